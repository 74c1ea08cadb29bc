"""Writes through the mount answered before they land (mxfs/fs/write_behind.py).

The queue itself, on trio with real worker threads: writes of one inode land in the
order they came, at most DEPTH are held (and at most BUDGET in the whole daemon, one
user's queued writes never holding another's answer back), drain waits for every one
queued before it and none after, a failure is raised once by the next write or report,
and a bug in a write is EIO, not the end of the daemon.  Then through a real mount:
what a write answered is what every reader sees at once (a second descriptor with
O_DIRECT, the direct path), a write that fails after its answer reaches the writer at
close, and a reader's close never waits for a writer writing on.
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import Mounted, eventually, ext4_image, make_members, mkfs, mount_with
from users import User, ensure_users, run_as

from mxfs.client.direct import open_reader
from mxfs.fs.fair import Lanes, RoundRobin
from mxfs.fs.write_behind import BUDGET, Run, WriteBehind


def run_queue(body) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            limiter = trio.CapacityLimiter(8)

            async def run(write: Callable[[], None]) -> None:
                await trio.to_thread.run_sync(write, limiter=limiter)
            await body(nursery, WriteBehind(depth=3), run)
    trio.run(main)


@pytest.mark.unit
def test_writes_land_in_arrival_order_and_drain_waits_for_all() -> None:
    landed: list[int] = []
    gates = [threading.Event() for _ in range(3)]

    def write(i: int) -> None:
        gates[i].wait(10)
        landed.append(i)

    async def body(nursery: trio.Nursery, q: WriteBehind, lim: Run) -> None:
        for i in range(3):
            await q.submit(nursery, lambda i=i: write(i), lim, 0)
        assert q.pending == 3
        gates[2].set()  # the newest may go first in a thread: it must still wait its turn
        gates[1].set()
        await trio.sleep(0.05)
        assert landed == []
        gates[0].set()
        await q.drain()
        assert landed == [0, 1, 2] and q.pending == 0

    run_queue(body)


@pytest.mark.unit
def test_drain_waits_for_the_writes_before_it_not_those_after() -> None:
    """A drain (a reader's read or close, a flush) waits for the writes queued when it
    was called, and their failures are counted by then; a write queued after it is not
    waited for (a writer writing on and on held every reader of the file)."""
    first, later = threading.Event(), threading.Event()

    def fails() -> None:
        first.wait(10)
        raise OSError(errno.ENOSPC, "full")

    async def body(nursery: trio.Nursery, q: WriteBehind, lim: Run) -> None:
        drained = trio.Event()
        await q.submit(nursery, fails, lim, 0)

        async def drain() -> None:
            await q.drain()
            drained.set()

        nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        await q.submit(nursery, lambda: later.wait(10) and None, lim, 0)  # (after it)
        first.set()
        try:
            with trio.move_on_after(10):  # (a bound, not a timing: it never ends before)
                await drained.wait()
            assert drained.is_set() and q.pending == 1, "the drain waited for a later write"
            err, seen = q.failure_since(0)
            assert err is not None and err.errno == errno.ENOSPC and seen == 1
        finally:
            later.set()
        await q.drain()
        assert q.pending == 0

    run_queue(body)


@pytest.mark.unit
def test_depth_bounds_the_writes_held() -> None:
    gate = threading.Event()
    started = []

    async def body(nursery: trio.Nursery, q: WriteBehind, lim: Run) -> None:
        for _ in range(3):
            await q.submit(nursery, gate.wait, lim, 0)

        async def fourth() -> None:
            await q.submit(nursery, lambda: None, lim, 0)
            started.append(True)

        nursery.start_soon(fourth)
        await trio.sleep(0.05)
        assert started == [] and q.pending == 3  # the writer waits: nothing more is held
        gate.set()
        await q.drain()
        await trio.sleep(0)
        assert started == [True]
        await q.drain()

    run_queue(body)


@pytest.mark.unit
def test_the_daemons_budget_bounds_what_all_queues_hold() -> None:
    gate = threading.Event()
    started = []

    async def body(nursery: trio.Nursery, q: WriteBehind, lim: Run) -> None:
        budget = RoundRobin(2)
        files = [WriteBehind(depth=3, budget=lambda: budget) for _ in range(3)]
        await files[0].submit(nursery, gate.wait, lim, 0)
        await files[1].submit(nursery, gate.wait, lim, 0)

        async def third() -> None:  # another file: its own queue is empty, the budget is not
            await files[2].submit(nursery, lambda: None, lim, 0)
            started.append(True)

        nursery.start_soon(third)
        await trio.sleep(0.05)
        assert started == [] and files[2].pending == 0
        gate.set()
        for f in files[:2]:
            await f.drain()
        await trio.sleep(0.05)
        assert started == [True]
        await files[2].drain()

    run_queue(body)


@pytest.mark.unit
def test_one_users_queued_writes_never_hold_back_anothers_answer() -> None:
    """alice queues writes to many files until the lane's budget makes her wait; bob's
    write is still answered: she held 3 in 4 of it, not all of it, and his did not wait
    for hers to land (first come first served, it waited for every one of them)."""
    alice, bob = 1001, 1002
    gate = trio.Event()  # no write lands until the end: all stay queued
    queued = {alice: 0, bob: 0}

    async def run(write: Callable[[], None]) -> None:
        await gate.wait()
        write()

    async def main() -> None:
        budget = Lanes(8, BUDGET).own.budget
        files: list[WriteBehind] = []

        async def writes(uid: int, n: int) -> None:
            for _ in range(n):
                files.append(WriteBehind(depth=1, budget=lambda: budget))
                await files[-1].submit(nursery, lambda: None, run, uid)
                queued[uid] += 1

        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(writes, alice, 2 * BUDGET)
                await trio.testing.wait_all_tasks_blocked()
                assert queued[alice] == BUDGET * 3 // 4  # her share, then she waits
                nursery.start_soon(writes, bob, 2)
                await trio.testing.wait_all_tasks_blocked()
                assert queued == {alice: BUDGET * 3 // 4, bob: 2}
            finally:
                gate.set()  # (the landings are shielded: they must end for the test to)
        assert queued == {alice: 2 * BUDGET, bob: 2}
        assert budget.busy() == 0 and budget.queued() == 0

    trio.run(main)


@pytest.mark.unit
def test_each_writer_hears_a_failure_once_and_a_bug_is_eio() -> None:
    """A failed write is counted, as the kernel's errseq keeps it: each handle hears of
    it once, past the count it last heard (or saw at open), and one handle hearing of
    it takes it from no other."""
    def full() -> None:
        raise OSError(errno.ENOSPC, "no space")

    def bug() -> None:
        raise KeyError("a bug")

    async def body(nursery: trio.Nursery, q: WriteBehind, lim: Run) -> None:
        await q.submit(nursery, full, lim, 0)
        await q.drain()
        err, mine = q.failure_since(0)
        assert err is not None and err.errno == errno.ENOSPC and mine == 1
        assert q.failure_since(mine) == (None, 1)  # (said once to this handle)
        err, theirs = q.failure_since(0)  # (another writer hears it all the same)
        assert err is not None and err.errno == errno.ENOSPC
        await q.submit(nursery, lambda: None, lim, 0)  # (the queue goes on)
        await q.submit(nursery, bug, lim, 0)
        await q.drain()
        err, mine = q.failure_since(mine)
        assert err is not None and err.errno == errno.EIO and mine == 2
        assert q.failure_since(mine) == (None, 2)

    run_queue(body)


def test_a_readers_close_takes_no_writers_failure(loop_pool: Mounted) -> None:
    """A write answered, then failing as it lands (its member full), was reported to
    the first close of the file, whoever's: a reader's close took it (a backup tool, a
    tail) and the writer's close said nothing of a megabyte of zeros.  Only a handle
    that writes hears of it, and each one that does."""
    mp, members = loop_pool.path, loop_pool.members
    folder = mp / "narrow"
    folder.mkdir()
    os.setxattr(folder, "user.mxfs.layout", b"stripe_width=1")
    for i in range(64):  # (a file of one member: member 2, not the metadata member)
        path = folder / f"f{i}"
        path.touch()
        if b"first_member=2" in os.getxattr(path, "user.mxfs.layout"):
            break
        path.unlink()
    else:
        raise AssertionError("no file placed on member 2")
    st = os.statvfs(members[2])
    junk = Path(members[2]) / "junk"
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize - (256 << 10)), junk],
                   check=True)
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"A" * (1 << 20))  # (answered; it fails as it lands)
            end = time.monotonic() + 2
            while time.monotonic() < end:  # (a reader's closes meanwhile: none raises)
                os.close(os.open(path, os.O_RDONLY))
                time.sleep(0.02)
        finally:
            with pytest.raises(OSError) as err:
                os.close(fd)
        assert err.value.errno == errno.ENOSPC
    finally:
        junk.unlink()


def test_every_reader_sees_what_a_write_answered_at_once(mounted: Mounted) -> None:
    path = mounted.path / "moving"
    size = 8 << 20
    buf = mmap.mmap(-1, size)  # aligned, for O_DIRECT
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for rnd in range(12):
            want = bytes([rnd]) * size
            for off in range(0, size, 1 << 20):  # 1 MiB requests, answered before they land
                os.pwrite(fd, want[off:off + (1 << 20)], off)
            direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # to the daemon, not the cache
            try:
                assert os.preadv(direct_fd, [buf], 0) == size and buf[:] == want
            finally:
                os.close(direct_fd)
            os.pwrite(fd, bytes([rnd + 100]) * size, 0)
            with open_reader(str(path)) as r:  # the direct path reads the chunk files
                got = bytearray(size)
                r.read_into(0, memoryview(got))
                assert got == bytes([rnd + 100]) * size
    finally:
        os.close(fd)


def test_a_write_that_fails_after_its_answer_is_reported_by_close(loop_pool: Mounted) -> None:
    mp, members = loop_pool.path, loop_pool.members
    free = os.statvfs(members[2]).f_bavail * os.statvfs(members[2]).f_frsize
    block = os.urandom(1 << 20)
    # Member 2 is not the metadata member: only landing the write finds it full.
    n = 4 * (free >> 20) + 16  # a quarter of the stripes go to member 2
    with pytest.raises(OSError) as err:
        fd = os.open(mp / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for _ in range(n):
                os.write(fd, block)
        finally:
            os.close(fd)  # no fsync: the failure must still reach the writer
    assert err.value.errno == errno.ENOSPC
    os.unlink(mp / "filler")
    assert eventually(lambda: os.statvfs(members[2]).f_bavail * 4096 >= free - (1 << 20))
    (mp / "after").write_bytes(block)
    assert (mp / "after").read_bytes() == block


_PEEKS = """
path = sys.argv[1]
done = 0
for _ in range(5):  # (a tail, a backup tool: open, read a little, close)
    with open(path, "rb", buffering=0) as f:
        f.read(4096)
    done += 1
print(json.dumps(done))
"""


def test_a_readers_close_never_waits_for_a_writer_writing_on(tmp_path: Path) -> None:
    """Root writes a file on and on, 1 MiB a write, on a member slower to write than the
    mount is to answer (ext4 mounted `sync`: the queue never empties); bob opens it,
    reads a little and closes it, five times, while root still writes.  A read or a
    close drained the file's queue until it was empty: bob waited for as long as root
    wrote."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    bob = ensure_users()["bob"]
    with ext4_image(tmp_path, "slow", 256, "sync") as slow:
        fast = make_members(tmp_path / "fast", 1)[0]  # (the metadata's member)
        mkfs([fast, slow])
        with mount_with([fast, slow]) as m:  # (write_behind: its default)
            folder = m.path / "logs"
            folder.mkdir()
            os.setxattr(folder, "user.mxfs.layout", b"stripe_width=1")
            path = next(p for p in (folder / f"{i}.log" for i in range(64))
                        if p.touch() or b"first_member=1" in os.getxattr(p, "user.mxfs.layout"))
            path.chmod(0o644)
            _peek_while_written(path, bob)


def _peek_while_written(path: Path, bob: User) -> None:
    block = os.urandom(1 << 20)
    stop = threading.Event()
    wrote = [0]

    def writer() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            end = time.monotonic() + 30  # (bounded: before the fix bob waits this long)
            while not stop.is_set() and time.monotonic() < end:
                os.pwrite(fd, block, (wrote[0] % 16) << 20)
                wrote[0] += 1
        finally:
            os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert eventually(lambda: wrote[0] >= 16), "root's writes never came"
        assert run_as(bob, _PEEKS, str(path)) == 5
        seen = wrote[0]
        assert thread.is_alive(), "bob's opens, reads and closes ended only once root stopped"
        assert eventually(lambda: wrote[0] > seen), "root's writes stopped"
    finally:
        stop.set()
        thread.join()


def test_write_behind_takes_a_whole_number(tmp_path: Path) -> None:
    from conftest import make_members, mkfs, mxfs, one_line_error
    members = make_members(tmp_path)
    mkfs(members)
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = mxfs("mount", "-o", "write_behind=lots", members[0], str(mp), check=False)
    assert res.returncode != 0 and "write_behind" in one_line_error(res)

"""Faults: a member fills up, the daemon is SIGKILLed mid-storm, files die while open."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CRASH,
    STORM,
    Mounted,
    check_pool,
    chunk_files,
    eventually,
    ext4_image,
    kill_daemon,
    make_members,
    mkfs,
    mounted_pool,
    mxfs,
    one_line_error,
)
from users import ensure_users, run_as

from mxfs.cli.measure import drop_caches
from mxfs.client import ControlClient
from mxfs.fs import block_counts
from mxfs.io.chunk_client import ChunkClient
from mxfs.kv import KVStore
from mxfs.pool.key import load_key
from mxfs.pool.pool import INODE_RESERVE, META_GROWTH_FLOOR, META_MEASURE_S
from mxfs.vol import volume
from mxfs.vol.volume import Volume

# ---- a member runs out of space ---------------------------------------------------

def test_a_create_holds_what_its_first_member_may_get_of_the_metadata_member(
        loop_pool: Mounted) -> None:
    """A direct create held an even share (its size over its width) of the metadata
    member's room, but a writer may put a whole stripe unit on the file's first
    member: in a folder of 1 GiB units, a file declared 1 GiB held a quarter and could
    be written whole on member 0, past the store's reserve.  It holds the most one
    member may get now: declared twice the room, it is refused at once; a quarter of it
    (its even share before, what passed) fits."""
    from mxfs.pool.pool import META_RESERVE

    mp, members = loop_pool.path, loop_pool.members
    (mp / "wide").mkdir()
    os.setxattr(mp / "wide", "user.mxfs.layout", b"stripe_unit=1073741824")
    st = os.statvfs(members[0])
    room = st.f_bavail * st.f_frsize - META_RESERVE
    with ControlClient(str(mp)) as c:
        with pytest.raises(OSError) as e:
            c.call_with_fds("create", path="/wide/big", size=2 * room)
        assert e.value.errno == errno.ENOSPC
        made, fds = c.call_with_fds("create", path="/wide/fits", size=room // 2)
        for fd in fds:
            os.close(fd)
        c.call("abort", ino=made["ino"])


def _fill_up(folder: Path) -> None:
    """Fill the filesystem that holds `folder` with a file beside the pool's (to ENOSPC)."""
    with open(folder / "not-the-pools", "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
                f.flush()


@pytest.mark.daemon_log(r"is full: released the metadata reserve")
def test_a_pool_whose_metadata_member_filled_up_while_unmounted_mounts(
        tmp_path: Path) -> None:
    """Member 0 filled up (by something else on its filesystem) while the pool was not
    mounted: the mount gives the store its reserve back and goes on, so that users can
    free space through it.  With no reserve to give, the mount and the offline tools are
    refused in one line that says the member is full, and the store stays as it is: a
    mount said the store was "unreadable (disk I/O error)" and, where a backup was
    found, would have put it in the store's place, losing every change made since."""
    with ext4_image(tmp_path, "m0", 64) as m0:
        members = [str(Path(m0) / "pool"), str(tmp_path / "m1")]
        for m in members:
            os.mkdir(m)
        mkfs(members)
        with mounted_pool(members) as m:
            (m.path / "kept").write_bytes(b"k" * 100_000)
            (m.path / "old").mkdir()
        os.truncate(Path(m0) / "pool" / "meta" / "daemon.lock", 0)  # (as older versions
        _fill_up(Path(m0))                                            # left it: no block)
        with mounted_pool(members) as m:
            assert (m.path / "kept").read_bytes() == b"k" * 100_000
            os.unlink(m.path / "kept")  # (a change that gives space back commits)
        os.unlink(Path(m0) / "not-the-pools")
        with mounted_pool(members) as m:
            assert sorted(os.listdir(m.path)) == ["old"]
            (m.path / "new").mkdir()
        os.unlink(Path(m0) / "pool" / "meta" / "reserve")  # (none to give back)
        _fill_up(Path(m0))
        store = Path(m0) / "pool" / "meta" / "mxfs.db"
        before = store.read_bytes()
        (tmp_path / "mnt").mkdir()
        res = mxfs("mount", members[0], str(tmp_path / "mnt"), check=False)
        line = one_line_error(res)
        assert res.returncode != 0 and "is full" in line and "free space" in line, line
        (tmp_path / "f").write_bytes(b"f")
        res = mxfs("put", members[0], str(tmp_path / "f"), check=False)  # (a tool, offline)
        line = one_line_error(res)
        assert res.returncode != 0 and "is full" in line and "free space" in line, line
        assert store.read_bytes() == before
        assert not [p for p in store.parent.iterdir() if ".replaced-" in p.name]
        os.unlink(Path(m0) / "not-the-pools")
        with mounted_pool(members) as m:
            assert sorted(os.listdir(m.path)) == ["new", "old"]


def test_full_member_gives_enospc_and_harms_nothing(loop_pool: Mounted) -> None:
    mp, loop_members = loop_pool.path, loop_pool.members
    keeper = os.urandom(4 << 20)
    (mp / "keeper").write_bytes(keeper)
    free_before = os.statvfs(loop_members[2]).f_bavail
    block = os.urandom(1 << 20)
    with pytest.raises(OSError) as err, open(mp / "filler", "wb") as f:
        for _ in range(400):  # far more than the pool holds
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    assert err.value.errno == errno.ENOSPC
    assert os.statvfs(loop_members[2]).f_bavail * 4096 < 1 << 20
    # nothing else was harmed, and the namespace still works
    assert (mp / "keeper").read_bytes() == keeper
    (mp / "dir").mkdir()
    (mp / "dir" / "note").write_text("still here")
    # deleting gives the space back
    os.unlink(mp / "filler")
    assert eventually(lambda: os.statvfs(loop_members[2]).f_bavail >= free_before - 64)
    (mp / "again").write_bytes(block * 8)
    assert (mp / "again").read_bytes() == block * 8
    loop_pool.umount()
    check_pool(loop_members)


def test_files_stop_short_of_a_members_last_inodes(tmp_path: Path) -> None:
    """Members with few inodes, filled with one-byte files until creates are refused
    (ENOSPC): each member keeps its reserve of inodes for the daemon's own files, and
    existing files still take writes and a chmod."""
    with contextlib.ExitStack() as stack:
        members = [stack.enter_context(ext4_image(tmp_path, f"m{i}", 48, inodes=1600))
                   for i in range(2)]
        mkfs(members)
        with mounted_pool(members) as m:
            (m.path / "keeper").write_bytes(b"k")
            refused = 0
            for i in range(2 * 1600):
                try:
                    (m.path / f"f{i}").write_bytes(b"x")
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    refused += 1
                    if refused > 50:
                        break
            assert refused > 50
            for member in members:
                assert os.statvfs(member).f_favail >= INODE_RESERVE - 64
            with open(m.path / "keeper", "ab") as f:
                f.write(b" and more")
            os.chmod(m.path / "keeper", 0o600)
            assert (m.path / "keeper").read_bytes() == b"k and more"


# ---- SIGKILL during a storm of writes -----------------------------------------------


@pytest.mark.also_postgres
@pytest.mark.daemon_log(CRASH)
def test_sigkill_during_write_storm_loses_nothing_synced(mounted: Mounted) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", STORM, str(mounted.path), str(w)],
                              stdout=subprocess.PIPE, text=True) for w in range(4)]
    time.sleep(3)
    kill_daemon(mounted)
    synced: dict[str, str] = {}
    for p in procs:
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        for line in out.splitlines():
            parts = line.split()
            if parts[0] == "synced":
                synced[parts[1]] = parts[2]
            elif parts[0] == "gone":
                synced.pop(parts[1], None)
    assert len(synced) > 10, "the storm wrote too little to test anything"
    mounted.remount()
    for name, digest in synced.items():
        assert hashlib.sha256((mounted.path / name).read_bytes()).hexdigest() == digest, name
    mounted.umount()
    check_pool(mounted.members)


@pytest.mark.also_postgres
@pytest.mark.daemon_log(CRASH)
def test_file_deleted_while_open_is_reclaimed_after_a_crash(mounted: Mounted) -> None:
    p = mounted.path / "victim"
    p.write_bytes(os.urandom(1 << 20))
    before = len(chunk_files(mounted.members))
    f = open(p, "rb")  # noqa: SIM115 - held open across the crash on purpose
    os.unlink(p)
    dfd = os.open(mounted.path, os.O_RDONLY)
    os.fsync(dfd)  # the unlink is durable; only the open handle keeps the data
    os.close(dfd)
    assert len(chunk_files(mounted.members)) == before  # kept while open
    kill_daemon(mounted)
    try:
        f.close()
    except OSError:
        pass  # ENOTCONN: its daemon is gone
    mounted.remount()  # (orphans are freed while it serves)
    assert eventually(lambda: len(chunk_files(mounted.members)) == before - 4)
    mounted.umount()
    check_pool(mounted.members)


def leave_orphans(m: Mounted, n: int) -> None:
    """`n` files of a byte each removed while held open, then the daemon SIGKILLed: `n`
    orphans whose chunk files only the next mount frees (as a dropped KV namespace's
    chunks are, killed mid-drain)."""
    held = []
    for i in range(n):
        p = m.path / f"o{i}"
        p.write_bytes(b"x")
        held.append(open(p, "rb"))  # noqa: SIM115 - held open across the crash on purpose
        os.unlink(p)
    dfd = os.open(m.path, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    kill_daemon(m)
    for f in held:
        with contextlib.suppress(OSError):  # ENOTCONN: its daemon is gone
            f.close()


@pytest.mark.daemon_log(CRASH)
def test_thousands_of_orphans_a_crash_left_are_freed_in_bites(mounted: Mounted) -> None:
    """Orphans a killed daemon left were freed at mount one sync each (~3 ms: an hour
    for a dropped KV namespace of a million chunks, past systemd's start timeout, so
    the node never came up).  The daemon now serves first and frees them in its
    rounds; the mount's recovery, for tools, frees them a bite a sync.  Either way all
    go, their chunk files with them, and fsck finds the pool clean."""
    n = 600  # (past a daemon round's bite of 512: two of them)
    before = len(chunk_files(mounted.members))
    leave_orphans(mounted, n)
    assert len(chunk_files(mounted.members)) == before + n
    mounted.remount()
    assert eventually(lambda: len(chunk_files(mounted.members)) == before, 60)
    assert os.listdir(mounted.path) == []
    leave_orphans(mounted, n)
    vol = Volume.open(mounted.members[0], hold="test")
    syncs = []
    engine_sync = vol.store.engine.sync
    vol.store.engine.sync = lambda: (syncs.append(1), engine_sync())[1]  # type: ignore
    try:
        vol.recover()
        assert not vol.store.orphans() and len(chunk_files(mounted.members)) == before
        assert len(syncs) <= 4  # (a bite of PENDING_BITE orphans a sync)
    finally:
        vol.close()
    assert mxfs("fsck", mounted.members[0]).stdout.strip() == "clean"
    mounted.remount()
    mounted.umount()
    check_pool(mounted.members)


@pytest.mark.daemon_log(CRASH)
def test_a_stop_leaves_orphans_past_its_bound_to_the_next_mount(
        mounted: Mounted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop freed every queued orphan first (a million: past systemd's stop timeout,
    SIGKILLed, never marked clean), and a failed start the same, holding the pool's
    lock.  A failed start frees none and a clean stop only for CLOSE_DRAIN_S; those left
    stay orphan rows, the store is still marked clean, and the next mount frees them."""
    n = 20
    before = len(chunk_files(mounted.members))
    leave_orphans(mounted, n)

    def reopen() -> Volume:
        vol = Volume.open(mounted.members[0], recover_meta=True)  # (as a mount: checked)
        vol.recover(drain=False)  # (as the daemon does: queued, freed while serving)
        return vol

    reopen().close(clean=False)  # (a failed start: the port taken, FUSE init)
    vol = reopen()
    assert len(vol.store.orphans()) == n
    monkeypatch.setattr(volume, "CLOSE_DRAIN_S", 0.0)
    vol.close()
    vol = Volume.open(mounted.members[0], hold="test")
    try:
        assert len(vol.store.orphans()) == n and vol.store.setting("clean") == "1"
    finally:
        vol.close()
    assert len(chunk_files(mounted.members)) == before + n
    monkeypatch.undo()
    reopen().close()  # (a clean stop with a few left frees them)
    assert len(chunk_files(mounted.members)) == before
    mounted.remount()
    mounted.umount()
    check_pool(mounted.members)


@pytest.mark.daemon_log(CRASH)
def test_a_crashs_orphans_count_against_their_owner_until_freed(mounted: Mounted) -> None:
    """A crash's orphans, queued at mount and freed while the daemon serves (minutes,
    for a million), were credited to their owners as a removal freed within a round
    is: a user at her quota could write their size again while the pool still held
    them.  They now count against her until freed."""
    alice = ensure_users()["alice"]
    mxfs("quota", str(mounted.path), "--user", alice.name, "--bytes", "1MiB")
    d = mounted.path / "alice"
    d.mkdir()
    os.chown(d, alice.uid, alice.gid)
    p = d / "big"
    p.write_bytes(os.urandom(768 << 10))
    os.chown(p, alice.uid, alice.gid)
    f = open(p, "rb")  # noqa: SIM115 - held open across the crash on purpose
    os.unlink(p)
    dfd = os.open(d, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    kill_daemon(mounted)
    with contextlib.suppress(OSError):  # ENOTCONN: its daemon is gone
        f.close()
    vol = Volume.open(mounted.members[0], hold="test")
    try:
        vol.recover(drain=False)  # (as the daemon does: queued, freed while serving)
        assert vol.pending_reclaim
        with pytest.raises(OSError) as e:  # (what her next write of 512 KiB asks)
            vol.quotas.room(alice.uid, 512 << 10)
        assert e.value.errno == errno.EDQUOT
        vol.reclaim_pending()
        vol.quotas.room(alice.uid, 512 << 10)  # (freed: it fits)
    finally:
        vol.close()
    mounted.remount()
    mounted.umount()
    check_pool(mounted.members)


@pytest.mark.daemon_log(CRASH)
def test_unsynced_tail_is_trimmed_after_a_crash(mounted: Mounted) -> None:
    p = mounted.path / "f"
    synced = os.urandom(300_000)
    with open(p, "wb") as f:
        f.write(synced)
        f.flush()
        os.fsync(f.fileno())
        f.write(os.urandom(500_000))  # never synced
        f.flush()
        kill_daemon(mounted)
        try:
            f.close()
        except OSError:
            pass
    mounted.remount()
    data = p.read_bytes()
    # what was synced is there; whatever came after is either there or gone, and
    # growing the file shows zeros, never stale bytes from the lost tail
    assert data[:len(synced)] == synced
    os.truncate(p, len(data) + 200_000)
    assert p.read_bytes()[len(data):] == bytes(200_000)
    mounted.umount()
    check_pool(mounted.members)


# ---- a member vanishes ----------------------------------------------------------------

def _spread_and_local(mp: Path) -> tuple[Path, Path]:
    """A file striped over every member, and a small one on member 0 only."""
    (mp / "wide").write_bytes(os.urandom(4 << 20))
    for i in range(64):  # small files land on the member their inode number picks
        p = mp / f"small{i}"
        p.write_bytes(b"s" * 1000)
        if os.stat(p).st_ino % 4 == 0:
            return mp / "wide", p
    raise AssertionError("no small file landed on member 0")


STAT_BY_SOCKET = r"""
import socket
from mxfs.proto import recv_message, send_message
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
send_message(s, {"op": "stat", "id": 1})
print(json.dumps(recv_message(s)[0]))
"""


@pytest.mark.daemon_log(r"member 2 \(.*\) failed: its superblock",
                        r"mounted read-only and degraded")
def test_a_vanished_member_fails_its_files_and_mount_needs_degraded(
        loop_pool: Mounted) -> None:
    mp, loop_members = loop_pool.path, loop_pool.members
    loop_pool.umount()
    loop_pool.remount()  # with allow_other: other users may ask the daemon
    wide, local = _spread_and_local(mp)
    subprocess.run(["umount", "-l", loop_members[2]], check=True)  # member 2 vanishes
    loop_pool.check = False  # (the pool is broken on purpose: no soundness check after)
    mxfs("status", str(mp), check=False)
    drop_caches()  # so the read reaches the daemon, not the kernel's cache
    with pytest.raises(OSError) as err:
        wide.read_bytes()
    assert err.value.errno == errno.EIO
    assert local.read_bytes() == b"s" * 1000  # files elsewhere still read
    res = mxfs("status", "--json", str(mp), check=False)
    assert res.returncode == 1  # degraded: monitors and scripts see it in the exit code
    status = json.loads(res.stdout)
    assert status["degraded"] and "/wide" in status["lost_examples"]
    # Other users learn that files are lost, not their names (folders may be private).
    theirs = run_as(None, STAT_BY_SOCKET, status["socket"])
    assert theirs["lost_files"] == status["lost_files"] and theirs["lost_examples"] == []
    assert [m["index"] for m in status["members"] if m.get("failed")] == [2]
    text = mxfs("status", str(mp), check=False).stdout
    assert "FAILED" in text and "DEGRADED" in text and "/wide" in text
    mxfs("umount", str(mp))
    line = one_line_error(mxfs("mount", loop_members[0], str(mp), check=False))
    assert "member 2" in line and "-o degraded" in line
    res = mxfs("mount", "-o", "degraded", loop_members[0], str(mp))
    assert "read-only and degraded" in res.stderr
    assert local.read_bytes() == b"s" * 1000
    with pytest.raises(OSError) as err:
        wide.read_bytes()
    assert err.value.errno == errno.EIO
    with pytest.raises(OSError) as err:
        (mp / "new").write_bytes(b"x")
    assert err.value.errno == errno.EROFS


@contextlib.contextmanager
def _member_on_a_mount(tmp_path: Path, *options: str
                       ) -> Iterator[tuple[Mounted, Mounted, list[str]]]:
    """A pool (`outer`) whose second member is a folder of another mxfs mount
    (`inner`), whose daemon a test may stop: a member that stops answering."""
    inner_members = make_members(tmp_path / "inner", 1)
    mkfs(inner_members)
    with mounted_pool(inner_members) as inner:
        hung = inner.path / "member1"
        hung.mkdir()
        members = [*make_members(tmp_path / "outer", 1), str(hung)]
        mkfs(members)
        with mounted_pool(members, *options) as outer:
            yield inner, outer, members


def test_a_member_that_stops_answering_holds_up_no_one(tmp_path: Path) -> None:
    """A member whose filesystem stops answering (a hung drive or target; here a FUSE
    mount whose daemon is stopped) leaves stat, `ls -l`, df and status answering, the
    member left out: stats of its chunk files and of its space, a direct reader's
    opens and creates, small KV puts' writes, KV gets' opens and small reads, and the
    chunk service's opens for other nodes run off the loop (before, the first
    stat, open or write held the daemon's thread, and every user's request, until it
    came back); an open of a file there waits for it, or is EIO once the member is
    judged hung."""
    with _member_on_a_mount(tmp_path, "chunk_port=0") as (inner, outer, members):
        names = [outer.path / f"f{i}" for i in range(4)]  # (on both members in turn)
        for p in names:
            p.write_bytes(b"x" * 4096)
        with ControlClient(str(outer.path)) as c:
            st, lays = c.stat(), [c.layout(str(p)) for p in names]
        svc = st["chunk_service"]
        on_hung = next(lay for lay in lays if lay["layout"]["first_member"] == 1)
        answered: dict[str, Any] = {}
        with KVStore(str(outer.path), "stored") as kv:  # (small ones ride inline)
            for i in range(4):
                kv.put(f"small{i}", bytes([i]) * 4096)
                kv.put(f"large{i}", bytes([i]) * (64 << 10))

        def ask() -> None:
            answered["sizes"] = [os.stat(p).st_size for p in names]
            answered["got"] = get_all()  # (a place on each member, or EIO: no wait)
            answered["ls"] = subprocess.run(["ls", "-ls", str(outer.path)],
                                            capture_output=True, text=True).stdout
            answered["df"] = os.statvfs(outer.path).f_blocks
            answered["status"] = json.loads(
                mxfs("status", "--json", str(outer.path), check=False).stdout)

        opened: dict[str, Any] = {}

        def open_read(p: Path) -> None:  # (one on the stopped member waits for it)
            try:
                with ControlClient(str(outer.path)) as c:
                    _, fds = c.call_with_fds("open_read", path=c.pool_path(str(p)))
                for fd in fds:
                    os.close(fd)
                opened[p.name] = "ok"
            except OSError as e:
                opened[p.name] = e.errno

        def create(name: str = "create") -> None:  # (on both members: one waits)
            try:
                with ControlClient(str(outer.path)) as c:
                    made, fds = c.call_with_fds("create", path="/" + name, size=4096)
                    for fd in fds:
                        os.close(fd)
                    c.call("abort", ino=made["ino"])
                opened[name] = "ok"
            except OSError as e:
                opened[name] = e.errno

        def put() -> None:  # (spares on both members in turn: some wait)
            with KVStore(str(outer.path), "hung") as kv:
                for i in range(8):
                    try:
                        kv.put(f"k{i}", bytes([i]) * 4096)
                        opened[f"k{i}"] = "ok"
                    except OSError as e:
                        opened[f"k{i}"] = e.errno

        def get_all() -> str:
            with KVStore(str(outer.path), "stored") as kv:
                try:
                    return "ok" if all(kv.batch_get([f"small{i}" for i in range(4)])) \
                        else "miss"
                except OSError as e:
                    return errno.errorcode[e.errno or 0]

        def get() -> None:  # (their files opened, the small ones read, on both)
            with KVStore(str(outer.path), "stored") as kv:
                for size in ("small", "large"):
                    try:
                        got = kv.batch_get([f"{size}{i}" for i in range(4)])
                        opened[size] = "ok" if all(got) else "miss"
                    except OSError as e:
                        opened[size] = e.errno

        def chunk_read() -> None:  # (another node's READ of a stripe there)
            try:
                with ChunkClient(svc["addr"], int(svc["port"]), load_key(members[0]),
                                 st["pool_uuid"]) as chunks:
                    chunks.read(on_hung["ino"], 1, 0, 4096)
                opened["chunk"] = "ok"
            except OSError as e:
                opened["chunk"] = e.errno

        pid = inner.daemon_pid()
        os.kill(pid, signal.SIGSTOP)
        try:  # (the kernel forgets the member's names: each stat must ask its daemon)
            Path("/proc/sys/vm/drop_caches").write_text("2")
            openers = [threading.Thread(target=open_read, args=(p,), daemon=True)
                       for p in names]
            # (gets into the stopped member, more than the daemon has member-call
            # threads: they took them all, and every user's gets waited behind it)
            openers += [threading.Thread(target=get_all, daemon=True) for _ in range(24)]
            openers += [threading.Thread(target=create, daemon=True),
                        threading.Thread(target=put, daemon=True),
                        threading.Thread(target=get, daemon=True),
                        threading.Thread(target=chunk_read, daemon=True)]
            for t in openers:
                t.start()
            asking = threading.Thread(target=ask, daemon=True)
            asking.start()
            asking.join(120)
            held_up = asking.is_alive()
            if not held_up:  # (else it would wait for the daemon too, and never fail)
                create("late")  # (left out now: EIO at once, the member not failed)
        finally:
            os.kill(pid, signal.SIGCONT)
        asking.join(120)
        for t in openers:
            t.join(120)
        assert not held_up, "a request waited on the stopped member"
        assert opened["late"] == errno.EIO
        assert set(opened.values()) <= {"ok", "miss", errno.EIO}  # (a get: either)
        assert "ok" in opened.values()
        assert answered["sizes"] == [4096] * 4 and answered["got"] in ("miss", "EIO")
        assert all(p.name in answered["ls"] for p in names) and answered["df"] > 0
        states = {m["index"]: m.get("failed") for m in answered["status"]["members"]}
        assert states == {0: None, 1: "not answering"}
        after = json.loads(mxfs("status", "--json", str(outer.path)).stdout)
        assert not any(m.get("failed") for m in after["members"])  # back once it is


def _held_up(pid: int, meanwhile: Callable[[], None], ask: Callable[[], None]) -> bool:
    """With the daemon `pid` (a member's) stopped, do `meanwhile` and then `ask`:
    whether `ask` still waited after 60 s (it ends once the member answers again)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        meanwhile()
        time.sleep(0.5)  # (what it set going reaches the daemon: a release, a write)
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(60)
        held = asking.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    asking.join(60)
    return held


def test_closing_a_file_on_a_member_that_stops_answering_holds_up_no_one(
        tmp_path: Path) -> None:
    """The last close of a file with a chunk file on a member that stops answering
    (a FUSE or NFS member flushes on close(2), and waits for its server) leaves the
    daemon answering: its descriptors are closed off the loop, each member's in turn.
    Closed on the loop, one user's close of such a file held every user's requests
    until the member came back."""
    with _member_on_a_mount(tmp_path) as (inner, outer, _):
        held = []
        for i in range(2):  # (f1 is on the member that stops)
            fd = os.open(outer.path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"x" * 4096)
            os.fsync(fd)  # (the daemon holds both chunk files open now)
            held.append(fd)
        answered: dict[str, Any] = {}

        def close() -> None:  # (the daemon closes the chunk files on its release)
            for fd in held:
                os.close(fd)

        def closing() -> int:
            with ControlClient(str(outer.path)) as c:
                return int(c.stat()["closing"])

        def ask() -> None:
            answered["df"] = os.statvfs(outer.path).f_blocks
            (outer.path / "after").write_bytes(b"y" * 4096)  # (on member 0)
            answered["after"] = (outer.path / "after").read_bytes()
            answered["names"] = sorted(os.listdir(outer.path))
            # (its descriptor of f1's chunk file waits for the member: status says so)
            answered["closing"] = eventually(lambda: closing() >= 1, 10)

        assert not _held_up(inner.daemon_pid(), close, ask), \
            "a close on the stopped member held the daemon"
        assert answered["df"] > 0 and answered["after"] == b"y" * 4096
        assert answered["names"] == ["after", "f0", "f1"]
        assert answered["closing"], "status showed no descriptor closing"
        assert eventually(lambda: closing() == 0, 30)  # (closed once it answers)
        assert (outer.path / "f1").read_bytes() == b"x" * 4096


def test_a_closed_files_blocks_are_answered_without_asking_its_members(
        tmp_path: Path) -> None:
    """A file counted (its chunk files' st_blocks) while it was open nowhere is not
    counted again until it changes: its lookup after the kernel forgot it asks no
    member, and answers its true blocks while a member it is on has stopped
    answering.  Counted at every lookup, the stat waited for that member's call and
    then answered the size's blocks: this sparse file's 64 MiB."""
    with _member_on_a_mount(tmp_path) as (inner, outer, _):
        sparse = outer.path / "sparse"  # (striped over both members, the hung one too)
        with open(sparse, "wb") as f:
            f.truncate(64 << 20)
            f.write(b"x" * 4096)
        with ControlClient(str(outer.path)) as c:
            assert eventually(lambda: c.stat()["open_files"] == 0, 10)  # (released)
        time.sleep(block_counts.SETTLE_S + 0.2)  # (its descriptors closed, settled)
        drop_caches()  # (the kernel forgets it: the stat below is a lookup, counted)
        assert 0 < os.stat(sparse).st_blocks * 512 <= 1 << 20
        time.sleep(block_counts.KEEP_S + 0.2)  # (past what a count of an open file keeps)
        answered: dict[str, int] = {}
        pid = inner.daemon_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            Path("/proc/sys/vm/drop_caches").write_text("2")  # (forgotten again)
            asking = threading.Thread(
                target=lambda: answered.update(blocks=os.stat(sparse).st_blocks),
                daemon=True)
            asking.start()
            asking.join(60)
        finally:
            os.kill(pid, signal.SIGCONT)
        asking.join(60)
        assert 0 < answered["blocks"] * 512 <= 1 << 20, \
            f"{answered['blocks']} blocks: counted again, without the stopped member"
        sparse.write_bytes(b"y" * (8 << 20))  # (changed: counted afresh)
        assert eventually(lambda: os.stat(sparse).st_blocks * 512 >= 8 << 20)


def test_writes_to_a_first_member_that_stops_answering_hold_up_no_one(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A pool whose metadata is on a server, its first member on a filesystem that stops
    answering: a write there waits for it, and the daemon answers everyone meanwhile.
    The reserve the metadata store keeps on the first member was measured (statvfs) on
    the daemon's thread for each write there, the store on a server or not: one
    write held every user's requests until the member came back."""
    inner_members = make_members(tmp_path / "inner", 1)
    mkfs(inner_members)
    with mounted_pool(inner_members) as inner:
        hung = inner.path / "member0"
        hung.mkdir()
        members = [str(hung), *make_members(tmp_path / "outer", 1)]
        mkfs(members, "64KiB", "--meta", pg_cluster.database())
        with mounted_pool(members, check=False) as outer:
            (outer.path / "w").mkdir()
            mxfs("setstripe", "--width", "1", str(outer.path / "w"))
            names = [outer.path / "w" / f"f{i}" for i in range(4)]  # (on both in turn)
            for p in names:
                p.write_bytes(b"x" * 4096)
            on_hung = [p for p in names if _first_member(outer, p) == 0]
            assert on_hung, "no file on the first member"
            answered: dict[str, Any] = {}

            def write() -> None:
                with contextlib.suppress(OSError), open(on_hung[0], "r+b") as f:
                    f.write(b"y" * 4096)

            def ask() -> None:
                answered["df"] = os.statvfs(outer.path).f_blocks
                answered["names"] = sorted(os.listdir(outer.path / "w"))

            writing = threading.Thread(target=write, daemon=True)
            assert not _held_up(inner.daemon_pid(), writing.start, ask), \
                "a write to the stopped member held the daemon"
            writing.join(60)
            assert answered["names"] == [p.name for p in names]


def _first_member(m: Mounted, path: Path) -> int:
    with ControlClient(str(m.path)) as c:
        return int(c.layout(str(path))["layout"]["first_member"])


def test_freeing_files_on_a_member_that_stops_answering_holds_no_commit(
        tmp_path: Path) -> None:
    """Files removed whose chunk files are on a member that stops answering: freeing
    them waits on that member, and the daemon's groups of changes are committed
    meanwhile (a folder made after them is in the store).  The frees ran inside the
    loop that ends each group, so a round of them held every user's commits: a user's
    mass removal of files striped wide a quarter of a second a round, a hung member
    for good."""
    with _member_on_a_mount(tmp_path) as (inner, outer, members):
        names = [outer.path / f"f{i}" for i in range(4)]  # (on both members in turn)
        for p in names:
            with open(p, "wb") as f:
                f.write(b"x" * 4096)
                os.fsync(f.fileno())  # (landed: an unlink waits for writes in flight)
        db = sqlite3.connect(f"file:{members[0]}/meta/mxfs.db?mode=ro", uri=True)

        def stored(name: bytes) -> bool:
            return db.execute("SELECT 1 FROM dentries WHERE name = ?",
                              (name,)).fetchone() is not None

        pid = inner.daemon_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            Path("/proc/sys/vm/drop_caches").write_text("2")
            removing = threading.Thread(target=lambda: [p.unlink() for p in names],
                                        daemon=True)
            removing.start()
            removing.join(60)
            assert not removing.is_alive(), "an unlink waited on the stopped member"
            time.sleep(0.5)  # (their frees begun, and waiting on the member)
            (outer.path / "after").mkdir()
            assert eventually(lambda: stored(b"after"), 30), \
                "no commit while frees waited on the stopped member"
        finally:
            os.kill(pid, signal.SIGCONT)
            db.close()
        assert eventually(lambda: not chunk_files(members[:1]), 30)


def test_a_member_made_read_only_refuses_writes_but_serves_reads(
        loop_pool: Mounted) -> None:
    mp, loop_members = loop_pool.path, loop_pool.members
    wide, local = _spread_and_local(mp)
    data = wide.read_bytes()
    # (the kernel sends the daemon each close's release after close() returns: until
    # it lands, the daemon holds that file's chunk files open for writing, and the
    # member's remount read-only is refused, busy)
    assert eventually(lambda: subprocess.run(["mount", "-o", "remount,ro", loop_members[2]],
                                             capture_output=True).returncode == 0, 10)
    drop_caches()
    assert wide.read_bytes() == data  # reads go on
    with pytest.raises(OSError) as err, open(wide, "r+b") as f:
        f.write(b"x" * (4 << 20))
        f.flush()
        os.fsync(f.fileno())
    assert err.value.errno == errno.EROFS
    local.write_bytes(b"still writable")  # on member 0 only
    status = json.loads(mxfs("status", "--json", str(mp)).stdout)
    assert not status["degraded"]  # read-only is not failed
    subprocess.run(["mount", "-o", "remount,rw", loop_members[2]], check=True)
    (mp / "after").write_bytes(os.urandom(4 << 20))
    assert local.read_bytes() == b"still writable"
    loop_pool.umount()
    check_pool(loop_members)


# ---- a power cut between a commit and what follows it ------------------------------

def test_chunk_bytes_go_only_after_their_change_is_on_stable_storage(tmp_path: Path) -> None:
    """A commit may sit in the page cache (SQLite's WAL before sync) while the removal
    of chunk files or their cut is already on disk: after a power cut the name would be
    back and its bytes gone.  So reclaim and a shrinking truncate sync the store first."""
    from conftest import make_members, mkfs

    from mxfs.meta.inode import ROOT_INO

    members = make_members(tmp_path)
    mkfs(members)
    vol = Volume.open(members[0], hold="test")
    events: list[str] = []
    engine_sync, remove, cut = vol.store.engine.sync, vol.pool.remove_chunks, \
        vol.pool.truncate_chunks
    vol.store.engine.sync = lambda: (events.append("sync"), engine_sync())[1]  # type: ignore
    vol.pool.remove_chunks = lambda *a: (events.append("remove"), remove(*a))[1]  # type: ignore
    vol.pool.truncate_chunks = lambda *a, **k: (events.append("cut"), cut(*a, **k))[1]  # type: ignore
    try:
        vol.store.group_changes(3600)
        root = vol.store.get(ROOT_INO)
        node = vol.store.create(ROOT_INO, b"f", 0o100644, 0, 0, layout_for=vol.pick_layout)
        entry = vol.acquire(node)
        vol.note_write(entry)
        assert entry.chunks is not None
        entry.chunks.write(0, memoryview(os.urandom(1 << 20)))
        vol.store.touch(node, size=1 << 20)
        events.clear()
        assert vol.resize(node, 4096)  # (the daemon cuts from a worker thread: `cut`)
        vol.cut(node.ino, vol.layout(node), 4096)
        vol.truncated(node)
        assert events == ["sync", "cut"]
        vol.release(node.ino)
        vol.unlinked(vol.store.unlink(ROOT_INO, b"f"))
        events.clear()
        vol.reclaim_pending()
        assert events[:1] == ["sync"] and "remove" in events
        assert not chunk_files(members) and root.nlink == 2
    finally:
        vol.close()



def test_writes_answered_before_they_land_keep_the_metadata_members_reserve(
        loop_members: list[str]) -> None:
    """A write answered before it lands was measured against the metadata member's
    free space as it was, not counting those admitted before it and not yet landed:
    hundreds at once (a FUSE task each) passed the same measure and ate the reserve
    the store commits in.  Admitted writes count until they land now: with 6 MiB
    free past the reserve, the seventh 1 MiB write not yet landed is refused, and
    landing them lets more in."""
    from mxfs.io.layout import Layout
    from mxfs.pool.chunks import ChunkFiles
    from mxfs.pool.pool import META_RESERVE
    from mxfs.vol.volume import Volume

    mkfs(loop_members)
    vol = Volume.open(loop_members[0])
    meta = loop_members[vol.pool.meta_member]
    ballast = Path(meta) / "ballast"  # (another user of the disk)
    try:
        st = os.statvfs(meta)
        with open(ballast, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - META_RESERVE
                               - (6 << 20) - (512 << 10))
        chunks = ChunkFiles(vol.pool, 1 << 40, Layout(1 << 20, 1, vol.pool.meta_member,
                                                      len(loop_members)))
        admitted = []
        with pytest.raises(OSError) as e:
            for i in range(64):
                admitted.append((i << 20, chunks.admit(i << 20, 1 << 20)))
        assert e.value.errno == errno.ENOSPC and len(admitted) == 6, len(admitted)
        block = memoryview(os.urandom(1 << 20))
        for offset, pieces in admitted[:3]:
            chunks.write(offset, block, pieces)  # (landed: the space is the file's now)
        for _, pieces in admitted[3:]:
            chunks.unadmit(pieces)  # (never to land)
        again = [chunks.admit(i << 20, 1 << 20) for i in range(3, 6)]
        with pytest.raises(OSError):
            chunks.admit(6 << 20, 1 << 20)
        for pieces in again:
            chunks.unadmit(pieces)
        chunks.close()
    finally:
        ballast.unlink(missing_ok=True)
        vol.store.close()


def test_declared_sizes_of_unpublished_files_hold_the_metadata_members_room(
        loop_pool: Mounted) -> None:
    """A direct create's declared share of the metadata member was measured against
    its free space and not held: two files declared as large as its room each passed,
    and writing them took its reserve.  The share is held until the file is committed
    or dropped now: the second is refused (ENOSPC), and an abort gives the room back."""
    from mxfs.pool.pool import META_RESERVE

    mp, meta = loop_pool.path, loop_pool.members[0]
    ballast = Path(meta) / "ballast"  # (another user of the disk)
    st = os.statvfs(meta)
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - META_RESERVE
                           - (8 << 20))
    declared = 4 * (6 << 20)  # (6 MiB a member of the four)
    try:
        with ControlClient(str(mp)) as c:
            def create(name: str) -> int:
                made, fds = c.call_with_fds("create", path="/" + name, size=declared)
                for fd in fds:
                    os.close(fd)
                return int(made["ino"])
            first = create("first")
            with pytest.raises(OSError) as e:
                create("second")
            assert e.value.errno == errno.ENOSPC
            c.call("abort", ino=first)
            c.call("abort", ino=create("third"))  # (the first's room given back)
    finally:
        ballast.unlink(missing_ok=True)


SEALS_PAST_THE_FLOOR = r"""
import base64, time
from mxfs.client import ControlClient
mp, size, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with ControlClient(mp) as c:
    def create(name):
        for _ in range(64):  # (off the metadata member: check_space never sees its bytes)
            made, fds = c.call_with_fds("create", path="/narrow/" + name, size=size)
            for fd in fds:
                os.close(fd)
            if made["layout"]["first_member"] != 0:
                return made["ino"]
            c.call("abort", ino=made["ino"])
        raise AssertionError("no file placed off member 0")
    def commit(ino):  # (sum_unit 4096: 8 bytes of sums a 4 KiB block)
        sums = base64.b64encode(bytes(8 * (size // 4096))).decode()
        return c.call("commit", ino=ino, size=size, sum_unit=4096, sums=sums)
    made = [create(f"f{i}") for i in range(files)]
    ready = os.path.join(mp, "narrow", "ready")
    open(ready, "w").close()
    while os.path.exists(ready):  # (the test fills the metadata member, then unlinks it)
        time.sleep(0.05)
    out = []
    for ino in made:
        got = attempt(commit, ino)
        out.append([got, attempt(c.call, "abort", ino=ino) if got != "ok" else "kept"])
    print(json.dumps(out))
"""


@pytest.mark.parametrize("loop_members", [[6 << 10, 64, 24, 64]], indirect=True)
def test_commits_sums_are_refused_below_the_metadata_members_floor(
        loop_members: list[str]) -> None:
    """A direct commit's seal row carries the file's sums (8 bytes a sum block: 512 KiB
    for a 256 MiB file in 4 KiB blocks), and only its hidden file's row was measured
    against the metadata member's room: files placed off that member passed
    `check_space` too, and a tenant's commits filled the store's disk, failing every
    other user's changes.  Twenty sparse files on other members, made while the member
    had room, are committed with 256 KiB left above its floor (and the store's few MiB
    of growth room, which it may give back): their 10 MiB of sums cannot all pass, so
    some commits are refused (ENOSPC), and those files can still be aborted."""
    alice = ensure_users()["alice"]
    size, files = 256 << 20, 20
    mkfs(loop_members)
    with mounted_pool(loop_members) as m:
        folder = m.path / "narrow"
        folder.mkdir()
        os.setxattr(folder, "user.mxfs.layout", b"stripe_unit=4096 stripe_width=1")
        os.chown(folder, alice.uid, alice.gid)
        ballast = Path(loop_members[0]) / "ballast"  # (another user of the disk)
        out: list[Any] = []
        tenant = threading.Thread(target=lambda: out.append(
            run_as(alice, SEALS_PAST_THE_FLOOR, str(m.path), str(size), str(files))))
        tenant.start()
        try:
            eventually(lambda: (folder / "ready").exists() or not tenant.is_alive(), 120)
            st = os.statvfs(loop_members[0])
            with open(ballast, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize
                                   - META_GROWTH_FLOOR - (256 << 10))
            time.sleep(2 * META_MEASURE_S)  # (the daemon's last measure of the room is stale)
            (folder / "ready").unlink()
            tenant.join()
        finally:
            (folder / "ready").unlink(missing_ok=True)
            tenant.join()
            ballast.unlink(missing_ok=True)
        results = out[0]
        assert len(results) == files and [errno.ENOSPC, "ok"] in results, results
        assert all(r in ([errno.ENOSPC, "ok"], ["ok", "kept"]) for r in results), results
        kept = sum(r == ["ok", "kept"] for r in results)
        assert len(os.listdir(folder)) == kept


RENAMES = r"""
d = sys.argv[1]
print(json.dumps([attempt(os.rename, f"{d}/a", f"{d}/" + "x" * 255),
                  attempt(os.rename, f"{d}/" + "b" * 200, f"{d}/c"),
                  sorted(os.listdir(d))]))
"""


def test_a_rename_to_a_longer_name_is_refused_below_the_metadata_members_floor(
        loop_members: list[str]) -> None:
    """A rename to a longer name grows the store by the difference, and only the
    owner's quota was asked: a million one-byte names made above the metadata member's
    floor, renamed to 255 bytes below it, fill its disk.  Below the floor such a rename
    is refused (ENOSPC) now; a rename to a shorter name still goes through."""
    alice = ensure_users()["alice"]
    mkfs(loop_members)
    with mounted_pool(loop_members) as m:
        folder = m.path / "names"
        folder.mkdir()
        for name in ("a", "b" * 200):
            (folder / name).touch()
        os.chown(folder, alice.uid, alice.gid)
        meta = Path(loop_members[0])
        ballast = [meta / "ballast", meta / "ballast2"]  # (another user of the disk)
        db = meta / "meta" / "mxfs.db"

        def fill(path: Path) -> None:  # (to the floor)
            st = os.statvfs(meta)
            with open(path, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - META_GROWTH_FLOOR)
        try:
            fill(ballast[0])
            # The store gives its database's growth room (allocated past its end) back
            # at its next checkpoint, and takes none again while the member is short:
            # filled again once it did.
            eventually(lambda: db.stat().st_blocks * 512 < db.stat().st_size + (1 << 20))
            fill(ballast[1])
            time.sleep(2 * META_MEASURE_S)  # (the daemon's last measure of the room is stale)
            assert run_as(alice, RENAMES, str(folder)) == [errno.ENOSPC, "ok", ["a", "c"]]
        finally:
            for path in ballast:
                path.unlink(missing_ok=True)

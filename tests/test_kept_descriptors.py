"""Descriptors the daemon hands out (`open_read`, KV gets, hidden files' writes) as a
hostile user keeps them: past exec, or turned into ones the kernel's lease counts miss.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import HAVE_FUSE, Mounted, eventually, force_unmount, make_members, mkfs
from open_gate import OpenGate
from users import run_as

from mxfs.client import ControlClient

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")


def test_descriptors_a_client_receives_are_not_inherited_across_exec(pool: Mounted) -> None:
    """Received without MSG_CMSG_CLOEXEC, a client's descriptors went to every program
    it ran: a child kept a hidden file's write descriptors (its commit refused, EBUSY,
    until that exited), and a root launcher's went to what it ran as anyone."""
    path = pool.path / "read-by-a-launcher"
    path.write_bytes(os.urandom(1 << 20))
    with ControlClient(str(pool.path)) as c:
        _, read = c.call_with_fds("open_read", path=c.pool_path(str(path)))
        made, write = c.call_with_fds("create", path="/written-by-a-launcher", size=4096)
        try:
            flags = [fcntl.fcntl(fd, fcntl.F_GETFD) for fd in read + write]
            assert read and write and all(f & fcntl.FD_CLOEXEC for f in flags), flags
        finally:
            for fd in read + write:
                os.close(fd)
            c.call("abort", ino=made["ino"])


# As nobody: what the daemon handed her turned into O_PATH descriptors (which read
# nothing, and which no lease probe sees), the originals closed, and those sent to the
# test (argv[1]) so that it holds them once she exits.
HAND_BACK = """
import array, base64, socket
def hand_back(fds):
    paths = [os.open(f"/proc/self/fd/{fd}", os.O_PATH) for fd in fds]
    for fd in fds:
        os.close(fd)
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                        array.array("i", paths).tobytes())])
    s.close()
    print(json.dumps(len(paths)))
"""

OPEN_READ = HAND_BACK + """
with mxfs.client.ControlClient(os.path.dirname(sys.argv[2])) as c:
    hand_back(c.call_with_fds("open_read", path=c.pool_path(sys.argv[2]))[1])
"""

KV_GET = HAND_BACK + """
from mxfs.kv import KVStore
with KVStore(sys.argv[2], "kept") as kv:
    kv.put("k", b"v" * (8 << 20))
    key = base64.b64encode(b"k").decode()
    hand_back(kv.client.call_with_fds("kv_get", namespace="kept", shared=False, keys=[key],
                                      inline_max=0, odirect=False)[1])
"""

KV_EVICT = """
from mxfs.kv import KVStore
with KVStore(sys.argv[1], "kept") as kv:
    print(json.dumps(kv.evict(0)))
"""


def _kept_as_o_path(script: str, target: str) -> list[int]:
    """The O_PATH descriptors nobody made by `script` of what she was handed for
    `target` (now held by this process alone)."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o777)
        where = os.path.join(d, "back")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(where)
            os.chmod(where, 0o777)
            listener.listen(1)
            count = run_as(None, script, where, target)
            conn, _ = listener.accept()
            with conn:
                _, anc, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(4 * count))
    fds = array.array("i")
    for _level, _kind, data in anc:
        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    assert len(fds) == count > 0
    return list(fds)


@pytest.mark.parametrize("how", ["open_read", "kv_get"])
def test_an_o_path_descriptor_keeps_no_removed_files_space(pool: Mounted, how: str) -> None:
    """The daemon asks whether anyone holds a chunk file by a write lease, and the
    kernel counts only descriptors that may read or write: an O_PATH one a user made of
    one she was handed (`/proc/self/fd/N`) went unseen, and kept a removed or evicted
    file's blocks for as long as she held it, outside every quota and KV capacity.  A
    chunk file is cut to nothing before it is removed now: her descriptor keeps none."""
    if how == "open_read":
        path = pool.path / "read-then-kept-as-a-path"
        path.write_bytes(os.urandom(8 << 20))
        path.chmod(0o644)
        fds = _kept_as_o_path(OPEN_READ, str(path))
    else:
        fds = _kept_as_o_path(KV_GET, str(pool.path))
    try:
        assert sum(os.fstat(fd).st_blocks for fd in fds) * 512 >= 4 << 20
        if how == "open_read":
            path.unlink()
        else:
            assert run_as(None, KV_EVICT, str(pool.path)) == 1
        assert eventually(lambda: all(os.fstat(fd).st_nlink == 0 for fd in fds))
        assert eventually(lambda: all(os.fstat(fd).st_blocks == 0 for fd in fds)), \
            [os.fstat(fd).st_blocks for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


NO_LEASES = [sys.executable, str(Path(__file__).with_name("no_leases.py"))]

JUDGED = """
import json, os, sys
from mxfs.pool.revoke import anyone_holds, writers_remain
path = os.path.join(sys.argv[1], "written")
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # (held for writing: as a writer's)
print(json.dumps([writers_remain([path]), anyone_holds(path)]))
"""


@pytest.mark.unit
def test_where_the_kernel_takes_no_leases_every_file_counts_as_held(tmp_path: Path) -> None:
    """Where leases fail (`fs.leases-enable=0`, a file system without them) the probes
    said nobody held the file: commits sealed files their writers still held, and
    dropped files were cut and removed under them.  They fail closed now, and say why."""
    res = subprocess.run([*NO_LEASES, sys.executable, "-c", JUDGED, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [True, True], res.stderr
    assert "takes no leases" in res.stderr  # (logged: why commits are refused)


HELD_PAST_LIMIT = """
import sys
from mxfs.fs.limits import Limits
from mxfs.fs.session import Session, check_pending_room
from mxfs.vol.access import Caller
from mxfs.vol.volume import Volume
vol = Volume.open(sys.argv[1])
for ino in (90001, 90002):  # (removed files' chunk files, nobody holding them)
    open(vol.pool.chunk_path(0, ino), "wb").close()
    vol.held.hold_read(ino, owner=7002)
try:
    check_pending_room(Session(Caller(1, 7002, 7002, frozenset({7002}))),
                       Limits(max_held_files_per_user=2), vol)
except OSError as e:
    print(e.errno, e.strerror)
"""


def test_where_leases_fail_after_mount_a_user_past_her_held_files_is_told_why(
        tmp_path: Path) -> None:
    """Where leases fail after the mount, every removed file counts as held by a writer
    (fail closed), and a user reaches `max_held_files_per_user` by removing files
    alone: she is told leases fail and the fix, not to close write descriptors she
    never had (as the message said before)."""
    members = make_members(tmp_path, 1)
    mkfs(members)
    res = subprocess.run([*NO_LEASES, sys.executable, "-c", HELD_PAST_LIMIT, members[0]],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    code, _, why = res.stdout.strip().partition(" ")
    assert int(code) == errno.ENOLCK, res.stdout
    assert "takes no leases" in why and "fs.leases-enable=1" in why \
        and "write descriptors" not in why, why


def test_a_pool_whose_members_take_no_leases_is_not_mounted(tmp_path: Path) -> None:
    """Every descriptor the daemon hands out is judged by leases: where the members'
    file system takes none the mount is refused, naming the fix."""
    members = make_members(tmp_path)
    mkfs(members)
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        res = subprocess.run([*NO_LEASES, sys.executable, "-m", "mxfs", "mount", members[0],
                              str(mp)], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and "takes no leases" in res.stderr and \
            "fs.leases-enable=1" in res.stderr, res.stderr
    finally:
        force_unmount(str(mp))


def test_an_open_read_racing_a_removal_hands_out_no_chunk_file_then_cut(
        pool: Mounted) -> None:
    """A removed file's chunk files are each asked whether anyone holds them (a write
    lease), then all cut to nothing and unlinked.  An `open_read` that found the file
    before its removal and opened a chunk file after its probe, before its cut, handed
    out a descriptor of a file then cut: its reader read nothing where the bytes were
    (a plain direct read checks no sums).  The opens are held in the kernel here so
    that they fall there for sure.  The open_read finds the file removed after its
    opens now, and answers as for a missing file."""
    path = pool.path / "read-while-removed"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))  # (64 KiB stripes: a chunk file on every member)
        f.flush()
        os.fsync(f.fileno())
    ino = path.stat().st_ino
    files = [f"{m}/chunks/{ino % 256:02x}/{ino}" for m in pool.members]
    before = [Path(f).read_bytes() for f in files]
    member_of = {os.stat(f).st_ino: n for n, f in enumerate(files)}
    answer: dict[str, Any] = {}

    def open_read() -> None:
        with ControlClient(str(pool.path)) as c:
            try:
                answer["reply"], answer["fds"] = c.call_with_fds(
                    "open_read", path=c.pool_path(str(path)))  # (no O_DIRECT ones)
            except OSError as e:
                answer["errno"] = e.errno

    with OpenGate(files) as gate:
        reader = threading.Thread(target=open_read)
        reader.start()
        first = gate.next()  # (the reader's first open, waiting: it found the file)
        path.unlink()  # (the reclaim probes member 0, 1, ... in a thread of its own)
        late = 1 if member_of[first.ino] == 0 else 0  # (one the reader opens later)
        while member_of[(probe := gate.next()).ino] != late:
            gate.allow(probe)
        gate.allow(probe)  # (nobody holds it: to be cut)
        cut_later = gate.next()  # (the reclaim's next open, waiting: no cut before it)
        gate.let_all()
        gate.allow(first)  # (the reader opens the rest, `late`'s after its probe)
        reader.join(timeout=60)
        gate.allow(cut_later)
    assert not reader.is_alive()
    assert eventually(lambda: not any(os.path.exists(f) for f in files))  # (reclaimed)
    if "errno" in answer:
        assert answer["errno"] == errno.ENOENT, answer
        return
    fds = answer["fds"]
    try:
        read = {m: os.pread(fd, 1 << 20, 0)
                for m, fd in zip(answer["reply"]["members"], fds, strict=True)}
    finally:
        for fd in fds:
            os.close(fd)
    assert {m: len(b) for m, b in read.items()} == {m: len(before[m]) for m in read}
    assert all(b == before[m] for m, b in read.items())


def test_one_files_failing_cut_back_stops_no_others(tmp_path: Path) -> None:
    """The daemon's cut-back was one loop over every unpublished file: one file whose
    hold failed (here a chunk file the kernel refuses to cut: immutable) abandoned
    the round for every file after it, whose writers kept what they took past their
    word.  Each file is handled alone now: the other is still cut and held."""
    from mxfs.fs.session import Pending, chunk_paths, cut_back
    from mxfs.meta import ROOT_INO
    from mxfs.pool.revoke import set_immutable
    from mxfs.vol.volume import Volume

    members = make_members(tmp_path, 2)
    mkfs(members)
    vol = Volume.open(members[0])
    fds, stuck = [], ""
    try:
        root = vol.store.get(ROOT_INO)
        entries = [vol.create_hidden(root, 0o644, 0, 0) for _ in range(2)]
        for entry in entries:  # (declared 0 bytes, written 64 KiB a chunk file)
            for path in chunk_paths(vol, entry.node):
                fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
                os.pwrite(fds[-1], b"x" * 65536, 0)
        stuck = chunk_paths(vol, entries[0].node)[0]
        assert set_immutable(stuck, True)
        pendings = [Pending(entry, f"/f{i}", 0) for i, entry in enumerate(entries)]
        cut_back(vol, pendings)
        other = chunk_paths(vol, entries[1].node)
        assert pendings[1].overdrawn and not any(os.path.exists(p) for p in other)
        assert all(os.fstat(fd).st_size == 0 for fd in fds[-len(other):])
    finally:
        if stuck:
            set_immutable(stuck, False)
        for fd in fds:
            os.close(fd)
        vol.close()


def test_a_held_file_that_cannot_be_moved_aside_is_held_where_it_is(tmp_path: Path) -> None:
    """A dropped file's chunk file is cut, then moved into `chunks/held/`; on a full
    member the move failed (ENOSPC) and the file was left where it was, untracked: its
    writer took the space back through the descriptor she kept, and its inode's reclaim
    removed a file she still held.  It is held where it is now (here the move is
    refused by an immutable `held/`): cut, counted as hers, cut again by the sweep if
    it grows, left to the sweep by the reclaim, and moved aside once it can be."""
    from mxfs.pool.revoke import HELD_DIR, set_immutable
    from mxfs.vol.volume import Volume

    members = make_members(tmp_path, 1)
    mkfs(members)
    vol = Volume.open(members[0])
    ino, held = 90001, os.path.join(members[0], "chunks", HELD_DIR)
    path = vol.pool.chunk_path(0, ino)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.makedirs(held, exist_ok=True)
    try:
        os.pwrite(fd, b"x" * 65536, 0)
        assert set_immutable(held, True)
        assert vol.held.hold(ino, owner=7002) == 1
        assert os.fstat(fd).st_blocks == 0 and vol.held.held_by[7002] == 1
        os.pwrite(fd, b"y" * 65536, 0)  # (taken again: the sweep cuts it)
        vol.pool.remove_chunks(ino)  # (its reclaim: the file stays the sweep's)
        vol.held.sweep()
        assert os.path.exists(path) and os.fstat(fd).st_blocks == 0
        set_immutable(held, False)
        vol.held.sweep()
        assert not os.path.exists(path) and len(os.listdir(held)) == 1
        assert vol.held.held_by[7002] == 1 and os.fstat(fd).st_blocks == 0
    finally:
        set_immutable(held, False)
        os.close(fd)
        vol.close()

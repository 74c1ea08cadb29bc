"""A node shared by users who do not trust each other: what one of them sends, holds or
floods must not hang, fill or stall the daemon for the rest.

One pool is mounted for the module; each test attacks it as a user would and then
checks that the daemon still serves everyone.
"""

from __future__ import annotations

import array
import base64
import contextlib
import errno
import json
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    HAVE_FUSE,
    Mounted,
    chunk_files,
    eventually,
    kill_daemon,
    make_members,
    mkfs,
    module_pool,
    mount_with,
    mounted_pool,
    mxfs,
    one_line_error,
    raw_socket,
    slow_member,
)
from dir_lock import held_dir_lock
from users import User, as_user, ensure_users, run_as, subordinate_uids

from mxfs.client import ControlClient
from mxfs.fs.foreign_fds import Dropper, carries_rights, take
from mxfs.fs.kv_ops import KVOps
from mxfs.proto import HEADER, encode
from mxfs.proto.framing import recv_message
from mxfs.vol.kv_index import KVIndex
from mxfs.vol.volume import Volume

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")


def fuse_abort(path: Path) -> None:
    """End a hung mount's FUSE connection, as an operator would by hand (found from
    mountinfo: touching the hung mount would hang this process too)."""
    with open("/proc/self/mountinfo") as f:
        devs = [line.split()[2] for line in f if line.split()[4] == str(path)]
    conns = Path("/sys/fs/fuse/connections")
    if devs and not any(conns.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(conns)], capture_output=True)
    for dev in devs:
        major, minor = (int(x) for x in dev.split(":"))
        abort = conns / str(os.makedev(major, minor)) / "abort"
        if abort.exists():
            abort.write_text("1")


def answers(m: Mounted, timeout: float = 10) -> bool:
    """Whether the mount and its daemon answer another user's requests within `timeout`."""
    probe = (f"import os; os.listdir({str(m.path)!r}); "
             "from mxfs.client import ControlClient; "
             f"c = ControlClient({str(m.path)!r}); c.call('stat'); c.close()")
    try:
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """One pool for the module; a mount the attacks left hanging is aborted after."""
    with module_pool(tmp_path_factory) as m:
        try:
            yield m
        finally:
            if not answers(m, 5):
                fuse_abort(m.path)


def test_a_descriptor_of_a_file_on_the_mount_sent_to_the_daemon_hangs_nobody(
        pool: Mounted) -> None:
    victim = pool.path / "sent-back"
    victim.write_bytes(b"x" * 4096)
    fd = os.open(victim, os.O_RDWR)
    s = raw_socket(pool, timeout=10)
    try:
        msg = encode({"op": "hello", "id": 1})
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        try:
            s.sendmsg([msg], anc)
        except PermissionError:  # the kernel refuses them for the daemon (Linux 6.16)
            s.sendall(msg)
        os.close(fd)  # the daemon's copy, if it took one, is now the last
        head = s.recv(HEADER.size)
        assert head, "the daemon closed the connection instead of answering"
    finally:
        s.close()
    assert answers(pool), "the daemon hangs after a client sent it a descriptor of its mount"
    assert victim.read_bytes() == b"x" * 4096


@pytest.mark.daemon_log(r"requests carry no descriptors|bad magic")
def test_descriptors_sent_where_the_kernel_passes_them_hang_nobody(tmp_path: Path) -> None:
    """Kernels before 6.16 pass descriptors to the daemon whatever it says; one that
    names a file on this mount, closed on the daemon's thread, hangs the mount for
    every user (its close waits on a FLUSH only that thread could answer).  Sent with
    the header, with the payload's bytes, 253 at once, or left unread when the
    connection ends: none is taken, the connection is closed, its socket dropped by a
    process of its own.  (MXFS_PASS_RIGHTS=1: this kernel's older path.)"""
    members = make_members(tmp_path)
    mkfs(members)
    with mount_with(members, prefix=["env", "MXFS_PASS_RIGHTS=1"]) as m:
        victim = m.path / "sent-back"
        victim.write_bytes(b"x" * 4096)
        msg = encode({"op": "hello", "id": 1})

        try:
            _send_rights(m, victim, msg)
        finally:
            if not answers(m, 5):
                fuse_abort(m.path)  # (a hung mount would hang its unmount too)
        assert victim.read_bytes() == b"x" * 4096


def _send_rights(m: Mounted, victim: Path, msg: bytes) -> None:
    """Descriptors of `victim` sent with a request's header, its payload, 253 at once,
    and after a refused request: each refused, and the daemon answering after."""
    for where in ("header", "payload", "many", "unread"):
        s = raw_socket(m, timeout=10)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                array.array("i", fds := [os.open(victim, os.O_RDWR)
                                         for _ in range(253 if where == "many" else 1)]
                            ).tobytes())]
        try:
            if where == "payload":
                s.sendall(msg[:HEADER.size])
                s.sendmsg([msg[HEADER.size:]], anc)
            elif where == "unread":  # (refused at once: what follows is never asked)
                s.sendall(b"JUNK" + msg[4:])
                s.sendmsg([b"more"], anc)
            else:
                s.sendmsg([msg], anc)
            for fd in fds:
                os.close(fd)  # (the daemon's copies are now the last)
            reply, _ = recv_message(s)
            assert not reply["ok"] and reply["errno"] == errno.EPROTO, reply
        finally:
            s.close()
        assert answers(m), f"the daemon hangs after descriptors sent with the {where}"


@contextlib.contextmanager
def _lingering_socket() -> Iterator[socket.socket]:
    """A TCP socket whose last close waits an hour (SO_LINGER, and data its peer never
    takes), until the peer closes at the end."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.socket()
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    cli.connect(srv.getsockname())
    peer, _ = srv.accept()
    cli.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            cli.send(b"x" * 65536)
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))
    try:
        yield cli
    finally:
        peer.close()  # (its close ends the linger, wherever it waits)
        srv.close()


@pytest.mark.daemon_log(r"requests carry no descriptors")
def test_a_close_that_never_ends_fills_nothing_of_the_daemons(tmp_path: Path) -> None:
    """A descriptor whose last close waits (a lingering socket), sent first, then
    thousands more: the daemon took each into its table and closed them in one
    thread, where they queued behind the close that waited, and it went on reading
    refused connections' descriptors (10,000 held in the test, 524,288 in a second
    for a sender who keeps on).  It takes none now, and another user is served."""
    members = make_members(tmp_path)
    mkfs(members)
    with mount_with(members, prefix=["env", "MXFS_PASS_RIGHTS=1"]) as m:
        pid = m.daemon_pid()
        before = len(os.listdir(f"/proc/{pid}/fd"))
        msg = encode({"op": "hello", "id": 1})
        null = os.open("/dev/null", os.O_RDONLY)
        with _lingering_socket() as lingering:
            for n in range(41):
                fds = [lingering.detach()] if n == 0 else [null] * 253
                s = raw_socket(m, timeout=10)
                try:
                    s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       array.array("i", fds).tobytes())])
                    if n == 0:
                        os.close(fds[0])  # (the daemon's copy, if it took one, is the last)
                    reply, _ = recv_message(s)
                    assert not reply["ok"], reply  # (the request is refused)
                finally:
                    s.close()
            held = len(os.listdir(f"/proc/{pid}/fd")) - before
            bob = ensure_users()["bob"]
            assert run_as(bob, "print(json.dumps(os.stat(sys.argv[1]).st_nlink))",
                          str(m.path)) >= 2, "another user is not served"
        os.close(null)
        assert held < 64, f"the daemon holds {held} more descriptors than before"


@pytest.mark.unit
def test_descriptors_sent_are_seen_never_taken_and_dropped_elsewhere() -> None:
    """A read that meets descriptors says so and takes nothing (the process's table
    stays as it was); a socket holding some, handed to the dropper, is closed by a
    process of its own: the last reader of a pipe, sent in flight, goes with it."""
    a, b = socket.socketpair()
    r, w = os.pipe()

    def table() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        conn = trio.socket.from_stdlib_socket(b)
        a.sendall(b"plain")
        assert await take(conn, 100) == (b"plain", False)
        a.sendmsg([b"with"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                               array.array("i", [r] * 8).tobytes())])
        before = table()
        assert await take(conn, 100) == (b"", True)
        assert table() == before and carries_rights(conn.fileno())
        os.close(r)  # (the pipe's read ends are now those in flight)
        dropper = Dropper()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dropper.run)
            dropper.drop(conn.detach())
            with trio.fail_after(30):
                while dropper.dropped < 1:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)

        def pipe_broken() -> bool:
            try:
                os.write(w, b"x")
            except BrokenPipeError:
                return True
            return False
        assert eventually(pipe_broken, timeout=10)
    finally:
        a.close()
        os.close(w)


def test_mkfs_force_refuses_the_members_of_a_mounted_pool(pool: Mounted) -> None:
    kept = pool.path / "kept"
    kept.write_bytes(b"k" * 300_000)
    for members in (pool.members, pool.members[2:3]):  # member 0 holds the lock; 2 does not
        args = [a for m in members for a in ("--member", m)]
        res = mxfs("mkfs", "--force", *args, check=False)
        assert res.returncode != 0
        line = one_line_error(res)
        assert f"mounted at {pool.path}" in line and "mxfs umount" in line, line
    assert kept.read_bytes() == b"k" * 300_000


def test_a_runtime_folder_another_user_made_first_is_refused(tmp_path: Path) -> None:
    """A non-root daemon's log and socket live in /tmp/mxfs-UID without XDG_RUNTIME_DIR:
    a folder of that name someone else made, linked or opened up is not used."""
    from mxfs.errors import MxfsError
    from mxfs.vol.mounts import ensure_runtime_dir, open_private_log

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine-elsewhere")
    (tmp_path / "mine-elsewhere").mkdir()
    for bad, why in ((theirs, "belongs to uid 65534"), (open_to_all, "written by others"),
                     (link, "symbolic link")):
        with pytest.raises(MxfsError, match=why):
            ensure_runtime_dir(str(bad))
    mine = tmp_path / "mine" / "mxfs"
    ensure_runtime_dir(str(mine))
    assert mine.is_dir() and (mine.stat().st_mode & 0o777) == 0o755
    (mine / "pool.log").symlink_to(tmp_path / "victim-file")
    with pytest.raises(MxfsError, match="symbolic link"):
        open_private_log(str(mine / "pool.log"))
    assert not (tmp_path / "victim-file").exists()


def test_engine_default_namespace_names_are_their_users_own(pool: Mounted) -> None:
    """`<engine>-uid<N>` is what an engine of uid N picks by default: nobody else may
    make it first, so a victim's engine never finds its name taken."""
    from users import ensure_users, run_as

    alice, bob = ensure_users()["alice"], ensure_users()["bob"]
    script = f"""
c = mxfs.client.ControlClient({str(pool.path)!r})
def make(name):
    return attempt(c.call, "kv_ns_create", namespace=name)
print(json.dumps([make("sglang-uid{bob.uid}"), make("vllm-uid{alice.uid}"),
                  make("mine-uid{alice.uid}x")]))
"""
    stolen, own, unreserved = run_as(alice, script)
    assert stolen == errno.EACCES and own == "ok" and unreserved == "ok"


@pytest.mark.daemon_log(r"metadata member \S+ is full")
def test_xattrs_cannot_fill_the_metadata_member(loop_pool: Mounted) -> None:
    """A tenant setting 64 KiB xattrs on file after file is stopped (ENOSPC) while the
    metadata member still has room to commit what others were answered for: every
    answered mkdir is there after a remount, and one inode holds a bounded amount."""
    from users import ensure_users, run_as

    alice = ensure_users()["alice"]
    loop_pool.umount()
    loop_pool.remount()  # allow_other: alice reaches it
    home = loop_pool.path / "alice"
    home.mkdir()
    os.chown(home, alice.uid, alice.gid)
    script = f"""
home = {str(home)!r}
value = b"v" * 65536
first = os.path.join(home, "first")
open(first, "wb").close()
per_inode = next(j for j in range(100)
                 if attempt(os.setxattr, first, f"user.x{{j}}".encode(), value) != "ok")
for i in range(2000):  # 3 x 64 KiB a file, 375 MiB: six times the metadata member
    path = os.path.join(home, f"f{{i}}")
    err = attempt(lambda: open(path, "wb").close())  # names are metadata too
    for j in range(3):
        if err == "ok":
            err = attempt(os.setxattr, path, f"user.x{{j}}".encode(), value)
        if err != "ok":
            print(json.dumps([i, err, per_inode])); sys.exit()
print(json.dumps([i, "never refused", per_inode]))
"""
    i, err, per_inode = run_as(alice, script)
    assert err == errno.ENOSPC, (i, err)
    assert 0 < per_inode < 5  # 256 KiB of xattrs an inode
    made = []
    for k in range(300):  # root's mkdirs now: each answered one must survive
        try:
            (loop_pool.path / f"d{k}").mkdir()
        except OSError:
            break
        made.append(k)
    loop_pool.umount()
    loop_pool.remount()
    assert all((loop_pool.path / f"d{k}").is_dir() for k in made)
    assert os.getxattr(home / "f0", "user.x0") == b"v" * 65536


def _sums(data: bytes, unit: int = 65536) -> dict[str, object]:
    import base64

    from mxfs.io.checksum import block_sums, pack_sums

    return {"sum_unit": unit, "sums": base64.b64encode(pack_sums(block_sums(data, unit))).decode()}


def test_a_file_is_published_only_once_nobody_can_write_it(pool: Mounted) -> None:
    """A commit while any write descriptor of the file is open (here a child's, which
    inherited it) is refused with EBUSY, the file still unpublished; once every one is
    closed it commits, and nothing can rewrite the sealed file behind its checksums."""
    data = b"s" * 4096
    with ControlClient(str(pool.path)) as c:
        reply, fds = c.call_with_fds("create", path="/sealed-late", size=len(data))
        first = reply["layout"]["first_member"]  # where a file's first stripe goes
        os.pwrite(dict(zip(reply["members"], fds, strict=True))[first], data, 0)
        child = os.fork()
        if child == 0:  # holds copies of the descriptors until told to go
            time.sleep(600)
            os._exit(0)
        try:
            for fd in fds:
                os.close(fd)
            with pytest.raises(OSError) as refused:
                c.call("commit", ino=reply["ino"], size=len(data), **_sums(data))
            assert refused.value.errno == errno.EBUSY
            assert not (pool.path / "sealed-late").exists()
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        c.call("commit", ino=reply["ino"], size=len(data), **_sums(data))
    assert (pool.path / "sealed-late").read_bytes() == data
    assert mxfs("scrub", str(pool.path)).returncode == 0  # its checksums match its bytes


def test_an_aborted_file_kept_open_by_its_writer_holds_no_space_and_no_inode(
        pool: Mounted) -> None:
    """After abort (or its connection's end), a writer that kept its descriptors is
    refused (EPERM: its chunk files, moved aside, are immutable where the member's file
    system keeps the flag, as ext4 does) or writes into them, cut to nothing every
    second; they go once it lets go, and nothing it writes reaches a file made since."""
    with ControlClient(str(pool.path)) as c:
        reply, fds = c.call_with_fds("create", path="/dropped", size=4096)
        ino = reply["ino"]
        c.call("abort", ino=ino)
    held = [Path(m) / "chunks" / "held" for m in pool.members]

    def write(data: bytes) -> None:
        with contextlib.suppress(PermissionError):  # (immutable: refused)
            os.pwrite(fds[0], data, 0)
    try:
        for _ in range(8):
            write(b"h" * (4 << 20))  # 4 MiB a round, far past 4 KiB
            time.sleep(0.2)
        assert not any(Path(pool.members[m], "chunks", f"{ino % 256:02x}", str(ino)).exists()
                       for m in range(len(pool.members)))
        names = [p for h in held if h.is_dir() for p in h.iterdir()]
        assert names and all(p.name.startswith(f"{ino}.") for p in names)
        assert eventually(lambda: all(p.stat().st_blocks == 0 for p in names), timeout=5)
        (pool.path / "after").write_bytes(b"a" * 200_000)
        write(b"h" * 65536)
        assert (pool.path / "after").read_bytes() == b"a" * 200_000
    finally:
        for fd in fds:
            os.close(fd)
    assert eventually(lambda: not any(h.is_dir() and any(h.iterdir()) for h in held),
                      timeout=10)


def test_a_held_file_that_stays_cut_is_not_cut_again(pool: Mounted) -> None:
    """Every held file was made mutable, cut and made immutable again each second
    (journal writes), ~30 us a file: 18.8k of them kept by one user slowed everyone's
    cut-backs.  One that stays cut is left alone; its writer is asked now and then."""
    with ControlClient(str(pool.path)) as c:
        reply, fds = c.call_with_fds("create", path="/dropped-and-kept", size=4096)
        c.call("abort", ino=reply["ino"])
    held = [Path(m) / "chunks" / "held" for m in pool.members]
    try:
        names = [p for h in held if h.is_dir() for p in h.iterdir()]
        assert names
        time.sleep(1.5)  # (past its first sweep)
        before = [p.stat().st_ctime_ns for p in names]
        time.sleep(2.5)  # (two sweeps more)
        assert [p.stat().st_ctime_ns for p in names] == before
    finally:
        for fd in fds:
            os.close(fd)
    assert eventually(lambda: not any(h.is_dir() and any(h.iterdir()) for h in held))


_ALICE_DROPS_AND_KEEPS = """
kept, made = [], 0
with mxfs.client.ControlClient(sys.argv[1]) as c:
    while made < 64:
        try:
            reply, fds = c.call_with_fds("create", path=f"/alices/{made}", size=4096)
        except OSError as e:
            print(json.dumps({"made": made, "kept": len(kept), "errno": e.errno,
                              "why": e.strerror}))
            break
        kept += fds
        c.call("abort", ino=reply["ino"])
        made += 1
    else:
        print(json.dumps({"made": made}))
"""

_ALICE_WRITES = """
with mxfs.client.writer.create_file(sys.argv[1], 0) as w:
    print(json.dumps(attempt(w.commit, 0)))
"""


def test_dropped_files_a_user_keeps_open_are_bounded(tmp_path: Path) -> None:
    """A user who created files and aborted them, keeping their write descriptors, had
    each one's chunk files held (and looked at every second) without bound: 4,700
    creates gave 18.8k held files.  Past `max_held_files_per_user` her creates are
    refused (EMFILE, naming the limit) until she lets go."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_held_files_per_user=8") as m:
        (m.path / "alices").mkdir()
        os.chown(m.path / "alices", alice.uid, alice.gid)
        got = run_as(alice, _ALICE_DROPS_AND_KEEPS, str(m.path))
        assert got.get("errno") == errno.EMFILE and "max_held_files_per_user" in got["why"] \
            and 8 <= got["kept"] < 8 + len(members), got
        held = [Path(p) / "chunks" / "held" for p in m.members]
        assert eventually(lambda: not any(h.is_dir() and any(h.iterdir()) for h in held))
        assert run_as(alice, _ALICE_WRITES, str(m.path / "alices" / "after")) == "ok"


ALICE_KEEPS_ACROSS_A_RESTART = """
mp, drop = sys.argv[1], sys.argv[2] == "drop"
c = mxfs.client.ControlClient(mp)
reply, kept = c.call_with_fds("create", path="/alices/kept", size=4096)
if drop:
    c.call("abort", ino=reply["ino"])
print(json.dumps(len(kept)), flush=True)
sys.stdin.readline()  # (the daemon was restarted meanwhile)
try:
    with mxfs.client.ControlClient(mp) as again:
        again.call("create", path="/alices/after", size=4096)
    print(json.dumps("ok"), flush=True)
except OSError as e:
    print(json.dumps([e.errno, e.strerror]), flush=True)
"""


@pytest.mark.daemon_log(r"recovered pool")
@pytest.mark.parametrize("how", ["drop", "crash"])
def test_a_users_held_files_are_still_hers_after_a_daemon_restart(
        tmp_path: Path, how: str) -> None:
    """Held chunk files outlive the daemon (their writers keep descriptors) and the next
    one took them over as nobody's: `max_held_files_per_user` started again from 0 at
    every restart, and hidden files the crash dropped were held as root's, never
    refused.  Both still count as hers after the restart: her next create is refused."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    limit = f"max_held_files_per_user={len(members)}"  # (a file's chunk files)
    with mounted_pool(members, limit) as m:
        (m.path / "alices").mkdir()
        os.chown(m.path / "alices", alice.uid, alice.gid)
        proc = _as(alice, ALICE_KEEPS_ACROSS_A_RESTART, str(m.path), how,
                   stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            line = proc.stdout.readline()
            assert line and json.loads(line) == len(members), \
                proc.stderr.read() if proc.stderr else ""
            kill_daemon(m)  # (a crash, or an upgrade: what it held is adopted alike)
            mxfs("mount", "-o", f"allow_other,{limit}", members[0], str(m.path))
            held = [Path(p) / "chunks" / "held" for p in m.members]
            # (a crash's orphans are freed, hers held aside, after the mount answers)
            assert eventually(lambda: sum(len(os.listdir(h)) for h in held if h.is_dir())
                              == len(members))
            proc.stdin.write("\n")
            proc.stdin.flush()
            got = json.loads(proc.stdout.readline())
            assert got[0] == errno.EMFILE and "max_held_files_per_user" in got[1], got
        finally:
            proc.kill()
            proc.communicate(timeout=60)
        assert eventually(lambda: not any(h.is_dir() and any(h.iterdir()) for h in held))


def test_a_big_namespace_is_removed_while_others_are_served(pool: Mounted) -> None:
    """Removing 16,384 chunks goes a slice at a time: another user's requests are
    answered while it runs (they see the namespace part-removed), and kv_list pages."""
    import base64

    one = base64.b64encode(b"x").decode()
    n = 16384
    with ControlClient(str(pool.path)) as c:
        _fill(c, "big", b"k", n, one)
        assert len(c.call("kv_list", namespace="big", limit=100_000)["chunks"]) == 1000
    removed: list[Any] = []
    seen = _chunks_while(pool, "big", lambda r: removed.append(
        r.call("kv_ns_remove", namespace="big")))
    assert removed and removed[0]["deleted"] == n
    assert any(0 < k < n for k in seen), "nobody was served while the namespace went"


_REPLACER = """
import select
from mxfs.client import ControlClient
c, folder, n = ControlClient(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for k in range(n):  # each name, first to last, replaced: it moves to the directory's end
    made, fds = c.call_with_fds("create", path=f"{folder}/e{k:05d}", size=0)
    for fd in fds:
        os.close(fd)
    c.call("commit", ino=made["ino"], size=0, sum_unit=65536, sums="")
    if k == 0:
        print("going", flush=True)
    if select.select([sys.stdin], [], [], 0)[0]:  # (stdin closed: stop)
        break
print(k + 1, flush=True)
"""


def _getdents(fd: int, size: int) -> list[str]:
    """The names one getdents64 call of `size` bytes returns from `fd`'s offset."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(size)
    got = libc.syscall(217, fd, buf, size)  # SYS_getdents64 (x86_64)
    if got < 0:
        raise OSError(ctypes.get_errno(), "getdents64")
    raw, names, at = buf.raw[:got], [], 0
    while at < got:
        reclen = struct.unpack_from("<H", raw, at + 16)[0]
        names.append(raw[at + 19:at + reclen].split(b"\0", 1)[0].decode())
        at += reclen
    return names


def test_one_big_readdir_lets_another_users_requests_through(mounted: Mounted) -> None:
    """Since Linux 6.16 one getdents64 of 1 MiB is one FUSE readdir of thousands of
    names; the daemon fetches them a page at a time and steps aside between pages, so
    another user's requests are served in the middle of it (it held everyone for the
    whole listing before).  Shown in the listing itself: bob keeps replacing the names
    from the first on through the control socket (no directory lock in the kernel),
    which moves each to the directory's end, and a listing that was passed by one of
    his replaces names it twice: at its old place, read before, and at its new one."""
    if platform.machine() != "x86_64":
        pytest.skip("getdents64 called by its x86_64 number")
    bob = ensure_users()["bob"]
    n = 6_000  # (with their attributes, 160 bytes each in the reply: all in 1 MiB)
    d = mounted.path / "wide"
    d.mkdir()
    os.chown(d, bob.uid, bob.gid)
    for i in range(n):
        os.mknod(d / f"e{i:05d}")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.lseek(fd, 2, os.SEEK_SET)  # (past "." and "..")
        if len(_getdents(fd, 1 << 20)) < n:
            pytest.skip("this kernel lists a directory in small requests (before 6.16)")
        replacer = _as(bob, _REPLACER, str(mounted.path), "/wide", str(n),
                       stdin=subprocess.PIPE)
        try:
            assert replacer.stdout is not None and replacer.stdout.readline() == "going\n"
            twice: list[str] = []
            for _ in range(50):
                os.lseek(fd, 2, os.SEEK_SET)
                names = _getdents(fd, 1 << 20)
                assert len(set(names)) == n, "a name went missing from the listing"
                twice = [name for name, k in Counter(names).items() if k > 1]
                if twice:
                    break
        finally:
            assert replacer.stdin is not None and replacer.stdout is not None
            replacer.stdin.close()
            out = replacer.stdout.read()
        assert replacer.wait(timeout=120) == 0
        assert twice, f"none of bob's {out.strip()} replaces was served during a listing"
    finally:
        os.close(fd)


def _fill(c: ControlClient, namespace: str, prefix: bytes, n: int, value: str) -> None:
    """Put `n` chunks of `value` (base64) in `namespace`, 4,096 a request."""
    for start in range(0, n, 4096):
        keys = [base64.b64encode(prefix + b"%06d" % i).decode()
                for i in range(start, start + 4096)]
        c.call("kv_put", namespace=namespace, keys=keys, data=[value] * 4096)


def _chunks_while(pool: Mounted, namespace: str, work: Callable[[ControlClient], None]
                  ) -> list[int]:
    """Run `work` on a connection of its own while another asks `kv_stats` again and
    again: the chunk counts of `namespace` that other connection was answered."""
    seen: list[int] = []
    done = threading.Event()

    def run() -> None:
        try:
            with ControlClient(str(pool.path)) as r:
                work(r)
        finally:
            done.set()

    worker = threading.Thread(target=run)
    with ControlClient(str(pool.path)) as other:
        worker.start()
        while not done.is_set():
            stats = other.call("kv_stats")["namespaces"]
            seen += [s["chunks"] for s in stats if s["namespace"] == namespace]
    worker.join()
    return seen


def test_a_put_that_evicts_thousands_of_chunks_leaves_others_served(pool: Mounted) -> None:
    """A put that takes a namespace over its capacity evicts its least recently used
    chunks down to the low watermark a bite at a time: another user's requests are
    answered meanwhile (they see the namespace part-evicted).  It evicted them all in
    one stroke before, holding every user for as long as 16,384 removals take."""
    from mxfs.vol.kv_index import CHUNK_FLOOR, LOW

    n, more, small = 16384, 4096, base64.b64encode(b"x" * 16).decode()
    with ControlClient(str(pool.path)) as c:
        _fill(c, "evicted", b"e", n, small)  # (each chunk counts CHUNK_FLOOR bytes)
        capacity = n * CHUNK_FLOOR + (64 << 10)  # (not over it yet)
        c.call("kv_config", namespace="evicted", capacity=capacity)
    keys = [base64.b64encode(b"m%06d" % i).decode() for i in range(more)]
    replies: list[Any] = []
    seen = _chunks_while(pool, "evicted", lambda r: replies.append(r.call(
        "kv_put", namespace="evicted", data=[small] * more, keys=keys)))
    assert replies and all(replies[0]["stored"]), replies
    evicted = replies[0]["evicted"]  # (down to 90% of the capacity: 5,700 and more)
    assert evicted == n + more - int(capacity * LOW) // CHUNK_FLOOR > n // 4
    left = n + more - evicted
    with ControlClient(str(pool.path)) as c:
        assert {s["namespace"]: s["chunks"] for s in c.call("kv_stats")["namespaces"]
                }["evicted"] == left
        c.call("kv_ns_remove", namespace="evicted")
    peak = seen.index(max(seen))  # (the puts stored, then the evictions)
    assert any(left < k < seen[peak] for k in seen[peak + 1:]), "nobody was served meanwhile"


def test_a_connection_with_many_leases_lets_them_go_while_others_are_served(
        pool: Mounted) -> None:
    """A connection that closes holding 65,536 read leases (its limit; a dead node's
    connections may hold hundreds of thousands) has them ended a bite at a time:
    another connection's `kv_stats` is answered meanwhile and sees them part-ended.
    They all ended in one stroke before, 60-100 ms of every user's time."""
    n, small = 65536, base64.b64encode(b"x" * 16).decode()
    keys = [base64.b64encode(b"p%06d" % i).decode() for i in range(n)]
    with ControlClient(str(pool.path)) as c:
        _fill(c, "leased", b"p", n, small)

    def pinned(c: ControlClient) -> int:
        return int(c.call("kv_stats", namespace="leased")["namespaces"][0]["pinned"])

    with ControlClient(str(pool.path)) as other:
        with ControlClient(str(pool.path)) as holder:
            for start in range(0, n, 4096):
                assert all(holder.call("kv_pin", namespace="leased",
                                       keys=keys[start:start + 4096])["pinned"])
            assert pinned(other) == n
        seen = [pinned(other)]
        while seen[-1]:
            seen.append(pinned(other))
        other.call("kv_ns_remove", namespace="leased")
    assert any(0 < k < n for k in seen), f"nobody was served meanwhile: {seen[:3]}..."


_ALICE_READS = """
import mmap, sys, threading, time
path, n = sys.argv[1], int(sys.argv[2])
out = threading.Lock()
def reader(i):
    buf = mmap.mmap(-1, 128 << 10)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    off = i * (n // 8)
    while True:
        os.preadv(fd, [buf], off)
        off = off + (128 << 10) if off + (256 << 10) <= (i + 1) * (n // 8) else i * (n // 8)
        with out:
            print(time.monotonic(), flush=True)
for i in range(8):
    threading.Thread(target=reader, args=(i,), daemon=True).start()
time.sleep(600)
"""

_BOB_READS = """
import time
path = sys.argv[1]
start = time.monotonic()
data = open(path, "rb").read()
print(json.dumps([start, time.monotonic(), len(data)]))
"""


def test_one_users_flood_of_reads_leaves_another_a_thread(tmp_path: Path) -> None:
    """Alice keeps eight cold reads of a file on a slow member in flight through a mount
    with four I/O threads; bob's read of a file on a fast member is served in his turn:
    alice holds three of the four threads, and none of her reads need finish during
    his.  First come first served, his read waited until five of hers had (the threads
    went to whoever asked first)."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    fast = make_members(tmp_path / "fast", 1)[0]
    with slow_member(tmp_path, 1_000_000) as (slow, throttle, _):
        mkfs([fast, slow], "64KiB")
        with mount_with([fast, slow], "io_threads=4") as m:
            big = m.path / "alice.bin"
            big.write_bytes(os.urandom(16 << 20))
            os.chown(big, alice.uid, alice.gid)
            (m.path / "bob").mkdir()
            mxfs("setstripe", "--width", "1", str(m.path / "bob"))
            small = next(p for p in (m.path / "bob" / f"{i}.bin" for i in range(16))
                         if p.write_bytes(b"b" * 100_000) and
                         _first_member(m, p) == 0)
            os.chown(small, bob.uid, bob.gid)
            for chunk in Path(slow).rglob("chunks/*/*"):
                fd = os.open(chunk, os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            throttle(m.daemon_pid())
            flood = _as(alice, _ALICE_READS, str(big), str(16 << 20))
            try:
                done = _times_read(flood)
                assert eventually(lambda: len(done) >= 8, 30), "alice's reads never came"
                start, end, n = run_as(bob, _BOB_READS, str(small))
                assert n == 100_000
                during = sum(1 for t in list(done) if start <= t <= end)
                assert during <= 2, f"{during} of alice's reads finished during bob's"
            finally:
                flood.kill()
                flood.wait()


_ALICE_SPANS = """
import mmap, random, sys, threading, time
path, k = sys.argv[1], int(sys.argv[2])
rows = list(range(os.path.getsize(path) // (192 << 10)))
random.shuffle(rows)  # (each row once: a read never finds it cached)
out = threading.Lock()
def reader(i):
    buf = mmap.mmap(-1, 128 << 10)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    for row in rows[i::k]:  # (its 2nd and 3rd stripes: a fast member's and the slow one's)
        os.preadv(fd, [buf], row * (192 << 10) + (64 << 10))
        with out:
            print(time.monotonic(), flush=True)
for i in range(k):
    threading.Thread(target=reader, args=(i,), daemon=True).start()
time.sleep(600)
"""

_BOB_SPAN = """
import mmap, time
path = sys.argv[1]
buf = mmap.mmap(-1, 128 << 10)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
start = time.monotonic()
n = os.preadv(fd, [buf], 0)  # (two stripes: one on each fast member)
print(json.dumps([start, time.monotonic(), n, buf[:1] == buf[n - 1:n] == b"b"]))
"""


def test_one_users_reads_over_a_slow_member_leave_another_the_io_helpers(
        tmp_path: Path) -> None:
    """Alice keeps 40 cold reads in flight, each over a fast member and a slow one; bob's
    read over the two fast members is served at once.  Each read's pieces ran on one
    pool of I/O threads, first come, below the users' turns: her slow pieces held all
    of its threads and queued more, and his two pieces, in his turn, waited behind
    them.  A read now takes only the helpers idle when it begins and runs the rest on
    its own thread (`io/batch._Helpers`)."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    fast = make_members(tmp_path / "fast", 2)
    with slow_member(tmp_path, 250_000) as (slow, throttle, _):  # (4 of her reads a second)
        mkfs([*fast, slow], "64KiB")
        with mount_with([*fast, slow], "io_threads=64") as m:
            theirs = {}
            for name, width in (("alice", "3"), ("bob", "2")):
                folder = m.path / name
                folder.mkdir()
                mxfs("setstripe", "--width", width, str(folder))
                size, byte = (96 * (192 << 10), b"a") if name == "alice" else (128 << 10, b"b")
                theirs[name] = next(p for p in (folder / f"{i}.bin" for i in range(32))
                                    if p.write_bytes(byte * size) and _first_member(m, p) == 0)
            big, small = theirs["alice"], theirs["bob"]
            os.chown(big, alice.uid, alice.gid)
            os.chown(small, bob.uid, bob.gid)
            subprocess.run(["sync"], check=True)
            for chunk in Path(slow).rglob("chunks/*/*"):
                fd = os.open(chunk, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            throttle(m.daemon_pid())
            flood = _as(alice, _ALICE_SPANS, str(big), "40")
            try:
                done = _times_read(flood)
                assert eventually(lambda: len(done) >= 4, 60), "alice's reads never came"
                time.sleep(1)  # (all 40 asked by now)
                start, end, n, same = run_as(bob, _BOB_SPAN, str(small))
                assert (n, same) == (128 << 10, True)
                during = sum(1 for t in list(done) if start <= t <= end)
                assert during <= 3, f"{during} of alice's reads finished during bob's"
            finally:
                Path("/sys/fs/cgroup/blkio/cgroup.procs").write_text(str(m.daemon_pid()))
                flood.kill()
                flood.wait()


_ALICE_PAGES = """
import mmap, random, sys, threading, time
path, k, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pages = list(range(os.path.getsize(path) // 4096))
random.shuffle(pages)  # (each page once: a read never finds it cached)
out = threading.Lock()
def reader(i):
    buf = mmap.mmap(-1, 4096)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if how == "direct" else 0))
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (a page a request, no readahead)
    for page in pages[i::k]:
        os.preadv(fd, [buf], page * 4096)
        with out:
            print(time.monotonic(), flush=True)
for i in range(k):
    threading.Thread(target=reader, args=(i,), daemon=True).start()
time.sleep(600)
"""

_BOB_LOOKS = """
import time
folder, small = sys.argv[1], sys.argv[2]
start = time.monotonic()
for i in range(20):
    assert not os.path.exists(os.path.join(folder, f"nothing-{i}"))  # (a lookup each)
data = open(small, "rb").read()
print(json.dumps([start, time.monotonic(), len(data)]))
"""


@pytest.mark.parametrize("how", ["direct", "buffered"])
@pytest.mark.daemon_log(r"fuse_reply_\* failed with No such file")  # (hers, killed)
def test_one_users_hundreds_of_reads_leave_anothers_lookups_and_reads_served(
        tmp_path: Path, how: str) -> None:
    """Alice keeps 150 cold reads of a file on a slow member in flight; bob's lookups,
    and his read of a file on a fast member, are served in his turn.  The daemon read
    FUSE requests with at most 64 tasks, each held until its request was answered:
    her direct reads took them all, and bob's lookups waited in the kernel's queue
    behind the rest of hers.  Her buffered reads filled the kernel's 12 background
    slots (every read of pages not cached is sent in the background), and his read
    waited behind them.  The daemon now reads with up to `fuse_tasks` tasks and
    raises the slots (`fs/fuse_conn.py`): inside, her reads wait their turn beside
    his.  (Before: 133-139 of hers were answered during his.)"""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    fast = make_members(tmp_path / "fast", 1)[0]
    with slow_member(tmp_path, 32_000) as (slow, throttle, _):  # (8 of her reads a second)
        mkfs([fast, slow], "64KiB")
        with mount_with([fast, slow], "io_threads=4") as m:
            folders = {}
            for name, member in (("alice", 1), ("bob", 0)):  # (each wholly on one)
                folders[name] = m.path / name
                folders[name].mkdir()
                mxfs("setstripe", "--width", "1", str(folders[name]))
                folders[name] = next(p for p in (folders[name] / f"{i}.bin" for i in range(16))
                                     if p.write_bytes(b"x" * (4 << 20 if name == "alice"
                                                              else 100_000)) and
                                     _first_member(m, p) == member)
            big, small = folders["alice"], folders["bob"]
            os.chown(big, alice.uid, alice.gid)
            os.chown(small.parent, bob.uid, bob.gid)
            os.chown(small, bob.uid, bob.gid)
            subprocess.run(["sync"], check=True)
            for cached in [*Path(slow).rglob("chunks/*/*"), *Path(fast).rglob("chunks/*/*"),
                           big, small]:  # (the members' pages, and the mount's)
                fd = os.open(cached, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            throttle(m.daemon_pid())
            flood = _as(alice, _ALICE_PAGES, str(big), "150", how)
            try:
                done = _times_read(flood)
                assert eventually(lambda: len(done) >= 4, 60), "alice's reads never came"
                time.sleep(1)  # (all 150 asked by now)
                start, end, n = run_as(bob, _BOB_LOOKS, str(small.parent), str(small))
                assert n == 100_000
                during = sum(1 for t in list(done) if start <= t <= end)
                assert during <= 3, f"{during} of alice's reads finished during bob's"
            finally:  # (her reads in flight land at once, the daemon out of the slow
                # cgroup: a process killed in a FUSE request ends once it is answered)
                Path("/sys/fs/cgroup/blkio/cgroup.procs").write_text(str(m.daemon_pid()))
                flood.kill()
                flood.wait()


_REOPEN = """
import contextlib, time
path, rounds = sys.argv[1], int(sys.argv[2])
got = []
for r in range(rounds):
    p = f"{path}.{r}"
    while not os.path.exists(p):
        time.sleep(0.001)
    o = os.open(p, os.O_PATH)  # (no open through the mount: the daemon counts none)
    print("held", flush=True)
    while True:
        try:
            if not os.fstat(o).st_nlink:
                break
        except FileNotFoundError:  # (freed already, on a busy machine, before a look
            break  # found it removed)
        time.sleep(0.0005)
    try:  # (removed, not yet freed: reopened through the link /proc keeps)
        fd = os.open(f"/proc/self/fd/{o}", os.O_RDWR)
    except OSError as e:
        got.append(errno.errorcode[e.errno])
    else:
        got.append("opened")
        for i in range(1, 5):
            with contextlib.suppress(OSError):
                os.pwrite(fd, b"!", i * (8 << 20))
        with contextlib.suppress(OSError):
            os.close(fd)
    os.close(o)
print(json.dumps(got), flush=True)
"""


def test_a_removed_file_is_not_opened_again_while_it_is_freed(pool: Mounted) -> None:
    """Bob's file is removed while alice holds it by an O_PATH descriptor (which opens
    nothing through the mount); her reopen through /proc is ESTALE, as on a reading
    node.  It was opened: the freeing, begun already, took the file's bytes from bob's
    quota, then her writes to the freed file added to it for good (bob's count said
    58 MiB of 64 for a file of none)."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    folder = pool.path / "reopened"
    folder.mkdir()
    folder.chmod(0o1777)

    def bobs_file_bytes() -> int:
        lines = json.loads(mxfs("quota", str(pool.path), "--json").stdout)["users"]
        line = next((u for u in lines if u["uid"] == bob.uid), None)
        return 0 if line is None else int(line["bytes"] - line["name_bytes"]
                                          - line["xattr_bytes"])
    before, rounds = bobs_file_bytes(), 8
    reopen = _as(alice, _REOPEN, str(folder / "f"), str(rounds))
    assert reopen.stdout is not None
    try:
        for r in range(rounds):
            f = folder / f"f.{r}"
            f.write_bytes(b"b" * (1 << 20))
            os.chown(f, bob.uid, bob.gid)
            f.chmod(0o666)
            assert reopen.stdout.readline() == "held\n"
            f.unlink()
        got = json.loads(reopen.stdout.readline())
    finally:
        reopen.kill()
        reopen.wait()
    assert set(got) <= {"ESTALE", "ENOENT"}, got
    assert eventually(lambda: bobs_file_bytes() == before, 10), (bobs_file_bytes(), before)
    shutil.rmtree(folder)


def _first_member(m: Mounted, path: Path) -> int:
    with ControlClient(str(m.path)) as c:
        return int(c.layout(str(path))["layout"]["first_member"])


def _as(user: Any, script: str, *args: str, stderr: int | None = None,
        stdin: int | None = None) -> subprocess.Popen[str]:
    """`script` (after users.PRELUDE) run as `user` in the background, stdout piped."""
    return subprocess.Popen(as_user(user, script, *args), stdout=subprocess.PIPE,
                            stderr=stderr, stdin=stdin, text=True)


def _times_read(flood: subprocess.Popen[str]) -> list[float]:
    """The times `flood` prints (one a read it finished), gathered as they come by a
    thread of their own: a test checks which fell in another user's reads."""
    out, done = flood.stdout, list[float]()
    assert out is not None
    threading.Thread(target=lambda: done.extend(float(line) for line in out),
                     daemon=True).start()
    return done


@contextlib.contextmanager
def _as_with_flags(user: Any, script: str, *args: str
                   ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """`script` run as `user` (`_as`, stderr piped too), given after `args` a folder
    anyone may write, where the test and the script leave each other flags (files);
    killed at the end.  (Not under tmp_path: another user may not walk it.)"""
    flags = Path(tempfile.mkdtemp(prefix="mxfs-flags-"))
    flags.chmod(0o777)
    proc = _as(user, script, *args, str(flags), stderr=subprocess.PIPE)
    try:
        yield proc, flags
    finally:
        proc.kill()
        proc.communicate(timeout=60)
        shutil.rmtree(flags, ignore_errors=True)


_ALICE_HOLDS = """
from mxfs.client import ControlClient
mp, conns, each = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
clients, made = [], []
for i in range(conns):
    clients.append(ControlClient(mp))
    for j in range(each):
        reply, fds = clients[-1].call_with_fds("create", path=f"/alice/{i}-{j}", size=1 << 20)
        for fd in fds:
            os.pwrite(fd, b"a" * 65536, 0)
            os.close(fd)
        made.append([reply["ino"], reply["members"]])
print(json.dumps(made), flush=True)
sys.stdin.readline()
os._exit(0)  # (every connection closed at once)
"""

_BOB_COMMITS = """
from mxfs.client import ControlClient
c = ControlClient(sys.argv[1])
made, fds = c.call_with_fds("create", path="/bob/report", size=0)
for fd in fds:
    os.close(fd)
print("ready", flush=True)
sys.stdin.readline()
c.call("commit", ino=made["ino"], size=0, sum_unit=65536, sums="")
print("committed", flush=True)
"""


def test_one_users_closes_leave_anothers_commit_served(tmp_path: Path) -> None:
    """Alice holds 1,024 unpublished files (the per-user limit) over 512 connections and
    closes them all at once: each file's chunk files are cut, the cut fsynced on the
    metadata member.  Bob's commit meanwhile is answered while most of her cuts are
    still to come: they take turns with everyone's settling (two threads of four hers
    at most), and his commit's sync and the kernel's invalidation have threads of their
    own.  (Before, her cuts went first come first served on trio's shared threads, and
    his commit's sync and invalidation waited behind them all: 980-1,014 of hers were
    cut while he waited; now 5-24.)"""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members) as m:
        for user in (alice, bob):
            folder = m.path / user.name.removeprefix("mxfs-")
            folder.mkdir()
            os.chown(folder, user.uid, user.gid)
        holder = _as(alice, _ALICE_HOLDS, str(m.path), "512", "2", stdin=subprocess.PIPE)
        committer = _as(bob, _BOB_COMMITS, str(m.path), stdin=subprocess.PIPE)
        try:
            assert holder.stdout is not None and holder.stdin is not None
            assert committer.stdout is not None and committer.stdin is not None
            made = json.loads(holder.stdout.readline())
            assert len(made) == 1024
            last = [Path(members[max(held)], "chunks", f"{ino % 256:02x}", str(ino))
                    for ino, held in made]  # (each file's last chunk file: cut last)

            def cut() -> int:
                n = 0
                for path in last:
                    try:
                        n += path.stat().st_size == 0
                    except FileNotFoundError:
                        n += 1  # (cut, released and reclaimed)
                return n
            assert cut() == 0
            assert committer.stdout.readline() == "ready\n"
            holder.stdin.write("close\n")
            holder.stdin.flush()
            assert holder.wait(60) == 0
            assert eventually(lambda: cut() > 0, 30), "alice's files were never cut"
            before = cut()
            committer.stdin.write("commit\n")
            committer.stdin.flush()
            assert committer.stdout.readline() == "committed\n"
            during = cut() - before
            assert during <= 128, f"{during} of alice's 1024 files were cut during bob's commit"
            assert eventually(lambda: cut() == 1024, 60)
        finally:
            for proc in (holder, committer):
                proc.kill()
                proc.wait()


_COMMITS_AT_ONCE = """
import threading
from mxfs.client import ControlClient
def commit(path):
    c = ControlClient(sys.argv[1])
    made, fds = c.call_with_fds("create", path=path, size=0)
    for fd in fds:
        os.close(fd)
    c.call("commit", ino=made["ino"], size=0, sum_unit=65536, sums="")
    os.write(1, (path + "\\n").encode())  # (one write: print's two interleave)
threads = [threading.Thread(target=commit, args=(p,)) for p in sys.argv[2:]]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def _commits(user: Any, mp: Path, *paths: str) -> list[str]:
    """`user` commits empty files at `paths` at once, a connection each: those answered
    (in a minute at most: the rest are not)."""
    proc = _as(user, _COMMITS_AT_ONCE, str(mp), *paths)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return sorted(out.split())


def test_a_directory_one_user_holds_stalls_no_commit(tmp_path: Path) -> None:
    """Alice holds the lock of a directory she may list (a listing of it waiting in the
    kernel for good, `dir_lock.py`; a page of her own FUSE mount's would do), and the
    commits of bob's files into it are answered all the same, 20 at once: their names'
    invalidations, which the kernel makes only once she lets go, are waited for a
    while, not forever; a commit into another directory meanwhile is answered and its
    name shown at once (its kernel had kept "no such name").  Before, each of his
    commits waited for the invalidation: never answered, each holding one of a pool of
    16 threads for good, and past 16 everyone's commits hung, anywhere."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members) as m:
        shared, bobs = m.path / "shared", m.path / "bob"
        shared.mkdir()
        shared.chmod(0o1777)
        (shared / "f").write_bytes(b"f")
        bobs.mkdir()
        os.chown(bobs, bob.uid, bob.gid)
        in_shared = [f"/shared/b{i:02d}" for i in range(20)]
        with held_dir_lock(shared, alice):
            assert _commits(bob, m.path, *in_shared) == in_shared
            assert not (bobs / "report").exists()  # (the kernel keeps "no such name")
            assert _commits(bob, m.path, "/bob/report") == ["/bob/report"]
            assert (bobs / "report").exists()
        assert eventually(lambda: all(m.path.joinpath(p[1:]).exists() for p in in_shared))


@pytest.mark.unit
def test_a_uid_has_a_few_requests_in_service_at_once_root_any() -> None:
    from mxfs.fs.fair import Turns

    turns = Turns(3)
    inside = {5: 0, 0: 0}
    most = {5: 0, 0: 0}

    async def request(uid: int, release: trio.Event) -> None:
        async with turns.turn(uid):
            inside[uid] += 1
            most[uid] = max(most[uid], inside[uid])
            await release.wait()
            inside[uid] -= 1

    async def main() -> None:
        release = trio.Event()
        async with trio.open_nursery() as nursery:
            for uid in [5] * 10 + [0] * 10:
                nursery.start_soon(request, uid, release)
            await trio.testing.wait_all_tasks_blocked()
            assert turns.waiting() == {5: 10}
            release.set()

    trio.run(main)
    assert most == {5: 3, 0: 10}
    assert turns.waiting() == {}


@pytest.mark.unit
def test_a_request_that_steps_aside_gives_its_turn_and_takes_one_back() -> None:
    from mxfs.fs.fair import Turns

    turns = Turns(2)
    log: list[str] = []

    async def waiter(go: trio.Event) -> None:
        async with turns.turn(5):
            async with turns.aside(5):
                await go.wait()
            log.append("waiter back")

    async def other(i: int, release: trio.Event) -> None:
        async with turns.turn(5):
            log.append(f"other {i}")
            await release.wait()

    async def main() -> None:
        go, release = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, go)
            nursery.start_soon(waiter, go)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(2):  # both turns are free while the two wait aside
                nursery.start_soon(other, i, release)
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(log) == ["other 0", "other 1"]
            go.set()  # back in line: behind the two that hold the turns now
            await trio.testing.wait_all_tasks_blocked()
            assert len(log) == 2
            release.set()
        assert log[2:] == ["waiter back", "waiter back"]
        assert turns.waiting() == {}
        async with trio.open_nursery() as nursery:  # (the turns are whole again: two)
            release = trio.Event()
            for i in range(3):
                nursery.start_soon(other, i, release)
            await trio.testing.wait_all_tasks_blocked()
            assert len(log) == 6  # (two of the three in)
            release.set()

    trio.run(main)


WAITS_ON_CLAIMS = r"""
import base64, threading
m, ns = sys.argv[1], sys.argv[2]
done = []
def wait(i):
    with mxfs.client.ControlClient(m) as c:
        key = base64.b64encode(b"w%d" % i).decode()
        done.append(c.call("kv_wait", namespace=ns, keys=[key], ms=20000,
                           shared=True)["present"][0])
threads = [threading.Thread(target=wait, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
sys.stdin.readline()
with mxfs.client.ControlClient(m) as c:
    present = c.call("kv_exists", namespace=ns, keys=["b3RoZXI="], shared=True)["present"]
print(json.dumps({"exists": present, "waits_done": len(done)}), flush=True)
for t in threads:
    t.join()
print(json.dumps(sorted(done)), flush=True)
"""


@contextlib.contextmanager
def _beside(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`script` running as bob beside the test (stdin and stdout piped, lines told with
    `_tell`), killed after whatever happened."""
    from users import as_user

    proc = subprocess.Popen(as_user(ensure_users()["bob"], script, *args),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_a_users_waits_on_others_claims_leave_her_turns_to_her_other_requests(
        pool: Mounted) -> None:
    """A kv_wait on keys another user claimed held one of its caller's turns until the
    keys were put (up to a minute): eight such waits, and every other request of hers
    (any namespace, any file) waited behind them.  A wait now steps out of her turns
    while it waits."""

    bob = ensure_users()["bob"]
    ns = "claimed-by-root"
    keys = [base64.b64encode(b"w%d" % i).decode() for i in range(8)]
    with ControlClient(str(pool.path)) as root:
        root.call("kv_ns_create", namespace=ns, mode=0o755)
        assert root.call("kv_claim", namespace=ns, keys=keys, ms=60000)["state"] == \
            ["yours"] * 8
        with _beside(WAITS_ON_CLAIMS, str(pool.path), ns) as proc:
            def waiting() -> int:
                by_user = root.stat()["limits"]["by_user"]
                return int(by_user.get(str(bob.uid), {}).get("requests", 0))
            assert eventually(lambda: waiting() == 8)  # (all eight in the daemon)
            _tell(proc, "go")
            assert json.loads(proc.stdout.readline()) == {"exists": [False], "waits_done": 0}
            root.call("kv_put", namespace=ns, keys=keys,
                      data=[base64.b64encode(b"v").decode()] * 8)
            assert json.loads(proc.stdout.readline()) == [True] * 8
            assert proc.wait(30) == 0
        root.call("kv_ns_remove", namespace=ns)


PINS_A_SHARED_CHUNK = r"""
m, ns = sys.argv[1], sys.argv[2]
with mxfs.client.ControlClient(m) as c:
    print(json.dumps(c.call("kv_pin", namespace=ns, keys=["aw=="], shared=True)["pinned"]),
          flush=True)
    sys.stdin.readline()
    print(json.dumps([attempt(c.call, op, namespace=ns, keys=["aw=="], shared=True)
                      for op in ("kv_unpin", "kv_exists")]), flush=True)
"""


def test_a_reader_shut_out_of_a_namespace_loses_her_leases_in_it(pool: Mounted) -> None:
    """A read lease (`kv_pin`) keeps a chunk from eviction.  A reader the owner shut
    out (chmod, chgrp) kept hers for as long as her connection stayed open: chunks she
    could no longer get held the namespace past its capacity, charged to their writers.
    They end with her right to read now, as presence tables do."""

    bob = ensure_users()["bob"]
    ns = "shut-out"

    def pinned() -> tuple[int, int]:
        (stats,) = root.call("kv_stats", namespace=ns)["namespaces"]
        by_user = root.stat()["limits"]["by_user"]
        return stats["pinned"], by_user.get(str(bob.uid), {}).get("pins", 0)
    with ControlClient(str(pool.path)) as root:
        root.call("kv_ns_create", namespace=ns, mode=0o755)
        root.call("kv_put", namespace=ns, keys=["aw=="], data=["dg=="])
        with _beside(PINS_A_SHARED_CHUNK, str(pool.path), ns) as proc:
            assert json.loads(proc.stdout.readline()) == [True]
            assert pinned() == (1, 1)
            root.call("kv_ns_set", namespace=ns, mode=0o754)  # (read kept: he keeps it)
            assert pinned() == (1, 1)
            root.call("kv_ns_set", namespace=ns, mode=0o700)
            assert pinned() == (0, 0)  # (her connection still open)
            assert root.call("kv_evict", namespace=ns, keep=0)["evicted"] == 1
            _tell(proc, "go")
            assert json.loads(proc.stdout.readline()) == [errno.ENOENT] * 2
            assert proc.wait(30) == 0
        assert pinned()[0] == 0
        root.call("kv_ns_remove", namespace=ns)


CLAIMS_A_SHARED_KEY = r"""
m, ns = sys.argv[1], sys.argv[2]
with mxfs.client.ControlClient(m) as c:
    print(json.dumps(c.call("kv_claim", namespace=ns, keys=["aw=="], ms=60000,
                            shared=True)["state"]),
          flush=True)
    sys.stdin.readline()
"""


def test_a_writer_shut_out_of_a_namespace_loses_her_claims_in_it(pool: Mounted) -> None:
    """A claim tells every other writer of its key "busy" and holds their waits.  A
    writer the owner shut out kept hers for up to a minute, on keys she could no
    longer put; they end with her right to write."""
    ns = "shut-out-claims"
    with ControlClient(str(pool.path)) as root:
        root.call("kv_ns_create", namespace=ns, mode=0o777)
        with _beside(CLAIMS_A_SHARED_KEY, str(pool.path), ns) as proc:
            assert json.loads(proc.stdout.readline()) == ["yours"]
            root.call("kv_ns_set", namespace=ns, mode=0o757)  # (write kept: she keeps it)
            assert root.call("kv_claim", namespace=ns, keys=["aw=="], ms=1)["state"] == \
                ["busy"]
            root.call("kv_ns_set", namespace=ns, mode=0o755)
            assert root.call("kv_claim", namespace=ns, keys=["aw=="], ms=1)["state"] == \
                ["yours"]  # (her connection still open)
            _tell(proc, "go")
            assert proc.wait(30) == 0
        root.call("kv_ns_remove", namespace=ns)


PINNED_GETS = r"""
import base64, threading
m, ns = sys.argv[1], sys.argv[2]
keys = [base64.b64encode(b"k%d" % i).decode() for i in range(1024)]
conns = [mxfs.client.ControlClient(m) for _ in range(24)]
stop, got = threading.Event(), {"ok": 0, "refused": 0}
def gets(c, j):
    while not stop.is_set():
        j = (j + 1) % 16
        try:
            _, fds = c.call_with_fds("kv_get", namespace=ns, shared=True, pin=True,
                                     keys=keys[j * 64:(j + 1) * 64])
            for fd in fds:
                os.close(fd)
            got["ok"] += 1
        except OSError:
            got["refused"] += 1
threads = [threading.Thread(target=gets, args=(c, j)) for j, c in enumerate(conns)]
for t in threads:
    t.start()
print("going", flush=True)
sys.stdin.readline()
stop.set()
for t in threads:
    t.join()
print(json.dumps(got), flush=True)
sys.stdin.readline()  # (her connections held open until told)
"""


def test_gets_in_flight_when_a_reader_is_shut_out_leave_her_no_leases(
        pool: Mounted) -> None:
    """Bob's pinned gets run on 24 connections when the namespace's owner shuts him out:
    once they end, his connections still open, he holds no read lease there.  A get
    judged before the chmod and waiting on its opens meanwhile had nothing for the
    chmod to end, then leased (and handed out) what he could read no more: 128 leases
    kept.  A get is judged again once its opens are done."""

    bob = ensure_users()["bob"]
    ns = "shut-out-in-flight"
    with ControlClient(str(pool.path)) as root:
        root.call("kv_ns_create", namespace=ns, mode=0o755)
        keys = [base64.b64encode(b"k%d" % i).decode() for i in range(1024)]
        for i in range(0, 1024, 64):
            root.call("kv_put", namespace=ns, keys=keys[i:i + 64],
                      data=[base64.b64encode(os.urandom(8192)).decode()] * 64)
        with _beside(PINNED_GETS, str(pool.path), ns) as proc:
            assert proc.stdout.readline() == "going\n"
            time.sleep(1)
            root.call("kv_ns_set", namespace=ns, mode=0o700)
            time.sleep(0.5)
            _tell(proc, "stop")
            got = json.loads(proc.stdout.readline())
            assert got["ok"] and got["refused"], got
            (stats,) = root.call("kv_stats", namespace=ns)["namespaces"]
            by_user = root.stat()["limits"]["by_user"]
            assert (stats["pinned"], by_user.get(str(bob.uid), {}).get("pins", 0)) == (0, 0)
            _tell(proc, "go")
            assert proc.wait(30) == 0
        root.call("kv_ns_remove", namespace=ns)


@pytest.mark.unit
def test_one_users_slow_commits_leave_others_a_settling_thread() -> None:
    """Commits settle (stat, truncate, sync) in four threads shared by every user: one
    user's four commits of files with gigabytes of dirty pages held all four through
    their syncs, everyone's commits behind them.  One uid holds two at most now."""
    import threading

    from mxfs.fs.session import SETTLERS, settle_off_loop

    held = threading.Event()
    running: list[int] = []

    def slow_sync(uid: int) -> None:
        running.append(uid)
        held.wait(30)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(SETTLERS):
                nursery.start_soon(settle_off_loop, 1001, slow_sync, 1001)
            with trio.fail_after(10):  # (bob's commit settles while alice's sync on)
                while len(running) < SETTLERS // 2:
                    await trio.sleep(0.01)
                await settle_off_loop(1002, lambda: None)
            await trio.sleep(0.1)
            assert running == [1001] * (SETTLERS // 2)
            held.set()

    trio.run(main)
    assert running == [1001] * SETTLERS


@pytest.mark.unit
def test_shared_slots_go_round_the_users_and_one_holds_a_few() -> None:
    """Four slots, one uid (but root) holding three at most: a flood of one uid leaves
    the fourth to another at once; freed slots go to the uid that waited longest, each
    in turn; a call cancelled in line, or cancelled just as a slot passed to it,
    leaves every slot usable."""
    from mxfs.fs.fair import RoundRobin

    line = RoundRobin(4, 3)
    order: list[int] = []
    releases: dict[int, trio.Event] = {}

    async def call(uid: int, n: int) -> None:
        async with line.slot(uid):
            order.append(uid)
            releases[n] = trio.Event()
            await releases[n].wait()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(call, 5, n)
                await trio.testing.wait_all_tasks_blocked()
            assert (line.busy(), line.queued()) == (3, 7)
            nursery.start_soon(call, 6, 100)
            await trio.testing.wait_all_tasks_blocked()
            assert order == [5, 5, 5, 6] and line.queued() == 7
            for n, uid in ((101, 6), (102, 0), (103, 7)):
                nursery.start_soon(call, uid, n)
                await trio.testing.wait_all_tasks_blocked()
            gone = trio.CancelScope()

            async def cancelled() -> None:
                with gone:
                    await call(8, 200)
            nursery.start_soon(cancelled)
            await trio.testing.wait_all_tasks_blocked()
            gone.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert line.queued() == 10
            # One slot frees at a time: uid 5 (in line first), then 6, 0, 7, 5 again;
            # then only 5 waits, holding three: the fourth stays free for others.
            for n in (0, 100, 1, 101, 102, 103):
                releases[n].set()
                await trio.testing.wait_all_tasks_blocked()
            assert order[4:] == [5, 6, 0, 7, 5]
            assert (line.busy(), line.queued()) == (3, 5)
            for n in list(releases):
                releases[n].set()
            while line.busy():
                for n in list(releases):
                    releases[n].set()
                await trio.testing.wait_all_tasks_blocked()
        assert (line.busy(), line.queued()) == (0, 0)

    trio.run(main)
    assert order.count(5) == 10 and order.count(8) == 0


@pytest.mark.unit
def test_store_worker_calls_take_turns_by_uid(tmp_path: Path) -> None:
    """A reading node's lookups share one store connection: a user with eight calls
    queued waits behind its own, and another user's call waits for one of them besides
    the one running, not for all eight; a call cancelled in line leaves the line
    working."""
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.meta import MetaStore

    MetaStore.format(str(tmp_path), "0" * 32, 1 << 20).close()
    worker = StoreWorker(str(tmp_path))
    ran: list[str] = []
    gate = threading.Event()

    def call(name: str) -> Any:
        def fn(store: MetaStore) -> None:
            gate.wait(10)  # (the first call holds the worker until every other queued)
            ran.append(name)
        return fn

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(8):  # (hog0 first: trio starts tasks in no set order)
                nursery.start_soon(worker.run, call(f"hog{i}"), 5)
                await trio.testing.wait_all_tasks_blocked()
            gone = trio.CancelScope()

            async def cancelled() -> None:
                with gone:
                    await worker.run(call("cancelled"), 6)
            nursery.start_soon(cancelled)
            await trio.testing.wait_all_tasks_blocked()
            gone.cancel()
            nursery.start_soon(worker.run, call("victim"), 7)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()

    trio.run(main)
    worker.close()
    # Round robin: the uid in line first (the hog's) has one call, then the victim's.
    assert ran[:3] == ["hog0", "hog1", "victim"]
    assert sorted(ran[3:]) == [f"hog{i}" for i in range(2, 8)]


def _three_chunks(vol: Volume, index: KVIndex, owner: int, gid: int, mode: int) -> Any:
    """Namespace "n" of `owner` (group `gid`, `mode`) holding chunks k0, k1, k2 of one
    byte, in the store and the index."""
    from mxfs.vol.kv_index import Chunk, Namespace

    space = index.spaces["n"] = Namespace("n", owner, gid, mode, 0)
    for i in range(3):
        vol.store.engine.insert("kv", {"ns": "n", "key": b"k%d" % i, "ino": 1000 + i,
                                       "size": 1, "atime": 0})
        space.chunks[b"k%d" % i] = Chunk(ino=1000 + i, size=1, atime=0, sum_unit=1,
                                         sums=b"", tenant=owner)
    vol.store.commit()
    return space


def test_requests_on_a_namespace_do_not_wait_for_its_table_to_fill(tmp_path: Path) -> None:
    """Every op on a namespace grew its presence table after it, waiting for a fill
    another request had begun: a fill of a million keys, read a bite at a time in
    another user's turns, held bob's puts and lookups in the namespace all along (and
    a writer who put and deleted keys in a loop had it rebuilt again and again).  Only
    `kv_view` waits for the table now; the rest answer and go."""
    from mxfs.fs.session import Session
    from mxfs.vol.access import Caller

    alice, bob, carol = 7001, 7002, 7003
    with _kv_volume(tmp_path) as (vol, index, kv):
        handlers = kv.handlers()
        space = _three_chunks(vol, index, alice, alice, 0o755)
        gate = threading.Event()
        answers: dict[str, Any] = {}

        def session(uid: int) -> Session:
            return Session(Caller(1, uid, uid, frozenset({uid})))

        async def ask(op: str, msg: dict[str, Any], uid: int) -> None:
            answers[op] = await handlers[op](msg, session(uid))

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kv.rows.run, lambda s: gate.wait(10), carol)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ask, "kv_view", {"namespace": "n"}, alice)
                await trio.testing.wait_all_tasks_blocked()
                assert space.next_view is not None and answers == {}  # (being filled)
                nursery.start_soon(ask, "kv_exists", {"namespace": "n", "shared": True,
                                                      "keys": ["azE="]}, bob)
                await trio.testing.wait_all_tasks_blocked()
                assert answers == {"kv_exists": ({"present": [True]}, [])}
                gate.set()

        trio.run(main)
        _, fds = answers["kv_view"]
        for fd in fds:
            os.close(fd)
        assert space.view is not None and space.view.count == 3


@contextlib.contextmanager
def _kv_volume(tmp_path: Path) -> Iterator[tuple[Volume, KVIndex, KVOps]]:
    """A fresh pool's volume opened in this process, with its KV index and `KVOps`:
    the KV ops' rounds driven straight, no daemon between.  Closed after."""
    members = make_members(tmp_path)
    mkfs(members)
    vol = Volume.open(members[0])
    try:
        index = KVIndex(vol)
        kv = KVOps(vol, index)
        try:
            yield vol, index, kv
        finally:
            kv.rows.close()
    finally:
        vol.store.close()


class _Walked(OrderedDict):  # type: ignore[type-arg]
    """A namespace's chunks that count the pinned ones an eviction walks past."""

    passed = 0

    def move_to_end(self, key: Any, last: bool = True) -> None:
        _Walked.passed += 1
        super().move_to_end(key, last)


def _evictable(index: Any, name: str, uid: int, pinned: int, unpinned: int) -> Any:
    """Namespace `name` of `uid`'s, its `pinned` chunks first, then `unpinned` (no files:
    what an eviction's choice reads of it)."""
    from mxfs.vol.kv_index import Chunk, Namespace

    space = index.spaces[name] = Namespace(name, uid, uid, 0o700, 0)
    space.chunks = _Walked()
    for i in range(pinned + unpinned):
        c = space.chunks[b"%d" % i] = Chunk(ino=1, size=4096, atime=0, sum_unit=4096,
                                            sums=b"", tenant=uid, pins=int(i < pinned))
        space.used += c.cost
        space.pinned_bytes += c.cost if c.pins else 0
    return space


def test_an_eviction_walks_past_a_bounded_number_of_pins(tmp_path: Path) -> None:
    """A user who pinned VICTIMS chunks in each of 32 namespaces had every put of every
    user, while the pool was short, walk past all of them (VICTIMS a namespace, 30 ms
    of the daemon's thread) to evict nothing.  Now about VICTIMS in all a call, and a
    namespace holding nothing unpinned is not walked: the next calls go on past them
    and find the chunks that may go."""
    from mxfs.vol.kv_index import PASS_FLOOR, VICTIMS

    with _kv_volume(tmp_path) as (_, index, _kv):
        for n in range(32):  # (p0: nothing but pins)
            _evictable(index, f"p{n}", 7001, VICTIMS, 10 if n else 0)
        head = next(iter(index.spaces["p0"].chunks))
        found: list[Any] = []
        for _ in range(40):
            _Walked.passed = 0
            found = index.fair_victims(1 << 30)
            assert _Walked.passed <= VICTIMS + PASS_FLOOR
            if found:
                break
        assert found and all(not s.chunks[k].pins for s, k in found)
        assert next(iter(index.spaces["p0"].chunks)) == head  # (never walked)


def test_one_users_pins_stop_no_eviction_of_the_others(tmp_path: Path) -> None:
    """With one budget of pinned chunks walked past for all namespaces, a user whose
    namespace came first, a quarter million pins and one chunk unpinned, spent it at
    every call: nothing was evicted from anyone, and every put failed ENOSPC while
    others held chunks that could go.  Each namespace passes its share, from a first
    taken in turn: the others lose chunks at every call."""
    with _kv_volume(tmp_path) as (_, index, _kv):
        _evictable(index, "alice", 7001, 250_000, 10)
        bob = _evictable(index, "bob", 7002, 0, 200_000)
        _evictable(index, "carol", 7003, 0, 1000)
        for _ in range(10):
            before = len(bob.chunks)
            victims = index.fair_victims(64 << 20)
            assert any(s is bob for s, _ in victims)
            index.drop(victims)
            assert len(bob.chunks) < before


def test_a_reader_shut_out_while_a_table_fills_gets_no_table(tmp_path: Path) -> None:
    """A presence table is a right to read a namespace's keys: bob, let in by its
    group, asks for one; while it is filled, the owner shuts the group out (which
    retires that fill) and asks for one herself.  Bob's request, waiting on the fill
    she began, was handed her table, kept current by every put and delete after; it
    is judged again once the table is there, and refused."""
    from mxfs.fs.session import Session
    from mxfs.vol.access import Caller

    alice, bob, carol, group = 7001, 7002, 7003, 7100
    with _kv_volume(tmp_path) as (vol, index, kv):
        handlers = kv.handlers()
        space = _three_chunks(vol, index, alice, group, 0o750)
        gate = threading.Event()
        answers: dict[str, Any] = {}

        async def ask(who: str, op: str, msg: dict[str, Any], uid: int) -> None:
            session = Session(Caller(1, uid, uid, frozenset({uid, group})))
            try:
                answers[who] = await handlers[op](msg, session)
            except OSError as e:
                answers[who] = e

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kv.rows.run, lambda s: gate.wait(10), carol)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ask, "bob", "kv_view", {"namespace": "n", "shared": True},
                                   bob)
                await trio.testing.wait_all_tasks_blocked()
                assert space.next_view is not None and answers == {}  # (being filled)
                await ask("chmod", "kv_ns_set", {"namespace": "n", "mode": 0o700}, alice)
                nursery.start_soon(ask, "alice", "kv_view", {"namespace": "n"}, alice)
                await trio.testing.wait_all_tasks_blocked()
                gate.set()

        trio.run(main)
        assert not isinstance(answers["chmod"], OSError), answers["chmod"]
        _, fds = answers["alice"]
        for fd in fds:
            os.close(fd)
        if not isinstance(answers["bob"], OSError):
            for fd in answers["bob"][1]:
                os.close(fd)
            pytest.fail("bob, shut out while the table filled, was handed it")
        assert answers["bob"].errno in (errno.EACCES, errno.ENOENT), answers["bob"]


def test_a_pin_of_thousands_of_keys_lets_others_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kv_pin` looked up and leased every key of its request at once: 4,096 held the
    daemon's thread about 12 ms.  It looks them up a bite at a time, stepping aside
    each slice (here every bite, whatever this CPU's speed): another user's request
    is answered in the middle of one, and the pin leases what it found."""
    from mxfs.fs import fair
    from mxfs.fs.kv_fields import MAX_BATCH

    monkeypatch.setattr(fair, "SLICE_S", 0.0)
    from mxfs.fs.session import Session
    from mxfs.vol.access import Caller
    from mxfs.vol.kv_index import Chunk, Namespace

    alice, bob = 7001, 7002
    with _kv_volume(tmp_path) as (vol, index, kv):
        handlers = kv.handlers()
        space = index.spaces["n"] = Namespace("n", alice, alice, 0o700, 0)
        keys = [b"k%06d" % i for i in range(MAX_BATCH)]
        for i, key in enumerate(keys):
            space.chunks[key] = Chunk(ino=1000 + i, size=1, atime=0, sum_unit=1, sums=b"",
                                      tenant=alice)
        index.spaces["b"] = Namespace("b", bob, bob, 0o700, 0)
        wire = [base64.b64encode(k).decode() for k in keys]
        seen: list[bool] = []

        def session(uid: int) -> Session:
            return Session(Caller(1, uid, uid, frozenset({uid})))

        async def main() -> None:
            for _ in range(10):  # (rounds, until bob is seen answered in the middle)
                pinned: list[Any] = []

                async def pin(s: Session, pinned: list[Any] = pinned) -> None:
                    pinned.append(await handlers["kv_pin"](
                        {"namespace": "n", "keys": wire}, s))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pin, session(alice))
                    await trio.testing.wait_all_tasks_blocked()  # (its first slice run)
                    await handlers["kv_exists"]({"namespace": "b", "keys": ["azE="]},
                                                session(bob))
                    seen.append(not pinned)
                assert pinned[0][0]["pinned"] == [True] * len(keys)
                if any(seen):
                    return

        trio.run(main)
        assert any(seen), "bob waited for every pin to end"


def test_a_chunk_indexed_counts_once_against_its_writers_limit_while_her_put_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's chunks count against the per-user chunk limit while being stored, and
    as stored once indexed: each is given back as it is indexed (all at the end, 4,096
    held the daemon's thread 20-30 ms, and the ones indexed counted twice meanwhile:
    her other puts were refused EDQUOT at half her limit)."""
    from mxfs.fs import fair
    from mxfs.fs.session import Session
    from mxfs.vol.access import Caller

    monkeypatch.setattr(fair, "SLICE_S", 0.0)  # (a slice an item: every count is seen)
    alice, n = 7001, 64
    keys = [base64.b64encode(b"c%03d" % i).decode() for i in range(n)]
    one = base64.b64encode(b"x").decode()
    with _kv_volume(tmp_path) as (vol, index, kv):
        handlers = kv.handlers()
        caller = Session(Caller(1, alice, alice, frozenset({alice})))
        counted: list[int] = []

        async def main() -> None:
            put: list[Any] = []

            async def put_all() -> None:
                put.append(await handlers["kv_put"](
                    {"namespace": "n", "keys": keys, "data": [one] * n}, caller))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(put_all)
                while not put:
                    counted.append(index.chunks_by_tenant[alice] +
                                   index.storing_by_tenant[alice])
                    await trio.sleep(0)
            assert put[0][0]["stored"] == [True] * n

        trio.run(main)
        assert index.chunks_by_tenant[alice] == n and not index.storing_by_tenant[alice]
        assert max(counted) == n, f"{max(counted)} chunks of hers counted at once, {n} put"


def test_a_rounds_access_time_write_back_lets_others_through(tmp_path: Path) -> None:
    """A group commit writes back TOUCH_BITE KV access times at most; in one statement
    that was 9 ms of the daemon's thread for 1 KiB keys, each round a user kept pinning
    keys.  It writes TOUCH_STEP a statement now and steps aside between: another
    user's requests are served in the middle of a round (seen in what it has left)."""
    from mxfs.vol.kv_index import TOUCH_BITE, Chunk, Namespace

    with _kv_volume(tmp_path) as (vol, index, kv):
        space = index.spaces["n"] = Namespace("n", 7001, 7001, 0o700, 0)
        keys = [b"%04d" % i + b"k" * 1020 for i in range(TOUCH_BITE + 44)]
        engine = vol.store.engine
        vol.store.txn(lambda: [engine.insert("kv", {"ns": "n", "key": k, "ino": 1000 + i,
                                                    "size": 1, "atime": 0})
                               for i, k in enumerate(keys)])
        for i, key in enumerate(keys):
            space.chunks[key] = Chunk(ino=1000 + i, size=1, atime=0, sum_unit=1, sums=b"",
                                      tenant=7001)
        seen: list[int] = []

        async def main() -> None:
            for _ in range(20):  # (rounds, until one is seen in its middle)
                for key in keys:  # (a user pinning them all again)
                    index.lookup(space, key)
                done = trio.Event()

                async def others(done: trio.Event) -> None:  # (another user's requests)
                    while not done.is_set():
                        seen.append(index.touches())
                        await trio.sleep(0.0001)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(others, done)
                    await trio.testing.wait_all_tasks_blocked()
                    await kv.flush()
                    done.set()
                assert index.touches() == 44
                await kv.flush()  # (the rest, in the next round)
                if any(44 < n < len(keys) for n in seen):
                    return

        trio.run(main)
        assert any(44 < n < len(keys) for n in seen), "no request ran during a round"
        assert index.touches() == 0
        assert {r[0] for r in engine.scan("kv", ("atime",))} != {0}


def test_kv_rows_for_a_table_or_a_listing_are_read_off_the_thread(tmp_path: Path) -> None:
    """Filling a namespace's presence table, and a kv_list page past a cursor, read its
    keys from the rows in key order: a bite of 1,024 held the daemon's thread 2 ms.
    They are read on a worker's connection now, in the asker's turn: another user's
    request is served while both wait there.  That connection sees committed rows
    only, so the open group is committed first: keys put just before are in both."""
    from mxfs.fs.session import Session
    from mxfs.meta.feed_notes import KV_STORED
    from mxfs.vol.access import Caller
    from mxfs.vol.kv_index import Chunk, Namespace

    alice, bob, carol = 7001, 7002, 7003
    with _kv_volume(tmp_path) as (vol, index, kv):
        handlers = kv.handlers()
        space = index.spaces["n"] = Namespace("n", alice, alice, 0o700, 0)
        index.spaces["b"] = Namespace("b", bob, bob, 0o700, 0)
        engine = vol.store.engine

        def put(keys: list[bytes]) -> None:
            for key in keys:
                ino = 1000 + len(space.chunks)
                engine.insert("kv", {"ns": "n", "key": key, "ino": ino, "size": 1,
                                     "atime": 0})
                vol.store.note_kv(KV_STORED, "n", key)  # (as `KVRows.publish` does)
                space.chunks[key] = Chunk(ino=ino, size=1, atime=0, sum_unit=1, sums=b"",
                                          tenant=alice)
        vol.store.txn(lambda: put([b"k%05d" % i for i in range(3000)]))
        vol.store.group_changes(60)  # (the daemon's groups: a worker sees none till commit)
        late = [b"a%d" % i for i in range(5)]  # (first in key order, in the open group)
        vol.store.txn(lambda: put(late))
        gate = threading.Event()
        answers: dict[str, Any] = {}

        def session(uid: int) -> Session:
            return Session(Caller(1, uid, uid, frozenset({uid})))

        async def ask(op: str, msg: dict[str, Any]) -> None:
            answers[op] = await handlers[op](msg, session(alice))

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kv.rows.run, lambda s: gate.wait(10), carol)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ask, "kv_view", {"namespace": "n"})
                nursery.start_soon(ask, "kv_list", {"namespace": "n", "after": "",
                                                    "limit": 1000})
                await trio.testing.wait_all_tasks_blocked()
                assert answers == {}  # (both wait for the worker: the thread is free)
                stats, _ = await handlers["kv_stats"]({}, session(bob))
                assert [s["namespace"] for s in stats["namespaces"]] == ["b"]
                gate.set()

        trio.run(main)
        listed = [base64.b64decode(k) for k, _, _ in answers["kv_list"][0]["chunks"]]
        assert listed == sorted(late) + [b"k%05d" % i for i in range(995)]
        _, fds = answers["kv_view"]
        for fd in fds:
            os.close(fd)
        assert space.view is not None and space.view.count == 3005


@pytest.mark.unit
def test_a_chown_of_a_folder_of_many_names_sums_them_off_the_thread(tmp_path: Path) -> None:
    """A chown moves a folder's names (its entries: a name is its directory's owner's)
    and xattrs from one owner's quota tally to the other's; their sum (17 ms for 65,000
    names) was taken on the daemon's thread, as often as a user chowned.  It is taken
    on a worker's connection now: another user's changes are made while it waits there,
    and a change to the folder's own names meanwhile has it summed again (the worker
    sees committed rows only)."""
    from mxfs.fs.owned import OwnedSums
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.meta import MetaStore
    from mxfs.meta.usage import NAME_ROW
    from mxfs.vol.quota import Quota, Quotas

    alice, bob, carol = 7001, 7002, 7003
    MetaStore.format(str(tmp_path), "0" * 32, 1 << 20).close()
    store = MetaStore.open(str(tmp_path))
    store.group_changes(60)  # (the daemon's groups: rows a worker cannot see till commit)
    quotas = Quotas(store)
    quotas.set(str(bob), Quota(bytes=1 << 30))
    node = store.create(1, b"d", 0o040755, alice, alice)
    fifo = store.create(node.ino, b"f", 0o010644, alice, alice)  # (a fifo: no layout)
    for i in range(1, 500):
        store.link(fifo.ino, node.ino, b"f%04d" % i)
    sums = OwnedSums(quotas, StoreWorker(str(tmp_path)))
    gate = threading.Event()
    done: list[tuple[int, int]] = []

    def held(s: MetaStore) -> None:
        gate.wait(10)

    async def chown() -> None:
        async with sums.of(node, bob, alice) as measured:
            owned = measured.now()
            assert owned is not None
            quotas.room_for_owner(node, bob, alice, owned)
            store.set_attrs(node, uid=bob, owned=owned)
            done.append(owned)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sums.worker.run, held, carol)  # (the worker busy first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(chown)
            await trio.testing.wait_all_tasks_blocked()
            assert not done  # (waiting for the worker: the thread is everyone's)
            store.create(1, b"carols", 0o010644, carol, carol)  # (another user served)
            store.link(fifo.ino, node.ino, b"late")  # (its names change meanwhile)
            gate.set()

    trio.run(main)
    sums.worker.close()
    names = sum(len(b"f%04d" % i) + NAME_ROW for i in range(1, 500)) + \
        len(b"f") + len(b"late") + 2 * NAME_ROW
    assert done == [(0, names)]  # (the late name in: summed again after it)
    assert store.usage.names[bob] == names and store.usage.names[alice] == 0
    store.close()


@pytest.mark.unit
def test_a_chown_moves_what_the_rows_hold_when_it_is_made(tmp_path: Path) -> None:
    """A chown measures a folder's names and a file's xattrs, then may wait more before
    it is made (a lent file's copy: `renew`).  Names linked and xattrs set meanwhile
    were charged to the old owner, and the sums measured before moved without them:
    the tally drifted from the rows until the next recount.  Sums the rows no longer
    hold are read again inside the change."""
    from mxfs.fs.owned import OwnedSums
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.meta import MetaStore
    from mxfs.vol.quota import Quota, Quotas

    alice, bob = 7001, 7002
    MetaStore.format(str(tmp_path), "0" * 32, 1 << 20).close()
    store = MetaStore.open(str(tmp_path))
    store.group_changes(60)
    quotas = Quotas(store)
    quotas.set(str(bob), Quota(bytes=1 << 30))
    folder = store.create(1, b"d", 0o040755, alice, alice)
    fifo = store.create(folder.ino, b"f", 0o010644, alice, alice)
    store.setxattr(fifo, b"user.a", b"v" * 100)
    sums = OwnedSums(quotas, StoreWorker(str(tmp_path)))
    waiting, resume = trio.Event(), trio.Event()

    async def chown(node: Any) -> None:
        async with sums.of(node, bob, alice) as measured:
            quotas.room_for_owner(node, bob, alice, measured.sums)
            waiting.set()
            await resume.wait()  # (the chown's await: a copy of the file, as `renew`)
            store.set_attrs(node, uid=bob, owned=measured.now())

    async def main(node: Any, meanwhile: Callable[[], None]) -> None:
        nonlocal waiting, resume
        waiting, resume = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chown, node)
            await waiting.wait()
            meanwhile()
            resume.set()

    try:
        trio.run(main, folder, lambda: store.link(fifo.ino, folder.ino, b"late"))
        trio.run(main, fifo, lambda: store.setxattr(fifo, b"user.b", b"w" * 4000))
        store.commit()
        def tally() -> list[dict[int, int]]:
            return [{u: n for u, n in c.items() if n}
                    for c in (store.usage.names, store.usage.xattrs)]
        moved = tally()
        store.count_usage()  # (what the rows hold, summed anew)
        assert moved == tally() and alice not in moved[0] and alice not in moved[1]
    finally:
        sums.worker.close()
        store.close()


def test_a_walk_through_long_link_chains_is_cut_short(pool: Mounted) -> None:
    """40 links of 1,600 components each would be 64,000 lookups on the daemon's
    thread for one request; past MAX_WALK components the walk is ELOOP."""
    from mxfs.vol.access import MAX_WALK

    home = pool.path / "walks"
    home.mkdir()
    depth = 200
    fd = os.open(home, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("a", dir_fd=fd)
        fd, old = os.open("a", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    (home / "target").write_bytes(b"t" * 10)
    for i in range(40):  # each link goes down `depth` folders and back up again
        os.symlink("a/" * depth + "../" * depth + (f"l{i - 1}" if i else "target"),
                   home / f"l{i}")
    assert 40 * 2 * depth > MAX_WALK
    with ControlClient(str(pool.path)) as c:
        assert c.call("layout", path="/walks/l1")["size"] == 10  # a short chain works
        with pytest.raises(OSError) as e:
            c.call("layout", path="/walks/l39")
    assert e.value.errno == errno.ELOOP
    assert (home / "l39").read_bytes() == b"t" * 10  # the kernel's own walk is its own



def test_descriptors_a_user_leaves_unread_are_bounded(tmp_path: Path) -> None:
    """The kernel does not count descriptors root sends against the receiver: a user
    who never reads its replies could pin any number of open files.  The daemon counts
    them per uid (max_fds_in_flight_per_user) until they are read, also after the
    connection closed on the daemon's side, and after the peer shut it down without
    closing its socket (what was sent stays in its queue, for it to read)."""
    from mxfs.proto.framing import recv_message

    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_fds_in_flight_per_user=40") as m:
        (m.path / "f").write_bytes(os.urandom(300_000))  # over 4 members: 4 a reply
        os.chmod(m.path / "f", 0o644)
        request = encode({"op": "open_read", "path": "/f", "id": 1})
        os.setegid(65534)
        os.seteuid(65534)  # the connections are nobody's (SO_PEERCRED at connect)
        try:
            greedy = raw_socket(m)
            late = raw_socket(m)
        finally:
            os.seteuid(0)
            os.setegid(0)
        for _ in range(20):  # 80 descriptors asked for, none read
            greedy.sendall(request)
        assert eventually(lambda: _in_flight(m) == 40)
        # every one answered before any is read (reading frees room for the rest)
        assert eventually(lambda: _answered(m, "open_read") >= 20)
        late.sendall(request)
        reply, fds = recv_message(late)  # the first 10 replies hold all 40 it may have
        assert not reply["ok"] and reply["errno"] == errno.EMFILE, reply
        assert "max_fds_in_flight_per_user" in reply["error"]
        got = [recv_message(greedy) for _ in range(20)]
        assert [r["ok"] for r, _ in got] == [True] * 10 + [False] * 10
        for _, fds in got:
            for fd in fds:
                os.close(fd)
        late.sendall(request)  # read now: the bound is free again
        reply, fds = recv_message(late)
        assert reply["ok"] and len(fds) == 4
        for fd in fds:
            os.close(fd)
        for _ in range(10):  # unread again, and the daemon's side closed: still counted
            greedy.sendall(request)
        assert eventually(lambda: _in_flight(m) == 40)
        greedy.shutdown(socket.SHUT_RDWR)  # (the daemon's side hangs up: still unread)
        late.sendall(request)
        assert recv_message(late)[0]["errno"] == errno.EMFILE
        greedy.close()  # the peer lets go: its descriptors are closed by the kernel
        assert eventually(lambda: _asks(late, request))
        late.close()


def test_a_get_refused_for_descriptors_unread_takes_no_read_leases(tmp_path: Path) -> None:
    """A `kv_get` with `pin` takes read leases on what it found; a reply that cannot go
    as made (its caller holds max_fds_in_flight_per_user descriptors unread) is an
    EMFILE error instead, which tells her of none, and its leases are given back.
    Kept, they held the chunks from eviction and counted against her pins until her
    connection closed, leases she could not name to end."""
    from mxfs.kv import KVStore

    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_fds_in_flight_per_user=4") as m:
        key = base64.b64encode(b"k1").decode()
        get = {"op": "kv_get", "namespace": "leased", "keys": [key], "inline_max": 0}
        os.setegid(65534)
        os.seteuid(65534)  # (nobody's namespace and connections: SO_PEERCRED)
        try:
            with KVStore(str(m.path), "leased") as kv:
                kv.put(b"k1", os.urandom(300_000))
            greedy, late = raw_socket(m), raw_socket(m)
        finally:
            os.seteuid(0)
            os.setegid(0)
        for i in range(4):  # (a descriptor each, none read)
            greedy.sendall(encode({**get, "id": i}))
        assert eventually(lambda: _in_flight(m) == 4)
        late.sendall(encode({**get, "pin": True, "id": 9}))
        reply, fds = recv_message(late)
        assert not reply["ok"] and reply["errno"] == errno.EMFILE and not fds, reply
        with ControlClient(str(m.path)) as c:
            stats = {s["namespace"]: s for s in c.call("kv_stats")["namespaces"]}
        assert stats["leased"]["pinned"] == 0, "the refused get's lease was kept"
        for sock in (greedy, late):
            sock.close()


@pytest.mark.daemon_log(r"cannot reach this pool's mount point")
def test_a_user_who_cannot_reach_the_mount_point_is_refused_its_daemon(
        tmp_path: Path) -> None:
    """The control socket is open to everyone and judged each path from the pool's
    root down; the folders above the mount point are another file system's.  A pool
    mounted under a folder closed to nobody handed nobody chunk descriptors of a
    0644 file that `cat` refused him.  His connections are refused (EACCES) until
    the folder lets him by."""
    from mxfs.proto.framing import recv_message

    members = make_members(tmp_path)
    mkfs(members)
    closed = Path(tempfile.mkdtemp(prefix="mxfs-closed-"))
    mp = closed / "pool"
    mp.mkdir()
    closed.chmod(0o700)
    res = subprocess.run([sys.executable, "-m", "mxfs", "mount", "-o", "allow_other",
                          members[0], str(mp)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    try:
        (mp / "f").write_bytes(b"secret")
        (mp / "f").chmod(0o644)
        sock_path = os.getxattr(mp, "user.mxfs.control").decode()

        def nobody_asks() -> dict[str, Any]:
            os.setegid(65534)
            os.seteuid(65534)
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(30)
                s.connect(sock_path)
            finally:
                os.seteuid(0)
                os.setegid(0)
            with s:
                s.sendall(encode({"op": "open_read", "path": "/f", "id": 1}))
                reply, fds = recv_message(s)
            for fd in fds:
                os.close(fd)
            return reply

        reply = nobody_asks()
        assert not reply["ok"] and reply["errno"] == errno.EACCES, reply
        assert "mount point" in reply["error"]
        closed.chmod(0o755)
        assert eventually(lambda: nobody_asks()["ok"], timeout=10)
    finally:
        closed.chmod(0o755)
        subprocess.run([sys.executable, "-m", "mxfs", "umount", str(mp)],
                       capture_output=True, timeout=120)
        shutil.rmtree(closed, ignore_errors=True)


def _kernel_lets_by(folder: Path, uid: int, gid: int) -> bool:
    """Whether the kernel lets `uid` (with only `gid`) search `folder`: asked of it."""
    pid = os.fork()
    if pid == 0:  # (the child: only os calls, then _exit)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.stat(folder / "pool")
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


@pytest.mark.parametrize("mode, acl", [
    (0o755, "u:65534:---"), (0o750, "u:65534:r-x"), (0o750, "g:65534:r-x"),
    (0o755, "g:65534:---"), (0o755, "u:65534:r-x,m::r--"), (0o711, "g::---"),
    (0o700, "o::--x,m::---"), (0o755, None), (0o750, None)])
def test_a_folder_above_the_mount_point_is_judged_by_its_acl(mode: int, acl: str | None
                                                            ) -> None:
    """Judged by its mode bits alone, a folder above the mount point whose ACL shut a
    user out (u:nobody:---) let her daemon connections by, and one that let her in
    refused them.  The judgement is the kernel's, whatever the ACL."""
    from mxfs.fs.reach import MountReach

    folder = Path(tempfile.mkdtemp(prefix="mxfs-above-"))  # (every folder above: 0755)
    try:
        (folder / "pool").mkdir()
        folder.chmod(mode)
        if acl is not None:
            subprocess.run(["setfacl", "-m", acl, str(folder)], check=True)
        kernel = _kernel_lets_by(folder, 65534, 65534)
        reach = MountReach(str(folder / "pool"))
        assert reach.reaches(65534, frozenset({65534})) == kernel
        if acl is not None and acl.startswith("u:65534:") and "m::" not in acl:
            assert kernel == acl.endswith("x")  # (her named entry decides)
    finally:
        shutil.rmtree(folder)


HALF_SENT = r"""
import socket, threading
from mxfs.proto import HEADER, VERSION
from mxfs.proto.framing import recv_message
path, n, size, flags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
conns = []
for _ in range(n):
    conns.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    conns[-1].connect(path)
frame = HEADER.pack(b"MXFS", VERSION, 0, size) + b" " * (size - 1)  # all but its last byte
replies = [None] * n
def send(i):
    try:
        conns[i].sendall(frame)
    except OSError:
        pass  # refused and closed before all was taken
    try:
        replies[i] = recv_message(conns[i])[0]
    except Exception:
        pass  # closed without a word (too slow)
threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
open(os.path.join(flags, "sending"), "w").close()
for t in threads:
    t.join()
print(json.dumps(replies))
"""


def _bob_puts(m: Mounted, bob: Any) -> None:
    """A large request of bob's is served (its reply read)."""
    os.setegid(bob.gid)
    os.seteuid(bob.uid)  # (SO_PEERCRED: as of connect)
    try:
        bobs = ControlClient(str(m.path))
    finally:
        os.seteuid(0)
        os.setegid(0)
    with bobs:
        data = base64.b64encode(os.urandom(512 << 10)).decode()
        bobs.call("kv_put", namespace="bobs", keys=[base64.b64encode(b"k").decode()],
                  data=[data])


def _most_rss(pid: int, seconds: float) -> int:
    """The most resident memory the daemon had in the next `seconds`, in bytes."""
    most, end = _rss(pid), time.monotonic() + seconds
    while time.monotonic() < end:
        most = max(most, _rss(pid))
        time.sleep(0.05)
    return most


def _buffered(m: Mounted) -> dict[str, int]:
    """Bytes of control messages the daemon holds, by uid but root (whose asking is)."""
    with ControlClient(str(m.path)) as c:
        by_user = c.call("stat")["limits"]["by_user"]
    return {uid: held["bytes_buffered"] for uid, held in by_user.items()
            if uid != "0" and held["bytes_buffered"]}


BUDGET = 8 << 20  # the memory tests' max_buffered_per_user


@contextlib.contextmanager
def _budgeted(tmp_path: Path) -> Iterator[tuple[Mounted, int, str, Any, Any]]:
    """A pool mounted with max_buffered_per_user=BUDGET (and time to send a frame):
    it, its daemon's pid, its control socket's path, alice and bob."""
    users = ensure_users()
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, f"max_buffered_per_user={BUDGET}", "frame_timeout=20") as m:
        yield (m, m.daemon_pid(), os.getxattr(m.path, "user.mxfs.control").decode(),
               users["alice"], users["bob"])


def _rss(pid: int) -> int:
    """The daemon's resident memory, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.mark.daemon_log(r"slow for pid \d+ uid \d+ failed .*not sent whole in time",
                        r"buffered for pid \d+ uid \d+ failed .*max_buffered_per_user")
def test_one_users_half_sent_requests_hold_a_bounded_share_of_the_daemons_memory(
        tmp_path: Path) -> None:
    """A connection's inbox held a request while it arrived, up to 1 MiB for
    frame_timeout, counted by connection alone: a user's connections each sending
    all but the last byte of 1 MiB made the daemon hold 1 MiB each (0.5 GiB at her
    512).  Her connections together hold max_buffered_per_user: past it a request
    is not read until there is room, and refused (ENOBUFS, naming the limit) if none
    comes in time; another user is served meanwhile."""
    conns, size = 64, 1 << 20
    with _budgeted(tmp_path) as (m, pid, control, alice, bob):
        before = _rss(pid)
        with _as_with_flags(alice, HALF_SENT, control, str(conns), str(size)) as (proc, flags):
            assert eventually(lambda: (flags / "sending").exists(), timeout=60)
            most = _most_rss(pid, 4)  # (before any is refused)
            _bob_puts(m, bob)  # a large request of his, while alice's hold all of theirs
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        grew = most - before
        assert grew < BUDGET + (16 << 20), f"the daemon grew by {grew >> 20} MiB"
        refused = [r for r in json.loads(out) if r is not None]
        assert refused and all(r["errno"] == errno.ENOBUFS for r in refused), refused
        assert "max_buffered_per_user" in refused[0]["error"], refused[0]
        assert eventually(lambda: _buffered(m) == {})  # (all of hers came back)


STALLED_SENDERS = r"""
import socket, time
from mxfs.proto import HEADER, VERSION
path, n, mount = sys.argv[1], int(sys.argv[2]), sys.argv[3]
stalled = []
for _ in range(n):  # each sends half a request's bytes, and then nothing
    stalled.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    stalled[-1].connect(path)
    stalled[-1].sendall(HEADER.pack(b"MXFS", VERSION, 0, 65536) + b" " * 32768)
time.sleep(0.5)  # (the daemon has read what came)
with mxfs.client.ControlClient(mount) as c:
    answered = c.call("hello")["pool_uuid"]
def still_open(s):  # (nothing to read, no close: the daemon still waits for its bytes)
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
print(json.dumps({"answered": bool(answered), "open": sum(map(still_open, stalled))}))
"""


def test_a_users_stalled_senders_hold_none_of_her_reading_turns(tmp_path: Path) -> None:
    """A user's connections are read and parsed READERS_PER_USER at a time (the
    others wait for a turn, not every user's time: 64 connections each sending 1 MiB
    requests made another user's lookups wait 12 ms for every one of hers read); a
    turn is taken only once bytes wait to be read.  Her connections that sent half a
    request and stopped hold none: her next request on another connection is
    answered while they still wait (held, it waited for them to be closed as too
    slow, frame_timeout later)."""
    from mxfs.fs.listener import READERS_PER_USER

    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "frame_timeout=30") as m:
        control = os.getxattr(m.path, "user.mxfs.control").decode()
        got = run_as(alice, STALLED_SENDERS, control, str(READERS_PER_USER * 4),
                     str(m.path))
        assert got == {"answered": True, "open": READERS_PER_USER * 4}, got


UNREAD_REPLIES = r"""
import base64, socket
from mxfs.proto import encode
mount, path, n, flags = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
key = base64.b64encode(b"big").decode()
with mxfs.client.ControlClient(mount) as c:  # a chunk a get answers inline
    c.call("kv_put", namespace="alices", keys=[key],
           data=[base64.b64encode(b"x" * (500 << 10)).decode()])
ask = encode({"op": "kv_get", "id": 1, "namespace": "alices", "keys": [key],
              "inline_max": 1 << 20})
conns = []
for _ in range(n):  # each asks for it, and never reads its reply
    conns.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    conns[-1].connect(path)
    conns[-1].sendall(ask)
open(os.path.join(flags, "asked"), "w").close()
while not os.path.exists(os.path.join(flags, "stop")):
    time.sleep(0.05)
print(json.dumps("closed"))
"""


def test_one_users_unread_replies_hold_a_bounded_share_of_the_daemons_memory(
        tmp_path: Path) -> None:
    """A reply was held until its peer read it, for frame_timeout, on every connection:
    a user's connections each asking for 500 KiB inline and reading nothing made the
    daemon hold a copy or two of it each.  Her unsent replies count against
    max_buffered_per_user, and her requests are served only while they are under it
    (a reply is memory once made); another user is served meanwhile."""
    conns = 64
    with _budgeted(tmp_path) as (m, pid, control, alice, bob):
        before = _rss(pid)
        with _as_with_flags(alice, "import time\n" + UNREAD_REPLIES, str(m.path), control,
                            str(conns)) as (proc, flags):
            assert eventually(lambda: (flags / "asked").exists(), timeout=60)
            most = _most_rss(pid, 4)  # (before any is given up)
            _bob_puts(m, bob)
            (flags / "stop").touch()
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        grew = most - before
        assert grew < BUDGET + (16 << 20), f"the daemon grew by {grew >> 20} MiB"
        assert eventually(lambda: _buffered(m) == {})  # (all of hers came back)


@pytest.mark.unit
def test_a_users_room_to_buffer_goes_in_turn_and_all_comes_back() -> None:
    """Room in a user's budget of bytes buffered is handed out first come first served
    as it frees; a message over the whole budget is refused at once, a wait that runs
    past its deadline or is cancelled leaves the line to the next; requests wait while
    her unsent replies fill the budget; what a connection held comes back when it
    ends; root is not bound."""
    import math

    from mxfs.fs.buffered import Buffered, Hold

    b = Buffered(100)

    async def main() -> None:
        first, second, third, late = Hold(5), Hold(5), Hold(5), Hold(5)
        assert await b.take(first, 60, math.inf)
        assert not await b.take(second, 101, math.inf)  # (at once: it never fits)
        got: list[tuple[Hold, bool]] = []

        async def take(hold: Hold, n: int) -> None:
            got.append((hold, await b.take(hold, n, math.inf)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, second, 50)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, third, 10)  # (room for it, but behind the first)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [] and b.room(5) == 0
            assert await b.take(Hold(0), 1 << 30, 0)  # root's
            b.keep(first, 50)  # (room for the first in line, and no more)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [(second, True)] and second.inbox == 50
            b.keep(first, 40)
        assert got[1] == (third, True) and b.held[5] == 100
        assert not await b.take(late, 10, trio.current_time() + 0.05)
        with trio.move_on_after(0.05):
            await b.take(late, 10, math.inf)
        b.drop(third)
        assert b.room(5) == 10 and late.inbox == 0  # (nobody left in line)
        b.reply(first, 50)
        assert await b.reply_room(5, 0)
        b.reply(second, 50)  # her replies fill her budget: her requests wait
        assert not await b.reply_room(5, trio.current_time() + 0.05)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.reply_room, 5, math.inf)
            await trio.testing.wait_all_tasks_blocked()
            b.reply(second, 0)  # (one sent: room again)
        for hold in (first, second, third, late):
            b.drop(hold)

    trio.run(main)
    assert b.held == {0: 1 << 30} and not b.replies


@pytest.mark.daemon_log(r"control connections, the limit")
def test_a_users_subordinate_uids_share_her_limits(tmp_path: Path) -> None:
    """A user may run processes as her subordinate uids (rootless containers): counted
    apart, each would have a user's share of connections (and turns, descriptors in
    flight, unpublished files) and one user would hold the daemon's totals alone."""
    alice = ensure_users()["alice"]
    subs = subordinate_uids(alice)
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_conns_per_user=4") as m:
        held, refused = [], None
        for uid in (alice.uid, subs[0], subs[1], subs[7], subs[-1]):
            os.seteuid(uid)  # (SO_PEERCRED: as of connect)
            try:
                sock = raw_socket(m)
            finally:
                os.seteuid(0)
            sock.sendall(encode({"op": "hello", "id": 1}))
            reply, _ = recv_message(sock)
            if reply["ok"]:
                held.append(sock)
            else:
                refused = reply
                sock.close()
        assert len(held) == 4 and refused is not None
        assert refused["errno"] == errno.EMFILE and f"uid {alice.uid} " in refused["error"]
        bob = ensure_users()["bob"]  # another user is not held by hers
        os.seteuid(bob.uid)
        try:
            with ControlClient(str(m.path)) as c:
                assert c.call("hello")["pid"] > 0
        finally:
            os.seteuid(0)
        for sock in held:
            sock.close()


def test_a_users_subordinate_uids_share_her_kv_limits(tmp_path: Path) -> None:
    """Namespaces, chunks and read leases a user's subordinate uids hold are hers: her
    containers' uids do not each own a user's namespaces, and the leases one of them
    held end with its connection (they stayed counted against her: after 262,144 her
    every pin was refused until the daemon restarted)."""
    from mxfs.kv import KVStore

    alice = ensure_users()["alice"]
    subs = subordinate_uids(alice)
    members = make_members(tmp_path)
    mkfs(members)

    def as_uid(uid: int, namespace: str) -> KVStore:
        os.seteuid(uid)  # (SO_PEERCRED: as of connect)
        try:
            return KVStore(str(m.path), namespace=namespace, shared=True)
        finally:
            os.seteuid(0)

    with mounted_pool(members, "max_namespaces_per_user=2", "max_pins_per_user=4",
                      "max_chunks_per_user=3") as m:
        keys = [f"k{i}" for i in range(4)]
        with KVStore(str(m.path), namespace="open", mode=0o777) as kv:
            kv.batch_put(keys, [b"v"] * 4)
        made = []
        for uid, name in ((alice.uid, "a"), (subs[0], "s0"), (subs[1], "s1")):
            kv = as_uid(uid, name)
            try:
                made.append(kv.put("k", b"v"))
            except OSError as e:
                made.append(e.errno)
            kv.close()
        assert made == [True, True, errno.EDQUOT]  # (two namespaces, hers together)
        kv = as_uid(subs[0], "s0")
        put = [kv.put("k2", b"v")]  # (a third chunk of hers; a fourth is past the limit)
        with pytest.raises(OSError) as refused:
            kv.put("k3", b"v")
        kv.close()
        assert put == [True] and refused.value.errno == errno.EDQUOT
        for uid in (subs[2], subs[3], subs[4]):  # each her four leases, each let go
            kv = as_uid(uid, "open")
            assert eventually(lambda kv=kv: _pins(kv, keys))
            kv.close()


def test_a_users_kv_views_hold_a_bounded_share_of_the_daemons_descriptors(
        tmp_path: Path) -> None:
    """Each namespace a reader views has a presence table (a memfd, and its mapping:
    two descriptors), kept until the namespace went: a user who viewed her thousand
    namespaces, and a few users more, ran the daemon out of descriptors (and an open
    that failed so took a member out of service).  Tables are kept for the most
    recently viewed namespaces of each owner, and of all: an older one is retired
    and made again when it is next viewed, its reader none the wiser."""
    from mxfs.kv import KVStore

    users = ensure_users()
    members = make_members(tmp_path)
    mkfs(members)

    def viewed(uid: int, name: str) -> bool:
        os.seteuid(uid)  # (SO_PEERCRED: as of connect)
        try:
            kv = KVStore(str(m.path), namespace=name)
        finally:
            os.seteuid(0)
        try:
            kv.put("k", b"v")
            return kv.exists_many(["k", "x"]) == [True, False] and kv.views.present(
                [b"k"]) is not None  # (answered from the table)
        finally:
            kv.close()

    with mounted_pool(members, "max_kv_views=6", "max_kv_views_per_user=4") as m:
        fds = f"/proc/{m.daemon_pid()}/fd"
        before = len(os.listdir(fds))
        assert all(viewed(users["alice"].uid, f"alice-{i}") for i in range(12))
        # (eventually: the daemon closes a closed client's connection as it sees it)
        assert eventually(lambda: len(os.listdir(fds)) - before <= 2 * 4)
        assert all(viewed(users["bob"].uid, f"bob-{i}") for i in range(4))
        assert eventually(lambda: len(os.listdir(fds)) - before <= 2 * 6)
        assert viewed(users["alice"].uid, "alice-0")  # (retired: made again)


def _pins(kv: Any, keys: list[str]) -> bool:
    """Whether `kv` leased every one of `keys` (False: refused, as over a limit)."""
    try:
        return kv.pin(keys) == [True] * len(keys)
    except OSError as e:
        assert e.errno == errno.EMFILE
        return False


def _daemon_counts(m: Mounted) -> dict[str, int]:
    """What the daemon holds open and has still to free (for a failure's message)."""
    with ControlClient(str(m.path)) as c:
        st = c.stat()
    return {"open_files": st["open_files"], "orphans_queued": st["orphans_queued"]}


def test_renewing_a_file_open_here_strands_none_of_the_daemons_descriptors(
        mounted: Mounted) -> None:
    """A chmod that takes a right from a lent file renews its chunk files, and the
    mount's own descriptors of them are opened afresh.  The old ones are closed at
    once when no I/O is in flight through them: kept open 10 s whatever was, and
    counted nowhere, a user looping writes, `open_read` and chmods of a file she
    held open left its member count of descriptors open in the daemon a loop."""
    path = mounted.path / "renewed"
    data = os.urandom(256 << 10)  # (over every member: 64 KiB stripes)
    path.write_bytes(data)
    pid = mounted.daemon_pid()

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    loops = 40
    with open(path, "r+b", buffering=0) as held, ControlClient(str(mounted.path)) as c:
        held.write(data)  # (the daemon's descriptors of every chunk file open)
        before = open_fds()
        for _ in range(loops):
            held.seek(0)
            held.write(data)
            _, lent = c.call_with_fds("open_read", path=c.pool_path(str(path)))
            for fd in lent:
                os.close(fd)
            path.chmod(0o600)  # (takes others' read: renewed)
            path.chmod(0o644)
        assert eventually(lambda: open_fds() <= before + 8, timeout=5), \
            f"{open_fds() - before} more descriptors open after {loops} renews"
        held.seek(0)
        assert held.read() == data


def test_a_file_set_wider_while_open_is_charged_every_descriptor_it_opens(
        mounted: Mounted) -> None:
    """An empty file's layout may be set while it is open (`setfattr -n
    user.mxfs.layout`, `mxfs setstripe` of a file just made): the descriptors it opens
    here are charged to its user for every member it may then use.  Charged at open
    for its layout then, a file made in a folder one member wide and set to every
    member held four descriptors on a charge of one."""
    narrow = mounted.path / "narrow"
    narrow.mkdir()
    mxfs("setstripe", "--width", "1", str(narrow))
    path = narrow / "widened"
    with open(path, "wb", buffering=0) as f:
        os.setxattr(path, "user.mxfs.layout", b"stripe_width=4")
        f.write(os.urandom(256 << 10))  # (over all four members: 64 KiB stripes)
        os.fsync(f.fileno())
        with ControlClient(str(mounted.path)) as c:
            assert b"stripe_width=4" in os.getxattr(path, "user.mxfs.layout")
            held = c.stat()["limits"]["by_user"]["0"]["fds_held"]
        assert held >= 4, f"{held} descriptors charged for a file holding 4"


def test_a_removed_files_space_ends_though_a_reader_holds_its_chunk_files(
        tmp_path: Path) -> None:
    """The chunk-file descriptors `open_read` hands out kept a removed file's space for
    as long as their holder liked, released from its owner's quota meanwhile.  Now
    they go aside with the file, still readable for `read_grace_s` (reads in flight
    finish), then are cut to nothing and removed while still held: the daemon tracks
    nothing of them after (kept until let go, a user's loop of gets and deletes grew
    its table of them without bound)."""
    from mxfs.pool.revoke import HELD_DIR

    grace = 3
    members = make_members(tmp_path)  # (its own: the module's pool frees what its
    mkfs(members)  # other tests removed, in order, before this file)
    with mounted_pool(members, f"read_grace_s={grace}") as pool:

        def held() -> list[str]:  # (this file's)
            folders = [os.path.join(m, "chunks", HELD_DIR) for m in pool.members]
            return [n for f in folders if os.path.isdir(f) for n in os.listdir(f)
                    if n.startswith(f"{ino}.")]

        path = pool.path / "read-then-removed"
        data = os.urandom(8 << 20)
        path.write_bytes(data)
        ino = path.stat().st_ino
        with ControlClient(str(pool.path)) as c:
            _, fds = c.call_with_fds("open_read", path=c.pool_path(str(path)))
        try:
            path.unlink()
            assert eventually(lambda: len(held()) >= 4), (  # (the file's bytes on every member)
                held(), [m for m in pool.members
                         if os.path.exists(f"{m}/chunks/{ino % 256:02x}/{ino}")],
                _daemon_counts(pool))
            assert sum(os.fstat(fd).st_size for fd in fds) >= len(data) // 2  # (still there)
            assert eventually(lambda: all(os.fstat(fd).st_blocks == 0 for fd in fds),
                              timeout=grace + 30)
            assert eventually(lambda: not held(), timeout=30)  # (though still held)
            assert all(os.fstat(fd).st_nlink == 0 for fd in fds)
        finally:
            for fd in fds:
                os.close(fd)


def _alices_file_lent_to_bob(pool: Mounted, name: str,
                             data: bytes) -> tuple[Path, list[int]]:
    """Alice's file `name` (0644, holding `data`) and the chunk-file descriptors bob
    was handed for it (`open_read`, his connection: SO_PEERCRED at connect)."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    path = pool.path / name
    path.write_bytes(data)
    os.chown(path, alice.uid, alice.gid)
    path.chmod(0o644)
    os.seteuid(bob.uid)
    try:
        with ControlClient(str(pool.path)) as c:
            _, fds = c.call_with_fds("open_read", path=c.pool_path(str(path)))
    finally:
        os.seteuid(0)
    return path, fds


def test_a_renew_that_failed_leaves_the_file_lent_and_the_next_one_renews(
        loop_members: list[str]) -> None:
    """A chmod taking a lent file's read from others renews its chunk files first; on a
    member too full for the copy that fails (the chmod with it).  The file stays lent:
    the chmod tried again once there is room renews it, and bob's descriptors keep
    what he could read.  Forgotten at the failure, the second chmod changed the mode
    with no renew, and bob read every byte written after."""
    mkfs(loop_members)
    with mounted_pool(loop_members) as pool:
        _renew_on_a_full_member(pool, Path(loop_members[2]))  # (the small one: 24 MiB)


def _renew_on_a_full_member(pool: Mounted, member: Path) -> None:
    path, kept = _alices_file_lent_to_bob(pool, "lent", b"public " * (8 << 17))
    filler = member / "filler"
    try:
        with open(filler, "wb") as f, contextlib.suppress(OSError):  # (as full as it gets)
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
                os.fsync(f.fileno())
        with pytest.raises(OSError):
            path.chmod(0o600)  # (the copy of its 2 MiB on the full member fails)
        filler.unlink()
        path.chmod(0o600)
        with open(path, "r+b") as f:
            f.write(b"SECRET " * (8 << 17))
        got = b"".join(os.pread(fd, 8 << 20, 0) for fd in kept)
        assert b"SECRET" not in got and b"public" in got
    finally:
        filler.unlink(missing_ok=True)
        for fd in kept:
            os.close(fd)


def test_a_readers_descriptors_end_where_its_right_to_read_does(pool: Mounted) -> None:
    """`open_read` hands out descriptors of the chunk files themselves: a reader kept
    them past a chmod that took its right away and read every byte written after.  A
    lent file's chunk files are made anew before its access changes: the old
    descriptors keep what they could read (the old files held aside, cut after a grace
    as a removed file's are); the file, through the mount and through new
    descriptors, has what is written after."""
    path, kept = _alices_file_lent_to_bob(pool, "alices-notes", b"public " * 1000)

    def read_all(fds: list[int]) -> bytes:
        return b"".join(os.pread(fd, 1 << 20, 0) for fd in fds)

    try:
        assert b"public" in read_all(kept)
        with open(path, "r+b") as f:  # (open before the chmod: alice's writes go on)
            path.chmod(0o600)
            f.write(b"SECRET " * 1000)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "wb") as f:  # ... and a rewrite, as cp or > would
            f.write(b"SECRET AGAIN " * 1000)
        assert b"SECRET" not in read_all(kept) and b"public" in read_all(kept)
        ino = path.stat().st_ino  # (the old bytes are held aside: cut after a grace)
        held = [n for m in pool.members if os.path.isdir(f"{m}/chunks/held")
                for n in os.listdir(f"{m}/chunks/held")]
        assert any(n.startswith(f"{ino}.") and n.endswith(".r") for n in held), held
        with ControlClient(str(pool.path)) as c:  # (root's: its right is intact)
            _, fresh = c.call_with_fds("open_read", path=c.pool_path(str(path)))
        try:
            assert read_all(fresh).rstrip(b"\0").startswith(b"SECRET AGAIN")
        finally:
            for fd in fresh:
                os.close(fd)
        assert path.read_bytes() == b"SECRET AGAIN " * 1000
    finally:
        for fd in kept:
            os.close(fd)


def _held_copies(m: Mounted, ino: int) -> list[str]:
    """The chunk files of `ino` held aside (renewed or removed, readers still on them)."""
    return [n for member in m.members if os.path.isdir(f"{member}/chunks/held")
            for n in os.listdir(f"{member}/chunks/held") if n.startswith(f"{ino}.")]


OPENS_KEPT = """
path, flags = sys.argv[1], sys.argv[2]
kept, refused = [], {}
with mxfs.client.ControlClient(os.path.dirname(path)) as c:
    p = c.pool_path(path)
    while not os.path.exists(flags + "/stop"):
        try:
            kept.append(c.call_with_fds("open_read", path=p)[1])
            while len(kept) > 200:  # (the newest sets: those about the chmod)
                for fd in kept.pop(0):
                    os.close(fd)
        except OSError as e:
            refused[e.errno] = refused.get(e.errno, 0) + 1
        open(flags + "/began", "w").close()
while not os.path.exists(flags + "/written"):
    time.sleep(0.02)
leaked = sum(any(b"SECRET" in os.pread(fd, 1 << 16, 0) for fd in fds) for fds in kept)
print(json.dumps({"kept": len(kept), "leaked": leaked, "refused": refused}))
"""


def test_an_open_read_racing_a_chmod_gets_no_descriptor_of_the_renewed_files(
        pool: Mounted) -> None:
    """The chmod that takes a right away renews the file's chunk files a member at a
    time, then sets the mode: an `open_read` judged by the old mode and opened while
    the renew ran held some of the new files, and read a quarter of every later write
    for good (39 of 300 sets).  It waits for the renew now and is judged again."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    path = pool.path / "alices-big-notes"
    path.write_bytes(b"public " * ((64 << 20) // 7))  # (on every member: a long renew)
    os.chown(path, alice.uid, alice.gid)
    path.chmod(0o644)
    with _as_with_flags(bob, "import time\n" + OPENS_KEPT, str(path)) as (proc, flags):
        assert eventually(lambda: (flags / "began").exists(), timeout=60)
        time.sleep(0.3)
        path.chmod(0o600)  # (alice's right: root does what she would)
        (flags / "stop").touch()
        time.sleep(0.3)
        with open(path, "r+b") as f:
            f.write(b"SECRET " * ((64 << 20) // 7))
            f.flush()
            os.fsync(f.fileno())
        (flags / "written").touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["kept"] > 0 and got["leaked"] == 0, got


def test_a_chmod_that_takes_no_right_away_renews_nothing(pool: Mounted) -> None:
    """Any chmod or chown of a lent file renewed it: a copy of the whole file, held
    aside 30 s (a chmod to the same mode in a loop held 1 GiB a second outside every
    quota), and the old file cut under a reader who kept its right (a mapped load
    died of SIGBUS).  Only a change that may take a right away renews now, and a copy
    nobody holds goes at once, not after the grace."""
    path, kept = _alices_file_lent_to_bob(pool, "alices-shared-notes",
                                          b"public " * 100_000)
    ino = path.stat().st_ino
    alice = ensure_users()["alice"]
    try:
        path.chmod(0o644)
        path.chmod(0o664)
        os.chown(path, alice.uid, alice.gid)
        assert _held_copies(pool, ino) == []
        with open(path, "r+b") as f:  # (bob may still read it: he reads what is written)
            f.write(b"shared ")
        assert any(os.pread(fd, 7, 0) == b"shared " for fd in kept)
        path.chmod(0o600)
        assert _held_copies(pool, ino)  # (this one took his right: renewed)
    finally:
        for fd in kept:
            os.close(fd)
    assert eventually(lambda: _held_copies(pool, ino) == [], timeout=10)


def test_a_chmod_of_a_lent_file_nobody_holds_copies_nothing(pool: Mounted) -> None:
    """A chmod of a file whose descriptors were handed out copied it whole (a read,
    a write and an fsync of every chunk file, on the lane's threads, outside every
    quota) though its reader had closed them: a loop of open_read, close, chmod 600,
    chmod 644 took 0.3-0.5 s a chmod of 256 MiB.  Chunk files nobody holds stay."""
    path, kept = _alices_file_lent_to_bob(pool, "alices-read-and-closed",
                                          b"public " * 100_000)
    for fd in kept:
        os.close(fd)
    ino = path.stat().st_ino

    def chunk_inodes() -> list[int]:
        return sorted(os.stat(p).st_ino for p in chunk_files(pool.members)
                      if os.path.basename(p) == str(ino))
    before = chunk_inodes()
    path.chmod(0o600)
    assert _held_copies(pool, ino) == [] and chunk_inodes() == before != []


def test_descriptors_lent_before_a_daemon_restart_end_at_a_later_chmod(
        members: list[str]) -> None:
    """Chunk-file descriptors outlive the daemon that handed them out (a crash, an
    upgrade), and which files it lent was known to it alone: after a restart a chmod
    renewed nothing, and bob read every byte alice wrote after it, for good.  A file
    made before the mount counts as lent until renewed."""
    mkfs(members)
    with mounted_pool(members) as m:
        path, kept = _alices_file_lent_to_bob(m, "alices-notes", b"public " * 1000)
        try:
            m.umount()  # (an upgrade; a crash loses `lent` alike)
            m.remount()
            path.chmod(0o600)
            with open(path, "r+b") as f:
                f.write(b"SECRET " * 1000)
            read = b"".join(os.pread(fd, 1 << 20, 0) for fd in kept)
            assert b"SECRET" not in read and b"public" in read
        finally:
            for fd in kept:
                os.close(fd)


@pytest.mark.daemon_log(r"recovered pool")
def test_a_renew_cut_short_by_a_crash_leaves_the_file_whole(tmp_path: Path) -> None:
    """A renew (`revoke.Held.renew`) links the live chunk file into `chunks/held/` as
    the old one, then renames its copy over it: a daemon that died in between left
    there a second name of the live file, which the next mount took for one only
    readers held and cut to nothing (the file read zeros, and the check saw nothing
    wrong).  That name goes alone now, and the copy with it."""
    members = make_members(tmp_path)
    mkfs(members)
    data = os.urandom(3 << 20)
    with mounted_pool(members) as m:
        path = m.path / "renewed"
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        ino = path.stat().st_ino
        kill_daemon(m)
        live = [p for p in chunk_files(members) if os.path.basename(p) == str(ino)]
        assert live
        stamp = time.time_ns()
        for chunk in live:  # (as the crash left each: its copy, its old name)
            held = Path(chunk).parent.parent / "held"
            held.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(chunk, held / f"{ino}.{stamp}.n")
            os.link(chunk, held / f"{ino}.{stamp}.0.r")
        m.remount()
        assert path.read_bytes() == data
        assert [p for p in chunk_files(members) if os.sep + "held" + os.sep in p] == []


ALICE_LENDS = """
import time
folder, flags = sys.argv[1], sys.argv[2]
def wait(name):
    while not os.path.exists(os.path.join(flags, name)):
        time.sleep(0.02)
def write(name, size):
    try:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"a" * size)
        return "ok"
    except OSError as e:
        return e.errno
kept, inos = [], []
for i in range(3):  # (each lent to herself, then removed: kept for her readers a grace)
    path = os.path.join(folder, f"f{i}")
    with open(path, "wb") as f:
        f.write(bytes([i + 1]) * (8 << 20))
    inos.append(os.stat(path).st_ino)
    with mxfs.client.ControlClient(os.path.dirname(folder)) as c:
        _, fds = c.call_with_fds("open_read", path=c.pool_path(path))
    kept.append([fd for fd in fds if os.fstat(fd).st_size])
    os.unlink(path)
print(json.dumps(inos), flush=True)
wait("held")
read = [sum(len(os.pread(fd, 8 << 20, 0)) for fd in fds) for fds in kept]
over = write("g", 16 << 20)
for fds in kept:
    for fd in fds:
        os.close(fd)
os.unlink(os.path.join(folder, "g")) if over == "ok" else None
print(json.dumps({"read": read, "over": over}), flush=True)
wait("let-go")
print(json.dumps({"after": write("g", 16 << 20)}), flush=True)
"""


def test_files_kept_for_their_readers_count_as_their_owners(tmp_path: Path) -> None:
    """A removed file's chunk files a reader holds are kept readable a grace (so are a
    renewed file's): outside every quota, so a user who lent her own files to herself
    and removed them, over and over, held the pool's space outside hers.  They count
    in her quota now, and past `max_held_per_user` the next are cut at once."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, f"max_held_per_user={12 << 20}") as m:
        folder = m.path / "alices"
        folder.mkdir()
        os.chown(folder, alice.uid, alice.gid)
        mxfs("quota", "--user", "mxfs-alice", "--bytes", "24MiB", str(m.path))
        with _as_with_flags(alice, ALICE_LENDS, str(folder)) as (proc, flags):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            inos = json.loads(line)

            def held(ino: int, readable: bool = False) -> list[os.stat_result]:
                return [os.stat(f"{member}/chunks/held/{n}") for member in m.members
                        if os.path.isdir(f"{member}/chunks/held")
                        for n in os.listdir(f"{member}/chunks/held")
                        if n.startswith(f"{ino}.") and (n.endswith(".r") or not readable)]
            assert eventually(lambda: all(held(ino) for ino in inos))
            kept = sum(st.st_blocks * 512 for ino in inos for st in held(ino, True))
            assert 8 << 20 <= kept <= 12 << 20, kept  # (the first whole, no more)
            (flags / "held").touch()
            got = json.loads(proc.stdout.readline())
            assert got["read"][0] == 8 << 20 and got["read"][2] == 0, got
            assert got["over"] == errno.EDQUOT, got  # (12 MiB kept for her + 16 > 24)
            assert eventually(lambda: not any(held(ino) for ino in inos))
            (flags / "let-go").touch()
            assert json.loads(proc.stdout.readline()) == {"after": "ok"}


def test_copies_kept_by_renews_stay_within_their_owners_quota(tmp_path: Path) -> None:
    """A file read (its descriptors held) and chmodded to take that right away, over and
    over: each renew keeps the old chunk files for their readers, and those count in
    the owner's quota; past what it has left they are cut at once (a loop held a
    hundred times a user's quota in copies, while her own writes were refused)."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members) as m:
        path = m.path / "alices.bin"
        path.write_bytes(os.urandom(3 << 20))
        os.chown(path, alice.uid, alice.gid)
        mxfs("quota", "--user", "mxfs-alice", "--bytes", "8MiB", str(m.path))
        ino = path.stat().st_ino
        kept: list[int] = []
        try:
            with ControlClient(str(m.path)) as c:
                for _ in range(6):
                    kept += c.call_with_fds("open_read", path=c.pool_path(str(path)))[1]
                    os.chmod(path, 0o600)
                    os.chmod(path, 0o644)
            held = sum(os.stat(f"{member}/chunks/held/{n}").st_blocks * 512
                       for member in m.members if os.path.isdir(f"{member}/chunks/held")
                       for n in os.listdir(f"{member}/chunks/held")
                       if n.startswith(f"{ino}.") and n.endswith(".r"))
            assert 3 << 20 <= held <= 5 << 20, held  # (her 8 MiB less the file's 3)
            line = next(x for x in mxfs("quota", str(m.path)).stdout.splitlines()
                        if f"uid {alice.uid}:" in x)
            assert "kept for readers" in line, line  # (what her quota counts, shown)
        finally:
            for fd in kept:
                os.close(fd)


PUTS_AT_ONCE = """
import base64, threading
b = lambda s: base64.b64encode(s.encode()).decode()
clients = [mxfs.client.ControlClient(sys.argv[1]) for _ in range(8)]
ready = threading.Barrier(8)
stored = [0] * 8
def put(i):
    keys = [b(f"k{i}-{j}") for j in range(100)]
    ready.wait()
    try:
        got = clients[i].call("kv_put", namespace=f"ns{i}", keys=keys, data=[b("v" * 100)] * 100)
        stored[i] = sum(map(bool, got["stored"]))
    except OSError as e:
        assert e.errno == errno.EDQUOT, e
threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(stored))
"""


def test_puts_at_once_keep_to_the_per_user_chunk_limit(tmp_path: Path) -> None:
    """A put's chunks are judged, then written together in a worker thread, then
    indexed: eight requests at once each judged the limit by the chunks indexed, and
    stored 800 under a limit of 100.  Those being stored count now."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_chunks_per_user=100") as m:
        answered = run_as(alice, PUTS_AT_ONCE, str(m.path))  # (a refused put's earlier
        with ControlClient(str(m.path)) as c:  # chunks are stored: counted here)
            held = sum(s["chunks"] for s in c.call("kv_stats")["namespaces"])
        assert sum(answered) <= held <= 100, (answered, held)
        assert held > 0


HOLD_OPEN = """
import time
folder, flags = sys.argv[1], sys.argv[2]
held, refused = [], 0
for i in range(30):
    try:
        held.append(os.open(os.path.join(folder, f"f{i}"), os.O_RDONLY))
    except OSError as e:
        assert e.errno == errno.EMFILE, e
        refused += 1
print(json.dumps({"held": len(held), "refused": refused}), flush=True)
while not os.path.exists(flags + "/done"):
    time.sleep(0.02)
"""


def test_one_users_open_files_leave_the_daemon_descriptors_for_others(tmp_path: Path) -> None:
    """Each file open through the mount holds a descriptor of the daemon's for each
    member it touches: one user holding 300 files open took all 1,024 of them, and
    every other user's reads and creates failed (EMFILE).  One uid holds
    `max_open_per_user` files and folders open at most (folders were not counted)."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_open_per_user=20") as m:
        folder = m.path / "alices"
        folder.mkdir()
        for i in range(30):  # (every other one a folder: each open holds the daemon)
            if i % 2:
                (folder / f"f{i}").write_bytes(b"x" * 4096)
            else:
                (folder / f"f{i}").mkdir()
        os.chown(folder, alice.uid, alice.gid)
        with _as_with_flags(alice, HOLD_OPEN, str(folder)) as (proc, flags):
            assert proc.stdout is not None
            held = json.loads(proc.stdout.readline())
            assert held == {"held": 20, "refused": 10}
            got = run_as(bob, "print(json.dumps(open(sys.argv[1], 'rb').read(4).decode()))",
                         str(folder / "f29"))
            assert got == "xxxx"  # (bob's open, while alice holds her twenty)
            (flags / "done").touch()
            proc.wait(timeout=60)
        assert (folder / "f29").read_bytes()[:4] == b"xxxx"


def _answered(m: Mounted, op: str) -> int:
    """How many requests of `op` the daemon has answered (its metrics)."""
    with ControlClient(str(m.path)) as c:
        return sum(int(n) for _, o, n, _ in c.call("metrics")["requests"] if o == op)


def _in_flight(m: Mounted) -> int:
    with ControlClient(str(m.path)) as c:
        return int(c.call("stat")["limits"]["fds_in_flight"])


def _asks(sock: socket.socket, request: bytes) -> bool:
    from mxfs.proto.framing import recv_message

    sock.sendall(request)
    reply, fds = recv_message(sock)
    for fd in fds:
        os.close(fd)
    return bool(reply["ok"])


PINS_AT_ONCE = """
import base64, threading
b = lambda s: base64.b64encode(s.encode()).decode()
keys = [b(f"k{i}") for i in range(48)]
mxfs.client.ControlClient(sys.argv[1]).call("kv_put", namespace="a", keys=keys,
                                            data=[b("v" * 600)] * 48)
clients = [mxfs.client.ControlClient(sys.argv[1]) for _ in range(8)]
ready, got = threading.Barrier(8), [None] * 8
def get(i):
    ready.wait()
    got[i] = attempt(clients[i].call, "kv_get", namespace="a", keys=keys[6 * i:6 * i + 6],
                     pin=True)
threads = [threading.Thread(target=get, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(got))
"""


def test_pinning_gets_at_once_stay_within_a_users_leases(tmp_path: Path) -> None:
    """A pinning get was checked against the user's leases before it opened its chunk
    files and counted after: gets sent at once each passed the same check (8 of 6
    keys under a limit of 10).  One passes now, the rest EMFILE."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_pins_per_user=10") as m:
        got = run_as(alice, PINS_AT_ONCE, str(m.path))
        assert got.count("ok") == 1 and got.count(errno.EMFILE) == 7, got


def test_kv_chunks_and_leases_are_bounded_per_user(tmp_path: Path) -> None:
    """The KV index is memory (about 2 KB a chunk) and each read lease too: one uid's
    namespaces hold at most max_chunks_per_user chunks, its connections together at
    most max_pins_per_user leases; root's are not bounded."""
    from users import ensure_users, run_as

    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_chunks_per_user=100,max_pins_per_user=10") as m:
        script = f"""
import base64
b = lambda s: base64.b64encode(s.encode()).decode()
c1, c2 = mxfs.client.ControlClient({str(m.path)!r}), mxfs.client.ControlClient({str(m.path)!r})
keys = [b(f"k{{i}}") for i in range(100)]
c1.call("kv_put", namespace="a", keys=keys, data=[b("v" * 600)] * 100)
more = attempt(c1.call, "kv_put", namespace="a2", keys=[b("x")], data=[b("v")])
first = attempt(c1.call, "kv_get", namespace="a", keys=keys[:6], pin=True)
second = attempt(c2.call, "kv_get", namespace="a", keys=keys[6:12], pin=True)
c1.close()  # its leases end with it
third = attempt(c2.call, "kv_get", namespace="a", keys=keys[6:12], pin=True)
limits = c2.call("stat")["limits"]
print(json.dumps([more, first, second, third,
                  [limits[k] for k in ("by_user", "busiest_user", "users")]]))
"""
        more, first, second, third, seen = run_as(alice, script)
        assert more == errno.EDQUOT
        assert first == "ok" and second == errno.EMFILE and third == "ok"
        assert seen == [{}, None, 0]  # who else uses the daemon is root's to see
        status = json.loads(mxfs("status", "--json", str(m.path)).stdout)
        assert status["limits"]["by_user"][str(alice.uid)]["kv_chunks"] == 100
        assert f"uid {alice.uid}: 100 kv chunks" in mxfs("status", str(m.path)).stdout
        with ControlClient(str(m.path)) as root:
            keys = [base64.b64encode(b"r%d" % i).decode() for i in range(150)]
            root.call("kv_put", namespace="r", keys=keys, data=[keys[0]] * 150)


def test_the_bytes_a_users_leases_keep_from_eviction_are_bounded(tmp_path: Path) -> None:
    """A read lease keeps its chunk from eviction, charged to its writer: a reader of
    a shared namespace could pin 262,144 chunks of up to 256 MiB and hold it past its
    capacity for as long as she liked.  Her leases keep at most
    max_pinned_bytes_per_user bytes: past it a pin or a pinning get is EMFILE; a chunk
    she leases already costs nothing more; what she unpins, or closes, counts no more."""
    from users import ensure_users, run_as

    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_pinned_bytes_per_user=2000") as m:
        script = f"""
import base64
b = lambda s: base64.b64encode(s.encode()).decode()
c = mxfs.client.ControlClient({str(m.path)!r})
keys = [b(f"k{{i}}") for i in range(5)]
c.call("kv_put", namespace="a", keys=keys, data=[b("v" * 600)] * 5)
pin = lambda *ks, op="kv_pin", **kw: attempt(c.call, op, namespace="a", keys=list(ks), **kw)
got = [pin(*keys[:3]), pin(keys[3]), pin(keys[3], op="kv_get", pin=True), pin(keys[0])]
held = c.call("stat")["limits"]["by_user"]
c.call("kv_unpin", namespace="a", keys=[keys[0]])
got.append(pin(keys[0]))  # (leased still: one of two unpinned)
c.call("kv_unpin", namespace="a", keys=[keys[0]] * 2)
got += [pin(keys[3]), pin(keys[4])]
print(json.dumps([got, held]))
"""
        got, held = run_as(alice, script)
        assert got == ["ok", errno.EMFILE, errno.EMFILE, "ok", "ok", "ok", errno.EMFILE], got
        assert held == {}  # (root's to see)

        def kept() -> tuple[int, int]:
            held = json.loads(mxfs("status", "--json", str(m.path)).stdout)["limits"][
                "by_user"].get(str(alice.uid), {})
            return held.get("pins", 0), held.get("pinned_bytes", 0)
        assert eventually(lambda: kept() == (0, 0))  # (her connection closed)


def _log_of(m: Mounted) -> Path:
    """The daemon's log, beside its control socket."""
    with ControlClient(str(m.path)) as c:
        st = c.stat()
    return Path(st["socket"]).parent / f"{st['pool_uuid']}.log"


def _lines_since(log: Path, start: int) -> list[str]:
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").splitlines()


def test_a_layout_with_other_digits_is_einval_and_floods_no_log(pool: Mounted) -> None:
    """"²" is a digit to str.isdigit but not to int(): setting user.mxfs.layout to
    stripe_unit=² failed unforeseen (EIO) and wrote a traceback into the daemon's log
    (in RAM) each time; a user looping on it wrote megabytes a second.  So did a
    width of 5,000 digits (int() refuses past 4,300)."""
    alice = ensure_users()["alice"]
    folder = pool.path / "superscript"
    folder.mkdir()
    os.chown(folder, alice.uid, alice.gid)
    log = _log_of(pool)
    start = log.stat().st_size
    got = run_as(alice, """
values = ["stripe_unit=\\u00b2".encode(), b"stripe_width=" + b"9" * 5000]
print(json.dumps([attempt(os.setxattr, sys.argv[1], "user.mxfs.layout", value)
                  for _ in range(100) for value in values]))
""", str(folder))
    assert got == [errno.EINVAL] * 200
    assert len(_lines_since(log, start)) <= 2
    assert mxfs("getstripe", "--json", str(folder)).returncode == 0


OPEN_PAST = """
folder = sys.argv[1]
held = [os.open(os.path.join(folder, f"f{i}"), os.O_RDONLY) for i in range(20)]
print(json.dumps([attempt(os.open, os.path.join(folder, "f0"), os.O_RDONLY)
                  for _ in range(200)]))
"""


def test_opens_past_the_limit_are_refused_without_a_line_each(tmp_path: Path) -> None:
    """Each open refused past max_open_per_user was a line of the daemon's log (in RAM):
    a user holding her limit and looping on open(2) wrote megabytes a second."""
    alice = ensure_users()["alice"]
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "max_open_per_user=20") as m:
        folder = m.path / "alices"
        folder.mkdir()
        for i in range(20):
            (folder / f"f{i}").write_bytes(b"x")
        log = _log_of(m)
        start = log.stat().st_size
        assert run_as(alice, OPEN_PAST, str(folder)) == [errno.EMFILE] * 200
        lines = _lines_since(log, start)
        assert 1 <= len(lines) <= 3, lines
        assert "max_open_per_user" in lines[0]


@pytest.mark.unit
def test_a_log_past_its_cap_is_kept_once_and_cut(tmp_path: Path) -> None:
    """The daemon's log lives on tmpfs (RAM) and grew without bound.  Past its cap its
    bytes go to LOG.1 (an older one replaced) and the file opened O_APPEND is cut, so
    what is written next lands at its start; a line written between the bulk copy and
    the cut (here: as `quiet` is taken) is in LOG.1, not lost."""
    from mxfs.vol.mounts import open_private_log, rotate_log

    path = tmp_path / "pool.log"
    older = tmp_path / "pool.log.1"
    older.write_bytes(b"an older rotation\n")

    @contextlib.contextmanager
    def late_line() -> Iterator[None]:
        os.write(fd, b"late\n")
        yield

    with open_private_log(str(path)) as f:
        fd = f.fileno()
        f.write(b"a" * 999 + b"\n")
        f.flush()
        assert not rotate_log(fd, str(path), cap=2000)  # (under it: left as it is)
        assert older.read_bytes() == b"an older rotation\n" and path.stat().st_size == 1000
        f.write(b"b" * 1499 + b"\n")
        f.flush()
        assert rotate_log(fd, str(path), cap=2000, quiet=late_line)
        assert older.read_bytes() == b"a" * 999 + b"\n" + b"b" * 1499 + b"\nlate\n"
        assert path.stat().st_size == 0
        f.write(b"after\n")
        f.flush()
    assert path.read_bytes() == b"after\n"
    assert older.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.log", "pool.log.1"]


def test_a_daemon_cuts_its_log_past_the_cap(tmp_path: Path) -> None:
    """A daemon whose log is already past LOG_CAP at mount copies it to LOG.1 and goes on
    logging at the start of LOG, saying so first."""
    from mxfs.pool import Pool
    from mxfs.vol.mounts import LOG_CAP, ensure_runtime_dir, open_private_log, runtime_dir

    members = make_members(tmp_path)
    mkfs(members)
    log = Path(runtime_dir(), f"{Pool.open(members[0]).uuid}.log")
    old = Path(f"{log}.1")
    ensure_runtime_dir(str(log.parent))
    with open_private_log(str(log)) as f:
        line = b"2026-01-01 00:00:00,000 mxfs.test INFO " + b"x" * 960 + b"\n"
        f.write(line * (LOG_CAP // len(line) + 1))
    try:
        with mounted_pool(members) as m:
            assert eventually(old.exists)
            assert old.stat().st_size > LOG_CAP
            assert eventually(lambda: "the log passed 64 MiB" in log.read_text())
            assert log.stat().st_size < 1 << 20
            (m.path / "still").write_bytes(b"served")
            assert (m.path / "still").read_bytes() == b"served"
    finally:
        old.unlink(missing_ok=True)


# A tenant's threads each tagging files of hers with a 64,000-byte xattr: what each call
# came to ("ok", "busy" for EBUSY, or another errno), by file.
XATTR_TAGGERS = r"""
import errno, json, os, sys, threading
root, threads, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
got = {}
def tag(t):
    for i in range(files):
        path = os.path.join(root, f"t{t}-{i}")
        open(path, "w").close()
        try:
            os.setxattr(path, "user.tag", bytes([65 + t]) * 64000)
            got[path] = "ok"
        except OSError as e:
            got[path] = "busy" if e.errno == errno.EBUSY else e.errno
ts = [threading.Thread(target=tag, args=(t,)) for t in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps(got))
"""


def test_a_tenants_xattr_bytes_past_her_rate_wait_and_past_her_waiters_are_refused(
        pool: Mounted) -> None:
    """A tenant setting large xattrs as fast as she could made the store's WAL grow by
    1,000 pages between two of the checkpointer's runs, and the commit that crossed them
    held the daemon's thread for everyone (another user's p99 25 ms; 2 ms now,
    `tools/bench_fair.py` arm `xattrs`).  Past her burst her calls wait, the thread free;
    a waiting call holds one of the FUSE tasks all users share, so with XATTR_WAITING
    of hers waiting the next is refused EBUSY.  What was set is whole; another
    tenant's xattr is set as she asks."""
    from mxfs.fs.xattr_pace import XATTR_BURST, XATTR_WAITING

    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    root = pool.path / "xattr-rate"
    root.mkdir()
    os.chown(root, alice.uid, alice.gid)
    files = 2 * XATTR_BURST // 64000 // (2 * XATTR_WAITING) + 4  # (twice her burst)
    got = run_as(alice, XATTR_TAGGERS, str(root), str(2 * XATTR_WAITING), str(files))
    outcomes = Counter(got.values())
    assert set(outcomes) == {"ok", "busy"}, outcomes
    assert outcomes["ok"] >= XATTR_BURST // 64000, outcomes  # (her burst, and more)
    for path, outcome in got.items():
        value = os.getxattr(path, "user.tag") if outcome == "ok" else None
        t = int(Path(path).name[1:].split("-")[0])
        assert value == (bytes([65 + t]) * 64000 if outcome == "ok" else None)
    theirs = pool.path / "xattr-rate-bob"
    theirs.mkdir()
    os.chown(theirs, bob.uid, bob.gid)
    assert run_as(bob, XATTR_TAGGERS, str(theirs), "1", "2") == {
        str(theirs / "t0-0"): "ok", str(theirs / "t0-1"): "ok"}


XATTR_FLOOD = r"""
import errno, json, os, sys, threading, time
root, seconds = sys.argv[1], float(sys.argv[2])
ok, failed, lock = [0], [], threading.Lock()
def tag(t):
    path = os.path.join(root, f"t{t}")
    open(path, "w").close()
    while time.monotonic() < until:
        try:
            os.setxattr(path, "user.tag", b"x" * 64000)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.001)  # (refused at once: not a spin on the daemon's thread)
            continue
        with lock:
            ok[0] += 1
def run(t):
    try:
        tag(t)
    except BaseException as e:
        failed.append(repr(e))
ts = [threading.Thread(target=run, args=(t,)) for t in range(4)]
start = time.monotonic()
until = start + seconds
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps({"ok": ok[0], "start": start, "end": time.monotonic(), "failed": failed}))
"""


def test_tenants_each_within_her_xattr_rate_are_paced_together(pool: Mounted) -> None:
    """Six tenants each setting large xattrs within her own rate grew the store's WAL
    32 MB/s, past what the checkpointer copies between its runs: the commits that
    crossed 1,000 pages checkpointed on the daemon's thread (another user's p99
    17.7 ms; 3.6 ms now, `tools/bench_fair.py` arm `xattr_tenants`).  Every tenant's
    xattr bytes together are paced to POOL_PER_S: what four of them set at once is
    within the pool's burst and rate over the time they took."""
    from mxfs.fs.xattr_pace import POOL_BURST, POOL_PER_S, XATTR_WAITING

    tenants = [User(f"t{uid}", uid, uid, ()) for uid in range(64011, 64015)]
    procs = []
    for t in tenants:
        home = pool.path / f"flood-{t.uid}"
        home.mkdir()
        os.chown(home, t.uid, t.gid)
        procs.append(subprocess.Popen(as_user(t, XATTR_FLOOD, str(home), "2"),
                                      stdout=subprocess.PIPE, text=True))
    got = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert not any(g["failed"] for g in got) and all(g["ok"] for g in got), got
    took = sum(g["ok"] for g in got) * 64008  # (a value and its name)
    window = max(g["end"] for g in got) - min(g["start"] for g in got)
    in_flight = len(tenants) * (XATTR_WAITING + 4) * 64008
    assert took <= POOL_BURST + POOL_PER_S * window + in_flight, (took, window, got)

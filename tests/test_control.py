"""The control socket: found from the mount, versioned frames, checked credentials."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mounted, eventually, mxfs, one_line_error, raw_socket
from users import User, as_user, ensure_users, run_as

from mxfs.client import ControlClient, ControlError
from mxfs.proto import HEADER, MAX_PAYLOAD, VERSION, recv_message


def test_hello_stat_and_layout(mounted: Mounted) -> None:
    (mounted.path / "d").mkdir()
    (mounted.path / "d" / "f").write_bytes(b"x" * 200_000)
    with ControlClient(str(mounted.path)) as c:
        assert c.server["version"] == VERSION and "layout" in c.server["ops"]
        st = c.stat()
        assert st["mountpoint"] == str(mounted.path) and len(st["members"]) == 4
        lay = c.layout(str(mounted.path / "d" / "f"))
        assert lay["size"] == 200_000 and lay["ino"] == os.stat(mounted.path / "d" / "f").st_ino
        assert lay["layout"]["stripe_unit"] == 64 * 1024 and lay["layout"]["stripe_width"] == 4
        with pytest.raises(ControlError) as e:
            c.layout(str(mounted.path / "d" / "missing"))
        assert e.value.errno == errno.ENOENT
        # the connection survives a refused request
        assert c.layout(str(mounted.path / "d"))["size"] == 4096
        assert c.connections == 1 and not c.broken
    with pytest.raises(ControlError) as e:  # closed for good: no silent new connection
        c.stat()
    assert e.value.errno == errno.EBADF


def test_pipelined_requests_are_answered_in_order_each_refused_alone(mounted: Mounted) -> None:
    (mounted.path / "f").write_bytes(b"x" * 1000)
    with ControlClient(str(mounted.path)) as c:
        pool = c.pool_path(str(mounted.path))
        reqs = [("layout", {"path": f"{pool}f".replace("//", "/")}),
                ("layout", {"path": "/missing"}), ("stat", {})] * 12  # past the window
        out = c.call_many(reqs, window=4)
        assert len(out) == len(reqs)
        for k, got in enumerate(out):
            if k % 3 == 1:
                assert isinstance(got, ControlError) and got.errno == errno.ENOENT
            else:
                assert not isinstance(got, ControlError) and got[1] == []
                if k % 3 == 0:
                    assert got[0]["size"] == 1000
                else:
                    assert len(got[0]["members"]) == 4
        assert c.connections == 1 and not c.broken
        assert c.layout(str(mounted.path / "f"))["size"] == 1000  # the stream is in step


@pytest.mark.parametrize("bad", [
    b"JUNK" + b"\0" * 8,                                         # bad magic
    HEADER.pack(b"MXFS", VERSION + 7, 0, 2) + b"{}",             # unknown version
    HEADER.pack(b"MXFS", VERSION, 0, MAX_PAYLOAD + 1),           # oversized
    HEADER.pack(b"MXFS", VERSION, 0, 5) + b"nope!",              # not JSON
    HEADER.pack(b"MXFS", VERSION, 0, 2) + b"[]",                 # not an object
    HEADER.pack(b"MXFS", VERSION, 0, 14) + b'{"op":"fly"}  ',    # unknown op
    # an integer of 21 digits (4,299 each cost the thread ~0.1 ms to parse), NaN
    HEADER.pack(b"MXFS", VERSION, 0, 39) + b'{"op":"stat","x":' + b"9" * 21 + b"}",
    HEADER.pack(b"MXFS", VERSION, 0, 21) + b'{"op":"stat","x":NaN}',
    # a number of 760 characters (one halfway between two doubles: 30 us to round)
    HEADER.pack(b"MXFS", VERSION, 0, 17 + 760 + 1) + b'{"op":"stat","x":0.' +
    b"1" * 758 + b"}",
])
@pytest.mark.daemon_log(r"protocol for pid \d+ uid \d+ failed \(ProtocolError")
def test_malformed_messages_are_refused_and_others_still_served(mounted: Mounted,
                                                                bad: bytes) -> None:
    with ControlClient(str(mounted.path)) as good:
        s = raw_socket(mounted)
        s.sendall(bad)
        reply, _ = recv_message(s)
        assert reply["ok"] is False and reply["errno"] == errno.EPROTO and reply["error"]
        assert s.recv(1) == b""  # and the bad connection is closed
        s.close()
        assert good.stat()["pid"] == good.server["pid"]


def test_half_message_then_hang_up_leaves_the_daemon_serving(mounted: Mounted) -> None:
    s = raw_socket(mounted)
    s.sendall(HEADER.pack(b"MXFS", VERSION, 0, 100) + b'{"op":')
    s.close()
    with ControlClient(str(mounted.path)) as c:
        assert c.stat()["open_files"] >= 0


def test_passed_descriptors_are_not_leaked(mounted: Mounted) -> None:
    pid = mounted.daemon_pid()
    before = len(os.listdir(f"/proc/{pid}/fd"))
    s = raw_socket(mounted)
    payload = json.dumps({"op": "hello", "id": 1}).encode()
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(5)]
    message = HEADER.pack(b"MXFS", VERSION, 5, len(payload)) + payload
    try:
        s.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("5i", *fds))])
    except PermissionError:  # Linux 6.16: the kernel refuses them for the daemon
        s.sendall(message)
    reply, _ = recv_message(s)
    assert reply["ok"]
    s.close()
    for fd in fds:
        os.close(fd)
    with ControlClient(str(mounted.path)) as c:
        c.stat()
        assert len(os.listdir(f"/proc/{pid}/fd")) <= before + 1


def kv_puts_served(c: ControlClient) -> int:
    return sum(n for kind, op, n, _ in c.call("metrics")["requests"]
               if (kind, op) == ("control", "kv_put"))


def test_a_request_broken_midway_raises_and_the_next_call_connects_again(
        mounted: Mounted) -> None:
    key, value = base64.b64encode(b"k").decode(), base64.b64encode(b"v").decode()
    pid = mounted.daemon_pid()
    with ControlClient(str(mounted.path), timeout=1) as c:
        c.call("kv_ns_create", namespace="n")
        first = c.sock
        os.kill(pid, signal.SIGSTOP)  # the request is sent, its reply does not come in time
        try:
            with pytest.raises(TimeoutError):
                c.call("kv_put", namespace="n", keys=[key], data=[value])
        finally:
            os.kill(pid, signal.SIGCONT)
        assert c.broken
        # The next call gets a new connection and its own reply (not the late one, which
        # came on the old connection), and the failed request was not sent again: the
        # daemon served it once, as it came.
        assert eventually(lambda: c.call("kv_exists", namespace="n", keys=[key])["present"]
                          == [True])
        assert c.connections == 2 and not c.broken and c.sock is not first
        assert eventually(lambda: kv_puts_served(c) == 1)
        assert c.call("kv_stats", namespace="n")["namespaces"][0]["puts"] == 1


CALLER = r"""
import json, os, sys
from mxfs.client import ControlClient  # before dropping root: Python may live in /root
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {}
with ControlClient(sys.argv[1]) as c:
    out["uid"] = c.server["uid"]
    for p in sys.argv[2:]:
        try:
            c.layout(p); out[p] = "ok"
        except OSError as e:
            out[p] = e.errno
for p in sys.argv[2:]:
    try:
        open(p, "rb").close(); out["mount:" + p] = "ok"
    except OSError as e:
        out["mount:" + p] = e.errno
print(json.dumps(out))
"""


def test_a_non_root_caller_is_refused_what_the_mount_refuses(mounted: Mounted) -> None:
    os.chmod(mounted.path, 0o755)
    private = mounted.path / "private"
    private.mkdir(mode=0o700)
    (private / "secret").write_text("s")
    (mounted.path / "public").write_text("p")
    paths = [str(private / "secret"), str(mounted.path / "public")]
    res = subprocess.run([sys.executable, "-c", CALLER, str(mounted.path), *paths],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["uid"] == 65534  # SO_PEERCRED saw the real caller
    assert out[paths[0]] == errno.EACCES and out["mount:" + paths[0]] == errno.EACCES
    assert out[paths[1]] == "ok" and out["mount:" + paths[1]] == "ok"


def test_out_of_order_requests_are_refused_and_the_daemon_keeps_serving(
        mounted: Mounted) -> None:
    sums = {"size": 0, "sum_unit": 65536, "sums": ""}
    with ControlClient(str(mounted.path)) as a, ControlClient(str(mounted.path)) as b:
        a.call("kv_ns_create", namespace="n")  # namespaces are no longer made by any use
        for op, fields in (("commit", {"ino": 123456, **sums}), ("abort", {"ino": 1}),
                           ("kv_commit", {"ino": 123456, "namespace": "n", "key": "aw==",
                                          **sums})):
            with pytest.raises(ControlError) as e:
                a.call(op, **fields)
            assert e.value.errno == errno.EBADF, op
        reply, fds = b.call_with_fds("create", path="/theirs", size=10)
        for fd in fds:
            os.close(fd)
        with pytest.raises(ControlError) as e:  # another connection's hidden file
            a.call("commit", ino=reply["ino"], **sums)
        assert e.value.errno == errno.EBADF
        with pytest.raises(ControlError) as e:  # checksums that do not fit the size
            b.call("commit", ino=reply["ino"], size=10, sum_unit=65536, sums="")
        assert e.value.errno == errno.EINVAL
        b.call("commit", ino=reply["ino"], size=0, sum_unit=65536, sums="")
        with pytest.raises(ControlError) as e:  # committed once already
            b.call("commit", ino=reply["ino"], **sums)
        assert e.value.errno == errno.EBADF
        assert a.stat()["pid"] == b.stat()["pid"]
    assert (mounted.path / "theirs").read_bytes() == b""


NOBODY = r"""
import json, sys
from mxfs.client import ControlClient  # before dropping root: Python may live in /root
from mxfs.kv import KVStore
import os
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {}
with ControlClient(sys.argv[1]) as c:
    for op, fields in (("meta_backup", {}), ("kv_stats", {"namespace": "roots"})):
        try:
            c.call(op, **fields); out[op] = "ok"
        except OSError as e:
            out[op] = e.errno
try:
    KVStore(sys.argv[1], "roots").put("k", b"v"); out["put"] = "ok"
except OSError as e:
    out["put"] = e.errno
print(json.dumps(out))
"""


def test_wrong_credentials_are_refused_for_admin_and_kv_requests(mounted: Mounted) -> None:
    from mxfs.kv import KVStore

    os.chmod(mounted.path, 0o755)
    with KVStore(str(mounted.path), "roots") as kv:  # root's namespace (mode 0770)
        kv.put("k", b"v")
    res = subprocess.run([sys.executable, "-c", NOBODY, str(mounted.path)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # (root's private namespace is not there to nobody; its name is taken)
    assert out == {"meta_backup": errno.EPERM, "kv_stats": errno.ENOENT, "put": errno.EACCES}
    with ControlClient(str(mounted.path)) as c:
        assert c.call("kv_stats", namespace="roots")["namespaces"][0]["chunks"] == 1


def test_every_op_replies_as_its_declaration_says(mounted: Mounted) -> None:
    """Each op served once with good fields: its reply (less the envelope) holds what
    `proto/messages.py` declares, no more, no less; a field no op takes is refused."""
    from mxfs.io.checksum import block_sums, pack_sums
    from mxfs.proto import BY_NAME

    (mounted.path / "f").write_bytes(b"y" * 70_000)
    seen = set()

    def ask(c: ControlClient, op: str, **fields: object) -> tuple[dict, list[int]]:
        reply, fds = c.call_with_fds(op, **fields)
        assert reply.pop("ok") is True and reply.pop("id") is not None
        assert BY_NAME[op].stray(reply) is None, (op, reply)
        seen.add(op)
        return reply, fds

    def close(fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    def sums(data: bytes, unit: int) -> str:
        return base64.b64encode(pack_sums(block_sums(data, unit))).decode()

    key = base64.b64encode(b"k1").decode()
    with ControlClient(str(mounted.path)) as c:
        for op in ("hello", "stat", "metrics", "df", "quota", "meta_sync", "meta_backup"):
            ask(c, op)
        ask(c, "layout", path="/f")
        close(ask(c, "open_read", path="/f", odirect=True, remote=True)[1])
        ask(c, "close_read", grant=1)  # (none on one node: grants are a reading node's)
        made, fds = ask(c, "create", path="/g", size=5, mode=0o600)
        os.pwrite(fds[0], b"hello", 0)
        close(fds)
        unit = made["layout"]["stripe_unit"]
        ask(c, "commit", ino=made["ino"], size=5, sum_unit=unit, sums=sums(b"hello", unit))
        dropped, fds = ask(c, "create", path="/h", size=0)
        close(fds)
        ask(c, "abort", ino=dropped["ino"])
        ns = {"namespace": "decl", "shared": False}
        ask(c, "kv_ns_create", namespace="decl", capacity=1 << 30)
        ask(c, "kv_put", **ns, keys=[key], data=[base64.b64encode(b"v" * 100).decode()])
        chunk, fds = ask(c, "kv_create", **ns, key=base64.b64encode(b"k2").decode(), size=3)
        os.pwrite(fds[0], b"abc", 0)
        close(fds)
        ask(c, "kv_commit", **ns, ino=chunk["ino"], key=base64.b64encode(b"k2").decode(),
            size=3, sum_unit=unit, sums=sums(b"abc", unit))
        close(ask(c, "kv_get", **ns, keys=[key, base64.b64encode(b"k2").decode()],
                  pin=True, inline_max=64)[1])
        assert ask(c, "kv_pin", **ns, keys=[key, k3 := base64.b64encode(b"k3").decode()]
                   )[0]["pinned"] == [True, False]
        ask(c, "kv_unpin", **ns, keys=[key, key])
        ask(c, "kv_exists", **ns, keys=[key])
        close(ask(c, "kv_view", **ns)[1])
        ask(c, "kv_claim", **ns, keys=[key, k3], ms=1000)
        ask(c, "kv_wait", **ns, keys=[k3], ms=10)
        ask(c, "kv_list", **ns, limit=10)
        ask(c, "kv_stats", namespace="decl")
        ask(c, "kv_config", **ns, capacity=1 << 20)
        ask(c, "kv_evict", **ns, keep=1 << 20)
        ask(c, "kv_delete", **ns, keys=[key])
        ask(c, "kv_ns_set", namespace="decl", mode=0o750)
        ask(c, "kv_ns_remove", namespace="decl")
        with pytest.raises(ControlError) as e:
            c.call("layout", path="/f", recursive=True)
        assert e.value.errno == errno.EINVAL and "'recursive'" in e.value.strerror
        assert c.layout(str(mounted.path / "g"))["size"] == 5  # the connection goes on
    assert seen == set(BY_NAME)
    assert (mounted.path / "g").read_bytes() == b"hello"


# A control socket served by a tenant (as the user the prelude makes it): it sets
# user.mxfs.control on argv[2] (when given) to name it, then counts what each
# connection sends until stdin closes.
FAKE_DAEMON = r"""
import select
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o777)
s.listen(16)
if len(sys.argv) > 2:
    os.setxattr(sys.argv[2], "user.mxfs.control", path.encode())
print("ready", flush=True)
seen = []
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if sys.stdin in ready and not sys.stdin.readline():
        break
    if s in ready:
        conn, _ = s.accept()
        conn.settimeout(1)
        try:
            seen.append(len(conn.recv(4096)))
        except OSError:
            seen.append(0)
        conn.close()
print(json.dumps(seen), flush=True)
"""


@contextlib.contextmanager
def fake_daemon(user: User, sock: str, folder: str | None = None) -> Iterator[list[int]]:
    """A control socket `user` serves at `sock` (naming it from `folder`); what each
    connection to it sent, once the block ends."""
    p = subprocess.Popen(as_user(user, "import socket\n" + FAKE_DAEMON, sock,
                                 *([folder] if folder else [])),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    seen: list[int] = []
    try:
        yield seen
    finally:
        p.stdin.close()
        seen += json.loads(p.stdout.readline() or "[]")
        p.wait(timeout=30)


@pytest.fixture
def alices_folder() -> Iterator[tuple[User, Path]]:
    """mxfs-alice and a folder of hers outside the mount (on the test machine's disk)."""
    alice = ensure_users()["alice"]
    box = Path(tempfile.mkdtemp(prefix="mxfs-tenant-"))
    box.chmod(0o755)
    mine = box / "alice"
    mine.mkdir()
    os.chown(mine, alice.uid, alice.gid)
    try:
        yield alice, mine
    finally:
        shutil.rmtree(box)


def test_a_control_xattr_off_an_mxfs_mount_is_not_trusted(
        mounted: Mounted, alices_folder: tuple[User, Path]) -> None:
    """A tenant names a socket of hers from a folder of her own; root's command given
    that folder refuses it in one line and never connects (it asked her socket for
    the pool's config, then opened a superblock and store of hers)."""
    alice, mine = alices_folder
    (mine / "model.bin").write_bytes(b"m" * 4096)
    with fake_daemon(alice, str(mine / "sock"), str(mine)) as seen:
        line = one_line_error(mxfs("scrub", str(mine), check=False))
        said = run_as(ensure_users()["bob"], f"""
from mxfs.client.direct import open_reader
from mxfs.errors import MxfsError
try:
    open_reader({str(mine / "model.bin")!r})
    print(json.dumps("opened"))
except MxfsError as e:
    print(json.dumps(str(e)))
""")
    assert f"{mine} carries user.mxfs.control but is not an mxfs mount (it is a folder " \
        "of the " in line and line.endswith("its socket is not trusted"), line
    assert said.startswith(f"{mine} carries user.mxfs.control") and \
        said.endswith("not trusted: give a path on an mxfs mount"), said  # (another user)
    assert seen == []


def test_a_control_socket_another_user_serves_is_not_trusted(
        mounted: Mounted, alices_folder: tuple[User, Path]) -> None:
    """The mount's socket path leading to a socket a tenant serves: refused once
    connected (SO_PEERCRED: not root, not the caller), before a byte is sent."""
    alice, mine = alices_folder
    real = os.getxattr(mounted.path, "user.mxfs.control").decode()
    with fake_daemon(alice, str(mine / "sock")) as seen:
        os.rename(real, real + ".aside")
        os.symlink(mine / "sock", real)
        try:
            line = one_line_error(mxfs("scrub", str(mounted.path), check=False))
        finally:
            os.unlink(real)
            os.rename(real + ".aside", real)
    assert line == f"mxfs: the control socket of {mounted.path} is served by uid " \
        f"{alice.uid}, not by root or you: not trusted"
    assert seen == [0]  # (connected to ask who serves it; sent nothing)
    with ControlClient(str(mounted.path)) as c:  # (the daemon's own, as before)
        assert c.stat()["pool_uuid"]


IN_CONTAINER = r"""
import ctypes
from mxfs.client import ControlClient
def contained():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE (cleared by setuid): her /proc/self
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER: her own namespace, as podman's
        raise OSError(ctypes.get_errno(), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with ControlClient(sys.argv[1]) as c:
        return [os.geteuid(), bool(c.stat()["pool_uuid"])]
r, w = os.pipe()
if os.fork() == 0:  # (one thread: a process with more cannot enter a user namespace)
    try:
        out = contained()
    except BaseException as e:
        out = repr(e)
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
with os.fdopen(r) as f:
    print(f.read())
"""


def test_a_client_in_a_rootless_container_reaches_roots_daemon(
        mounted: Mounted) -> None:
    """A tenant's process in a user namespace that maps only her uid (a rootless
    container) sees root's daemon as the overflow uid, and still reaches it."""
    alice = ensure_users()["alice"]
    os.chmod(mounted.path, 0o755)
    # (root in her namespace, her uid outside it)
    assert run_as(alice, IN_CONTAINER, str(mounted.path)) == [0, True]

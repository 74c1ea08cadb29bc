"""A pool across nodes, on this machine: the writer node mounted here, a reading node in
a network namespace of its own (`conftest.node_net`), its daemon started with
`nsenter --net` so that its mount is visible here; the metadata on the session's
PostgreSQL server.  The reading node reads every member through the writer's chunk
service, sees the writer's changes from one open to the next, writes nothing, and
reads EIO, never stale bytes, while the writer is dead.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import netns
import psycopg
import pytest
import torch
import xxhash
from conftest import (
    HAVE_FUSE,
    Mounted,
    eventually,
    make_members,
    mkfs,
    mount_with,
    mounted_pool,
    mxfs,
    node_net,
    raw_socket,
    requests_served,
    slow_member,
    steady_page_cache,
)
from dir_lock import held_dir_lock
from netns import NodeNet
from safetensors.torch import save_file
from test_dcp import run_ranks
from users import User, as_user, ensure_users, run_as, subordinate_uids

import mxfs.ckpt as ck
from mxfs.client.control import ControlClient
from mxfs.client.direct import DirectFile, FileChanged, PlainFile, RemoteFile, open_reader
from mxfs.fs import kv_follow
from mxfs.fs.chunk_service import CHANGE_LATE_S
from mxfs.fs.node_files import HOLDS_AT_ONCE
from mxfs.io import Layout
from mxfs.io.chunk_client import ChunkClient
from mxfs.kv import KVStore
from mxfs.load import load_file
from mxfs.pool.key import KEY_NAME, load_key
from mxfs.pool.superblock import read_superblock
from mxfs.proto import HEADER, encode
from mxfs.proto.chunk_wire import ANSWER, MAX_SCOPE, READ, SCOPE_COUNT, WireError
from mxfs.proto.messages import CLOSE_READ, KV_GET, OPEN_READ

pytestmark = [pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse"),
              pytest.mark.nodes]


def _status(m: Mounted) -> dict[str, Any]:
    return json.loads(mxfs("status", "--json", str(m.path)).stdout)


def _digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def _log(m: Mounted) -> str:
    """A reading node's daemon log (beside its control socket)."""
    status = _status(m)
    return (Path(status["socket"]).parent /
            f"{status['pool_uuid']}-{status['node']}.log").read_text()


def _node_state(m: Mounted, name: str) -> str | None:
    return {n["name"]: n["state"] for n in _status(m)["nodes"]}.get(name)


def _reads(path: Path) -> bytes | None:
    """The file's bytes, or None while it reads EIO."""
    try:
        return path.read_bytes()
    except OSError as e:
        assert e.errno == errno.EIO
        return None


def _join(tmp_path: Path, url: str, key: str, name: str = "b") -> str:
    config = str(tmp_path / name / "node.toml")
    res = mxfs("node", "add", "--meta", url, "--key", key, "--name", name, "--config", config)
    assert f"node {name} joined pool" in res.stdout
    return config


WRITER = ("chunk_port=0", "lease_s=3", "node=a")  # node a: the members, chunks served


@contextlib.contextmanager
def _writer_node(tmp_path: Path, url: str) -> Iterator[tuple[NodeNet, Mounted, list[str]]]:
    """A pool on `url` mounted here as writer node a, and a namespace for a second
    node: (its network, a's mount, a's members)."""
    members = make_members(tmp_path / "a")
    mkfs(members, "64KiB", "--meta", url)
    with node_net() as net, mounted_pool(members, *WRITER, f"chunk_addr={net.host_ip}") as a:
        yield net, a, members


def _reading_node(tmp_path: Path, url: str, net: NodeNet, members: list[str],
                  *options: str) -> contextlib.AbstractContextManager[Mounted]:
    """Node b joined (`mxfs node add`, with a's key) and mounted in `net`."""
    config = _join(tmp_path, url, str(Path(members[0], KEY_NAME)))
    return mount_with([config], "lease_s=3", *options, prefix=net.enter, check=False)


@pytest.mark.daemon_log(r"node \S+ (is dead|cannot be reached|could not serve)",
                        r"recovered pool", r"serves its members again",
                        # (a proof the reading node ended on finding the stopped writer
                        # dead: the writer's service reads its end after SIGCONT)
                        r"chunk handshake .* failed \(EOFError")
def test_reading_node(tmp_path: Path, pg_cluster: Any) -> None:
    url = pg_cluster.database()
    members = make_members(tmp_path / "a")
    mkfs(members, "64KiB", "--meta", url)
    key = str(Path(members[0], KEY_NAME))
    writer_opts = ("chunk_port=0", "lease_s=3", "node=a")
    with node_net() as net:
        ns = net.enter
        with mounted_pool(members, *writer_opts, f"chunk_addr={net.host_ip}") as a:
            model = os.urandom(3 << 20)  # 48 stripe units: every member several times
            (a.path / "models").mkdir()
            (a.path / "models" / "m.bin").write_bytes(model)
            unread = os.urandom(1 << 20)
            (a.path / "unread.bin").write_bytes(unread)

            # Joining checks the key against the pool's own name for it.
            bad = tmp_path / "bad.key"
            bad.write_bytes(os.urandom(32))
            bad.chmod(0o600)
            res = mxfs("node", "add", "--meta", url, "--key", str(bad), "--name", "b",
                       "--config", str(tmp_path / "bad.toml"), check=False)
            assert res.returncode != 0 and "is not pool" in res.stderr, res.stderr
            assert not (tmp_path / "bad.toml").exists()
            config = _join(tmp_path, url, key)
            assert os.stat(config).st_mode & 0o777 == 0o600

            with mount_with([config], "lease_s=3", "max_kv_lent_per_user=4194304",
                            prefix=ns, check=False) as b:
                # Every member read through the writer's chunk service, here and by
                # the loader (the direct path hands remote files to the mount).
                assert _digest(b.path / "models" / "m.bin") == xxhash.xxh3_128_hexdigest(model)
                with open_reader(str(b.path / "models" / "m.bin")) as f:
                    buf = bytearray(len(model))
                    f.read_into(0, memoryview(buf))
                    assert bytes(buf) == model
                status = _status(b)
                assert status["node"] == "b"
                nodes = {n["name"]: n for n in status["nodes"]}
                assert nodes["a"]["role"] == "writer" and nodes["a"]["state"] == "alive"
                assert nodes["a"]["addr"].startswith(net.host_ip + ":")
                assert nodes["a"]["members"] == len(members)
                assert nodes["b"]["role"] == "reader" and nodes["b"]["state"] == "alive"
                assert all(m["node"] == "a" for m in status["members"])
                assert {n["name"] for n in _status(a)["nodes"]} == {"a", "b"}

                # Holding no members, it writes no bytes through its mount (names and
                # attributes are the writer's to change for it: test_files_written_...).
                for change in (lambda: (b.path / "new").write_bytes(b"x"),
                               lambda: (b.path / "models" / "m.bin").write_bytes(b"x"),
                               lambda: os.truncate(b.path / "models" / "m.bin", 1)):
                    with pytest.raises(OSError) as e:
                        change()
                    assert e.value.errno == errno.EROFS
                assert _digest(b.path / "models" / "m.bin") == xxhash.xxh3_128_hexdigest(model)
                os.symlink("m.bin", b.path / "models" / "l")
                os.chmod(b.path / "models" / "m.bin", 0o600)
                assert os.readlink(a.path / "models" / "l") == "m.bin"
                assert stat.S_IMODE(os.stat(a.path / "models" / "m.bin").st_mode) == 0o600
                os.unlink(b.path / "models" / "l")
                # Extended attributes, FIFOs and layouts through b are the writer's too,
                # judged there as the caller (the kernel's rules: user.* for who may
                # write, trusted.* root's, devices root's).
                m_b, m_a = b.path / "models" / "m.bin", a.path / "models" / "m.bin"
                os.setxattr(m_b, "user.origin", b"hub\0/x")
                os.setxattr(m_b, "trusted.k", b"")
                assert os.getxattr(m_a, "user.origin") == b"hub\0/x"
                assert os.getxattr(m_a, "trusted.k") == b""
                assert eventually(lambda: "user.origin" in os.listxattr(m_b), 10)
                os.removexattr(m_b, "user.origin")
                assert "user.origin" not in os.listxattr(m_a)
                with pytest.raises(OSError) as e:
                    os.removexattr(m_b, "user.origin")
                assert e.value.errno == errno.ENODATA
                os.mkfifo(b.path / "models" / "fifo")
                assert stat.S_ISFIFO(os.stat(a.path / "models" / "fifo").st_mode)
                os.unlink(b.path / "models" / "fifo")
                mxfs("setstripe", "--unit", "128KiB", str(b.path / "models"))
                assert "stripe_unit=131072" in os.getxattr(
                    a.path / "models", "user.mxfs.layout").decode()
                os.chmod(m_a, 0o644)
                alice = ensure_users()["alice"]
                (a.path / "open").mkdir(mode=0o777)
                os.chmod(a.path / "open", 0o777)
                (a.path / "alice.txt").write_bytes(b"hers")
                os.chown(a.path / "alice.txt", alice.uid, alice.gid)
                assert eventually(lambda: (b.path / "alice.txt").stat().st_uid == alice.uid,
                                  10)
                got = run_as(alice, """
import errno, os
path = sys.argv[1]
out = []
for call in (lambda: os.setxattr(path + "/models/m.bin", "user.x", b"1"),
             lambda: os.setxattr(path + "/alice.txt", "trusted.x", b"1"),
             lambda: os.mknod(path + "/open/dev", 0o600 | 0o20000, os.makedev(1, 3)),
             lambda: os.setxattr(path + "/alice.txt", "user.x", b"1")):
    try:
        call()
        out.append("ok")
    except OSError as e:
        out.append(errno.errorcode[e.errno])
print(json.dumps(out))
""", str(b.path))
                assert got == ["EACCES", "EPERM", "EPERM", "ok"]
                assert os.getxattr(a.path / "alice.txt", "user.x") == b"1"

                # Close-to-open: what the writer closed, the reader's next open sees.
                model2 = os.urandom(len(model))
                (a.path / "models" / "m.bin").write_bytes(model2)
                late = os.urandom(70_000)
                (a.path / "models" / "late.bin").write_bytes(late)
                assert eventually(lambda: (b.path / "models" / "late.bin").exists(), 10)
                assert (b.path / "models" / "late.bin").read_bytes() == late
                assert eventually(lambda: _digest(b.path / "models" / "m.bin") ==
                                  xxhash.xxh3_128_hexdigest(model2), 10)

                # Tools that work on the members say where to run them; KV puts are
                # the writer's too.
                res = mxfs("scrub", str(b.path), check=False)
                assert res.returncode != 0 and "run it on node a" in res.stderr, res.stderr
                assert "members are node a's" in mxfs("df", str(b.path)).stdout
                # Its statfs is the writer's members' space, as the writer published it
                # (never a count of every row of the store).
                assert os.statvfs(b.path).f_blocks == os.statvfs(a.path).f_blocks > 0
                assert _status(b)["inodes"] > 0
                # A KV chunk put on the writer is a hit on the reading node (copied over
                # from the writer, its checksums checked).
                small, large = os.urandom(100), os.urandom(3 << 20)
                on_a = KVStore(str(a.path), namespace="t", mode=0o755)
                on_a.put(b"s" * 32, small)
                on_a.put(b"l" * 32, large)
                on_b = KVStore(str(b.path), namespace="t")
                assert on_b.get(b"s" * 32) == small
                assert on_b.get(b"l" * 32) == large
                assert on_b.get(b"m" * 32) is None
                assert on_b.batch_exists([b"s" * 32, b"l" * 32, b"m" * 32]) == 2
                # KVStore reads a chunk from the writer itself (connections scoped to
                # the get's chunks); for a caller that does not take connections the
                # daemon copies it, and a copy is lent (memory of the node's daemon):
                # one user gets at most max_kv_lent_per_user (here 4 MiB) at once.
                got = run_as(ensure_users()["alice"], """
import base64
from mxfs.client.control import ControlClient
kv = mxfs.kv.KVStore(sys.argv[1], namespace="t", shared=True)
out = [kv.get(b"l" * 32) is not None for _ in range(3)]
c = ControlClient(sys.argv[1])
key = base64.b64encode(b"l" * 32).decode()
for _ in range(2):
    reply, fds = c.call_with_fds("kv_get", namespace="t", keys=[key], shared=True)
    out.append(reply["chunks"][0] is not None and "ino" not in reply["chunks"][0])
print(json.dumps(out))
""", str(b.path))
                assert got == [True, True, True, True, False]

                # The writer stopped past its lease: dead to the reader, whose reads of
                # it fail at once (no wait on a node that does not answer); woken, it
                # renews its lease (nobody took it) and is read again.  A read sent
                # while it still looked alive (a kept connection: its kernel takes the
                # request) ends when the reader finds it dead, with the writer still
                # stopped, not at the receive timeout (30 s); so does a KV get there
                # (a miss: the connections lent for its chunk are shut, and the copy
                # it falls back to closes its mapping whatever the read left behind).
                a_pid = a.daemon_pid()
                os.kill(a_pid, signal.SIGSTOP)
                in_flight: dict[str, object] = {}

                def read_unread() -> None:
                    try:
                        (b.path / "unread.bin").read_bytes()
                    except BaseException as e:
                        in_flight["read"] = e

                def get_large() -> None:
                    try:
                        in_flight["get"] = on_b.get(b"l" * 32)
                    except BaseException as e:
                        in_flight["get"] = e

                sent = [threading.Thread(target=read_unread), threading.Thread(target=get_large)]
                for t in sent:
                    t.start()
                try:
                    assert eventually(lambda: _node_state(b, "a") == "dead", 15)
                    for t in sent:
                        t.join(15)  # (a's lease is 3 s: the reader's keeper finds it soon)
                        assert not t.is_alive(), "a call of the stopped writer outlived its lease"
                    assert getattr(in_flight["read"], "errno", None) == errno.EIO, in_flight
                    assert in_flight["get"] is None  # (a chunk on a dead node: a miss)
                    with pytest.raises(OSError) as e:
                        (b.path / "unread.bin").read_bytes()
                    assert e.value.errno == errno.EIO
                    # KV puts and claims there fail at once too (the engine goes on
                    # without caching), small or large, never waiting on the dead node.
                    for value in (b"v" * 100, os.urandom(1 << 20)):
                        with pytest.raises(OSError) as e:
                            on_b.put(os.urandom(32), value)
                        assert e.value.errno == errno.EIO and "node a is dead" in str(e.value)
                    with pytest.raises(OSError) as e:
                        on_b.claim([os.urandom(32)])
                    assert e.value.errno == errno.EIO
                    # (refused by the lease, not by a receive left to time out)
                    assert "node a is dead (its lease ran out)" in _log(b)
                finally:
                    os.kill(a_pid, signal.SIGCONT)
                    for t in sent:
                        t.join()
                assert eventually(lambda: _node_state(b, "a") == "alive", 15)
                assert eventually(lambda: _reads(b.path / "models" / "late.bin") == late, 15)

                # The writer dies: what the reader has not cached reads EIO, not bytes.
                os.kill(a.daemon_pid(), signal.SIGKILL)
                with pytest.raises(OSError) as e:
                    (b.path / "unread.bin").read_bytes()
                assert e.value.errno == errno.EIO
                mxfs("umount", str(a.path))
                assert eventually(lambda: {n["name"]: n["state"] for n in _status(b)["nodes"]}
                                  .get("a") == "dead", 15)
                with pytest.raises(OSError) as e:
                    (b.path / "unread.bin").read_bytes()
                assert e.value.errno == errno.EIO

                # It comes back (a new epoch): its members read again.
                res = mxfs("mount", "-o", ",".join(("allow_other", *writer_opts,
                                                    f"chunk_addr={net.host_ip}")),
                           members[0], str(a.path))
                assert res.returncode == 0
                deadline = time.monotonic() + 15
                while True:
                    try:
                        got = (b.path / "unread.bin").read_bytes()
                        break
                    except OSError as e2:
                        assert e2.errno == errno.EIO
                        assert time.monotonic() < deadline, "the writer's members stay EIO"
                        time.sleep(0.2)
                assert got == unread
            # The reading node gave its lease back at unmount.
            assert {n["name"] for n in _status(a)["nodes"]} == {"a"}


def test_node_add_refuses(tmp_path: Path, pg_cluster: Any) -> None:
    """What `mxfs node add` refuses, each with one line: a pool whose writer never
    served chunks, a bad name, a key others may read."""
    url = pg_cluster.database()
    members = make_members(tmp_path / "a")
    mkfs(members, "64KiB", "--meta", url)
    key = tmp_path / "k"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)

    def add(*extra: str) -> str:
        res = mxfs("node", "add", "--meta", url, "--key", str(key), "--config",
                   str(tmp_path / "n.toml"), *extra, check=False)
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) <= 2, res.stderr
        return res.stderr

    assert "never served chunks" in add("--name", "b")
    assert "is not one" in add("--name", "../x")
    key.chmod(0o644)
    assert "may be read by others" in add("--name", "b")
    assert not (tmp_path / "n.toml").exists()


@pytest.mark.daemon_log(r"lease could not be renewed", r"lease is renewed again",
                        r"node \S+ (is dead|cannot be reached|could not serve)",
                        r"serves its members again",
                        # (went away: a request in flight when the server stopped)
                        r"metadata server .* (cannot be reached|went away)",
                        r"the change feed cannot be read")
def test_a_reading_node_rides_out_a_metadata_server_restart(tmp_path: Path) -> None:
    """The metadata server stops and starts again: the writer, unable to renew, stops
    serving chunks (asked straight, it refuses; the reading node reads what it already
    held of an open file or EIO, never other bytes); once the server is back both nodes
    renew and the reading node reads again, without a remount, and its KV lookups,
    which lost their table with the feed, have one again (a key put since shows)."""
    from pg_server import private

    server_gen = private()
    server = next(server_gen)
    try:
        url = server.database()
        with _writer_node(tmp_path, url) as (net, a, members):
            files = {f"f{i}": os.urandom(300_000) for i in range(3)}
            for name, data in files.items():
                (a.path / name).write_bytes(data)
            with _reading_node(tmp_path, url, net, members) as b:
                assert (b.path / "f0").read_bytes() == files["f0"]
                on_a = KVStore(str(a.path), namespace="t", mode=0o755)
                assert on_a.put(b"k1", b"v")
                on_b = KVStore(str(b.path), namespace="t")
                assert on_b.exists_many([b"k1", b"k2"]) == [True, False]  # (its table)
                fd = os.open(b.path / "f1", os.O_RDONLY)  # opened before the outage
                served = _chunk_service(a, members[0])
                ino = os.stat(a.path / "f1").st_ino
                assert served(ino) is not None
                try:
                    server.stop()
                    try:
                        # the writer fences itself at half its lease: it serves nothing
                        assert eventually(lambda: served(ino) is None, 15)
                        assert _reads_fd(fd) in (None, files["f1"])
                    finally:
                        server.start()
                    assert eventually(lambda: _reads_fd(fd) == files["f1"], 30)
                finally:
                    os.close(fd)
                assert eventually(lambda: _reads(b.path / "f2") == files["f2"], 30)
                assert {n["name"]: n["state"] for n in _status(b)["nodes"]} == \
                    {"a": "alive", "b": "alive"}

                def put_again() -> bool:
                    try:
                        return on_a.put(b"k2", b"w")
                    except OSError:  # (the writer renews first)
                        return False
                assert eventually(put_again, 30)
                assert eventually(lambda: on_b.exists_many([b"k1", b"k2"]) == [True, True],
                                  15)

                def from_its_table() -> bool:
                    asked = requests_served(b.path, "kv_exists")
                    return on_b.exists_many([b"k1", b"k3"]) == [True, False] and \
                        requests_served(b.path, "kv_exists") == asked
                assert eventually(from_its_table, 15)
                on_b.close()
                on_a.close()
    finally:
        for _ in server_gen:
            pass


@pytest.mark.daemon_log(r"lease could not be renewed", r"lease is renewed again",
                        r"node \S+ (is dead|cannot be reached|could not serve)",
                        r"serves its members again", r"metadata server .* (cannot be "
                        r"reached|went away|is back)", r"the change feed cannot be read")
def test_a_hung_metadata_server_holds_a_reading_nodes_users_a_short_while(tmp_path: Path
                                                                          ) -> None:
    """The metadata server stops answering (SIGSTOP): a lookup on the reading node waits
    for it in the store's worker thread, at most SERVE_WAIT_S, not the minute a long
    statement may take, as do `mxfs status` and a control request's path walk;
    meanwhile the daemon's loop serves what needs no server (a read of an open file, a
    hello), and what needs the server fails (EIO) instead of hanging."""
    from pg_server import private

    server_gen = private()
    server = next(server_gen)
    try:
        url = server.database()
        with _writer_node(tmp_path, url) as (net, a, members), \
                _reading_node(tmp_path, url, net, members) as b:
            (a.path / "f").write_bytes(b"f")
            assert eventually(lambda: _reads(b.path / "f") == b"f", 15)
            key = base64.b64encode(b"k" * 32).decode()
            KVStore(str(a.path), namespace="t", mode=0o755).put(b"k" * 32, b"v")
            kv = ControlClient(str(b.path), timeout=30)
            assert kv.call("kv_exists", namespace="t", keys=[key])["present"] == [True]
            other = raw_socket(b, timeout=30)  # (its socket found while all is well)
            held = os.open(b.path / "f", os.O_RDONLY)
            paths = ControlClient(str(b.path), timeout=30)
            procs = server.processes()
            for pid in procs:
                os.kill(pid, signal.SIGSTOP)
            try:
                failed: list[int] = []
                stated = threading.Event()

                def look() -> None:
                    # `mxfs status` (the nodes and what the writer published, read in
                    # the store's worker): answered once the server is given up on
                    if paths.call("stat")["pool_uuid"]:
                        stated.set()
                    try:  # a control request's walk of a path (the store's worker too)
                        paths.call("layout", path="/f")
                    except OSError as e:
                        failed.append(e.errno)
                    try:
                        os.stat(b.path / "never-looked-up")
                    except OSError as e:
                        failed.append(e.errno)
                looking = threading.Thread(target=look)
                looking.start()
                time.sleep(0.5)  # (the lookup is the daemon's now, waiting on the server)
                os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(held, 1, 0) == b"f"  # (the daemon's read: no server needed)
                other.sendall(encode({"op": "hello", "id": 1}))
                assert other.recv(HEADER.size), "the reading node did not answer"
                # ... both answered while the status still waits on the server (on the
                # loop, it held them until it gave up)
                assert not stated.is_set() and looking.is_alive()
                looking.join(30)
                assert stated.is_set() and failed == [errno.EIO, errno.EIO]
                # KV lookups (the store's worker thread) are bounded the same way, and
                # then refused at once while the server stays away.
                for _ in range(2):
                    with pytest.raises(OSError) as e:
                        kv.call("kv_exists", namespace="t", keys=[key])
                    assert e.value.errno == errno.EIO
            finally:
                for pid in procs:
                    os.kill(pid, signal.SIGCONT)
                other.close()
                paths.close()
                os.close(held)
            assert eventually(lambda: _reads(b.path / "f") == b"f", 30)

            def looks_up() -> bool:
                try:
                    return kv.call("kv_exists", namespace="t", keys=[key])["present"] == [True]
                except OSError:
                    return False
            assert eventually(looks_up, 30)  # (the same store, dialled again)
            kv.close()
    finally:
        for _ in server_gen:
            pass


def _chunk_service(m: Mounted, member0: str) -> Callable[[int], bytes | None]:
    """Ask the node's chunk service straight for the first 4 KiB of an inode on member
    0 (the file's bytes, or None when it refuses or cannot be reached)."""
    status = _status(m)
    addr = status["chunk_service"]
    key = load_key(member0)

    def read(ino: int) -> bytes | None:
        try:
            with ChunkClient(addr["addr"], int(addr["port"]), key, status["pool_uuid"]) as c:
                return c.read(ino, 0, 0, 4096)
        except OSError:
            return None
    return read


def _reads_fd(fd: int) -> bytes | None:
    """An open file's bytes read afresh (its cached pages dropped), or None on EIO."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        return os.pread(fd, 1 << 20, 0)
    except OSError as e:
        assert e.errno == errno.EIO
        return None


def _published(url: str) -> int:
    """The last change feed row committed (read straight from the server)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()
    assert row is not None
    return int(row[0])


def _caught_up(b: Mounted, url: str) -> None:
    """Wait until the reading node has read the change feed to its last row."""
    want = _published(url)
    assert eventually(lambda: (_status(b)["feed"] or {}).get("seq", 0) >= want, 15), \
        _status(b)["feed"]


@pytest.mark.daemon_log(r"the change feed cannot be read", r"the change feed is read again")
def test_a_reading_node_drops_what_the_writer_changed_as_it_commits(
        tmp_path: Path, pg_cluster: Any) -> None:
    """The reading node's kernel keeps names, absent names, attributes and pages for
    long (the feed's backstop, 60 s), and every change the writer commits is dropped
    from it as the feed brings it: a name made, renamed or removed, a mode changed, a
    file rewritten in place are seen at once, not after a timeout.  The feed's own
    connection killed by the server: rows missed meanwhile are read on reconnecting."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members):
        d = a.path / "d"
        d.mkdir()
        for name in ("f1", "g", "h"):
            (d / name).write_bytes(name.encode())
        big = os.urandom(1 << 20)
        (d / "big").write_bytes(big)
        with _reading_node(tmp_path, url, net, members) as b:
            bd = b.path / "d"
            assert eventually(lambda: _status(b)["feed"]["live"], 15)
            assert _status(a)["feed"]["role"] == "publishes"
            # What the reading node's kernel now holds: an absent name, a listing,
            # attributes, a file's pages.
            assert not (bd / "x").exists()
            assert sorted(os.listdir(bd)) == ["big", "f1", "g", "h"]
            assert stat.S_IMODE((bd / "h").stat().st_mode) == 0o644
            assert (bd / "big").read_bytes() == big
            # ... for 60 s (not the 1 s of a reading node without the feed).  (Whether
            # the kernel keeps them that long is its own: it reclaims dentries when the
            # page cache presses on memory; bench_nodes measures what it saves.)
            assert _status(b)["feed"]["answers_s"] == 60

            (d / "x").write_bytes(b"new")
            (d / "f1").rename(d / "f2")
            (d / "g").unlink()
            (d / "h").chmod(0o600)
            big2 = os.urandom(len(big))
            with open(d / "big", "r+b") as f:  # in place: same size, new bytes
                f.write(big2)
            _caught_up(b, url)
            assert (bd / "x").read_bytes() == b"new"
            assert sorted(os.listdir(bd)) == ["big", "f2", "h", "x"]
            assert not (bd / "g").exists()
            assert stat.S_IMODE((bd / "h").stat().st_mode) == 0o600
            assert (bd / "big").read_bytes() == big2
            assert _status(b)["feed"]["invalidations"] > 0

            # The server ends the feed's connection; what the writer changes meanwhile
            # is read once the node has connected again.
            with psycopg.connect(url, autocommit=True) as conn:
                killed = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM "
                                      "pg_stat_activity WHERE application_name = "
                                      "'mxfs change feed'").fetchone()
            assert killed is not None and killed[0] >= 1
            assert not (bd / "y").exists()
            (d / "y").write_bytes(b"y")
            (d / "x").unlink()
            _caught_up(b, url)
            assert (bd / "y").read_bytes() == b"y"
            assert not (bd / "x").exists()
            assert _status(b)["feed"]["live"]


def test_a_directory_one_user_holds_on_a_reading_node_stalls_nobody_elses_changes(
        tmp_path: Path, pg_cluster: Any) -> None:
    """Alice holds a directory's lock on the reading node (a listing of it that waits in
    the kernel, `dir_lock.py`) for the whole test, and the writer changes a name in it:
    the invalidation of that name waits for her.  Bob's file made on the writer
    meanwhile shows on the reading node at once all the same (its kernel had kept "no
    such name" for 60 s), and the node reads the feed on (its word to the writer says
    the rows it read).  Before, the feed's one thread made the invalidations: it waited
    on Alice's directory and nothing after was invalidated or read."""
    url = pg_cluster.database()
    users = ensure_users()
    bob = users["bob"]
    with _writer_node(tmp_path, url) as (net, a, members):
        (a.path / "held").mkdir(mode=0o755)
        (a.path / "held" / "f").write_bytes(b"f")
        (a.path / "bobs").mkdir(mode=0o755)
        os.chown(a.path / "bobs", bob.uid, bob.gid)
        with _reading_node(tmp_path, url, net, members) as b:
            assert eventually(lambda: _status(b)["feed"]["live"], 15)
            assert not (b.path / "bobs" / "new").exists()  # (kept 60 s by the kernel)
            assert not (b.path / "held" / "g").exists()
            with held_dir_lock(b.path / "held", users["alice"]):
                before = _status(b)["feed"]["seq"]
                (a.path / "held" / "g").write_bytes(b"g")  # (waits for Alice on b)
                assert eventually(lambda: _status(b)["feed"]["seq"] > before, 15)
                run_as(bob, """
with open(sys.argv[1], "wb") as f:
    f.write(b"bob's")
print(json.dumps(None))
""", str(a.path / "bobs" / "new"))
                assert eventually(lambda: (b.path / "bobs" / "new").exists(), 20), \
                    _status(b)["feed"]
                assert (b.path / "bobs" / "new").read_bytes() == b"bob's"
                _caught_up(b, url)  # (what its word to the writer says: read on)
                assert _status(b)["feed"]["pending"] >= 1  # (Alice's "g", still)
            assert eventually(lambda: (b.path / "held" / "g").exists(), 20)
            assert eventually(lambda: _status(b)["feed"]["pending"] == 0, 15)


def test_a_reading_nodes_kv_lookups_never_hold_its_other_requests(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A reading node looks a get's KV keys up in the metadata server; a lookup the
    server is slow to answer (here: the table locked) waits in a worker thread, while
    the daemon goes on answering other requests (and exists, from the node's table,
    is answered without the server); it is answered once the server is."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members):
        KVStore(str(a.path), namespace="t", mode=0o755).put(b"k" * 32, b"v" * 100)
        with _reading_node(tmp_path, url, net, members) as b:
            keys = [b"k" * 32] + [os.urandom(32) for _ in range(4095)]
            kv = KVStore(str(b.path), namespace="t")
            # (a node keeps tables only once it follows the feed: asked before, it is
            # answered EAGAIN, and its store asks the daemon for a while, the lookup
            # below then waiting behind the locked one until the server was judged away)
            assert eventually(lambda: _status(b)["feed"]["live"], 15)
            assert kv.batch_exists(keys) == 1  # (the namespace's table, mapped)
            assert _status(b)["kv_views"]["tables"] == 1
            got: list[object] = []
            with psycopg.connect(url) as lock:
                lock.execute("LOCK TABLE kv IN ACCESS EXCLUSIVE MODE")
                asking = threading.Thread(target=lambda: got.append(
                    sum(g is not None for g in kv.batch_get(keys))))
                asking.start()
                try:
                    assert eventually(lambda: lock.execute(
                        "SELECT count(*) FROM pg_locks WHERE relation = 'kv'::regclass "
                        "AND NOT granted").fetchone() == (1,), 15)
                    with ControlClient(str(b.path)) as c:  # answered meanwhile
                        assert c.call("hello")["pool_uuid"]
                    assert kv.batch_exists(keys) == 1  # (the table: no server asked)
                    assert asking.is_alive() and not got  # (the lookup still waits)
                finally:
                    lock.rollback()
                asking.join(30)
            assert got == [1]
            kv.close()


# Waits on one key from as many connections of one user at once; what each answered.
WAITS = """
import base64, threading
key, n = base64.b64decode(sys.argv[2]), int(sys.argv[3])
out = [None] * n
def one(i):
    out[i] = mxfs.kv.KVStore(sys.argv[1], namespace="t", shared=True).wait([key], 20)[0]
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""


@pytest.mark.daemon_log(r"chunk request for the daemon failed")
def test_kv_puts_and_claims_on_a_reading_node_are_the_pools(tmp_path: Path, pg_cluster: Any
                                                            ) -> None:
    """A prefix an instance on a reading node computed is a hit on every node: its
    chunks go to the writer's chunk service (small ones in the request, large ones
    through a memfd of the node's daemon) and are judged there as that user's puts;
    its claims are the writer's too, so two nodes missing one prefix compute it once."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members):
        (a.path / "f.bin").write_bytes(os.urandom(100_000))
        with _reading_node(tmp_path, url, net, members, "max_kv_lent_per_user=4194304",
                           "max_pending=8") as b:
            small, large = os.urandom(100), os.urandom(3 << 20)
            on_b = KVStore(str(b.path), namespace="t", mode=0o755)
            assert on_b.batch_put([b"s" * 32, b"l" * 32], [small, large]) == [True, True]
            assert on_b.batch_put([b"s" * 32, b"l" * 32], [small, large]) == [False, False]
            # several large chunks: sent on over connections of the store's own, at once
            many, names = [os.urandom(512 << 10) for _ in range(6)], [b"%02d" % i * 16
                                                                      for i in range(6)]
            assert on_b.batch_put(names, many) == [True] * 6
            assert len(on_b._put_conns or ()) == 3  # (the store's, besides its first)
            assert on_b.batch_put(names, many) == [False] * 6
            on_a = KVStore(str(a.path), namespace="t")
            assert on_a.get(b"s" * 32) == small and on_a.get(b"l" * 32) == large
            assert [bytes(g) for g in on_a.batch_get(names)] == many
            assert on_b.get(b"l" * 32) == large and on_b.batch_exists([b"s" * 32]) == 1
            # As the user's puts on the writer: root's namespace (0755) refuses alice's
            # puts and claims; her own is hers there (its owner, her quota).
            got = run_as(ensure_users()["alice"], """
import errno
kv = mxfs.kv.KVStore(sys.argv[1], namespace="t", shared=True)
out = []
for attempt in (lambda: kv.put(b"x" * 32, b"v" * 100), lambda: kv.claim([b"x" * 32])):
    try:
        out.append(str(attempt()))
    except OSError as e:
        out.append(errno.errorcode[e.errno])
mine = mxfs.kv.KVStore(sys.argv[1], namespace="alices")
out += mine.batch_put([b"a" * 32, b"b" * 32], [b"v" * 100, b"w" * (2 << 20)])
print(json.dumps(out))
""", str(b.path))
            assert got == ["EACCES", "EACCES", True, True]
            alices = {n["namespace"]: n for n in ControlClient(str(a.path)).call(
                "kv_stats")["namespaces"]}["alices"]
            assert (alices["uid"], alices["chunks"]) == (ensure_users()["alice"].uid, 2)
            # A chunk being written is memory of b's daemon: one uid holds 4 MiB of them
            # at most here, and they go with the connection that did not commit them.
            key = base64.b64encode(b"p" * 32).decode()
            for _ in range(2):
                with ControlClient(str(b.path)) as c:
                    reply, fds = c.call_with_fds("kv_create", namespace="t", key=key,
                                                 size=3 << 20)
                    with pytest.raises(OSError) as e:
                        c.call_with_fds("kv_create", namespace="t", key=key, size=3 << 20)
                    assert e.value.errno == errno.ENOSPC
                    assert _status(b)["kv_forward"]["writing"] == 3 << 20
                    for fd in fds:
                        os.close(fd)
            assert eventually(lambda: _status(b)["kv_forward"]["writing"] == 0, 5)
            # ... and each is a descriptor of b's daemon, whatever its size: at most
            # max_pending (here 8) at once on a connection.
            with ControlClient(str(b.path)) as c:
                for _ in range(8):
                    for fd in c.call_with_fds("kv_create", namespace="t", key=key,
                                              size=0)[1]:
                        os.close(fd)
                with pytest.raises(OSError) as e:
                    c.call_with_fds("kv_create", namespace="t", key=key, size=0)
                assert e.value.errno == errno.EMFILE
            # Copies lent to one uid stay under max_kv_lent_per_user (4 MiB) however many
            # of its gets copy at once: of eight 3 MiB gets at once, one is lent.
            lent = run_as(ensure_users()["alice"], """
import base64, threading
from mxfs.client.control import ControlClient
key, held, out = base64.b64encode(b"l" * 32).decode(), [], []
def get():
    with ControlClient(sys.argv[1]) as c:
        reply, fds = c.call_with_fds("kv_get", namespace="t", keys=[key], shared=True)
        out.append(reply["chunks"][0] is not None)
        held.extend(fds)
threads = [threading.Thread(target=get) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(sum(out)))
""", str(b.path))
            assert lent == 1, lent
            forwarded = _status(b)["kv_forward"]
            assert forwarded["puts"] >= 6 and forwarded["put_bytes"] >= 2 * (3 << 20)
            assert "KV sent on to the writer: " in mxfs("status", str(b.path)).stdout
            # Instances on two nodes that miss one prefix compute it once: the claims
            # are the writer's, whichever node they are made on, and a wait on one
            # node ends with a put on the other.
            for first, second in ((on_b, on_a), (on_a, on_b)):
                keys = [os.urandom(32) for _ in range(3)]
                assert first.claim(keys) == ["yours"] * 3
                assert second.claim(keys) == ["busy"] * 3
                waited: list[list[bool]] = []
                waiting = threading.Thread(target=lambda w=waited, s=second, k=keys:
                                           w.append(s.wait(k)))
                waiting.start()
                time.sleep(0.2)
                assert not waited  # (waits for the puts)
                first.batch_put(keys, [b"c" * 100, b"d" * (1 << 20), b"e" * 100])
                waiting.join(15)
                assert waited == [[True] * 3]
                assert second.claim(keys) == ["stored"] * 3
            # One user's waits leave room for another's: past WAITERS_PER_USER, alice's
            # are answered at once (not stored yet), while bob's still waits for the put.
            keys = [os.urandom(32)]
            assert on_a.claim(keys, seconds=30) == ["yours"]
            answers: dict[str, list[bool]] = {}

            def waits(name: str, n: int) -> None:
                answers[name] = run_as(ensure_users()[name], WAITS, str(b.path),
                                       base64.b64encode(keys[0]).decode(), str(n))
            alice = threading.Thread(target=waits, args=("alice", 8))
            alice.start()
            assert eventually(lambda: "alice" not in answers and
                              _status(b)["kv_forward"]["waiting"] == 4, 15)
            bob = threading.Thread(target=waits, args=("bob", 1))
            bob.start()
            assert eventually(lambda: _status(b)["kv_forward"]["waiting"] == 5, 15)
            on_a.batch_put(keys, [b"w" * 100])
            alice.join(30)
            bob.join(30)
            assert answers["bob"] == [True]
            assert sorted(answers["alice"]) == [False] * 4 + [True] * 4
            # Claims made on b end when their connection closes there.
            keys = [os.urandom(32)]
            leaving = KVStore(str(b.path), namespace="t")
            assert leaving.claim(keys) == ["yours"]
            assert on_a.claim(keys) == ["busy"]
            leaving.close()
            assert eventually(lambda: on_a.claim(keys) == ["yours"], 10)
            # A connection scoped for a local reader reads; a put on it ends it.
            client, _, conns = _grant(b, "f.bin")
            with pytest.raises((OSError, WireError)):
                conns[0].kv_put((0, 0, []), "t", 0, False, b"z" * 32, b"v" * 100)
            assert _refused(conns[0], 1) in (-1, errno.EPIPE, errno.ECONNRESET)  # (shut)
            assert on_a.get(b"z" * 32) is None
            client.close()
            on_b.close()
            # A node that dies holding claims never gives them up: they run out, and the
            # writer forgets the connection that held them.
            keys = [os.urandom(32)]
            dying = KVStore(str(b.path), namespace="t")
            assert dying.claim(keys, seconds=2) == ["yours"]
            with ControlClient(str(a.path)) as c:
                assert c.call("kv_stats")["node_claimants"] == 1
                os.kill(b.daemon_pid(), signal.SIGKILL)
                assert on_a.claim(keys, seconds=0) == ["busy"]
                assert eventually(lambda: c.call("kv_stats")["node_claimants"] == 0, 10)
                assert on_a.claim(keys) == ["yours"]
            on_a.close()
            dying.close()


def test_kv_requests_on_a_reading_node_are_the_writers(tmp_path: Path,
                                                        pg_cluster: Any) -> None:
    """Deletes, capacities, evictions, namespaces, lists and stats asked on a reading
    node are asked of the writer as that caller's requests there: they change (and
    show) the pool's one index, under the writer's rules for that user."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        on_a = KVStore(str(a.path), namespace="t", mode=0o755)
        keys = [b"%02d" % i * 16 for i in range(6)]
        assert on_a.batch_put(keys, [os.urandom(100_000) for _ in keys]) == [True] * 6
        on_b = KVStore(str(b.path), namespace="t")
        assert on_b.delete(keys[0]) and not on_b.delete(keys[0])
        assert on_a.exists_many(keys[:2]) == [False, True]
        assert on_b.usage()["chunks"] == on_a.usage()["chunks"] == 5
        assert on_b.set_capacity(250_000) == 3 and on_a.usage()["capacity"] == 250_000
        listed = mxfs("kv", "ls", str(b.path), "t").stdout
        assert base64.b64encode(keys[5]).decode() in listed or keys[5].decode() in listed
        assert "t" in mxfs("kv", "stats", str(b.path)).stdout
        # As the user's requests on the writer: alice may not delete root's chunks or
        # remove its namespace; her own namespace is hers to make and remove.
        got = run_as(ensure_users()["alice"], """
import errno
kv = mxfs.kv.KVStore(sys.argv[1], namespace="t", shared=True)
out = []
for attempt in (lambda: kv.delete(sys.argv[2].encode()), kv.clear,
                lambda: kv.client.call("kv_ns_remove", namespace="t")):
    try:
        out.append(str(attempt()))
    except OSError as e:
        out.append(errno.errorcode[e.errno])
mine = mxfs.kv.KVStore(sys.argv[1], namespace="alices")
out.append(mine.clear())  # (nothing put yet: nothing to clear)
mine.client.call("kv_ns_create", namespace="alices", mode=0o700, capacity=0)
out.append(mine.put(b"k", b"v"))
mine.client.call("kv_ns_remove", namespace="alices")
print(json.dumps(out))
""", str(b.path), keys[5].decode())
        assert got == ["EACCES", "EACCES", "EPERM", 0, True], got
        assert "alices" not in {n["namespace"] for n in on_a.client.call("kv_stats")
                                ["namespaces"]}
        assert on_b.clear() == 2 and on_a.usage()["chunks"] == 0
        assert _status(b)["kv_forward"]["requests"] >= 6
        on_b.close()
        on_a.close()


# Puts from many connections of one user, each counted in a progress file once answered,
# until a stop file shows (or a minute passed); how many were answered.
FLOOD = """
import threading, time
where, progress, stop, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fd = os.open(progress, os.O_WRONLY | os.O_APPEND)
done = [0] * n
def one(i):
    kv, end = mxfs.kv.KVStore(where, namespace="alices"), time.monotonic() + 60
    while not os.path.exists(stop) and time.monotonic() < end:
        try:
            kv.put(os.urandom(32), b"v" * 200_000)
        except OSError:
            pass
        os.write(fd, b".")
        done[i] += 1
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(sum(done)))
"""

# One put after another, each beside the flood: how many of its puts were answered
# during each (the progress file's growth).
BESIDE = """
where, progress = sys.argv[1], sys.argv[2]
kv = mxfs.kv.KVStore(where, namespace=sys.argv[3])
kv.put(b"first" * 8, b"v")  # (the namespace made)
during = []
for i in range(5):
    before = os.path.getsize(progress)
    kv.put(b"%02d" % i * 16, b"v" * 100)
    during.append(os.path.getsize(progress) - before)
print(json.dumps(during))
"""


def test_a_users_flood_of_kv_requests_on_a_reading_node_leaves_others_their_turn(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A reading node sends KV requests on to the writer from a few threads; one
    user's 48 puts at once get three of them at most, and the rest wait in that user's
    turn: another user's put (bob's; root's) is sent on while the flood goes on, not
    after every put queued before it (it waited for dozens, first come first served).
    The node's link to the writer is limited (tc tbf), so the link paces the flood,
    not the CPU: her puts end a few dozen a second, queued all along, and a put's
    count of hers ended during it is its place in the queue, not how long this
    machine kept the test off the CPU."""
    url = pg_cluster.database()
    users = ensure_users()
    work = Path(tempfile.mkdtemp(prefix="mxfs-flood-"))  # (tmp_path: root's alone)
    work.chmod(0o777)
    progress, stop = work / "progress", work / "stop"
    progress.touch()
    progress.chmod(0o666)
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members, "max_active_per_user=64") as b:
        net.slow("40mbit", sends=True)  # ~5 MB/s: one of her puts ~40 ms on the link
        flooded: list[int] = []
        flood = threading.Thread(target=lambda: flooded.append(run_as(
            users["alice"], FLOOD, str(b.path), str(progress), str(stop), "48")))
        flood.start()
        try:
            seen: dict[str, int] = {}  # (one snapshot: between two, the flood's one
            # process may be off the CPU while the daemon drains its queue)
            assert eventually(lambda: seen.update(_status(b)["kv_forward"]) or
                              seen["queued"] >= 30, 30)
            sending = seen["sending"]
            bobs = run_as(users["bob"], BESIDE, str(b.path), str(progress), "bobs")
            on_b, roots = KVStore(str(b.path), namespace="roots"), []
            on_b.put(b"first" * 8, b"v")
            for i in range(5):
                before = progress.stat().st_size
                on_b.put(b"%02d" % i * 16, b"v" * 100)
                roots.append(progress.stat().st_size - before)
            on_b.close()
            still = _status(b)["kv_forward"]["queued"]
        finally:
            stop.touch()
            flood.join(90)
            net.slow(None, sends=True)
            shutil.rmtree(work)
        assert flooded and flooded[0] > 60
        assert still >= 30  # (the flood went on throughout)
        assert sending == 3  # (alice's three; the fourth kept for other users)
        # Each of bob's and root's puts waited for one of alice's at most, while her
        # three in service ran (0-2 of hers end during one); never behind the 30 and
        # more queued (first come first served, 46 of hers ended during each).
        assert max(bobs) < 24 and max(roots) < 24, (bobs, roots)


COPIES = """
import base64
from mxfs.client.control import ControlError
from mxfs.kv.kvstore import KVStore
from mxfs.proto.messages import KV_GET
kv = KVStore(sys.argv[1], namespace="copies")
kv.batch_put([b"k%05d" % i for i in range(1100)], [b"x"] * 1100)
one = base64.b64encode(b"k00000").decode()
refused = 0
for _ in range(20):  # one key asked 4,096 times a get, copies never read: one copy each
    try:
        kv.client.request_with_fds(KV_GET({**kv._ns, "keys": [one] * 4096,
                                           "inline_max": 0}))
    except ControlError:
        refused += 1  # (more descriptors than a reply carries)
got = 0
for start in range(0, 1100, 50):  # 1,100 copies lent at once: past what one uid holds
    reply, fds = kv.client.request_with_fds(KV_GET({**kv._ns, "inline_max": 0, "keys": [
        base64.b64encode(b"k%05d" % i).decode() for i in range(start, start + 50)]}))
    got += sum(c is not None for c in reply["chunks"])
    for fd in fds:  # (the daemon holds its own descriptor of each copy lent)
        os.close(fd)
print(json.dumps([refused, got]))
"""


def test_a_users_kv_copies_on_a_reading_node_are_bounded(tmp_path: Path,
                                                         pg_cluster: Any) -> None:
    """A reading node copies small chunks from the writer into memfds it lends a user:
    one key asked thousands of times in a get is copied once (each copy held a
    descriptor of the daemon's for 30 s, counted as its one byte), and one user holds
    LENT_PER_USER copies at most (past it, misses)."""
    url = pg_cluster.database()
    users = ensure_users()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        before = len(os.listdir(f"/proc/{b.daemon_pid()}/fd"))
        refused, got = run_as(users["alice"], COPIES, str(b.path))
        assert refused == 20
        assert got == kv_follow.LENT_PER_USER - 20  # (the first 20 gets' copies lent too)
        assert len(os.listdir(f"/proc/{b.daemon_pid()}/fd")) - before < \
            kv_follow.LENT_PER_USER + 200
        # bob's copies are his own count: served while alice holds hers.
        res = run_as(users["bob"], """
from mxfs.kv.kvstore import KVStore
kv = KVStore(sys.argv[1], namespace="bobs")
kv.put(b"b", b"bob")
print(json.dumps(bytes(kv.get(b"b")).decode()))
""", str(b.path))
        assert res == "bob"


def test_a_users_subordinate_uids_share_her_kv_bounds_on_a_reading_node(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A reading node's memory a user holds (memfds her puts are written into, copies
    her gets are lent) and the waits she holds there are bounded by user: her
    subordinate uids (rootless containers) share her bounds, or each of 65,536 of them
    had a user's own."""
    url = pg_cluster.database()
    alice = ensure_users()["alice"]
    subs = subordinate_uids(alice)

    def connect(uid: int) -> KVStore:
        os.seteuid(uid)  # (SO_PEERCRED: as of connect)
        try:
            return KVStore(str(b.path), namespace="t", shared=True)
        finally:
            os.seteuid(0)

    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members, "max_kv_lent_per_user=4194304") as b:
        on_a = KVStore(str(a.path), namespace="t", mode=0o755)
        large = os.urandom(3 << 20)
        on_a.put(b"l" * 32, large)
        stores = [connect(uid) for uid in subs[:8]]
        # 3 MiB being written by one of her uids: another's 3 MiB is past her 4 MiB.
        key = base64.b64encode(b"p" * 32).decode()
        _, fds = stores[0].client.call_with_fds("kv_create", namespace="t", key=key,
                                                size=3 << 20)
        with pytest.raises(OSError) as e:
            stores[1].client.call_with_fds("kv_create", namespace="t", key=key, size=3 << 20)
        assert e.value.errno == errno.ENOSPC
        for fd in fds:
            os.close(fd)
        stores[0].close()
        assert eventually(lambda: _status(b)["kv_forward"]["writing"] == 0, 5)
        # A copy of 3 MiB lent to one of her uids: another's copy is past her 4 MiB.
        got = []
        for kv in stores[1:3]:
            reply, fds = kv.client.call_with_fds("kv_get", namespace="t", shared=True,
                                                 keys=[base64.b64encode(b"l" * 32).decode()])
            got.append(reply["chunks"][0] is not None)
            for fd in fds:
                os.close(fd)
        assert got == [True, False]
        # Of six waits of her uids, WAITERS_PER_USER (4) wait; the others are answered
        # at once (not stored yet), the four once the key is put.
        keys = [os.urandom(32)]
        assert on_a.claim(keys, seconds=30) == ["yours"]
        answers: list[bool] = []
        waits = [threading.Thread(target=lambda kv=kv: answers.extend(kv.wait(keys, 20)))
                 for kv in stores[2:8]]
        for t in waits:
            t.start()
        assert eventually(lambda: len(answers) == 2, 15)
        assert _status(b)["kv_forward"]["waiting"] == 4 and answers == [False, False]
        on_a.batch_put(keys, [b"w" * 100])
        for t in waits:
            t.join(30)
        assert answers == [False] * 2 + [True] * 4
        for kv in [*stores[1:], on_a]:
            kv.close()


def test_kv_pins_on_a_reading_node_are_leases_on_the_writer(tmp_path: Path,
                                                             pg_cluster: Any) -> None:
    """A key a store on a reading node pinned (LMCache's "lookup and lock") stays on
    the writer until it is unpinned: the writer's eviction skips it, as it skips its
    own users' pins; the pins end with the connection that took them, and with the
    node, once its lease runs out (a dead node never says it let them go)."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        on_a = KVStore(str(a.path), namespace="t", mode=0o755)
        keys = [b"%02d" % i * 16 for i in range(4)]
        assert on_a.batch_put(keys, [os.urandom(1 << 20) for _ in keys]) == [True] * 4
        on_b = KVStore(str(b.path), namespace="t")
        assert on_b.pin(keys[:2] + [b"n" * 32]) == [True, True, False]
        assert on_a.usage()["pinned"] == 2
        assert on_a.set_capacity(1) == 2  # only the two unpinned go
        assert on_a.exists_many(keys) == [True, True, False, False]
        on_b.unpin(keys[:1])
        assert on_a.set_capacity(1) == 1 and on_a.exists_many(keys[:2]) == [False, True]
        on_b.close()  # its connection's pins end with it
        assert eventually(lambda: on_a.usage()["pinned"] == 0, 10)
        assert on_a.set_capacity(0) == 0  # (the pool's room only)
        assert on_a.batch_put(keys, [os.urandom(1 << 20) for _ in keys]) == \
            [True, False, True, True]
        dying = KVStore(str(b.path), namespace="t")
        assert dying.pin(keys) == [True] * 4 and on_a.usage()["pinned"] == 4
        os.kill(b.daemon_pid(), signal.SIGKILL)
        time.sleep(1)
        assert on_a.usage()["pinned"] == 4  # (held while its lease may be renewed)
        assert eventually(lambda: on_a.usage()["pinned"] == 0, 15)
        assert on_a.set_capacity(1) == 4
        dying.close()
        on_a.close()


def test_an_idle_connection_holding_pins_on_a_reading_node_is_kept(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A connection holding nothing is closed once idle `idle_timeout`; one holding
    pins is kept.  On a reading node its pins are held on the writer, not in the
    connection's own count, and it was closed as holding nothing: its keys unpinned
    under a store that had locked them, and evicted."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members, "idle_timeout=1") as b:
        on_a = KVStore(str(a.path), namespace="t", mode=0o755)
        keys = [b"%02d" % i * 16 for i in range(3)]
        assert on_a.batch_put(keys, [os.urandom(1 << 16) for _ in keys]) == [True] * 3
        on_b = KVStore(str(b.path), namespace="t")
        assert on_b.pin(keys[:2]) == [True, True]
        time.sleep(3)  # (idle past its timeout)
        assert on_a.usage()["pinned"] == 2
        assert on_a.set_capacity(1) == 1 and on_a.exists_many(keys) == [True, True, False]
        made = on_b.client.connections
        on_b.unpin(keys[:2])  # (holding nothing now: closed once idle, as any other)
        time.sleep(3)
        on_b.client.stat()  # (a request of the daemon's own: a new connection)
        assert on_b.client.connections == made + 1
        on_b.close()
        assert eventually(lambda: on_a.usage()["pinned"] == 0, 10)
        on_a.close()


def test_kv_lookups_on_a_reading_node_read_a_table_the_feed_keeps(tmp_path: Path,
                                                                   pg_cluster: Any) -> None:
    """A store on a reading node answers exists from a presence table that node keeps
    by the writer's change feed, asking its daemon nothing: keys stored on the writer
    show once the feed row is read, the node's own puts at once, deleted and evicted
    keys go, and a removed namespace's table says so (all misses, then a new table
    once the namespace is made again)."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        on_a = KVStore(str(a.path), namespace="t", mode=0o777)
        first = [b"f%05d" % i for i in range(3000)]  # (filled in bites: more than one)
        assert on_a.batch_put(first, [b"v" * 100] * len(first)) == [True] * len(first)
        on_b = KVStore(str(b.path), namespace="t", shared=True)
        asked = requests_served(b.path, "kv_exists")
        assert on_b.exists_many(first + [b"none"]) == [True] * len(first) + [False]
        more = [b"m%03d" % i for i in range(50)]
        assert on_a.batch_put(more, [b"w" * 5000] * 50) == [True] * 50
        assert eventually(lambda: on_b.exists_many(more) == [True] * 50, 10)
        mine = [b"b%03d" % i for i in range(20)]
        assert on_b.batch_put(mine, [b"x" * 100] * 20) == [True] * 20
        assert on_b.exists_many(mine) == [True] * 20  # (its own: at once)
        # the oldest go first: all but some of `first` (more and mine stay)
        assert on_a.delete(first[0]) and on_a.set_capacity(50 * 5000 + 20 * 100 +
                                                           1500 * 100) > 1000
        left = on_a.exists_many(first)
        assert not left[0] and 0 < sum(left) < len(first) - 1000
        assert eventually(lambda: on_b.exists_many(first) == left, 10)
        assert requests_served(b.path, "kv_exists") == asked  # none of it asked b
        views = _status(b)["kv_views"]
        assert views["live"] and views["tables"] == 1 and views["keys"] == sum(
            on_a.exists_many(first + more + mine))
        assert "KV lookups: 1 namespaces' keys" in mxfs("status", str(b.path)).stdout
        on_a.client.call("kv_ns_remove", namespace="t")
        assert eventually(lambda: on_b.exists_many(more + mine) == [False] * 70, 10)
        assert on_a.put(b"again", b"v")  # made again: a new table, asked for anew
        assert eventually(lambda: on_b.exists_many([b"again", more[0]]) == [True, False],
                          10)
        on_b.close()
        on_a.close()


@pytest.mark.daemon_log(r"node \S+ (cannot be reached|could not)",
                        r"serves its members again",
                        r"chunk handshake .* failed")  # (one begun as the link went)
def test_a_node_cut_off_from_the_owner_reads_eio_never_old_bytes(tmp_path: Path,
                                                                 pg_cluster: Any) -> None:
    """The reading node's link to the writer goes down (both ways), then only the
    writer's packets to it are dropped (a one-way partition): files it has not cached
    read EIO, again and again, never bytes the writer has since replaced; KV puts fail;
    its daemon answers meanwhile; healed, every file reads its current bytes.  (b takes
    the writer as cut off after 2 s unanswered, not 5 s to connect and 8 s unacknowledged:
    the same EIO, seconds sooner.)"""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members, "connect_s=2", "unacked_s=2") as b:
        old, new = os.urandom(1 << 20), os.urandom(1 << 20)
        cold = {name: os.urandom(1 << 20) for name in ("cold1.bin", "cold2.bin")}
        (a.path / "kept.bin").write_bytes(old)
        for name, data in cold.items():
            (a.path / name).write_bytes(data)
        assert (b.path / "kept.bin").read_bytes() == old  # (its pages cached on b)
        on_b = KVStore(str(b.path), namespace="t", mode=0o755)
        assert on_b.put(b"k" * 32, b"v" * 100)
        one_way = ["ip", "route", "add", "blackhole", f"{net.node_ip}/32"]
        for cut, heal, name in ((net.cut, lambda: net.cut(down=False), "cold1.bin"),
                                (lambda: subprocess.run(one_way, check=True),
                                 lambda: subprocess.run(["ip", "route", "del", *one_way[3:]],
                                                        check=True), "cold2.bin")):
            cut()
            try:
                for _ in range(2):
                    assert _reads(b.path / name) is None
                with ControlClient(str(b.path)) as c:
                    assert c.call("hello")["pool_uuid"]
                with pytest.raises(OSError) as e:
                    on_b.put(os.urandom(32), b"v" * 100)
                assert e.value.errno == errno.EIO
                (a.path / "kept.bin").write_bytes(new)  # (the feed tells b: not the network)
                assert eventually(lambda o=old: _reads(b.path / "kept.bin") != o, 15)
                assert _reads(b.path / "kept.bin") is None
            finally:
                heal()
            assert eventually(lambda n=name: _reads(b.path / n) == cold[n], 30)
            assert _reads(b.path / "kept.bin") == new
            old, new = new, os.urandom(1 << 20)
        assert on_b.put(b"j" * 32, b"v" * 100) and on_b.get(b"k" * 32) == b"v" * 100
        on_b.close()
        assert "cannot be reached" in _log(b)


def test_a_slow_reading_node_stalls_nobody_else(tmp_path: Path, pg_cluster: Any) -> None:
    """The reading node's link limited to 4 Mbit/s (tc tbf): its reads are slow and
    whole, and while one is in flight the writer node's own users are answered (the
    chunk service sends from worker threads, never from the daemon's one thread)."""
    url = pg_cluster.database()
    with _writer_node(tmp_path, url) as (net, a, members):
        data = os.urandom(2 << 20)
        (a.path / "big.bin").write_bytes(data)
        chunk = os.urandom(1 << 20)
        KVStore(str(a.path), namespace="t", mode=0o755).put(b"s" * 32, chunk)
        with _reading_node(tmp_path, url, net, members) as b:
            net.slow("4mbit")  # ~0.5 MB/s: the file takes seconds
            try:
                got: list[bytes] = []
                reading = threading.Thread(
                    target=lambda: got.append((b.path / "big.bin").read_bytes()))
                reading.start()
                try:
                    # Meanwhile, on the writer: a write, a read, a control request.
                    (a.path / "other.bin").write_bytes(b"x" * 100_000)
                    assert (a.path / "other.bin").read_bytes() == b"x" * 100_000
                    with ControlClient(str(a.path)) as c:
                        assert c.call("hello")["pool_uuid"]
                    assert reading.is_alive()  # (the slow read was still in flight)
                finally:
                    reading.join(120)
                assert got == [data]
                kv = KVStore(str(b.path), namespace="t", shared=True)
                assert kv.get(b"s" * 32) == chunk  # a KV copy over the slow link, whole
                kv.close()
            finally:
                net.slow(None)


def _grant(b: Mounted, name: str) -> tuple[ControlClient, dict[str, Any], list[ChunkClient]]:
    """A connection of its own to b's daemon, and the scoped connections to the owner
    its `open_read` of `name` hands over (taken up without the key)."""
    client = ControlClient(str(b.path))
    reply, fds = client.request_with_fds(OPEN_READ({"path": "/" + name, "remote": True}))
    grant = reply["remote"]
    return client, dict(reply), [ChunkClient.adopt(fd, grant["addr"], grant["epoch"])
                                 for fd in fds]


def _refused(conn: ChunkClient, ino: int, member: int = 0) -> int:
    """The errno the owner answers a READ with (0: it sent the bytes; -1: the
    connection is shut)."""
    try:
        conn.read(ino, member, 0, 4096)
        return 0
    except OSError as e:
        return e.errno or -1
    except WireError:
        return -1


def _served(a: Mounted) -> int:
    return int(_status(a)["chunk_service"]["served_bytes"])


@pytest.mark.daemon_log(r"chunk (request|scope) for the daemon failed")
def test_a_reading_node_reads_straight_from_the_owner(tmp_path: Path, pg_cluster: Any
                                                      ) -> None:
    """The direct path on a reading node: its daemon hands a reader connections to the
    owner's chunk service scoped to one file; the reader moves the bytes, can reach
    nothing else, and loses them when its right ends."""
    url = pg_cluster.database()
    users = ensure_users()
    with _writer_node(tmp_path, url) as (net, a, members):
        tensors = {"w": torch.randn(300, 1000), "b": torch.arange(10)}
        save_file(tensors, str(a.path / "m.safetensors"))
        (a.path / "m.safetensors").chmod(0o644)
        (a.path / "secret.bin").write_bytes(os.urandom(1 << 20))
        (a.path / "secret.bin").chmod(0o600)
        big = os.urandom(64 << 20)  # 16 MiB a member: more than a socket holds
        (a.path / "big.bin").write_bytes(big)
        warm = os.urandom(4 << 20)
        (a.path / "warm.bin").write_bytes(warm)
        secret_ino = (a.path / "secret.bin").stat().st_ino
        with _reading_node(tmp_path, url, net, members, "max_remote_reads_per_user=8") as b:
            # The loader reads the owner's chunk service itself, not b's mount.
            with open_reader(str(b.path / "m.safetensors")) as f:
                assert isinstance(f, RemoteFile)
            before = _served(a)
            got = load_file(str(b.path / "m.safetensors"))
            assert set(got) == set(tensors)
            assert all(torch.equal(got[k], tensors[k]) for k in tensors)
            assert _served(a) - before >= (a.path / "m.safetensors").stat().st_size - 4096
            assert _status(b)["remote_reads"]["grants"] == 0  # closed with the reader
            # What b's page cache holds through its mount is read from there (no test
            # beside this one drops the page cache meanwhile, nor reclaim evicts it).
            with steady_page_cache(b.path / "warm.bin"):
                assert (b.path / "warm.bin").read_bytes() == warm
                before = _served(a)
                with open_reader(str(b.path / "warm.bin")) as f:
                    assert isinstance(f, RemoteFile)
                    buf = bytearray(len(warm))
                    f.read_into(0, memoryview(buf))
                assert bytes(buf) == warm and _served(a) == before

            # Another user: what they may read, as the mount would judge it.
            got_alice = run_as(users["alice"], """
from mxfs.client.direct import open_reader, RemoteFile
out = []
with open_reader(sys.argv[1] + "/m.safetensors") as f:
    out.append(isinstance(f, RemoteFile))
out.append(attempt(open_reader, sys.argv[1] + "/secret.bin"))
print(json.dumps(out))
""", str(b.path))
            assert got_alice == [True, errno.EACCES]

            # A scoped connection reads its file and nothing else, and cannot be widened:
            # a second scope closes it (it was answered, EPERM, as often as one liked).
            client, reply, conns = _grant(b, "m.safetensors")
            assert len(conns) == len(members)
            assert _refused(conns[0], reply["ino"]) == 0
            assert _refused(conns[0], secret_ino) == errno.EPERM
            with pytest.raises((OSError, WireError)):
                conns[1].scope([(secret_ino, 1)])
            assert _refused(conns[1], reply["ino"]) != 0  # (closed: not even its own file)
            # Its right ends with the control connection that was handed it (the
            # daemon shuts the sockets down, the reader's copies with them).
            client.close()
            assert eventually(lambda: _refused(conns[2], reply["ino"]) != 0, 10)
            # ... with close_read, and when the file goes on the owner.
            client, reply, conns = _grant(b, "warm.bin")
            client.request(CLOSE_READ({"grant": reply["remote"]["grant"]}))
            assert _refused(conns[0], reply["ino"]) != 0
            client.close()
            client, reply, conns = _grant(b, "warm.bin")
            (a.path / "warm.bin").unlink()
            assert _refused(conns[0], reply["ino"]) == errno.ESTALE
            client.close()

            # A KV get sends connections scoped to the chunks it found: another chunk
            # is refused on them, and a chunk removed on the writer reads ESTALE.
            on_a = KVStore(str(a.path), namespace="t", mode=0o755)
            chunks = {k: os.urandom(1 << 20) for k in (b"k" * 32, b"j" * 32)}
            for k, v in chunks.items():
                on_a.put(k, v)
            assert KVStore(str(b.path), namespace="t").batch_get(list(chunks)) == \
                list(chunks.values())
            client = ControlClient(str(b.path))
            inos = []
            for k in chunks:
                reply, fds = client.request_with_fds(KV_GET(
                    {"namespace": "t", "keys": [base64.b64encode(k).decode()],
                     "remote": True}))
                entry = reply["chunks"][0]
                assert entry is not None and "ino" in entry
                kv_conns = [ChunkClient.adopt(fd, reply["remote"]["addr"],
                                              reply["remote"]["epoch"]) for fd in fds]
                inos.append((entry["ino"], Layout.from_description(entry["layout"])
                             .plan(0, entry["size"])[0].member))
            (k_ino, k_member), (j_ino, j_member) = inos
            assert _refused(kv_conns[0], j_ino, j_member) == 0
            assert _refused(kv_conns[0], k_ino, k_member) == errno.EPERM
            on_a.delete(b"j" * 32)
            assert _refused(kv_conns[0], j_ino, j_member) == errno.ESTALE
            client.close()

            # One uid holds max_remote_reads_per_user connections (8: two files of
            # four members); past them its reads go through the mount.
            held = [_grant(b, "big.bin"), _grant(b, "big.bin")]
            with open_reader(str(b.path / "m.safetensors")) as f:
                assert isinstance(f, PlainFile)
            assert _status(b)["remote_reads"]["refused"] >= 1
            shown = mxfs("status", str(b.path)).stdout
            assert "direct reads of other nodes: 2 files open, 8 connections" in shown, shown
            # Readers that stop reading hold no sender of the owner's: all eight ask
            # for 16 MiB and take none, and the owner still serves b's mount.
            ino = held[0][1]["ino"]
            for i, conn in enumerate(held[0][2] + held[1][2]):
                conn.sock.sendall(READ.pack(b"READ", ino, i % len(members), 0, 16 << 20))
            time.sleep(1)  # (their sends fill the sockets and stall)
            assert (b.path / "secret.bin").stat().st_size == 1 << 20
            assert _digest(b.path / "big.bin") == xxhash.xxh3_128_hexdigest(big)
            # ... and the stalled ones were kept, not dropped: each gets all it asked.
            stalled = held[1][2][0]
            code, _, n = ANSWER.unpack(stalled._recv(ANSWER.size))
            assert (code, n) == (0, 16 << 20)
            assert len(stalled._recv(n)) == n
            for client, _, _ in held:
                client.close()

            # Garbage on a scoped connection, or a scope past MAX_SCOPE, ends that
            # connection and no other.
            client, reply, conns = _grant(b, "m.safetensors")
            conns[0].sock.sendall(os.urandom(4096))
            conns[1].sock.sendall(b"SCOP" + SCOPE_COUNT.pack(0, MAX_SCOPE + 1))
            for conn in conns[:2]:
                assert eventually(lambda c=conn: _refused(c, reply["ino"]) != 0, 10)
            assert _refused(conns[2], reply["ino"]) == 0
            client.close()

            # Readers that flood the owner with tiny requests are served a few at a
            # time (SCOPED_AT_ONCE); the rest wait their turn, off trio's thread.
            held = [_grant(b, "m.safetensors"), _grant(b, "m.safetensors")]
            stop = threading.Event()

            def flood(conn: ChunkClient, ino: int) -> None:
                while not stop.is_set():
                    conn.sock.sendall(READ.pack(b"READ", ino, 0, 0, 1) * 64)
                    for _ in range(64):
                        conn._recv(ANSWER.size + 1)

            floods = [threading.Thread(target=flood, args=(conn, reply["ino"]), daemon=True)
                      for _, reply, conns in held for conn in conns]
            for t in floods:
                t.start()
            try:
                assert eventually(lambda: _status(a)["chunk_service"]["scoped_waiting"] > 0,
                                  10)
                assert (a.path / "m.safetensors").read_bytes()  # (the owner's own mount)
            finally:
                stop.set()
                for t in floods:
                    t.join()
                for client, _, _ in held:
                    client.close()



# Scoped connections to the owner, `grants` opens' worth, each asking for one byte at
# a time (64 ahead), counted in a progress file once answered, until a stop file shows.
READERS = """
import threading
from mxfs.client.control import ControlClient
from mxfs.io.chunk_client import ChunkClient
from mxfs.proto import chunk_wire as w
where, progress, stop, grants = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fd = os.open(progress, os.O_WRONLY | os.O_APPEND)
conns, ino = [], 0
c = ControlClient(where)
for _ in range(grants):
    reply, fds = c.call_with_fds("open_read", path="/f.bin", remote=True)
    g, ino = reply["remote"], reply["ino"]
    conns += [ChunkClient.adopt(f, g["addr"], g["epoch"]) for f in fds]
conns = conns if grants > 1 else conns[:1]  # (one reader: one connection)
def read(conn, ahead):
    while not os.path.exists(stop):
        conn.sock.sendall(w.READ.pack(b"READ", ino, 0, 0, 1) * ahead)
        for _ in range(ahead):
            conn._recv(w.ANSWER.size + 1)
        os.write(fd, b"." * ahead)
threads = [threading.Thread(target=read, args=(x, 64 if grants > 1 else 1)) for x in conns]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(len(conns)))
"""


def test_readers_of_two_users_take_turns_at_the_owner(tmp_path: Path, pg_cluster: Any
                                                      ) -> None:
    """The owner serves scoped connections' requests a few at a time, by the readers'
    uids in turn (each SCOPE names it): alice's sixteen connections flooding it leave
    bob's one reader about half of the turns, not a seventeenth of them."""
    url = pg_cluster.database()
    users = ensure_users()
    work = Path(tempfile.mkdtemp(prefix="mxfs-turns-"))
    work.chmod(0o777)
    stop = work / "stop"
    for name in ("alice", "bob"):
        (work / name).touch()
        (work / name).chmod(0o666)
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        (a.path / "f.bin").write_bytes(os.urandom(1 << 20))
        (a.path / "f.bin").chmod(0o644)
        got: dict[str, int] = {}
        readers = [threading.Thread(target=lambda n=name, k=k: got.update({n: run_as(
            users[n], READERS, str(b.path), str(work / n), str(stop), str(k))}))
            for name, k in (("alice", 4), ("bob", 1))]
        for t in readers:
            t.start()
        try:
            def size(name: str) -> int:
                return (work / name).stat().st_size
            assert eventually(lambda: size("alice") > 2000 and size("bob") > 100, 30)
            alice0, bob0 = size("alice"), size("bob")
            assert eventually(lambda: size("alice") - alice0 > 20_000, 60)
            alice1, bob1 = size("alice"), size("bob")
        finally:
            stop.touch()
            for t in readers:
                t.join(60)
            shutil.rmtree(work)
        assert got == {"alice": 16, "bob": 1}  # (a connection a member: four an open)
        assert (bob1 - bob0) * 6 >= alice1 - alice0, (bob1 - bob0, alice1 - alice0)


# `n` opens of f.bin at once on the reading node's direct path, a control connection
# each (each waits on the owner), until all are answered: how many were granted.
OPENS = """
import threading
from mxfs.client.control import ControlClient
where, n = sys.argv[1], int(sys.argv[2])
clients, got = [ControlClient(where) for _ in range(n)], []
def one(c):
    got.append(attempt(c.call_with_fds, "open_read", path="/f.bin", remote=True))
threads = [threading.Thread(target=one, args=(c,)) for c in clients]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(got.count("ok")))
"""


# `mxfs df` on the reading node: whether it was answered (or why not).
DF = """
from mxfs.client.control import ControlClient
try:
    print(json.dumps("by_use" in ControlClient(sys.argv[1]).call("df")))
except OSError as e:  # (its client's wait for the answer ran out)
    print(json.dumps(str(e)))
"""


# (stopped inside a group of changes, the writer's session is ended by the server after
# its idle_in_transaction_session_timeout, 10 s: it says so when it goes on)
@pytest.mark.daemon_log(r"node \S+ (cannot be reached|could not)",
                        r"has not seen node \S+ join", r"metadata server \S+ went away",
                        r"(commit|stats) for the daemon failed")
def test_opens_waiting_on_a_stopped_owner_hold_no_other_users_thread(
        tmp_path: Path, pg_cluster: Any) -> None:
    """With the owner stopped, three users' 48 direct opens on a reading node wait on
    it (each a scope or handshake left unanswered 30 s), and meanwhile another user's
    `mxfs df` there, which reads the store on one of trio's default threads, is
    answered: the opens wait on threads of their own, a few, by user in turn (they
    took all 40 default threads, and the daemon's every other call waited on the
    owner)."""
    url = pg_cluster.database()
    users = {**ensure_users(), "root": User("root", 0, 0, (0,))}
    members = make_members(tmp_path / "a")
    mkfs(members, "64KiB", "--meta", url)
    # (a lease that outlives the stop: to b the owner is up, slow, not dead, renewed each
    # second: b's mount waits for a renewal naming it, 20 s every 10; on b, each user's
    # 16 opens in service at once, as many as max_remote_reads_per_user lets in)
    with node_net() as net, mounted_pool(members, "chunk_port=0", "lease_s=60", "renew_s=1",
                                         "node=a", f"chunk_addr={net.host_ip}") as a, \
            _reading_node(tmp_path, url, net, members, "max_active_per_user=16") as b:
        (a.path / "f.bin").write_bytes(b"f" * 1000)  # (one member: a connection an open)
        (a.path / "f.bin").chmod(0o644)
        def direct() -> bool:  # (each leaves b a connection it keeps: the opens'
            with open_reader(str(b.path / "f.bin")) as f:  # scopes wait on them too)
                return isinstance(f, RemoteFile)
        assert eventually(direct, 15)  # (once b reads the file's commit)
        assert all(direct() for _ in range(8))
        pid = a.daemon_pid()
        got: dict[str, int] = {}
        openers = [threading.Thread(target=lambda n=name: got.update(
            {n: run_as(users[n], OPENS, str(b.path), "16")})) for name in users]
        answered: list[Any] = []
        df = threading.Thread(target=lambda: answered.append(run_as(None, DF, str(b.path))))
        os.kill(pid, signal.SIGSTOP)
        try:
            for t in openers:
                t.start()
            assert eventually(
                lambda: _status(b)["remote_reads"]["connections"] == 48, 30)
            df.start()
            df.join(15)
            assert answered == [True], "df waited on the stopped owner"
        finally:
            os.kill(pid, signal.SIGCONT)
            for t in [*openers, df]:
                if t.ident is not None:
                    t.join(120)
        assert set(got) == set(users)  # (answered once the owner went on)
        assert eventually(lambda: _status(b)["remote_reads"]["connections"] == 0, 10)


def _cold(path: Path) -> bytes | None:
    """The file's bytes read past the kernel's cache of them (None while EIO)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        assert e.errno == errno.EIO
        return None
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = bytearray()
        while chunk := os.read(fd, 1 << 20):
            out += chunk
        return bytes(out)
    except OSError as e:
        assert e.errno == errno.EIO, e
        return None
    finally:
        os.close(fd)


def _used(m: Mounted, path: Path) -> tuple[int, set[int], Layout]:
    with ControlClient(str(m.path)) as c:
        lay = c.layout(str(path))
    layout = Layout.from_description(lay["layout"])
    return lay["ino"], set(layout.used_members()), layout


def _chunk(member: str, ino: int) -> Path:
    return Path(member, "chunks", f"{ino % 256:02x}", str(ino))


@pytest.mark.daemon_log(r"node \S+ (is dead|cannot be reached|could not)",
                        r"serves its members again", r"is left there",
                        r"chunk files of removed files")
def test_a_pool_over_two_nodes_members_is_written_through_their_owner(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A pool made with two of its members on node b (`mxfs mkfs --member b:PATH`):
    b joins with those folders and serves them; the writer places a new file on its
    own members, and a directory set --across-nodes on every member, whose stripes on
    b it writes, syncs, cuts and removes through b's chunk service; each node reads
    every stripe (its own locally, the other's through it).  With b dead, what has
    stripes there reads EIO on the writer, and files on its own members read on; a file
    removed meanwhile leaves its chunk files on b, which b removes once back."""
    url = pg_cluster.database()
    mine, theirs = make_members(tmp_path / "a", 2), make_members(tmp_path / "b", 2)
    mkfs([*mine, *(f"b:{p}" for p in theirs)], "64KiB", "--meta", url)
    assert not any(Path(p, "chunks").exists() for p in theirs)  # (b's to make)
    with node_net() as net, \
            mounted_pool(mine, *WRITER, f"chunk_addr={net.host_ip}") as a:
        key, config = str(Path(mine[0], KEY_NAME)), str(tmp_path / "b" / "node.toml")
        join = ["node", "add", "--meta", url, "--key", key, "--name", "b", "--config", config]
        res = mxfs(*join, "--member", theirs[0], check=False)
        assert res.returncode != 0 and "gives node b 2 members (2, 3), and 1" in res.stderr
        mxfs(*join, "--member", theirs[0], "--member", theirs[1])
        assert [read_superblock(p).member_index for p in theirs] == [2, 3]
        with mount_with([config], "lease_s=3", "chunk_port=0", f"chunk_addr={net.node_ip}",
                        prefix=net.enter, check=False) as b:
            own = os.urandom(1 << 20)
            (a.path / "own.bin").write_bytes(own)
            assert _used(a, a.path / "own.bin")[1] <= {0, 1}  # (the writer's own)
            (a.path / "models").mkdir()
            mxfs("setstripe", "--across-nodes", str(a.path / "models"))
            model = os.urandom((3 << 20) + 5000)
            (a.path / "models" / "m.bin").write_bytes(model)
            ino, used, layout = _used(a, a.path / "models" / "m.bin")
            assert used == {0, 1, 2, 3}
            for m, folder in ((2, theirs[0]), (3, theirs[1])):
                assert _chunk(folder, ino).stat().st_size == layout.chunk_length(m, len(model))
            assert _cold(a.path / "models" / "m.bin") == model
            assert eventually(lambda: _cold(b.path / "models" / "m.bin") == model, 15)
            assert _cold(b.path / "own.bin") == own
            # b's service changes its files for the writer's epoch only, on its members.
            addr = {n["name"]: n for n in _status(a)["nodes"]}["b"]["addr"]
            host, _, port = addr.rpartition(":")
            with ChunkClient(host, int(port), load_key(mine[0]),
                             _status(a)["pool_uuid"]) as raw:
                epoch = _status(a)["lease"]["epoch"]
                for tag, ep, member, code in ((b"TRUN", epoch + 1, 2, errno.ESTALE),
                                              (b"REMV", epoch, 0, errno.EREMOTE),
                                              (b"REMV", epoch, 7, errno.EINVAL)):
                    with pytest.raises(OSError) as e:
                        raw.change(tag, ep, ino, member)
                    assert e.value.errno == code, (tag, member)
                assert raw.read(ino, 2, 0, 10) == _chunk(theirs[0], ino).read_bytes()[:10]
            assert _cold(a.path / "models" / "m.bin") == model
            # Changed in place, made durable, cut: through b for its stripes.
            with open(a.path / "models" / "m.bin", "r+b") as f:
                f.seek(100_000)
                f.write(b"x" * 300_000)
                f.flush()
                os.fsync(f.fileno())
            model = model[:100_000] + b"x" * 300_000 + model[400_000:]
            assert _cold(a.path / "models" / "m.bin") == model
            os.truncate(a.path / "models" / "m.bin", 200_000)
            for m, folder in ((2, theirs[0]), (3, theirs[1])):
                assert _chunk(folder, ino).stat().st_size == layout.chunk_length(m, 200_000)
            assert _cold(a.path / "models" / "m.bin") == model[:200_000]
            assert eventually(lambda: _cold(b.path / "models" / "m.bin") == model[:200_000],
                              15)
            # Removed: its chunk files on b go too (freed after the commit), cut first:
            # a descriptor no lease probe sees (O_PATH, made of one handed out) kept
            # an unlinked file's blocks for as long as it was held.
            kept = [os.open(_chunk(folder, ino), os.O_PATH) for folder in theirs]
            try:
                (a.path / "models" / "m.bin").unlink()
                assert eventually(lambda: not _chunk(theirs[0], ino).exists() and
                                  not _chunk(theirs[1], ino).exists(), 15)
                assert [os.fstat(fd).st_blocks for fd in kept] == [0, 0]
            finally:
                for fd in kept:
                    os.close(fd)
            later = os.urandom(2 << 20)
            (a.path / "models" / "later.bin").write_bytes(later)
            (a.path / "models" / "gone.bin").write_bytes(os.urandom(1 << 20))
            gone = _used(a, a.path / "models" / "gone.bin")[0]
            assert _chunk(theirs[0], gone).exists()
            assert _cold(b.path / "own.bin") == own
            # b dies: its stripes read EIO on the writer, never other bytes; files on
            # the writer's own members read on; b back (a new epoch), all read again.
            os.kill(b.daemon_pid(), signal.SIGKILL)
            assert eventually(lambda: _cold(a.path / "models" / "later.bin") is None, 20)
            assert _cold(a.path / "own.bin") == own
            with pytest.raises(OSError) as e:
                (a.path / "models" / "new.bin").write_bytes(os.urandom(1 << 20))
            assert e.value.errno == errno.EIO
            # A file removed meanwhile: its chunk files on b cannot be removed now ...
            (a.path / "models" / "gone.bin").unlink()
            assert eventually(lambda: not _chunk(mine[0], gone).exists(), 15)  # (then b's)
            assert _chunk(theirs[0], gone).exists()
            mxfs("umount", str(b.path), check=False)
            for folder in theirs:  # (as if b had been away two hours: strays once an hour old)
                old = time.time() - 7200
                os.utime(_chunk(folder, gone), (old, old))
        # ... b removes them itself once back (cut: a path held to one keeps nothing).
        stray = os.open(_chunk(theirs[0], gone), os.O_PATH)
        with mount_with([config], "lease_s=3", "chunk_port=0", f"chunk_addr={net.node_ip}",
                        prefix=net.enter, check=False) as b:
            assert eventually(lambda: not _chunk(theirs[0], gone).exists() and
                              not _chunk(theirs[1], gone).exists(), 15)
            assert os.fstat(stray).st_blocks == 0
            os.close(stray)
            assert eventually(lambda: _cold(a.path / "models" / "later.bin") == later, 20)
            assert _cold(b.path / "models" / "later.bin") == later
            assert _chunk(theirs[0], _used(a, a.path / "models" / "later.bin")[0]).exists()
            (a.path / "models" / "new.bin").unlink(missing_ok=True)


def test_a_hung_member_of_an_owner_holds_only_its_own_changes(tmp_path: Path,
                                                                pg_cluster: Any) -> None:
    """Node b holds two members, one on a filesystem that stops answering (a FUSE mount
    whose daemon is stopped: a hung drive).  The writer's changes of it hold places of
    their own on b, three of its four: a write of b's other member is done meanwhile
    (before, the first four held every change b serves, first come, and it waited
    until the hung member came back, past the writer's wait).  A write that waited
    past CHANGE_LATE_S for a place is refused, not done after the writer gave up on it
    (it would land after what the writer's caller did next, as a truncate and a
    rewrite)."""
    url = pg_cluster.database()
    inner_members = make_members(tmp_path / "inner", 1)
    mkfs(inner_members)
    mine, fast = make_members(tmp_path / "a", 2), make_members(tmp_path / "b", 1)[0]
    with mounted_pool(inner_members) as inner:
        hung = inner.path / "member3"
        hung.mkdir()
        mkfs([*mine, f"b:{fast}", f"b:{hung}"], "64KiB", "--meta", url)
        with node_net() as net, \
                mounted_pool(mine, *WRITER, f"chunk_addr={net.host_ip}") as a:
            config = str(tmp_path / "b" / "node.toml")
            mxfs("node", "add", "--meta", url, "--key", str(Path(mine[0], KEY_NAME)),
                 "--name", "b", "--config", config, "--member", fast, "--member", str(hung))
            with mount_with([config], "lease_s=3", "chunk_port=0",
                            f"chunk_addr={net.node_ip}", prefix=net.enter, check=False):
                (a.path / "w").mkdir()
                mxfs("setstripe", "--across-nodes", str(a.path / "w"))
                (a.path / "w" / "z.bin").write_bytes(bytes(1 << 20))
                ino, used, _ = _used(a, a.path / "w" / "z.bin")
                assert used == {0, 1, 2, 3}
                status = _status(a)
                addr = {n["name"]: n for n in status["nodes"]}["b"]["addr"]
                host, _, port = addr.rpartition(":")

                def write(member: int, timeout: float = 60.0) -> int:
                    """A raw WRIT of zeros (as the file holds) on b's `member`: 0 or the
                    errno it failed with."""
                    with ChunkClient(host, int(port), load_key(mine[0]), status["pool_uuid"],
                                     timeout=timeout) as raw:
                        try:
                            raw.change(b"WRIT", status["lease"]["epoch"], ino, member, 0,
                                       [memoryview(bytes(4096))])
                            return 0
                        except OSError as e:
                            return e.errno or errno.EIO

                inner_pid = inner.daemon_pid()  # (asked of it: not while it is stopped)
                with ThreadPoolExecutor(4) as threads:
                    os.kill(inner_pid, signal.SIGSTOP)
                    try:
                        on_hung = [threads.submit(write, 3) for _ in range(4)]
                        time.sleep(1)  # (all four asked)
                        assert write(2, timeout=10) == 0  # (b's other member, meanwhile)
                        assert not any(f.done() for f in on_hung)
                        # The fourth, with no place within CHANGE_LATE_S, is refused while
                        # the member still hangs; the three it has go on waiting.
                        assert eventually(lambda: sum(f.done() for f in on_hung) == 1,
                                          CHANGE_LATE_S + 30)
                    finally:
                        os.kill(inner_pid, signal.SIGCONT)
                    assert sorted(f.result() for f in on_hung) == [0, 0, 0, errno.ETIMEDOUT]
                assert (a.path / "w" / "z.bin").read_bytes() == bytes(1 << 20)


def test_a_slow_member_of_an_owner_holds_only_its_own_senders(tmp_path: Path,
                                                              pg_cluster: Any) -> None:
    """Node b holds two members, one a slow drive (its reads held to 250 KB/s).  Reads
    of chunk files there, each from the disk, hold six of b's eight sender threads at
    most: a read of b's other member is served while none of them has ended (before,
    the first eight held every sender thread, first come, and it waited for one to
    end)."""
    url = pg_cluster.database()
    mine, fast = make_members(tmp_path / "a", 2), make_members(tmp_path / "b", 1)[0]
    with slow_member(tmp_path, 250_000) as (slow, throttle, pace):
        mkfs([*mine, f"b:{fast}", f"b:{slow}"], "64KiB", "--meta", url)
        with node_net() as net, \
                mounted_pool(mine, *WRITER, f"chunk_addr={net.host_ip}") as a:
            config = str(tmp_path / "b" / "node.toml")
            mxfs("node", "add", "--meta", url, "--key", str(Path(mine[0], KEY_NAME)),
                 "--name", "b", "--config", config, "--member", fast, "--member", slow)
            with mount_with([config], "lease_s=3", "chunk_port=0",
                            f"chunk_addr={net.node_ip}", prefix=net.enter,
                            check=False) as b:
                (a.path / "w").mkdir()
                mxfs("setstripe", "--across-nodes", str(a.path / "w"))
                (a.path / "w" / "big.bin").write_bytes(os.urandom(48 << 20))
                ino, used, _ = _used(a, a.path / "w" / "big.bin")
                assert used == {0, 1, 2, 3}
                chunks = {2: _chunk(fast, ino), 3: _chunk(slow, ino)}
                for chunk in chunks.values():  # (their pages from the disk, when read)
                    fd = os.open(chunk, os.O_RDONLY)
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                status = _status(a)
                addr = {n["name"]: n for n in status["nodes"]}["b"]["addr"]
                host, _, port = addr.rpartition(":")
                key = load_key(mine[0])
                clients = [ChunkClient(host, int(port), key, status["pool_uuid"],
                                       timeout=300) for _ in range(11)]
                part = 1 << 20
                try:
                    throttle(b.daemon_pid())
                    with ThreadPoolExecutor(10) as threads:
                        slow_reads = [threads.submit(c.read, ino, 3, i * part, part)
                                      for i, c in enumerate(clients[:10])]
                        time.sleep(2)  # (all asked, and reading from the slow drive)
                        got = clients[10].read(ino, 2, 0, part)
                        ended = [f.done() for f in slow_reads]
                        pace(1 << 40)  # (the rest at the disk's pace)
                        slow_got = [f.result() for f in slow_reads]
                finally:
                    for c in clients:
                        c.close()
                assert not any(ended), "a read of the fast member waited for the slow one's"
                assert got == chunks[2].read_bytes()[:part]
                assert b"".join(slow_got) == chunks[3].read_bytes()[:10 * part]


@contextlib.contextmanager
def _two_owners(tmp_path: Path, url: str, *node_options: str, writer: tuple[str, ...] = ()
                ) -> Iterator[tuple[NodeNet, Mounted, Mounted, list[str], list[str]]]:
    """Writer a holding members 0 and 1 (mounted with `writer` too), node b (a namespace
    of its own; mounted with `node_options` too) holding 2 and 3, both mounted: (b's
    network, a, b, a's members, b's members)."""
    mine, theirs = make_members(tmp_path / "a", 2), make_members(tmp_path / "b", 2)
    mkfs([*mine, *(f"b:{p}" for p in theirs)], "64KiB", "--meta", url)
    with node_net() as net, \
            mounted_pool(mine, *WRITER, *writer, f"chunk_addr={net.host_ip}") as a:
        key, config = str(Path(mine[0], KEY_NAME)), str(tmp_path / "b" / "node.toml")
        mxfs("node", "add", "--meta", url, "--key", key, "--name", "b", "--config", config,
             "--member", theirs[0], "--member", theirs[1])
        with mount_with([config], "lease_s=3", "chunk_port=0", f"chunk_addr={net.node_ip}",
                        *node_options, prefix=net.enter, check=False) as b:
            yield net, a, b, mine, theirs


def test_a_removed_files_chunk_files_read_on_their_owner_are_its_users(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A node holding members kept the chunk files of a removed file that its direct
    readers held as root's (the writer's REMV named no owner): each stayed readable
    `read_grace_s` outside its user's quota and `max_held_per_user`.  The writer names
    the file's owner now, and past her bound on that node it is cut at once."""
    url = pg_cluster.database()
    alice = ensure_users()["alice"]
    with _two_owners(tmp_path, url, f"max_held_per_user={256 << 10}") as (
            _net, a, _b, _mine, theirs):
        (a.path / "shared").mkdir()
        mxfs("setstripe", "--across-nodes", str(a.path / "shared"))
        path = a.path / "shared" / "alices.bin"
        path.write_bytes(os.urandom(4 << 20))
        os.chown(path, alice.uid, alice.gid)
        ino = path.stat().st_ino
        assert _chunk(theirs[0], ino).stat().st_size >= 1 << 20
        fd = os.open(_chunk(theirs[0], ino), os.O_RDONLY)  # (a direct reader's, on b)
        try:
            path.unlink()
            assert eventually(lambda: not _chunk(theirs[0], ino).exists(), 15)
            st = os.fstat(fd)
            assert st.st_nlink == 1 and st.st_size == 0, st  # (held aside, cut: hers)
        finally:
            os.close(fd)


def test_a_chmod_on_the_writer_ends_what_a_nodes_readers_read_of_its_members(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A file on b's members, read directly on b (b's descriptors of its chunk files):
    a chmod on the writer that takes readers' right away makes b's chunk files anew
    too, so those descriptors keep what they held and never read what the writer
    writes after; the file has the new bytes on both nodes."""
    url = pg_cluster.database()
    with _two_owners(tmp_path, url) as (_net, a, b, _mine, theirs):
        (a.path / "shared").mkdir()
        assert eventually(lambda: (b.path / "shared").is_dir(), 15)
        (b.path / "shared" / "notes.bin").write_bytes(b"public " * 150000)
        path = a.path / "shared" / "notes.bin"
        ino = path.stat().st_ino
        assert _chunk(theirs[0], ino).stat().st_size > 0
        with ControlClient(str(b.path)) as c:
            _, kept = c.call_with_fds("open_read", path=c.pool_path(
                str(b.path / "shared" / "notes.bin")))
        try:
            theirs_held = [fd for fd in kept if os.fstat(fd).st_ino in {
                _chunk(t, ino).stat().st_ino for t in theirs}]
            assert theirs_held  # (b's own chunk files among them)
            os.chmod(path, 0o600)
            with open(path, "r+b") as f:
                f.write(b"SECRET " * 150000)
                f.flush()
                os.fsync(f.fileno())
            for fd in theirs_held:
                got = os.pread(fd, 4 << 20, 0)
                assert b"SECRET" not in got and b"public" in got
            assert _cold(path) == b"SECRET " * 150000
            assert eventually(lambda: _cold(b.path / "shared" / "notes.bin") ==
                              b"SECRET " * 150000, 15)
        finally:
            for fd in kept:
                os.close(fd)


@pytest.mark.daemon_log(r"node \S+ (cannot be reached|could not)")
def test_a_slow_owner_holds_only_the_files_striped_over_it(tmp_path: Path,
                                                           pg_cluster: Any) -> None:
    """With node b's link throttled, two dozen files striped over b's members are
    being written through the writer (each write waits on b); meanwhile the writer's
    own files are written and read at once: b's writes wait on threads, slots and a
    write-behind budget of their own, never on those the writer's own members are
    served with (they took all 16 threads and the whole budget before)."""
    url = pg_cluster.database()
    with _two_owners(tmp_path, url) as (net, a, b, mine, theirs):
        (a.path / "models").mkdir()
        mxfs("setstripe", "--across-nodes", str(a.path / "models"))
        own = os.urandom(1 << 20)
        (a.path / "own.bin").write_bytes(own)
        blobs = [os.urandom(2 << 20) for _ in range(24)]
        net.slow("64kbit")  # 8 KB/s: 48 MiB to b would take hours
        try:
            writers = [threading.Thread(target=(a.path / "models" / f"{i}.bin")
                                        .write_bytes, args=(blob,))
                       for i, blob in enumerate(blobs)]
            for t in writers:
                t.start()
            assert eventually(lambda: sum(
                1 for _ in (a.path / "models").iterdir()) == len(blobs), 10)
            done: list[bool] = []

            def own_work() -> None:  # the writer's own files, written and read
                (a.path / "mine.bin").write_bytes(own)
                done.append(_cold(a.path / "own.bin") == own and
                            _cold(a.path / "mine.bin") == own)

            worker = threading.Thread(target=own_work)
            worker.start()
            worker.join(30)
            assert done == [True], "the writer's own files waited on b"
            assert any(t.is_alive() for t in writers)  # (b's were still in flight)
        finally:
            net.slow(None)
        for t in writers:
            t.join(120)
        for i, blob in enumerate(blobs):
            assert _cold(a.path / "models" / f"{i}.bin") == blob
        assert _cold(b.path / "models" / "0.bin") == blobs[0]


@pytest.mark.daemon_log(r"node \S+ (cannot be reached|could not)", r"did not come within")
def test_a_slow_owner_holds_no_file_of_another_owner(tmp_path: Path,
                                                     pg_cluster: Any) -> None:
    """Writer a, and nodes b and c each holding two members: with b's link throttled
    and two dozen files on b's members being written through the writer, a file on
    c's members is read and written through the writer at once (each set of owners a
    file waits on has threads and a write-behind budget of its own: b's writes took
    every thread files on other nodes shared before)."""
    url = pg_cluster.database()
    mine = make_members(tmp_path / "a", 2)
    bs, cs = make_members(tmp_path / "b", 2), make_members(tmp_path / "c", 2)
    mkfs([*mine, *(f"b:{p}" for p in bs), *(f"c:{p}" for p in cs)], "64KiB", "--meta", url)
    with node_net() as net_b, node_net() as net_c, netns.forwarding(), \
            mounted_pool(mine, *WRITER, f"chunk_addr={net_b.host_ip}") as a:
        key = str(Path(mine[0], KEY_NAME))
        configs = []
        for name, folders in (("b", bs), ("c", cs)):
            configs.append(str(tmp_path / name / "node.toml"))
            mxfs("node", "add", "--meta", url, "--key", key, "--name", name, "--config",
                 configs[-1], "--member", folders[0], "--member", folders[1])
        with mount_with([configs[0]], "lease_s=3", "chunk_port=0",
                        f"chunk_addr={net_b.node_ip}", prefix=net_b.enter, check=False) as b, \
                mount_with([configs[1]], "lease_s=3", "chunk_port=0",
                           f"chunk_addr={net_c.node_ip}", prefix=net_c.enter,
                           check=False) as c:
            (a.path / "b").mkdir()
            assert eventually(lambda: (b.path / "b").is_dir(), 15)
            for i in range(24):  # (made on b: on b's members)
                (b.path / "b" / f"{i}.bin").touch()
            theirs = os.urandom(1 << 20)
            (c.path / "c.bin").write_bytes(theirs)
            assert _used(a, a.path / "c.bin")[1] == {4, 5}
            assert _used(a, a.path / "b" / "0.bin")[1] == {2, 3}
            blobs = [os.urandom(2 << 20) for _ in range(24)]
            net_b.slow("64kbit")  # 8 KB/s: 48 MiB to b would take hours
            try:
                writers = [threading.Thread(target=(a.path / "b" / f"{i}.bin").write_bytes,
                                            args=(blob,)) for i, blob in enumerate(blobs)]
                for t in writers:
                    t.start()
                time.sleep(2)  # (b's writes hold their threads)
                done: list[bool] = []

                def other_owner() -> None:  # c's file, read and written by the writer
                    (a.path / "c2.bin").write_bytes(theirs)  # (a's members: own lane)
                    with open(a.path / "c.bin", "r+b") as f:
                        f.write(b"written on a")
                    done.append(_cold(a.path / "c.bin") == b"written on a" + theirs[12:])

                worker = threading.Thread(target=other_owner)
                worker.start()
                worker.join(30)
                assert done == [True], "c's file waited on b"
                assert any(t.is_alive() for t in writers)  # (b's were still in flight)
            finally:
                net_b.slow(None)
            for t in writers:
                t.join(120)
            for i, blob in enumerate(blobs):
                assert _cold(a.path / "b" / f"{i}.bin") == blob


def test_three_nodes_load_a_model_striped_over_two_owners(tmp_path: Path,
                                                          pg_cluster: Any) -> None:
    """Writer a and node b each hold two members; node c holds none.  A model written on
    a into a directory set --across-nodes loads equal on b and on c: c reads a's
    stripes through a's chunk service and b's through b's (nodes in two namespaces,
    routed through the host), b reads its own and a's."""
    url = pg_cluster.database()
    mine, theirs = make_members(tmp_path / "a", 2), make_members(tmp_path / "b", 2)
    mkfs([*mine, *(f"b:{p}" for p in theirs)], "64KiB", "--meta", url)
    with node_net() as net_b, node_net() as net_c, netns.forwarding(), \
            mounted_pool(mine, *WRITER, f"chunk_addr={net_b.host_ip}") as a:
        key = str(Path(mine[0], KEY_NAME))
        config_b = str(tmp_path / "b" / "node.toml")
        mxfs("node", "add", "--meta", url, "--key", key, "--name", "b", "--config",
             config_b, "--member", theirs[0], "--member", theirs[1])
        with mount_with([config_b], "lease_s=3", "chunk_port=0",
                        f"chunk_addr={net_b.node_ip}", prefix=net_b.enter, check=False) as b, \
                mount_with([_join(tmp_path, url, key, "c")], "lease_s=3",
                           prefix=net_c.enter, check=False) as c:
            (a.path / "models").mkdir()
            mxfs("setstripe", "--across-nodes", str(a.path / "models"))
            gen = torch.Generator().manual_seed(3)
            tensors = {f"layer{i}.weight": torch.randn(512, 1024, generator=gen)
                       for i in range(6)}  # 12 MiB over four members of two nodes
            save_file(tensors, str(a.path / "models" / "m.safetensors"))
            assert _used(a, a.path / "models" / "m.safetensors")[1] == {0, 1, 2, 3}
            data = (a.path / "models" / "m.safetensors").read_bytes()
            served_a, served_b = _served(a), _served(b)
            for node in (b, c):
                path = node.path / "models" / "m.safetensors"
                assert eventually(lambda path=path: _cold(path) == data, 15)
                got = load_file(str(path))
                assert got.keys() == tensors.keys()
                assert all(torch.equal(got[k], v) for k, v in tensors.items())
            assert _served(a) > served_a and _served(b) > served_b  # (both owners served)
            # c holds no members: it makes names through the writer, and a checkpoint
            # (its bytes would need members of c's) is refused leaving nothing behind.
            os.mkdir(c.path / "models" / "from-c")
            assert (a.path / "models" / "from-c").is_dir()
            with pytest.raises(OSError, match="holds no members"):
                from mxfs import ckpt
                ckpt.save({"w": torch.zeros(4)}, str(c.path / "models" / "ck")).wait()
            with pytest.raises(OSError) as e:  # (nor are bytes through its mount)
                os.open(c.path / "models" / "x.bin", os.O_WRONLY | os.O_CREAT)
            assert e.value.errno == errno.EROFS
            assert sorted(os.listdir(a.path / "models")) == ["from-c", "m.safetensors"]
            assert eventually(lambda: _status(c)["nodes"] and all(
                n["state"] == "alive" for n in _status(c)["nodes"]), 10)


def _direct_write(path: Path, data: bytes) -> None:
    import mmap

    from mxfs.client.writer import create_file

    buf = mmap.mmap(-1, max(4096, -(-len(data) // 4096) * 4096))
    buf[:len(data)] = data
    with create_file(str(path), len(data)) as w:
        w.write_at(0, memoryview(buf), valid=len(data))
        w.commit(len(data))


@pytest.mark.daemon_log(r"node \S+ (is dead|cannot be reached|could not)",
                        r"serves its members again", r"is left there",
                        r"was not told to drop")
def test_a_node_writes_files_and_checkpoints_on_its_own_members(tmp_path: Path,
                                                                pg_cluster: Any) -> None:
    """Node b holds two members: a direct write there (a file, a checkpoint) lands on
    b's members and is named by the writer, readable on both nodes; the writer checks
    the caller's permission as its own mount would; an abort, or a writer whose
    connection ends, leaves no file and no chunk files; b killed with a file unwritten:
    the writer drops it once b's lease runs out."""
    users = ensure_users()
    url = pg_cluster.database()
    with _two_owners(tmp_path, url) as (net, a, b, mine, theirs):
        (a.path / "ckpt").mkdir(mode=0o755)
        assert eventually(lambda: (b.path / "ckpt").is_dir(), 15)
        data = os.urandom((2 << 20) + 12345)
        _direct_write(b.path / "ckpt" / "rank1.bin", data)
        ino, used, layout = _used(a, a.path / "ckpt" / "rank1.bin")
        assert used == {2, 3}  # (b's own members)
        for m, folder in ((2, theirs[0]), (3, theirs[1])):
            assert _chunk(folder, ino).stat().st_size == layout.chunk_length(m, len(data))
        assert not _chunk(mine[0], ino).exists()
        assert _cold(a.path / "ckpt" / "rank1.bin") == data
        assert eventually(lambda: _cold(b.path / "ckpt" / "rank1.bin") == data, 15)
        with open_reader(str(b.path / "ckpt" / "rank1.bin")) as r:  # (b's descriptors)
            assert not isinstance(r, (PlainFile, RemoteFile))  # (its own descriptors)
            buf = bytearray(len(data))
            r.read_into(0, memoryview(buf))
            assert bytes(buf) == data
        # One DCP checkpoint of two ranks, rank 0 on the writer node and rank 1 on
        # b (each writing its shard where it runs), saved and loaded back by both.
        run_ranks([a.path / "ckpt", b.path / "ckpt"])
        for name in ("sync", "async"):
            assert ck.verify(str(a.path / "ckpt" / name)) == []
            # (on b, rank 0's file is read from a's members: checked to be the file
            # that b's mount names, as a verify checks every data file it opens)
            assert ck.verify(str(b.path / "ckpt" / name)) == []
            ino1 = _used(a, a.path / "ckpt" / name / "rank-00001.safetensors")[1]
            assert ino1 == {2, 3} and _used(
                a, a.path / "ckpt" / name / "rank-00000.safetensors")[1] <= {0, 1}
        # Names made through b's mount are the writer's (as the caller): a folder,
        # a rename, removals; so a checkpoint saved on b whole (its folder and
        # rename the writer's, its files on b's members) loads on the writer.
        os.mkdir(b.path / "ckpt" / "d1")
        assert (a.path / "ckpt" / "d1").is_dir()
        _direct_write(b.path / "ckpt" / "d1" / "f", b"named on a, bytes on b")
        os.rename(b.path / "ckpt" / "d1" / "f", b.path / "ckpt" / "d1" / "g")
        assert (a.path / "ckpt" / "d1" / "g").read_bytes() == b"named on a, bytes on b"
        os.unlink(b.path / "ckpt" / "d1" / "g")
        os.rmdir(b.path / "ckpt" / "d1")
        assert not (a.path / "ckpt" / "d1").exists()
        state = {"w": torch.randn(128, 1024), "step": 7}
        ck.save(state, str(b.path / "ckpt" / "step7")).wait()
        got = ck.load(str(a.path / "ckpt" / "step7"))
        assert torch.equal(got["w"], state["w"]) and got["step"] == 7
        assert _used(a, a.path / "ckpt" / "step7" / next(
            n for n in os.listdir(a.path / "ckpt" / "step7") if "data" in n or
            n.endswith(".safetensors")))[1] == {2, 3}
        # The writer judges a node's name changes itself, as its own kernel would
        # (a node's kernel judged them on attributes perhaps a moment old).
        (a.path / "ckpt" / "sticky").mkdir()
        os.chmod(a.path / "ckpt" / "sticky", 0o1777)
        (a.path / "ckpt" / "sticky" / "roots").write_bytes(b"r")
        node_b = {n["name"]: n for n in _status(a)["nodes"]}["b"]
        host, port = _status(a)["chunk_service"]["addr"], \
            _status(a)["chunk_service"]["port"]
        alice = (users["alice"].uid, users["alice"].gid, [])
        sticky = os.stat(a.path / "ckpt" / "sticky").st_ino  # (the pool's inodes)
        ckpt_ino = os.stat(a.path / "ckpt").st_ino
        (b.path / "ckpt" / "plain.bin").write_bytes(b"p")  # (on b's members)
        on_b = a.path / "ckpt" / "plain.bin"
        with ChunkClient(host, int(port), load_key(mine[0]),
                         _status(a)["pool_uuid"]) as raw:
            # A new generation only for a file granted to the node for writing: once
            # b's last close let its grant go (asking its room, which changes nothing,
            # is refused), asked for one it is refused, and the generation stays.  (A
            # token each: a request asked again under its token is answered as before.)
            def room(renew: bool) -> int:
                try:
                    raw.kv_request(alice, "node_room", {
                        "ino": on_b.stat().st_ino, "token": os.urandom(8).hex(),
                        "node": ["b", node_b["epoch"]], **({"renew": True} if renew
                                                           else {})})
                except OSError as e:
                    return e.errno or 0
                return 0
            assert eventually(lambda: room(False) == errno.ESTALE, 15)
            with ControlClient(str(a.path)) as c:
                generation = c.layout(str(on_b))["generation"]
                assert room(True) == errno.ESTALE
                assert c.layout(str(on_b))["generation"] == generation
            for op, body, code in (
                    ("node_unlink", {"parent": sticky, "name": "cm9vdHM="}, errno.EPERM),
                    ("node_mkdir", {"parent": ckpt_ino, "name": "eA==", "mode": 0o755},
                     errno.EACCES),
                    ("node_rename", {"parent": sticky, "name": "cm9vdHM=",
                                     "new_parent": sticky, "new_name": "eA=="},
                     errno.EPERM)):
                with pytest.raises(OSError) as e:
                    raw.kv_request(alice, op, {**body, "token": op,
                                               "node": ["b", node_b["epoch"]]})
                assert e.value.errno == code, op
        assert (a.path / "ckpt" / "sticky" / "roots").read_bytes() == b"r"
        # The writer judges the caller as its own mount would.
        res = run_as(users["alice"], """
from mxfs.client.writer import create_file
print(json.dumps(attempt(create_file, sys.argv[1], 10)))
""", str(b.path / "ckpt" / "alice.bin"))
        assert res == errno.EACCES
        # Aborted, or the writer gone without a commit: nothing left.
        from mxfs.client.writer import create_file
        with create_file(str(b.path / "ckpt" / "dropped.bin"), 1 << 20) as w:
            dropped = w.ino
            w.abort()
        gone = subprocess.run([sys.executable, "-c", (
            "import os, sys\nfrom mxfs.client.writer import create_file\n"
            "w = create_file(sys.argv[1], 1 << 20)\nprint(w.ino, flush=True)\n"
            "os._exit(0)"), str(b.path / "ckpt" / "gone.bin")],
            capture_output=True, text=True, check=True)
        left = int(gone.stdout)
        for ino_ in (dropped, left):
            assert eventually(lambda i=ino_: not any(_chunk(f, i).exists() for f in theirs)
                              and not _in_store(url, i), 15)
        assert not (a.path / "ckpt" / "dropped.bin").exists()
        assert not (a.path / "ckpt" / "gone.bin").exists()
        # b dies holding an unpublished file: the writer drops it after b's lease.
        w = create_file(str(b.path / "ckpt" / "orphan.bin"), 1 << 20)
        orphan = w.ino
        os.kill(b.daemon_pid(), signal.SIGKILL)
        assert eventually(lambda: _in_store(url, orphan) is False, 30)
        mxfs("umount", str(b.path), check=False)
        assert _cold(a.path / "ckpt" / "rank1.bin") is None  # (b gone: EIO, never zeros)
        # A scrub names the sealed files on b's members as not checked, never as sound.
        res = mxfs("scrub", "--json", str(a.path), check=False)
        got = json.loads(res.stdout)
        assert res.returncode == 1 and got["damaged"] == []
        assert "rank1.bin" in {Path(u["path"]).name for u in got["unchecked"]}
        assert all("node b" in u["why"] for u in got["unchecked"])


@pytest.mark.daemon_log(r"node \S+ (is dead|cannot be reached|could not)",
                        r"serves its members again", r"is left there",
                        r"the writer refused its size")
def test_files_written_through_a_nodes_mount_land_on_its_members(tmp_path: Path,
                                                                 pg_cluster: Any) -> None:
    """Node b holds two members: files written through b's mount as any program
    writes them (open, write, close; rewritten in place, cut, appended, renamed while
    open) land on b's members, made by the writer at their create, and read equal on
    the writer after each close (close-to-open); a close past the caller's quota
    fails and leaves the size the writer held, b's bytes cut back to it; links,
    modes, owners and times set through b are the writer's, judged there as the
    caller; a file unlinked before its close leaves nothing; files striped over the
    writer's members, or sealed, are refused for writing."""
    users = ensure_users()
    url = pg_cluster.database()
    with _two_owners(tmp_path, url) as (net, a, b, mine, theirs):
        (a.path / "w").mkdir()
        os.chmod(a.path / "w", 0o777)
        assert eventually(lambda: (b.path / "w").is_dir(), 15)
        data = os.urandom((3 << 20) + 4321)
        with open(b.path / "w" / "x.bin", "wb") as f:
            f.write(data[:1 << 20])
            # Open here: named on the writer at its create, empty there until the close.
            assert os.stat(b.path / "w" / "x.bin").st_size == 1 << 20
            assert os.stat(a.path / "w" / "x.bin").st_size == 0
            f.write(data[1 << 20:])
        ino, used, layout = _used(a, a.path / "w" / "x.bin")
        assert used == {2, 3}  # (b's own members)
        for m, folder in ((2, theirs[0]), (3, theirs[1])):
            assert _chunk(folder, ino).stat().st_size == layout.chunk_length(m, len(data))
        assert _cold(a.path / "w" / "x.bin") == data
        # Rewritten in place, then cut and appended to: each close seen on the writer.
        with open(a.path / "w" / "x.bin", "rb") as f:  # (the writer's kernel keeps pages)
            assert f.read(4096) == data[:4096]
        with open(b.path / "w" / "x.bin", "r+b") as f:
            f.seek(100)
            f.write(b"rewritten on b")
        data = data[:100] + b"rewritten on b" + data[114:]
        assert (a.path / "w" / "x.bin").read_bytes() == data
        with open(b.path / "w" / "x.bin", "r+b") as f:
            f.truncate(5000)
            f.seek(0, os.SEEK_END)
            f.write(b"tail")
        data = data[:5000] + b"tail"
        assert (a.path / "w" / "x.bin").read_bytes() == data
        assert os.stat(a.path / "w" / "x.bin").st_ino == ino  # (the same file)
        # Not sealed: the writer's own mount writes it too.
        with open(a.path / "w" / "x.bin", "ab") as f:
            f.write(b"+a")
        assert eventually(lambda: (b.path / "w" / "x.bin").read_bytes() == data + b"+a", 15)
        data += b"+a"
        # A close on b tells a size that only grows the file: what the writer's own
        # mount appended while b held it open stays.
        with open(b.path / "w" / "x.bin", "r+b") as f:
            f.write(b"head")
            with open(a.path / "w" / "x.bin", "ab") as g:
                g.write(b"+tail")
        data = b"head" + data[4:] + b"+tail"
        assert (a.path / "w" / "x.bin").read_bytes() == data
        # Saved as programs save: to a temporary name, renamed before the close.
        state = {"w": torch.randn(256, 256)}
        with open(b.path / "w" / "tmp.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.rename(b.path / "w" / "tmp.pt", b.path / "w" / "model.pt")
            f.write(b"")
        got = torch.load(a.path / "w" / "model.pt")
        assert torch.equal(got["w"], state["w"])
        assert not (a.path / "w" / "tmp.pt").exists()
        # A user's file: hers, on b's members.
        res = run_as(users["alice"], """
with open(sys.argv[1], "wb") as f:
    f.write(b"alice on b")
print(json.dumps(os.stat(sys.argv[1]).st_uid))
""", str(b.path / "w" / "alice.txt"))
        assert res == users["alice"].uid
        assert (a.path / "w" / "alice.txt").read_bytes() == b"alice on b"
        assert os.stat(a.path / "w" / "alice.txt").st_uid == users["alice"].uid
        # Under her quota her files close; past it her writes through b fail (b was
        # granted what her quota left when she opened), and the file keeps what fit.
        mxfs("quota", "--user", "mxfs-alice", "--bytes", "4MiB", str(a.path))
        # Her writes in flight at once on b, each into a file of its own, are held to
        # her quota together, and every close is taken: a write's check of b's share
        # and the growth it counts are split by awaits, so each holds its growth from
        # the check on (`MountWrites.reserved`); passed together, the writer would
        # refuse the later closes, and b cut back bytes it had answered for.
        sparse = [str(b.path / "w" / f"sparse{i}.bin") for i in range(16)]
        res = run_as(users["alice"], """
import errno, threading
got, ready = {}, threading.Barrier(len(sys.argv) - 1)
def one(i, path):
    f = open(path, "wb", buffering=0)
    ready.wait()  # (every file open: the writes go at once)
    try:
        f.seek(1_300_000)
        wrote = f.write(b"!")  # (a hole, then a byte: 1.3 MB of her quota)
    except OSError as e:
        wrote = errno.errorcode[e.errno]
    try:
        f.close()
        closed = "ok"
    except OSError as e:
        closed = errno.errorcode[e.errno]
    got[i] = [wrote, closed]
threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(sys.argv[1:])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps([got[i] for i in range(len(threads))]))
""", *sparse)
        assert all(closed == "ok" for _, closed in res), res
        assert sum(wrote == 1 for wrote, _ in res) >= 1 and \
            all(wrote in (1, "EDQUOT") for wrote, _ in res), res
        for (wrote, _), path in zip(res, sparse, strict=True):
            on_a = a.path / "w" / Path(path).name
            assert on_a.read_bytes() == (bytes(1_300_000) + b"!" if wrote == 1 else b"")
            on_a.unlink()
        mxfs("quota", "--user", "mxfs-alice", "--bytes", "1MiB", str(a.path))
        res = run_as(users["alice"], """
with open(sys.argv[1], "wb") as f:
    f.write(b"s" * 100_000)
done = [0, 0]
with open(sys.argv[2], "wb", buffering=0) as f1, open(sys.argv[3], "wb", buffering=0) as f2:
    try:
        while True:  # (two files open at once: her quota is one for both)
            for i, f in enumerate((f1, f2)):
                done[i] += f.write(b"b" * 65536)
    except OSError as e:
        print(json.dumps([e.errno, done]))
""", *(str(b.path / "w" / n) for n in ("small.bin", "big.bin", "big2.bin")))
        assert res[0] == errno.EDQUOT and 0 < sum(res[1]) <= (1 << 20) - 100_000
        assert (a.path / "w" / "small.bin").read_bytes() == b"s" * 100_000
        assert (a.path / "w" / "big.bin").read_bytes() == b"b" * res[1][0]
        assert (a.path / "w" / "big2.bin").read_bytes() == b"b" * res[1][1]
        # Many opens of one file at once on b, each writing its own block: every
        # block lands, and the size is the furthest one.
        (b.path / "w" / "shared.bin").write_bytes(b"")

        def block(i: int) -> None:
            with open(b.path / "w" / "shared.bin", "r+b") as f:
                f.seek(i * 4096)
                f.write(bytes([i]) * 4096)

        for _ in range(5):
            threads = [threading.Thread(target=block, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert (a.path / "w" / "shared.bin").read_bytes() == \
            b"".join(bytes([i]) * 4096 for i in range(8))
        # Read-only files are written through what was opened (as git makes its
        # objects: created 0444, written, closed; cp -p: fchmod before the close).
        res = run_as(users["alice"], """
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o444)
os.write(fd, b"object")
os.close(fd)
fd = os.open(sys.argv[2], os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b"copied")
os.fchmod(fd, 0o444)
os.close(fd)
print(json.dumps("ok"))
""", str(b.path / "w" / "obj"), str(b.path / "w" / "cp"))
        assert res == "ok"
        assert (a.path / "w" / "obj").read_bytes() == b"object"
        assert (a.path / "w" / "cp").read_bytes() == b"copied"
        # A file of hers open for writing on b holds a share of her quota for b (her
        # writes through the writer's own mount find it spent), given back at its close.
        mxfs("quota", "--user", "mxfs-alice", "--bytes", "3MiB", str(a.path))
        res = run_as(users["alice"], """
import errno, time
def fill(path):
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(b"a" * 65536)
        except OSError as e:
            assert e.errno == errno.EDQUOT, e
    os.unlink(path)
    return n
on_b = open(sys.argv[1], "wb", buffering=0)
on_b.write(b"x" * 65536)  # (b takes its share of her quota)
first = fill(sys.argv[2])
on_b.close()
time.sleep(2.5)  # (b tells the writer its last close: the share goes back)
print(json.dumps([first, fill(sys.argv[2])]))
""", str(b.path / "w" / "share.bin"), str(a.path / "w" / "fill.bin"))
        assert res[1] - res[0] >= 256 << 10, res
        assert (a.path / "w" / "share.bin").read_bytes() == b"x" * 65536
        # Another of her files closed on b untouched while one stays open there: its
        # let-go leaves b's share as it was (b read "no limit" into that answer, and her
        # writes into the open file passed her quota until its close).
        res = run_as(users["alice"], """
import errno, time
done = 0
with open(sys.argv[1], "wb", buffering=0) as held:
    held.write(b"h" * 65536)
    open(sys.argv[2], "wb").close()
    time.sleep(2.5)  # (b tells the writer that last close: the grant is let go)
    try:
        while done < 16 << 20:
            done += held.write(b"h" * 65536)
    except OSError as e:
        print(json.dumps([e.errno, done]))
        raise SystemExit(0)
print(json.dumps([0, done]))
""", str(b.path / "w" / "held.bin"), str(b.path / "w" / "untouched.bin"))
        assert res[0] == errno.EDQUOT and res[1] < 3 << 20, res
        mxfs("quota", "--user", "mxfs-alice", "--clear", str(a.path))
        # Links, modes, owners and times through b's mount: the writer's, for the caller
        # (so shutil.copy2 and a Hugging Face cache's links work on a node).
        shutil.copy2(b.path / "w" / "alice.txt", b.path / "w" / "copy.txt")
        st_a, st_c = os.stat(a.path / "w" / "alice.txt"), os.stat(a.path / "w" / "copy.txt")
        assert (st_c.st_mode, st_c.st_mtime_ns) == (st_a.st_mode, st_a.st_mtime_ns)
        os.chmod(b.path / "w" / "copy.txt", 0o600)
        os.chown(b.path / "w" / "copy.txt", users["alice"].uid, -1)
        os.utime(b.path / "w" / "copy.txt", ns=(10**18, 2 * 10**18))
        st_c = os.stat(a.path / "w" / "copy.txt")
        assert (stat.S_IMODE(st_c.st_mode), st_c.st_uid, st_c.st_mtime_ns) == \
            (0o600, users["alice"].uid, 2 * 10**18)
        os.symlink("copy.txt", b.path / "w" / "link")
        os.link(b.path / "w" / "copy.txt", b.path / "w" / "hard")
        assert os.readlink(a.path / "w" / "link") == "copy.txt"
        assert (a.path / "w" / "link").read_bytes() == b"alice on b"
        assert os.stat(a.path / "w" / "hard").st_ino == st_c.st_ino
        assert os.stat(a.path / "w" / "copy.txt").st_nlink == 2
        os.truncate(b.path / "w" / "copy.txt", 5)  # (by name: told at once)
        assert (a.path / "w" / "hard").read_bytes() == b"alice"
        # The writer judges the caller with every group it is in (here 70: one past the
        # first 64 lets it into a folder).
        os.mkdir(a.path / "w" / "many")
        os.chown(a.path / "w" / "many", 0, 50069)
        os.chmod(a.path / "w" / "many", 0o770)
        assert eventually(lambda: (b.path / "w" / "many").is_dir() and
                          os.stat(b.path / "w" / "many").st_gid == 50069, 15)  # (b heard)
        many = User("mxfs-alice", users["alice"].uid, users["alice"].gid,
                    tuple(range(50000, 50070)))
        res = run_as(many, """
os.mkdir(sys.argv[1])
with open(sys.argv[1] + "/f", "wb") as f:
    f.write(b"in group 50069")
print(json.dumps("ok"))
""", str(b.path / "w" / "many" / "d"))
        assert res == "ok"
        assert (a.path / "w" / "many" / "d" / "f").read_bytes() == b"in group 50069"
        # A name mounted on in the writer's mount is neither removed nor moved through
        # b (the writer's kernel refuses it there; b's request never passes it).
        (a.path / "w" / "mnt").mkdir()
        assert eventually(lambda: (b.path / "w" / "mnt").is_dir(), 15)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "mxfs-test",
                        str(a.path / "w" / "mnt")], check=True)
        try:
            for change in (lambda: os.rmdir(b.path / "w" / "mnt"),
                           lambda: os.rename(b.path / "w" / "mnt", b.path / "w" / "mnt2")):
                with pytest.raises(OSError) as e:
                    change()
                assert e.value.errno == errno.EBUSY
            assert os.path.ismount(a.path / "w" / "mnt")
        finally:
            subprocess.run(["umount", str(a.path / "w" / "mnt")], check=True)
        os.rmdir(b.path / "w" / "mnt")
        assert not (a.path / "w" / "mnt").exists()
        # Unlinked before its close (as a temporary file is): its bytes go with it.
        fd = os.open(b.path / "w" / "gone.bin", os.O_WRONLY | os.O_CREAT)
        os.write(fd, os.urandom(1 << 20))
        gone = os.fstat(fd).st_ino
        os.unlink(b.path / "w" / "gone.bin")
        os.close(fd)
        assert eventually(lambda: not any(_chunk(m, gone).exists() for m in theirs)
                          and not _in_store(url, gone), 15)
        assert not (a.path / "w" / "gone.bin").exists()
        # Striped over the writer's members, or sealed: written on the writer.
        (a.path / "w" / "mine.bin").write_bytes(b"a's")
        assert _used(a, a.path / "w" / "mine.bin")[1] <= {0, 1}
        with pytest.raises(OSError) as e:
            os.open(b.path / "w" / "mine.bin", os.O_RDWR)
        assert e.value.errno == errno.EROFS
        _direct_write(b.path / "w" / "sealed.bin", b"sealed")
        with pytest.raises(OSError) as e:
            os.open(b.path / "w" / "sealed.bin", os.O_RDWR)
        assert e.value.errno == errno.EPERM
        assert (a.path / "w" / "mine.bin").read_bytes() == b"a's"
        # The writer judges a node's callers itself (a node's kernel judged them on
        # attributes perhaps a moment old): alice may not create in root's folder nor
        # open root's file for writing; nobody may tell the size of a file b was never
        # granted (on members b does not hold, or sealed).
        node_b = {n["name"]: n for n in _status(a)["nodes"]}["b"]
        host, port = _status(a)["chunk_service"]["addr"], \
            _status(a)["chunk_service"]["port"]
        alice, root = (users["alice"].uid, users["alice"].gid, []), (0, 0, [])
        (a.path / "w" / "roots").mkdir()
        with ChunkClient(host, int(port), load_key(mine[0]),
                         _status(a)["pool_uuid"]) as raw:
            for who, op, body, code in (
                    (alice, "node_create", {"parent": os.stat(a.path / "w" / "roots").st_ino,
                                            "name": "eA==", "mountpoint": ""}, errno.EACCES),
                    (alice, "node_open", {"ino": ino}, errno.EACCES),
                    (root, "node_written", {"ino": ino, "size": 0}, errno.ESTALE),  # (let go
                    # after b's last close of it)
                    (root, "node_create", {"parent": os.stat(a.path / "w").st_ino,
                                           "name": "eC5iaW4=", "mode": 0o644,
                                           "exclusive": True}, errno.EEXIST),
                    (root, "node_written", {"ino": os.stat(a.path / "w" / "mine.bin").st_ino,
                                            "size": 0}, errno.ESTALE),  # (never granted)
                    (root, "node_written", {"ino": os.stat(a.path / "w" / "sealed.bin").st_ino,
                                            "size": 0}, errno.ESTALE),
                    (root, "node_open", {"ino": os.stat(a.path / "w" / "sealed.bin").st_ino},
                     errno.EPERM),
                    (root, "node_open", {"ino": os.stat(a.path / "w" / "mine.bin").st_ino},
                     errno.EROFS),
                    (alice, "node_setattr", {"ino": ino, "mode": 0o777}, errno.EPERM),
                    (alice, "node_mknod", {"parent": os.stat(a.path / "w").st_ino,
                                           "name": "ZGV2", "mode": stat.S_IFCHR | 0o600,
                                           "rdev": os.makedev(1, 3)}, errno.EPERM),
                    (alice, "node_setxattr", {"ino": ino, "name": "dXNlci54",
                                              "value": ""}, errno.EACCES),
                    (alice, "node_setxattr", {"ino": os.stat(a.path / "w" / "alice.txt").st_ino,
                                              "name": "dHJ1c3RlZC54", "value": ""},
                     errno.EPERM),
                    (alice, "node_setattr", {"ino": os.stat(a.path / "w" / "alice.txt").st_ino,
                                             "uid": 0}, errno.EPERM),
                    (alice, "node_setattr", {"ino": ino, "mtime_ns": 0}, errno.EPERM),
                    (alice, "node_link", {"ino": ino, "parent": os.stat(a.path / "w").st_ino,
                                          "name": "eA=="}, errno.EPERM),
                    (alice, "node_symlink", {"parent": os.stat(a.path / "w" / "roots").st_ino,
                                             "name": "eA==", "target": "eA=="},
                     errno.EACCES)):
                with pytest.raises(OSError) as e:
                    raw.kv_request(who, op, {**body, "token": op,
                                             "node": ["b", node_b["epoch"]]})
                assert e.value.errno == code, op
        assert (a.path / "w" / "x.bin").read_bytes() == data
        assert (a.path / "w" / "mine.bin").read_bytes() == b"a's"
        assert not (a.path / "w" / "roots" / "x").exists()
        # A scrub on either node checks the sealed files on the other's members too
        # (through its chunk service), and names a damaged byte there.
        _direct_write(a.path / "w" / "sealed_a.bin", os.urandom(300_000))
        assert _used(a, a.path / "w" / "sealed_a.bin")[1] <= {0, 1}
        for m in (a, b):
            got = json.loads(mxfs("scrub", "--json", str(m.path)).stdout)
            assert got["checked"] >= 2 and got["damaged"] == got["unchecked"] == []
        sealed = os.stat(a.path / "w" / "sealed.bin").st_ino
        held = next(f for f in theirs if _chunk(f, sealed).exists()
                    and _chunk(f, sealed).stat().st_size)
        with open(_chunk(held, sealed), "r+b") as f:
            f.write(b"S")
        for m in (a, b):
            res = mxfs("scrub", "--json", str(m.path), check=False)
            got = json.loads(res.stdout)
            assert res.returncode == 1 and got["unchecked"] == []
            assert [(Path(d["path"]).name, d["member"] in (2, 3)) for d in got["damaged"]] \
                == [("sealed.bin", True)]


def test_writes_through_a_nodes_mount_after_a_reader_there_was_told_change_the_file(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A file open for writing through node b's mount, and written, is opened by a
    direct reader on b (b's own descriptors, told its generation); b's writer writes
    it again in place (its size the same): the reader sees the file changed.  The
    generation stayed until the next open there, and check_unchanged passed over
    torn bytes."""
    url = pg_cluster.database()
    with _two_owners(tmp_path, url) as (_net, a, b, _mine, _theirs):
        (a.path / "w").mkdir()
        assert eventually(lambda: (b.path / "w").is_dir(), 15)
        path = b.path / "w" / "g.bin"
        path.write_bytes(b"A" * (1 << 20))
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"A", 0)
            os.fsync(fd)
            for byte in (b"B", b"C"):  # (each reader in turn: told, then written)
                with open_reader(str(path)) as reader:
                    assert isinstance(reader, DirectFile)  # (b's own descriptors)
                    buf = bytearray(1 << 20)
                    reader.read_into(0, memoryview(buf))
                    reader.check_unchanged()
                    os.pwrite(fd, byte * (512 << 10), 512 << 10)
                    os.fsync(fd)
                    with pytest.raises(FileChanged):
                        reader.check_unchanged()
        finally:
            os.close(fd)
        assert (a.path / "w" / "g.bin").read_bytes() == b"A" * (512 << 10) + b"C" * (512 << 10)


@pytest.mark.daemon_log(r"node \S+ (is dead|cannot be reached|could not)",
                        r"serves its members again", r"went away|not alive")
def test_a_file_open_on_a_node_is_written_on_across_a_writer_restart(
        tmp_path: Path, pg_cluster: Any) -> None:
    """A file open for writing through b's mount while the writer restarts (its grants
    gone with it): b's close asks for the file again and tells its size; nothing b
    wrote before or after the restart is lost.  Nor of alice's file, made read-only
    after she opened it (permission is judged at open: the grant asked for again was
    refused, and her close's bytes cut back)."""
    url = pg_cluster.database()
    with _two_owners(tmp_path, url) as (net, a, b, mine, theirs):
        (a.path / "w").mkdir(mode=0o777)
        os.chmod(a.path / "w", 0o777)
        assert eventually(lambda: (b.path / "w").is_dir(), 15)
        before, after = os.urandom(300_000), os.urandom(200_000)
        alice = subprocess.Popen(as_user(ensure_users()["alice"], """
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, b"b" * 300_000)
os.fchmod(fd, 0o444)
print(json.dumps("written"), flush=True)
sys.stdin.readline()
print(json.dumps([attempt(os.write, fd, b"a" * 200_000), attempt(os.close, fd)]))
""", str(b.path / "w" / "alice.bin")), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        assert alice.stdout is not None and alice.stdin is not None
        assert json.loads(alice.stdout.readline()) == "written"
        with open(b.path / "w" / "long.bin", "wb", buffering=0) as f:
            f.write(before)
            mxfs("umount", str(a.path))
            mxfs("mount", "-o", ",".join(("allow_other", *WRITER,
                                          f"chunk_addr={net.host_ip}")), mine[0], str(a.path))

            def b_reaches_the_writer() -> bool:
                try:
                    os.mkdir(b.path / "w" / f"ping{time.monotonic_ns()}")
                    return True
                except OSError:
                    return False
            assert eventually(b_reaches_the_writer, 30)
            f.write(after)
        out, _ = alice.communicate("go\n", timeout=60)
        assert json.loads(out) == [200_000, "ok"]
        assert (a.path / "w" / "long.bin").read_bytes() == before + after
        assert (a.path / "w" / "alice.bin").read_bytes() == b"b" * 300_000 + b"a" * 200_000


@pytest.mark.daemon_log(r"refused its size", r"node \S+ (is dead|cannot be reached|could not)",
                        r"serves its members again", r"went away|not alive",
                        r"chunk handshake .* failed")  # (one begun as b was killed)
def test_a_nodes_refused_close_and_a_writers_cut_leave_each_others_bytes_as_they_are(
        tmp_path: Path, pg_cluster: Any) -> None:
    """bob's file on b's members is written by alice through the writer's mount (its
    size held there until her close), then by root through b's, past her bytes; b's
    close is refused (bob's quota, set meanwhile), and told again, refused again: what
    b wrote past the writer's size is cut, her bytes are not.  (b cut its chunk files
    to the size the store last committed: none of hers, read as zeros.)  And a file b
    holds open that a truncate on the writer cuts is held at the writer's size.  b's
    untold bytes of files it held when it died never show in the holes the writer
    makes after."""
    url = pg_cluster.database()
    users = ensure_users()
    with _two_owners(tmp_path, url) as (net, a, b, mine, theirs):
        (a.path / "w").mkdir()
        os.chmod(a.path / "w", 0o777)
        assert eventually(lambda: (b.path / "w").is_dir(), 15)
        (b.path / "w" / "f.bin").write_bytes(b"")  # (made on b's members)
        path = a.path / "w" / "f.bin"
        os.chown(path, users["bob"].uid, users["bob"].gid)
        os.chmod(path, 0o666)
        ino = path.stat().st_ino
        alice = subprocess.Popen(as_user(users["alice"], """
fd = os.open(sys.argv[1], os.O_WRONLY)
os.write(fd, b"a" * (4 << 20))
print(json.dumps("written"), flush=True)
sys.stdin.readline()
os.close(fd)
""", str(path)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert alice.stdout is not None
        assert json.loads(alice.stdout.readline()) == "written"

        def on_b() -> int:
            return sum(_chunk(m, ino).stat().st_size for m in theirs
                       if _chunk(m, ino).exists())
        fd = os.open(b.path / "w" / "f.bin", os.O_WRONLY)
        try:
            mxfs("quota", "--user", "mxfs-bob", "--bytes", "512KiB", str(a.path))
            os.pwrite(fd, b"b" * (1 << 20), 4 << 20)
        finally:
            with pytest.raises(OSError) as e:
                os.close(fd)
        assert e.value.errno == errno.EDQUOT
        assert eventually(lambda: on_b() == 4 << 20, 15), on_b()  # (its retell refused)
        alice.communicate("go\n", timeout=60)
        assert alice.returncode == 0
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert f.read() == b"a" * (4 << 20)
        # A log b appends to, cut on the writer (logrotate's copytruncate): b's next
        # append lands at the start, and its close grows nothing back (held at the
        # size before, b appended past it and told that size: 1 MiB of zeros, then x).
        log_path = a.path / "w" / "log"
        with open(b.path / "w" / "log", "ab", buffering=0) as f:
            f.write(b"l" * (1 << 20))
            os.fsync(f.fileno())
            os.truncate(log_path, 0)
            f.write(b"x")
        assert log_path.read_bytes() == b"x"
        # A late cut-back (the writer's, after b gave up waiting for its answer) leaves
        # a file a caller on b holds open for writing again (b cut it at that open, and
        # what it wrote since is its own); open nowhere there, it is cut.
        late = b.path / "w" / "late.bin"
        with open(late, "wb", buffering=0) as f:
            f.write(b"n" * (1 << 20))
            ino = os.fstat(f.fileno()).st_ino
            addr = {n["name"]: n for n in _status(a)["nodes"]}["b"]["addr"]
            host, _, port = addr.rpartition(":")
            with ChunkClient(host, int(port), load_key(mine[0]),
                             _status(a)["pool_uuid"]) as raw:
                epoch = _status(a)["lease"]["epoch"]
                member = next(m for m, folder in ((2, theirs[0]), (3, theirs[1]))
                              if _chunk(folder, ino).exists())
                folder = theirs[member - 2]
                held = _chunk(folder, ino).stat().st_size
                raw.change(b"TRUN", epoch, ino, member, 0, back=True)
                assert held and _chunk(folder, ino).stat().st_size == held
        with ChunkClient(host, int(port), load_key(mine[0]), _status(a)["pool_uuid"]) as raw:
            def cut_once_released() -> bool:  # (b hears the close's release after it)
                raw.change(b"TRUN", epoch, ino, member, 0, back=True)
                return _chunk(folder, ino).stat().st_size == 0
            assert eventually(cut_once_released, 15)
        # b dies holding files it wrote and never told (the writer holds them empty),
        # and joins again: a truncate that grows one on the writer, and a write past
        # the end of another, read zeros in their holes, never b's untold bytes.
        def b_epoch() -> int:
            return int({n["name"]: n for n in _status(a)["nodes"]}["b"]["epoch"])
        was = b_epoch()
        fds = []
        for name in ("grown.bin", "past.bin"):
            fd = os.open(b.path / "w" / name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(fd, b"s" * (1 << 20), 0)
            fds.append(fd)
        os.kill(b.daemon_pid(), signal.SIGKILL)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        mxfs("umount", str(b.path), check=False)
        config = str(tmp_path / "b" / "node.toml")
        res = subprocess.run([*net.enter, sys.executable, "-m", "mxfs", "mount", "-o",
                              f"allow_other,lease_s=3,chunk_port=0,chunk_addr={net.node_ip}",
                              config, str(b.path)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        assert eventually(lambda: b_epoch() != was and _node_state(a, "b") == "alive", 30)
        time.sleep(2.5)  # (the writer's sweep, once a second, drops b's old grants)
        os.truncate(a.path / "w" / "grown.bin", 1 << 20)
        with open(a.path / "w" / "past.bin", "r+b") as f:
            f.seek(2 << 20)
            f.write(b"p")
        for name, size in (("grown.bin", 1 << 20), ("past.bin", (2 << 20) + 1)):
            with open(a.path / "w" / name, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                got = f.read()
            assert len(got) == size and got[:1 << 20] == bytes(1 << 20), name


@pytest.mark.daemon_log(r"node \S+ (is dead|cannot be reached|could not|serves no chunks)",
                        r"serves its members again", r"is left there",
                        r"chunk files of removed files")
def test_a_file_open_on_a_node_keeps_its_bytes_when_unlinked(tmp_path: Path,
                                                             pg_cluster: Any) -> None:
    """A file b's mount has open reads (and writes) on after it is unlinked, on the
    writer or through b itself (a temporary file), as on a local file system and on
    NFSv4: the writer keeps its bytes until b's last close, across a writer restart,
    and until b's lease runs out when b dies.  (Each read EIO or ENOENT before.)
    b says all it holds every `full` s in parts of `at_once`, the writer drops a dead
    node's holds after `grace` s (mount options: the defaults, 10 s, 16,384 and 10 s,
    would only make it wait longer and open more files)."""
    url = pg_cluster.database()
    full, at_once, grace = 1, 100, 4
    writer = (f"node_grace_s={grace}",)
    with _two_owners(tmp_path, url, f"holds_full_s={full}", f"holds_at_once={at_once}",
                     writer=writer) as (net, a, b, mine, theirs):
        (a.path / "models").mkdir()
        mxfs("setstripe", "--across-nodes", str(a.path / "models"))
        data = os.urandom(4 << 20)

        def whole(fd: int, size: int) -> bytes:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (read from the pool)
            return os.pread(fd, size, 0)

        def gone(ino: int, members: list[str]) -> bool:
            return not any(_chunk(m, ino).exists() for m in members) \
                and not _in_store(url, ino)

        def open_on_b(name: str) -> tuple[int, int]:
            """`name` written on the writer, then opened on b: (descriptor, inode)."""
            (a.path / name).write_bytes(data)
            assert eventually(lambda: (b.path / name).exists(), 15)
            fd = os.open(b.path / name, os.O_RDONLY)
            return fd, os.fstat(fd).st_ino

        # Striped over a's and b's members, open on b, unlinked on the writer.
        fd, ino = open_on_b("models/m.bin")
        (a.path / "models" / "m.bin").unlink()
        time.sleep(2)  # (the writer's reclaim rounds run ten times a second)
        assert whole(fd, len(data)) == data
        assert all(_chunk(m, ino).exists() for m in (*mine, *theirs))
        os.close(fd)
        assert eventually(lambda: gone(ino, [*mine, *theirs]), 15)
        # Opens on b racing unlinks on the writer: each open either fails (the file was
        # gone) or reads the whole file, never EIO or part of it.
        small = os.urandom(256 << 10)
        outcomes: list[str] = []

        def race(i: int) -> None:  # (eight files at a time, each its own race)
            (a.path / "models" / f"r{i}").write_bytes(small)
            assert eventually(lambda: (b.path / "models" / f"r{i}").exists(), 15)

            def read_on_b() -> None:
                time.sleep((i % 10) * 0.013)  # (before the unlink, after its commit, ...)
                try:
                    fd = os.open(b.path / "models" / f"r{i}", os.O_RDONLY)
                except OSError as e:
                    outcomes.append(errno.errorcode[e.errno])
                    return
                try:
                    time.sleep(0.3)  # (past the writer's free of an unheld orphan)
                    outcomes.append("whole" if whole(fd, len(small)) == small else "PART")
                except OSError as e:
                    outcomes.append("READ " + errno.errorcode[e.errno])
                finally:
                    os.close(fd)

            reader = threading.Thread(target=read_on_b)
            reader.start()
            time.sleep(0.04)
            (a.path / "models" / f"r{i}").unlink()
            reader.join(30)
        with ThreadPoolExecutor(8) as racers:
            list(racers.map(race, range(40)))
        assert len(outcomes) == 40, outcomes
        assert set(outcomes) <= {"whole", "ENOENT", "ESTALE"}, outcomes
        # Asked raw as b: a word meant for another writer, or one older than b's last,
        # changes nothing; a malformed one is refused.
        status = _status(a)
        epochs = {n["name"]: n["epoch"] for n in status["nodes"]}
        with ChunkClient(status["chunk_service"]["addr"], int(status["chunk_service"]["port"]),
                         load_key(mine[0]), status["pool_uuid"]) as raw:
            def word(writer: int = epochs["a"], **body: Any) -> Any:
                return raw.kv_request((0, 0, []), "node_hold", {
                    "word": 0, "hold": [], **body, "writer": writer,
                    "node": ["b", epochs["b"]]})
            assert word(writer=0, full=True) == {"writer": epochs["a"]}
            assert word(full=True) == {"writer": epochs["a"]}  # (not newer than b's own)
            # (a word naming HOLDS_AT_ONCE files, the most, fits a request; one more not)
            assert word(hold=[(1 << 63) - 1] * HOLDS_AT_ONCE) == {"writer": epochs["a"]}
            for bad in ({"hold": "1"}, {"hold": [-1]}, {"let_go": [True]}, {"seen": "x"},
                        {"word": None}, {"let_go": [1] * (HOLDS_AT_ONCE + 1)}):
                with pytest.raises(OSError) as e:
                    word(**bad)
                assert e.value.errno == errno.EINVAL
        # ... and b's own words go on: a file open on b and unlinked on a is still kept.
        fd, _ = open_on_b("models/m2.bin")
        (a.path / "models" / "m2.bin").unlink()
        time.sleep(1)
        assert whole(fd, len(data)) == data
        os.close(fd)
        # A temporary file on b's members: made, unlinked and written on through b.
        (a.path / "w").mkdir()
        assert eventually(lambda: (b.path / "w").is_dir(), 15)
        fd = os.open(b.path / "w" / "t.bin", os.O_RDWR | os.O_CREAT)
        os.write(fd, data)
        tmp = os.fstat(fd).st_ino
        os.unlink(b.path / "w" / "t.bin")
        time.sleep(2)
        os.write(fd, b"more")
        os.fsync(fd)
        assert whole(fd, len(data) + 4) == data + b"more"
        os.close(fd)
        assert eventually(lambda: gone(tmp, theirs), 15)
        # On the writer's members, unlinked through b; then the writer restarts: it
        # frees the orphans it finds only once b told it its holds again.
        fd, mine_ino = open_on_b("mine.bin")
        os.unlink(b.path / "mine.bin")
        mxfs("umount", str(a.path))
        mxfs("mount", "-o", ",".join(("allow_other", *WRITER, *writer,
                                      f"chunk_addr={net.host_ip}")), mine[0], str(a.path))
        time.sleep(3)  # (b's word comes five times a second)
        assert whole(fd, len(data)) == data
        os.close(fd)
        assert eventually(lambda: gone(mine_ino, mine), 15)
        # More files open on b than one word can name: its whole word (every `full` s)
        # goes in parts, and a file unlinked meanwhile stays whole past the next ones (a
        # first part alone let every hold past it go, and the file was freed).
        many = 2 * at_once + 50
        (a.path / "many").mkdir()
        for i in range(many):
            (a.path / "many" / str(i)).touch()
        fd, past = open_on_b("past.bin")  # (its inode past every one of theirs)
        assert eventually(lambda: (b.path / "many" / str(many - 1)).exists(), 15)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, many + 1024),
                                                    max(hard, many + 1024)))
        held = [os.open(b.path / "many" / str(i), os.O_RDONLY) for i in range(many)]
        try:
            (a.path / "past.bin").unlink()
            time.sleep(2 * full + 1)
            assert whole(fd, len(data)) == data
        finally:
            for h in held:
                os.close(h)
            os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert eventually(lambda: gone(past, mine), 15)
        # b dies holding one: the writer reclaims it once b's lease is gone a while.
        fd, last = open_on_b("last.bin")
        (a.path / "last.bin").unlink()
        time.sleep(2)
        assert _chunk(mine[0], last).exists() or _chunk(mine[1], last).exists()
        os.kill(b.daemon_pid(), signal.SIGKILL)
        assert eventually(lambda: gone(last, mine), 40)
        with pytest.raises(OSError):
            os.pread(fd, 10, 0)
        with contextlib.suppress(OSError):  # (b's mount is gone with its daemon)
            os.close(fd)


def _in_store(url: str, ino: int) -> bool:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT 1 FROM inodes WHERE ino = %s", (ino,)).fetchone() \
            is not None


TAGGING_FOR = r"""
import errno, json, os, sys, threading, time
dirs, seconds = sys.argv[1:3], float(sys.argv[3])
ok, busy, lock = {d: 0 for d in dirs}, [0], threading.Lock()
def tag(root, t):
    path = os.path.join(root, f"t{t}")
    while time.monotonic() < until:
        try:
            os.setxattr(path, "user.tag", b"x" * 64000)
            with lock: ok[root] += 1
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            with lock: busy[0] += 1
            time.sleep(0.001)  # (refused at once: not a spin on the daemons' threads)
failed = []
def run(root, t):
    try:
        tag(root, t)
    except BaseException as e:
        failed.append(repr(e))
ts = [threading.Thread(target=run, args=(d, t)) for d in dirs for t in range(4)]
start = time.monotonic()
until = start + seconds
for t in ts: t.start()
for t in ts: t.join()
print(json.dumps({"ok": list(ok.values()), "busy": busy[0], "s": time.monotonic() - start,
                  "failed": failed}))
"""


def test_a_tenants_xattrs_through_two_nodes_are_paced_as_through_one(
        tmp_path: Path, pg_cluster: Any) -> None:
    """Each daemon paces its own mount's callers' xattr bytes (`fs/xattr_pace.py`); a
    tenant setting them through the writer's mount and a reading node's at once got
    each node's rate at the store, twice one tenant's (N nodes: N times).  The writer
    paces what nodes forward in the same buckets as its own mount's: what she set in
    all is within one burst and one rate over the time she took."""
    from mxfs.fs.xattr_pace import XATTR_BURST, XATTR_PER_S

    url = pg_cluster.database()
    alice = ensure_users()["alice"]
    with _writer_node(tmp_path, url) as (net, a, members), \
            _reading_node(tmp_path, url, net, members) as b:
        mine = a.path / "alice"
        mine.mkdir()
        os.chown(mine, alice.uid, alice.gid)
        assert eventually(lambda: (b.path / "alice").exists(), 10)
        for d in ("a", "b"):  # (her files: a reading node makes none)
            (mine / d).mkdir()
            for t in range(4):
                (mine / d / f"t{t}").touch()
                os.chown(mine / d / f"t{t}", alice.uid, alice.gid)
        seen = [b.path / "alice" / "b" / f"t{t}" for t in range(4)]  # (hers there too)
        assert eventually(lambda: all(p.exists() and p.stat().st_uid == alice.uid
                                      for p in seen), 10)
        got = run_as(alice, TAGGING_FOR, str(mine / "a"), str(b.path / "alice" / "b"), "2")
        took = sum(got["ok"]) * 64008  # (a value and its name)
        allowed = XATTR_BURST + XATTR_PER_S * got["s"] + 8 * 64008  # (8 in flight)
        # (each node's calls got through: the reading node's are forwarded and paced)
        assert not got["failed"] and min(got["ok"]) > 0 and took <= allowed, got

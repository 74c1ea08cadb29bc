"""The chunk service (issue 27: a node reads other nodes' member ranges through them).

Through a real mount serving chunks on a real TCP port: every stripe of a file read
through the service is the file's bytes; a client without the pool's key learns
nothing and is told so, a peer that fails its proof is dropped, and neither stops the
service; bad requests get their errno and the connection goes on; the key is root's
alone and a key file others may read is refused at mount.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from conftest import (
    HAVE_FUSE,
    Mounted,
    eventually,
    make_members,
    mkfs,
    module_pool,
    mount_with,
    mounted_pool,
    mxfs,
    one_line_error,
)

from mxfs.client import ControlClient
from mxfs.io import Layout
from mxfs.io.chunk_client import Busy, ChunkClient
from mxfs.pool.key import KEY_NAME, load_key
from mxfs.proto.chunk_wire import (
    ANSWER,
    CHALLENGE,
    CHUNK_OP,
    HELLO,
    KEY_LEN,
    KEYS_BODY,
    KPUT_BODY,
    KREQ_BODY,
    MAGIC,
    MAX_KPUT_NAME,
    MAX_KREQ,
    MAX_READ,
    MAX_WRITE,
    NODE,
    PROOF,
    READ,
    VERSION,
    WireError,
)
from mxfs.proto.constants import MAX_KEY

pytestmark = [pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse"),
              pytest.mark.daemon_log(r"chunk handshake .* failed")]


def _service(m: Mounted) -> tuple[str, int, str]:
    with ControlClient(str(m.path)) as c:
        st = c.stat()
    svc = st["chunk_service"]
    assert svc is not None
    return svc["addr"], int(svc["port"]), st["pool_uuid"]


def _log_of(m: Mounted) -> str:
    """The daemon's log, beside its control socket."""
    with ControlClient(str(m.path)) as c:
        st = c.stat()
    return str(Path(st["socket"]).parent / f"{st['pool_uuid']}.log")


def _first_member(m: Mounted, name: str) -> tuple[int, int]:
    """A small file's inode and the member its one stripe is on."""
    with ControlClient(str(m.path)) as c:
        lay = c.layout(str(m.path / name))
    return lay["ino"], lay["layout"]["first_member"]


def _reserved_port_connection(src: str, port: int) -> socket.socket:
    """A connection to the service from `src` and a port below 1024 (root's, as a
    node's daemon connects), the first free one."""
    for local in range(600, 1024):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((src, local))
            s.settimeout(10)
            s.connect(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
    raise AssertionError("no reserved port free")


def _dropped(s: socket.socket) -> bool:
    """Whether the service closed the connection (a reset: it left bytes unread)."""
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True
    finally:
        s.close()


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """One pool serving chunks for the module's tests (each writes files of its own)."""
    with module_pool(tmp_path_factory, "chunk_port=0") as m:
        yield m


def test_every_stripe_read_through_the_service_is_the_files_bytes(serving: Mounted) -> None:
    data = os.urandom(3 * 1024 * 1024 + 12_345)  # stripes on every member, a short tail
    (serving.path / "model.bin").write_bytes(data)
    host, port, pool = _service(serving)
    key = load_key(serving.members[0])
    with ControlClient(str(serving.path)) as c:
        lay = c.layout(str(serving.path / "model.bin"))
    layout = Layout.from_description(lay["layout"])
    got = bytearray(len(data))
    with ChunkClient(host, port, key, pool) as chunks:
        for piece in layout.plan(0, len(data)):
            part = chunks.read(lay["ino"], piece.member, piece.chunk_offset, piece.length)
            view = memoryview(part)
            for o, n in piece.spans:
                got[o:o + n] = view[:n]
                view = view[n:]
        assert chunks.read(lay["ino"], 0, 1 << 40, 4096) == b""  # past the end: nothing
        # Each member's whole chunk file at once, every stripe unit received in place.
        placed = memoryview(bytearray(len(data)))
        for m in layout.used_members():
            views, c_off, end = [], 0, layout.chunk_length(m, len(data))
            while c_off < end:
                k = min(layout.unit - c_off % layout.unit, end - c_off)
                views.append(placed[layout.file_offset(m, c_off):][:k])
                c_off += k
            assert chunks.read_scatter(lay["ino"], m, 0, views) == end
        assert bytes(placed) == data
    assert bytes(got) == data
    with ControlClient(str(serving.path)) as c:
        assert c.stat()["chunk_service"]["served_bytes"] >= len(data)  # type: ignore[index]


def test_a_host_without_the_key_gets_nothing_and_the_service_goes_on(serving: Mounted) -> None:
    (serving.path / "f").write_bytes(b"secret" * 1000)
    host, port, pool = _service(serving)
    with pytest.raises(WireError, match="does not hold this pool's key"):
        ChunkClient(host, port, os.urandom(32), pool)  # the server's proof fails here
    # A peer that fakes its half: the challenge is answered, the bad proof dropped.
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(HELLO.pack(MAGIC, VERSION, uuid.UUID(pool).bytes, os.urandom(16)))
    assert len(s.recv(CHALLENGE.size, socket.MSG_WAITALL)) == CHALLENGE.size
    s.sendall(PROOF.pack(os.urandom(32)))
    assert _dropped(s)  # nothing accepted
    with pytest.raises(WireError, match="another pool|closed"):  # right key, other pool
        ChunkClient(host, port, load_key(serving.members[0]), str(uuid.uuid4()))
    garbage = socket.create_connection((host, port), timeout=10)
    garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100)
    assert _dropped(garbage)
    ino, first = _first_member(serving, "f")
    with ChunkClient(host, port, load_key(serving.members[0]), pool) as chunks:
        assert chunks.read(ino, first, 0, 6) == b"secret"


def test_bad_requests_get_their_errno_and_the_connection_goes_on(serving: Mounted) -> None:
    (serving.path / "d").mkdir()
    (serving.path / "g").write_bytes(b"y" * 100)
    host, port, pool = _service(serving)
    (ino, first), d = _first_member(serving, "g"), os.stat(serving.path / "d").st_ino
    with ChunkClient(host, port, load_key(serving.members[0]), pool) as chunks:
        for args, code in (((ino, 9, 0, 10), errno.EINVAL),       # not a member
                           ((999_999, 0, 0, 10), errno.ENOENT),   # no such inode
                           ((d, 0, 0, 10), errno.EINVAL)):        # a directory
            with pytest.raises(OSError) as e:
                chunks.read(*args)
            assert e.value.errno == code, args
        with pytest.raises(ValueError):
            chunks.read(ino, 0, 0, MAX_READ + 1)
        assert chunks.read(ino, first, 0, 100) == b"y" * 100
        assert chunks.read(ino, (first + 1) % 4, 0, 100) == b""  # a chunk file never written


@pytest.mark.daemon_log(r"chunk request for the daemon failed")
def test_nobody_changes_the_writers_chunk_files_through_its_service(serving: Mounted
                                                                     ) -> None:
    """WRIT, SYNC, TRUN and REMV are the writer's requests to nodes holding members;
    the writer's own service refuses them (EPERM, even under its own epoch) and the
    connection goes on; a scoped connection that tries loses it, as does a write past
    the protocol's limit.  (Nodes' services doing them: test_nodes.)"""
    host, port, pool = _service(serving)
    key = load_key(serving.members[0])
    (serving.path / "kept").write_bytes(b"k" * 100)
    ino, first = _first_member(serving, "kept")
    path = Path(serving.members[first], "chunks", f"{ino % 256:02x}", str(ino))
    with ChunkClient(host, port, key, pool) as node:
        epoch = node.epoch
        for tag in (b"WRIT", b"SYNC", b"TRUN", b"REMV"):
            with pytest.raises(OSError) as e:
                node.change(tag, epoch, ino, first, 0,
                            [memoryview(b"evil")] if tag == b"WRIT" else None)
            assert e.value.errno == errno.EPERM, tag
        assert node.read(ino, first, 0, 100) == b"k" * 100
        with pytest.raises(ValueError):
            node.change(b"REMV", epoch, ino, first, 0, [memoryview(b"x")])
    assert path.read_bytes() == b"k" * 100
    # Past the limit: the connection goes.
    raw = ChunkClient(host, port, key, pool)
    raw.sock.sendall(b"WRIT" + CHUNK_OP.pack(epoch, ino, first, 0, MAX_WRITE + 1))
    assert _dropped(raw.sock)
    # A scoped connection (a local reader's) reads, nothing else.
    scoped = ChunkClient(host, port, key, pool)
    scoped.scope([(ino, 0)])
    with pytest.raises((OSError, WireError)):
        scoped.change(b"WRIT", epoch, ino, first, 0, [memoryview(b"evil")])
    assert (serving.path / "kept").read_bytes() == b"k" * 100


def test_a_scoped_reader_reads_no_more_once_a_chmod_chown_or_write_changes_the_file(
        serving: Mounted) -> None:
    """A reading node's reader holds connections scoped to a file's generation, which
    its owner appends to through an open made before: a chmod that adds bits leaves
    them reading; one that clears a read bit, a chown, and a write through that open
    end them (ESTALE), so the reader gets none of the bytes written after (they read
    every new byte for up to SCOPE_S before)."""
    host, port, pool = _service(serving)
    key = load_key(serving.members[0])
    path = serving.path / "appended"
    path.write_bytes(b"a" * 100)
    os.chmod(path, 0o644)
    with ControlClient(str(serving.path)) as c:
        lay = c.layout(str(path))
    ino, first = lay["ino"], lay["layout"]["first_member"]
    changes: list[Callable[[BinaryIO], object]] = [
        lambda _: os.chmod(path, 0o600), lambda _: os.chown(path, 4242, -1),
        lambda appending: appending.write(b"w")]
    for change in changes:
        with path.open("ab", buffering=0) as appending, \
                ChunkClient(host, port, key, pool) as scoped:
            appending.write(b"a")  # (the open's first write: a new generation)
            appending.write(b"b")
            os.fsync(appending.fileno())  # (answered is not landed: write-behind)
            with ControlClient(str(serving.path)) as c:
                generation = c.layout(str(path))["generation"]
            scoped.scope([(ino, generation)], 1000)
            os.chmod(path, 0o666)  # (adds bits: takes nothing away)
            assert scoped.read(ino, first, 0, 200) == b"a" * 101 + b"b"
            change(appending)
            os.fsync(appending.fileno())
            with pytest.raises(OSError) as e:
                scoped.read(ino, first, 0, 300)
            assert e.value.errno == errno.ESTALE
        path.write_bytes(b"a" * 100)
        os.chmod(path, 0o644)


@pytest.mark.daemon_log(r"chunk request for the daemon failed")
def test_bad_kv_requests_of_a_node_get_their_errno_or_lose_their_connection(
        serving: Mounted) -> None:
    """A node's KV puts, claims, waits, pins and index requests with bad fields are
    answered with their errno (the connection goes on); past the protocol's limits the
    connection ends; the service serves on either way."""
    host, port, pool = _service(serving)
    key = load_key(serving.members[0])
    root = (0, 0, [])
    with ChunkClient(host, port, key, pool) as c:
        for what, call, code in (
                ("a bad namespace", lambda: c.kv_put(root, "no/such name", 0, False, b"k",
                                                     b"v"), errno.EINVAL),
                ("an empty key", lambda: c.kv_put(root, "kvbad", 0, False, b"", b"v"),
                 errno.EINVAL),
                ("a key too long", lambda: c.kv_put(root, "kvbad", 0, False,
                                                    b"k" * (MAX_KEY + 1), b"v"), errno.EINVAL),
                ("a claim of an empty key", lambda: c.kv_keys(b"KCLM", root, "kvbad", 0,
                                                              [b""], 1000, bytes(16)),
                 errno.EINVAL),
                ("a wait in no namespace", lambda: c.kv_keys(b"KWAI", root, "kvnone", 0,
                                                             [b"k"], 10, bytes(16)),
                 errno.ENOENT),
                ("an op not asked of another node", lambda: c.kv_request(root, "kv_put",
                                                                         {}), errno.EPERM),
                ("a request's bad field", lambda: c.kv_request(
                    root, "kv_delete", {"namespace": "kvbad", "keys": "k"}), errno.EINVAL),
                ("a pin in no namespace", lambda: c.kv_keys(b"KPIN", root, "kvnone", 0,
                                                            [b"k"], 0, bytes(16), ("n", 1)),
                 errno.ENOENT)):
            with pytest.raises(OSError) as e:
                call()
            assert e.value.errno == code, what
        assert c.kv_put(root, "kvbad", 0, False, b"k" * 32, b"v" * 10) is True
        assert c.kv_put(root, "kvbad", 0, False, b"k" * 32, b"v" * 10) is False
        assert c.kv_keys(b"KCLM", root, "kvbad", 0, [b"k" * 32, b"j" * 32], 1000,
                         bytes(16)) == bytes([1, 0])  # stored, yours
        assert c.kv_keys(b"KPIN", root, "kvbad", 0, [b"j" * 32, b"k" * 32], 0, bytes(16),
                         ("n", 1)) == bytes([0, 1])  # (leased what is stored)
        assert c.kv_keys(b"KUNP", root, "kvbad", 0, [b"k" * 32], 0, bytes(16),
                         ("n", 1)) == bytes([1])
        stats = c.kv_request(root, "kv_stats", {"namespace": "kvbad"})["namespaces"]
        assert stats[0]["chunks"] == 1 and stats[0]["pinned"] == 0
    with ChunkClient(host, port, key, pool) as c:  # past the limits: the connection ends
        c.sock.sendall(b"KPUT" + KPUT_BODY.pack(0, 0, 0, 0, 0, MAX_KPUT_NAME + 1, 1, 1))
        assert _dropped(c.sock)
    with ChunkClient(host, port, key, pool) as c:
        c.sock.sendall(b"KCLM" + KEYS_BODY.pack(0, 0, 0, 0, 5, 60_000, 10, bytes(16)))
        assert _dropped(c.sock)
    with ChunkClient(host, port, key, pool) as c:  # a node name past its limit
        c.sock.sendall(b"KPIN" + KEYS_BODY.pack(0, 0, 0, 0, 5, 1, 0, bytes(16)) + b"kvbad"
                       + KEY_LEN.pack(1) + b"k" + NODE.pack(1, 200) + b"n" * 200)
        assert _dropped(c.sock)
    with ChunkClient(host, port, key, pool) as c:  # a request past its limit
        c.sock.sendall(b"KREQ" + KREQ_BODY.pack(0, 0, 0, 8, MAX_KREQ + 1) + b"kv_stats")
        assert _dropped(c.sock)
    with ChunkClient(host, port, key, pool) as c:  # not JSON: refused, the connection goes on
        c.sock.sendall(b"KREQ" + KREQ_BODY.pack(0, 0, 0, 8, 3) + b"kv_stats" + b"{{{")
        code, _, n = ANSWER.unpack(c.sock.recv(ANSWER.size, socket.MSG_WAITALL))
        assert code == errno.EINVAL and b"JSON" in c.sock.recv(n, socket.MSG_WAITALL)
        assert c.kv_put(root, "kvbad", 0, False, b"m" * 32, b"w" * 10) is True


def test_a_writer_mounted_for_its_user_alone_serves_other_nodes_that_user_alone(
        tmp_path: Path) -> None:
    """A writer mounted without allow_other answers only its mounting uid on its control
    socket, and so only that uid's requests a node makes for its users: another uid's
    put, pin and request are refused (EACCES), the mounting uid's served."""
    members = make_members(tmp_path)
    mkfs(members)
    with mount_with(members, "chunk_port=0", allow_other=False) as m:
        host, port, pool = _service(m)
        key = load_key(m.members[0])
        alice = (1000, 1000, [])
        with ChunkClient(host, port, key, pool) as c:
            for what, call in (
                    ("a put", lambda: c.kv_put(alice, "alone", 0, False, b"k", b"v")),
                    ("a pin", lambda: c.kv_keys(b"KPIN", alice, "alone", 0, [b"k"], 0,
                                                bytes(16), ("n", 1))),
                    ("a request", lambda: c.kv_request(alice, "kv_stats", {}))):
                with pytest.raises(OSError) as e:
                    call()
                assert e.value.errno == errno.EACCES and "allow_other" in str(e.value), what
            assert c.kv_put((0, 0, []), "alone", 0, False, b"k", b"v") is True
            assert c.kv_request((0, 0, []), "kv_stats", {"namespace": "alone"}
                                )["namespaces"][0]["chunks"] == 1


def test_the_key_is_roots_alone_and_a_loose_one_is_refused(tmp_path: Path) -> None:
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "chunk_port=0"):
        pass
    path = Path(members[0], KEY_NAME)
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_bytes()) == 32
    key = path.read_bytes()
    with mounted_pool(members, "chunk_port=0"):  # the same key next time
        assert path.read_bytes() == key
    path.chmod(0o644)
    mp = tmp_path / "mnt"
    mp.mkdir()
    line = one_line_error(mxfs("mount", "-o", "chunk_port=0", members[0], str(mp), check=False))
    assert KEY_NAME in line and "chmod 600" in line


@pytest.mark.daemon_log(r"chunk connection .* failed")
def test_silent_connections_hold_their_own_addresss_slots_and_a_stalled_reader_only_itself(
        serving: Mounted) -> None:
    """A host that opens connections and never proves the key fills its address's
    handshake slots (max_chunk_handshakes_per_peer, 8) and no more: its next connection is
    closed at once and counted, from any loopback address (a local user reaches all of
    127.0.0.0/8: they count as one), while a node connected before goes on reading.  A
    peer that asks for a large range and never reads it holds one sender, not the
    service."""
    data = os.urandom(64 << 20)  # 16 MiB on each member: more than the sockets buffer
    (serving.path / "big").write_bytes(data)
    host, port, pool = _service(serving)
    key = load_key(serving.members[0])
    with ControlClient(str(serving.path)) as c:
        lay = c.layout(str(serving.path / "big"))
    ino, first = lay["ino"], lay["layout"]["first_member"]

    def chunk_stat() -> dict:
        with ControlClient(str(serving.path)) as c:
            return c.stat()["chunk_service"]  # type: ignore[return-value]

    refused = chunk_stat()["refused"]
    node = ChunkClient(host, port, key, pool, source="127.0.0.3")  # proved before
    silent = [socket.create_connection((host, port), timeout=10, source_address=("127.0.0.1", 0))
              for _ in range(8)]
    try:
        for _ in range(100):  # the service has accepted all eight
            if chunk_stat()["connections"] >= 9:
                break
            time.sleep(0.05)
        assert node.read(ino, first, 0, 4096) == data[:4096]
        for source in ("127.0.0.1", "127.0.0.2", "127.1.2.3"):
            late = socket.create_connection((host, port), timeout=20,
                                            source_address=(source, 0))
            assert _dropped(late), source
        assert chunk_stat()["refused"] == refused + 3
        # A node's daemon (root: a reserved port) connecting now is not among them.
        with ChunkClient(host, port, key, pool) as new:
            assert new.read(ino, first, 0, 4096) == data[:4096]
            assert new.sock.getsockname()[1] < 1024
    finally:
        node.close()
        for s in silent:
            s.close()
    # A reader that stops reading a 16 MiB answer; another is served meanwhile.
    stalled = ChunkClient(host, port, key, pool)
    try:
        stalled.sock.sendall(READ.pack(b"READ", ino, first, 0, 16 << 20))
        with ChunkClient(host, port, key, pool) as other:
            assert other.read(ino, first, 4096, 4096) == data[4096:8192]
    finally:
        stalled.close()
    for _ in range(100):  # the service saw them all go
        if chunk_stat()["connections"] == 0:
            break
        time.sleep(0.05)
    with ChunkClient(host, port, key, pool, source="127.0.0.1") as again:  # slots freed
        assert again.read(ino, first, 0, 10) == data[:10]


READ_AS_NODE = r"""
import hashlib, json, sys
from mxfs.io.chunk_client import ChunkClient
host, port, key_path, pool, ino, member, length, timeout = sys.argv[1:9]
key = open(key_path, "rb").read() if key_path != "-" else b"k" * 32
try:
    with ChunkClient(host, int(port), key, pool, timeout=float(timeout)) as c:
        data = c.read(int(ino), int(member), 0, int(length))
    print(json.dumps({"sha": hashlib.sha256(data).hexdigest(), "n": len(data)}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "why": str(e)}))
"""


@pytest.mark.nodes
def test_a_node_in_its_own_network_reads_through_the_service_and_a_cut_link_fails_it(
        tmp_path: Path) -> None:
    """Node B, a process in a network namespace of its own joined by a veth pair, reads a
    stripe over that link with the pool key; a host of that network without the key
    reads nothing; with the link cut B's read fails within its timeout, and once healed
    it reads again."""
    import hashlib
    import json
    import sys

    from conftest import node_net

    members = make_members(tmp_path)
    mkfs(members)
    with node_net() as net, mounted_pool(members, "chunk_port=0",
                                         f"chunk_addr={net.host_ip}") as m:
        data = os.urandom(50_000)
        (m.path / "f").write_bytes(data)
        ino, first = _first_member(m, "f")
        _, port, pool = _service(m)
        key_file = str(Path(members[0], KEY_NAME))

        def as_node(key: str, timeout: str = "10") -> dict:
            res = net.run(sys.executable, "-c", READ_AS_NODE, net.host_ip, str(port), key,
                          pool, str(ino), str(first), str(len(data)), timeout)
            assert res.returncode == 0, res.stderr
            return json.loads(res.stdout)

        assert as_node(key_file) == {"sha": hashlib.sha256(data).hexdigest(), "n": len(data)}
        assert as_node("-")["error"] == "WireError"  # no key: nothing
        net.cut()
        try:
            assert as_node(key_file, timeout="2")["error"] in ("TimeoutError", "OSError")
        finally:
            net.cut(down=False)
        healed = as_node(key_file)
        assert healed.get("n") == len(data), healed


@contextlib.contextmanager
def _beside_a_node(tmp_path: Path, option: str) -> Iterator[tuple[Any, Mounted, tuple[
        list[str], bytes, int, int, int, str]]]:
    """A pool serving chunks on every address, with `option`, and a node's network
    beside it: (the network, the mount, (members, a small file's bytes, its inode, its
    member, the service's port, the pool's uuid))."""
    from conftest import node_net

    members = make_members(tmp_path)
    mkfs(members)
    with node_net() as net, mounted_pool(members, "chunk_port=0", "chunk_addr=0.0.0.0",
                                         option) as m:
        data = os.urandom(50_000)
        (m.path / "f").write_bytes(data)
        ino, first = _first_member(m, "f")
        _, port, pool = _service(m)
        yield net, m, (members, data, ino, first, port, pool)


@pytest.mark.nodes
@pytest.mark.daemon_log(r"chunk connection .* failed")
def test_unproved_connections_of_every_address_together_stay_under_their_cap(
        tmp_path: Path) -> None:
    """Connections that have not proved the key are capped in all
    (max_chunk_handshakes), whatever addresses they come from; those from ports any
    user may bind to half of it: past the cap a new one is closed at once, while a node
    that proved the key before goes on reading, and a node's daemon connecting now
    (root, from a reserved port) is let in and proves it."""
    with _beside_a_node(tmp_path, "max_chunk_handshakes=20") as (net, m, served):
        members, data, ino, first, port, pool = served
        node = ChunkClient("127.0.0.1", port, load_key(members[0]), pool)
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10,
                                           source_address=(src, 0))
                  for src in ["127.0.0.1"] * 8 + [net.host_ip] * 2]
        try:
            with ControlClient(str(m.path)) as c:
                assert eventually(lambda: c.stat()["chunk_service"]["connections"] >= 11)
            late = socket.create_connection(("127.0.0.1", port), timeout=20,
                                            source_address=(net.host_ip, 0))
            assert _dropped(late)  # its address has 2 of its 8: the cap in all said no
            assert node.read(ino, first, 0, len(data)) == data
            with ChunkClient("127.0.0.1", port, load_key(members[0]), pool) as new:
                assert new.read(ino, first, 0, len(data)) == data
        finally:
            node.close()
            for s in silent:
                s.close()
        assert "max_chunk_handshakes)" in Path(_log_of(m)).read_text()


@pytest.mark.nodes
@pytest.mark.daemon_log(r"chunk connection .* failed")
def test_silent_hosts_holding_every_handshake_slot_keep_no_node_out(tmp_path: Path) -> None:
    """Hosts without the key (root there: reserved ports) that hold every handshake
    slot in silence kept every node from connecting (each newcomer was refused for
    as long as they held them).  Past the cap the oldest silent one goes: a node
    connecting now proves the key and reads."""
    with _beside_a_node(tmp_path, "max_chunk_handshakes=12") as (net, m, served):
        members, data, ino, first, port, pool = served
        silent = [_reserved_port_connection(src, port)
                  for src in ["127.0.0.1"] * 6 + [net.host_ip] * 6]
        try:
            with ControlClient(str(m.path)) as c:
                assert eventually(lambda: c.stat()["chunk_service"]["connections"] >= 12)
            with ChunkClient("127.0.0.1", port, load_key(members[0]), pool) as node:
                assert node.read(ino, first, 0, len(data)) == data
            assert _dropped(silent[0])  # (the oldest silent one made room)
        finally:
            for s in silent:
                s.close()
        assert "the oldest closed" in Path(_log_of(m)).read_text()


@pytest.mark.nodes
@pytest.mark.daemon_log(r"chunk connection .* failed")
def test_one_address_holds_a_share_of_the_connections_proved_or_not(tmp_path: Path) -> None:
    """A peer that proved the key (a node: it holds it) still has at most
    max_chunk_conns_per_peer connections: its next is closed at once, while another
    node's address is let in and reads."""
    with _beside_a_node(tmp_path, "max_chunk_conns_per_peer=4") as (net, m, served):
        members, data, ino, first, port, pool = served
        key = load_key(members[0])
        held = [ChunkClient("127.0.0.1", port, key, pool) for _ in range(4)]
        try:
            with pytest.raises((OSError, WireError)):
                ChunkClient("127.0.0.1", port, key, pool, timeout=10)
            with ChunkClient("127.0.0.1", port, key, pool, source=net.host_ip) as other:
                assert other.read(ino, first, 0, len(data)) == data
            assert held[0].read(ino, first, 0, len(data)) == data
        finally:
            for c in held:
                c.close()

        def again() -> bool:  # (room once the service has seen them go)
            try:
                with ChunkClient("127.0.0.1", port, key, pool) as c:
                    return c.read(ino, first, 0, 100) == data[:100]
            except (OSError, WireError):
                return False
        assert eventually(again, 10)
        assert "max_chunk_conns_per_peer)" in Path(_log_of(m)).read_text()


def test_one_users_scoped_connections_hold_a_part_of_the_service(tmp_path: Path) -> None:
    """Readers' scoped connections (a node's local users reading straight from the
    writer) hold a part of max_chunk_conns, and one user a part of that: one user's
    16 a node on 16 nodes took every connection.  Past her part a scope is refused
    (EMFILE: her node reads through its mount) and the connection closed; another
    user's is served, and so is a node's own unscoped connection."""
    with _one_file_served(tmp_path, 16) as (ino, connect):
        held = []
        try:
            for _ in range(3):  # (16 * 75% = 12 in all, a third of them hers: 3)
                c = connect()
                c.scope([(ino, 0)], 1000)
                held.append(c)
            late = connect()
            with pytest.raises(OSError) as e:
                late.scope([(ino, 0)], 1000)
            assert e.value.errno == errno.EMFILE
            late.close()
            other = connect()
            other.scope([(ino, 0)], 1001)  # (another user's part)
            held.append(other)
            with connect() as node:  # (a node's own, unscoped)
                assert node.kv_request((0, 0, []), "kv_stats", {})["namespaces"] == []
        finally:
            for c in held:
                c.close()
        assert eventually(lambda: _scopes(connect(), ino))  # (hers ended with them)


@pytest.mark.daemon_log(r"chunk connection .* failed")
def test_readers_filling_their_part_take_no_room_of_a_nodes_own_connections(
        tmp_path: Path) -> None:
    """Readers' scoped connections were counted in max_chunk_conns with the nodes' own:
    readers holding their part left the nodes a quarter, shared by all of them.  They
    are counted apart now: with their part full (a fourth scope refused), a node
    opens more connections of its own than the whole limit, and each is served."""
    with _one_file_served(tmp_path, 4) as (ino, connect):
        held = []
        try:
            for uid in (1000, 1001, 1002):  # (4 * 75% = 3 in all, one a user)
                c = connect()
                held.append(c)
                c.scope([(ino, 0)], uid)
            assert not _scopes(connect(), ino, 1003)  # (full)
            for _ in range(6):
                c = connect()
                held.append(c)
                assert c.kv_request((0, 0, []), "kv_stats", {})["namespaces"] == []
        finally:
            for c in held:
                c.close()


@pytest.mark.daemon_log(r"chunk connection .* failed")
def test_a_full_service_answers_busy_and_a_node_waits_for_room_not_marking_it_away(
        tmp_path: Path) -> None:
    """A connection past the service's room was closed unanswered: the node saw a
    broken handshake, held the writer unreachable, and failed every call that needed
    a connection (FUSE reads, KV puts) with EIO at once for 2 s.  Now it is told busy
    (EBUSY), and a node's call waits for room instead: served once a connection
    closes, and the next call served too."""
    from mxfs.pool.remote import Owner, RemoteMembers

    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "chunk_port=0", "max_chunk_conns=4",
                      "reserved_chunk_conns=2") as m:
        host, port, pool = _service(m)
        key = load_key(members[0])
        held = [ChunkClient(host, port, key, pool) for _ in range(4)]
        try:
            with pytest.raises(Busy) as busy:
                ChunkClient(host, port, key, pool)
            assert busy.value.errno == errno.EBUSY
            owner = Owner("writer", f"{host}:{port}", held[0].epoch, True)
            remote = RemoteMembers(key, pool, lambda: owner)
            remote.update(owner)
            with ControlClient(str(m.path)) as c:
                refused = c.stat()["chunk_service"]["refused"]  # type: ignore[index]
                call = remote.submit(remote.kv_request, (0, 0, []), "kv_stats", {})
                assert eventually(lambda: c.stat()["chunk_service"]["refused"] > refused
                                  or call.done())  # type: ignore[index]
            held.pop().close()  # (room: the waiting call gets it)
            assert call.result(timeout=30)["namespaces"] == []
            assert remote.kv_request((0, 0, []), "kv_stats", {})["namespaces"] == []
        finally:
            for c in held:
                c.close()


@contextlib.contextmanager
def _one_file_served(tmp_path: Path, max_conns: int
                     ) -> Iterator[tuple[int, Callable[[], ChunkClient]]]:
    """A pool whose chunk service takes `max_conns` connections, holding one file: its
    inode, and a way to open a node's connection to that service (the scope tests')."""
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "chunk_port=0", f"max_chunk_conns={max_conns}") as m:
        (m.path / "f").write_bytes(b"f" * 10_000)
        host, port, pool = _service(m)
        key = load_key(members[0])
        yield (m.path / "f").stat().st_ino, lambda: ChunkClient(host, port, key, pool)


def _scopes(c: ChunkClient, ino: int, uid: int = 1000) -> bool:
    """Whether `c` could be scoped for `uid` (closed either way)."""
    with c:
        try:
            c.scope([(ino, 0)], uid)
            return True
        except OSError:
            return False


OVER_RATE = r"chunk connections from .* come faster than"


@pytest.mark.daemon_log(OVER_RATE, r"chunk connection .* failed")
def test_one_address_opening_connections_fast_is_held_to_its_rate_and_a_node_goes_on(
        tmp_path: Path) -> None:
    """The handshake limits bound what an address holds, not how often it connects: a
    local user who opened and closed connections as fast as she could had each one
    accepted and its handshake started on the daemon's one thread.  Past
    max_chunk_accept_burst, then max_chunk_accepts_per_s, her address's connections
    are closed as they are accepted (counted as refused, logged once), while a node's
    daemon on the same host (a reserved port: a peer of its own) connects and reads,
    and her address is let in again as its rate allows."""
    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members, "chunk_port=0", "max_chunk_accept_burst=10",
                      "max_chunk_accepts_per_s=1") as m:
        (m.path / "f").write_bytes(b"z" * 5000)
        ino, first = _first_member(m, "f")
        host, port, pool = _service(m)
        with ControlClient(str(m.path)) as c:
            refused = c.stat()["chunk_service"]["refused"]  # type: ignore[index]
        started = time.monotonic()
        answered = sum(_challenged(host, port, pool) for _ in range(100))
        seconds = time.monotonic() - started  # (what the rate lets in meanwhile)
        assert answered <= 10 + int(seconds) + 1, (answered, seconds)
        with ChunkClient(host, port, load_key(members[0]), pool) as node:
            assert node.sock.getsockname()[1] < 1024
            assert node.read(ino, first, 0, 5000) == b"z" * 5000
        with ControlClient(str(m.path)) as c:
            st = c.stat()["chunk_service"]
        assert st["refused"] >= refused + 100 - answered  # type: ignore[index]
        assert eventually(lambda: _challenged(host, port, pool), 10)  # (a rate, not a ban)
        lines = [x for x in Path(_log_of(m)).read_text().splitlines()
                 if "come faster than" in x]
        assert len(lines) == 1 and "loopback (port >= 1024)" in lines[0], lines


def _challenged(host: str, port: int, pool: str) -> bool:
    """Whether a connection from an unreserved port got the service's challenge to its
    HELLO (not closed as accepted); closed after."""
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            s.sendall(HELLO.pack(MAGIC, VERSION, uuid.UUID(pool).bytes, os.urandom(16)))
            return len(s.recv(CHALLENGE.size, socket.MSG_WAITALL)) == CHALLENGE.size
        except OSError:  # (a reset: it was closed with the HELLO unread)
            return False


@pytest.mark.unit
def test_the_accept_rate_of_each_address_and_its_table_stay_bounded() -> None:
    """A token bucket an address (time given, not waited for): `burst` at once, then
    `per_s` a second; its refusals reported once a `report_s`, counted; and a scan
    from many addresses keeps `peers` buckets at most, a quiet one dropped."""
    from mxfs.fs.accept_rate import AcceptRate

    rate = AcceptRate(burst=3, per_s=2, peers=100, report_s=60)
    assert [rate.take("a", 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert rate.take("b", 0.0)  # (another address: a bucket of its own)
    assert rate.due("a", 0.0) == 2 and rate.due("a", 1.0) == 0  # (once a minute)
    assert [rate.take("a", 1.0) for _ in range(3)] == [True, True, False]  # 2 a second
    assert rate.due("a", 30.0) == 0 and rate.due("a", 61.0) == 1
    for i in range(10_000):
        rate.take(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", 100.0)
        assert len(rate) <= 100
    assert rate.take("c", 1000.0) and len(rate) == 1  # (the others quiet long: full again)
    # `wait`: tokens taken into debt, the seconds to wait told (a tenant's xattr bytes)
    assert rate.wait("d", 3, 0.0) == 0 and rate.wait("d", 4, 0.0) == 2.0
    assert rate.wait("d", 1, 1.0) == 1.5  # (1 s paid 2 of the debt of 4, 1 more taken)
    assert rate.wait("d", -1, 1.0) == 1.0  # (a refusal gives its tokens back)
    assert rate.wait("d", 1, 10.0) == 0  # (full again: the burst, at most)


def test_peers_are_counted_by_address_loopback_as_one_and_ipv6_by_its_64() -> None:
    """Handshake slots are counted by peer: every loopback address is one (any local
    user may use them all), an IPv6 address is its /64 (a host holds a whole /64 as a
    rule: one address each gave it unbounded slots), unreserved ports apart."""
    import ipaddress

    from mxfs.fs.chunk_service import UNRESERVED, peer_of

    a = ipaddress.ip_address
    assert peer_of(a("127.0.0.2"), 700) == peer_of(a("::1"), 700) == "loopback"
    assert peer_of(a("::ffff:10.0.0.5"), 700) == peer_of(a("10.0.0.5"), 700) == "10.0.0.5"
    assert peer_of(a("2001:db8::1"), 700) == peer_of(a("2001:db8::ffff:1"), 700) \
        == "2001:db8::/64"
    assert peer_of(a("2001:db8:0:1::1"), 700) != peer_of(a("2001:db8::1"), 700)
    assert peer_of(a("10.0.0.5"), 40000) == "10.0.0.5" + UNRESERVED


def test_a_users_busy_turns_hold_no_aborts_of_her_nodes(serving: Mounted,
                                                         tmp_path: Path) -> None:
    """alice's turns at the writer are all held by KV waits from her nodes (those past
    the ones that wait out of her turns).  An
    abort a node sends for her only frees her own file there: answered at once, not in
    her turn; a node sends each user's aborts apart from her slots there, so bob's do
    not queue behind hers (his dropped file's size stayed reserved meanwhile).  And a
    forwarded request the writer left unanswered past the timeout ends its own
    connection, not the node's others (each then paid a new handshake)."""
    from concurrent.futures import ThreadPoolExecutor

    import trio
    import trio.testing

    from mxfs.fs.fair import Turns
    from mxfs.fs.node_files import ForwardedFiles
    from mxfs.pool.remote import Owner, RemoteMembers
    from mxfs.proto.chunk_wire import KPUT_SHARED
    from mxfs.vol.access import Caller
    from mxfs.vol.volume import Volume

    host, port, pool = _service(serving)
    key = load_key(serving.members[0])
    root, alice, bob = (0, 0, []), (1000, 1000, []), (1001, 1001, [])
    with ChunkClient(host, port, key, pool) as c:
        c.kv_put(root, "abortq", 0o777, True, b"x", b"v")
        # (root computes "y": others' waits for it last until it is put)
        assert c.kv_keys(b"KCLM", root, "abortq", KPUT_SHARED, [b"y"], 60_000,
                         b"r" * 16) == bytes([0])
        epoch = c.epoch

    connected = threading.Semaphore(0)

    def wait(who: tuple[int, int, list[int]]) -> bytes:
        with ChunkClient(host, port, key, pool, timeout=90) as c:
            connected.release()
            return c.kv_keys(b"KWAI", who, "abortq", KPUT_SHARED, [b"y"], 60_000, bytes(16))

    def turns_full() -> bool:  # (a request of hers gets no turn: all 8 are waiting)
        with ChunkClient(host, port, key, pool, timeout=1) as c:
            try:
                c.kv_request(alice, "kv_stats", {"namespace": "abortq"})
            except BlockingIOError:
                return True
            return False

    members = make_members(tmp_path, 2)
    mkfs(members)
    vol = Volume.open(members[0])
    # Her first `aside_per_user` waits wait out of her turns (`Turns.aside`): the 8
    # after them hold all 8.
    many = Turns(8).aside_per_user + 8
    with ThreadPoolExecutor(many) as waits:
        waiting = []
        try:
            for _ in range(many // 8):  # (8 past the key proof before the next 8: the
                # service takes max_chunk_handshakes_per_peer, 8, from one address at
                # once, and closes more)
                waiting += [waits.submit(wait, alice) for _ in range(8)]
                assert all(connected.acquire(timeout=60) for _ in range(8))
            assert eventually(turns_full)
            with ChunkClient(host, port, key, pool, timeout=15) as c:
                with pytest.raises(OSError) as e:  # (no node "b" alive: refused, at once)
                    c.kv_request(alice, "node_abort", {"ino": 5, "node": ["b", 1]})
                assert e.value.errno == errno.ESTALE

            # A node's aborts of both users while alice's slots there are all busy.
            def owner() -> Owner:
                return Owner("a", f"{host}:{port}", epoch, True)
            remote = RemoteMembers(key, pool, owner, timeout=15)
            vol.pool.node, vol.pool.remote = "b", remote
            files = ForwardedFiles(vol)
            files.abort_later(Caller(1, 1000, 1000, frozenset({1000})), ino=5)
            files.abort_later(Caller(1, 1001, 1001, frozenset({1001})), ino=6)

            async def main() -> None:
                freed = trio.Event()

                async def busy() -> None:
                    async with files._asks.slot(1000):
                        await freed.wait()
                async with trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(busy)
                    await trio.testing.wait_all_tasks_blocked()
                    with trio.move_on_after(20):  # (a bound, not a timing)
                        await files.send_aborts()
                    freed.set()
            trio.run(main)
            assert not files._aborts, "aborts waited for alice's turns"

            remote.close()
            short = RemoteMembers(key, pool, owner, timeout=2)  # (the aborts' had room)
            short.top_up(2)
            kept = len(short._idle)
            with pytest.raises(OSError) as e:  # (bob's wait, past the 2 s timeout)
                short.kv_keys(b"KWAI", bob, "abortq", KPUT_SHARED, [b"y"], 10_000,
                              bytes(16))
            assert e.value.errno == errno.EIO
            assert kept and len(short._idle) == kept - 1, \
                "the node's other connections were closed"
            short.close()
        finally:
            with ChunkClient(host, port, key, pool) as c:  # (the waits end)
                c.kv_put(root, "abortq", 0o777, True, b"y", b"w")
            vol.store.close()
        assert [w.result() for w in waiting] == [bytes([1])] * many


def test_a_call_on_an_owner_that_stops_answering_ends_when_it_is_found_dead() -> None:
    """A stopped owner's kernel still takes connections and requests: a call proving a
    connection to it (or waiting on a request) waited the whole receive timeout after
    the lease keeper had found the owner dead.  Now the keeper's view ends it then,
    with the lease's line; a view read before the one held changes nothing."""
    import socket

    from mxfs.pool.remote import Owner, RemoteMembers

    with socket.socket() as stopped:  # (listening, never answering: a stopped owner)
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(16)
        addr = f"127.0.0.1:{stopped.getsockname()[1]}"
        alive, dead = Owner("a", addr, 1, True), Owner("a", addr, 1, False)
        view = [alive]
        remote = RemoteMembers(b"k" * 32, "12345678-1234-1234-1234-123456789abc",
                               lambda: view[0], timeout=60)
        remote.update(alive, read_at=time.monotonic())
        ended: dict[str, OSError] = {}

        def call() -> None:
            try:
                remote.read_bytes(1, 0, 0, 10)
            except OSError as e:
                ended["call"] = e

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)  # (its proof sent, waiting on the owner)
        remote.update(dead, read_at=time.monotonic() - 10)  # (an older read: ignored)
        caller.join(1)
        assert caller.is_alive()
        view[0] = dead
        remote.update(dead, read_at=time.monotonic())
        caller.join(30)  # (its receive timeout is 60 s)
        assert not caller.is_alive(), "the call outlived the owner's lease"
        assert ended["call"].errno == errno.EIO
        assert "node a is dead" in str(ended["call"]), ended

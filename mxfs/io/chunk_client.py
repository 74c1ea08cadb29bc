"""A client of another node's chunk service (`fs/chunk_service.py`): ranges of the chunk
files on its members, read over TCP after both sides proved the pool key.

One connection, one request at a time (a reader wanting parallel reads opens one a
member).  Every answer carries the serving node's epoch; an answer under another epoch
than the connection began with means the node lost the pool and joined again since,
and its bytes are refused (`StaleNode`).  A connection a reading node's daemon proved
and scoped to one file (`scope`) is handed to a local reader, who takes it up with
`adopt`, without the key.
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import struct
import uuid
from collections.abc import Callable
from typing import Any

from mxfs.proto.chunk_wire import (
    ACCEPT,
    ANSWER,
    BUSY,
    CHALLENGE,
    CHUNK_OP,
    CUT_BACK,
    GROUP,
    HELLO,
    KEY_LEN,
    KEYS_BODY,
    KPUT,
    KPUT_SHARED,
    KREQ_BODY,
    MAGIC,
    MAX_KREQ,
    MAX_READ,
    MAX_WHY,
    MAX_WRITE,
    NO_ROOM,
    NODE,
    PROOF,
    READ,
    SCOPE,
    SCOPE_ITEM,
    VERSION,
    WireError,
    check_magic,
    check_proof,
    proof,
)

PIPELINE = 16  # READs one connection sends ahead of the answer it is receiving
CONNECT_S = 5  # a connection to a node is made within this (a LAN takes ms; -o connect_s)
RESERVED_LOW = 600  # a node's connections come from a port in [RESERVED_LOW, 1024) ...
RESERVED_TRIES = 16  # ... if one of this many picked at random is free
UNACKED_S = 8  # a request the node has not acknowledged for this long: cut off (unacked_s)
RENEW_S = 300.0  # a RENW's answer waited for this long (the owner copies the file)


class StaleNode(OSError):
    """The serving node's epoch changed: what it sends is not the pool's any more."""


class Refused(OSError):
    """The node answered one request with an errno; the connection goes on."""


class Busy(OSError):
    """The node's service holds as many connections as it may (it answered BUSY): it
    is up, and has room again once a connection closes (EBUSY)."""


class ChunkClient:
    def __init__(self, host: str, port: int, key: bytes, pool_uuid: str,
                 timeout: float = 30.0, source: str | None = None,
                 connect_s: float = CONNECT_S, unacked_s: float = UNACKED_S,
                 connected: Callable[[socket.socket], None] | None = None) -> None:
        """Connect and prove the key; `source`: this node's address to connect from
        (on a host with several networks, the one the pool's nodes are on);
        `connect_s`, `unacked_s`: a mount's `-o connect_s`, `-o unacked_s`;
        `connected`: told the socket before the proof waits on the node."""
        self.where = f"{host}:{port}"
        self.sock = _connect(host, port, min(timeout, connect_s), source)
        if connected is not None:
            connected(self.sock)
        self.sock.settimeout(timeout)
        # Requests are small writes the owner answers at once: each goes out whole
        # (Nagle would hold a short last segment until the owner's ACK).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.epoch = self._handshake(key, pool_uuid)
        except BaseException:
            self.sock.close()
            raise
        _kernel_timeouts(self.sock, timeout, unacked_s)

    @classmethod
    def adopt(cls, fd: int, where: str, epoch: int, timeout: float = 30.0) -> ChunkClient:
        """A connection proved and scoped elsewhere (a descriptor its daemon sent)."""
        self = cls.__new__(cls)
        self.where, self.epoch = where, epoch
        self.sock = socket.socket(fileno=fd)
        _kernel_timeouts(self.sock, timeout)
        return self

    def scope(self, files: list[tuple[int, int]], uid: int = 0) -> None:
        """Narrow this connection for good to reading `files` (inode, generation), each
        while it keeps that generation, for a reader of `uid` (its requests take that
        uid's turn on the node)."""
        self.sock.sendall(SCOPE.pack(b"SCOP", uid, len(files)) +
                          b"".join(SCOPE_ITEM.pack(*f) for f in files))
        code, epoch, n = ANSWER.unpack(self._recv(ANSWER.size))
        if code or n:
            raise OSError(code or errno.EPROTO, f"{self.where} would not scope a connection "
                          f"to {len(files)} files: "
                          f"{os.strerror(code) if code else 'bytes followed'}")
        if epoch != self.epoch:
            raise StaleNode(errno.ESTALE, f"{self.where} changed epoch ({self.epoch} -> "
                            f"{epoch})")

    def _handshake(self, key: bytes, pool_uuid: str) -> int:
        client_nonce = os.urandom(16)
        self.sock.sendall(HELLO.pack(MAGIC, VERSION, uuid.UUID(pool_uuid).bytes, client_nonce))
        head = self._recv(len(BUSY))
        if head == BUSY:
            raise Busy(errno.EBUSY, f"{self.where} serves as many connections as it may "
                       "(max_chunk_conns): try again")
        magic, version, server_nonce, theirs, epoch = CHALLENGE.unpack(
            head + self._recv(CHALLENGE.size - len(head)))
        check_magic(magic, version)
        check_proof(proof(key, b"server", pool_uuid, client_nonce, server_nonce), theirs)
        self.sock.sendall(PROOF.pack(proof(key, b"client", pool_uuid, client_nonce,
                                           server_nonce)))
        if self._recv(len(ACCEPT)) != ACCEPT:
            raise WireError(f"{self.where} did not accept this node")
        return int(epoch)

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            if not k:
                raise WireError(f"{self.where} closed the connection (it does not take "
                                "this pool's key, or went away)")
            got += k

    def read_into(self, ino: int, member: int, offset: int, out: memoryview) -> int:
        """Read the chunk file of `ino` on `member` from `offset` into `out`; how many
        bytes it held (fewer at its end; 0 for one never written)."""
        return self.read_scatter(ino, member, offset, [out])

    def read_scatter(self, ino: int, member: int, offset: int, views: list[memoryview]
                     ) -> int:
        """Read the chunk file of `ino` on `member` from `offset` straight into `views`,
        in order (a member's run of stripe units into their places in a file's buffer,
        no copy in between); how many bytes it held (fewer at its end: the views past
        them are left as they were)."""
        total = sum(len(v) for v in views)
        if total > MAX_READ:
            raise ValueError(f"at most {MAX_READ} bytes a request")
        self.sock.sendall(READ.pack(b"READ", ino, member, offset, total))
        return self._answer(ino, member, views)

    def _answer(self, ino: int, member: int, views: list[memoryview]) -> int:
        """Receive one READ's answer into `views`; how many bytes came (Refused: the
        node answered an errno)."""
        total = sum(len(v) for v in views)
        code, epoch, n = ANSWER.unpack(self._recv(ANSWER.size))
        if code:
            raise Refused(code, f"{self.where}: {os.strerror(code)} (inode {ino}, member "
                          f"{member})")
        if n > total:
            raise WireError(f"{self.where} sent {n} bytes for {total} asked")
        left = n
        for v in views:
            if not left:
                break
            part = v[:min(len(v), left)]
            self._recv_into(part)
            left -= len(part)
        if epoch != self.epoch:
            raise StaleNode(errno.ESTALE, f"{self.where} changed epoch ({self.epoch} -> "
                            f"{epoch}): its bytes are not trusted")
        return int(n)

    def fill(self, ino: int, member: int, offset: int, views: list[memoryview]) -> None:
        """Fill `views`, in order, from the chunk file of `ino` on `member` at `offset`,
        MAX_READ bytes a request; bytes past its end (or of one never written) are zeros."""
        failed = self.fill_many([(ino, member, offset, views)])[0]
        if failed is not None:
            raise failed

    def fill_many(self, runs: list[tuple[int, int, int, list[memoryview]]],
                  depth: int = PIPELINE) -> list[Exception | None]:
        """Fill each run (inode, member, chunk offset, views) as `fill` does, up to
        `depth` requests sent ahead of the answer being received, so the node goes
        from one to the next without waiting for a round trip; each run's failure, or
        None.  A run the node refused fails alone; once the connection breaks (or the
        node's epoch changes), every run not yet done fails with it."""
        asks: list[tuple[int, int, int, int, list[memoryview]]] = []  # (run, ino, ...)
        for r, (ino, member, offset, views) in enumerate(runs):
            for group in _groups(views):
                asks.append((r, ino, member, offset, group))
                offset += sum(len(v) for v in group)
        errors: list[Exception | None] = [None] * len(runs)
        sent = 0
        try:
            for k, (r, ino, member, _, group) in enumerate(asks):
                ahead = asks[sent:k + depth]
                if ahead:
                    self.sock.sendall(b"".join(
                        READ.pack(b"READ", a[1], a[2], a[3], sum(len(v) for v in a[4]))
                        for a in ahead))
                    sent += len(ahead)
                try:
                    n = self._answer(ino, member, group)
                except Refused as e:
                    errors[r] = e
                    continue
                for v in group:  # past the chunk file's end: a hole
                    if n < len(v):
                        v[n:] = bytes(len(v) - n)
                    n = max(0, n - len(v))
        except (OSError, WireError) as e:
            done = {a[0] for a in asks[:k]} - {a[0] for a in asks[k:]}
            for r in range(len(runs)):
                if r not in done and errors[r] is None:
                    errors[r] = e
        return errors

    def kv_put(self, who: tuple[int, int, list[int]], namespace: str, mode: int,
               shared: bool, key: bytes, chunk: bytes | memoryview | tuple[int, int]
               ) -> bool:
        """Store a KV chunk on the node as a put of `who` (uid, gid, groups) would be:
        True if stored, False if the key was stored already; Refused (the node's errno
        and line) when it is not.  `chunk`: the bytes, or (descriptor, size) to send
        the first `size` bytes of with sendfile."""
        uid, gid, groups = who
        ns = namespace.encode()
        size = chunk[1] if isinstance(chunk, tuple) else len(chunk)
        self.sock.sendall(KPUT.pack(b"KPUT", uid, gid, mode, KPUT_SHARED if shared else 0,
                                    len(groups), len(ns), len(key), size)
                          + b"".join(GROUP.pack(g) for g in groups) + ns + key)
        if isinstance(chunk, tuple):
            fd, done = chunk[0], 0
            while done < size:
                sent = os.sendfile(self.sock.fileno(), fd, done, size - done)
                if not sent:
                    raise OSError(errno.EIO, "the chunk's file shrank while it was sent")
                done += sent
        else:
            self.sock.sendall(chunk)
        code, said = self._kv_answer(MAX_WHY, "reason", errno.EEXIST)
        return not code

    def change(self, tag: bytes, epoch: int, ino: int, member: int, offset: int = 0,
               views: list[memoryview] | None = None, room: int | None = None,
               back: bool = False) -> None:
        """A chunk change of the pool's writer node (under its lease's `epoch`) on a
        member this node holds: WRIT `views` at `offset`, SYNC (offset 1: data only),
        TRUN to `offset` bytes, REMV, RENW (`room`: what the owner's quota has left for
        the copies kept, None: no bound); Refused (the node's errno and line) when it
        will not."""
        views = views or []
        if views and tag != b"WRIT":
            raise ValueError(f"a {tag.decode()} carries no bytes")
        length = sum(len(v) for v in views) if tag != b"RENW" else \
            NO_ROOM if room is None else room
        if back and tag == b"TRUN":
            length = CUT_BACK
        if tag == b"WRIT" and length > MAX_WRITE:
            raise ValueError(f"at most {MAX_WRITE} bytes a chunk write")
        self.sock.sendall(tag + CHUNK_OP.pack(epoch, ino, member, offset, length))
        for v in views:
            self.sock.sendall(v)
        if tag != b"RENW":
            self._kv_answer(MAX_WHY, "reason")
            return
        waited = self.sock.gettimeout()  # (a RENW copies the chunk file first: GiBs of a
        self.sock.settimeout(RENEW_S)  # large file on a slow member take minutes)
        try:
            self._kv_answer(MAX_WHY, "reason")
        finally:
            self.sock.settimeout(waited)

    def kv_keys(self, tag: bytes, who: tuple[int, int, list[int]], namespace: str,
                flags: int, keys: list[bytes], ms: int, holder: bytes,
                node: tuple[str, int] | None = None) -> bytes:
        """A KCLM, KWAI, KPIN or KUNP (`proto/chunk_wire.py`) as `who` (KPIN and KUNP
        with `node`: this node's name and epoch): the answer's byte a key; Refused (the
        node's errno and line) when it is not served."""
        uid, gid, groups = who
        ns = namespace.encode()
        tail = b""
        if node is not None:
            name = node[0].encode()
            tail = NODE.pack(node[1], len(name)) + name
        self.sock.sendall(tag + KEYS_BODY.pack(uid, gid, flags, len(groups), len(ns),
                                               len(keys), ms, holder)
                          + b"".join(GROUP.pack(g) for g in groups) + ns
                          + b"".join(KEY_LEN.pack(len(k)) + k for k in keys) + tail)
        _, said = self._kv_answer(max(MAX_WHY, len(keys)), f"answer to {len(keys)} keys")
        if len(said) != len(keys):
            raise WireError(f"{self.where} answered {len(said)} of {len(keys)} keys")
        return said

    def kv_request(self, who: tuple[int, int, list[int]], op: str, msg: dict[str, Any]
                   ) -> dict[str, Any]:
        """A KREQ (`proto/chunk_wire.py`): the owner's reply to `op` asked as `who`;
        Refused (the node's errno and line) when it is not served."""
        uid, gid, groups = who
        name, body = op.encode(), json.dumps(msg).encode()
        if len(body) > MAX_KREQ:
            raise Refused(errno.E2BIG, f"a {op} request of {len(body)} bytes (at most "
                          f"{MAX_KREQ} to another node)")
        self.sock.sendall(b"KREQ" + KREQ_BODY.pack(uid, gid, len(groups), len(name), len(body))
                          + b"".join(GROUP.pack(g) for g in groups) + name + body)
        _, said = self._kv_answer(MAX_KREQ, "answer")
        try:
            reply = json.loads(said)
        except ValueError:
            raise WireError(f"{self.where} answered {op} with no JSON") from None
        if not isinstance(reply, dict):
            raise WireError(f"{self.where} answered {op} with no object")
        return reply

    def _kv_answer(self, most: int, what: str, fine: int = 0) -> tuple[int, bytes]:
        """A KV request's answer: (its code, its bytes), at most `most` of them, under
        the epoch this connection was proved with; a refusal (a code but `fine`) is
        Refused with the line the node sent."""
        code, epoch, n = ANSWER.unpack(self._recv(ANSWER.size))
        if n > most:
            raise WireError(f"{self.where} sent a {n}-byte {what}")
        said = self._recv(n) if n else b""
        if epoch != self.epoch:
            raise StaleNode(errno.ESTALE, f"{self.where} changed epoch ({self.epoch} -> "
                            f"{epoch})")
        if code and code != fine:
            raise Refused(code, said.decode(errors="replace") or os.strerror(code))
        return code, said

    def read(self, ino: int, member: int, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        n = self.read_into(ino, member, offset, memoryview(buf))
        return bytes(buf[:n])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ChunkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect(host: str, port: int, timeout: float, source: str | None) -> socket.socket:
    """A TCP connection to a node; from root, from a reserved port (below 1024, which
    only root may bind, as NFS clients do): the service keeps room for such peers'
    handshakes that the connections of unprivileged users on the same host cannot
    take.  Falls back to any port when none of RESERVED_TRIES is free."""
    if os.geteuid() == 0:
        for _ in range(RESERVED_TRIES):
            family, kind, proto, _, addr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.settimeout(timeout)
                sock.bind((source or "", random.randrange(RESERVED_LOW, 1024)))
                sock.connect(addr)
                return sock
            except OSError as e:
                sock.close()
                if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    raise
    return socket.create_connection((host, port), timeout=timeout,
                                    source_address=(source, 0) if source else None)


def _kernel_timeouts(sock: socket.socket, timeout: float, unacked_s: float = UNACKED_S
                     ) -> None:
    """Blocking, with the kernel's send and receive timeouts: a receive with MSG_WAITALL
    then takes a whole stripe unit in one call (Python's own timeouts poll before every
    call and take what has arrived, a few hundred KiB at a time).  And bytes sent that
    the peer has not acknowledged for `unacked_s` end the connection: a request to a
    node cut off (a link down, a one-way partition) fails then, while a node merely
    slow to answer acknowledges the request at once and is waited for `timeout`."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(unacked_s * 1000))


def _groups(views: list[memoryview]) -> list[list[memoryview]]:
    """`views` cut and grouped into requests of at most MAX_READ bytes each."""
    groups: list[list[memoryview]] = [[]]
    size = 0
    for v in views:
        for at in range(0, len(v), MAX_READ):
            part = v[at:at + MAX_READ]
            if size + len(part) > MAX_READ:
                groups.append([])
                size = 0
            groups[-1].append(part)
            size += len(part)
    return groups

"""The chunk service: this node's member ranges, served to the pool's other nodes.

A daemon mounted with `-o chunk_port=N` listens on TCP (`chunk_addr`, loopback unless
named) for the pool's other nodes (`io/chunk_client.py`): each connection proves the pool
key both ways first (`proto/chunk_wire.py`), then asks for ranges of chunk files, which
go out with sendfile from a worker thread, never through Python buffers.  A request is
checked as the direct path checks one (a member of this pool in service, an inode
that is a regular file, at most MAX_READ bytes); a daemon fenced off the pool
(`meta/lease.py`: its lease went) answers ESTALE, never bytes the pool no longer
stands behind.  Every answer carries the lease's epoch.

Anyone who can reach the port can connect, so connections are admitted against
`Limits`: at most `max_chunk_conns` of the peers' own in all, past which an address
holding `reserved_chunk_conns` of its own is told busy (each node keeps that room,
however many the others hold), never into the descriptors the daemon keeps back,
`max_chunk_conns_per_peer` of one address (proved or not: one node cannot take every
other node's room); readers' scoped connections are counted apart, to their own part
(`_scoped_room`), so they never take a node's room.  A connection refused for room is
answered BUSY after its HELLO (`proto/chunk_wire.py`): a node waits for one of its
own or tries again, and goes on treating the service as up.  At most
`max_chunk_handshakes_per_peer` of one address may not yet have proved the key (every
loopback address counted as one: a local user reaches all of 127.0.0.0/8), and at
most `max_chunk_handshakes` in all, below `max_chunk_conns`: a host that opens
connections and stays silent holds its own slots only, never the room of the nodes
already proved.  Nodes' daemons connect from a reserved port (below 1024: root's
alone, `io/chunk_client.py`), and connections from other ports are counted apart
(each address's as a peer of its own, and all of them to half of
`max_chunk_handshakes`): a user on a node who floods the port with silent connections
cannot take the slots its daemon proves the key in.  A connection refused for those
(a flood of unproved ones) is closed at once, without an answer.  Those bound what a
peer holds, not how often it connects: each address (counted as above, its
unreserved ports apart) may open `max_chunk_accept_burst` connections at once and
`max_chunk_accepts_per_s` a second after that (`fs/accept_rate.py`); one past them
is closed as it is accepted, before a task or a handshake is spent on it, and an
address's are logged once a minute at most.

The pool's writer node writes the stripes it places on this node's members through
it (WRIT, SYNC, TRUN, REMV): each done in a worker thread, under the epoch of the
writer's lease this node knows (`writer_epoch`), on a member this node holds (the
writer's own service refuses them: nobody changes its files but itself); at most
WRITES_AT_ONCE are in service at once, on threads of their own (a slow member holds
those, not trio's default ones), a write received within PUT_RECV_S.  The pool
key is what makes a peer a node: every node that holds it is trusted to name the
writer's epoch honestly, as it is trusted to name its users.

A connection may be scoped to one file (SCOPE, `proto/chunk_wire.py`) and handed by a
reading node's daemon to a local reader, who is not trusted: so a sender thread is
held only while bytes move.  A peer that stops reading gives its thread back after
ROOM_WAIT_S and waits for room on trio's loop, SEND_STALL_S at most, then loses its
connection; readers that stall cannot take the senders from the others.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import itertools
import json
import logging
import math
import os
import select
import socket
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from mxfs.fs.accept_rate import AcceptRate
from mxfs.fs.descriptors import Descriptors
from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import RoundRobin, Turns
from mxfs.fs.limits import Limits
from mxfs.fs.member_calls import MemberCalls
from mxfs.fs.ports import listen_error
from mxfs.fs.store_worker import StoreWorker
from mxfs.io import PAGE
from mxfs.io.residency import cached_pages
from mxfs.meta import Inode
from mxfs.pool.closer import close_later
from mxfs.pool.pool import unlink_cut
from mxfs.proto.chunk_wire import (
    ACCEPT,
    ANSWER,
    BUSY,
    CHALLENGE,
    CHUNK_OP,
    CHUNK_OPS,
    CLAIM_STATES,
    CUT_BACK,
    GROUP,
    HELLO,
    KEY_LEN,
    KEY_TAGS,
    KEYS_BODY,
    KEYS_RELEASE,
    KPUT_BODY,
    KPUT_SHARED,
    KREQ_BODY,
    MAGIC,
    MAX_KEYS,
    MAX_KPUT,
    MAX_KPUT_GROUPS,
    MAX_KPUT_NAME,
    MAX_KREQ,
    MAX_NODE_NAME,
    MAX_READ,
    MAX_SCOPE,
    MAX_WHY,
    MAX_WRITE,
    NO_ROOM,
    NODE,
    NODE_FILE_OPS,
    PROOF,
    READ_BODY,
    SCOPE_COUNT,
    SCOPE_ITEM,
    SCOPE_S,
    TAG,
    VERSION,
    WireError,
    check_magic,
    check_proof,
    proof,
)
from mxfs.proto.framing import loads
from mxfs.vol.access import Caller
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.chunks")


class NodeKV(Protocol):
    """The writer's KV tier, as other nodes' users reach it (`fs/kv_ops.py`): each call
    judged as that caller's request on this node; OSError when refused."""

    async def put_from_node(self, caller: Caller, namespace: str, mode: int | None,
                            shared: bool, key: bytes, data: bytearray) -> bool: ...

    async def claim_from_node(self, caller: Caller, namespace: str, shared: bool,
                              keys: list[bytes], seconds: float, holder: bytes,
                              release: bool) -> list[str]: ...

    async def wait_from_node(self, caller: Caller, namespace: str, shared: bool,
                             keys: list[bytes], seconds: float, holder: bytes
                             ) -> list[bool]: ...

    async def pin_from_node(self, caller: Caller, namespace: str, shared: bool,
                            keys: list[bytes], holder: bytes, node: tuple[str, int]
                            ) -> list[bool]: ...

    async def unpin_from_node(self, caller: Caller, namespace: str, shared: bool,
                              keys: list[bytes], holder: bytes) -> None: ...

    async def request_from_node(self, caller: Caller, op: str, msg: dict[str, Any]
                                ) -> dict[str, Any]: ...


class NodeFileTier(Protocol):
    """The writer's files held for other nodes (`fs/node_files.NodeFiles`)."""

    async def request(self, caller: Caller, op: str, msg: dict[str, Any]
                      ) -> dict[str, Any]: ...


SCOPED_PART = 75  # percent of max_chunk_conns that readers' scoped connections may hold
SCOPED_PER_USER = 33  # percent of those one user's (her subordinate uids with her)
HANDSHAKE_S = 3.0  # a peer proves the key within this, or is dropped (a node: in ms)
IDLE_S = 600.0  # a connection with no request for this long is closed
SENDERS = 8  # sendfiles at once (worker threads); more wait their turn
MEMBER_SENDS = SENDERS - 2  # ... of one member's chunk files: a slow one's leave the others two
SEND_STALL_S = 30.0  # a peer that takes no bytes for this long loses its connection
ROOM_WAIT_S = 0.02  # a sender thread waits this long for room in a socket, then lets go
INLINE_SEND = 128 << 10  # a read this small whose pages are cached is sent from trio's
                         # thread (larger ones copy in a sender thread, off the loop)
SCOPED_AT_ONCE = 2  # requests of scoped connections (local readers) in service at once
GONE = -1  # a scoped inode found removed or replaced: refused without a lookup
SCOPED_SLOT_S = 0.0005  # ... each asking for less than SCOPED_SMALL holding its place this
SCOPED_SMALL = 256 << 10  # long at least: a flood of tiny READs gets 4,000 a second)
PUTS_AT_ONCE = 4  # KV chunks being received at once (each held whole: MAX_KPUT bytes)
PUT_RECV_S = 30.0  # ... each within this, or its connection goes
UNRESERVED = " (port >= 1024)"  # a peer's connections from ports any user may bind
WRITES_AT_ONCE = 4  # the writer's chunk writes being received at once (each held whole)
# ... and its changes of one member in service at once: a slow member's leave the others one
MEMBER_CHANGES = WRITES_AT_ONCE - 1
CHANGE_LATE_S = 15.0  # a chunk write with no place this long after it came is refused
# (the writer waits 30 s for its answer, then fails its caller's write: done after, it
# would land after whatever that caller did next, as a truncate and a rewrite)
CUT_FOLLOW_S = 60.0  # a TRUN's following by the node's mount, never cancelled, at most
# What accept says while the daemon's descriptors or the kernel's memory are out ...
OUT_OF_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
OUT_OF_ROOM_S = 0.1  # ... waited out this long, then accepted again


class ChunkService:
    def __init__(self, vol: Volume, key: bytes, host: str, port: int,
                 epoch: Callable[[], int], limits: Limits | None = None,
                 fds: Descriptors | None = None) -> None:
        self.vol, self.key, self.host, self.port = vol, key, host, port
        self.epoch = epoch  # the lease's, 0 for a pool with none
        self.limits = limits or Limits()
        # The daemon's descriptors held for tenants (its connections counted there).
        self.fds = fds or Descriptors(self.limits)
        self.fds.elsewhere.append(lambda: self.connections)
        self.connections = 0
        self.handshaking: Counter[str] = Counter()  # by peer address
        # Those connections' handshakes (their scopes), oldest first, by a token each.
        self._unproved: dict[int, trio.CancelScope] = {}
        self._unproved_peer: dict[int, str] = {}  # ... and whose each is
        self._tokens = itertools.count()
        self.by_host: Counter[str] = Counter()  # own connections, proved or not, by address
        self.scoped: Counter[int] = Counter()  # readers' scoped connections, by tenant ...
        self.scoped_by_host: Counter[str] = Counter()  # ... and by the node that made them
        self.refused = 0
        self._accepts = AcceptRate(self.limits.max_chunk_accept_burst,
                                   self.limits.max_chunk_accepts_per_s)
        self.served_bytes = 0
        self._senders = trio.CapacityLimiter(SENDERS)
        # Scoped connections are held by readers the service does not trust: however
        # many flood it with requests, this many are in service at once and the rest
        # wait without costing trio's thread (FUSE and the nodes go on being served),
        # by the readers' uids in turn (one user's sixteen connections do not leave
        # another's one a seventeenth).
        self._scoped = RoundRobin(SCOPED_AT_ONCE)
        self._failures = FailureLog(log)
        self._sock: socket.socket | None = None
        self.kv: NodeKV | None = None  # the daemon's KV tier, where it has one
        self.files: NodeFileTier | None = None  # the writer's files held for other nodes
        # Whether a caller here writes `ino` (a node's direct write, not yet committed).
        self.writing: Callable[[int], bool] = lambda ino: False
        # While a RENW makes `ino`'s chunk files anew: this node's writes of it (through
        # its mount) wait, so none lands in the old file after its copy (`Ops`).
        self.holding: Callable[[int], contextlib.AbstractAsyncContextManager[None]] = \
            lambda ino: contextlib.nullcontext()
        # After the writer's TRUN of `ino` (a truncate there), within `holding`: what
        # this node's mount holds of it, if open for writing here, follows (`Ops`).
        self.cut_elsewhere: Callable[[int], Awaitable[None]] = _nothing
        # Whether this node's mount holds `ino` open for writing (a CUT_BACK leaves it).
        self.writing_here: Callable[[int], bool] = lambda ino: False
        self.turns: Turns | None = None  # the control socket's requests in service by uid
        # A reading node's worker for its store's rows (None: the writer's, in memory).
        self.reads: StoreWorker | None = None
        # The member guard its opens go through (the daemon's, set by it; None: here).
        self.calls: MemberCalls | None = None
        # The one uid whose requests are served, as on the control socket (a daemon
        # mounted without allow_other): other nodes' users are held to it too.
        self.only_uid: int | None = None
        # (by user in turn, one holding 3 of the 4: one user's large puts from her
        # nodes do not queue every other user's behind them, first come first served)
        self._puts = RoundRobin(PUTS_AT_ONCE, PUTS_AT_ONCE * 3 // 4)
        self._writes = trio.CapacityLimiter(WRITES_AT_ONCE)
        self._member_changes: dict[int, trio.CapacityLimiter] = {}  # (`_places`)
        self._member_sends: dict[int, trio.CapacityLimiter] = {}  # (`_places`)
        # Their threads (a member's changes hold MEMBER_CHANGES: one left to the others)
        self._changers = trio.CapacityLimiter(WRITES_AT_ONCE)
        # The epoch of the pool's writer node's lease as this node knows it (its own on
        # the writer; None: no live writer): the only one whose chunk writes it does.
        self.writer_epoch: Callable[[], int | None] = epoch
        # Whether this node serves the pool: the writer while its store takes changes,
        # a node holding members while its own lease is held.
        self.serving: Callable[[], bool] = lambda: not vol.store.readonly
        self.written_bytes = 0

    def bind(self) -> None:
        """Open the listening socket now (before the daemon reports ready), so a port in
        use is one clear line at mount."""
        try:
            self._sock = socket.create_server((self.host, self.port), backlog=128)
        except OSError as e:
            raise listen_error("the chunk service", "chunk_port", "chunk_addr", self.host,
                               self.port, e) from None
        self.port = self._sock.getsockname()[1]

    def status(self) -> dict[str, Any]:
        return {"addr": self.host, "port": self.port, "connections": self.connections,
                "refused": self.refused, "served_bytes": self.served_bytes,
                "written_bytes": self.written_bytes,
                "scoped_waiting": self._scoped.queued()}

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        log.info("chunk service on %s:%d", self.host, self.port)
        task_status.started()
        async with listener, trio.open_nursery() as nursery:
            while True:
                stream = await self._accept(listener)
                peer = _peer_address(stream)
                if self._accepts.take(peer, trio.current_time()):
                    nursery.start_soon(self._connection, stream, peer)
                else:  # (closed here: no task, no handshake for a flood's connections)
                    self._over_rate(peer)
                    stream.socket.close()

    async def _accept(self, listener: trio.SocketListener) -> trio.SocketStream:
        """The next connection; while the daemon's descriptors or the kernel's memory
        are out, noted and waited out (as trio's serve_listeners did)."""
        while True:
            try:
                return await listener.accept()
            except OSError as e:
                if e.errno not in OUT_OF_ROOM:
                    raise
                self._failures.note("chunk accept", None, e, trace=False)
                await trio.sleep(OUT_OF_ROOM_S)

    def _over_rate(self, peer: str) -> None:
        """A connection from `peer` past its accept rate: counted as refused, logged
        with those since its last line once a minute at most (one line a connection
        was the flood again, in the log)."""
        self.refused += 1
        n = self._accepts.due(peer, trio.current_time())
        if n:
            lim = self.limits
            log.warning("chunk connections from %s come faster than %d a second "
                        "(max_chunk_accepts_per_s) after %d at once "
                        "(max_chunk_accept_burst): %d closed as accepted since this "
                        "address's last such line", peer, lim.max_chunk_accepts_per_s,
                        lim.max_chunk_accept_burst, n)

    def _admit(self, peer: str) -> tuple[str, bool] | None:
        """Why a new connection from `peer` is refused (a limit is reached) and whether
        it is told busy (no room now: a node tries again) rather than closed at once (a
        flood of unproved connections), or None."""
        lim = self.limits
        if self.handshaking[peer] >= lim.max_chunk_handshakes_per_peer:
            return (f"{peer} has {self.handshaking[peer]} connections that have not proved "
                    "the pool key, the limit (max_chunk_handshakes_per_peer)"), False
        unreserved = sum(n for p, n in self.handshaking.items() if p.endswith(UNRESERVED))
        if peer.endswith(UNRESERVED) and unreserved >= lim.max_chunk_handshakes // 2:
            return (f"{unreserved} connections from unreserved ports have not proved the "
                    "pool key, half the limit (max_chunk_handshakes)"), False
        if not self.fds.room(1):
            return "the daemon's descriptors are nearly all in use", True
        host = peer.removesuffix(UNRESERVED)
        if self.by_host[host] >= lim.max_chunk_conns_per_peer:
            return (f"{host} has {self.by_host[host]} connections, the limit "
                    "(max_chunk_conns_per_peer)"), True
        own = self.connections - sum(self.scoped_by_host.values())
        if own >= lim.max_chunk_conns and self.by_host[host] >= lim.reserved_chunk_conns:
            return (f"{own} connections of the peers' own, the limit (max_chunk_conns), "
                    f"and {host} holds {self.by_host[host]}, past its reserve "
                    "(reserved_chunk_conns)"), True
        return None

    async def _connection(self, stream: trio.SocketStream, peer: str) -> None:
        refusal = self._admit(peer)
        if refusal is not None:
            self.refused += 1
            self._failures.note("chunk connection", None, OSError(
                errno.EMFILE, refusal[0] + (": told busy" if refusal[1] else "")),
                trace=False)
            if not refusal[1]:
                await stream.aclose()
                return
        if sum(self.handshaking.values()) >= self.limits.max_chunk_handshakes:
            self._make_room()
        self.connections += 1
        self.handshaking[peer] += 1
        host = peer.removesuffix(UNRESERVED)
        self.by_host[host] += 1
        token = next(self._tokens)
        try:
            async with stream:
                proved = False
                self._unproved_peer[token] = peer
                with trio.CancelScope() as self._unproved[token]:
                    try:
                        proved = await self._handshake(stream, refusal is not None)
                    finally:
                        self._unproved.pop(token, None)
                        self._unproved_peer.pop(token, None)
                        self._end_handshake(peer)
                if proved:
                    await self._requests(stream, host)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, EOFError):
            pass  # the peer went away
        except WireError as e:  # a request past the protocol's limits: this peer goes
            self._failures.note("chunk request", None, e, trace=False)
        except Exception as e:  # (anything else, a store's Conflict under a DBA's lock
            #                      say: this connection ends, logged, never the daemon)
            self._failures.note("chunk connection", None, e)
        finally:
            self.connections -= 1
            self.by_host[host] -= 1
            if not self.by_host[host]:
                del self.by_host[host]

    def _make_room(self) -> None:
        """max_chunk_handshakes connections have not proved the key: the oldest of the
        address holding the most of them goes, for the newcomer.  A node proves it in a
        round trip; silent ones from a few hosts without the key, refused newcomers in
        their place, kept every node from connecting for as long as they liked, and
        closing the oldest of all closed nodes' handshakes for a flood from a few."""
        if self._unproved:
            most = max(self.handshaking, key=self.handshaking.__getitem__)
            oldest = next((t for t in self._unproved if self._unproved_peer.get(t) == most),
                          next(iter(self._unproved)))
            self._unproved.pop(oldest).cancel()
            self._failures.note("chunk connection", None, OSError(
                errno.EMFILE, f"{self.limits.max_chunk_handshakes} connections had not "
                "proved the pool key, the limit (max_chunk_handshakes): the oldest closed"),
                trace=False)

    def _end_handshake(self, peer: str) -> None:
        self.handshaking[peer] -= 1
        if not self.handshaking[peer]:
            del self.handshaking[peer]

    async def _handshake(self, stream: trio.SocketStream, busy: bool = False) -> bool:
        """The mutual proof of the pool key; False (and logged) when the peer fails it.
        `busy`: no room for the connection, answered BUSY once its HELLO is read
        whole (closed with bytes unread, the peer might see a reset, not the answer)."""
        pool_uuid = self.vol.pool.uuid
        try:
            with trio.fail_after(HANDSHAKE_S):
                magic, version, their_pool, client_nonce = HELLO.unpack(
                    await _recv_exact(stream, HELLO.size))
                check_magic(magic, version)
                if their_pool != _uuid_bytes(pool_uuid):
                    raise WireError("the peer is a node of another pool")
                if busy:
                    await stream.send_all(BUSY)
                    return False
                server_nonce = os.urandom(16)
                mine = proof(self.key, b"server", pool_uuid, client_nonce, server_nonce)
                await stream.send_all(CHALLENGE.pack(MAGIC, VERSION, server_nonce, mine,
                                                     self.epoch()))
                (theirs,) = PROOF.unpack(await _recv_exact(stream, PROOF.size))
                check_proof(proof(self.key, b"client", pool_uuid, client_nonce,
                                  server_nonce), theirs)
                await stream.send_all(ACCEPT)
                return True
        except (WireError, trio.TooSlowError, EOFError) as e:
            self._failures.note("chunk handshake", None, e, trace=False)
            return False

    async def _requests(self, stream: trio.SocketStream, host: str) -> None:
        scope: dict[int, int] | None = None  # inode: generation, once narrowed
        until = 0.0
        uid = 0  # the reader a scoped connection is for
        readers: int | None = None  # the tenant a scoped connection counts against
        try:
            while True:
                with trio.move_on_after(IDLE_S) as idle:
                    try:
                        tag = await _recv_exact(stream, TAG)
                    except EOFError:
                        return
                if idle.cancelled_caught:
                    return  # idle too long
                # (the request, within IDLE_S of its tag: a wait before it cuts none short)
                with trio.move_on_after(IDLE_S):
                    if tag == b"SCOP":
                        reader, count = SCOPE_COUNT.unpack(
                            await _recv_exact(stream, SCOPE_COUNT.size))
                        if count > MAX_SCOPE:
                            self._failures.note("chunk scope", None, WireError(
                                f"a scope of {count} files (at most {MAX_SCOPE})"), trace=False)
                            return
                        if scope is not None:  # (narrowed once, for good: a second SCOP was
                            # answered outside the readers' turns, as often as one liked)
                            self._failures.note("chunk scope", None, WireError(
                                "a second scope on a scoped connection"), trace=False)
                            return
                        items = await _recv_exact(stream, count * SCOPE_ITEM.size)
                        code = errno.EACCES if self.only_uid not in (None, reader) else \
                            self._scoped_room(tenant_of(reader), host)
                        if not code:
                            scope = dict(SCOPE_ITEM.iter_unpack(items))
                            for ino in scope:  # (their next writes change the generation)
                                self.vol.told(ino)
                            until = trio.current_time() + SCOPE_S
                            uid = reader
                            readers = tenant_of(reader)
                            self.scoped[readers] += 1
                            # (the node's readers' now, not its own: its room is kept)
                            self.by_host[host] -= 1
                            self.scoped_by_host[host] += 1
                        await stream.send_all(ANSWER.pack(code, self.epoch(), 0))
                        if code:
                            return
                        continue
                    if tag == b"KPUT" or tag == b"KREQ" or tag in KEY_TAGS or tag in CHUNK_OPS:
                        if scope is not None:  # a local reader's: it reads, nothing else
                            self._failures.note("chunk request", None, WireError(
                                f"a {tag.decode()} on a scoped connection"), trace=False)
                            return
                        if tag in CHUNK_OPS:
                            await self._chunk_op(stream, tag)
                            continue
                        await (self._kv_put(stream) if tag == b"KPUT" else
                               self._kv_request(stream) if tag == b"KREQ" else
                               self._kv_keys(stream, tag))
                        continue
                    if tag != b"READ":
                        self._failures.note("chunk request", None,
                                            WireError(f"unknown request {tag!r}"), trace=False)
                        return
                    ino, member, offset, length = READ_BODY.unpack(
                        await _recv_exact(stream, READ_BODY.size))
                    if scope is not None and trio.current_time() > until:
                        return  # a scoped connection's time is up: the reader asks anew
                    await self._read(stream, ino, member, offset, length, scope, uid)
                    continue
                return  # (a request that took IDLE_S: its peer stalled)
        finally:
            if readers is not None:
                self.scoped[readers] -= 1
                if not self.scoped[readers]:
                    del self.scoped[readers]
                self.scoped_by_host[host] -= 1
                if not self.scoped_by_host[host]:
                    del self.scoped_by_host[host]
                self.by_host[host] += 1  # (counted off as its own when it closes)

    def _scoped_room(self, tenant: int, host: str) -> int:
        """EMFILE where one more connection scoped to a reader of `tenant` (a local
        user of some node, `fs/remote_reads.py`) for the node at `host` would pass the
        readers' part (SCOPED_PART of max_chunk_conns, beside the nodes' own), one
        user's part of that (a user on 16 nodes held 16 of them through each and took
        every connection this service has), or max_chunk_conns_per_peer of that
        node's readers; else 0."""
        lim = self.limits
        most = lim.max_chunk_conns * SCOPED_PART // 100
        if sum(self.scoped.values()) >= most or \
                self.scoped_by_host[host] >= lim.max_chunk_conns_per_peer or \
                tenant != 0 and self.scoped[tenant] >= max(1, most * SCOPED_PER_USER // 100):
            return errno.EMFILE  # (the reader reads through its node's mount)
        return 0

    async def _kv_put(self, stream: trio.SocketStream) -> None:
        """Receive one KPUT and answer it: stored, there already (EEXIST) or why not."""
        uid, gid, mode, flags, ngroups, ns_len, key_len, size = KPUT_BODY.unpack(
            await _recv_exact(stream, KPUT_BODY.size))
        if ngroups > MAX_KPUT_GROUPS or max(ns_len, key_len) > MAX_KPUT_NAME or \
                size > MAX_KPUT:
            raise WireError(f"a KV put of {size} bytes, {ngroups} groups, names of "
                            f"{ns_len} and {key_len} bytes: past the limits")
        caller, namespace = await _caller(stream, uid, gid, ngroups, ns_len)
        key = await _recv_exact(stream, key_len)
        try:
            self._check_uid(caller.uid)
        except OSError as e:  # refused before it takes a turn or a slot: read past it
            await _skip(stream, size, "a refused KV put's")
            why = (e.strerror or "").encode()
            await stream.send_all(ANSWER.pack(e.errno, self.epoch(), len(why)) + why)
            return
        # The caller's turn first: a user whose turns are all taken waits without a
        # receiving slot (PUTS_AT_ONCE are every user's).
        turn = self.turns.turn(caller.uid) if self.turns is not None \
            else contextlib.nullcontext()
        async with turn, self._puts.slot(caller.uid):
            data = bytearray(size)
            with trio.move_on_after(PUT_RECV_S) as late:  # a stalled node holds no slot
                await _recv_into(stream, memoryview(data))
            if late.cancelled_caught:
                raise WireError(f"a KV put's {size} bytes did not come within {PUT_RECV_S:.0f} s")

            async def put() -> tuple[int, bytes]:
                self._check_uid(caller.uid)
                stored = await self._kv_tier().put_from_node(
                    caller, namespace, mode or None, bool(flags & KPUT_SHARED), key, data)
                return (0 if stored else errno.EEXIST), b""

            code, said = await self._judged("KV put from a node", put)
        await stream.send_all(ANSWER.pack(code, self.epoch(), len(said)) + said)

    async def _kv_keys(self, stream: trio.SocketStream, tag: bytes) -> None:
        """Receive one KCLM, KWAI, KPIN or KUNP and answer it: a byte a key, or why
        not."""
        uid, gid, flags, ngroups, ns_len, nkeys, ms, holder = KEYS_BODY.unpack(
            await _recv_exact(stream, KEYS_BODY.size))
        if ngroups > MAX_KPUT_GROUPS or ns_len > MAX_KPUT_NAME or nkeys > MAX_KEYS:
            raise WireError(f"a KV {tag.decode()} of {nkeys} keys, {ngroups} groups, a "
                            f"namespace of {ns_len} bytes: past the limits")
        caller, namespace = await _caller(stream, uid, gid, ngroups, ns_len)
        keys = []
        for _ in range(nkeys):
            (n,) = KEY_LEN.unpack(await _recv_exact(stream, KEY_LEN.size))
            if n > MAX_KPUT_NAME:
                raise WireError(f"a key of {n} bytes")
            keys.append(await _recv_exact(stream, n))
        shared = bool(flags & KPUT_SHARED)
        node = ("", 0)
        if tag in (b"KPIN", b"KUNP"):
            epoch, name_len = NODE.unpack(await _recv_exact(stream, NODE.size))
            if name_len > MAX_NODE_NAME:
                raise WireError(f"a node name of {name_len} bytes")
            node = ((await _recv_exact(stream, name_len)).decode(errors="replace"), epoch)

        async def answer() -> tuple[int, bytes]:
            kv = self._kv_tier()
            if tag == b"KPIN":
                leased = await kv.pin_from_node(caller, namespace, shared, keys, holder, node)
                return 0, bytes(int(p) for p in leased)
            if tag == b"KUNP":
                await kv.unpin_from_node(caller, namespace, shared, keys, holder)
                return 0, bytes([1]) * len(keys)
            if tag == b"KCLM":
                states = await kv.claim_from_node(caller, namespace, shared, keys, ms / 1000,
                                                  holder, bool(flags & KEYS_RELEASE))
                return 0, bytes(CLAIM_STATES.index(st) for st in states)
            present = await kv.wait_from_node(caller, namespace, shared, keys, ms / 1000,
                                              holder)
            return 0, bytes(int(p) for p in present)

        # (A closed connection's claims and pins given up cost nothing: not in a turn,
        # where a user's own waits would hold them up.)
        turn = not (tag == b"KCLM" and flags & KEYS_RELEASE)
        code, said = await self._judged(f"KV {tag.decode()} from a node", answer, caller.uid,
                                        turn)
        await stream.send_all(ANSWER.pack(code, self.epoch(), len(said)) + said)

    async def _kv_request(self, stream: trio.SocketStream) -> None:
        """Receive one KREQ and answer it: the reply as JSON, or why not."""
        uid, gid, ngroups, op_len, size = KREQ_BODY.unpack(
            await _recv_exact(stream, KREQ_BODY.size))
        if ngroups > MAX_KPUT_GROUPS or op_len > 64 or size > MAX_KREQ:
            raise WireError(f"a KV request of {size} bytes, {ngroups} groups, an op name "
                            f"of {op_len} bytes: past the limits")
        caller, op = await _caller(stream, uid, gid, ngroups, op_len)
        body = await _recv_exact(stream, size)

        async def answer() -> tuple[int, bytes]:
            try:
                msg = loads(body)
            except ValueError:
                raise OSError(errno.EINVAL, f"{op[:32]}: the request is not JSON") from None
            if not isinstance(msg, dict):
                raise OSError(errno.EINVAL, f"{op[:32]}: the request is not an object")
            if op in NODE_FILE_OPS:
                if self.files is None:
                    raise OSError(errno.EROFS, "this node names no files: ask the writer")
                reply = await self.files.request(caller, op, msg)
            else:
                reply = await self._kv_tier().request_from_node(caller, op, msg)
            out = json.dumps(reply).encode()
            if len(out) > MAX_KREQ:
                raise OSError(errno.E2BIG, f"the {op} reply is over {MAX_KREQ} bytes: ask "
                              "for less (kv_list: a page at a time)")
            return 0, out

        # (A node's abort only drops that caller's own file of that node: not in her
        # turn, where her busy waits held every user's aborts queued behind hers.)
        code, said = await self._judged(f"KV {op[:32]} from a node", answer, caller.uid,
                                        op != "node_abort")
        await stream.send_all(ANSWER.pack(code, self.epoch(), len(said)) + said)

    async def _chunk_op(self, stream: trio.SocketStream, tag: bytes) -> None:
        """Receive one WRIT, SYNC, TRUN, REMV or RENW of the writer node and answer it: done,
        or the errno and why not.  Each waits for a place on its member (a slow member's
        changes hold its own places, MEMBER_CHANGES, not every member's), a WRIT then for
        one of the WRITES_AT_ONCE buffers.  A WRIT that has neither within CHANGE_LATE_S
        of its coming is refused, its bytes read past: done later, it would land after
        the writer gave up on it.  The others wait as they must (a cut or a sync refused
        would leave the writer's size or its fsync unmade on this member)."""
        came = trio.current_time()
        epoch, ino, member, offset, length = CHUNK_OP.unpack(
            await _recv_exact(stream, CHUNK_OP.size))
        if tag == b"WRIT" and length > MAX_WRITE:
            raise WireError(f"a chunk write of {length} bytes (at most {MAX_WRITE})")
        placed = False
        async with contextlib.AsyncExitStack() as held:
            with trio.move_on_at(came + CHANGE_LATE_S if tag == b"WRIT" else math.inf):
                await held.enter_async_context(
                    self._places(self._member_changes, member, MEMBER_CHANGES))
                if tag == b"WRIT":
                    await held.enter_async_context(self._writes)
                placed = True
            if not placed:
                await _skip(stream, length, "a refused chunk write's")
                code, said = errno.ETIMEDOUT, (f"this node's member {member} was too busy "
                                               "to take the write in time").encode()
            else:
                data: bytearray | None = None
                if tag == b"WRIT":
                    data = bytearray(length)
                    with trio.move_on_after(PUT_RECV_S) as late:  # (a stalled peer holds
                        await _recv_into(stream, memoryview(data))  # no place)
                    if late.cancelled_caught:
                        raise WireError(f"a chunk write's {length} bytes did not come "
                                        f"within {PUT_RECV_S:.0f} s")
                code, said = await self._judged(
                    f"chunk {tag.decode()} from the writer",
                    lambda: self._change(tag, epoch, ino, member, offset, data, length))
        await stream.send_all(ANSWER.pack(code, self.epoch(), len(said)) + said)

    def _places(self, table: dict[int, trio.CapacityLimiter], member: int, n: int
                ) -> trio.CapacityLimiter:
        """`member`'s `n` places in `table` (the writer's changes of it, or the sends
        of its chunk files): a member that stops answering, or a slow one, holds its
        own, never every member's.  An index that is none of this pool's shares one
        set (refused, or answered zeros, after)."""
        key = member if 0 <= member < len(self.vol.pool.members) else -1
        places = table.get(key)
        if places is None:
            places = table[key] = trio.CapacityLimiter(n)
        return places

    async def _change(self, tag: bytes, epoch: int, ino: int, member: int, offset: int,
                      data: bytearray | None, length: int = 0) -> tuple[int, bytes]:
        """Do one chunk change for the writer (checked first: its epoch, our member)."""
        pool = self.vol.pool
        if not pool.node:  # (nobody else holds the pool's epoch here to change our files)
            raise OSError(errno.EPERM, "the writer node writes its own members: chunk "
                          "changes go to the nodes that hold members")
        if not self.serving():
            raise OSError(errno.ESTALE, "this node no longer serves the pool")
        writer = self.writer_epoch()
        if writer is None or epoch != writer:
            raise OSError(errno.ESTALE, f"a chunk change under epoch {epoch}, and the pool's "
                          f"writer holds {'no live lease' if writer is None else writer}")
        if not 0 <= member < len(pool.members):
            raise OSError(errno.EINVAL, f"member {member} is not one of this pool's")
        if pool.members[member].node:
            raise OSError(errno.EREMOTE, f"member {member} is node "
                          f"{pool.members[member].node}'s")
        pool.check([member])
        if tag == b"REMV" and self.writing(ino):
            # A file this node's caller is writing (its lease lapsed long enough for
            # the writer to drop it): writers keep descriptors, so its chunk files
            # are moved aside and held cut to nothing, not unlinked (unlinked, they
            # would take whatever those writers wrote: pool/revoke.py).
            await trio.to_thread.run_sync(self.vol.held.hold, ino, offset,
                                          limiter=self._changers)
            return 0, b""
        if tag == b"RENW":  # (`offset`: the file's owner, whose limits it counts in)
            room = None if length == NO_ROOM else length
            async with self.holding(ino):
                await trio.to_thread.run_sync(self.vol.renew_here, ino, offset, [member],
                                              room, limiter=self._changers)
            return 0, b""
        path = pool.chunk_path(member, ino)
        if tag == b"REMV":  # (`offset`: the file's owner, whose limits it counts in)
            await trio.to_thread.run_sync(self._remove, ino, member, path, offset,
                                          limiter=self._changers)
            return 0, b""
        if tag == b"TRUN":  # (a cut on the writer: this node's writes of it wait, and
            async with self.holding(ino):  # what it holds open for writing follows it)
                if length == CUT_BACK and self.writing_here(ino):
                    return 0, b""  # (a late cut-back: opened here since, cut then)
                await trio.to_thread.run_sync(_change_chunk, tag, path, offset, None,
                                              limiter=self._changers)
                # (cut: the node's mount follows it whatever happens to the request, its
                # IDLE_S run out or its peer gone; cancelled between the two, a file
                # open for writing here kept its old size and grew the cut back)
                with trio.CancelScope(shield=True) as follow:
                    follow.deadline = trio.current_time() + CUT_FOLLOW_S
                    try:
                        await self.cut_elsewhere(ino)
                    except Exception as e:  # (the writer's truncate stands; the size
                        self._failures.note("a cut's size on this node", None, e,  # held
                                            trace=not isinstance(e, OSError))  # here: told)
            return 0, b""
        await trio.to_thread.run_sync(_change_chunk, tag, path, offset, data,
                                      functools.partial(pool.create_flags, member, path),
                                      limiter=self._changers)
        if data is not None:
            self.written_bytes += len(data)
        return 0, b""

    def _remove(self, ino: int, member: int, path: str, owner: int) -> None:
        """(A worker thread.)  REMV: as on the writer (`Volume._remove_chunk_files`),
        a chunk file this node's direct readers hold goes aside for them a grace (kept
        as `owner`'s, the tenant the writer named: as root's, never limited, a reader
        here kept each file her tenant removed outside its quota and
        `max_held_per_user`), and the rest is cut as it goes (`unlink_cut`): an
        unlinked file an O_PATH descriptor held kept its blocks."""
        self.vol.held.hold_read(ino, owner, [member])
        unlink_cut(path)

    async def _judged(self, what: str, work: Callable[[], Awaitable[tuple[int, bytes]]],
                      uid: int | None = None, turn: bool = True) -> tuple[int, bytes]:
        """`work`'s (code, bytes), or a refusal's errno and line; a failure of ours is
        logged and answered EIO, never the service's end.  A request a node makes for
        one of its users (`uid`) takes that user's turn, as one on the control socket
        does (`fs/fair.Turns`): a user's requests from other nodes add up with its own
        here, and hundreds at once wait in its line, not in everyone's."""
        try:
            if uid is not None:
                self._check_uid(uid)
            if uid is not None and self.turns is not None and turn:
                async with self.turns.turn(uid):
                    return await work()
            return await work()
        except OSError as e:
            return e.errno or errno.EIO, (e.strerror or str(e)).encode()[:MAX_WHY]
        except Exception as e:
            self._failures.note(what, None, e)
            return errno.EIO, f"the node failed this request ({type(e).__name__})".encode()

    def _check_uid(self, uid: int) -> None:
        """EACCES unless `uid` may use this daemon (`only_uid`)."""
        if self.only_uid not in (None, uid):
            raise OSError(errno.EACCES, "the pool's writer is mounted without allow_other: "
                          f"only uid {self.only_uid} may use it")

    def _kv_tier(self) -> NodeKV:
        if self.kv is None:
            raise OSError(errno.EROFS, f"node {self.vol.pool.node or 'writer'} keeps no KV "
                          "tier")
        if self.vol.store.readonly:
            raise OSError(errno.ESTALE, "this node no longer serves the pool")
        return self.kv

    async def _read(self, stream: trio.SocketStream, ino: int, member: int, offset: int,
                    length: int, scope: dict[int, int] | None, uid: int = 0) -> None:
        """Answer one READ: its header, then its bytes.  A scoped connection's request
        is served inside the scoped gate, in its reader's uid's turn, all but its waits
        for room in its socket (a reader that stops reading holds nothing; readers
        that flood the service get SCOPED_AT_ONCE requests of trio's thread at a
        time)."""
        def gate() -> contextlib.AbstractAsyncContextManager[Any]:
            return self._scoped.slot(uid) if scope is not None else contextlib.nullcontext()
        if scope is not None:
            await _room(stream)
        fd, n, code = -1, 0, 0
        try:
            async with gate():
                done = trio.current_time() + SCOPED_SLOT_S
                try:
                    fd, n = await self._open(ino, member, offset, length, scope, uid)
                except OSError as e:
                    code = e.errno or errno.EIO
                await stream.send_all(ANSWER.pack(code, self.epoch(), n))
                if n and n <= INLINE_SEND and _all_cached(fd, offset, n):
                    # Cached and small: sent from trio's thread, what the socket takes
                    # now (a thread hop costs as much as the copy; KV chunks go so).
                    try:
                        sent = os.sendfile(stream.socket.fileno(), fd, offset, n)
                    except BlockingIOError:
                        sent = 0
                    self.served_bytes += sent
                    offset, n = offset + sent, n - sent
                if scope is not None and length < SCOPED_SMALL:
                    await trio.sleep_until(done)
            if n:
                await self._send(stream, fd, offset, n, member, gate)
        finally:
            if fd >= 0:
                close_later([fd])  # (a close can wait on the member)

    async def _send(self, stream: trio.SocketStream, fd: int, offset: int, n: int,
                    member: int,
                    gate: Callable[[], contextlib.AbstractAsyncContextManager[Any]]) -> None:
        """sendfile `n` bytes of a chunk file of `member`; a sender thread (one of the
        member's places, then through a `gate()`: reads of a slow member, all its pages
        from the disk, held every sender thread, and reads of others waited behind
        them; taken inside the gate, a place waited for held a scoped reader's slot)
        only while the socket takes them, and waits for room on trio's loop, outside
        it."""
        out = stream.socket.fileno()
        while n:
            async with self._places(self._member_sends, member, MEMBER_SENDS), gate():
                sent = await trio.to_thread.run_sync(_send_file, out, fd, offset, n,
                                                     limiter=self._senders)
            self.served_bytes += sent
            offset, n = offset + sent, n - sent
            if n:
                await _room(stream)

    async def _open(self, ino: int, member: int, offset: int, length: int,
                    scope: dict[int, int] | None, uid: int) -> tuple[int, int]:
        """A descriptor of the chunk file and how many of the bytes asked for it holds
        (-1 and 0: never written, all zeros): judged here, opened in a worker thread
        in `uid`'s turn through the member guard (a member that stopped answering
        holds this request, EIO once judged hung, never trio's thread), and judged
        again once opened: a file removed meanwhile may have been asked whether anyone
        holds it before the open, and cut after (`FileOps.open_read`)."""
        path = await self._judge(ino, member, length, scope, uid)
        calls = self.calls
        if calls is None:
            got: tuple[int, int] | None = _open_chunk(path, offset, length)
        else:
            got = await calls.run_whole(functools.partial(
                calls.guarded, member, functools.partial(_open_chunk, path, offset, length)),
                uid, (member,))
        if got is None:
            raise OSError(errno.EIO, f"member {member} is not answering")
        try:
            await self._judge(ino, member, length, scope, uid)
        except BaseException:
            if got[0] >= 0:
                close_later([got[0]])
            raise
        return got

    async def _judge(self, ino: int, member: int, length: int,
                     scope: dict[int, int] | None = None, uid: int = 0) -> str:
        """The chunk file a READ may read, or why not.  A scoped connection reads its
        inodes only, each while it keeps its generation and a link (its row read in
        `uid`'s turn, off the loop where that is a round trip: `_row`)."""
        vol = self.vol
        if not self.serving():
            raise OSError(errno.ESTALE, "this node no longer serves the pool")
        if not 0 <= member < len(vol.pool.members):
            raise OSError(errno.EINVAL, f"member {member} is not one of this pool's")
        if length > MAX_READ:
            raise OSError(errno.EINVAL, f"at most {MAX_READ} bytes a request")
        if scope is not None and ino not in scope:
            raise OSError(errno.EPERM, f"this connection may not read inode {ino}")
        vol.pool.check([member])
        if vol.pool.members[member].node:
            raise OSError(errno.EREMOTE, f"member {member} is node "
                          f"{vol.pool.members[member].node}'s")
        if scope is None and vol.pool.node:
            # A node's own member, read by another node: the writer names the inodes it
            # placed here, whose rows this node may not have read yet.
            return vol.pool.chunk_path(member, ino)
        if scope is not None and scope[ino] == GONE:
            raise OSError(errno.ESTALE, f"inode {ino} is removed, or another file now")
        try:
            node = await self._row(ino, uid)
        except OSError as e:
            if scope is None or e.errno != errno.ENOENT:
                raise
            scope[ino] = GONE  # (a row not cached is a round trip: asked once)
            raise OSError(errno.ESTALE, f"inode {ino} is gone") from None
        if scope is not None and (node.generation != scope[ino] or not node.nlink):
            scope[ino] = GONE  # (a generation never comes back)
            raise OSError(errno.ESTALE, f"inode {ino} is removed, or another file now")
        if not node.is_reg:
            raise OSError(errno.EINVAL, f"inode {ino} is not a regular file")
        return vol.pool.chunk_path(member, ino)


    async def _row(self, ino: int, uid: int) -> Inode:
        """`ino`'s row: from the store's cache on the writer, on a reading node from
        its server through `reads` (a worker thread, in `uid`'s turn: two lookups a
        READ, a reader's flood of tiny READs held the loop in SQL, and the whole daemon
        while the server was slow)."""
        if self.reads is None:
            return self.vol.store.get(ino)
        return await self.reads.run(lambda store: store.get(ino), uid)


def _open_chunk(path: str, offset: int, length: int) -> tuple[int, int]:
    """A descriptor of the chunk file at `path` and how many of [offset, offset+length)
    it holds (-1 and 0: never written)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1, 0
    size = os.fstat(fd).st_size
    return fd, max(0, min(length, size - offset))


def _peer_address(stream: trio.SocketStream) -> str:
    """Whom a connection's handshake slots are counted to: its address, with every
    loopback address one peer (any local user may connect from all of 127.0.0.0/8),
    and connections from a port any user may bind apart (UNRESERVED after it)."""
    try:
        host, port = stream.socket.getpeername()[:2]
        addr = ipaddress.ip_address(str(host))
    except (OSError, ValueError):  # gone already
        return "?" + UNRESERVED
    return peer_of(addr, int(port))


def peer_of(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """(See `_peer_address`.)  An IPv6 address counts as its /64: a host holds a whole
    /64 as a rule, and one address each would have given it unbounded slots."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        where = "loopback"
    elif isinstance(addr, ipaddress.IPv6Address):
        where = str(ipaddress.IPv6Network((addr, 64), strict=False))
    else:
        where = str(addr)
    return where + ("" if port < 1024 else UNRESERVED)


async def _nothing(ino: int) -> None:
    pass


def _uuid_bytes(pool_uuid: str) -> bytes:
    return uuid.UUID(pool_uuid).bytes


async def _recv_exact(stream: trio.SocketStream, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = await stream.receive_some(n - got)
        if not chunk:
            raise EOFError("the peer closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


async def _caller(stream: trio.SocketStream, uid: int, gid: int, ngroups: int, ns_len: int
                  ) -> tuple[Caller, str]:
    """The caller a node's KV request names (its groups follow the header) and the
    namespace after them."""
    groups = [g for (g,) in GROUP.iter_unpack(await _recv_exact(stream, 4 * ngroups))]
    namespace = (await _recv_exact(stream, ns_len)).decode(errors="replace")
    return Caller(0, uid, gid, frozenset([gid, *groups])), namespace


async def _skip(stream: trio.SocketStream, n: int, what: str) -> None:
    """Read past the `n` bytes a refused request carries (within PUT_RECV_S, else its
    connection goes: `what` names them)."""
    with trio.move_on_after(PUT_RECV_S) as late:
        scratch, left = memoryview(bytearray(1 << 16)), n
        while left:
            await _recv_into(stream, scratch[:min(left, len(scratch))])
            left -= min(left, len(scratch))
    if late.cancelled_caught:
        raise WireError(f"{what} {n} bytes did not come within {PUT_RECV_S:.0f} s")


async def _recv_into(stream: trio.SocketStream, view: memoryview) -> None:
    """Receive a KV chunk's bytes straight into `view` (one copy, on trio's thread: a
    bytes object a part and a second copy doubled it), ACKing each part at once: a
    connection that mostly carries requests and answers has the kernel delay its ACKs,
    and a sender at the start of its window then waits for one (60-70 ms of every few
    2 MiB puts)."""
    got = 0
    sock = stream.socket
    while got < len(view):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        n = await sock.recv_into(view[got:got + (1 << 20)])
        if not n:
            raise EOFError("the peer closed the connection")
        got += n


async def _room(stream: trio.SocketStream) -> None:
    """Wait until the socket takes bytes, SEND_STALL_S at most (TimeoutError: the peer
    stopped reading)."""
    with trio.move_on_after(SEND_STALL_S):
        await stream.socket.wait_writable()
        return
    raise TimeoutError(f"the peer took no bytes for {SEND_STALL_S:.0f} s")


def _all_cached(fd: int, offset: int, n: int) -> bool:
    """Whether every page of [offset, offset + n) of `fd` is in the page cache (so a
    sendfile of it never waits for the disk); False where the kernel cannot say."""
    pages = -(-(offset + n) // PAGE) - offset // PAGE
    return cached_pages(fd, offset, n) == pages


def _change_chunk(tag: bytes, path: str, offset: int, data: bytearray | None,
                  create: Callable[[int], int] = lambda flags: flags) -> None:
    """(A worker thread.)  WRIT `data` at `offset`, SYNC (offset 1: data only), or TRUN
    to `offset` bytes if longer the chunk file at `path` (REMV: `_remove`); `create`
    gives a new file's open flags (`Pool.create_flags`: a member's reserve of inodes)."""
    if tag == b"WRIT":
        assert data is not None
        fd = os.open(path, create(os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC), 0o600)
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)
        return
    try:
        if tag == b"TRUN":
            if os.stat(path).st_size > offset:
                os.truncate(path, offset)
        else:  # SYNC
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                (os.fdatasync if offset == 1 else os.fsync)(fd)
            finally:
                os.close(fd)
    except FileNotFoundError:
        pass  # never written: nothing to cut, remove or make durable


def _send_file(out_fd: int, in_fd: int, offset: int, n: int) -> int:
    """sendfile up to `n` bytes to a non-blocking socket; how many went before it stayed
    full for ROOM_WAIT_S (the caller waits for room without holding a thread)."""
    writable = select.poll()
    writable.register(out_fd, select.POLLOUT)
    done = 0
    while done < n:
        try:
            sent = os.sendfile(out_fd, in_fd, offset + done, n - done)
        except BlockingIOError:
            if not writable.poll(ROOM_WAIT_S * 1000):
                return done
            continue
        if sent == 0:  # the file shrank under us: the peer's read would hang
            raise OSError(errno.EIO, "the chunk file shrank while it was sent")
        done += sent
    return done

"""Members another node owns, read through its chunk service.

A reading node (`mxfs node add`) holds no member: every member is the writer node's,
whose lease (`meta/lease.py`) names its chunk service and epoch.  `RemoteMembers`
keeps that view of the owner (`Owner`, refreshed by the node's lease keeper and again
whenever the owner answers unlike the view), a few connections to it (each proved
with the pool key), and reads a member's chunk range straight into a file's buffer
(`ChunkClient.read_scatter`).  An owner that is dead (its lease ran out), serves no
chunks, cannot be reached, or answers under another epoch than the pool's store
gives it reads EIO naming the node: never bytes the pool does not stand behind.

A node cut off (a link down, a partition) fails a request in UNACKED_S at most and a
connection in CONNECT_S (`io/chunk_client.py`); its idle connections are dropped with
the first that failed (each would wait as long), and for AWAY_S after a connection
could not be made every call fails at once, so readers of a node that cannot be
reached get EIO in seconds, not one wait after another.  A request the owner took but
left unanswered past the timeout ends its own connection alone: the owner is busy,
not gone.  A request in flight when the lease keeper finds the owner dead, or under
another epoch, ends then, not at the timeout, and so do the connections being proved
and those lent to direct readers: a stopped owner (SIGSTOP, a hung host whose kernel still
acknowledges) held every request sent it just before for the whole timeout, and the
reads waiting on them with it.  An owner that answers BUSY (its service holds as many
connections as it may) is up too: nothing is marked away, and a call waits for a
connection another call gives back, or tries again after a growing pause, for BUSY_S
at most, then fails EBUSY naming the node.

Each owner's requests run on threads of its own (`submit`, FAR_THREADS): a slow owner
(a throttled link, a busy disk) holds those, never the I/O threads that this node's
own members, or another owner's, are read and written on.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from mxfs.io.batch import Helpers
from mxfs.io.chunk_client import CONNECT_S, UNACKED_S, Busy, ChunkClient, Refused
from mxfs.meta.lease import STARTING
from mxfs.proto.chunk_wire import WireError

log = logging.getLogger("mxfs.remote")

T = TypeVar("T")

IDLE_CONNS = 16  # connections kept open to the owner between reads (windows ahead:
                 # 4 members x 4 windows in flight)
TIMEOUT_S = 30.0  # prove and each receive (a connection: CONNECT_S)
AWAY_S = 2.0  # after a connection to the owner could not be made, calls fail at once
BUSY_S = 10.0  # an owner answering BUSY is tried again (or a connection given back
BUSY_PAUSE_S = 0.01  # taken) so long at most, after a pause from this, doubling ...
BUSY_PAUSE_MAX_S = 0.5  # ... up to this
FAR_THREADS = 8  # helpers a file's I/O with one owner takes while idle (as many as
                 # the I/O pool has on two CPUs: an owner's share is not cut)
PROVING = 4  # connections to one owner proving the key at once (the owner refuses
             # past max_chunk_handshakes_per_peer, 8: callers on their own threads
             # opened more at once)


_CHANGES = {b"WRIT": "write", b"SYNC": "sync", b"TRUN": "truncate", b"REMV": "remove",
            b"RENW": "renew"}


@dataclass(frozen=True)
class Owner:
    """The node that owns the members, as its lease in the store says."""

    node: str
    addr: str  # its chunk service, "IP:PORT" ("": it serves none)
    epoch: int
    alive: bool

    def why_not(self) -> str | None:
        """Why its members cannot be read now, or None."""
        if not self.alive:
            return f"node {self.node} is dead (its lease ran out)"
        if self.addr == STARTING:
            return f"node {self.node} is starting (its chunk service is not up yet)"
        if not self.addr:
            return (f"node {self.node} serves no chunks (mount it there with "
                    "-o chunk_port=N,chunk_addr=IP)")
        return None


class RemoteMembers:
    """Reads of the owner's members for this node; thread-safe (worker threads read)."""

    def __init__(self, key: bytes, pool_uuid: str,
                 refresh: Callable[[], Owner | None], timeout: float = TIMEOUT_S) -> None:
        """`refresh`: reads the owner's lease from the store again (blocking)."""
        self.key, self.pool_uuid, self.refresh, self.timeout = key, pool_uuid, refresh, timeout
        self.connect_s, self.unacked_s = CONNECT_S, UNACKED_S  # (the mount's options)
        self.owner: Owner | None = None
        self._idle: list[ChunkClient] = []
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # a connection was given back
        self._said: str | None = None  # the last failure logged (once per kind)
        self._away: tuple[float, str] | None = None  # unreachable until, and why
        self._threads: ThreadPoolExecutor | None = None  # (`submit`, made on first use)
        # A file's I/O here, in its users' turns (`pool/chunks.py`): on the helpers idle,
        # else on the caller's thread, never queued behind another user's calls
        self.helpers = Helpers(FAR_THREADS, "mxfs-far-io")
        self._proving = threading.BoundedSemaphore(PROVING)
        # Connections a caller waits on or holds (calls in flight, proofs, those lent):
        # shut by `update` where the owner turns out dead or another.
        self._watched: set[socket.socket] = set()
        self._read_at = float("-inf")  # when the view in `owner` was read

    def update(self, owner: Owner | None, read_at: float | None = None) -> None:
        """A new view of the owner, read at `read_at` (monotonic; one read before the
        view held is ignored: the keeper's read, landing after a caller's newer one,
        ended calls made since); connections to another epoch or address are closed,
        and where it is dead or another, the calls in flight, the connections being
        proved and those lent out end (their readers see the end at once)."""
        with self._lock:
            if read_at is not None:
                if read_at < self._read_at:
                    return
                self._read_at = read_at
            old, self.owner = self.owner, owner
            another = owner is None or old is None or owner.epoch != old.epoch \
                or owner.addr != old.addr
            if owner != old and another:
                for c in self._idle:
                    c.close()
                self._idle.clear()
                self._away = None
            if another or owner is not None and owner.why_not() is not None:
                for sock in self._watched:  # (their answers would not be the pool's)
                    _shut(sock)
        if owner is not None and owner.why_not() is None and self._said is not None:
            log.warning("node %s (%s, epoch %d) serves its members again", owner.node,
                        owner.addr, owner.epoch)
            self._said = None

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` (a call of this owner's) on this owner's threads."""
        if self._threads is None:
            with self._lock:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(FAR_THREADS,
                                                       thread_name_prefix="mxfs-far")
        return self._threads.submit(fn, *args)

    def read(self, ino: int, member: int, offset: int, views: list[memoryview]) -> None:
        """Fill `views`, in order, from the chunk file of `ino` on `member` at `offset`;
        bytes past its end (or of one never written) read as zeros.  EIO naming the
        node when it cannot serve them."""
        self._call(lambda c: c.fill(ino, member, offset, views),
                   f"could not serve member {member} of inode {ino}")

    def read_bytes(self, ino: int, member: int, offset: int, length: int) -> bytes:
        """What the chunk file of `ino` on `member` holds at `offset`: fewer than
        `length` bytes where it ends (a scrub tells a missing chunk from zeros).  EIO
        naming the node when it cannot serve them."""
        return self._call(lambda c: c.read(ino, member, offset, length),
                          f"could not serve member {member} of inode {ino}")

    def change(self, tag: bytes, epoch: int, ino: int, member: int, offset: int = 0,
               views: list[memoryview] | None = None, room: int | None = None,
               back: bool = False) -> None:
        """A chunk change on the owner's member as the pool's writer under `epoch`
        (`ChunkClient.change`: WRIT, SYNC, TRUN, REMV, RENW; each may be done twice, so a
        connection that failed is retried); the owner's refusal as its OSError, EIO
        naming the node when it cannot be asked."""
        self._call(lambda c: c.change(tag, epoch, ino, member, offset, views, room, back),
                   f"could not {_CHANGES[tag]} member {member} of inode {ino}",
                   refusals=True)

    def kv_put(self, who: tuple[int, int, list[int]], namespace: str, mode: int,
               shared: bool, key: bytes, chunk: bytes | memoryview | tuple[int, int]
               ) -> bool:
        """Store a KV chunk on the owner as `who`'s put (`ChunkClient.kv_put`): True if
        stored, False if the key was there; the owner's refusal as the OSError it
        answered, EIO naming the node when it cannot be asked."""
        return self._call(lambda c: c.kv_put(who, namespace, mode, shared, key, chunk),
                          "could not store a KV chunk", refusals=True)

    def kv_keys(self, tag: bytes, who: tuple[int, int, list[int]], namespace: str,
                flags: int, keys: list[bytes], ms: int, holder: bytes,
                node: tuple[str, int] | None = None) -> bytes:
        """A KCLM, KWAI, KPIN or KUNP to the owner (`ChunkClient.kv_keys`), refusals
        and failures as for `kv_put`."""
        return self._call(lambda c: c.kv_keys(tag, who, namespace, flags, keys, ms, holder,
                                              node),
                          "could not claim, wait for or pin KV keys", refusals=True)

    def kv_request(self, who: tuple[int, int, list[int]], op: str, msg: dict[str, Any]
                   ) -> dict[str, Any]:
        """A KREQ to the owner (`ChunkClient.kv_request`): its reply to `op` asked as
        `who`; refusals and failures as for `kv_put`."""
        return self._call(lambda c: c.kv_request(who, op, msg), f"could not answer {op}",
                          refusals=True)

    def _call(self, fn: Callable[[ChunkClient], T], what: str, refusals: bool = False
              ) -> T:
        """`fn` on a connection to the owner, once more on a new one if an idle
        connection the owner closed meanwhile (its idle limit, a restart) fails;
        `refusals`: an errno the owner answered is the caller's, not a failure."""
        reused, client = self._client()
        while True:
            self._watch(client.sock)
            try:
                out = fn(client)
            except Refused as e:
                if refusals:
                    self._give_back(client)
                    raise OSError(e.errno, e.strerror) from None
                failed: Exception = e
            except (OSError, WireError) as e:
                failed = e
            except BaseException:
                self._drop(client)
                raise
            else:
                self._give_back(client)
                return out
            self._drop(client)
            owner = self.owner
            why = owner.why_not() if owner is not None else None
            if why is not None:  # (dead meanwhile: its calls in flight were ended)
                raise self._failed("", owner, why) from None
            if not reused or _unanswered(failed):
                raise self._failed(f"{what} ({failed})") from None
            self.close()  # (kept connections to it would fail as this one did)
            reused, client = self._client(fresh=True)

    def connect(self, idle: bool = False, wait: bool = True) -> tuple[bool, ChunkClient]:
        """A connection to the owner, proved, under the epoch the store gives it, for a
        caller to keep (EIO naming the node when there is none to be had, EBUSY when it
        has no room); with `idle`, one of the kept ones if any (True: the owner may have
        closed it meanwhile); without `wait`, EBUSY at once when it has no room.  It is
        lent: shut when the owner is found dead, until the caller's `let_go`."""
        kept, client = self._client(fresh=not idle, wait=wait)
        self._watch(client.sock)
        return kept, client

    def _watch(self, sock: socket.socket) -> None:
        """`sock` shut by `update` from now on (and now, where the owner died since
        the call took it), until `let_go`."""
        with self._lock:
            self._watched.add(sock)
            if self.owner is None or self.owner.why_not() is not None:
                _shut(sock)

    def let_go(self, sock: socket.socket) -> None:
        """(Before its close.)  `sock` is watched no more: a connection `connect` lent
        given back, a call's or a proof's ended."""
        with self._lock:
            self._watched.discard(sock)

    def top_up(self, n: int) -> None:
        """(Blocking.)  Make up to `n` new connections and keep them (IDLE_CONNS at most),
        so the next callers that take connections away find them proved already; a
        failure is left to those callers."""
        for _ in range(n):
            with self._lock:
                if len(self._idle) >= IDLE_CONNS:
                    return
            try:
                client = self._client(fresh=True, wait=False)[1]
            except OSError:
                return
            self._give_back(client)

    def close(self) -> None:
        with self._lock:
            for c in self._idle:
                c.close()
            self._idle.clear()

    def _client(self, fresh: bool = False, wait: bool = True) -> tuple[bool, ChunkClient]:
        """An idle connection to the owner (True: reused), or a new one whose epoch is
        the owner's.  An owner with no room for it (BUSY) is not away: with `wait`, a
        connection given back meanwhile is taken (even `fresh`: it served a call just
        now), or a new one tried again after a growing pause, for BUSY_S at most."""
        with self._lock:
            owner = self.owner
            if owner is not None and owner.why_not() is None and self._idle and not fresh:
                return True, self._idle.pop()
        if owner is None or owner.why_not() is not None:
            owner = self._refreshed()
        away = self._away
        if away is not None and time.monotonic() < away[0]:
            raise OSError(errno.EIO, away[1])
        last: Exception | None = None
        until, pause = time.monotonic() + min(self.timeout, BUSY_S), BUSY_PAUSE_S
        refreshed = False
        while True:
            why = owner.why_not()
            if why is not None:
                raise self._failed("", owner, why)
            host, _, port = owner.addr.rpartition(":")
            try:
                with self._proving:  # (a proof takes CONNECT_S and a timeout at most)
                    away = self._away  # (found by those proving before: EIO at once,
                    if away is not None and time.monotonic() < away[0]:  # not a wait
                        raise OSError(errno.EIO, away[1])  # of its own after theirs)
                    client = self._proved(host, int(port))
            except Busy as e:
                if not wait or time.monotonic() + pause > until:
                    raise self._busy(owner, e) from None
                kept = self._given_back(pause)
                if kept is not None:
                    return True, kept
                pause = min(2 * pause, BUSY_PAUSE_MAX_S)
                continue
            except (OSError, WireError) as e:
                last = e
            else:
                if client.epoch == owner.epoch:
                    self._away = None
                    return False, client
                client.close()
                last = OSError(errno.ESTALE, f"it answers under epoch {client.epoch}, the "
                               f"pool's store gives it {owner.epoch}")
            if refreshed:
                break
            refreshed = True  # it may have come back since the view was read
            tried, owner = owner, self._refreshed()
            if owner.why_not() is None and (owner.addr, owner.epoch) == (tried.addr,
                                                                         tried.epoch):
                break  # (the same node at the same address: no second wait)
        failed = self._failed(f"cannot be reached at {owner.addr} ({last})", owner)
        self._away = (time.monotonic() + AWAY_S, str(failed.strerror))
        raise failed

    def _proved(self, host: str, port: int) -> ChunkClient:
        """A new connection to the owner, its proof shut with the calls in flight
        where the keeper finds the owner dead meanwhile (a stopped owner's kernel
        takes the connection, and the proof waited the whole timeout)."""
        made: list[socket.socket] = []

        def connected(sock: socket.socket) -> None:
            made.append(sock)
            self._watch(sock)

        try:
            return ChunkClient(host, port, self.key, self.pool_uuid, self.timeout,
                               connect_s=self.connect_s, unacked_s=self.unacked_s,
                               connected=connected)
        finally:
            for sock in made:
                self.let_go(sock)

    def _given_back(self, seconds: float) -> ChunkClient | None:
        """A kept connection, waited for `seconds` at most (another call's, given back)."""
        with self._returned:
            if not self._idle:
                self._returned.wait(seconds)
            return self._idle.pop() if self._idle else None

    def _busy(self, owner: Owner, busy: Busy) -> OSError:
        """EBUSY naming the node, which is up with no room for another connection of
        ours now; logged once while it lasts."""
        text = f"node {owner.node} is busy: {busy.strerror}"
        if self._said != text:
            self._said = text
            log.warning("%s", text)
        return OSError(errno.EBUSY, text)

    def _refreshed(self) -> Owner:
        read_at = time.monotonic()
        try:
            owner = self.refresh()
        except Exception as e:  # (Unusable, or a store's Conflict, raised on: a read's
            #                      bug, and the daemon's end from a task that met it)
            raise self._failed(f"cannot be looked up: the metadata store is not reachable "
                               f"({e})") from None
        if owner is None:
            raise OSError(errno.EIO, "no node owns the pool's members (the writer node "
                          "gave the pool back): mount it on its owner node")
        self.update(owner, read_at)
        return owner

    def _drop(self, client: ChunkClient) -> None:
        self.let_go(client.sock)  # (first: `update` shuts only open ones)
        client.close()

    def _give_back(self, client: ChunkClient) -> None:
        with self._lock:
            self._watched.discard(client.sock)
            if self.owner is not None and client.epoch == self.owner.epoch \
                    and len(self._idle) < IDLE_CONNS:
                self._idle.append(client)
                self._returned.notify()
                return
        client.close()

    def _failed(self, what: str, owner: Owner | None = None, why: str | None = None
                ) -> OSError:
        """EIO naming the node; logged once for each kind of failure, not per read."""
        owner = owner or self.owner
        name = f"node {owner.node}" if owner else "the owner node"
        text = why or f"{name} {what}"
        kind = why or f"{name} unreachable"
        if owner is not None and owner.addr == STARTING and owner.alive:
            return OSError(errno.EIO, text)  # (a moment, while it mounts: not logged)
        if kind != self._said:
            self._said = kind
            log.error("%s: stripes on its members read EIO", text)
        return OSError(errno.EIO, text)


def _shut(sock: socket.socket) -> None:
    """End a connection whose reader is on another thread, or in another process."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # (the peer ended it already)


def _unanswered(e: Exception) -> bool:
    """Whether `e` is a request the owner took but did not answer within the receive
    timeout (SO_RCVTIMEO: EAGAIN): it is busy, not gone, so its other connections are
    kept (one forwarded wait that ran long closed them all) and it is not asked again
    (another wait as long)."""
    return isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EWOULDBLOCK)

"""KV puts, claims and pins on a reading node: sent on to the writer, whose KV tier
holds them.

A reading node keeps no KV index and no members, so what its users put goes to the
writer node's chunk service (KPUT, `proto/chunk_wire.py`), which judges each chunk as
a put of that user there (the namespace and its mode, quotas, room): a prefix an
instance on this node computed is a hit on every node of the pool.  Small chunks come
in `kv_put` and are sent on from a worker thread.  Larger ones are written by the
caller as on the writer, through `kv_create` and `kv_commit`, but into a memfd of this
daemon's, sealed against growing (the caller's own descriptor writes it); at commit
its sums are checked by reading it and its bytes go to the writer with sendfile.  The
control socket takes no descriptors, so nothing a caller holds is ever sent on.

A memfd's pages are memory this node holds for the caller, so one user (her
subordinate uids with her, `vol/tenants.py`) has at most
`max_kv_lent_per_user` bytes of them at once (the limit of KV copies lent to it,
`fs/kv_follow.py`), all users with those copies `max_kv_lent` (past it, ENOMEM), and
each goes once its commit is answered or its connection closes: cut to nothing, its
pages freed whoever still holds a descriptor of it.

Claims and waits (`fs/kv_claims.py`) go to the writer too (KCLM, KWAI), each connection
of this node known there by 16 random bytes of its own, so instances on two nodes that
miss one prefix compute it once. When the connection closes its claims are given up
there (from a thread of its own: nobody waits for it; a line a user, taken in turn,
`GiveUps`); a node that dies leaves them to run out. A wait holds a connection to the
writer and a thread here, so it lasts WAIT_S at most, WAITERS wait at once, and one user
(but root) holds at most WAITERS_PER_USER of them: past either, the wait is answered at
once with what is stored and the instance computes the rest, so a tenant's waits cannot
take every other tenant's.

Pins (`KVStore.pin`, LMCache's "lookup and lock") are read leases on the writer (KPIN,
KUNP), held there by the connection's holder and this node's name and epoch: they end
with an unpin, with the connection (as its claims do), or, should this node die, once
its lease runs out there, so a dead node holds nothing back from eviction for long.
Deletes, capacities, evictions, namespaces made and removed, lists and stats are the
writer's index's: each is asked of it as the caller's request (KREQ), its reply passed
on.

Every round trip but a wait runs on one of SENDERS threads, handed out by uid in turn
(`fs/fair.RoundRobin`), one uid (but root) holding SENDERS_PER_USER at most: a user
with dozens of puts queued here makes another's request wait for one of them, not for
all of them (first come, first served, it waited for every one queued before it).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio
import xxhash

from mxfs.fs.descriptors import Descriptors
from mxfs.fs.fair import RoundRobin
from mxfs.fs.fields import (
    BadField,
    Msg,
    b64_field,
    bool_field,
    from_b64,
    int_field,
    sums_field,
)
from mxfs.fs.kv_claims import CLAIM_S, MAX_CLAIM_S
from mxfs.fs.kv_fields import keys_field
from mxfs.fs.limits import Limits, NodeHeld
from mxfs.fs.session import Answer, Reply, Session
from mxfs.io.checksum import pack_sums
from mxfs.io.layout import Layout
from mxfs.io.memfd import free_later
from mxfs.pool.remote import RemoteMembers
from mxfs.proto.chunk_wire import (
    CLAIM_STATES,
    KEYS_RELEASE,
    KPUT_SHARED,
    MAX_KEYS,
    MAX_KPUT,
    MAX_KPUT_GROUPS,
)
from mxfs.proto.messages import (
    Empty,
    KVClaimReply,
    KVCommitReply,
    KVCreateReply,
    KVExistsReply,
    KVForwardStatus,
    KVPinReply,
    KVPutReply,
)
from mxfs.vol.access import Caller
from mxfs.vol.kv_index import check_key, check_namespace
from mxfs.vol.tenant_lines import Lines

log = logging.getLogger("mxfs.kv")
T = TypeVar("T")

SENDERS = 4  # requests sent on to the writer at once (worker threads), all callers together
SENDERS_PER_USER = 3  # ... of one uid (root: all), handed out by uid in turn (fs/fair.py)
WAITERS = 16  # waits for others' claims at once, all callers together
WAITERS_PER_USER = 4  # ... and of one uid (root: up to WAITERS)
WAIT_S = 20.0  # a wait's longest here (below the chunk connections' receive timeout)
GIVE_UP_QUEUE = 65536  # connections with claims or pins on the writer, open or given up
GIVE_UP_PER_USER = 4096  # ... of one uid's (root: up to the total), given up in turn
GIVE_UP_RETRY_S = 1.0  # a give-up the writer did not answer: tried again after this,
GIVE_UP_RETRY_MAX_S = 30.0  # doubling up to this, until it is answered or the epoch ends
# Not F_SEAL_SHRINK: a buffer's pages are freed when it goes (cut to nothing, `_drop`);
# sealed so, the caller's own descriptor kept them past every count, a user's 64 MiB a
# failed commit, without bound.  A cut under the daemon's reads is what `_check_sums`
# and the send find short.
_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_READ_PIECE = 8 << 20  # bytes of a buffer read at once to check its sums
_MEMFD_UNIT = 1 << 30  # the one-member layout a caller writes its memfd through


# (writer, who, holder, tries, due, this node's epoch when it held them, tenant)
_GiveUp = tuple[RemoteMembers, tuple[int, int, list[int]], bytes, int, float, int, int]


class GiveUps:
    """Connections' holders of claims and pins on the writer: open ones counted, closed
    ones in a line a tenant taken in turn (`vol/tenant_lines.py`) to be ended there.  A
    holder is counted from its first claim or pin (`reserve`), so the lines never
    overflow: a closed connection's give-up always has its place, and a user at her
    bound is refused new holders (EAGAIN) instead.  Once a full queue dropped the
    newest give-ups, or a writer that did not answer five times in a row, and their
    pins held the writer's chunks from eviction until this node's lease ran out;
    in one line, a user who closed thousands of connections held every other user's
    give-ups behind hers."""

    def __init__(self) -> None:
        self._lines: Lines[_GiveUp] = Lines()
        self._open: Counter[int] = Counter()  # holders of open connections, by tenant
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._lines)

    def count_of(self, tenant: int) -> int:
        """`tenant`'s holders: open, and closed but not yet given up."""
        with self._cond:
            return self._lines.of(tenant) + self._open[tenant]

    def reserve(self, tenant: int) -> None:
        """A holder for a connection of `tenant`'s, counted until its give-up is done;
        EAGAIN past the bounds."""
        with self._cond:
            if len(self._lines) + self._open.total() >= GIVE_UP_QUEUE:
                raise OSError(errno.EAGAIN, f"{GIVE_UP_QUEUE} connections hold or are "
                              "giving up KV claims and pins on the writer: try again")
            if tenant != 0 and self._lines.of(tenant) + self._open[tenant] >= \
                    GIVE_UP_PER_USER:
                raise OSError(errno.EAGAIN, f"uid {tenant} has {GIVE_UP_PER_USER} "
                              "connections holding or giving up KV claims and pins on the "
                              "writer, the limit: close some, or try again once they are "
                              "given up")
            self._open[tenant] += 1

    def unreserve(self, tenant: int) -> None:
        """A reserved holder that has nothing to give up (no writer to tell)."""
        with self._cond:
            self._open[tenant] -= 1
            if self._open[tenant] <= 0:
                del self._open[tenant]

    def put(self, item: _GiveUp, reserved: bool = True) -> None:
        """Queue `item` (its last field: its tenant), in the place its holder reserved
        (`reserved`), or again after a try that failed (its place kept meanwhile)."""
        tenant = item[-1]
        with self._cond:
            if reserved:
                self._open[tenant] -= 1
                if self._open[tenant] <= 0:
                    del self._open[tenant]
            self._lines.push(tenant, item)
            self._cond.notify()

    def get(self) -> _GiveUp:
        """The next in turn, waiting for one."""
        with self._cond:
            while not len(self._lines):
                self._cond.wait()
            return self._lines.pop()


@dataclass
class _Pending:
    """A chunk a caller is writing into a memfd of ours."""

    fd: int
    size: int
    tenant: int  # whose bound it counts against (`vol/tenants.py`)
    fds: Descriptors | None = None  # the account its descriptor is charged to


class ForwardedKV:
    """`kv_put`, `kv_create`, `kv_commit`, `kv_claim` and `kv_wait` of a reading node."""

    def __init__(self, remote: RemoteMembers | None, limits: Limits,
                 node: Callable[[], tuple[str, int]],
                 stored: Callable[[str, bytes], None], held: NodeHeld | None = None) -> None:
        """`node`: this node's name and its lease's epoch, now; `stored(namespace,
        key)`: a put sent on is stored (this node's presence tables show it at once);
        `held`: the node's count of memory held for KV users (shared with its copies)."""
        self.remote = remote
        self.limits = limits
        self.held = held or NodeHeld(limits.max_kv_lent)
        self.node = node
        self.stored = stored
        self._senders = RoundRobin(SENDERS, SENDERS_PER_USER)
        self._threads = trio.CapacityLimiter(SENDERS)  # (a slot of _senders holds one)
        self._handles = itertools.count(1)
        self._pending: dict[int, dict[int, _Pending]] = {}  # by id(session)
        # Bytes of memfds, and how many, and waits, by caller's tenant (a user's
        # subordinate uids are hers, `vol/tenants.py`: counted apart, each had her bounds).
        self.held_by_uid: Counter[int] = Counter()
        self.count_by_uid: Counter[int] = Counter()
        self._waiters = trio.CapacityLimiter(WAITERS)
        self.waiting_by_uid: Counter[int] = Counter()
        self._holders: dict[int, bytes] = {}  # id(session): its name on the writer
        # id(session): the (namespace, key)s it pinned there (an idle one is kept)
        self._pinned: dict[int, set[tuple[object, bytes]]] = {}
        # Closed connections' holders whose claims and pins are ended on the writer,
        # by one thread, in turn (a thread each let a user who closed a hundred
        # connections at once start a hundred, each dialing the writer).
        self._given_up = GiveUps()
        self._giver: threading.Thread | None = None
        self.puts = self.put_bytes = self.claims = self.pins = self.requests = 0

    def status(self) -> KVForwardStatus:
        return {"puts": self.puts, "put_bytes": self.put_bytes,
                "writing": sum(self.held_by_uid.values()), "claims": self.claims,
                "pins": self.pins, "requests": self.requests,
                "waiting": int(self._waiters.borrowed_tokens),
                "sending": self._senders.busy(), "queued": self._senders.queued()}

    async def put(self, msg: Msg, session: Session) -> Answer[KVPutReply]:
        keys, data = keys_field(msg), msg.get("data")
        if not isinstance(data, list) or len(data) != len(keys):
            raise BadField(msg, "needs 'data': one base64 string per key")
        chunks = []
        for b64 in data:
            if not isinstance(b64, str):
                raise BadField(msg, "'data' holds base64 strings")
            try:
                chunks.append(from_b64(b64))
            except ValueError:
                raise BadField(msg, "'data' is not base64") from None
        stored = [await self._send(msg, session.caller, key, raw)
                  for key, raw in zip(keys, chunks, strict=True)]
        return {"stored": stored, "evicted": 0}, []

    async def create(self, msg: Msg, session: Session) -> Answer[KVCreateReply]:
        check_key(b64_field(msg, "key"))
        size = int_field(msg, "size")
        if size > MAX_KPUT:
            raise OSError(errno.EFBIG, f"a KV chunk put on a reading node is at most "
                          f"{MAX_KPUT} bytes")
        uid, lim = session.tenant, self.limits
        # Each is a descriptor of this daemon's, whatever its size: counted as the
        # writer counts unpublished files.
        if len(self._pending.get(id(session), {})) >= lim.max_pending:
            raise OSError(errno.EMFILE, f"this connection is writing {lim.max_pending} KV "
                          "chunks, the limit (mount option max_pending): commit some")
        if uid != 0 and self.count_by_uid[uid] >= lim.max_pending_per_user:
            raise OSError(errno.EMFILE, f"uid {uid} is writing {lim.max_pending_per_user} "
                          "KV chunks, the limit (mount option max_pending_per_user)")
        if self.held_by_uid[uid] + size > self.limits.max_kv_lent_per_user:
            raise OSError(errno.ENOSPC, f"uid {uid} is writing {self.held_by_uid[uid]} bytes "
                          "of KV chunks on this node, the limit (max_kv_lent_per_user): "
                          "commit those first")
        if not self.held.room(size):
            raise OSError(errno.ENOMEM, f"this node holds {self.held.held} bytes of KV "
                          "chunks and copies for its users, the limit (max_kv_lent): try "
                          "again once some are committed, or put on the writer")
        if session.fds is not None:  # (its memfd, held until the commit)
            session.fds.take(uid, 1)
        try:
            fd = os.memfd_create("mxfs-kv-put", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
                # The caller's own open of it: its flags (a failed O_DIRECT) are not ours.
                theirs = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            if session.fds is not None:
                session.fds.give(uid, 1)
            raise
        handle = next(self._handles)
        self._pending.setdefault(id(session), {})[handle] = _Pending(fd, size, uid,
                                                                     session.fds)
        session.far += 1
        self.held_by_uid[uid] += size
        self.held.held += size
        self.count_by_uid[uid] += 1
        layout = Layout(_MEMFD_UNIT, 1, 0, 1)
        return {"exists": False, "ino": handle, "layout": layout.describe(),
                "members": [0]}, [theirs]

    async def commit(self, msg: Msg, session: Session) -> Answer[KVCommitReply]:
        handle = int_field(msg, "ino")
        pending = self._pending.get(id(session), {}).get(handle)
        if pending is None:
            raise OSError(errno.EBADF, f"{handle} is not a KV chunk written here")
        key, size = check_key(b64_field(msg, "key")), int_field(msg, "size")
        try:
            if size > pending.size:
                raise OSError(errno.EFBIG, f"a commit of {size} bytes for {pending.size} "
                              "declared at kv_create")
            # The caller's checksums judged here, as the writer judges its own chunks'
            # (the writer sums what reaches it: a byte changed or never written here was
            # stored with sums that vouched for it, and every node's get a hit on it).
            unit, sums = sums_field(msg, _MEMFD_UNIT, size)
            await self._off_loop(session.caller, lambda: _check_sums(pending.fd, size,
                                                                     unit, sums))
            stored = await self._send(msg, session.caller, key, (pending.fd, size))
        finally:
            self._drop(session, handle)
        return {"stored": stored, "evicted": 0}, []

    async def claim(self, msg: Msg, session: Session) -> Answer[KVClaimReply]:
        ms = min(int_field(msg, "ms", int(CLAIM_S * 1000)), int(MAX_CLAIM_S * 1000))
        self.claims += 1
        said = await self._keys(b"KCLM", msg, session.caller, ms, self._holder(msg, session))
        if ms > 0:  # (held there until then, at most: an idle connection is kept so long)
            session.far_claims_until = max(session.far_claims_until,
                                           trio.current_time() + ms / 1000)
        return {"state": [CLAIM_STATES[b] for b in said]}, []

    async def pin(self, msg: Msg, session: Session) -> Answer[KVPinReply]:
        self.pins += 1
        said = await self._keys(b"KPIN", msg, session.caller, 0, self._holder(msg, session),
                                self.node())
        pinned = self._pinned.setdefault(id(session), set())
        before = len(pinned)
        pinned.update((msg.get("namespace"), k) for k, b in zip(keys_field(msg), said,
                                                                strict=True) if b)
        session.far += len(pinned) - before
        return {"pinned": [bool(b) for b in said]}, []

    def _holder(self, msg: Msg, session: Session) -> bytes:
        """The connection's name on the writer, drawn at its first claim or pin that is
        well formed (a connection that never held anything there costs nothing when it
        closes)."""
        keys = keys_field(msg)
        for k in keys:
            check_key(k)
        _check_count(keys)
        check_namespace(msg.get("namespace"))
        holder = self._holders.get(id(session))
        if holder is None:
            self._given_up.reserve(session.tenant)
            holder = self._holders[id(session)] = os.urandom(16)
        return holder

    async def unpin(self, msg: Msg, session: Session) -> Answer[Empty]:
        holder = self._holders.get(id(session))
        if holder is not None:  # (a connection that never pinned here holds nothing)
            self.pins += 1
            await self._keys(b"KUNP", msg, session.caller, 0, holder, self.node())
            pinned = self._pinned.get(id(session), set())
            before = len(pinned)
            pinned.difference_update((msg.get("namespace"), k) for k in keys_field(msg))
            session.far -= before - len(pinned)
        return {}, []

    async def wait(self, msg: Msg, session: Session) -> Answer[KVExistsReply]:
        ms = min(int_field(msg, "ms", int(CLAIM_S * 1000)), int(WAIT_S * 1000))
        holder = self._holders.get(id(session), bytes(16))
        uid = session.tenant
        self.claims += 1
        if ms <= 0 or self._waiters.available_tokens == 0 or (  # as many as may hold
                uid != 0 and self.waiting_by_uid[uid] >= WAITERS_PER_USER):  # connections
            # What is stored, at once: the instance computes the rest.
            said = await self._keys(b"KWAI", msg, session.caller, 0, holder)
        else:
            self.waiting_by_uid[uid] += 1
            try:
                said = await self._keys(b"KWAI", msg, session.caller, ms, holder,
                                        waits=True)
            finally:
                self.waiting_by_uid[uid] -= 1
                if self.waiting_by_uid[uid] <= 0:
                    del self.waiting_by_uid[uid]
        return {"present": [bool(b) for b in said]}, []

    async def _keys(self, tag: bytes, msg: Msg, caller: Caller, ms: int, holder: bytes,
                    node: tuple[str, int] | None = None, waits: bool = False) -> bytes:
        keys = _check_count([check_key(k) for k in keys_field(msg)])
        remote = self._remote()
        namespace = check_namespace(msg.get("namespace"))
        flags = KPUT_SHARED if bool_field(msg, "shared") else 0
        who = as_sent(caller)

        def ask() -> bytes:
            return remote.kv_keys(tag, who, namespace, flags, keys, max(ms, 0), holder, node)
        if waits:  # (a wait holds its thread up to WAIT_S: threads of their own)
            return await trio.to_thread.run_sync(ask, limiter=self._waiters)
        return await self._off_loop(caller, ask)

    def asked(self, op: str) -> Callable[[Msg, Session], Awaitable[Reply]]:
        """The handler of `op` (one of FORWARDED_OPS) here: asked of the writer as the
        caller (KREQ), its reply passed on."""
        async def handler(msg: Msg, session: Session) -> Reply:
            remote, who = self._remote(), as_sent(session.caller)
            body = {k: v for k, v in msg.items() if k != "op"}
            self.requests += 1
            reply = await self._off_loop(session.caller,
                                         lambda: remote.kv_request(who, op, body))
            return reply, []
        return handler

    async def _off_loop(self, caller: Caller, fn: Callable[[], T]) -> T:
        """`fn()` (a round trip to the writer) on a sender thread, in the caller's
        turn: a user with many requests queued waits behind its own."""
        async with self._senders.slot(caller.uid):
            return await trio.to_thread.run_sync(fn, limiter=self._threads)

    def _remote(self) -> RemoteMembers:
        if self.remote is None:
            raise OSError(errno.EIO, "this node reaches no writer node")
        return self.remote

    async def _send(self, msg: Msg, caller: Caller, key: bytes,
                    chunk: bytes | tuple[int, int]) -> bool:
        """One chunk to the writer as `caller`'s put: stored, or there already."""
        remote = self._remote()
        namespace = check_namespace(msg.get("namespace"))
        self.puts += 1
        self.put_bytes += chunk[1] if isinstance(chunk, tuple) else len(chunk)
        mode = int_field(msg, "mode", 0) if msg.get("mode") is not None else 0
        if mode > 0o777:
            raise BadField(msg, "'mode' is a permission mode from 0 to 0777")
        who = as_sent(caller)
        shared = bool_field(msg, "shared")
        stored = await self._off_loop(caller, lambda: remote.kv_put(
            who, namespace, mode, shared, check_key(key), chunk))
        self.stored(namespace, key)  # (stored now, or by another before)
        return stored

    def _drop(self, session: Session, handle: int) -> None:
        pending = self._pending.get(id(session), {}).pop(handle, None)
        if pending is None:
            return
        free_later(pending.fd)  # (a GiB's pages freed off the loop)
        session.far -= 1
        if pending.fds is not None:
            pending.fds.give(pending.tenant, 1)
        self.held_by_uid[pending.tenant] -= pending.size
        self.held.held -= pending.size
        self.count_by_uid[pending.tenant] -= 1
        if self.count_by_uid[pending.tenant] <= 0:
            del self.held_by_uid[pending.tenant], self.count_by_uid[pending.tenant]
        if not self._pending.get(id(session), True):
            del self._pending[id(session)]

    def release(self, session: Session) -> None:
        """The connection closed: the chunks it did not commit go, and its claims and
        pins on the writer end (told from a thread of its own)."""
        for handle in list(self._pending.get(id(session), {})):
            self._drop(session, handle)
        session.far -= len(self._pinned.pop(id(session), ()))
        holder = self._holders.pop(id(session), None)
        if holder is None:
            return
        if self.remote is None:
            self._given_up.unreserve(session.tenant)
            return
        self._given_up.put((self.remote, as_sent(session.caller), holder, 0, 0.0,
                            self.node()[1], session.tenant))
        if self._giver is None:
            self._giver = threading.Thread(target=self._give_up, daemon=True,
                                           name="mxfs-kv-unclaim")
            self._giver.start()

    def _give_up(self) -> None:
        """(One thread of its own.)  End closed connections' claims and pins on the
        writer, one after another.  One the writer did not answer is tried again behind
        the others (never a wait that holds them up), less often each time, until it is
        answered or this node's epoch ends (the writer ends that epoch's pins itself)."""
        while True:
            item = self._given_up.get()
            remote, who, holder, tries, due, epoch, tenant = item
            if self.node()[1] != epoch:
                continue  # (this node joined again: the writer ended the old one's pins)
            if due > time.monotonic():  # (tried and failed: the others go first)
                self._given_up.put(item, reserved=False)
                time.sleep(max(0.0, min(0.05, due - time.monotonic())))
                continue
            try:
                remote.kv_keys(b"KCLM", who, "-", KEYS_RELEASE, [], 0, holder)
            except Exception as e:  # (not an OSError: a bug, or the store's Conflict in
                #                    a lookup; the thread's end left every give-up queued)
                if not isinstance(e, OSError):
                    log.warning("giving up a closed connection's claims and pins failed "
                                "(%r): tried again", e, exc_info=tries == 0)
                    e = OSError(errno.EIO, str(e))
                if e.errno != errno.EIO:  # (refused: nothing of it is held there)
                    log.info("the writer refused to end a closed connection's claims "
                             "and pins: %s", e)
                    continue
                pause = min(GIVE_UP_RETRY_S * 2 ** tries, GIVE_UP_RETRY_MAX_S)
                if tries == 3:
                    log.warning("a closed connection's claims and pins could not be ended "
                                "on the writer (%s): tried again every %.0f s at most "
                                "until it answers", e, GIVE_UP_RETRY_MAX_S)
                self._given_up.put((remote, who, holder, tries + 1,
                                    time.monotonic() + pause, epoch, tenant), reserved=False)


def _check_count(keys: list[bytes]) -> list[bytes]:
    """E2BIG for more keys than one request sends on (`MAX_KEYS`)."""
    if len(keys) > MAX_KEYS:
        raise OSError(errno.E2BIG, f"at most {MAX_KEYS} keys a claim, wait or pin on a "
                      "reading node")
    return keys


def as_sent(caller: Caller) -> tuple[int, int, list[int]]:
    """A caller as the writer is told it: uid, gid and (some of) its other groups."""
    return caller.uid, caller.gid, sorted(caller.gids - {caller.gid})[:MAX_KPUT_GROUPS]


def _check_sums(fd: int, size: int, unit: int, sums: bytes) -> None:
    """(A worker thread.)  EINVAL unless the chunk's `size` bytes in `fd` have `sums`.
    Read, not mapped: the caller may cut the buffer meanwhile (a mapping's pages past
    the cut are SIGBUS, the daemon's end), and a hole reads zeros without a page made
    for it (through a mapping, each page of a buffer never written was allocated, on
    the daemon's account); summed a piece at a time (a block may be a GiB)."""
    got, off = [], 0
    while off < size:
        block, end = xxhash.xxh3_64(), min(off + unit, size)
        while off < end:
            data = os.pread(fd, min(_READ_PIECE, end - off), off)
            if not data:
                raise OSError(errno.EINVAL, "the chunk was cut while its sums were "
                              "checked: put it again")
            block.update(data)
            off += len(data)
        got.append(block.intdigest())
    if pack_sums(got) != sums:
        raise OSError(errno.EINVAL, "the chunk's bytes are not those its checksums name "
                      "(changed, or not all written, after they were summed): put it again")

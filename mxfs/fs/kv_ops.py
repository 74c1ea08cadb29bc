"""The KV operations of the control socket: chunks put, got, pinned, evicted.

A put is the direct write path without a name: `kv_create` makes a hidden file
and hands out write descriptors, `kv_commit` publishes it under its key (the
first writer wins; later ones are told the key is stored and their copy is
dropped).  KV chunks are a cache: they are not fsynced; a chunk whose bytes
were lost in a crash fails its checksum on read and is dropped as a miss.
"""

from __future__ import annotations

import base64
import errno
import functools
import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import trio

from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import BITE, Slice, Turns, in_bites
from mxfs.fs.fields import (
    BadField,
    Msg,
    b64_field,
    bool_field,
    from_b64,
    int_field,
    ints_field,
    sums_field,
)
from mxfs.fs.kv_claims import CLAIM_S, Claims
from mxfs.fs.kv_fields import INLINE_REPLY, MAX_BATCH, keys_field, sizes_field
from mxfs.fs.kv_follow import COPIERS, FollowerKV
from mxfs.fs.kv_forward import ForwardedKV
from mxfs.fs.limits import Limits, NodeHeld
from mxfs.fs.member_calls import MemberCalls
from mxfs.fs.remote_reads import RemoteReads
from mxfs.fs.session import (
    Answer,
    Handler,
    Lease,
    Pending,
    Reply,
    Session,
    again_while_busy,
    check_pending_room,
    drop_pending,
    open_hidden,
    open_writers_off_loop,
    overdrew,
    read_fds,
    refuse_if_degraded,
    refuse_if_writers,
    settle_off_loop,
    sparse_chunks,
)
from mxfs.fs.store_worker import SERVE_WAIT_S, StoreWorker
from mxfs.io.checksum import block_sums, pack_sums
from mxfs.meta import ROOT_INO, Inode
from mxfs.meta.usage import file_cost, key_cost
from mxfs.pool import ChunkFiles
from mxfs.pool.closer import close_later
from mxfs.pool.pool import NotAnswering
from mxfs.proto import MAX_FDS, OPS
from mxfs.proto.chunk_wire import FORWARDED_OPS
from mxfs.proto.messages import (
    ChunkReply,
    DeletedReply,
    Empty,
    EvictedReply,
    KVClaimReply,
    KVCommitReply,
    KVConfigReply,
    KVCreateReply,
    KVExistsReply,
    KVGetReply,
    KVListReply,
    KVPinReply,
    KVPutReply,
    KVStatsReply,
    KVViewReply,
    NamespaceStats,
    ReadFds,
)
from mxfs.proto.presence import HEADER_SIZE
from mxfs.vol.access import R_OK, W_OK, Caller
from mxfs.vol.kv_index import (
    TOUCH_BITE,
    VICTIMS,
    VIEW_BITE,
    Chunk,
    KVIndex,
    Namespace,
    check_key,
    check_namespace,
)
from mxfs.vol.kv_presence import Successor
from mxfs.vol.spares import ONE_MEMBER_MAX
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import OpenInode, Volume

log = logging.getLogger("mxfs.kv")

# A KV op that works in a namespace, given it checked for what the op needs.
InSpace = Callable[[Msg, Session, Namespace], Awaitable[Reply]]

KV_OPS = tuple(op for op in OPS if op.startswith("kv_"))
# A chunk's files opened slower than this waited on a member: open the rest at once
# (MXFS_KV_COLD_OPEN_US in the daemon's environment; 0: every batch at once).
def _cold_open_s() -> float:
    raw = os.environ.get("MXFS_KV_COLD_OPEN_US", "").strip()
    if raw.isascii() and raw.isdecimal():
        return int(raw) / 1e6
    if raw:
        log.warning("MXFS_KV_COLD_OPEN_US=%r is not a whole number of us: 200 is used", raw)
    return 200e-6


COLD_OPEN_S = _cold_open_s()
# Threads of their own (started on first use) for cold batches' opens, shared: however
# many cold batches run at once (each from a member-call thread, in its user's turn),
# the mount's I/O threads and trio's are not theirs to fill.
_OPENERS = ThreadPoolExecutor(8, thread_name_prefix="mxfs-kv-open")


EVICT_BITE = 4096  # victims chosen at once (~2 ms)
MAX_LIST = 1000  # chunks one kv_list reply names (page with after, as `mxfs kv ls` does)
MAX_LIST_SKIP = 20_000  # chunks a kv_list walks past in the order of use (~2 ms)
# Access times written back between looks at the clock: a round's TOUCH_BITE of 1 KiB
# keys held the thread 9 ms on SQLite in one statement; it steps aside between these.
TOUCH_STEP = 32
RELEASED_AT_ONCE = 1024  # pins and claims of a closed connection ended at once (~0.5 ms)
CLAIM_BITE = 256  # keys a claim makes, or a removal ends the claims of, between looks
NS_OPS = ("kv_ns_create", "kv_ns_remove", "kv_ns_set")
# What each op needs of a namespace: the mode bits, and whether it moves chunks (a
# caller who does not own the namespace must then have asked to share it).
_NEEDS = {"kv_put": (W_OK, True), "kv_create": (W_OK, True), "kv_commit": (W_OK, True),
          "kv_get": (R_OK, True), "kv_exists": (R_OK, True), "kv_view": (R_OK, True),
          "kv_pin": (R_OK, True), "kv_unpin": (0, False),
          "kv_claim": (W_OK, True), "kv_wait": (R_OK, True),
          "kv_list": (R_OK, False), "kv_delete": (W_OK, False), "kv_evict": (W_OK, False),
          "kv_config": (0, False)}


def _sums(chunk: Chunk) -> ChunkReply:
    """What a reader checks a chunk's bytes against (and which chunk it was: a reader's
    drop after a failed check names it, `_delete`)."""
    return {"size": chunk.size, "sum_unit": chunk.sum_unit,
            "sums": base64.b64encode(chunk.sums).decode(), "chunk": chunk.ino}


def _key(msg: Msg) -> bytes:
    return check_key(b64_field(msg, "key"))


def _mode(msg: Msg, default: int | None) -> int | None:
    if msg.get("mode") is None:
        return default
    mode = int_field(msg, "mode")
    if mode > 0o777:
        raise BadField(msg, "'mode' is a permission mode from 0 to 0777")
    return mode


def _charge(space: Namespace, key: bytes, size: int) -> int:
    """What a chunk costs its writer's byte quota once stored: its bytes, a BLOCK at
    least, and its key's row (`meta/usage.py`)."""
    return file_cost(size) + key_cost(space.name, key)


def _write_chunk(chunks: ChunkFiles | None, data: bytes | bytearray, unit: int) -> bytes:
    """Write a whole chunk into a spare's chunk files; its packed checksums."""
    assert chunks is not None
    chunks.write(0, memoryview(data))
    return pack_sums(block_sums(memoryview(data), unit))


class KVOps:
    def __init__(self, vol: Volume, index: KVIndex, limits: Limits | None = None,
                 remote: RemoteReads | None = None) -> None:
        self.vol = vol
        self.index = index
        self.limits = limits or Limits()
        self.pinned_by_uid: Counter[int] = Counter()  # read leases of every connection
        self.pins_booked: Counter[int] = Counter()  # ... and of gets still opening theirs
        self.pinned_bytes: Counter[int] = Counter()  # bytes of the chunks they lease
        self.pin_bytes_booked: Counter[int] = Counter()  # ... and gets still opening
        # Calls into the members' filesystems (the mount's set, once the daemon has it).
        self.calls = MemberCalls(len(vol.pool.members))
        self.claims = Claims(self.limits.max_kv_claims_per_user)  # keys being computed
        # Closed connections' pins and claims still to end (`let_go`).
        self._letting_go: deque[tuple[Session, list[tuple[tuple[str, bytes], Lease]],
                                      list[tuple[str, bytes]]]] = deque()
        self._let_go_wake = trio.Event()
        self._failures = FailureLog(log)
        # Other nodes' connections that hold claims or pins here (KCLM, KPIN:
        # `fs/chunk_service.py`), and for those that pinned, their node and its epoch.
        self._holders: dict[bytes, Session] = {}
        self._holder_nodes: dict[bytes, tuple[str, int]] = {}
        self._table: dict[str, Handler] | None = None  # (other nodes' KREQs: handlers())
        # The writer's KV rows read off the thread (presence tables filled, kv_list
        # pages by cursor), in the askers' turns; and the tables being filled, each by
        # one request (others wait on its event).
        self.rows = StoreWorker(vol.pool.meta_location, wait_s=SERVE_WAIT_S)
        self._filling: dict[Successor, trio.Event] = {}
        # The control socket's turns (`fs/fair.Turns`, set by `fs/control.py`).
        self.turns: Turns | None = None
        # This node's control connections (set by `fs/control.py`).
        self.sessions: Callable[[], Iterable[Session]] = lambda: ()
        # A reading node's gets: the writer's chunks, copied over (fs/kv_follow.py).
        held = NodeHeld(self.limits.max_kv_lent)  # (what both hold of its memory)
        self.follower = FollowerKV(vol, index, self.limits, trio.CapacityLimiter(COPIERS),
                                   remote, held) if vol.pool.node else None
        # ... and its puts, sent on to the writer (fs/kv_forward.py).
        self.forward = ForwardedKV(vol.pool.remote, self.limits, self._node,
                                   self.follower.views.put, held) if self.follower else None

    def view_fds(self) -> int:
        """Descriptors the presence tables hold (the writer's index's, or a reading
        node's): two each, a memfd and its mapping."""
        follower = self.follower
        return self.index.view_fds() + (2 * len(follower.views.tables) if follower else 0)

    def handlers(self) -> dict[str, Handler]:
        """The handler of each KV op.  Those that work through many items do it in
        bites (`fs/fair.py`): another user's request waits for a bite, not the whole."""
        in_space: dict[str, InSpace] = {
            "kv_put": self._put, "kv_create": self._create, "kv_commit": self._commit,
            "kv_pin": self._pin_keys, "kv_unpin": self._unpin_keys,
            "kv_exists": self._exists, "kv_view": self._view,
            "kv_claim": self._claim, "kv_wait": self._wait,
            "kv_delete": self._delete, "kv_list": self._list, "kv_config": self._config,
            "kv_evict": self._evict_to}
        table: dict[str, Handler] = {op: self._in_space(op, fn) for op, fn in in_space.items()}
        table.update({"kv_get": self.get, "kv_stats": self._stats,
                      "kv_ns_create": self._ns_create, "kv_ns_remove": self._ns_remove,
                      "kv_ns_set": self._ns_set})
        if (follower := self.follower) is not None:
            table.update({"kv_get": follower.get, "kv_exists": follower.exists,
                          "kv_view": follower.view})
            assert self.forward is not None
            fwd = self.forward
            table.update({"kv_put": fwd.put, "kv_create": fwd.create, "kv_commit": fwd.commit,
                          "kv_claim": fwd.claim, "kv_wait": fwd.wait, "kv_pin": fwd.pin,
                          "kv_unpin": fwd.unpin})
            table.update({op: fwd.asked(op) for op in FORWARDED_OPS})
        return table

    def _in_space(self, op: str, fn: InSpace) -> Handler:
        """`fn` given the namespace `op` works in, checked for what `op` needs of the
        caller."""
        async def handler(msg: Msg, session: Session) -> Reply:
            space = self._space(op, msg, session.caller)
            reply = await fn(msg, session, space)
            # (a put took it past FULL: filled here, unless another request fills it)
            await self._grow_view(space, session.caller.uid, wait=False)
            return reply
        return handler

    async def _stats(self, msg: Msg, session: Session) -> Answer[KVStatsReply]:
        caller = session.caller
        ns = msg.get("namespace")
        spaces = [self.index.space(ns, caller)] if ns is not None else [
            s for s in self.index.spaces.values() if s.may(caller, R_OK)]
        stats = []
        async for some in in_bites(spaces, BITE):  # (a tenant may make thousands)
            stats += [s.stats() for s in some]
        if caller.uid == 0:
            return {"namespaces": stats, "claims": len(self.claims),
                    "node_claimants": len(self._holders)}, []
        # Others count only the namespaces they may read: a count over all showed, live,
        # the prefills another tenant had under way in one that answers her ENOENT.
        return {"namespaces": stats, "claims": sum(self.claims.in_space(s.name)
                                                   for s in spaces),
                "node_claimants": 0}, []

    def _node(self) -> tuple[str, int]:
        """This reading node's name and the epoch of its lease (what its pins on the
        writer live as long as)."""
        held = self.vol.lease
        return self.vol.pool.node, held.epoch if held is not None else 0

    async def _pin_keys(self, msg: Msg, session: Session, space: Namespace
                        ) -> Answer[KVPinReply]:
        """Read leases on the stored keys, looked up a bite at a time (4,096 keys held
        the thread 12 ms at once), then judged again and leased with no await."""
        keys = keys_field(msg)
        found: list[Chunk | None] = []
        async for bite in in_bites(keys, BITE * 16):
            found += [self.index.lookup(space, k) for k in bite]
        if self._space("kv_pin", msg, session.caller) is not space:
            raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed meanwhile")
        return {"pinned": self._lease_found(session, space, keys, found)}, []

    def _pin(self, session: Session, space: Namespace, keys: list[bytes]) -> list[bool]:
        """Read leases of `session` on the stored `keys` (all or none: past a limit,
        EMFILE); which were stored."""
        return self._lease_found(session, space, keys,
                                 [self.index.lookup(space, k) for k in keys])

    def _lease_found(self, session: Session, space: Namespace, keys: list[bytes],
                     found: list[Chunk | None]) -> list[bool]:
        """`_pin` of the chunks `found` for `keys` (looked up before: those evicted or
        put again since are not leased)."""
        found = [c if c is not None and space.chunks.get(k) is c else None
                 for k, c in zip(keys, found, strict=True)]
        self._check_pins(session, sum(c is not None for c in found),
                         self._new_bytes(session, space, zip(keys, found, strict=True)))
        for key, chunk in zip(keys, found, strict=True):
            if chunk is not None:
                self._lease(session, space, key, chunk)
        return [c is not None for c in found]

    async def _unpin_keys(self, msg: Msg, session: Session, space: Namespace
                          ) -> Answer[Empty]:
        self._unpin(session, space, keys_field(msg))
        return {}, []

    async def _exists(self, msg: Msg, session: Session, space: Namespace
                      ) -> Answer[KVExistsReply]:
        return {"present": [k in space.chunks for k in keys_field(msg)]}, []

    async def _view(self, msg: Msg, session: Session, space: Namespace
                    ) -> Answer[KVViewReply]:
        """A read-only descriptor of the namespace's presence table: the caller answers
        exists from it without asking (`proto/presence.py`)."""
        self.index.viewed(space, session.tenant)
        if space.view is None:
            self.index.start_view(space)
            await self._grow_view(space, session.caller.uid)
            # Judged again: an owner's chmod while the table was filled retired that
            # fill, and a fill begun after it by someone still let in was handed to
            # this caller too, who may read the namespace's keys no more.
            if self._space("kv_view", msg, session.caller) is not space:
                raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed "
                              "meanwhile")
        table = space.view
        if table is None:  # (removed, or its table retired, while it was filled)
            if self.index.spaces.get(space.name) is not space:
                raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed "
                              "meanwhile")
            raise OSError(errno.EAGAIN, f"the table of KV namespace {space.name!r} was "
                          "retired while it was filled (more namespaces are viewed than "
                          "the daemon keeps tables for): ask again")
        return {"size": HEADER_SIZE + 8 * table.slots}, [table.reader_fd()]

    async def _grow_view(self, space: Namespace, uid: int, wait: bool = True) -> None:
        """Fill the namespace's next presence table a bite at a time, its keys read in
        `uid`'s turn on a worker's connection (`_committed`), copied in here: a bite
        read on the thread held it 2 ms.  One request fills a table; others wait for
        it, or with `wait` off go on (every op on the namespace grew its table after
        it: each waited for a fill of a million keys read in another user's turns, a
        writer who put and deleted keys in a loop having it rebuilt again and again;
        readers ask the daemon meanwhile, and only `kv_view` needs the table)."""
        while (growing := space.next_view) is not None:
            filled = self._filling.get(growing)
            if filled is not None:
                if not wait:
                    return
                await filled.wait()
                continue
            filled = self._filling[growing] = trio.Event()
            try:
                await self._fill(space, growing, uid)
            finally:
                del self._filling[growing]
                filled.set()

    async def _fill(self, space: Namespace, growing: Successor, uid: int) -> None:
        ns, share = space.name, Slice()
        worker = self._committed(ns)
        while space.next_view is growing:
            keys = await self._keys_after(worker, ns, growing.after, VIEW_BITE, uid)
            if space.next_view is not growing:  # (retired, or the namespace removed)
                return
            self.index.grow_view(space, keys)
            if worker is None:
                await share.due()

    def _committed(self, ns: str) -> StoreWorker | None:
        """The worker whose connection may read namespace `ns`'s KV rows for this
        thread: the open group committed first if it changed them, as it sees committed
        rows only (a put since is in memory, which the caller checks what it read
        against).  None where the commit failed (a full metadata member): the rows are
        read here then."""
        store = self.vol.store
        if not store.kv_uncommitted(ns):
            return self.rows
        try:
            store.commit()
        except OSError:  # (the group commit tells why, once)
            return None
        return self.rows

    async def _keys_after(self, worker: StoreWorker | None, ns: str, after: bytes | None,
                          limit: int, uid: int) -> list[bytes]:
        """`KVRows.keys_after` on `worker` in `uid`'s turn (None: here)."""
        if worker is None:
            return self.vol.store.kv.keys_after(ns, after, limit)
        return await worker.run(lambda s: s.kv.keys_after(ns, after, limit), uid)

    async def _claim(self, msg: Msg, session: Session, space: Namespace
                     ) -> Answer[KVClaimReply]:
        ms = int_field(msg, "ms", int(CLAIM_S * 1000))
        states: list[str] = []
        async for some in in_bites(keys_field(msg), CLAIM_BITE):  # (4,096 keys: 6-8 ms)
            if states and self.index.spaces.get(space.name) is not space:
                raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed "
                              "meanwhile")
            states += self.claims.claim(space, list(some), session, ms / 1000)
        return {"state": states}, []

    async def _wait(self, msg: Msg, session: Session, space: Namespace
                    ) -> Answer[KVExistsReply]:
        ms = int_field(msg, "ms", int(CLAIM_S * 1000))
        return {"present": await self._await_claims(space, keys_field(msg), session,
                                                    ms / 1000)}, []

    async def _await_claims(self, space: Namespace, keys: list[bytes], session: Session,
                            seconds: float) -> list[bool]:
        """`Claims.wait` out of the caller's turn (`Turns.aside`): what it waits on is
        another user's compute, and a user's waits held all her turns, her other
        requests behind them."""
        if self.turns is None:
            return await self.claims.wait(space, keys, session, seconds)
        async with self.turns.aside(session.caller.uid):
            return await self.claims.wait(space, keys, session, seconds)

    async def _delete(self, msg: Msg, session: Session, space: Namespace
                      ) -> Answer[DeletedReply]:
        """Delete keys; with `inos`, each only while it is still that chunk (a reader
        dropping one that failed its checksum: a put of the key since is not it)."""
        keys = keys_field(msg)
        inos = ints_field(msg, "inos", MAX_BATCH) if "inos" in msg else None
        if inos is not None:
            if len(inos) != len(keys):
                raise OSError(errno.EINVAL, "'inos' must name one chunk a key")
            keys = [k for k, ino in zip(keys, inos, strict=True)
                    if (c := space.chunks.get(k)) is not None and c.ino == ino]
        deleted = 0
        async for bite in in_bites(keys, BITE):
            deleted += self.index.remove(space, list(bite))
        return {"deleted": deleted}, []

    async def _list(self, msg: Msg, session: Session, space: Namespace) -> Answer[KVListReply]:
        """A page of the namespace's chunks: past the key `after` in key order (read
        from the store's index: a page costs its own keys), or from the `skip`-th in
        the order of use (walked from the start: at most MAX_LIST_SKIP, so no request
        walks a million keys on trio's thread)."""
        limit = min(int_field(msg, "limit", 1000), MAX_LIST)
        if msg.get("after") is not None:
            after, ns = b64_field(msg, "after"), space.name
            worker = self._committed(ns)  # (a page read on the thread held it 2 ms)
            keys = await self._keys_after(worker, ns, after, limit, session.caller.uid)
            items = [(k, space.chunks[k]) for k in keys if k in space.chunks]
        else:
            skip = int_field(msg, "skip", 0)
            if skip > MAX_LIST_SKIP:
                raise OSError(errno.EINVAL, f"kv_list skips at most {MAX_LIST_SKIP} chunks: "
                              "page with 'after' (the last key of the page before)")
            n = len(space.chunks)
            items = list(itertools.islice(space.chunks.items(), min(skip, n),
                                          min(skip + limit, n)))
        return {"chunks": [[base64.b64encode(k).decode(), c.size, c.pins]
                           for k, c in items]}, []

    async def _config(self, msg: Msg, session: Session, space: Namespace
                      ) -> Answer[KVConfigReply]:
        self.index.configure(space, session.caller, int_field(msg, "capacity"))
        target = self.index.over(space)
        evicted = 0 if target is None else await self._evict(space, target)
        return {"evicted": evicted, **space.stats()}, []

    async def _evict_to(self, msg: Msg, session: Session, space: Namespace
                        ) -> Answer[EvictedReply]:
        return {"evicted": await self._evict(space, int_field(msg, "keep", 0))}, []

    async def _evict(self, space: Namespace, target: int) -> int:
        """Evict down to `target` bytes a bite at a time (victims chosen EVICT_BITE at a
        time too: a list of a million held the thread 0.4 s); how many chunks went.
        A walk that met only pinned chunks passed VICTIMS of them: the next goes on past
        them, after others had their turn, until one round of the namespace is done."""
        evicted, empty, share = 0, 0, Slice()
        while self.index.spaces.get(space.name) is space:
            victims = self.index.victims(space, target, EVICT_BITE)
            if not victims:
                if not self.index.may_evict(space, target) \
                        or empty > len(space.chunks) // VICTIMS:
                    break
                empty += 1
                await share.due()
                continue
            space.evictions += len(victims)
            before = space.used
            await self._drop_in_bites(victims)
            evicted += len(victims)
            if space.used >= before:  # (all pinned or gone meanwhile: no progress)
                break
        return evicted

    async def _enforce(self, space: Namespace) -> int:
        """After a put: above the namespace's capacity, evict down to its low watermark,
        a bite at a time (one put over a capacity of 65,536 chunks held every user
        for 48 s when it evicted them all at once)."""
        target = self.index.over(space)
        return 0 if target is None else await self._evict(space, target)

    async def _drop_in_bites(self, victims: list[tuple[Namespace, bytes]]) -> None:
        """Evict `victims` a bite at a time, other requests served between: each bite
        skips what went or was pinned meanwhile, and namespaces removed meanwhile."""
        async for bite in in_bites(victims, BITE):
            self.index.drop([(s, k) for s, k in bite if self.index.spaces.get(s.name) is s
                             and k in s.chunks and not s.chunks[k].pins])

    def _space(self, op: str, msg: Msg, caller: Caller) -> Namespace:
        """The namespace `op` works in, checked for what it needs of the caller."""
        mask, moves = _NEEDS[op]
        shared = bool_field(msg, "shared")
        # Puts (and setting a capacity) may make the namespace on first use: private
        # to its maker unless the request gives a mode.  Other ops need one that exists.
        create = _mode(msg, 0o700) if op in ("kv_put", "kv_create", "kv_config",
                                             "kv_claim") else None
        return self.index.space(msg.get("namespace"), caller, mask, shared or not moves,
                                create_mode=create)

    async def _ns_remove(self, msg: Msg, session: Session) -> Answer[DeletedReply]:
        """Remove a namespace with its chunks, a bite at a time (puts racing the removal
        are removed with it): its owner or root."""
        caller = session.caller
        name = check_namespace(msg.get("namespace"))
        space = self.index.space(name, caller)
        if caller.uid not in (0, space.uid):
            raise OSError(errno.EPERM, "only the namespace's owner or root removes it")
        deleted, share = 0, Slice()
        while space.chunks and self.index.spaces.get(name) is space:
            deleted += self.index.remove(space, list(itertools.islice(space.chunks, BITE)))
            await share.due()
        if self.index.spaces.get(name) is not space:
            raise OSError(errno.ENOENT, f"KV namespace {name!r} was removed meanwhile")
        deleted += self.index.drop_namespace(space)
        await self._drop_claims(name)
        return {"deleted": deleted}, []

    async def _drop_claims(self, name: str) -> None:
        """Namespace `name` was removed, or taken over: its claims bind nobody now,
        ended a bite at a time (claims made meanwhile, on the namespace as it is now,
        are kept)."""
        async for some in in_bites(self.claims.claimed_in(name), CLAIM_BITE):
            self.claims.dropped(name, some)

    async def _ns_set(self, msg: Msg, session: Session) -> Answer[NamespaceStats]:
        """Give a namespace another group or mode, as chgrp and chmod a folder: its
        owner (to a group of her own) or root.  One that may let someone in no more
        ends the presence tables handed out (`KVIndex.set_access`): cutting a user off
        a shared namespace (one who left its group keeps the group in the processes
        she runs, as the mount judges them too) is a change of the namespace's."""
        caller = session.caller
        space = self.index.space(msg.get("namespace"), caller, 0)
        if caller.uid not in (0, space.uid):
            raise OSError(errno.EPERM, "only the namespace's owner or root changes its "
                          "group or mode")
        gid = int_field(msg, "gid", space.gid)
        if caller.uid != 0 and gid != space.gid and gid not in caller.gids:
            raise OSError(errno.EPERM, "a namespace's owner may give it only to a group "
                          "of her own")
        mode = _mode(msg, None)
        if self.index.set_access(space, gid, space.mode if mode is None else mode):
            await self._end_rights_of_the_shut_out(space)
        return {**space.stats()}, []

    async def _end_rights_of_the_shut_out(self, space: Namespace) -> None:
        """End the claims on `space`'s keys of every connection whose caller may write
        it no more, and the read leases on its chunks of every connection (this node's
        and other nodes') whose caller may read it no more: a lease is a right to read,
        and a reader the owner shut out kept chunks she could no longer get from
        eviction (past the namespace's capacity, charged to their writers) for as long
        as her connection stayed open."""
        name = space.name
        async for keys in in_bites(self.claims.claimed_in(name), EVICT_BITE):
            self.claims.shut_out(name, keys, lambda s: space.may(s.caller, W_OK))
        for session in [*self.sessions(), *self._holders.values()]:
            if not space.pinned:  # (none left to end: no connection's pins looked at)
                return
            if not session.pins or space.may(session.caller, R_OK):
                continue
            found: list[tuple[tuple[str, bytes], Lease]] = []  # (in bites: a connection
            async for bite in in_bites(list(session.pins.items()), EVICT_BITE):  # holds
                found += [(k, held) for k, held in bite if k[0] == name]  # 65,536 pins)
            # (those it still holds: it may have unpinned some, or closed, meanwhile)
            lost = [(k, held) for k, held in found if session.pins.get(k) is held]
            for k, held in lost:
                del session.pins[k]
                session.pinned -= held.n
            self._unpin_all(session.tenant, lost)

    async def _ns_create(self, msg: Msg, session: Session) -> Answer[NamespaceStats]:
        """Make a namespace ahead of its users (root: for anyone, taking over a name
        with `force`; others: for themselves)."""
        caller = session.caller
        name = check_namespace(msg.get("namespace"))
        uid = int_field(msg, "uid", caller.uid)
        gid = int_field(msg, "gid", caller.gid)
        force = bool_field(msg, "force")
        if caller.uid != 0 and (uid != caller.uid or gid not in caller.gids or force):
            raise OSError(errno.EPERM, "only root makes a namespace for another user or "
                          "group, or takes over an existing one")
        old = self.index.spaces.get(name)
        existed = old is not None
        if old is not None and not old.visible(caller):  # (root sees every namespace)
            raise self.index.taken(name, caller.uid, errno.EEXIST)
        if not existed:
            self.index.check_room(caller.uid)
        space = self.index.create(name, uid, gid, _mode(msg, 0o700) or 0,
                                  int_field(msg, "capacity", 0), replace=force)
        if existed:  # (taken over: the old namespace's claims bind nobody in the new)
            await self._drop_claims(name)
        return {**space.stats()}, []

    async def _room(self, space: Namespace, key: bytes, size: int, uid: int) -> Inode:
        """Fail fast when the chunk cannot fit (EFBIG, ENOSPC, EDQUOT: the writer `uid`
        has put as many chunks as one uid may, those being stored counted, wherever
        they are, or is at its quota: `_charge`); returns the layout parent.  The space
        is measured first (its one await): the checks after it and the caller's taking
        of a spare run with no await between, so puts at once never pass the same
        room."""
        root = self.vol.store.get(ROOT_INO)
        layout = self.vol.pool.layout_for(0, root.stripe_unit, root.stripe_width)
        members = list(range(len(self.vol.pool.members)))[:max(1, layout.width)]
        share = -(-size // layout.width)
        if self.index.rooms_stale(members, share):  # (statvfs: off the loop, guarded)
            await self.calls.run(functools.partial(
                self.index.measure_rooms, members, share, self.calls.guarded), uid)
            if not self.index.rooms_known():  # (no thread free in time)
                raise OSError(errno.EAGAIN, "the members' free space could not be "
                              "measured in time: try again")
        self.vol.quotas.room(uid, _charge(space, key, size), 1)
        tenant = tenant_of(uid)
        held = self.index.chunks_by_tenant[tenant] + self.index.storing_by_tenant[tenant]
        if tenant != 0 and held >= self.limits.max_chunks_per_user:
            raise OSError(errno.EDQUOT, f"uid {tenant} has put {held} KV chunks that are "
                          "still stored (with its subordinate uids'), the limit (mount "
                          "option max_chunks_per_user): delete or evict some")
        self.index.refuse_hopeless(space, size)
        victims = self.index.make_room(members, share)
        if victims is not None:
            await self._drop_in_bites(victims)
            raise OSError(errno.ENOSPC, "the pool is short of space for KV chunks; "
                          "least recently used chunks are being evicted")
        return root

    async def _put(self, msg: Msg, session: Session, space: Namespace) -> Answer[KVPutReply]:
        """Small chunks in one request: the daemon writes them (no descriptors passed)."""
        keys, data = keys_field(msg), msg.get("data")
        if not isinstance(data, list) or len(data) != len(keys):
            raise BadField(msg, "needs 'data': one base64 string per key")
        refuse_if_degraded(self.vol)
        items: list[tuple[bytes, bytes]] = []
        for key, b64 in zip(keys, data, strict=True):
            if not isinstance(b64, str):
                raise BadField(msg, "'data' holds base64 strings")
            try:
                items.append((key, from_b64(b64)))
            except ValueError:
                raise BadField(msg, "'data' is not base64") from None
        stored = await self._store(space, items, session.caller)
        if self.index.spaces.get(space.name) is not space:
            raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed "
                          f"meanwhile ({sum(stored)} chunks were stored)")
        evicted = await self._enforce(space)
        self._visible()
        return {"stored": stored, "evicted": evicted}, []

    async def put_from_node(self, caller: Caller, namespace: str, mode: int | None,
                            shared: bool, key: bytes, data: bytearray) -> bool:
        """A chunk a reading node's user put (`fs/chunk_service.py`, KPUT), judged as
        that caller's put here: True if stored, False if the key was there."""
        space = self.index.space(namespace, caller, W_OK, shared,
                                 create_mode=0o700 if mode is None else mode & 0o777)
        check_key(key)
        refuse_if_degraded(self.vol)
        (stored,) = await self._store(space, [(key, data)], caller)
        if stored:
            await self._enforce(space)
            self._visible()
            await self._grow_view(space, caller.uid, wait=False)
        return stored

    async def _store(self, space: Namespace, items: Sequence[tuple[bytes, bytes | bytearray]],
                     caller: Caller) -> list[bool]:
        """`caller`'s chunks into spares, hashed and indexed: each judged (room, its
        bytes reserved against the quota until indexed) and given a spare here, all
        written in one worker thread through the member guard (a member that stopped
        answering holds its callers alone, never the loop), then indexed here in order.
        False for a key stored already (first wins, also meanwhile, or twice in
        `items`) or whose namespace went meanwhile.  A refusal (room, a write) raises
        once the chunks before it are stored, as putting them one at a time would.
        The caller enforces the capacity and commits."""
        stored = [False] * len(items)
        tenant = tenant_of(caller.uid)  # (whose chunk count they are in: `_room`)
        taken: list[tuple[int, bytes, bytes | bytearray, OpenInode, int, int]] = []
        seen: set[bytes] = set()
        refusal: OSError | None = None
        share = Slice()
        let_go = 0  # taken[:let_go] are given back (`release`)

        def release(upto: int) -> None:
            """Give back taken[let_go:upto]: their reservations, and their spares'
            inodes (each a chunk indexed, or to orphan); one at a time, in the slices
            that index them (4,096 at the end held the thread 20-30 ms)."""
            nonlocal let_go
            for _, key, data, entry, _, _ in taken[let_go:upto]:
                let_go += 1
                self.vol.quotas.release(caller.uid, _charge(space, key, len(data)))
                self.index.storing_by_tenant[tenant] -= 1
                self.vol.release(entry.node.ino)
        try:
            for i, (key, data) in enumerate(items):
                if taken:
                    await share.due()
                if key in space.chunks or key in seen:
                    continue
                try:
                    await self._room(space, key, len(data), caller.uid)
                    if self.index.spaces.get(space.name) is not space:
                        break  # (removed while others ran)
                    entry = self.vol.take_spare(caller.uid, caller.gid)
                except OSError as e:
                    refusal = e
                    break
                self.vol.quotas.reserve(caller.uid, _charge(space, key, len(data)))
                self.index.storing_by_tenant[tenant] += 1
                seen.add(key)
                layout = self.vol.layout(entry.node)
                taken.append((i, key, data, entry, layout.first, layout.unit))
            sums = await self._write_spares(taken, caller.uid) if taken else []
            for n, ((i, key, data, entry, _, unit), got) in enumerate(
                    zip(taken, sums, strict=True)):
                if isinstance(got, OSError):
                    refusal = got  # (earlier than a refusal of room, which came after all)
                    break
                if n:
                    await share.due()
                if key not in space.chunks and self.index.spaces.get(space.name) is space:
                    self.index.insert(space, key, entry.node.ino, len(data), unit, got,
                                      entry.node.uid)
                    self.claims.stored(space, key)
                    stored[i] = True
                release(n + 1)
            while let_go < len(taken):  # (those after a refusal of a write)
                await share.due()
                release(min(let_go + BITE, len(taken)))
        finally:
            release(len(taken))  # (cancelled, or failed: at once)
            if not self.index.storing_by_tenant[tenant]:
                del self.index.storing_by_tenant[tenant]
        if refusal is not None:
            raise refusal
        return stored

    async def _write_spares(self, taken: Sequence[tuple[int, bytes, bytes | bytearray,
                                                         OpenInode, int, int]],
                            uid: int) -> list[bytes | OSError]:
        """Each chunk written into its spare and its checksums, in one worker thread in
        `uid`'s turn, every chunk file opened through the member guard (its write and
        hashing, which take as long as their bytes do, outside it): the packed sums, or
        the error (EIO at once for a member judged not answering)."""
        guarded = self.calls.guarded

        def write_all() -> list[bytes | OSError]:
            out: list[bytes | OSError] = []
            for _, _, data, entry, member, unit in taken:
                try:
                    chunks = entry.chunks
                    assert chunks is not None
                    if guarded(member, functools.partial(chunks.fd, member, True)) is None:
                        raise NotAnswering(errno.EIO, f"member {member} is not answering: "
                                           "the chunk was not stored")
                    out.append(_write_chunk(chunks, data, unit))
                except OSError as e:
                    out.append(e)
            return out
        return await self.calls.run_whole(write_all, uid, (t[4] for t in taken))

    async def claim_from_node(self, caller: Caller, namespace: str, shared: bool,
                              keys: list[bytes], seconds: float, holder: bytes,
                              release: bool) -> list[str]:
        """`kv_claim` of a reading node's connection (`holder`), as that caller's here;
        `release`: the connection closed, its claims end."""
        if release:
            self._let_go(holder)
            return []
        keys = [check_key(k) for k in keys]
        space = self.index.space(namespace, caller, W_OK, shared, create_mode=0o700)
        session = self._holder(holder, caller)
        try:
            return self.claims.claim(space, keys, session, seconds)
        finally:
            self._forget_idle(holder, session)

    async def wait_from_node(self, caller: Caller, namespace: str, shared: bool,
                             keys: list[bytes], seconds: float, holder: bytes
                             ) -> list[bool]:
        """`kv_wait` of a reading node's connection (`holder`), as that caller's here."""
        keys = [check_key(k) for k in keys]
        space = self.index.space(namespace, caller, R_OK, shared)
        session = self._holders.get(holder) or Session(caller)
        return await self._await_claims(space, keys, session, seconds)

    async def request_from_node(self, caller: Caller, op: str, msg: dict[str, Any]
                                ) -> dict[str, Any]:
        """One of FORWARDED_OPS a reading node's user asked there, answered as that
        caller's request here (a connection of its own, ended with the request)."""
        if op not in FORWARDED_OPS:
            raise OSError(errno.EPERM, f"{op[:32]} is not asked of another node")
        if self._table is None:
            self._table = self.handlers()
        session = Session(caller)
        try:
            reply, fds = await self._table[op]({**msg, "op": op}, session)
        finally:
            self.release(session)
        for fd in fds:  # (none of these ops answers with descriptors)
            os.close(fd)
        return dict(reply)

    async def pin_from_node(self, caller: Caller, namespace: str, shared: bool,
                            keys: list[bytes], holder: bytes, node: tuple[str, int]
                            ) -> list[bool]:
        """`pin` of a reading node's connection (`holder`) on `node` (its name and
        epoch), as that caller's here: which keys were leased."""
        keys = [check_key(k) for k in keys]
        space = self.index.space(namespace, caller, R_OK, shared)
        session = self._holder(holder, caller)
        self._holder_nodes[holder] = node
        try:
            return self._pin(session, space, keys)
        finally:
            self._forget_idle(holder, session)

    async def unpin_from_node(self, caller: Caller, namespace: str, shared: bool,
                              keys: list[bytes], holder: bytes) -> None:
        """`unpin` of a reading node's connection (`holder`), as that caller's here."""
        session = self._holders.get(holder)
        if session is None:
            return
        space = self.index.space(namespace, caller, R_OK, shared)
        self._unpin(session, space, [check_key(k) for k in keys])
        self._forget_idle(holder, session)

    async def sweep(self) -> None:
        """Now and then (the daemon, once a second): claims run out are dropped, a bite
        at a time, the pins of nodes whose lease ran out (or that joined again since)
        end, and other nodes' connections that hold neither are forgotten; a node that
        died never says it let them go."""
        share = Slice()
        while self.claims.drop_run_out():
            await share.due()
        if not self._holders:
            return
        alive = self.vol.reader_epochs
        for holder, (name, epoch) in list(self._holder_nodes.items()):
            if alive.get(name, epoch + 1) > epoch:  # (a newer epoch: not counted yet)
                log.info("KV pins of node %s (epoch %d) end: its lease ran out", name,
                         epoch)
                self._let_go(holder)
        for holder, session in list(self._holders.items()):
            self._forget_idle(holder, session)

    def _holder(self, holder: bytes, caller: Caller) -> Session:
        """The session here of a reading node's connection, made on its first request."""
        session = self._holders.get(holder)
        if session is None:
            session = self._holders[holder] = Session(caller)
        return session

    def _let_go(self, holder: bytes) -> None:
        """A reading node's connection closed (or its node died): its claims and pins
        end."""
        session = self._holders.pop(holder, None)
        self._holder_nodes.pop(holder, None)
        if session is not None:
            self.release(session)

    def _forget_idle(self, holder: bytes, session: Session) -> None:
        """A reading node's connection that holds no claim and no pin is not
        remembered."""
        if not self.claims.holds(session) and not session.pinned and \
                self._holders.get(holder) is session:
            del self._holders[holder]
            self._holder_nodes.pop(holder, None)

    def _visible(self) -> None:
        """While reading nodes are alive, what a put stored is committed before it is
        answered: their next lookup finds it (`fs/kv_follow.py`)."""
        if self.vol.readers:
            self.vol.store.commit()

    async def _create(self, msg: Msg, session: Session, space: Namespace
                      ) -> Answer[KVCreateReply]:
        key, size = _key(msg), int_field(msg, "size")
        if key in space.chunks:
            return {"exists": True}, []  # the cheap answer to a repeated put
        check_pending_room(session, self.limits, self.vol)
        caller = session.caller
        root = await self._room(space, key, size, caller.uid)
        if self.index.spaces.get(space.name) is not space:
            raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed meanwhile")
        extra = key_cost(space.name, key)  # (its row: charged at the commit)
        with session.booking(size, extra):
            if size <= ONE_MEMBER_MAX:  # a spare: committed, its one chunk file made ahead
                entry, members, fds = await self._open_spare(caller)
            else:  # striped over the members, as the root's files are
                entry, members, fds = await open_hidden(self.vol, root, 0o600, caller.uid,
                                                        caller.gid, self.calls)
        session.hold(Pending(entry, "", size, extra=extra, namespace=space.name), booked=True)
        return {"exists": False, "ino": entry.node.ino,
                "layout": self.vol.layout(entry.node).describe(), "members": members}, fds

    async def _open_spare(self, caller: Caller) -> tuple[OpenInode, list[int], list[int]]:
        """A spare of `caller`'s (`vol/spares.py`) and a write descriptor of its chunk
        file: (entry, [member], [fd]), opened off the loop (a member that stopped
        answering held every user's request behind one put).  Opening the file its
        maker made is a lookup, where `open_hidden` commits the store and creates a
        file a member."""
        refuse_if_degraded(self.vol)
        entry = self.vol.take_spare(caller.uid, caller.gid)
        chunks = entry.chunks
        assert chunks is not None

        def prepare() -> None:  # (done by its maker, or here and never by it: no
            try:  # writer of ours is left; its maker may hold the file's lock, hung)
                self.calls.guarded(chunks.layout.first, chunks.prepare)
            except OSError:
                pass  # the open makes the file, probing and reporting its member
        return await open_writers_off_loop(self.vol, entry, self.calls, caller.uid, prepare)

    async def _commit(self, msg: Msg, session: Session, space: Namespace
                      ) -> Answer[KVCommitReply]:
        pending = session.pending.get(int_field(msg, "ino"))
        if pending is None or pending.path:
            raise OSError(errno.EBADF, f"inode {msg.get('ino')} is not a KV chunk written here")
        if pending.namespace != space.name:  # (its room was judged for that one's owner)
            raise OSError(errno.EINVAL, f"inode {pending.entry.node.ino} was made for KV "
                          f"namespace {pending.namespace!r}: commit it there")
        entry = pending.entry
        key, size = _key(msg), int_field(msg, "size")
        sum_unit, sums = sums_field(msg, self.vol.layout(entry.node).unit, size)

        overdrawn = OSError(errno.EFBIG, f"wrote past the {pending.declared} bytes "
                            "declared at kv_create: refused, and the chunk's space reclaimed")
        was = pending.overdrawn

        def settled() -> OSError | None:
            """Why the writer did not keep to its word, or None and the chunk is settled
            at `size` (stats, leases and a truncate of its chunk files, off the loop:
            cutting back 256 MiB of dirty pages held the one thread 23-46 ms, and a
            member that stopped answering held it for good; a spare's in a member call,
            a few at a time on its member, not behind others' commits' syncs)."""
            if overdrew(self.vol, pending):
                if not was:  # (found here first: her other files go too)
                    self.vol.caught(session.tenant)
                return overdrawn
            refuse_if_writers(self.vol, pending)
            self.vol.settle_hidden(entry, size, sync=False)
            sparse = sparse_chunks(self.vol, entry.node, size)
            if sparse:
                return OSError(errno.EINVAL, f"the chunk's files on member(s) "
                               f"{', '.join(map(str, sparse))} hold holes: write all "
                               f"{size} bytes before kv_commit (refused, its space "
                               "reclaimed)")
            return None
        uid = session.caller.uid
        refused = overdrawn if size > pending.declared else await again_while_busy(
            lambda: settle_off_loop(uid, settled) if pending.declared > ONE_MEMBER_MAX
            else self.calls.run_whole(settled, uid,
                                      self.vol.layout(entry.node).used_members()))
        if refused is not None:
            await drop_pending(self.vol, session, entry.node.ino)
            raise refused
        if self.index.spaces.get(space.name) is not space:  # (removed meanwhile)
            await drop_pending(self.vol, session, entry.node.ino)
            raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed meanwhile")
        stored = True
        try:
            self.index.insert(space, key, entry.node.ino, size, sum_unit, sums,
                              entry.node.uid)
        except FileExistsError:
            stored = False  # another writer won; this copy is dropped below
        self.claims.stored(space, key)
        session.let_go(entry.node.ino)
        self.vol.release(entry.node.ino)
        evicted = await self._enforce(space) if stored else 0
        self._visible()
        return {"stored": stored, "evicted": evicted}, []

    async def get(self, msg: Msg, session: Session) -> Answer[KVGetReply]:
        """Layout, checksums and read descriptors of each present key (None: a miss);
        with "odirect", an O_DIRECT descriptor beside each buffered one, so that cold
        chunks go from the members to the engine's buffer without the page cache.

        The chunk files are opened, and small chunks read, in a worker thread in the
        caller's turn (`_fetch`): opening one whose inode is not cached waits on its
        member (most of a cold lookup: 3.5 ms of a batch of 8 on one disk; forever on
        a member that stopped answering).  A key evicted meanwhile is a miss."""
        space = self._space("kv_get", msg, session.caller)
        pin = bool_field(msg, "pin")
        odirect = bool_field(msg, "odirect")
        inline_max = int_field(msg, "inline_max", 0)
        budget = INLINE_REPLY  # base64 of what rides inline must stay under MAX_PAYLOAD
        out: list[ChunkReply | None] = []
        wanted: list[tuple[int, bytes, Chunk, Inode]] = []  # (slot in out, key, chunk, node)
        most = 0  # descriptors the opens may return, at most
        keys = keys_field(msg)
        sizes = sizes_field(msg, len(keys))
        inline: list[tuple[int, bytes, Chunk, Inode]] = []  # (the same, read below)
        share = Slice()
        for key, want in zip(keys, sizes, strict=True):
            await share.due()  # (4,096 keys, each a row and a file: others run between)
            if want is not None and (have := space.chunks.get(key)) is not None and \
                    have.size != want:  # the caller's buffer cannot take it: its miss
                space.misses += 1
                out.append({"size": have.size})
                continue
            chunk = self.index.lookup(space, key)
            if chunk is None:
                out.append(None)
                continue
            node = self.vol.store.get(chunk.ino)
            if chunk.size <= min(inline_max, budget):  # small: the bytes ride in the reply
                budget -= chunk.size
                inline.append((len(out), key, chunk, node))
                out.append(None)
                continue
            most += len(self.vol.layout(node).holding(chunk.size)) * (2 if odirect else 1)
            if most > MAX_FDS:
                raise OSError(errno.E2BIG, f"ask for fewer keys at once (over {MAX_FDS} "
                              "descriptors)")
            wanted.append((len(out), key, chunk, node))
            out.append(None)
        booked = 0
        if pin:  # (counted from the check on: gets awaiting their opens passed it too)
            booked = self._new_bytes(session, space, ((k, c) for _, k, c, _ in wanted))
            self._check_pins(session, len(wanted), booked)
            self.pins_booked[session.tenant] += len(wanted)
            self.pin_bytes_booked[session.tenant] += booked
        try:
            opened, datas = await self._fetch([n for _, _, _, n in wanted],
                                              [n for _, _, _, n in inline], odirect,
                                              session.caller.uid)
        finally:
            if pin:
                self.pins_booked[session.tenant] -= len(wanted)
                if not self.pins_booked[session.tenant]:
                    del self.pins_booked[session.tenant]
                self.pin_bytes_booked[session.tenant] -= booked
                if not self.pin_bytes_booked[session.tenant]:
                    del self.pin_bytes_booked[session.tenant]
        try:  # judged again: an owner's chmod while the opens waited found no leases
            # of this get to end, and it handed out what its caller may read no more
            if self._space("kv_get", msg, session.caller) is not space:
                raise OSError(errno.ENOENT, f"KV namespace {space.name!r} was removed "
                              "meanwhile")
        except OSError:
            for _, got in opened:
                close_later(got)  # (a close can wait on the member)
            raise
        for (slot, key, chunk, _), data in zip(inline, datas, strict=True):
            if space.chunks.get(key) is chunk:  # (evicted meanwhile: a miss)
                out[slot] = {**_sums(chunk), "data": base64.b64encode(data).decode()}
        fds: list[int] = []
        leased: list[bytes] = []
        for (slot, key, chunk, node), (which, got) in zip(wanted, opened, strict=True):
            if space.chunks.get(key) is not chunk:  # evicted or replaced meanwhile (its
                # files perhaps asked about before these opens and cut after: revoke.py)
                close_later(got)
                continue
            fds += got
            out[slot] = {**_sums(chunk), "layout": self.vol.layout(node).describe(), **which}
            if pin:  # only once the whole request is answered
                self._lease(session, space, key, chunk)
                leased.append(key)
        if leased:  # (a reply replaced by an error told of none: `Session.refused`)
            session.undo.append(functools.partial(self._unpin, session, space, leased))
        return {"chunks": out}, fds

    def _check_pins(self, session: Session, more: int, nbytes: int) -> None:
        """Refuse `more` read leases, on `nbytes` of chunks not leased yet, past the
        connection's or its uid's limits."""
        if session.pinned + more > self.limits.max_pins:
            raise OSError(errno.EMFILE, f"this connection holds {session.pinned}"
                          " KV read leases, the limit (mount option max_pins)")
        uid = session.tenant  # (a user's subordinate uids share her leases: vol/tenants)
        if uid == 0:
            return
        if self.pinned_by_uid[uid] + self.pins_booked[uid] + more > \
                self.limits.max_pins_per_user:
            raise OSError(errno.EMFILE, f"uid {uid} holds {self.pinned_by_uid[uid]} KV read "
                          "leases, the limit (mount option max_pins_per_user)")
        if self.pinned_bytes[uid] + self.pin_bytes_booked[uid] + nbytes > \
                self.limits.max_pinned_bytes_per_user:
            raise OSError(errno.EMFILE, f"uid {uid}'s KV read leases keep "
                          f"{self.pinned_bytes[uid]} bytes from eviction, the limit (mount "
                          "option max_pinned_bytes_per_user): unpin what was read")

    @staticmethod
    def _new_bytes(session: Session, space: Namespace,
                   chunks: Iterable[tuple[bytes, Chunk | None]]) -> int:
        """Bytes of `chunks` (key, chunk) `session` leases no chunk of yet: what
        leasing them adds to its uid's pinned bytes."""
        total = 0
        for key, chunk in chunks:
            if chunk is not None:
                held = session.pins.get((space.name, key))
                total += 0 if held is not None and held.chunk is chunk else chunk.size
        return total

    def _lease(self, session: Session, space: Namespace, key: bytes, chunk: Chunk) -> None:
        """A read lease of `session` on `key`'s chunk: eviction skips it until unpinned.
        Leases the session held on a chunk put before under the key (dropped since,
        its leases with it) are no longer counted."""
        held = session.pins.get((space.name, key))
        if held is None or held.chunk is not chunk:
            if held is not None:
                self._uncount(session, held.n, held.chunk.size)
            held = session.pins[(space.name, key)] = Lease(chunk)
            self.pinned_bytes[session.tenant] += chunk.size
        space.pin(chunk)
        held.n += 1
        session.pinned += 1
        self.pinned_by_uid[session.tenant] += 1

    def _uncount(self, session: Session, n: int, nbytes: int = 0) -> None:
        session.pinned -= n
        self._uncount_uid(session.tenant, n, nbytes)

    def _uncount_uid(self, uid: int, n: int, nbytes: int) -> None:
        """`n` of `uid`'s read leases end, on chunks of `nbytes` it leases no more."""
        self.pinned_by_uid[uid] -= n
        if self.pinned_by_uid[uid] <= 0:
            del self.pinned_by_uid[uid]
        self.pinned_bytes[uid] -= nbytes
        if self.pinned_bytes[uid] <= 0:
            del self.pinned_bytes[uid]

    async def _fetch(self, opens: list[Inode], reads: list[Inode], odirect: bool,
                     uid: int) -> tuple[list[tuple[ReadFds, list[int]]], list[bytes]]:
        """What a get asks of the members, in one worker thread in `uid`'s turn, never
        on the loop (a member that stopped answering held every user's request behind
        one get there): `read_fds` of each of `opens`, and the bytes of each of `reads`
        (small chunks, sent inline).  Every chunk file is opened through the member
        guard (EIO at once for a member judged not answering).  The first open tells
        whether the members are cold (over COLD_OPEN_S): then the rest are opened all
        at once in threads of their own.  On a failure every descriptor opened is
        closed and the error raised."""
        if not opens and not reads:
            return [], []
        guard = self.calls.guarded

        def one(node: Inode) -> tuple[ReadFds, list[int]] | Exception:
            try:
                return read_fds(self.vol, node, odirect, guard)
            except Exception as e:  # noqa: BLE001 - every opened descriptor is accounted
                return e

        def fetch() -> tuple[list[tuple[ReadFds, list[int]]], list[bytes]]:
            done: list[tuple[ReadFds, list[int]]] = []
            try:
                datas = [self._read(node) for node in reads]
                for i, node in enumerate(opens):
                    started = time.perf_counter()
                    done.append(read_fds(self.vol, node, odirect, guard))
                    if time.perf_counter() - started > COLD_OPEN_S and i + 1 < len(opens):
                        rest = list(_OPENERS.map(one, opens[i + 1:]))
                        done += [r for r in rest if not isinstance(r, Exception)]
                        for r in rest:
                            if isinstance(r, Exception):
                                raise r
                        break
            except BaseException:
                for _, fds in done:
                    for fd in fds:
                        os.close(fd)
                raise
            return done, datas
        touched = {m for node in (*opens, *reads)
                   for m in self.vol.layout(node).holding(node.size)}
        return await self.calls.run_whole(fetch, uid, touched)

    def _read(self, node: Inode) -> bytes:
        """(Worker thread.)  A small chunk's bytes, its files opened through the member
        guard."""
        layout = self.vol.layout(node)
        chunks = ChunkFiles(self.vol.pool, node.ino, layout)

        def open_file(member: int) -> bool:
            chunks.fd(member, False)  # (None: a hole, read as zeros)
            return True
        try:
            for member in layout.holding(node.size):
                if self.calls.guarded(member, functools.partial(open_file, member)) is None:
                    raise NotAnswering(errno.EIO, f"member {member} is not answering: "
                                       "the chunk was not read")
            buf = bytearray(node.size)
            chunks.read(0, memoryview(buf))
            return bytes(buf)
        finally:
            chunks.close()

    def _unpin(self, session: Session, space: Namespace, keys: list[bytes]) -> None:
        """End one of `session`'s read leases on each of `keys` it holds one on (on the
        chunk it leased: one put again under the key since is not touched)."""
        for key in keys:
            held = session.pins.get((space.name, key))
            if held is None:
                continue
            held.n -= 1
            if not held.n:
                del session.pins[(space.name, key)]
            self._uncount(session, 1, 0 if held.n else held.chunk.size)
            if space.chunks.get(key) is held.chunk:
                space.unpin(held.chunk)

    def release(self, session: Session) -> None:
        """The connection closed: its read leases and claims end (and on a reading
        node, the puts it did not commit).  A few end now; more (a connection may hold
        65,536 pins, a dead node's connections hundreds of thousands: 60-100 ms of the
        thread at once) end a bite at a time in `let_go`, other requests served
        between; until then they count against their uid's limits as before."""
        if self.forward is not None:
            self.forward.release(session)
        pins, session.pins, session.pinned = list(session.pins.items()), {}, 0
        claims = self.claims.take(session)
        if len(pins) + len(claims) <= RELEASED_AT_ONCE:
            self.claims.end(session, claims)
            self._unpin_all(session.tenant, pins)
            return
        self._letting_go.append((session, pins, claims))
        self._let_go_wake.set()

    async def let_go(self) -> None:
        """(A daemon task.)  End the pins and claims of closed connections that held
        many, a bite at a time."""
        while True:
            await self._let_go_wake.wait()
            self._let_go_wake = trio.Event()
            while self._letting_go:
                session, pins, claims = self._letting_go.popleft()
                try:
                    async for some in in_bites(claims, BITE):
                        self.claims.end(session, some)
                    async for bite in in_bites(pins, BITE):
                        self._unpin_all(session.tenant, bite)
                except Exception as e:  # a bug: logged, the daemon and the next go on
                    self._failures.note("release", session.caller, e)

    def _unpin_all(self, uid: int, pins: Sequence[tuple[tuple[str, bytes], Lease]]) -> None:
        """End `uid`'s read leases `pins` of a closed connection: on each chunk it
        leased that is still its namespace's (a chunk dropped since had its leases
        dropped with it; one put again under the key is another's)."""
        ended = nbytes = 0
        for (ns, key), held in pins:
            space = self.index.spaces.get(ns)
            if space is not None and space.chunks.get(key) is held.chunk:
                space.unpin(held.chunk, held.n)
            ended += held.n
            nbytes += held.chunk.size
        self._uncount_uid(uid, ended, nbytes)

    async def flush(self) -> None:
        """A round's access-time write-back (TOUCH_BITE at most, with each group
        commit), TOUCH_STEP rows a statement, stepping aside between (`fs/fair.py`).
        (Not on the worker's connection: writes there would wait for the open group's
        lock, and the group's next change on this thread for theirs.)"""
        share, left = Slice(), TOUCH_BITE
        while left > 0:
            written = self.index.flush(min(TOUCH_STEP, left))
            left -= written
            if written < TOUCH_STEP or left <= 0:
                break
            await share.due()
        if self.follower is not None:
            self.follower.take_back()

"""KV gets on a reading node: the writer's chunks, found in the store and read over.

A reading node holds no KV index (the writer's lives in the writer's memory), so a
lookup there reads the keys' rows, seals and inodes from the store, a few statements a
BITE of keys, in a worker thread on a connection of its own (`fs/store_worker.py`:
never a round trip on trio's thread; users take turns there a bite at a time): a
prefix another node computed is a hit on this one. A caller that takes them
(`KVStore`) gets connections to the writer's chunk service scoped to the chunks found
(`fs/remote_reads.py`, the reading node's direct path) and receives their bytes
itself, checking their checksums; a chunk evicted meanwhile reads ESTALE there, a
miss. Small chunks, callers that do not take connections, and gets past the limits on
them are served by copies: each chunk copied from the writer through its chunk
service, in worker threads, straight into a sealed memfd that goes to the caller as a
one-member chunk file with the chunk's checksums. A copy is the caller's own, so it
needs no read lease; a chunk evicted meanwhile, or a writer that cannot serve it, is a
miss.

A memfd's pages are this daemon's memory for as long as anyone holds the descriptor,
so a copy is only lent: the daemon keeps a descriptor of it and cuts it to nothing
LEND_S seconds later (it is sealed against writes and growth, not shrinking), and one
user (her subordinate uids with her, `vol/tenants.py`) has at most
`max_kv_lent_per_user` bytes lent at once, each copy counted in whole
pages and one more (its descriptor and the kernel's own), and LENT_PER_USER copies,
and all users together `max_kv_lent` with the chunks being put (past any, a miss);
a key asked for twice in one get is copied once.  A caller reads its copy at once;
one that keeps it past LEND_S reads a short file, which its checksums refuse.
Namespaces (their owners and modes) are read from the store on each request, so
access is judged as the writer judges it.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from mxfs.fs.fair import RoundRobin
from mxfs.fs.fields import Msg, bool_field, int_field
from mxfs.fs.kv_fields import INLINE_REPLY, keys_field, sizes_field
from mxfs.fs.kv_views import FollowerViews
from mxfs.fs.limits import Limits, NodeHeld
from mxfs.fs.remote_reads import RemoteReads
from mxfs.fs.session import Answer, Session
from mxfs.fs.store_worker import SERVE_WAIT_S, StoreWorker
from mxfs.io import PAGE, Layout
from mxfs.io.memfd import fill_mapped, free_later
from mxfs.meta import Inode, MetaStore
from mxfs.meta.schema import INODE_COLUMNS
from mxfs.pool import ChunkFiles
from mxfs.proto.chunk_wire import MAX_SCOPE
from mxfs.proto.messages import (
    ChunkReply,
    KVExistsReply,
    KVGetReply,
    KVViewReply,
    RemoteGrant,
)
from mxfs.proto.presence import HEADER_SIZE
from mxfs.vol.access import R_OK
from mxfs.vol.kv_index import KVIndex, Namespace, check_namespace
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.kv")

MAX_COPY = 256 << 20  # bytes one get may copy over from the writer
BITE = 128  # keys a turn of the store's worker (4,096 keys: 111 ms in bites, 106 ms whole)
COPIERS = 4  # chunks copied at once (worker threads), for every caller together
LEND_S = 30.0  # seconds a copy is the caller's to read
LENT_PER_USER = 1024  # copies one uid (but root) holds lent at once: a descriptor each
TAKE_BACK_BITE = 2048  # copies taken back at once (a few milliseconds of the thread)
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE  # (not SHRINK: taken back)


@dataclass
class _Found:
    """What the store holds of a namespace and some of its keys."""

    space: tuple[int, int, int, int] | None = None  # (uid, gid, mode, capacity)
    rows: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key: (ino, size)
    seals: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # ino: (unit, sums)
    nodes: dict[int, Inode] = field(default_factory=dict)


def _look(store: MetaStore, name: str, keys: list[bytes], chunks: bool) -> _Found:
    """(Blocking.)  The namespace's row and its keys' rows; with `chunks`, the seals
    and inodes of what they name too."""
    e = store.engine
    row = e.get("kv_ns", {"ns": name}, ("uid", "gid", "mode", "capacity"))
    found = _Found(None if row is None else (int(row[0]), int(row[1]), int(row[2]),
                                             int(row[3])))
    if row is None or not keys:
        return found
    found.rows = {bytes(k): (int(ino), int(size)) for k, ino, size in
                  e.get_many("kv", "key", keys, ("key", "ino", "size"), {"ns": name})}
    if chunks and found.rows:
        inos = [ino for ino, _ in found.rows.values()]
        found.seals = {int(ino): (int(unit), bytes(sums)) for ino, unit, sums in
                       e.get_many("sealed", "ino", inos, ("ino", "sum_unit", "sums"))}
        found.nodes = {int(r[0]): Inode(*r) for r in
                       e.get_many("inodes", "ino", inos, INODE_COLUMNS)}
    return found


def _charge(size: int) -> int:
    """What a lent copy of `size` bytes costs: its pages, and one more for what the
    kernel keeps of it (a memfd of one byte held 5.2 KiB)."""
    return (-(-size // PAGE) + 1) * PAGE


class FollowerKV:
    def __init__(self, vol: Volume, index: KVIndex, limits: Limits,
                 limiter: trio.CapacityLimiter, remote: RemoteReads | None = None,
                 held: NodeHeld | None = None) -> None:
        """`held`: the node's count of memory held for KV users (shared with its puts)."""
        self.vol, self.index, self.limits, self.limiter = vol, index, limits, limiter
        self.held = held or NodeHeld(limits.max_kv_lent)
        self.remote = remote  # scoped connections to the writer (`fs/remote_reads.py`)
        self.lookups = StoreWorker(vol.pool.meta_location, wait_s=SERVE_WAIT_S)
        self.views = FollowerViews(  # `kv_view` here
            self.lookups, (limits.max_kv_views, limits.max_kv_views_per_user))
        self._lent: deque[tuple[float, int, int, int]] = deque()  # (until, fd, tenant, bytes)
        self.lent_by_uid: Counter[int] = Counter()
        self.copies_by_uid: Counter[int] = Counter()  # copies lent now
        self._copying: Counter[int] = Counter()  # bytes being copied for a uid now
        self._copying_n: Counter[int] = Counter()  # ... and how many copies
        self._copiers = RoundRobin(COPIERS)  # (by uid in turn: one's queue holds no other)

    def take_back(self) -> None:
        """Cut the copies lent more than LEND_S ago to nothing, freeing their pages
        whoever still holds them (TAKE_BACK_BITE at a call: the rest at the next)."""
        now = time.monotonic()
        for _ in range(TAKE_BACK_BITE):
            if not self._lent or self._lent[0][0] > now:
                return
            _, fd, uid, charge = self._lent.popleft()
            free_later(fd)  # (a GiB's pages cut on the loop held every user ~100 ms)
            self.lent_by_uid[uid] -= charge
            self.held.held -= charge
            if self.lent_by_uid[uid] <= 0:
                del self.lent_by_uid[uid]
            self.copies_by_uid[uid] -= 1
            if self.copies_by_uid[uid] <= 0:
                del self.copies_by_uid[uid]

    def _lend(self, fd: int, uid: int, size: int) -> None:
        charge = _charge(size)
        self._lent.append((time.monotonic() + LEND_S, os.dup(fd), uid, charge))
        self.lent_by_uid[uid] += charge
        self.held.held += charge
        self.copies_by_uid[uid] += 1

    def _may_lend(self, uid: int, nbytes: int, copies: int) -> bool:
        """Whether `copies` copies of `nbytes` in all (`_charge`d) more may be made for
        `uid`: counting what is lent and what other requests of its are copying now
        (eight gets at once each passed a check that counted only what was lent), and
        what the node holds for every user (`max_kv_lent`)."""
        return uid == 0 or (
            self.lent_by_uid[uid] + self._copying[uid] + nbytes <=
            self.limits.max_kv_lent_per_user and self.held.room(nbytes) and
            self.copies_by_uid[uid] + self._copying_n[uid] + copies <= LENT_PER_USER)

    async def _lookup(self, msg: Msg, session: Session, keys: list[bytes], chunks: bool
                      ) -> tuple[Namespace, _Found]:
        """The namespace asked for, as the store has it now, checked for reading, and
        what the store holds of `keys` (`_look`)."""
        name = check_namespace(msg.get("namespace"))
        uid = session.caller.uid

        def look(bite: list[bytes]) -> Callable[[MetaStore], _Found]:
            return lambda store: _look(store, name, bite, chunks)
        found = await self.lookups.run(look(keys[:BITE]), uid)
        for start in range(BITE, len(keys), BITE):  # a bite a turn (fs/store_worker.py)
            more = await self.lookups.run(look(keys[start:start + BITE]), uid)
            found.rows.update(more.rows)
            found.seals.update(more.seals)
            found.nodes.update(more.nodes)
        if found.space is None:
            self.index.spaces.pop(name, None)
        else:
            self.index.spaces[name] = Namespace(name, *found.space)
        space = self.index.space(name, session.caller, R_OK, bool_field(msg, "shared"))
        return space, found

    async def view(self, msg: Msg, session: Session) -> Answer[KVViewReply]:
        """The namespace's presence table on this node, kept by the change feed
        (`fs/kv_views.py`); read permission (and `shared`) as `kv_exists`."""
        space, _ = await self._lookup(msg, session, [], chunks=False)
        kept = self.views.filled(space.name)
        table = await self.views.table(space.name, session.caller.uid, session.tenant)
        if table is kept:  # (kept whole already: no fill waited for, judged just now)
            return {"size": HEADER_SIZE + 8 * table.slots}, [table.reader_fd()]
        # Judged again (a store read): the owner's chmod while the table was filled
        # ended that fill, and one begun after it for someone still let in was handed
        # to this caller too.
        again, _ = await self._lookup(msg, session, [], chunks=False)
        if self.views.tables.get(again.name) is not table:
            raise OSError(errno.EAGAIN, f"the table of KV namespace {space.name!r} was "
                          "retired while it was filled: ask again")
        return {"size": HEADER_SIZE + 8 * table.slots}, [table.reader_fd()]

    async def exists(self, msg: Msg, session: Session) -> Answer[KVExistsReply]:
        keys = keys_field(msg)
        _, found = await self._lookup(msg, session, keys, chunks=False)
        return {"present": [k in found.rows for k in keys]}, []

    async def get(self, msg: Msg, session: Session) -> Answer[KVGetReply]:
        if bool_field(msg, "pin"):  # (a lease here would hold nothing on the writer)
            raise OSError(errno.EOPNOTSUPP, f"node {self.vol.pool.node} leases KV chunks "
                          "on the writer: ask kv_pin")
        self.take_back()
        uid = session.tenant  # (what is lent is counted by user: `vol/tenants.py`)
        keys = keys_field(msg)
        sizes = sizes_field(msg, len(keys))
        space, looked = await self._lookup(msg, session, keys, chunks=True)
        inline_max = int_field(msg, "inline_max", 0)
        out: list[ChunkReply | None] = []
        found_all: list[tuple[int, Inode, ChunkReply]] = []  # (slot in out, node, sums)
        for key, want in zip(keys, sizes, strict=True):
            found = looked.rows.get(key)
            seal = looked.seals.get(found[0]) if found else None
            node = looked.nodes.get(found[0]) if found else None
            if found is None or seal is None or node is None:
                space.misses += 1
                out.append(None)
                continue
            sums: ChunkReply = {"size": found[1], "sum_unit": seal[0],
                                "sums": base64.b64encode(seal[1]).decode()}
            if want is not None and want != found[1]:
                space.misses += 1
                out.append({"size": found[1]})
                continue
            found_all.append((len(out), node, sums))
            out.append(None)
        # Chunks past the inline size go to a caller that takes them as connections to
        # the writer, scoped to those chunks: it receives their bytes itself.
        grant: RemoteGrant | None = None
        conns: list[int] = []
        far = [w for w in found_all if w[1].size > inline_max]
        if far and bool_field(msg, "remote") and self.remote is not None:
            grant, conns = await self._grant([node for _, node, _ in far], session)
        if grant is not None:
            for slot, node, sums in far:
                space.hits += 1
                out[slot] = {**sums, "ino": node.ino,
                             "layout": self.vol.layout(node).describe()}
            found_all = [w for w in found_all if w[1].size <= inline_max]
        try:
            reply, fds = await self._copied(space, uid, found_all, out, inline_max)
        except BaseException:
            for fd in conns:
                os.close(fd)
            raise
        if grant is not None:
            reply["remote"] = grant
        return reply, fds + conns

    async def _grant(self, nodes: list[Inode], session: Session
                     ) -> tuple[RemoteGrant | None, list[int]]:
        """Scoped connections to the writer for these chunks, or (None, []) where the
        limits or the writer say no: then they are copied over, as for any caller."""
        assert self.remote is not None
        if len(nodes) > MAX_SCOPE:
            return None, []
        try:
            return await self.remote.open(nodes, len(self.vol.pool.members), session)
        except OSError as e:
            if e.errno not in (errno.EREMOTE, errno.EIO):
                raise
            return None, []

    async def _copied(self, space: Namespace, uid: int,
                      wanted: list[tuple[int, Inode, ChunkReply]], out: list[ChunkReply | None],
                      inline_max: int) -> Answer[KVGetReply]:
        """The chunks copied from the writer into memfds lent to the caller (or inline
        in the reply), at most MAX_COPY a request and what the uid may be lent."""
        copied = 0
        todo = []
        seen: set[int] = set()
        for slot, node, sums in wanted:
            if node.ino in seen:  # (asked again in this request: the same copy)
                todo.append((slot, node, sums))
                continue
            more = copied + _charge(node.size)
            if more > MAX_COPY or not self._may_lend(uid, more, len(seen) + 1):
                space.misses += 1  # (past what one request copies or one uid is lent)
                continue
            seen.add(node.ino)
            copied = more
            todo.append((slot, node, sums))
        self._copying[uid] += copied
        self._copying_n[uid] += len(seen)
        self.held.held += copied
        try:
            return await self._copy_all(space, uid, todo, out, inline_max)
        finally:
            self.held.held -= copied
            self._copying[uid] -= copied
            self._copying_n[uid] -= len(seen)
            if self._copying[uid] <= 0:
                del self._copying[uid]
            if self._copying_n[uid] <= 0:
                del self._copying_n[uid]

    async def _copy_all(self, space: Namespace, uid: int,
                        todo: list[tuple[int, Inode, ChunkReply]],
                        out: list[ChunkReply | None], inline_max: int
                        ) -> Answer[KVGetReply]:
        """`_copied`'s copies, made and lent (or inlined)."""
        memfds: dict[int, int] = {}  # inode -> its copy

        async def copy(node: Inode) -> None:
            try:
                async with self._copiers.slot(uid):
                    memfds[node.ino] = await trio.to_thread.run_sync(
                        self._copy, node, limiter=self.limiter)
            except OSError as e:
                log.info("KV chunk %d of namespace %s not copied from the writer: %s",
                         node.ino, space.name, e)

        fds: list[int] = []
        try:
            async with trio.open_nursery() as nursery:  # every chunk at once, 4 at a time
                for node in {node.ino: node for _, node, _ in todo}.values():
                    nursery.start_soon(copy, node)
            budget = INLINE_REPLY
            lent: set[int] = set()
            for slot, node, sums in todo:
                copy_fd = memfds.get(node.ino)
                if copy_fd is None:
                    space.misses += 1
                    continue
                space.hits += 1
                if node.size <= min(inline_max, budget):
                    budget -= node.size
                    data = os.pread(copy_fd, node.size, 0)
                    out[slot] = {**sums, "data": base64.b64encode(data).decode()}
                    continue
                if uid != 0 and node.ino not in lent:  # (root's copies are root's to hold)
                    lent.add(node.ino)
                    self._lend(copy_fd, uid, node.size)
                fds.append(os.dup(copy_fd))
                unit = max(PAGE, -(-node.size // PAGE) * PAGE)
                out[slot] = {**sums, "layout": Layout(unit, 1, 0, 1).describe(),
                             "members": [0], "direct_members": []}
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            for fd in memfds.values():
                os.close(fd)
        return {"chunks": out}, fds

    def _copy(self, node: Inode) -> int:
        """Blocking: the chunk's bytes from the writer straight into a sealed memfd
        (received into its mapping: no buffer between)."""
        ino, size = node.ino, node.size
        fd = os.memfd_create(f"mxfs-kv-{ino}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            if size:
                chunks = ChunkFiles(self.vol.pool, ino, self.vol.layout(node))
                try:
                    fill_mapped(fd, size, lambda view: chunks.read(0, view))
                finally:
                    chunks.close()
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # (its mapping gone: writes seal)
        except BaseException:
            os.close(fd)
            raise
        return fd

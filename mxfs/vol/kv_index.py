"""The KV chunk index: namespaces, an LRU per namespace, capacity and eviction.

Every process on the node reaches one index (this daemon's), so capacity and
LRU order hold across processes and serving instances.  The index lives in
the metadata store (`kv_ns`, `kv`) and in memory here; access times are
written back in batches with the group commit.  A chunk is a sealed inode;
evicting or deleting one orphans it, and its chunk files are reclaimed like
any unlinked file's (after the readers that hold descriptors are done).
No FUSE or trio here.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from mxfs.meta.kv_rows import SEALS_BITE
from mxfs.meta.usage import BLOCK
from mxfs.pool.pool import META_ROW, pool_totals
from mxfs.proto.constants import MAX_KEY
from mxfs.proto.messages import NamespaceStats
from mxfs.proto.presence import GONE, MOVED
from mxfs.vol.access import R_OK, W_OK, Caller
from mxfs.vol.kv_presence import KeptTables, PresenceTable, Successor
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume


class Guarded(Protocol):
    """A call into a member's filesystem, None if the member is not answering
    (`fs/member_calls.MemberCalls.guarded`)."""

    def __call__(self, member: int, fn: Callable[[], _T]) -> _T | None: ...

log = logging.getLogger("mxfs.kv")
K = TypeVar("K")
_T = TypeVar("_T")

PASS_FLOOR = 64  # pinned chunks one namespace's walk may pass, whatever its share
VICTIMS = 8192  # chunks one eviction takes at most (a short pool evicts again; a list of
#                a declared 256 MiB's worth of 4 KiB chunks held the thread 25-350 ms)
# Access times one group commit writes back at most (~1 KiB keys: 256 KiB of rows, a
# round trip's batch on PostgreSQL): a user pinning 20,000 keys a round had each round
# write them all on the daemon's thread.  The rest wait for later rounds, a key touched
# again meanwhile written once, with its latest time; atimes only order eviction after
# a restart (memory orders it while mounted), so a late one costs that order little.
TOUCH_BITE = 256
VIEW_BITE = 1024  # keys copied into a presence table being filled between yields (~1.4 ms)

# Eviction starts above HIGH x capacity and stops at LOW x capacity.
HIGH, LOW = 1.0, 0.9
# The pool keeps this share of each member free for everything else: KV puts that would
# go below it fail at once (the engine goes on without caching) and eviction makes room.
POOL_FREE_MIN = 0.05
# Seconds a measure of the pool's free space judges small chunks (`_pool_free`).
FREE_FRESH_S = 0.5
MAX_CHUNK = 256 << 20  # bytes of one chunk (256 tokens of Qwen2.5-32B are 64 MiB)
# What a chunk counts for at least in its namespace's bytes (capacity, eviction, stats):
# a page.  Counted at their size, empty chunks held nothing, so no capacity bounded
# their number and no eviction (which stops once the bytes are below its target) took
# one: a writer who filled a shared namespace with them left them for good.  (Quotas
# charge a chunk holding any byte the same block at least: `usage.file_cost`.)
CHUNK_FLOOR = BLOCK
MAX_NAMESPACE = 128


@dataclass(slots=True)
class Chunk:
    ino: int
    size: int
    atime: int
    sum_unit: int  # its checksums, kept here so a get never waits on the store
    sums: bytes
    tenant: int  # its writer's (the owner of its inode), whose chunk count it is in
    pins: int = 0

    @property
    def cost(self) -> int:
        """What it counts for in its namespace's bytes (`charge`)."""
        return max(self.size, CHUNK_FLOOR)


def charge(size: int) -> int:
    """What a chunk of `size` bytes counts for in its namespace's bytes: a page at least
    (CHUNK_FLOOR)."""
    return max(size, CHUNK_FLOOR)


@dataclass
class Namespace:
    name: str
    uid: int
    gid: int
    mode: int
    capacity: int  # bytes; 0 = bounded by the pool only
    chunks: OrderedDict[bytes, Chunk] = field(default_factory=OrderedDict)  # LRU first
    used: int = 0  # its chunks' bytes, each counted CHUNK_FLOOR at least (`Chunk.cost`)
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    pinned: int = 0  # chunks with a read lease (kept as they change: counting them
    #                  held every user 50 ms a million chunks at each kv_stats)
    pinned_bytes: int = 0  # ... and their bytes (what no eviction can free)
    view: PresenceTable | None = None  # its keys for readers' exists, once one asked
    # A larger table being filled a bite at a time (`KVIndex.grow_view`): it takes the
    # view's place once full.
    next_view: Successor | None = None
    # The user its owner answers to (`vol/tenants.py`), as of its making: whose
    # namespace count it is in, and whose share of the pool it takes (its chunks are
    # each in their writer's chunk count: `Chunk.tenant`).
    tenant: int = -1

    def __post_init__(self) -> None:
        if self.tenant < 0:
            self.tenant = tenant_of(self.uid)

    def may(self, caller: Caller, mask: int) -> bool:
        """Would the mode bits grant `mask` (R_OK, W_OK) to `caller`, as on a directory?
        The owner always may (its namespace is of no use to it otherwise); root too."""
        if caller.uid == 0 or caller.uid == self.uid:
            return True
        bits = (self.mode >> 3) & 7 if self.gid in caller.gids else self.mode & 7
        return bits & mask == mask

    def visible(self, caller: Caller) -> bool:
        """Whether `caller` may know the namespace is there: root, its owner, or one its
        mode grants read or write.  To anyone else it answers as a missing one (a
        tenant told EACCES here and ENOENT elsewhere learnt which names others use)."""
        return self.may(caller, R_OK) or self.may(caller, W_OK)

    def check(self, caller: Caller, mask: int, shared: bool) -> None:
        """Refuse `caller` what the mode bits refuse, and refuse to serve chunks of a
        namespace another uid owns unless the caller asked to share (`shared`): an
        engine that did not ask never reads or writes chunks someone else planted
        under the name it picked, root's engines included."""
        if caller.uid != self.uid and not shared:
            raise OSError(errno.EACCES, f"KV namespace {self.name!r} belongs to uid "
                          f"{self.uid}: pick another name, or join it with shared=True if "
                          "you trust its owner (root gives namespaces: mxfs kv create)")
        if not self.may(caller, mask):
            raise OSError(errno.EACCES, f"KV namespace {self.name!r} (uid {self.uid}, gid "
                          f"{self.gid}, mode {self.mode:o}) does not grant "
                          f"{'write' if mask & W_OK else 'read'} to uid {caller.uid}")

    def stats(self) -> NamespaceStats:
        return {"namespace": self.name, "uid": self.uid, "gid": self.gid,
                "mode": f"{self.mode:o}", "chunks": len(self.chunks), "bytes": self.used,
                "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "puts": self.puts, "evictions": self.evictions,
                "pinned": self.pinned}

    def pin(self, chunk: Chunk) -> None:
        """One more read lease on `chunk`, one of this namespace's."""
        if not chunk.pins:
            self.pinned += 1
            self.pinned_bytes += chunk.cost
        chunk.pins += 1

    def unpin(self, chunk: Chunk, n: int = 1) -> None:
        """`n` fewer read leases on `chunk` (never below none)."""
        if chunk.pins:
            chunk.pins = max(0, chunk.pins - n)
            if not chunk.pins:
                self.pinned -= 1
                self.pinned_bytes -= chunk.cost


def check_namespace(name: object) -> str:
    """A namespace name: 1-128 characters of valid UTF-8, no NUL or control characters."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAMESPACE or \
            not name.isprintable():
        raise OSError(errno.EINVAL, f"a namespace is 1-{MAX_NAMESPACE} printable characters")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise OSError(errno.EINVAL, "a namespace must be valid UTF-8") from None
    return name


# Names an engine picks by default for a user (mxfs.kv.kvstore.default_namespace):
# "<engine>-uid<N>" belongs to uid N alone, so nobody can take a victim's name first.
_RESERVED = re.compile(r"-uid([0-9]+)\Z")
# What a new namespace may be called: a name engines, paths and metric labels all take
# as it is (older pools' names, any printable text, are still served).
_NEW_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")


def check_new_name(name: str) -> None:
    """EINVAL unless a new namespace may be called `name` (`_NEW_NAME`)."""
    if not _NEW_NAME.fullmatch(name):
        raise OSError(errno.EINVAL, f"KV namespace name {name!r}: a new name is 1-128 "
                      "letters, digits and . _ - : @ + =, starting with a letter or digit")


def check_reserved(name: str, uid: int) -> None:
    """EACCES when `name` ends in "-uid<N>" and `uid` is not N."""
    m = _RESERVED.search(name)
    if m is not None and int(m.group(1)) != uid:
        raise OSError(errno.EACCES, f"KV namespace names ending in -uid{m.group(1)} are "
                      f"uid {m.group(1)}'s own (engines' default names): pick another name")


def missing(name: str) -> OSError:
    """What a namespace that is not there, or that the caller may not see, answers."""
    return OSError(errno.ENOENT, f"no KV namespace {name!r}")


def check_key(key: bytes) -> bytes:
    if not key or len(key) > MAX_KEY:
        raise OSError(errno.EINVAL, f"a key must be 1-{MAX_KEY} bytes (hash longer ones)")
    return key


class KVIndex:
    """Every namespace's chunks, in LRU order; the daemon's one instance."""

    def __init__(self, vol: Volume, max_per_user: int | None = None,
                 max_views: tuple[int, int] = (2048, 256)) -> None:
        self.vol = vol
        self.max_per_user = max_per_user  # namespaces one uid but root may own
        self.kept = KeptTables(*max_views)  # the namespaces with a presence table
        self.spaces: dict[str, Namespace] = {}
        # Namespaces by their owners' tenants, chunks by their writers' (a put asks: no
        # scan): a writer's chunks in another's namespace are hers to count, not the
        # owner's (counted against the owner, a writer of a shared namespace filled the
        # owner's max_chunks_per_user, refusing her puts in every namespace of hers).
        self._owned: Counter[int] = Counter()
        self.chunks_by_tenant: Counter[int] = Counter()
        # Chunks judged for a put and not yet indexed, by tenant (`KVOps._store`): the
        # per-user limit counts them, as puts at once each judge against it.
        self.storing_by_tenant: Counter[int] = Counter()
        self._clock = itertools.count(1)
        self._touched: dict[tuple[str, bytes], int] = {}
        self._pool_free = _Room(lambda guard: pool_totals(vol.pool.usage(guard))["free"])
        self._first_walked = 0  # where the last eviction walk began (`fair_victims`)
        self._member_room: dict[int, _Room] = {}  # member: room above its floor
        self.load()

    def load(self) -> None:
        """Read the index from the store (least recently used first).  A reading node
        loads none: the index is the writer node's (in its memory); its gets look keys
        up in the store (`fs/kv_follow.py`) and its puts and claims go to the writer
        (`fs/kv_forward.py`)."""
        if self.vol.pool.node:
            log.info("KV on reading node %s: looked up in the store, put and claimed on "
                     "the writer node (whose index it is)", self.vol.pool.node)
            return
        store = self.vol.store
        for ns, uid, gid, mode, capacity in store.kv.namespaces():
            made = self.spaces[ns] = Namespace(ns, uid, gid, mode, capacity)
            self._owned[made.tenant] += 1
        last = 0
        for n, (ns, key, ino, size, atime, sum_unit, sums, uid) in enumerate(
                store.kv.chunks()):
            if n % SEALS_BITE == 0:
                self.vol.progress()  # (a million chunks: a mount's longest step)
            space = self.spaces.get(ns)
            if space is None:
                space = self.spaces[ns] = Namespace(ns, 0, 0, 0o700, 0)
                self._owned[0] += 1
            chunk = space.chunks[bytes(key)] = Chunk(ino, size, atime, sum_unit, bytes(sums),
                                                     tenant_of(uid))
            space.used += chunk.cost
            self.chunks_by_tenant[chunk.tenant] += 1
            last = max(last, atime)
        self._clock = itertools.count(last + 1)
        if self.spaces:
            log.info("KV index: %d chunks in %d namespaces",
                     sum(len(s.chunks) for s in self.spaces.values()), len(self.spaces))

    # ---- namespaces -------------------------------------------------------------

    def space(self, name: object, caller: Caller, mask: int = R_OK, shared: bool = True,
              create_mode: int | None = None) -> Namespace:
        """A namespace `caller` may use for `mask` (see Namespace.check).

        With `create_mode`, a namespace that does not exist yet is made on this first
        use, owned by the caller with that mode; otherwise it is ENOENT.  One the
        caller may not see (`Namespace.visible`) is missing to it: ENOENT, word for
        word; only making one of its name says the name is taken (`taken`), as
        O_EXCL says a file of another's exists, without its owner or mode.
        """
        name = check_namespace(name)
        space = self.spaces.get(name)
        if space is not None and not space.visible(caller):
            if create_mode is None:
                raise missing(name)
            raise self.taken(name, caller.uid, errno.EACCES)
        if space is None:
            if create_mode is None:
                raise missing(name)
            self.check_room(caller.uid)
            space = self.create(name, caller.uid, caller.gid, create_mode, 0)
        space.check(caller, mask, shared)
        return space

    def taken(self, name: str, uid: int, code: int) -> OSError:
        """What making a namespace of a name in use by one `uid` may not see answers:
        the refusals making it would meet first, else `code` and no owner, group or
        mode."""
        self.check_room(uid)
        check_new_name(name)
        check_reserved(name, uid)
        return OSError(code, f"KV namespace name {name!r} is taken: pick another name")

    def check_room(self, uid: int) -> None:
        """EDQUOT when `uid` (not root) owns as many namespaces as it may, counted with
        those of its user's other uids (`vol/tenants.py`)."""
        if uid == 0 or self.max_per_user is None:
            return
        if self._owned[tenant := tenant_of(uid)] >= self.max_per_user:
            raise OSError(errno.EDQUOT, f"uid {tenant} owns {self.max_per_user} KV namespaces "
                          "(with its subordinate uids'), the limit (mount option "
                          "max_namespaces_per_user); drop one first")

    def create(self, name: str, uid: int, gid: int, mode: int, capacity: int,
               replace: bool = False) -> Namespace:
        """Make a namespace (EEXIST if it exists, unless `replace`: its chunks go)."""
        check_new_name(name)
        check_reserved(name, uid)
        old = self.spaces.get(name)
        if old is not None:
            if not replace:
                raise OSError(errno.EEXIST, f"KV namespace {name!r} exists (uid {old.uid})")
            self.drop_namespace(old)
        self.vol.pool.check_meta_room(META_ROW + len(name.encode()))
        self.vol.store.kv.set_namespace(name, uid, gid, mode, capacity)
        space = self.spaces[name] = Namespace(name, uid, gid, mode, capacity)
        self._owned[space.tenant] += 1
        return space

    def drop_namespace(self, space: Namespace) -> int:
        """Delete a namespace and every chunk in it; how many chunks went."""
        n = self.remove(space, list(space.chunks))
        self.vol.store.kv.drop_namespace(space.name)
        self.unview(space, GONE)
        del self.spaces[space.name]
        self._owned[space.tenant] -= 1
        return n

    def set_access(self, space: Namespace, gid: int, mode: int) -> bool:
        """Give the namespace another group or mode.  A change that may take access from
        anyone (another group, a bit cleared) retires its presence tables, here MOVED
        and on reading nodes by the feed: a table is a right to read the namespace's
        keys, and it ends when who may read them changes, as a file's descriptors do
        (`Volume.renew`); its readers ask again and are judged anew.  Whether it was
        such a change (the caller ends the read leases of those shut out)."""
        takes = gid != space.gid or bool(space.mode & ~mode & 0o777)
        rows = self.vol.store.kv
        (rows.set_access if takes else rows.set_namespace)(
            space.name, space.uid, gid, mode, space.capacity)
        space.gid, space.mode = gid, mode
        if takes:
            self.unview(space, MOVED)
        return takes

    def configure(self, space: Namespace, caller: Caller, capacity: int) -> None:
        if caller.uid not in (0, space.uid):
            raise OSError(errno.EPERM, "only the namespace's owner or root sets its capacity")
        space.capacity = capacity
        self.vol.store.kv.set_namespace(space.name, space.uid, space.gid, space.mode, capacity)

    # ---- chunks -----------------------------------------------------------------

    def lookup(self, space: Namespace, key: bytes) -> Chunk | None:
        """The chunk under `key` (now the most recently used), or None: a miss."""
        chunk = space.chunks.get(key)
        if chunk is None:
            space.misses += 1
            return None
        space.hits += 1
        space.chunks.move_to_end(key)
        chunk.atime = next(self._clock)
        self._touched[(space.name, key)] = chunk.atime
        return chunk

    def insert(self, space: Namespace, key: bytes, ino: int, size: int, sum_unit: int,
               sums: bytes, uid: int) -> None:
        """Publish and seal a hidden file under `key` (EEXIST if another writer won),
        `uid`'s (its writer, its inode's owner)."""
        self.vol.check_seal_room(key, sums)
        atime = next(self._clock)
        self.vol.store.kv.publish(ino, space.name, key, size, atime, sum_unit, sums)
        chunk = space.chunks[key] = Chunk(ino, size, atime, sum_unit, sums, tenant_of(uid))
        space.used += chunk.cost
        space.puts += 1
        self.chunks_by_tenant[chunk.tenant] += 1
        if space.next_view is not None:
            space.next_view.table.add(key)
        if (view := space.view) is not None:
            if view.can_take():
                view.add(key)
            if view.due() and space.next_view is None:  # (full, or a run too long)
                self.start_view(space)  # (a copy of the keys: this one among them)

    def viewed(self, space: Namespace, tenant: int) -> None:
        """A reader (of `tenant`, `vol/tenants.py`) asked for the namespace's table: it
        is the most recently asked for.  A table is counted against the user whose view
        made it; past the limits, the least recently asked of that user's tables (or
        of all) are retired MOVED, their readers asking again when they next look: a
        user who views a thousand namespaces holds no more of the daemon's descriptors
        and memory than the limit (they ran it out of descriptors, and opens on the
        members failed), and cannot retire others' tables past her own share."""
        if not self.kept.asked(space.name):
            for name in self.kept.add(space.name, tenant):
                self.unview(self.spaces[name])

    def unview(self, space: Namespace, state: int = MOVED) -> None:
        """Retire the namespace's tables (MOVED: its readers ask again; GONE: it went)."""
        for table in _tables(space):
            table.retire(state)
        space.view = space.next_view = None
        self.kept.drop(space.name)

    def view_fds(self) -> int:
        """Descriptors the tables hold (a memfd and its mapping's each)."""
        return 2 * len(self.kept)

    def start_view(self, space: Namespace) -> None:
        """Begin a presence table (`proto/presence.py`) for the namespace's keys: its
        first, or one with room for twice its keys under a fresh seed, for a table past
        FULL or one with a run of MAX_PROBE taken slots (`PresenceTable.due`).  The
        caller fills it (`grow_view`) a bite at a time: copying a million keys holds a
        thread half a second; until it is in place, readers of the run ask the daemon."""
        if space.next_view is None:
            space.next_view = Successor(len(space.chunks))

    def grow_view(self, space: Namespace, keys: list[bytes], bite: int = VIEW_BITE) -> None:
        """Copy a bite of keys read from the rows (`KVRows.keys_after`, past the table's
        `after`, `bite` asked) into the table being filled, those the namespace still
        holds; the last bite puts it in the view's place (the old one retired MOVED:
        its readers ask for the new)."""
        growing = space.next_view
        if growing is None:
            return
        if growing.fill(space.chunks, keys, bite):
            if space.view is not None:
                space.view.retire(MOVED)
            space.view, space.next_view = growing.table, None

    def remove(self, space: Namespace, keys: list[bytes]) -> int:
        """Delete chunks now (pinned ones too: readers keep their descriptors)."""
        return len(self.drop([(space, k) for k in keys]))

    def drop(self, victims: list[tuple[Namespace, bytes]]) -> list[int]:
        """Delete these chunks now (pinned ones too); their inode numbers."""
        return self._drop([(s, k) for s, k in victims if k in s.chunks])

    def _drop(self, victims: list[tuple[Namespace, bytes]]) -> list[int]:
        entries = []
        for space, key in victims:
            chunk = space.chunks.pop(key)
            if chunk.pins:  # (its readers keep their descriptors; it counts no more)
                space.pinned -= 1
                space.pinned_bytes -= chunk.cost
                chunk.pins = 0
            for table in _tables(space):
                table.remove(key)
            space.used -= chunk.cost
            self.chunks_by_tenant[chunk.tenant] -= 1
            self._touched.pop((space.name, key), None)
            entries.append((space.name, key, chunk.ino))
        if not entries:
            return []
        for node in self.vol.store.kv.remove(entries):
            self.vol.unlinked(node)
        return [ino for _, _, ino in entries]

    # ---- capacity -----------------------------------------------------------------

    def victims(self, space: Namespace, target: int, most: int | None = None
                ) -> list[tuple[Namespace, bytes]]:
        """Least recently used, unpinned chunks to evict for `space` to hold <= target
        (`most` of them at most: the caller asks again).  Pinned chunks met on the way
        go to the recent end, so later walks do not pass them again, and one call
        passes VICTIMS of them at most (the next goes on past them): with 262,144
        pinned, each call walked them all, 65 ms of every user's time.  None are
        walked once every unpinned byte is taken (or when there is none)."""
        victims: list[tuple[Namespace, bytes]] = []
        freed, passed = 0, list[bytes]()
        unpinned = space.used - space.pinned_bytes
        for key, chunk in space.chunks.items():
            if space.used - freed <= target or freed >= unpinned or len(passed) >= VICTIMS \
                    or most is not None and len(victims) >= most:
                break
            if chunk.pins:
                passed.append(key)
                continue
            victims.append((space, key))
            freed += chunk.cost
        for key in passed:
            space.chunks.move_to_end(key)
        return victims

    def may_evict(self, space: Namespace, target: int) -> bool:
        """Could evicting free bytes of `space` towards `target` (is it above it, and
        does it hold an unpinned byte)?"""
        return space.used > target and space.used > space.pinned_bytes

    def evict(self, space: Namespace, target: int) -> int:
        """Evict least recently used, unpinned chunks for `space` to hold <= target bytes,
        one walk's worth (`victims`: the caller asks again)."""
        victims = self.victims(space, target)
        space.evictions += len(victims)
        self._drop(victims)
        return len(victims)

    def over(self, space: Namespace) -> int | None:
        """The bytes `space` must be evicted down to (its low watermark), if it is above
        its capacity's high one; else None."""
        if space.capacity and space.used > space.capacity * HIGH:
            return int(space.capacity * LOW)
        return None

    def refuse_hopeless(self, space: Namespace, size: int) -> None:
        """Refuse, before anything is evicted, a chunk that could never fit or is no KV
        chunk at all: over MAX_CHUNK (a declared size evicts before a byte is written,
        so it is bounded), over its namespace's capacity, or over the pool's free space
        and every unpinned KV byte together."""
        if size > MAX_CHUNK:
            raise OSError(errno.EFBIG, f"a KV chunk of {size} bytes is over {MAX_CHUNK} "
                          "(split it: engines' chunks are tens of MiB)")
        if space.capacity and charge(size) > space.capacity:
            raise OSError(errno.EFBIG, f"a chunk of {size} bytes (counted as {charge(size)}) "
                          f"is over the capacity of KV namespace {space.name!r} "
                          f"({space.capacity} bytes)")
        free = self._pool_free.free(size)  # (a shared disk counted once)
        evictable = sum(s.used - s.pinned_bytes for s in self.spaces.values()) \
            if size > free else 0  # (summing every chunk held the thread 0.24 s a million)
        if size > free + evictable:
            raise OSError(errno.ENOSPC, f"a chunk of {size} bytes is over the pool's free "
                          f"space ({free} bytes, with every KV chunk evicted)")

    def rooms_stale(self, members: list[int], size: int) -> bool:
        """Whether a chunk of `size` (a member's share of it on `members`) needs the
        space measured again first (`measure_rooms`, off the loop)."""
        return self._pool_free.stale(size) or any(
            self._room_of(m).stale(size) for m in members)

    def rooms_known(self) -> bool:
        """Whether the pool's free space was ever measured (a member's never measured,
        as one not answering, evicts nothing: `make_room`)."""
        return self._pool_free.known

    def measure_rooms(self, members: list[int], size: int, guard: Guarded) -> None:
        """(Blocking: a worker thread.)  Measure what `rooms_stale` found stale, each
        member's filesystem asked through `guard` (a member not answering has no room)."""
        for room in [self._pool_free, *(self._room_of(m) for m in members)]:
            if room.stale(size):
                room.measured(room.measure(guard))

    def _room_of(self, member: int) -> _Room:
        room = self._member_room.get(member)
        if room is None:
            path = self.vol.pool.members[member].path
            room = self._member_room[member] = _Room(
                lambda guard: guard(member, functools.partial(_above_floor, path)))
        return room

    def make_room(self, members: list[int], size: int
                  ) -> list[tuple[Namespace, bytes]] | None:
        """None if there is room for a chunk of `size` on `members`; else the chunks to
        evict pool-wide so later puts find room (see `fair_victims`), for the caller to
        drop a bite at a time.  Judged by the last measures (`measure_rooms`)."""
        short = 0
        for m in members:
            room = self._room_of(m)
            if room.answering and room.known:  # (else it evicts nothing: its writes fail)
                short = max(short, size - room.free(size))
        if short <= 0:
            return None
        need = short * len(self.vol.pool.members) * 2  # bytes are spread over all members
        victims = self.fair_victims(need)
        for space, _ in victims:
            space.evictions += 1
        if victims:
            log.info("KV: pool short of space, evicting %d chunks (%d bytes)", len(victims),
                     sum(s.chunks[k].size for s, k in victims))
        return victims

    def fair_victims(self, need: int) -> list[tuple[Namespace, bytes]]:
        """Unpinned chunks worth `need` bytes, least recently used first within each
        namespace, taken by shares: first between owners (a user's subordinate uids
        with her, `vol/tenants.py`), each of whom may hold an equal part of the KV bytes
        stored: owners over it give up their excess, the others nothing (all within
        it: each in proportion to what it holds); then within an owner's part, between
        her namespaces, each of which may hold an equal part of hers, in the same way.
        A namespace over its own capacity gives up at least its excess.  So a user who
        spreads her chunks over a hundred namespaces takes no more of the pool than
        one who keeps them in one (an equal part by namespace made every eviction fall
        on the other users)."""
        spaces = [s for s in self.spaces.values() if s.used]
        if not spaces:
            return []
        owners: dict[int, list[Namespace]] = {}
        for s in spaces:
            owners.setdefault(s.tenant, []).append(s)
        held = {t: sum(s.used for s in group) for t, group in owners.items()}
        owner_weights = _over_equal(held)
        weights: dict[str, int] = {}
        for t, group in owners.items():
            within = _over_equal({s.name: s.used for s in group})
            total = sum(within.values())
            for s in group:
                part = owner_weights[t] * within[s.name] // total if total else 0
                weights[s.name] = max(part, s.used - s.capacity if s.capacity else 0)
        weight_sum = sum(weights.values())
        if not weight_sum:  # (an owner's excess split by integer division to nothing)
            weights = {s.name: s.used for s in spaces}
            weight_sum = sum(weights.values())
        victims: list[tuple[Namespace, bytes]] = []
        # Pinned chunks walked past: VICTIMS in all a call (VICTIMS a namespace, 32
        # namespaces of pins took 30 ms), a namespace's share of them at most (with
        # PASS_FLOOR), from a namespace taken in turn: a first namespace of a quarter
        # million pins spent it all, and every other was left untouched.
        passing = VICTIMS
        self._first_walked = (self._first_walked + 1) % len(spaces)
        for space in spaces[self._first_walked:] + spaces[:self._first_walked]:
            if space.used <= space.pinned_bytes:
                continue  # (nothing it holds may go)
            quota = -(-need * weights[space.name] // weight_sum) if weight_sum else 0
            most = -(-VICTIMS * weights[space.name] // weight_sum) if weight_sum else 0
            may_pass = min(passing, max(most, PASS_FLOOR))
            taken, n, passed = 0, 0, list[bytes]()
            for key, chunk in space.chunks.items():
                if taken >= quota or n >= most:
                    break
                if chunk.pins:
                    if len(passed) >= may_pass:
                        break
                    passed.append(key)  # (out of the way of the next walk)
                else:
                    victims.append((space, key))
                    taken += chunk.cost
                    n += 1
            passing -= len(passed)
            for key in passed:
                space.chunks.move_to_end(key)
        return victims

    def flush(self, most: int = TOUCH_BITE) -> int:
        """Write back the access times of the `most` keys touched longest ago (called
        with each group commit; the rest wait for the next); how many were written."""
        touched = self._touched
        if not touched:
            return 0
        rows = []
        for (ns, key), atime in itertools.islice(touched.items(), most):
            rows.append((atime, ns, key))
        for _, ns, key in rows:
            del touched[(ns, key)]
        self.vol.store.kv.touch(rows)
        return len(rows)

    def touches(self) -> int:
        """Access times waiting for their write-back (`flush`)."""
        return len(self._touched)

    def stats(self) -> list[NamespaceStats]:
        return [s.stats() for s in self.spaces.values()]


class _Room:
    """Free bytes as last measured, less what the chunks judged by that measure since
    will take.  Measuring asks the members' filesystems (statvfs), which a member that
    stopped answering never answers: it is done off the loop (`KVIndex.measure_rooms`)
    when a chunk finds the measure stale: older than FREE_FRESH_S, or the chunk over
    1/8 of the room.  A small chunk within that is judged without one."""

    def __init__(self, measure: Callable[[Guarded], int | None]) -> None:
        # (Blocking; each member asked through the guard given; None: not answering.)
        self.measure = measure
        self._at = -FREE_FRESH_S
        self._left = 0
        self.answering = True
        self.known = False  # (measured once: until then, judged by nothing)

    def stale(self, size: int) -> bool:
        return time.monotonic() - self._at >= FREE_FRESH_S or size * 8 > self._left

    def measured(self, free: int | None) -> None:
        """A new measure; None (not answering) keeps the last one, for FREE_FRESH_S."""
        self.answering = free is not None
        if free is not None:
            self._left, self.known = free, True
        self._at = time.monotonic()

    def free(self, size: int) -> int:
        """The room before a chunk of `size`, which is then taken from it."""
        room = self._left
        self._left -= size
        return room


def _over_equal(held: dict[K, int]) -> dict[K, int]:
    """How far each holder is over an equal part of what all hold; if none is, what
    each holds (then all give up in proportion)."""
    equal = sum(held.values()) // len(held)
    over = {k: max(0, v - equal) for k, v in held.items()}
    return over if any(over.values()) else held


def _above_floor(path: str) -> int:
    """Bytes free on `path`'s filesystem above the POOL_FREE_MIN it keeps."""
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize - st.f_blocks * st.f_frsize * POOL_FREE_MIN)


def _tables(space: Namespace) -> list[PresenceTable]:
    """The namespace's presence tables: the one readers map, the one being filled."""
    tables = [] if space.next_view is None else [space.next_view.table]
    return tables if space.view is None else [space.view, *tables]

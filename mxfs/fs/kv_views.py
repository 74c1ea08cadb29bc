"""A reading node's presence tables: `kv_view` there, kept current by the change feed.

Engines ask whether keys are stored for every request they schedule; on the writer
they read the namespace's presence table (`vol/kv_presence.py`) instead of asking.  A
reading node holds no KV index, but the writer's change feed carries every key it
stores and drops and every namespace it removes, in commit order
(`meta/feed_notes.py`), so a reading node keeps tables of its own: filled from the
store a bite at a time (BITE keys a turn of its store worker, other requests served
between), then moved by each feed row as the feed follower reads it, and by the puts
its own users sent on (answered once stored: read-your-writes on this node).  A row
read while a table fills and a bite read after it converge on the store's state: the
last change of each key wins either way.

The tables are only as current as the feed: a key another node stored shows here once
the feed row is read (a few milliseconds after its commit).  When the feed cannot be
read, or says "everything" (rows pruned, a group too large to list), every table is
retired MOVED and `kv_view` answers EAGAIN until the feed is read again: clients ask
`kv_exists` meanwhile, which reads the store.  A table that fills up is retired MOVED
too, as is one with a run of MAX_PROBE taken slots (a writer who put keys of one run,
`PresenceTable.due`) and one whose keys a row could not
list (KV_RESET); the next `kv_view` makes a new one, under a fresh seed.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import trio

from mxfs.fs.store_worker import StoreWorker
from mxfs.meta import MetaStore
from mxfs.meta.feed_notes import KV_GONE, KV_RESET, KV_STORED, Change
from mxfs.proto.messages import KVViewsStatus
from mxfs.proto.presence import GONE, MOVED
from mxfs.vol.kv_presence import KeptTables, PresenceTable

log = logging.getLogger("mxfs.kv")

BITE = 1024  # keys read from the store in one turn of the worker (~1.4 ms to add here)
FEED_BITE = 4096  # a feed row's KV notes applied at a time on trio's thread (~3 ms)
REMOVED_WHILE_FILLING = 65536  # keys the feed removed during one table's fill, at most


class FollowerViews:
    """The presence tables of the namespaces this node's clients asked to see."""

    def __init__(self, worker: StoreWorker, most: tuple[int, int] = (4096, 512)) -> None:
        """`most`: tables kept in all, and of those one user's views made (as the
        writer keeps, `KVIndex.viewed`: each holds two descriptors and its slots)."""
        self.worker = worker
        self.live: Callable[[], bool] = lambda: False  # the feed is being read (daemon)
        self.tables: dict[str, PresenceTable] = {}  # by namespace
        self.kept = KeptTables(*most)
        self._filling: dict[str, trio.Event] = {}
        # Keys the feed removed from a table while it filled: a bite read before the
        # removal holds them, and added after it they showed present for good.
        self._removed: dict[str, set[bytes]] = {}
        self._token: trio.lowlevel.TrioToken | None = None

    def status(self) -> KVViewsStatus:
        return {"tables": len(self.tables),
                "keys": sum(t.count for t in self.tables.values()), "live": self.live()}

    async def table(self, ns: str, uid: int, tenant: int) -> PresenceTable:
        """The namespace's table, filled from the store if this node holds none (the
        caller checked that `uid`, of `tenant`, may read it); EAGAIN while the feed
        cannot keep it."""
        if not self.live():
            raise OSError(errno.EAGAIN, "this node cannot read the pool's change feed now: "
                          "its KV lookups ask the metadata store (kv_exists)")
        self._token = trio.lowlevel.current_trio_token()
        while (filling := self._filling.get(ns)) is not None:
            await filling.wait()
        if (table := self.tables.get(ns)) is not None:
            self.kept.asked(ns)
            return table
        done = self._filling[ns] = trio.Event()
        self._removed[ns] = set()
        try:
            return await self._fill(ns, uid, tenant)
        finally:
            del self._filling[ns], self._removed[ns]
            done.set()

    async def _fill(self, ns: str, uid: int, tenant: int) -> PresenceTable:
        count = await self.worker.run(lambda s: s.engine.count("kv", {"ns": ns}), uid)
        table = self._hold(ns, PresenceTable(room=count), tenant)
        try:
            return await self._filled(ns, uid, table)
        except BaseException:  # (a table half filled was served as whole: false misses)
            if self.tables.get(ns) is table:
                self._drop(ns, MOVED)
            raise

    def filled(self, ns: str) -> PresenceTable | None:
        """The namespace's table if this node keeps it whole (none being filled)."""
        return None if ns in self._filling else self.tables.get(ns)

    def _hold(self, ns: str, table: PresenceTable, tenant: int) -> PresenceTable:
        """Keep `table`, counted against `tenant`; past the limits the least recently
        asked of that user's tables (or of all) are retired MOVED (a user who viewed
        thousands of namespaces held two descriptors each, for good)."""
        self.tables[ns] = table
        for name in self.kept.add(ns, tenant):
            self._drop(name, MOVED)
        return table

    @property
    def by_tenant(self) -> Counter[int]:
        return self.kept.by_tenant

    def _drop(self, ns: str, state: int) -> None:
        self.kept.drop(ns)
        self.tables.pop(ns).retire(state)

    async def _filled(self, ns: str, uid: int, table: PresenceTable) -> PresenceTable:
        after: bytes | None = None
        while True:
            def bite(store: MetaStore, after: bytes | None = after) -> list[bytes]:
                return store.kv.keys_after(ns, after, BITE)
            keys = await self.worker.run(bite, uid)
            if self.tables.get(ns) is not table:  # retired meanwhile (the feed, full)
                raise OSError(errno.EAGAIN, f"KV namespace {ns!r}'s table was replaced "
                              "while it filled: ask again")
            removed = self._removed[ns]
            for key in keys:
                if key not in removed:
                    self._add(ns, table, key)
            if self.tables.get(ns) is not table:
                raise OSError(errno.EAGAIN, f"KV namespace {ns!r} grew while its table "
                              "filled: ask again")
            if len(keys) < BITE:
                return table
            after = keys[-1]

    def put(self, ns: str, key: bytes) -> None:
        """A put this node sent on was stored (or was there): it shows here at once."""
        if (table := self.tables.get(ns)) is not None:
            self._add(ns, table, key)

    def from_feed(self, change: Change) -> None:
        """(The feed follower's thread.)  Apply a feed row's KV notes on trio's thread;
        with `change.kv_unknown` (or the feed lost), retire every table."""
        token = self._token
        if token is None:  # (no table was ever asked for: nothing to keep)
            return
        try:
            if change.kv_unknown:
                trio.from_thread.run_sync(self.retire_all, trio_token=token)
                return
            for start in range(0, len(change.kv), FEED_BITE):  # (others run between)
                trio.from_thread.run_sync(self._apply, change.kv[start:start + FEED_BITE],
                                          trio_token=token)
        except trio.RunFinishedError:
            pass

    def apply(self, change: Change) -> None:
        """A feed row's KV notes, whole (on trio's thread; `from_feed` sends a long
        row's a bite at a time)."""
        if change.kv_unknown:
            self.retire_all()
        else:
            self._apply(change.kv)

    def _apply(self, notes: Sequence[tuple[int, str, bytes]]) -> None:
        for what, ns, key in notes:
            table = self.tables.get(ns)
            if table is None:
                continue
            if what in (KV_GONE, KV_RESET):  # (reset: refilled at the next kv_view)
                self._drop(ns, GONE if what == KV_GONE else MOVED)
            elif what == KV_STORED:
                self._add(ns, table, key)
                if (removed := self._removed.get(ns)) is not None:
                    removed.discard(key)  # (stored again: present, whatever a bite says)
            else:
                table.remove(key)
                if (removed := self._removed.get(ns)) is not None:
                    if len(removed) >= REMOVED_WHILE_FILLING:  # (a storm: filled again)
                        self._drop(ns, MOVED)
                    else:
                        removed.add(key)

    def _add(self, ns: str, table: PresenceTable, key: bytes) -> None:
        if not table.full():
            table.add(key)
            if not (table.overflowed and table.due()):
                return
        # (full, or a run too long and `due`: the next kv_view makes a larger one, or
        # one under a fresh seed; before, readers of the run ask the store)
        self._drop(ns, MOVED)

    def retire_all(self) -> None:
        """Every table goes MOVED (their readers ask again, or ask the store)."""
        for ns in list(self.tables):
            self._drop(ns, MOVED)

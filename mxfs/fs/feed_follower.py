"""A reading node follows the pool's change feed (`meta/change_feed.py`): what the
writer node changed is invalidated in this node's kernel as it commits, so the kernel
keeps answers long (`fs/kernel_cache.py`) and a name made on the writer shows here at
once, not after a timeout.

A thread of its own waits for the server's notifications (a connection of its own) and
reads the rows past the last it saw (another, read-only); it hands the KV notes to the
node's tables and drops the daemon's read-ahead of what changed at once.  The kernel's
invalidation calls wait until the kernel has dropped what it held, which may take a
FUSE request answered meanwhile or one a user holds (a directory's lock), so they are
handed to threads of their own (`fs/invalidations.py`: one directory held stalls only
its own), never made on trio's thread nor on this one: the feed is read, the KV tables
kept and the row this node read (`applied`, what its word to the writer says:
`fs/held_open.py`) told on, whatever one user holds.  If the server cannot be reached,
answers turn short until the feed is read again; the rows missed meanwhile are read
then (or, if they were pruned, or more than a read merges, everything the kernel may
hold is invalidated: `FeedReader.read` holds a bounded backlog).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import trio

from mxfs.fs.invalidations import FEED, Held, Invalidations
from mxfs.fs.kernel_cache import FOLLOW_TIMEOUT, KernelCache
from mxfs.meta import MetaStore, location
from mxfs.meta.change_feed import FeedReader
from mxfs.meta.engine import Unusable
from mxfs.meta.feed_notes import Change, channel
from mxfs.proto.messages import FeedStatus

log = logging.getLogger("mxfs.fs")

POLL_S = 1.0  # rows are read at least this often: a lost notification, a dead server
RETRY_S = 1.0  # between tries to reach a server that went away


class FeedFollower:
    """`held`: the inodes and entries the kernel may hold (for "everything");
    `data_changed(ino)`: drop what the daemon itself holds of a file's bytes."""

    def __init__(self, where: str, pool_uuid: str, node: str, kernel: KernelCache,
                 held: Held, data_changed: Callable[[int], None]) -> None:
        self.where = where
        self.channel = channel(pool_uuid)
        self.kernel = kernel
        self.held = held
        self.data_changed = data_changed
        # KV keys stored and dropped on the writer (a reading node's presence tables:
        # `fs/kv_views.py`); told "everything" when the feed is lost.
        self.on_kv: Callable[[Change], None] | None = None
        self.applied = 0  # the last row read (status)
        self.error = ""  # why the feed cannot be read, while it cannot
        self._stop = threading.Event()
        self.calls = Invalidations(held, self._stop)  # (the kernel's, off this thread)
        # Connected now, before the kernel holds anything: a change committed from now
        # on is read (`FeedReader` starts at the present).
        self._conn: tuple[MetaStore, location.Listener | None] | None = self._open(None)
        self._reader = FeedReader(self._conn[0], node)

    def _open(self, reader: FeedReader | None) -> tuple[MetaStore, location.Listener | None]:
        store = MetaStore.open(self.where, readonly=True)
        try:
            listener = location.listen(self.where, self.channel)
        except BaseException:
            store.close()
            raise
        if reader is not None:
            reader.store = store
        return store, listener

    def status(self) -> FeedStatus:
        return {"role": "follows", "live": self.kernel.feed_live, "seq": self.applied,
                "invalidations": self.calls.made, "pending": self.calls.pending,
                "error": self.error, "answers_s": self.kernel.answers_s}

    async def run(self) -> None:
        """The daemon's task: the thread runs while the mount does."""
        thread = threading.Thread(target=self._follow, name="mxfs-feed", daemon=True)
        thread.start()
        try:
            await trio.sleep_forever()
        finally:
            self._stop.set()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join, POLL_S + 5)
                await trio.to_thread.run_sync(self.calls.close, 1.0)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                if self._conn is None:
                    self._conn = self._open(self._reader)
                    log.info("the change feed is read again: the kernel keeps answers "
                             "long again")
                change, self.applied = self._reader.read()
                self.kernel.feed_live = True
                self.error = ""
                if change:
                    self._apply(change)
                listener = self._conn[1]
                if listener is None:  # (no server: nobody else writes; never here)
                    self._stop.wait(POLL_S)
                else:
                    listener.wait(POLL_S)
            except Exception as e:  # (OSError, Unusable; a Conflict of a DBA's lock, or
                #                        a bug: ended, the thread left the feed "live")
                if self.kernel.feed_live or not self.error:
                    log.warning("the change feed cannot be read (%s): the kernel asks "
                                "again every %g s until it can", e, FOLLOW_TIMEOUT,
                                exc_info=not isinstance(e, OSError | Unusable))
                self.kernel.feed_live = False
                self.error = str(e)
                if self.on_kv is not None:  # (what the feed misses, tables would miss)
                    self.on_kv(Change(everything=True))
                self._close()
                self._stop.wait(RETRY_S)
        self._close()

    def _close(self) -> None:
        if self._conn is None:
            return
        store, listener = self._conn
        self._conn = None
        for part in (listener, store):
            try:
                if part is not None:
                    part.close()
            except Exception:  # (a connection already lost)
                pass

    def _apply(self, change: Change) -> None:
        """Invalidate in the kernel what `change` touched: names, attributes, and the
        cached pages (a file's data, a directory's listing) of what changed data; the
        calls are handed on, the rest is done here."""
        if self.on_kv is not None and (change.kv or change.kv_unknown):
            self.on_kv(change)
        if change.everything:
            inos, names = self.held()
            for ino in inos:
                self.data_changed(ino)
            self.calls.everything(inos, names, FEED)
            return
        for ino in change.data:
            self.data_changed(ino)
        # (as the feed's own tenant, held to a share as a user is: as root's, a user
        # who held the directories the feed changed took every thread of the node)
        self.calls.add(change.names, change.data, change.inos - change.data, uid=FEED)

"""A store connection of the daemon's own (read-only unless asked), used from a worker
thread, one call at a time.

Reads that a request needs from a metadata server (a reading node's KV lookups) are
round trips; on trio's thread each would hold every other request up for as long as it
takes, and a request may name thousands of keys.  So they run here, batched by the
caller (`Engine.get_many`), on a connection kept open between calls (a new one per call
costs more than the reads) and made again after it failed.  (A writer prunes its
change feed on one too: `fs/daemon.py`.)
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

import trio

from mxfs.meta import MetaStore, Unusable

T = TypeVar("T")


class StoreWorker:
    def __init__(self, where: str, readonly: bool = True) -> None:
        self.where = where  # the store's location (`meta/location.py`)
        self.readonly = readonly
        self._store: MetaStore | None = None
        self._lock = trio.Lock()  # one call at a time: a store is one thread's

    async def run(self, fn: Callable[[MetaStore], T]) -> T:
        """`fn(store)` in a worker thread; OSError (EIO) if the store cannot be read."""
        async with self._lock:
            return await trio.to_thread.run_sync(self._run, fn)

    def _run(self, fn: Callable[[MetaStore], T]) -> T:
        if self._store is None:
            try:
                self._store = MetaStore.open(self.where, readonly=self.readonly)
            except Unusable as e:  # (a server away, say)
                raise OSError(errno.EIO, f"the metadata store cannot be read now: {e}") \
                    from None
        try:
            return fn(self._store)
        except OSError:
            self.close()  # (its connection may be the reason: a new one next time)
            raise

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except OSError:
                pass

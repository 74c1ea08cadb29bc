"""A store connection of the daemon's own (read-only unless asked), used from a worker
thread, one call at a time.

Reads that a request needs from a metadata server (a reading node's KV lookups, and on
a worker of their own the reads of its FUSE lookups, getattrs, opens, readdirs and
xattrs) are round trips; on trio's thread each would hold every other request up for
as long as it takes, and a request may name thousands of keys.  So they run here,
batched by the caller (`Engine.get_many`), on a connection kept open between calls (a
new one per call costs more than the reads) and made again after it failed.  (A writer prunes its
change feed on one too: `fs/daemon.py`.)

Calls take turns by uid, round robin, not in the order they came: a user with many
requests of thousands of keys each waits behind its own, and another user's call
waits for at most one call of each other user (callers keep calls short: a bite of
keys each, `fs/kv_follow.py`).  Measured with `tools/bench_fair.py --meta`: a victim's
lookup waited 858 ms behind a flood of 4,096-key lookups when calls ran first come,
first served.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

import trio

from mxfs.fs.fair import RoundRobin
from mxfs.meta import MetaStore, Unusable

T = TypeVar("T")


# A request served from the store waits for the metadata server at most this long (its
# reads take milliseconds): a server that stopped answering holds a node's users this
# long once, then is away (EIO at once) until it answers again (`Engine.bound_waits`).
SERVE_WAIT_S = 5.0


class StoreWorker:
    def __init__(self, where: str, readonly: bool = True, wait_s: float | None = None,
                 prepare: Callable[[MetaStore], None] | None = None) -> None:
        """`wait_s`: the store's bound on every wait for the server (`SERVE_WAIT_S` for
        requests' lookups; None: a long statement's bound, for maintenance); `prepare`
        is given the store once opened (a follower's: `MetaStore.read_beside`)."""
        self.where = where  # the store's location (`meta/location.py`)
        self.readonly = readonly
        self.wait_s = wait_s
        self.prepare = prepare
        self._store: MetaStore | None = None
        self._line = RoundRobin(1)  # one call at a time: a store is one thread's
        # ... and that thread its own: never behind a flood of trio's shared ones
        self._thread = trio.CapacityLimiter(1)

    async def run(self, fn: Callable[[MetaStore], T], uid: int = 0) -> T:
        """`fn(store)` in a worker thread, in `uid`'s turn; OSError (EIO) if the store
        cannot be read."""
        async with self._line.slot(uid):
            return await trio.to_thread.run_sync(self._run, fn, limiter=self._thread)

    def _run(self, fn: Callable[[MetaStore], T]) -> T:
        if self._store is None:
            try:
                self._store = MetaStore.open(self.where, readonly=self.readonly)
            except Unusable as e:  # (a server away, say)
                raise OSError(errno.EIO, f"the metadata store cannot be read now: {e}") \
                    from None
            if self.wait_s is not None:
                self._store.engine.bound_waits(self.wait_s)
            if self.prepare is not None:
                self.prepare(self._store)
        # (Kept after a failure: an engine on a server dials again by itself, and while
        # the server is away it refuses at once instead of each call waiting to connect.)
        return fn(self._store)

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except OSError:
                pass

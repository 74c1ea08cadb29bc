"""What a chown moves between owners, measured off the daemon's thread.

A chown moves a file's xattrs and names from its owner's quota tally to the new
owner's (`meta/usage.py`), and gives room to the new one first (`Quotas.room_for_owner`).
Summing them is a statement over every name: a file of 65,000 hard links held the
thread 17 ms a chown, as often as a user asked.  So a writer sums them on a connection
of its own in a worker thread, in the caller's turn (`fs/store_worker.py`).  That
connection sees committed rows only: the open group is committed first if it changed
them, and the sum stands if the file's names and xattrs did not change while it was taken
(`MetaStore.watch_owned`); else it is taken again, TRIES times at most.  The watch
lasts until the chown is made: a chown awaits more after it measured (a lent file's
copy, `renew`), and sums the rows no longer held then moved a wrong amount (the tally
drifted till the next recount), so they are read inside the change instead
(`Measured.now`), as they are where the open group cannot be committed.
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from mxfs.fs.store_worker import StoreWorker
from mxfs.meta import Inode, MetaStore
from mxfs.meta.store import Owned
from mxfs.vol.quota import Quotas

TRIES = 8  # sums a chown takes while the file's names keep changing, before EAGAIN


def _never() -> bool:
    return False


@dataclass(frozen=True)
class Measured:
    """A chown's measured sums (None: none taken; read in the change) and whether the
    file's names or xattrs changed since."""

    sums: Owned | None
    changed: Callable[[], bool] = _never

    def now(self) -> Owned | None:
        """The sums if the rows still hold them, else None (`set_attrs` reads them
        inside its change): asked in the synchronous step that makes the chown."""
        return None if self.changed() else self.sums


class OwnedSums:
    """A writer's sums of what chowns move (one connection, its calls in uid turns)."""

    def __init__(self, quotas: Quotas, worker: StoreWorker) -> None:
        """`worker`: on `quotas.store`'s rows (a writer's daemon shares its KV reads':
        `KVOps.rows`)."""
        self.quotas = quotas
        self.worker = worker

    @asynccontextmanager
    async def of(self, node: Inode, uid: int | None, caller: int
                 ) -> AsyncIterator[Measured]:
        """What a chown of `node` to `uid` by `caller` moves, summed off the thread and
        watched while inside (`Measured.now` at the change); no sums where it moves
        nothing or nothing is counted."""
        store = self.quotas.store
        if uid is None or uid == node.uid or \
                not (store.usage.counted or self.quotas.limits):
            yield Measured(None)
            return
        ino = node.ino
        for _ in range(TRIES):
            if store.owned_uncommitted(ino):  # (the worker sees committed rows only)
                try:
                    store.commit()
                except OSError:  # (the group commit tells why, once: read in the change)
                    yield Measured(None)
                    return
            with store.watch_owned(ino) as changed:
                owned = await self.worker.run(lambda s: MetaStore.owned(s, ino), caller)
                if not changed():
                    yield Measured(owned, changed)
                    return
        raise OSError(errno.EAGAIN, f"the names of inode {ino} kept changing while a chown "
                      "counted them: try again")

"""What a chown moves between owners, measured off the daemon's thread.

A chown moves a file's xattrs and names from its owner's quota tally to the new
owner's (`meta/usage.py`), and gives room to the new one first (`Quotas.room_for_owner`).
Summing them is a statement over every name: a file of 65,000 hard links held the
thread 17 ms a chown, as often as a user asked.  So a writer sums them on a connection
of its own in a worker thread, in the caller's turn (`fs/store_worker.py`).  That
connection sees committed rows only: the open group is committed first if it changed
them, and the sum stands if the file's names and xattrs did not change while it was taken
(`MetaStore.watch_owned`); else it is taken again, TRIES times at most.
"""

from __future__ import annotations

import errno

from mxfs.fs.store_worker import StoreWorker
from mxfs.meta import Inode, MetaStore
from mxfs.meta.store import Owned
from mxfs.vol.quota import Quotas

TRIES = 8  # sums a chown takes while the file's names keep changing, before EAGAIN


class OwnedSums:
    """A writer's sums of what chowns move (one connection, its calls in uid turns)."""

    def __init__(self, quotas: Quotas, worker: StoreWorker) -> None:
        """`worker`: on `quotas.store`'s rows (a writer's daemon shares its KV reads':
        `KVOps.rows`)."""
        self.quotas = quotas
        self.worker = worker

    async def of(self, node: Inode, uid: int | None, caller: int) -> Owned | None:
        """What a chown of `node` to `uid` by `caller` moves, summed off the thread;
        None where it moves nothing or nothing is counted (no sum needed)."""
        store = self.quotas.store
        if uid is None or uid == node.uid or \
                not (store.usage.counted or self.quotas.limits):
            return None
        ino = node.ino
        for _ in range(TRIES):
            if store.owned_uncommitted(ino):  # (the worker sees committed rows only)
                store.commit()
            with store.watch_owned(ino) as changed:
                owned = await self.worker.run(lambda s: MetaStore.owned(s, ino), caller)
                if not changed():
                    return owned
        raise OSError(errno.EAGAIN, f"the names of inode {ino} kept changing while a chown "
                      "counted them: try again")

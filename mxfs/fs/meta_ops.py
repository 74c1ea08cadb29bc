"""The metadata operations of the control socket, and what the daemon's tasks share
with them: making every change durable, and online backups."""

from __future__ import annotations

import errno
import logging

import trio

from mxfs.fs.fields import Msg
from mxfs.fs.session import Answer, Handler, Session
from mxfs.meta import MetaStore
from mxfs.proto.messages import BackupReply, Empty
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.control")

# The syncs that answer commits have threads of their own: on trio's shared ones they
# waited behind whatever flooded those (a user's hundreds of closes, each cutting files).
SYNCING = trio.CapacityLimiter(8)


async def durable(store: MetaStore) -> None:
    """Every change so far committed and on stable storage (the sync in a worker)."""
    store.commit()
    await trio.to_thread.run_sync(store.sync, limiter=SYNCING)


class MetaOps:
    def __init__(self, vol: Volume) -> None:
        self.vol = vol

    def handlers(self) -> dict[str, Handler]:
        return {"meta_backup": self._backup, "meta_sync": self._sync}

    async def sync_meta(self) -> None:
        """Write back what memory holds (sizes and times of open files), commit, fsync."""
        self.vol.store.flush_all()
        await durable(self.vol.store)

    async def backup_meta(self) -> str:
        """Sync, then copy the metadata store online to the next member."""
        await self.sync_meta()
        path = await trio.to_thread.run_sync(self.vol.backup_meta)
        log.info("metadata backed up to %s", path)
        return path

    async def _backup(self, msg: Msg, session: Session) -> Answer[BackupReply]:
        if session.caller.uid != 0:
            raise OSError(errno.EPERM, "only root backs up the metadata store")
        return {"path": await self.backup_meta()}, []

    async def _sync(self, msg: Msg, session: Session) -> Answer[Empty]:
        if session.caller.uid != 0:
            raise OSError(errno.EPERM, "only root syncs the metadata store")
        await self.sync_meta()
        return {}, []

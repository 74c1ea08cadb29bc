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

class SharedSync:
    """A store's syncs, shared by every request that needs its changes on stable
    storage (FUSE fsyncs, direct commits, truncates, root's syncs): one runs at a time,
    on a thread of its own, and a caller waits for the first begun after it asked.  A
    user's 400 fsyncs at once queued everyone's behind them; a direct commit and a
    truncate each ran a sync of their own, first come, so a user's commits and O_TRUNC
    opens in a loop put every other user's fsync behind all of hers.  Now she waits
    for one sync, as he does (a sync covers every change committed before it)."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self._asked = self._done = 0  # syncs asked for, and the last asked one covered
        self._running: trio.Event | None = None
        # (its own thread: on trio's shared ones, or a lane's, syncs waited behind
        # whatever flooded those)
        self._thread = trio.CapacityLimiter(1)

    async def durable(self) -> None:
        """Every change so far committed and on stable storage."""
        self.store.commit()
        await self.synced()

    async def synced(self) -> None:
        """Every change committed so far on stable storage."""
        self._asked += 1
        ticket = self._asked
        while self._done < ticket:
            if self._running is not None:
                await self._running.wait()
                continue
            self._running, covers = trio.Event(), self._asked
            try:
                await trio.to_thread.run_sync(self.store.sync, limiter=self._thread)
                self._done = max(self._done, covers)
            finally:
                self._running.set()
                self._running = None


class MetaOps:
    def __init__(self, vol: Volume, syncs: SharedSync) -> None:
        self.vol = vol
        self.syncs = syncs

    def handlers(self) -> dict[str, Handler]:
        return {"meta_backup": self._backup, "meta_sync": self._sync}

    async def sync_meta(self) -> None:
        """Write back what memory holds (sizes and times of open files), commit, fsync."""
        self.vol.store.flush_all()
        await self.syncs.durable()

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

"""The control socket's services, and the dispatch of each request to one of them
(the server side of `client/control.py`: the same protocol, two layers).

The listener (`fs/listener.py`) accepts connections, admits them against the limits
and reads one framed request at a time; `dispatch` hands each to the handler of the
module that owns its op, in the caller's turn (`fs/fair.py`) and timed
(`fs/metrics.py`).  The services, each a module with a `handlers()` table:

    status   hello, stat, metrics, df, quota         fs/status_ops.py
    files    layout, open_read, create, commit, abort fs/file_ops.py
    remote   close_read                               fs/remote_reads.py
    kv       kv_*                                     fs/kv_ops.py
    meta     meta_backup, meta_sync                   fs/meta_ops.py

A new service is a module with `handlers()` and one line in `ControlServer.__init__`;
every op the protocol names (`proto.OPS`) must have exactly one handler.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from mxfs.fs.descriptors import Descriptors
from mxfs.fs.fair import Turns
from mxfs.fs.fields import Msg, check_fields
from mxfs.fs.file_ops import FileOps
from mxfs.fs.kv_ops import KVOps
from mxfs.fs.limits import Limits
from mxfs.fs.listener import Listener
from mxfs.fs.meta_ops import MetaOps, SharedSync
from mxfs.fs.metrics import Metrics
from mxfs.fs.reach import MountReach
from mxfs.fs.remote_reads import RemoteReads
from mxfs.fs.session import Handler, Session
from mxfs.fs.status_ops import StatusOps
from mxfs.fs.store_worker import StoreWorker
from mxfs.fs.wake import WakeLatency
from mxfs.pool.chunks import RETIRED
from mxfs.pool.closer import CLOSER, close_later
from mxfs.proto import BY_NAME, OPS
from mxfs.proto.messages import HELLO
from mxfs.vol.access import Caller
from mxfs.vol.kv_index import KVIndex
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.control")


class ControlServer:
    def __init__(self, volume: Volume, path: str, mountpoint: str,
                 writeback_cache: bool = False,
                 entry_changed: Callable[[int, bytes, int], Awaitable[None]] | None = None,
                 metrics: Metrics | None = None, limits: Limits | None = None,
                 only_uid: int | None = None,
                 settle: Callable[[int], Awaitable[None]] | None = None,
                 wake: WakeLatency | None = None, reads: StoreWorker | None = None,
                 syncs: SharedSync | None = None) -> None:
        """`reads`: a reading node's worker for its store's reads (`fs/ops.py`);
        `syncs`: the store's syncs, shared with the mount's fsyncs."""
        self.vol = volume
        self.mountpoint = mountpoint
        # A mount without allow_other serves its owner alone; so does this socket.
        self.only_uid = only_uid
        self.metrics = metrics or Metrics()
        self.limits = limits or Limits()
        self.wake = wake
        self.turns = Turns(self.limits.max_active_per_user)  # requests in service by uid
        self.pending_by_uid: Counter[int] = Counter()  # unpublished files, all connections
        # The daemon's descriptors held for tenants: its connections, presence tables,
        # open and unpublished files (the chunk service's connections, once it runs).
        self.fds = Descriptors(self.limits)
        self.listener = Listener(path, self.limits, self.dispatch, self._session,
                                 self._end_session, self.fds,
                                 close_later, MountReach(mountpoint).may_reach)
        self.remote = RemoteReads(volume, self.limits)  # (a reading node's direct path)
        lim = self.limits
        self.kv = KVOps(volume, KVIndex(volume, lim.max_namespaces_per_user,
                                        (lim.max_kv_views, lim.max_kv_views_per_user)),
                        lim, self.remote)
        self.kv.turns = self.turns  # (its waits on others' claims step out of them)
        self.kv.sessions = lambda: self.listener.sessions.values()
        self.fds.elsewhere += [self.listener.connections, self.kv.view_fds,
                               lambda: CLOSER.pending,  # (still closing: `pool/closer.py`)
                               lambda: RETIRED.count]  # (renewed files': `pool/chunks.py`)
        self.files = FileOps(volume, mountpoint, self.limits,
                             lambda: self.listener.sessions.values(),
                             writeback_cache=writeback_cache, entry_changed=entry_changed,
                             settle=settle, remote=self.remote, reads=reads,
                             pending_by_uid=self.pending_by_uid, syncs=syncs)
        self.meta = MetaOps(volume, self.files.syncs)
        self.status = StatusOps(volume, mountpoint, self.limits, self.listener, self.kv,
                                self.pending_by_uid, self.metrics, wake, reads)
        if volume.pool.remote is not None:
            self.status.remote = self.remote
        self.handlers: dict[str, Handler] = {}
        for service in (self.status, self.files, self.remote, self.kv, self.meta):
            for op, handler in service.handlers().items():
                assert op not in self.handlers, f"two services serve {op}"
                self.handlers[op] = handler
        assert set(self.handlers) == set(OPS), set(OPS) ^ set(self.handlers)

    @property
    def path(self) -> str:
        return self.listener.path

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        await self.listener.serve(task_status=task_status)

    async def dispatch(self, msg: Msg, session: Session) -> tuple[dict[str, Any], list[int]]:
        """Serve one request (its envelope checked by the listener): its fields checked
        against its op's declaration, then its handler's reply, marked ok."""
        caller, op = session.caller, BY_NAME[msg["op"]]
        async with self.turns.turn(caller.uid):
            await self.listener.reply_room(session)  # (its reply is made only with room)
            with self.metrics.timed("control", op.name):
                if op is not HELLO and self.only_uid is not None and \
                        caller.uid != self.only_uid:
                    raise OSError(errno.EACCES, "the pool is mounted without allow_other: "
                                  f"only uid {self.only_uid} may use it")
                check_fields(msg, op)
                reply, fds = await self.handlers[op.name](msg, session)
        stray = op.stray(reply)
        if stray is not None:  # a bug of the daemon: its clients may trip on it
            log.error("%s", stray)
        return {"ok": True, **reply}, fds

    def _session(self, caller: Caller, conn: Any) -> Session:
        return Session(caller, self.pending_by_uid, conn=conn, quotas=self.vol.quotas,
                       fds=self.fds, fds_each=len(self.vol.pool.local_members()))

    async def _end_session(self, session: Session) -> None:
        """A connection closed: what it held goes (its leases, its unpublished files:
        those cut in worker threads)."""
        for release in (self.remote.release, self.kv.release):
            try:
                release(session)
            except Exception as e:
                self.listener.failures.note("release", session.caller, e)
        try:
            await self.files.release(session)
        except Exception as e:
            self.listener.failures.note("release", session.caller, e)

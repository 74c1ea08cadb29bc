"""The status operations of the control socket: `hello`, `stat` (what `mxfs status`
shows), `metrics`, `df` and `quota`; the pool and what each user holds of it."""

from __future__ import annotations

import errno
import os
from collections import Counter
from typing import Any

from mxfs import __version__
from mxfs.fs.chunk_service import ChunkService
from mxfs.fs.feed_follower import FeedFollower
from mxfs.fs.fields import Msg, bool_field, int_field
from mxfs.fs.gc_keeper import GC_KEEPER
from mxfs.fs.kv_ops import KVOps
from mxfs.fs.limits import Limits, fd_limit, open_fds
from mxfs.fs.listener import Listener
from mxfs.fs.member_calls import MemberSpace
from mxfs.fs.metrics import Metrics
from mxfs.fs.remote_reads import RemoteReads
from mxfs.fs.session import Answer, Handler, Session
from mxfs.fs.store_worker import StoreWorker
from mxfs.fs.surveys import Surveys
from mxfs.fs.wake import WakeLatency
from mxfs.io.batch import ENGINE, native_engine, taken_back
from mxfs.meta import MetaStore, lease
from mxfs.meta.survey import bytes_by_use
from mxfs.pool.closer import CLOSER
from mxfs.proto import OPS, VERSION
from mxfs.proto.messages import (
    DfReply,
    FeedStatus,
    HelloReply,
    MetricsReply,
    NodeStatus,
    QuotaReport,
    StatReply,
)
from mxfs.vol.quota import DEFAULT, NONE, Quota, Quotas
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume


class StatusOps:
    def __init__(self, vol: Volume, mountpoint: str, limits: Limits, listener: Listener,
                 kv: KVOps, pending_by_uid: Counter[int], metrics: Metrics,
                 wake: WakeLatency | None = None, reads: StoreWorker | None = None) -> None:
        self.vol = vol
        self.mountpoint = mountpoint
        self.limits = limits
        self.listener = listener  # connections and what was sent on them
        self.kv = kv  # leases and chunks by uid
        self.pending_by_uid = pending_by_uid  # unpublished files by uid
        self.metrics = metrics
        self.wake = wake  # the CPU latency limit held while busy (-o wake_latency_us)
        # The members' space, off the loop (`fs/member_calls.py`; the mount's, once the
        # daemon has one: one set of threads and of members left out).
        self.space = MemberSpace(vol)
        self.surveys = Surveys(vol.pool.meta_location, vol.store.commit)
        self.chunks: ChunkService | None = None  # the daemon's, when it serves chunks
        self.feed: FeedFollower | None = None  # a reading node's (`fs/feed_follower.py`)
        self.remote: RemoteReads | None = None  # a reading node's (`fs/remote_reads.py`)
        # A reading node's store reads (round trips to the server), off trio's thread.
        self.reads = reads

    def handlers(self) -> dict[str, Handler]:
        return {"hello": self._hello, "stat": self._stat, "metrics": self._metrics,
                "df": self._df, "quota": self._quota}

    async def _hello(self, msg: Msg, session: Session) -> Answer[HelloReply]:
        return {"version": VERSION, "server": f"mxfs {__version__}",
                "pid": os.getpid(), "pool_uuid": self.vol.pool.uuid, "ops": list(OPS),
                "uid": session.caller.uid}, []

    async def _stat(self, msg: Msg, session: Session) -> Answer[StatReply]:
        uid = session.caller.uid
        status = await self.status(uid)
        if uid != 0:  # names of lost files may sit under others' 0700 folders
            status["lost_examples"] = []
            limits = status["limits"]  # (nor who else uses the daemon, or how much)
            limits["by_user"], limits["busiest_user"], limits["users"] = {}, None, 0
        return {**status}, []

    async def _metrics(self, msg: Msg, session: Session) -> Answer[MetricsReply]:
        await self.read_published(session.caller.uid)
        return {**self.metrics.snapshot(),
                "members": await self.space.usage(session.caller.uid)}, []

    async def _df(self, msg: Msg, session: Session) -> Answer[DfReply]:
        await self.read_published(session.caller.uid)
        return {"members": await self.space.usage(session.caller.uid),
                "by_use": await self.surveys.get("by_use", bytes_by_use)}, []

    async def _quota(self, msg: Msg, session: Session) -> Answer[QuotaReport]:
        return serve_quota(self.vol.quotas, msg, session.caller.uid), []

    async def read_published(self, uid: int) -> None:
        """A reading node: what the writer published of the pool (members' space,
        inodes), read now if it is stale, in `uid`'s turn of the store worker, so that
        what follows finds it read (a hung server holds this caller, not the loop)."""
        if self.reads is not None:
            await self.reads.run(self.vol.published, uid)

    async def status(self, viewer: int = 0) -> StatReply:
        """The pool as `mxfs status` shows it (the quota lines: `viewer`'s own, or every
        uid's to root)."""
        await self.read_published(viewer)
        nodes = await self.reads.run(self.nodes, viewer) if self.reads is not None \
            else self.nodes()
        quotas = self.vol.quotas
        shown = None if not quotas.limits else quotas.report(None if viewer == 0 else viewer)
        pool = self.vol.pool
        lost, names = 0, []
        if pool.failed:
            lost, names = await self.surveys.get(
                "lost", lambda store: self.vol.lost_files(limit=100, store=store))
        return {"degraded": bool(pool.failed), "lost_files": lost, "lost_examples": names,
                "pool_uuid": pool.uuid, "label": pool.label,
                "stripe_unit": pool.stripe_unit,
                "mountpoint": self.mountpoint, "pid": os.getpid(), "socket": self.listener.path,
                "members": await self.space.usage(viewer), "inodes": self.vol.count_inodes(),
                "open_files": len(self.vol.open_inodes),
                "orphans_queued": len(self.vol.pending_reclaim), "closing": CLOSER.pending,
                "io_engine": ENGINE,
                "native_engine": native_engine()[1], "io_taken_back": taken_back(),
                "limits": self.usage_of_limits(),
                "quotas": shown,
                "wake_latency": self.wake.state() if self.wake else None,
                "lease": self.vol.keeper.status() if self.vol.keeper else None,
                "chunk_service": self.chunks.status() if self.chunks else None,
                "feed": self.feed_status(),
                "remote_reads": self.remote.status() if self.remote else None,
                "kv_forward": self.kv.forward.status() if self.kv.forward else None,
                "kv_views": self.kv.follower.views.status() if self.kv.follower else None,
                "node": pool.node or (self.vol.lease.name if self.vol.lease else ""),
                "config": pool.config, "nodes": nodes, "gc": GC_KEEPER.status()}

    def feed_status(self) -> FeedStatus | None:
        """The change feed: what a reading node read of it, or what a writer published."""
        if self.feed is not None:
            return self.feed.status()
        noted = self.vol.store.feed
        if noted is not None:
            return {"role": "publishes", "published": noted.published}
        return None

    def nodes(self, store: MetaStore | None = None) -> list[NodeStatus]:
        """Every node of a pool on a metadata server (none for one on a member), read
        from `store` (a worker's) or the volume's."""
        if not self.vol.pool.meta_url:
            return []
        try:
            return lease.nodes(store or self.vol.store)
        except OSError:  # the server is away: status says so in the lease line
            return []

    def usage_of_limits(self) -> dict[str, Any]:
        """How close the daemon is to each limit (what `mxfs status` shows)."""
        busiest = self.listener.conns.most_common(1)
        return {**{k: getattr(self.limits, k) for k in Limits.options()},
                "connections": sum(self.listener.conns.values()), "users": len(self.listener.conns),
                "fds_in_flight": sum(s.sent_fds for s in self.listener.sessions.values()),
                "bytes_buffered": sum(self.listener.buffered.held.values()),
                "busiest_user": list(busiest[0]) if busiest else None,
                "fds_open": open_fds(), "fds_max": fd_limit(),
                "fds_held": self.listener.fds.held(), "fds_budget": self.listener.fds.budget(),
                "fds_share": self.listener.fds.share(), "by_user": self.by_user()}

    def by_user(self, most: int = 20) -> dict[str, dict[str, int]]:
        """What each user holds against its limits, its subordinate uids' with it
        (`vol/tenants.py`; the `most` busiest, by connections then KV chunks): for
        `mxfs status`, root's view."""
        held: dict[int, dict[str, int]] = {}

        def of(uid: int) -> dict[str, int]:
            return held.setdefault(uid, {"connections": 0, "requests": 0, "pending": 0,
                                         "pins": 0, "pinned_bytes": 0, "fds_in_flight": 0,
                                         "kv_chunks": 0,
                                         "bytes_buffered": 0, "fds_held": 0})
        for uid, n in self.listener.conns.items():
            of(uid)["connections"] = n
        if self.kv.turns is not None:  # (in service or waiting for a turn; waits aside too)
            for uid, n in self.kv.turns.waiting().items():
                of(uid)["requests"] = n
        for uid, n in self.pending_by_uid.items():
            of(uid)["pending"] = n
        for uid, n in self.kv.pinned_by_uid.items():
            of(uid)["pins"] = n
        for uid, n in self.kv.pinned_bytes.items():
            of(uid)["pinned_bytes"] = n
        for uid, n in self.kv.index.chunks_by_tenant.items():
            if n:
                of(uid)["kv_chunks"] = n
        for uid, n in self.listener.buffered.held.items():
            of(uid)["bytes_buffered"] = n
        for uid, n in self.listener.fds.by_tenant.items():
            of(uid)["fds_held"] = n
        for s in self.listener.sessions.values():
            if s.sent_fds:
                of(s.tenant)["fds_in_flight"] += s.sent_fds
        top = sorted(held.items(), key=lambda kv: (-kv[1]["connections"],
                                                   -kv[1]["kv_chunks"]))[:most]
        return {str(uid): counts for uid, counts in top}


def serve_quota(quotas: Quotas, msg: Msg, uid: int) -> QuotaReport:
    """The `quota` request: show (a user sees her own line, her subordinate uids'
    with hers: `vol/quota.py`; root every user's, or the one it names with "uid") or,
    for root, set.  Setting takes "uid" or "default", and "bytes" and "inodes" (0 lifts
    a limit, an absent one is kept) or "clear"; not a subordinate uid's (hers hold)."""
    if not bool_field(msg, "set"):
        if uid != 0:
            return {**quotas.report(uid)}
        return {**quotas.report(int_field(msg, "uid") if "uid" in msg else None)}
    if uid != 0:
        raise OSError(errno.EPERM, "only root sets quotas")
    if bool_field(msg, "default"):
        who = DEFAULT
    else:
        who = str(int_field(msg, "uid"))
        if who == "0":
            raise OSError(errno.EINVAL, "root has no quota (it is never refused)")
    old = quotas.limits.get(who, NONE)
    quota = NONE if bool_field(msg, "clear") else Quota(
        int_field(msg, "bytes", old.bytes), int_field(msg, "inodes", old.inodes))
    if quota and who != DEFAULT and (tenant := tenant_of(int(who))) != int(who):
        # (its user's holds for it: one of its own would never be looked at)
        raise OSError(errno.EINVAL, f"uid {who} is a subordinate uid of uid {tenant} "
                      "(/etc/subuid): her quota counts it; set hers")
    quotas.set(who, quota)
    return {**quotas.report(None if who == DEFAULT else int(who))}

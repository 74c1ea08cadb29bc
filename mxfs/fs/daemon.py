"""The mount daemon: one per mounted pool, the pool's single metadata authority.

It opens and recovers the volume, mounts it through pyfuse3, serves the
control socket beside it, and on unmount (or SIGTERM/SIGINT) writes
everything back and marks the metadata clean.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import stat
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from mxfs.errors import MxfsError
from mxfs.fs import held_open, loop_watch
from mxfs.fs.chunk_service import ChunkService
from mxfs.fs.control import ControlServer
from mxfs.fs.failures import FailureLog
from mxfs.fs.feed_follower import FeedFollower
from mxfs.fs.fuse_conn import raise_background
from mxfs.fs.gc_keeper import FREEZE_S, GC_KEEPER
from mxfs.fs.held_open import HeldOpen
from mxfs.fs.limits import Limits, raise_fd_limit
from mxfs.fs.metrics import Gauges, Metrics, serve_prometheus
from mxfs.fs.mount_writes import MountWrites
from mxfs.fs.node_files import HOLDS_AT_ONCE
from mxfs.fs.ops import MxfsOperations
from mxfs.fs.options import FLAGS, NUMBERS, TEXTS, check_options
from mxfs.fs.owned import OwnedSums
from mxfs.fs.ports import check_ports, listen_error
from mxfs.fs.startup import Startup
from mxfs.fs.store_worker import SERVE_WAIT_S, StoreWorker
from mxfs.fs.wake import WakeLatency
from mxfs.fs.write_behind import DEPTH
from mxfs.io.batch import ENGINE
from mxfs.io.chunk_client import CONNECT_S, UNACKED_S
from mxfs.meta import MetaStore, Unusable, backup, change_feed, lease, location
from mxfs.pool.key import key_id, load_key, read_key
from mxfs.pool.revoke import require_leases
from mxfs.pool.superblock import LABEL, superblock_path
from mxfs.proto.messages import MemberUsage
from mxfs.vol.mounts import (
    LOG_CAP,
    check_apart,
    check_mountpoint,
    ensure_runtime_dir,
    rotate_log,
    runtime_dir,
    set_readahead,
)
from mxfs.vol.tenants import TENANTS
from mxfs.vol.volume import STATS_EVERY_S, Volume

log = logging.getLogger("mxfs.daemon")

# Options mxfs reads itself (fs/options.py); everything else goes to FUSE and the kernel.
OWN_OPTIONS = (*NUMBERS, *FLAGS, *TEXTS)
DEFAULT_READAHEAD_KIB = 4096
META_BACKUP_S = 600  # metadata copied to the next member this often (meta_backup=0: never)
GROUP_COMMIT_S = 0.05
CHECKPOINT_S = 0.25  # the embedded store's WAL copied into its database this often
STRAY_S = 3600  # a node removes chunk files without an inode once this old (stray_s=S)
STRAY_SWEEP_S = 3600  # ... looking for them at mount and this often (stray_s if less)
RECLAIM_BITE = 512  # orphans freed a round (every GROUP_COMMIT_S / 2): 20,000 a second

# Called once: with the error that stopped the mount, or None and warnings for the user.
Ready = Callable[[MxfsError | None, list[str]], None]


def split_options(options: list[str]) -> tuple[dict[str, str], set[str]]:
    own: dict[str, str] = {}
    fuse: set[str] = set()
    for opt in options:
        key, _, value = opt.partition("=")
        if key in OWN_OPTIONS:
            own[key] = value
            if key == "noatime":
                fuse.add(opt)
        elif opt:
            fuse.add(opt)
    return own, fuse


def notify_systemd(state: str) -> None:
    """Tell systemd (Type=notify units) how we are doing; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError as e:
            log.warning("could not notify systemd: %s", e)


def socket_path(pool_uuid: str, node: str = "") -> str:
    """The control socket of the pool's daemon (a reading node's has its name: nodes
    of one pool may share a host, as in the tests)."""
    return os.path.join(runtime_dir(), f"{pool_uuid}-{node}.sock" if node
                        else f"{pool_uuid}.sock")


def run(spec: str, mountpoint: str, options: list[str], ready: Ready,
        waiting: Callable[[], None] | None = None) -> None:
    """Mount and serve until unmounted; calls `ready` once, with None or the error, and
    `waiting` now and then before that while mount-time work goes on (`fs/startup.py`)."""
    own, fuse_opts = split_options(options)
    startup = Startup(notify_systemd, waiting)
    try:
        check_options(options)
        check_ports(own)  # (a port any user may bind, she could hold while it restarts)
        io_threads = int(own.get("io_threads") or 16)
        readahead = int(own.get("readahead") or DEFAULT_READAHEAD_KIB)
        write_behind = int(own.get("write_behind", DEPTH))
        backup_s = int(own.get("meta_backup") or META_BACKUP_S)
        stray_s = int(own.get("stray_s") or STRAY_S)
        GC_KEEPER.freeze_s = int(own.get("gc_freeze_s") or FREEZE_S)
        holds = (int(own.get("holds_full_s") or held_open.FULL_S),  # (a reading node's:
                 int(own.get("holds_at_once") or HOLDS_AT_ONCE))  # fs/held_open.py)
        reach = (int(own.get("connect_s") or CONNECT_S),  # (other nodes' chunk services:
                 int(own.get("unacked_s") or UNACKED_S))  # pool/remote.py)
        metrics_port = int(own.get("metrics_port") or 0)
        # Loopback unless the operator names an address: /metrics has no authentication.
        metrics_addr = own.get("metrics_addr") or "127.0.0.1"
        # (counts the requests of `metrics`, made below; refuses what the kernel would)
        wake = WakeLatency(int(own["wake_latency_us"]), lambda: metrics.total) \
            if own.get("wake_latency_us") else None
        limits = Limits.from_options(own)
        mp = check_mountpoint(mountpoint, nonempty="nonempty" in own)
        startup.step()  # (a store its daemon did not close clean is checked page by page)
        vol = Volume.open(spec, recover_meta=True, degraded="degraded" in own)
        try:
            check_apart(mp, [vol.pool.members[m].path for m in vol.pool.local_members()])
        except MxfsError:
            vol.close(clean=False)
            raise
        vol.progress = startup.step  # (orphans queued, the KV index loaded: by the bite)
        reading = bool(vol.pool.node)  # a reading node (mxfs node add): it writes nothing
        try:  # (the descriptors it hands out are judged by leases: pool/revoke.py)
            require_leases(superblock_path(vol.pool.members[m].path)
                           for m in vol.pool.local_members())
        except MxfsError:
            vol.close(clean=False)
            raise
        if reading and "chunk_port" in own and not vol.pool.local_members():
            vol.close(clean=False)
            raise MxfsError(f"node {vol.pool.node} holds no members: it has no chunks to "
                            "serve", "leave chunk_port out on a reading node")
        if reading and vol.pool.local_members() and "chunk_port" not in own:
            vol.close(clean=False)
            raise MxfsError(f"node {vol.pool.node} holds members of the pool, which the "
                            "other nodes read and the writer writes through it",
                            "mount it with -o chunk_port=N,chunk_addr=IP")
        sock = socket_path(vol.pool.uuid, vol.pool.node)
        ensure_runtime_dir(os.path.dirname(sock))
        vol.lock(mp, sock, float(own.get("lease_s") or lease.TTL_S), own.get("node", ""),
                 lease.STARTING if "chunk_port" in own else "")  # (announced once bound)
        if vol.keeper is not None and own.get("renew_s"):  # (renewed at least this often)
            vol.keeper.every = min(vol.keeper.every, int(own["renew_s"]))
        for remote in vol.pool.remotes.values():  # (each made by now: the writer's at lock)
            remote.connect_s, remote.unacked_s = reach
        if reading:
            vol.store.follow = True  # (the writer node changes the rows: read them afresh)
        else:
            vol.store.sole_writer(True)  # (the lease: no other writer changes the rows)
    except ValueError:
        err = MxfsError("io_threads, readahead (KiB), write_behind (writes queued per file), "
                        "meta_backup (s), metrics_port, wake_latency_us and the "
                        f"limits ({', '.join(Limits.options())}) take whole numbers",
                        "write them like io_threads=16,max_conns=4096")
        ready(err, [])
        raise err from None
    except MxfsError as e:
        ready(e, [])
        raise
    clean = False
    os.umask(0o077)  # what the daemon makes (chunk files, copies) is its own
    raise_fd_limit()
    try:
        vol.recover(drain=False)  # (orphans freed by `_reclaims` while serving)
        if vol.quotas.limits:
            startup.step()
            vol.store.count_usage()  # (before serving, not on a tenant's first write)
        if vol.pool.node:  # its requests' lookups are round trips on trio's thread
            vol.store.engine.bound_waits(SERVE_WAIT_S)
        metrics = Metrics()
        vol.pool.on_io = metrics.io
        ops = MxfsOperations(vol, control_path=sock, noatime="noatime" in own,
                             io_threads=io_threads, write_behind=write_behind,
                             writeback_cache=own.get("writeback_cache", "0") in ("1", "yes"),
                             metrics=metrics)
        ops.max_open_per_user = limits.max_open_per_user
        vol.max_held_per_user = limits.max_held_per_user
        vol.held.read_grace_s = limits.read_grace_s
        vol.overdrafts.penalty_s = limits.overdraft_penalty_s
        notes = []
        name = vol.pool.label if LABEL.fullmatch(vol.pool.label) else vol.pool.uuid[:8]
        if vol.pool.label and name != vol.pool.label:  # (made before labels were checked)
            notes.append(f"the pool's label {vol.pool.label!r} holds characters a mount "
                         f"option cannot: the mount is named mxfs:{name}")
        fuse_opts |= {"default_permissions", f"fsname=mxfs:{name}", "subtype=mxfs"}
        # Said, not left to the default: a set-uid file or device node on the pool stays
        # inert unless the mount asks otherwise (never with allow_other: check_options).
        fuse_opts |= {f"no{flag}" for flag in ("suid", "dev") if flag not in fuse_opts}
        feed = None
        if reading and location.is_server(vol.pool.meta_location):
            # (connected before the mount: the kernel holds nothing the feed missed)
            try:
                feed = FeedFollower(vol.pool.meta_location, vol.pool.uuid, vol.pool.node,
                                    ops.kernel, ops.kernel_held, ops.data_changed)
            except (OSError, Unusable) as e:
                raise MxfsError(f"the pool's change feed cannot be followed ({e})",
                                "check the metadata server (mxfs status on the writer "
                                "node) and mount again") from None
        if reading:  # (not "ro": mkdir, unlink, rmdir and rename are the writer's, as
            # the caller, fs/node_files.py; every other change its store refuses, EROFS)
            owner = vol.pool.remote.owner if vol.pool.remote else None
            log.info("node %s reads the pool and changes names through the writer, node "
                     "%s; its members' files are read through their owners' chunk "
                     "services", vol.pool.node, owner.node if owner else "?")
        if vol.pool.failed:
            fuse_opts.add("ro")  # serve what survives; write nothing to a broken stripe set
            notes.append("mounted read-only and degraded: " + "; ".join(
                f"member {m.index} ({m.path}) {m.failed}" for m in vol.pool.failed)
                + "; files with stripes on it read EIO (mxfs status lists them)")
        try:
            pyfuse3.init(ops, mp, fuse_opts)
        except RuntimeError as e:
            raise MxfsError(f"FUSE refused the mount ({e}); options were {sorted(fuse_opts)}",
                            "check the -o options and that /dev/fuse is usable") from None
        # Who each uid answers to, before the KV index counts its namespaces by it and
        # before the first connection (read again off the loop as it changes).
        TENANTS.refresh()
        try:
            control = ControlServer(vol, sock, mp, writeback_cache=ops.enable_writeback_cache,
                                    entry_changed=ops.entry_changed, metrics=metrics,
                                    limits=limits, only_uid=None if "allow_other" in fuse_opts
                                    else os.getuid(), settle=ops.settle, wake=wake,
                                    reads=ops.reads, syncs=ops.syncs)
            gauges = Gauges(functools.partial(gather_gauges, control,
                                              "metrics_by_user" in own)) if metrics_port \
                else None
            if gauges is not None:
                try:
                    serve_prometheus(metrics, metrics_addr, metrics_port, gauges)
                except OSError as e:
                    raise listen_error("the metrics endpoint", "metrics_port",
                                       "metrics_addr", metrics_addr, metrics_port, e) from None
            if vol.restored_from:
                notes.append(f"the metadata store was recovered from the backup "
                             f"{vol.restored_from}; changes made after that backup are lost")
            chunks = None
            if "chunk_port" in own:
                key = read_key(vol.pool.key_file) if reading else \
                    load_key(vol.pool.members[0].path, create=True)
                chunks = ChunkService(vol, key, own.get("chunk_addr") or "127.0.0.1",
                                      int(own["chunk_port"]),
                                      lambda: vol.lease.epoch if vol.lease else 0,
                                      control.limits, control.fds)
                if reading:  # its own members: the writer writes them, every node reads
                    if control.files.forwarded is not None:
                        chunks.writing = control.files.forwarded.writing.__contains__
                    chunks.writer_epoch = lambda: _writer_epoch(vol)
                    chunks.holding = ops.holding
                    chunks.cut_elsewhere = ops.cut_elsewhere
                    chunks.writing_here = ops.writing_here
                    chunks.serving = lambda: vol.keeper is not None and \
                        vol.keeper.state == "held"
                if control.kv.follower is None:  # the writer: other nodes' users put here
                    chunks.kv, chunks.turns = control.kv, control.turns
                    chunks.files = control.files.for_nodes
                    chunks.only_uid = control.only_uid
                chunks.bind()
                control.status.chunks = chunks
                vol.announce(f"{chunks.host}:{chunks.port}", key_id(key, vol.pool.uuid))
            ops.fds = control.fds  # (one account of descriptors held for tenants)
            ops.names = control.files.forwarded  # (a reading node's names: the writer's)
            if ops.names is not None and vol.pool.local_members():
                ops.written = MountWrites(vol, ops.names, ops.row, ops.cut)  # (its bytes)
            if ops.names is not None and feed is not None:  # (what its mount has open,
                ops.held_open = HeldOpen(ops.names, lambda: feed.applied, *holds)  # there)
                if ops.written is not None:
                    ops.written.granted = ops.held_open.granted
            control.status.space = ops.space
            control.files.calls = control.kv.calls = ops.space.calls
            if control.status.chunks is not None:
                control.status.chunks.calls = ops.space.calls
                control.status.chunks.reads = ops.reads  # (a reading node's rows)
            control.files.renewing = ops.renewing
            ops.owned = OwnedSums(vol.quotas, control.kv.rows)  # (one connection for both)
            if control.files.for_nodes is not None:
                control.files.for_nodes.inode_changed = ops.inode_changed
                control.files.for_nodes.renew = ops.renew
                control.files.for_nodes.cut_far = ops.cut_far
                control.files.for_nodes.truncating = ops.truncating
                control.files.for_nodes.xattr_pace = ops.xattr_pace
                control.files.for_nodes.owned = ops.owned
            control.status.feed = feed
            if feed is not None and control.kv.follower is not None:
                views = control.kv.follower.views  # (kept by the feed: fs/kv_views.py)
                feed.on_kv = views.from_feed
                views.live = lambda: feed.kernel.feed_live
            daemon = Daemon(vol, ops, control, readahead, backup_s, chunks, feed, gauges,
                            stray_s, limits.fuse_tasks)
            try:
                watch = loop_watch.from_env()
                trio.run(daemon.serve, lambda: ready(None, notes),
                         instruments=[watch] if watch is not None else [])
            except Exception:  # (a bug: its whole story in the log, not one line)
                log.exception("the daemon stopped on an error")
                raise
            clean = True
        finally:
            pyfuse3.close(unmount=True)
    except MxfsError as e:
        ready(e, [])
        raise
    finally:
        vol.close(clean=clean)
        log.info("pool %s unmounted from %s (clean=%s)", vol.pool.uuid, mp, clean)


def _feed_mark(store: MetaStore) -> int:
    return store.engine.feed_mark()


def _writer_epoch(vol: Volume) -> int | None:
    """The epoch of the writer's lease as this node last read it; None while dead."""
    owner = vol.pool.remote.owner if vol.pool.remote else None
    return owner.epoch if owner is not None and owner.alive else None


@dataclass
class Daemon:
    """One mounted pool's parts, started and stopped together: the volume, the FUSE
    operations, the control socket and its services, and the background tasks that
    keep them (`tasks`).  A new service is a module and a line in `tasks`."""

    vol: Volume
    ops: MxfsOperations
    control: ControlServer
    readahead_kib: int
    backup_s: int
    chunks: ChunkService | None = None  # -o chunk_port: this node's ranges, to the others
    feed: FeedFollower | None = None  # a reading node's: the writer's changes, as they commit
    gauges: Gauges | None = None  # /metrics' pool gauges, gathered on this loop
    stray_s: int = STRAY_S  # a node's chunk files without an inode: removed this old
    fuse_tasks: int = Limits.fuse_tasks  # FUSE requests read at once (fs/fuse_conn.py)
    _trim: trio.Event = field(default_factory=trio.Event)  # the metadata member is short

    def tasks(self) -> list[Callable[[], Awaitable[None]]]:
        """The background tasks, each run until the mount ends."""
        tasks: list[Callable[[], Awaitable[None]]] = [
            _stop_on_signal, self._commit_groups, self._reclaims, self._trims, self._keep_lease,
            self._revoke, self._sweep_held, self.control.kv.let_go, GC_KEEPER.run]
        if log_file() is not None:  # (not journald's, nor a terminal)
            tasks.append(self._cap_log)
        if self.backup_s > 0 and backup.supported(self.vol.store):  # a server's are its
            tasks.append(self._backups)  # operator's to back up
        if self.control.wake is not None:
            tasks.append(self.control.wake.run)
        if self.feed is not None:
            tasks.append(self.feed.run)
        if self.ops.held_open is not None:
            tasks.append(self.ops.held_open.run)
        if self.ops.written is not None:  # (closes through this node's mount, told)
            tasks.append(self.ops.written.run)
        if self.control.files.forwarded is not None:  # (a node's aborts for the writer)
            tasks.append(self.control.files.forwarded.run_aborts)
        if self.vol.pool.node and self.vol.pool.local_members():  # a node's own members
            tasks.append(self._sweep_strays)
        if self.vol.store.feed is not None:  # a writer whose pool other nodes may mount
            tasks += [self._prune_feed, self._publish_stats]
        if not self.vol.store.readonly and \
                (checkpoint := self.vol.store.engine.checkpoint_apart()) is not None:
            tasks.append(functools.partial(self._checkpoints, checkpoint))
        return tasks

    async def serve(self, ready: Callable[[], None]) -> None:
        """Serve until unmounted or signalled; `ready` once the mount answers."""
        if self.gauges is not None:  # (gathered on this loop's thread, not the scraper's)
            self.gauges.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.ops.nursery = nursery  # writes through the mount land behind their answers
            await nursery.start(self.control.serve)
            if self.chunks is not None:
                await nursery.start(self.chunks.serve)
            for task in self.tasks():
                nursery.start_soon(task)
            await self._open_rows()
            GC_KEEPER.start()  # (what loading made, left out of every full collection)
            nursery.start_soon(self._announce, ready)
            try:
                await pyfuse3.main(min_tasks=4, max_tasks=self.fuse_tasks)
            finally:
                self.control.remote.close_all()  # readers' connections end with the mount
                self.ops.unmounting.set()  # (no invalidation after FUSE's session ends)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.ops.invalidations.close, 1.0)
            nursery.cancel_scope.cancel()

    async def _announce(self, ready: Callable[[], None]) -> None:
        """Once the mount answers (FUSE INIT done): raise its readahead (INIT resets it),
        then tell whoever started us, and systemd, that the pool is ready."""
        mp, kib = self.control.mountpoint, self.readahead_kib
        # Answered only after INIT; abandoned if the daemon stops first (a task that
        # failed at start): waiting for it would wait for the INIT that never comes.
        await trio.to_thread.run_sync(os.stat, mp, abandon_on_cancel=True)
        if not set_readahead(mp, kib):
            log.info("could not raise readahead of %s to %d KiB (needs root)", mp, kib)
        await trio.to_thread.run_sync(raise_background, mp, self.fuse_tasks)
        log.info("pool %s mounted on %s, control socket %s, I/O engine %s",
                 self.vol.pool.uuid, mp, self.control.path, ENGINE)
        ready()
        notify_systemd("READY=1")

    async def _open_rows(self) -> None:
        """A writer opens the connection its requests' reads share off the thread
        (`KVOps.rows`: KV rows, chown sums) before it answers: its descriptors are
        the daemon's from the start, not the first asker's."""
        if self.control.kv.follower is None and not self.vol.store.readonly:
            with contextlib.suppress(OSError):  # (a server away: opened when asked)
                await self.control.kv.rows.run(lambda store: None)

    async def _commit_groups(self) -> None:
        """End each group of metadata changes within GROUP_COMMIT_S of its first change
        (KV access times included).  A failure (a full or read-only metadata member) is
        logged and tried again on the next round: the daemon never ends of it."""
        vol, control = self.vol, self.control
        vol.store.group_changes(GROUP_COMMIT_S)
        failures = FailureLog(log)
        rounds = 0
        while True:
            await trio.sleep(GROUP_COMMIT_S / 2)
            rounds += 1
            try:
                # ten times a second: the metadata member's space reserve
                if rounds % 4 == 0 and vol.store.watch_space():
                    self._trim.set()  # (its own task: a hung member holds no commit)
                await control.kv.flush()
                vol.store.commit_if_due()
            except Exception as e:  # OSError from the store, or anything unforeseen
                failures.note("commit", None, e, trace=not isinstance(e, OSError))

    async def _reclaims(self) -> None:
        """Free the data of files whose last link and last open went, RECLAIM_BITE a
        round, in a task of its own: a round's chunk files (a user's mass removal of
        files striped wide; a member that stops answering, for good) held the loop
        that ends each group of changes, and every user's commits waited."""
        vol = self.vol
        failures = FailureLog(log)
        # (the change feed's last row, read off the loop: how far reading nodes' word
        # on the files they hold must go before an orphan is freed)
        marks = StoreWorker(vol.pool.meta_location, readonly=True)
        while True:
            await trio.sleep(GROUP_COMMIT_S / 2)
            try:
                inos = vol.take_pending(RECLAIM_BITE)
                if vol.reader_epochs or vol.holds.waiting:  # (nodes may hold them open)
                    try:
                        mark = await marks.run(_feed_mark) if inos and vol.reader_epochs \
                            else None
                    except BaseException:
                        vol.pending_reclaim.put_back(inos)  # (freed after the next round)
                        raise
                    inos = vol.past_nodes(inos, mark)
                if inos:
                    await trio.to_thread.run_sync(vol.remove_chunks, inos)
                    vol.drop_inodes(inos)
            except Exception as e:  # OSError from the store, or anything unforeseen
                failures.note("reclaim", None, e, trace=not isinstance(e, OSError))

    async def _trims(self) -> None:
        """Cut unpublished files back to their declared sizes whenever the metadata
        member runs short (`_commit_groups` asks), at once, in a worker thread."""
        failures = FailureLog(log)
        while True:
            await self._trim.wait()
            self._trim = trio.Event()
            try:
                await self.control.files.trim_overdrafts()
            except Exception as e:  # (a member failing: the next ask tries again)
                failures.note("trim", None, e, trace=not isinstance(e, OSError))

    async def _revoke(self) -> None:
        """Once a second: what direct writers hold past their word is taken back,
        readers' connections to other nodes past their time are shut, KV claims of
        other nodes' connections that ran out are dropped; the subordinate uids read
        again if their file changed (`vol/tenants.py`)."""
        failures = FailureLog(log)
        while True:
            await trio.sleep(1)
            try:
                await trio.to_thread.run_sync(TENANTS.refresh)
                self.control.remote.sweep()
                await self.control.kv.sweep()
                await self.control.files.revoke()
            except Exception as e:
                failures.note("revoke", None, e, trace=not isinstance(e, OSError))

    async def _sweep_held(self) -> None:
        """Once a second: chunk files held for writers or readers of dropped and removed
        files cut or removed (`FileOps.sweep_held`), a task apart from `_revoke`: a user
        keeping thousands of dropped files' descriptors held back every cut-back."""
        failures = FailureLog(log)
        while True:
            await trio.sleep(1)
            try:
                await self.control.files.sweep_held()
            except Exception as e:
                failures.note("held files", None, e, trace=not isinstance(e, OSError))

    async def _keep_lease(self) -> None:
        """Start the lease's keeper (its own thread renews: meta/lease.py) and watch it:
        once another node took the pool, this daemon refuses every change (EROFS; its
        keeper fenced the store) and stops trusting its caches of names."""
        vol, keeper = self.vol, self.vol.keeper
        if keeper is None:
            return
        keeper.start()
        while keeper.state != "taken":
            await trio.sleep(keeper.ttl / lease.RENEWALS / 4)
        log.error("%s", vol.store.engine.fenced)
        vol.store.sole_writer(False)  # (the new holder changes them)
        vol.lease = None  # (not ours to give back at unmount)

    async def _prune_feed(self) -> None:
        """A writer: the change feed's rows past its retention or its bounds go, once a
        minute or as soon as a flood of rows is published (`change_feed.PruneDue`,
        asked each second), on a connection of their own in a worker thread (never on
        trio's)."""
        failures = FailureLog(log)
        pruner = StoreWorker(self.vol.pool.meta_location, readonly=False)
        feed = self.vol.store.feed
        assert feed is not None
        due = change_feed.PruneDue(feed, trio.current_time())
        while True:
            await trio.sleep(1)
            if self.vol.store.readonly or not due(trio.current_time()):
                continue  # (readonly: fenced, the pool is another node's now)
            try:
                await pruner.run(change_feed.prune)
            except Exception as e:
                failures.note("prune", None, e, trace=not isinstance(e, OSError))

    async def _publish_stats(self) -> None:
        """A writer: its members' space and the inode count, for the reading nodes."""
        failures = FailureLog(log)
        while True:
            try:
                if not self.vol.store.readonly:  # (the space asked off the loop, guarded)
                    self.vol.publish_stats(await self.control.status.space.usage(0))
            except Exception as e:
                failures.note("stats", None, e, trace=not isinstance(e, OSError))
            await trio.sleep(STATS_EVERY_S)

    async def _checkpoints(self, checkpoint: Callable[[], None]) -> None:
        """Every CHECKPOINT_S, the embedded store's checkpoint in a worker thread (in a
        commit it copied the WAL into the database and fsynced it on this thread)."""
        failures = FailureLog(log)
        while True:
            await trio.sleep(CHECKPOINT_S)
            try:
                await trio.to_thread.run_sync(checkpoint)
            except Exception as e:  # (busy, a full member: the next one tries again)
                failures.note("checkpoint", None, e, trace=not isinstance(e, OSError))

    async def _sweep_strays(self) -> None:
        """At mount and every `stray_s` (an hour at most): chunk files on this node's members whose
        file the writer removed while it could not reach this node (`Volume.sweep_strays`,
        in a worker thread)."""
        failures = FailureLog(log)
        while True:
            try:
                await trio.to_thread.run_sync(self.vol.sweep_strays, self.stray_s)
            except Exception as e:  # the store away a while, say: the next round tries
                failures.note("stray sweep", None, e, trace=not isinstance(e, OSError))
            await trio.sleep(min(STRAY_SWEEP_S, self.stray_s))

    async def _cap_log(self) -> None:
        """Once a second, in a worker thread: the daemon's log (its stderr, a regular
        file: `mxfs mount`'s /run/mxfs/UUID.log, on tmpfs, RAM) past LOG_CAP is copied to
        LOG.1 and cut to nothing (`vol/mounts.py` `rotate_log`)."""
        path = log_file()
        if path is None:
            return
        failures = FailureLog(log)
        while True:
            await trio.sleep(1)
            try:
                if await trio.to_thread.run_sync(rotate_log, 2, path, LOG_CAP,
                                                 _logging_held):
                    log.info("the log passed %d MiB: its earlier lines are in %s.1",
                             LOG_CAP >> 20, path)
            except Exception as e:  # (a full tmpfs, say: the next round tries again)
                failures.note("log rotation", None, e, trace=not isinstance(e, OSError))

    async def _backups(self) -> None:
        """Copy the metadata store to the next member every `backup_s` seconds."""
        while True:
            await trio.sleep(self.backup_s)
            try:
                await self.control.meta.backup_meta()
            except Exception as e:  # a full member, say: the pool goes on, the next tries
                log.error("metadata backup failed (the next is tried in %d s): %s",
                          self.backup_s, e)


def log_file() -> str | None:
    """Where the daemon logs when its stderr is a regular file (`mxfs mount` makes it
    append to /run/mxfs/UUID.log), else None (journald, a terminal, a pipe)."""
    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return None
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if path.startswith("/") and not path.endswith(" (deleted)") else None


@contextlib.contextmanager
def _logging_held() -> Iterator[None]:
    """No line is logged (by any thread) while held: the root logger's handlers'
    locks, taken."""
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.acquire()
    try:
        for h in handlers:
            h.flush()
        yield
    finally:
        for h in reversed(handlers):
            h.release()


async def gather_gauges(control: ControlServer, by_user: bool = False) -> list[Any]:
    """(On the loop.)  The pool gauges: the members' space asked off the loop, each
    through the member guard (a scrape during a member's hang held every user), and
    what a reading node reads of the metadata server (the nodes, what the writer
    published) in the store worker, as status does: anyone may scrape, and on the
    loop a slow server held every user for each scrape."""
    status = control.status
    members = await status.space.usage(0)
    await status.read_published(0)
    nodes = await status.reads.run(status.nodes, 0) if status.reads is not None \
        else status.nodes()
    return list(pool_gauges(control, members, nodes, by_user))


def pool_gauges(control: ControlServer, usage: Sequence[MemberUsage],
                nodes: Sequence[Mapping[str, Any]], by_user: bool = False) -> Iterator[Any]:
    """Prometheus gauges read at scrape time: members (`usage`), inodes, nodes, KV
    namespaces (their stats read once; by owner only with `by_user`)."""
    from prometheus_client.core import GaugeMetricFamily

    members: list[Mapping[str, Any]] = list(usage)  # read by name
    for name, what in (("size", "Member capacity"), ("free", "Member free space"),
                       ("used", "Member space used")):
        g = GaugeMetricFamily(f"mxfs_member_{name}_bytes", what, labels=["member"])
        for m in members:
            g.add_metric([str(m["index"])], int(m[name]))
        yield g
    failed = GaugeMetricFamily("mxfs_member_failed", "1 if the member is out of service",
                               labels=["member"])
    for m in members:
        failed.add_metric([str(m["index"])], 1 if m.get("failed") else 0)
    yield failed
    yield GaugeMetricFamily("mxfs_inodes", "Inodes in the pool",
                            value=control.vol.count_inodes())
    alive = GaugeMetricFamily("mxfs_node_alive", "1 while the node's lease is live (a pool "
                              "on a metadata server)", labels=["node", "role"])
    for node in nodes:
        alive.add_metric([node["name"], node["role"]], 1 if node["state"] == "alive" else 0)
    yield alive
    spaces: list[Mapping[str, Any]] = list(control.kv.index.stats())
    for key, what in (("chunks", "KV chunks"), ("bytes", "KV bytes"), ("hits", "KV hits"),
                      ("misses", "KV misses"), ("puts", "KV puts"),
                      ("evictions", "KV evictions")):
        yield kv_gauge(key, what, spaces, by_user)


def kv_gauge(key: str, what: str, spaces: Sequence[Mapping[str, Any]], by_user: bool
             ) -> Any:
    """One KV statistic as the pool's total, or (`by_user`, -o metrics_by_user) by the
    namespaces' owner.  Anyone on the host may read /metrics: by owner, it told every
    user how much KV each other user holds and how often it hits, a view of their
    workloads; so that is root's choice.  Never by name: names are their owners'
    (kv_stats hides others' from a caller)."""
    from prometheus_client.core import GaugeMetricFamily

    if not by_user:
        return GaugeMetricFamily(f"mxfs_kv_{key}", what + " in the pool",
                                 value=float(sum(int(s[key]) for s in spaces)))
    by_uid: Counter[int] = Counter()
    for s in spaces:
        by_uid[int(s["uid"])] += int(s[key])
    g = GaugeMetricFamily(f"mxfs_kv_{key}", what + " by the namespaces' owner",
                          labels=["uid"])
    for uid, n in sorted(by_uid.items()):
        g.add_metric([str(uid)], float(n))
    return g


async def _stop_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            log.info("signal received: unmounting")
            notify_systemd("STOPPING=1")
            pyfuse3.terminate()
            return

"""The FUSE request handlers (pyfuse3, on trio).

Metadata work runs on the trio thread against the volume's store (one writer,
no locks), which answers from memory; on a reading node, whose store reads every
inode afresh from the metadata server, the reads of lookups, getattrs, opens,
readdirs, readlinks, xattrs and statfs run in the store's worker thread instead, users
taking turns (`fs/store_worker.py`), so a round trip (or a server that stopped
answering) holds up no one else's request on the loop.  Chunk I/O runs in worker
threads so a large read or write is served by every member it spans while other
requests go on.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from mxfs.fs.block_counts import KEEP_S, BlockCounts
from mxfs.fs.descriptors import Descriptors
from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import BITE, Lanes, Slice, Turns, in_bites
from mxfs.fs.fields import b64
from mxfs.fs.held_open import HeldOpen
from mxfs.fs.invalidations import Invalidations
from mxfs.fs.kernel_cache import KernelCache
from mxfs.fs.limits import Limits
from mxfs.fs.member_calls import MemberSpace
from mxfs.fs.meta_ops import SharedSync
from mxfs.fs.metrics import Metrics
from mxfs.fs.mount_writes import MountWrites, Written
from mxfs.fs.node_files import ForwardedFiles
from mxfs.fs.owned import OwnedSums
from mxfs.fs.store_worker import SERVE_WAIT_S, StoreWorker
from mxfs.fs.write_behind import BUDGET, DEPTH, WriteBehind
from mxfs.fs.xattr_pace import XattrPace
from mxfs.meta import NAME_MAX, ROOT_INO, Entry, Inode, MetaStore
from mxfs.meta.store import LOAD_BITE
from mxfs.meta.usage import growth
from mxfs.pool import ChunkFiles
from mxfs.pool.pool import META_ROW, pool_totals
from mxfs.vol.access import Caller, owner_for, supplementary_groups
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import OpenInode, Volume
from mxfs.vol.xattrs import (
    CONTROL_XATTR,
    LAYOUT_XATTR,
    check_sizes,
    format_layout,
    remove_xattr,
    set_xattr,
)

log = logging.getLogger("mxfs.fs")
T = TypeVar("T")

DAY_NS = 86_400 * 10**9
# Files a reading node remembers having opened, as they were (their pages kept if so).
SEEN_KEPT = 100_000
RENEWS_PER_USER = 2  # a tenant's renews (whole files copied) at once
# Entries a readdir reads from the store at first, and at most, at once; and the bytes
# of symlink targets a page reads (`MetaStore.readdir_page` cuts it a bite past them:
# 512 of 4 KiB targets held the thread 3-4.6 ms; `next_page` sizes the next from them).
FIRST_PAGE, PAGE, PAGE_TARGETS = 64, 512, 256 << 10


def next_page(limit: int, entries: list[Entry]) -> int:
    """How many entries the next page of a readdir reads: twice this one's while the
    reply takes them all (PAGE at most), and no more than would hold PAGE_TARGETS of
    symlink targets at this page's rate (one at the least)."""
    targets = sum(e.inode.size for e in entries if e.inode.target is not None)
    fit = limit * PAGE_TARGETS // targets if targets else PAGE
    return max(1, min(limit * 2, PAGE, fit))


def _caller(ctx: pyfuse3.RequestContext) -> Caller:
    """A FUSE request's caller, its groups those of its process now."""
    return Caller(ctx.pid, ctx.uid, ctx.gid,
                  frozenset({ctx.gid, *supplementary_groups(ctx.pid)}))


def _errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn OSError from the store or members into the errno FUSE returns; count the
    request, its latency and its errno in the daemon's metrics.  Anything else is a
    bug answered with EIO and logged through the mount's FailureLog: once with its
    traceback, then counted (a tenant repeating the request that meets it, thousands a
    second, wrote a traceback each into the daemon's log, which lives in RAM)."""
    name = fn.__name__

    async def wrapper(self: MxfsOperations, *args: Any, **kwargs: Any) -> Any:
        with self.metrics.timed("fuse", name):
            return await _handle(self, *args, **kwargs)

    async def _handle(self: MxfsOperations, *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            if e.errno is None:
                self.failures.note(name, _ctx_in(args, kwargs), e)
                raise pyfuse3.FUSEError(errno.EIO) from None
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception as e:
            self.failures.note(name, _ctx_in(args, kwargs), e)
            raise pyfuse3.FUSEError(errno.EIO) from None
    wrapper.__name__ = fn.__name__
    return wrapper


def _ctx_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> pyfuse3.RequestContext | None:
    """The request's context among a handler's arguments (its caller), if it has one."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, pyfuse3.RequestContext):
            return a
    return None


class Handle:
    """One open file description."""

    __slots__ = ("caller", "entry", "failures", "flags", "losses", "uid")

    def __init__(self, entry: OpenInode, flags: int, losses: int, uid: int = 0,
                 failures: int = 0) -> None:
        self.entry = entry
        self.flags = flags
        self.losses = losses  # the store's lost groups when this handle last synced
        self.failures = failures  # the file's failed writes it reported, or saw at open
        self.uid = uid  # who opened it (a readdir's turn on a reading node is theirs)
        self.caller: Caller | None = None  # (writing through a node's mount) who opened it

    @property
    def writes(self) -> bool:
        """Opened to change the file (for writing, or to cut it: O_TRUNC)."""
        return self.flags & os.O_ACCMODE != os.O_RDONLY or bool(self.flags & os.O_TRUNC)

    def heard_failures(self, behind: WriteBehind | None) -> None:
        """A failed write of the file since this handle last heard, raised once, and
        only to a handle that writes (a reader's close took the writer's error, and
        his close then said nothing of bytes that never landed)."""
        if behind is None or not self.writes:
            return
        err, self.failures = behind.failure_since(self.failures)
        if err is not None:
            raise err

    def heard_losses(self, lost: int) -> None:
        """EIO, once, if the metadata store lost a group of changes since this handle
        last synced: it may have held this file's changes (as errseq does for data)."""
        if lost != self.losses:
            self.losses = lost
            raise OSError(errno.EIO, "a group of metadata changes was lost")


class MxfsOperations(pyfuse3.Operations):
    supports_dot_lookup = True

    def __init__(self, volume: Volume, control_path: str = "", noatime: bool = False,
                 io_threads: int = 16, writeback_cache: bool = False,
                 metrics: Metrics | None = None, write_behind: int = DEPTH) -> None:
        super().__init__()
        self.metrics = metrics or Metrics()
        # With the writeback cache the kernel gathers writes and sends them in 1 MiB
        # requests, several at a time, and owns O_APPEND offsets and mtime; but data
        # it accepted is lost if the daemon dies first (docs/architecture.md).
        self.enable_writeback_cache = writeback_cache
        self.vol = volume
        self.store = volume.store
        # On a reading node: the worker thread its store's reads run in, on a connection
        # of its own (not the KV lookups': a slow batch of keys holds no lookup up).
        self.reads = StoreWorker(volume.pool.meta_location, wait_s=SERVE_WAIT_S,
                                 prepare=lambda s: s.read_beside(volume.store)) \
            if self.store.follow else None
        # What a writer's chowns move between owners, summed off the thread.
        self.owned = OwnedSums(volume.quotas, StoreWorker(
            volume.pool.meta_location, wait_s=SERVE_WAIT_S))  # (the daemon's shares KV's)
        self.control_path = control_path
        self.noatime = noatime
        self.handles: dict[int, Handle] = {}
        self.next_fh = 1
        # Data I/O runs on `io_threads` worker threads, handed out by the opener's uid in
        # turn (one uid, but root, holds 3 in 4): a user with dozens of reads in flight
        # makes another's wait for a thread, not behind all of them.  Files with stripes
        # on other nodes' members have threads of their own for each set of nodes they
        # wait on (`fs/fair.Lanes`): a slow node holds only those of files striped
        # over it, never this node's own files' nor other nodes' files'.
        self.lanes = Lanes(io_threads, BUDGET)
        self.limiter = self.lanes.own.limiter
        # Renews (copies of whole files) of one tenant at once: a user looping chmods of
        # files she holds open took 12 of a lane's 16 threads, and the disk.
        self.renew_turns = Turns(RENEWS_PER_USER)
        # a tenant's xattr bytes a second (`setxattr`): past them she waits, the thread
        # free (the writer's are shared with what other nodes forward: the daemon)
        self.xattr_pace = XattrPace()
        # On a reading node: mkdir, unlink, rmdir and rename asked of the writer as the
        # caller (`fs/node_files.py`; set by the daemon).
        self.names: ForwardedFiles | None = None
        # On a node that holds members: files written through this mount on them
        # (`fs/mount_writes.py`; set by the daemon).
        self.written: MountWrites | None = None
        # On a reading node: the files its mount has open, held for it on the writer
        # (an unlinked one keeps its bytes until the last close: `fs/held_open.py`).
        self.held_open: HeldOpen | None = None
        # Where writes land behind their answers (set by the daemon once trio runs;
        # without it, or with the writeback cache, each write lands before its answer).
        self.nursery: trio.Nursery | None = None
        self.write_behind = write_behind  # writes queued per inode; 0: none (a lane's
        # budget bounds them in all)
        self.behind: dict[int, WriteBehind] = {}
        # Files open through the mount by tenant (`vol/tenants.py`; root: not held).
        self.open_by_tenant: Counter[int] = Counter()
        self.max_open_per_user = Limits.max_open_per_user
        # The daemon's descriptors held for tenants (the control server's: set by the
        # daemon): each open file charged its chunk files here (`_opened`).
        self.fds = Descriptors()
        # Requests that failed unforeseen, and opens past max_open_per_user: each kind
        # logged once per tenant, then counted (`fs/failures.py`).
        self.failures = FailureLog(log)
        self._cutting: dict[int, trio.Event] = {}  # files being cut: their writes wait
        # Files a truncate cuts now, their smaller size committed: a node's close that
        # tells a size meanwhile is asked again (`NodeFiles`), once its node follows it.
        self.truncating: set[int] = set()
        # Writes past their wait for a cut and not yet queued (or landed), by inode, and
        # what a cut waiting for them waits on (`_entering`)
        self._entering_writes: Counter[int] = Counter()
        self._entered: dict[int, trio.Event] = {}
        self.syncs = SharedSync(self.store)  # (the control socket's commits share them)
        # How long the kernel keeps answers (`fs/kernel_cache.py`).  On a reading node
        # (`MetaStore.follow`) it also keeps a file's cached pages across opens only
        # while the file is as it was when they were read (close-to-open, as NFS gives
        # it): ino -> (mtime, ctime, size).
        self.kernel = KernelCache(self.store.follow)
        # The kernel's invalidations of what requests changed behind its back, off the
        # loop (`entry_changed`); `unmounting` set as the mount ends.
        self.unmounting = threading.Event()
        self.invalidations = Invalidations(self.kernel_held, self.unmounting)
        # The members' filesystems asked for a request (statfs, st_blocks) off the loop,
        # a hung member left out (`fs/member_calls.py`).
        self.space = MemberSpace(volume)
        self.blocks = BlockCounts(volume.pool, volume.layout, self.space.calls,
                                  volume.open_inodes.__contains__)
        self._seen: dict[int, tuple[int, int, int]] = {}

    def kernel_held(self) -> tuple[list[int], list[tuple[int, bytes]]]:
        """(inodes, entries) the kernel may hold answers or pages of: what a reading
        node invalidates when the change feed cannot say what changed.  (Called from
        the feed's thread.)"""
        inos, names = self.kernel.held()
        return sorted(set(inos) | set(list(self.vol.open_inodes))), names

    def data_changed(self, ino: int) -> None:
        """Another node changed the file's data: what this daemon read ahead of it is
        dropped (the kernel's pages go by the feed's invalidation).  (The feed's
        thread; a file closed meanwhile is nothing to drop.)"""
        entry = self.vol.open_inodes.get(ino)
        if entry is not None and entry.chunks is not None:
            entry.chunks.drop_read_ahead()

    async def entry_changed(self, parent: int, name: bytes, uid: int = 0) -> None:
        """A name changed behind the kernel's back (a direct commit): drop its cached entry.

        Waited for before the commit is answered, so the committer sees its file at
        once, a while at most: the kernel takes the directory's lock, which a user's
        request may hold for good (`fs/invalidations.py`: threads of their own, one
        directory held stalls only its own names).
        """
        await self.invalidations.waited(names=[(parent, name)], uid=uid)

    async def inode_changed(self, ino: int, uid: int = 0) -> None:
        """A file's bytes changed behind the kernel's back (written through another
        node's mount): its cached attributes and pages, and what was read ahead of it,
        are dropped before the change is answered (a while at most, as above)."""
        self.data_changed(ino)
        await self.invalidations.waited(data=[ino], uid=uid)

    # ---- attributes --------------------------------------------------------

    def attrs(self, node: Inode, entry: tuple[int, bytes] | None = None
              ) -> pyfuse3.EntryAttributes:
        """The kernel's view of `node`, reached by `entry` (directory, name) if the
        kernel will keep that name too (lookup, readdirplus, create).  Its blocks are
        its chunk files' if counted lately (`fs/block_counts.py`), else its size's."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.attr_timeout = self.kernel.timeout(node.ino)
        a.entry_timeout = self.kernel.timeout(entry) if entry is not None else a.attr_timeout
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = node.rdev
        a.st_size = node.apparent_size
        a.st_blksize = node.stripe_unit if node.is_reg and node.stripe_unit else 4096
        a.st_blocks = self.blocks.blocks(node)
        if not self.blocks.stands(node):  # (asked again soon: writes may still land)
            a.attr_timeout = min(a.attr_timeout, KEEP_S)
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = node.mtime_ns
        a.st_ctime_ns = node.ctime_ns
        held = self._held(node.ino)
        if held is not None:  # (written here: the writer is told at close)
            a.st_size, a.st_blocks = held.size, (held.size + 511) // 512
            a.st_mtime_ns = held.mtime_ns
        return a

    def _held(self, ino: int) -> Written | None:
        """What this node holds of a file open for writing here (a node's mount)."""
        return self.written.files.get(ino) if self.written is not None else None

    def _size(self, node: Inode) -> int:
        """A file's size, as written here if it is open for writing on this node."""
        held = self._held(node.ino)
        return held.size if held is not None else node.size

    async def _read_meta(self, uid: int, fn: Callable[[MetaStore], T]) -> T:
        """`fn(store)`: here, or on a reading node in its store's worker thread, in
        `uid`'s turn (each read there is a round trip to the metadata server)."""
        if self.reads is None:
            return fn(self.store)
        return await self.reads.run(fn, uid)

    @_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        if len(name) > NAME_MAX:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        node = await self._read_meta(ctx.uid, lambda s: _lookup(s, parent_inode, name))
        if node is not None:
            await self.blocks.count([node], ctx.uid)
            return self.attrs(node, (parent_inode, name))
        absent = pyfuse3.EntryAttributes()  # inode 0: the kernel caches "no such name"
        absent.st_ino = 0
        absent.entry_timeout = self.kernel.timeout((parent_inode, name))
        return absent

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        uid = ctx.uid if ctx is not None else 0
        node = await self._read_meta(uid, lambda s: s.get(inode))
        await self.blocks.count([node], uid)
        return self.attrs(node)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """The kernel let go of these: memory lets them go too, a slice at a time (a
        batch can hold 65,536, and a user makes one by having her memory cgroup
        reclaim her inodes: 16 ms of the thread at once)."""
        try:
            async for bite in in_bites(inode_list, 256):
                for ino, _ in bite:
                    if ino not in self.vol.open_inodes:
                        self.store.forget(ino)
        except Exception:  # forget has no reply: log, and keep the mount
            log.exception("forget failed")

    @_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.names is not None:  # a reading node
            return await self._setattr_node(inode, attr, fields, fh, ctx)
        node = self.store.get(inode)
        async with self.owned.of(node, attr.st_uid if fields.update_uid else None,
                                 ctx.uid) as owned:  # (watched until the change)
            now = time.time_ns()
            if fields.update_uid and attr.st_uid != node.uid:  # (before anything changes)
                self.vol.quotas.room_for_owner(node, attr.st_uid, ctx.uid, owned.sums)
            if fields.update_size:
                if node.is_dir:
                    raise pyfuse3.FUSEError(errno.EISDIR)
                if not node.is_reg:
                    raise pyfuse3.FUSEError(errno.EINVAL)
                self.vol.check_writable(node)
                await self.settle(inode)
                with self._charged(node, attr.st_size):
                    await self._truncate(node, attr.st_size, ctx.uid)
            if node.is_reg and self.vol.needs_renew(node) and node.takes_read(
                    attr.st_mode if fields.update_mode else None,
                    attr.st_uid if fields.update_uid else None,
                    attr.st_gid if fields.update_gid else None):
                await self.renew(node, ctx.uid)
            mtime = attr.st_mtime_ns if fields.update_mtime else now if fields.update_size else None
            self.store.set_attrs(
                node,
                mode=stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode) if fields.update_mode
                else None,
                uid=attr.st_uid if fields.update_uid else None,
                gid=attr.st_gid if fields.update_gid else None,
                atime_ns=attr.st_atime_ns if fields.update_atime else None,
                mtime_ns=mtime, ctime_ns=attr.st_ctime_ns if fields.update_ctime else now,
                owned=owned.now())
        return self.attrs(node)

    async def _row_attrs(self, ino: int, uid: int) -> pyfuse3.EntryAttributes:
        """The kernel's view of `ino` as the store holds it now (a row the writer just
        changed, on a reading node)."""
        return self.attrs(await self._read_meta(uid, lambda s: s.get(ino)))

    async def _setattr_node(self, inode: int, attr: pyfuse3.EntryAttributes,
                            fields: pyfuse3.SetattrFields, fh: int | None,
                            ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """setattr on a reading node.  A file's size, where it is wholly on this node's
        members, is cut here through a handle opened for writing (`fh`), or by name as
        an open, a cut and a close would (each judged by the writer first); the mtime
        of a file open for writing here is told at its close; mode, owner and other
        times are asked of the writer as the caller (`node_setattr`)."""
        assert self.names is not None
        node = await self._read_meta(ctx.uid, lambda s: s.get(inode))
        ask: dict[str, int] = {}
        if fields.update_mode:
            ask["mode"] = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            ask["uid"] = attr.st_uid
        if fields.update_gid:
            ask["gid"] = attr.st_gid
        if fields.update_atime:
            ask["atime_ns"] = attr.st_atime_ns
        handle = self.handles.get(fh) if fh is not None else None
        through = handle is not None and handle.writes and self.written is not None \
            and inode in self.written.files  # (a handle this node writes the file by)
        if fields.update_mtime and not through and not fields.update_size:
            ask["mtime_ns"] = attr.st_mtime_ns
        if ask:
            await self.names.ask(_caller(ctx), "node_setattr", {**ask, "ino": inode})
        if fields.update_size and not through:  # (by name: as open, cut, close)
            info = await self._open_here(node, os.O_WRONLY, ctx)
            try:
                await self._cut_here(node, attr.st_size, _caller(ctx))
            finally:
                await self._release(info.fh)
        elif through and self.written is not None:
            assert handle is not None and handle.caller is not None
            if fields.update_size:
                await self._cut_here(node, attr.st_size, handle.caller)
            if fields.update_mtime:
                self.written.touched(inode, attr.st_mtime_ns)
        if ask:
            node = await self._read_meta(ctx.uid, lambda s: s.get(inode))
        return self.attrs(node)

    # ---- namespace ---------------------------------------------------------

    def _create(self, parent_inode: int, name: bytes, mode: int,
                ctx: pyfuse3.RequestContext, rdev: int = 0,
                target: bytes | None = None) -> Inode:
        parent = self.store.get(parent_inode)
        self.vol.pool.check_meta_room(META_ROW + len(name) + len(target or b""))
        self.vol.quotas.room_for_entry(ctx.uid, parent.uid, name, len(target or b""), 1)
        mode, gid = owner_for(parent, mode, ctx.uid, ctx.gid,
                              lambda g: g == ctx.gid or g in pyfuse3.get_sup_groups(ctx.pid))
        return self.store.create(parent_inode, name, mode, ctx.uid, gid, rdev=rdev,
                                 target=target, layout_for=self.vol.pick_layout)

    @_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.names is not None:  # a reading node: made by the writer, for this caller
            made = await self.names.change_name(_caller(ctx), "node_mknod", parent_inode,
                                                name, mode=mode, rdev=rdev)
            return await self._row_attrs(int(made["ino"]), ctx.uid)
        return self.attrs(self._create(parent_inode, name, mode, ctx, rdev=rdev))

    @_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.names is not None:  # a reading node: made by the writer, for this caller
            made = await self.names.change_name(_caller(ctx), "node_mkdir", parent_inode,
                                                name, mode=mode)
            return await self._row_attrs(int(made["ino"]), ctx.uid)
        return self.attrs(self._create(parent_inode, name, stat.S_IFDIR | mode, ctx))

    @_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.names is not None:  # a reading node: made by the writer, for this caller
            made = await self.names.change_name(_caller(ctx), "node_symlink", parent_inode,
                                                name, target=b64(target))
            return await self._row_attrs(int(made["ino"]), ctx.uid)
        return self.attrs(self._create(parent_inode, name, stat.S_IFLNK | 0o777, ctx,
                                       target=target))

    @_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = await self._read_meta(ctx.uid, lambda s: s.get(inode))
        if node.target is None:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    @_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if self.names is not None:
            await self.names.change_name(_caller(ctx), "node_link", new_parent_inode,
                                         new_name, ino=inode)
            return await self._row_attrs(inode, ctx.uid)
        self.vol.pool.check_meta_room(META_ROW + len(new_name))
        self.vol.quotas.room_for_entry(ctx.uid, self.store.get(new_parent_inode).uid,
                                       new_name)
        return self.attrs(self.store.link(inode, new_parent_inode, new_name))

    @_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if self.names is not None:
            await self.names.change_name(_caller(ctx), "node_unlink", parent_inode, name)
            return
        self.vol.unlinked(self.store.unlink(parent_inode, name))

    @_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if self.names is not None:
            await self.names.change_name(_caller(ctx), "node_rmdir", parent_inode, name)
            return
        self.vol.unlinked(self.store.rmdir(parent_inode, name))

    @_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE):
            raise pyfuse3.FUSEError(errno.EINVAL)
        if self.names is not None:
            await self.names.change_name(
                _caller(ctx), "node_rename", parent_inode_old, name_old,
                new_parent=parent_inode_new, new_name=name_new,
                noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
            return
        if not flags & pyfuse3.RENAME_EXCHANGE:  # (an exchange moves no names)
            self.vol.room_for_rename(
                ctx.uid, self.store.get(parent_inode_old), name_old,
                self.store.get(parent_inode_new), name_new,
                self.store.entry_ino(parent_inode_new, name_new) is not None)
        gone = self.store.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                 noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                                 exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
        if gone is not None:
            self.vol.unlinked(gone)

    # ---- files -------------------------------------------------------------

    def _opened(self, ctx: pyfuse3.RequestContext, node: Inode | None = None) -> None:
        """Count one more open file or folder of the caller's user (`_may_open`)."""
        tenant = tenant_of(ctx.uid)
        self._may_open(ctx)
        if node is not None and node.is_reg:
            pool = self.vol.pool
            entry = self.vol.open_inodes.get(node.ino)
            if node.size == 0 and (entry is None or not entry.wrote):
                # (its layout may still be set wider while it is open: `set_layout`;
                # charged its own, a file made one wide and set to every member held
                # every member's descriptor on one's charge)
                here = pool.local_members()
            else:
                here = [m for m in self.vol.layout(node).used_members()
                        if not pool.members[m].node]
            try:
                self.fds.opened(tenant, node.ino, len(here))
            except OSError as e:
                self._refused(ctx, e)
        self.open_by_tenant[tenant] += 1

    def _may_open(self, ctx: pyfuse3.RequestContext, fds: int = 0) -> None:
        """EMFILE where the caller's user holds max_open_per_user files and folders, or
        `fds` more of the daemon's descriptors pass her share (a file holds one a member
        it touches here: `fs/descriptors.py`; one user's files, held open, took every
        descriptor and failed all others' I/O); ENFILE past all the tenants'.  A folder
        holds its inode in memory.  A refusal is logged once per user, then counted
        (logged each time, a user at the limit looping on open(2) wrote megabytes a
        second into the daemon's log)."""
        tenant = tenant_of(ctx.uid)
        if tenant and self.open_by_tenant[tenant] >= self.max_open_per_user:
            self.failures.note("open past max_open_per_user", ctx, OSError(
                errno.EMFILE, f"user {tenant} holds {self.open_by_tenant[tenant]} files and "
                "folders open through the mount, the limit"), trace=False, level=logging.INFO)
            raise pyfuse3.FUSEError(errno.EMFILE)
        err = self.fds.refusal(tenant, fds)
        if err is not None:
            self._refused(ctx, err)

    def _refused(self, ctx: pyfuse3.RequestContext, err: OSError) -> None:
        """Raise an open's refusal past the daemon's descriptors, logged (a user's own
        share at INFO: hers to mind)."""
        self.failures.note("open past the fd budget", ctx, err, trace=False,
                           level=logging.INFO if err.errno == errno.EMFILE else None)
        raise pyfuse3.FUSEError(err.errno or errno.EMFILE)

    def _closed(self, uid: int, ino: int | None = None) -> None:
        tenant = tenant_of(uid)
        self.open_by_tenant[tenant] -= 1
        if self.open_by_tenant[tenant] <= 0:
            del self.open_by_tenant[tenant]
        if ino is not None:
            self.fds.closed(tenant, ino)

    def _open_handle(self, node: Inode, flags: int, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.FileInfo:
        self._opened(ctx, node)
        uid = ctx.uid
        fh = self.next_fh
        self.next_fh += 1
        behind = self.behind.get(node.ino)
        self.handles[fh] = Handle(self.vol.acquire(node), flags, self.store.groups_lost, uid,
                                  behind.failures if behind is not None else 0)
        # Every change to a file passes through this daemon, so the kernel's cached
        # pages of it stay valid between opens; on a reading node, while it is unchanged.
        keep = True
        if self.store.follow:
            now = (node.mtime_ns, node.ctime_ns, node.size)
            keep = self._seen.pop(node.ino, None) == now
            self._seen[node.ino] = now  # (the most recent last)
            if len(self._seen) > SEEN_KEPT:  # the least recently opened goes: cleared
                del self._seen[next(iter(self._seen))]  # whole, one user's opens of
                #  100,000 files dropped every user's cached pages of every file
        # An O_APPEND handle bypasses the kernel's page cache (without the writeback
        # cache: its appends are placed here, at the size this daemon knows), so it is
        # never one the kernel writes a shared mapping's dirty pages through: one that
        # was had each page placed at the end of the file, not at its offset.  Mapped
        # shared (even read-only) it is refused, ENODEV; privately, it maps as any, and
        # its reads are not cached (an "a+" handle's).
        direct = bool(flags & os.O_APPEND) and not self.enable_writeback_cache
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=direct)

    @_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        if self.held_open is None:
            return await self._open(inode, flags, ctx)
        held = inode in self.vol.open_inodes
        self.held_open.open_begins(inode)  # (a reading node: counted before its row is
        try:                               # read)
            return await self._open(inode, flags, ctx, held)
        finally:
            self.held_open.open_ends(inode)

    async def _open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext,
                    held: bool = True) -> pyfuse3.FileInfo:
        """`held`: the file is open here already (a reading node: the writer keeps it
        for this node, linked or not; else it must still have a link)."""
        node = await self._read_meta(ctx.uid, lambda s: s.get(inode))
        if node.nlink == 0 and not held:
            raise OSError(errno.ESTALE, f"inode {inode} was removed")
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        writing = node.is_reg and (flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC)
        if writing and self.names is not None:  # (a reading node: its own members')
            return await self._open_here(node, flags, ctx)
        if writing:
            self.vol.check_writable(node)
        if flags & os.O_TRUNC and node.is_reg:
            # libfuse enables atomic O_TRUNC: the kernel sends it here, not as setattr.
            await self.settle(inode)
            await self._truncate(node, 0, ctx.uid)
            now = time.time_ns()
            self.store.set_attrs(node, mtime_ns=now, ctime_ns=now)
        if node.nlink == 0 and node.ino not in self.vol.open_inodes:
            # (no await from here to the handle) Removed, and open nowhere: its freeing
            # may have begun.  Reopened through a link /proc keeps (an O_PATH descriptor
            # opens nothing here), its bytes left its owner's quota with the file and
            # came back on her writes for good.
            raise OSError(errno.ESTALE, f"inode {inode} was removed")
        if flags & os.O_ACCMODE != os.O_WRONLY and not self.noatime:
            # Reads may be served from the kernel's cache without reaching us, so
            # relatime is also applied when a file is opened for reading.
            self._relatime(node)
        return self._open_handle(node, flags, ctx)

    async def _open_here(self, node: Inode, flags: int, ctx: pyfuse3.RequestContext,
                         judged: bool = False) -> pyfuse3.FileInfo:
        """Open a file for writing on a node that holds members: one wholly on them,
        judged (and granted) by the writer first, unless `judged`: a create there was."""
        if self.written is None:
            assert self.names is not None
            self.names.check_writable()  # (a node holding no members: why not, said)
        assert self.written is not None
        caller = _caller(ctx)
        if not judged:  # (the writer judges the seal too: no store read here first)
            await self.written.open(node, caller)
        fresh = node.ino not in self.vol.open_inodes
        try:
            info = self._open_handle(node, flags, ctx)
            if fresh and node.ino in self.vol.lent:  # (a reader here may have been told
                # the generation the writer gave at this open before its handle was
                # made, with nothing here to mark: its first write renews it)
                self.vol.open_inodes[node.ino].told = True
        finally:
            self.written.opened(node.ino)
            if node.ino not in self.vol.open_inodes:  # (no handle was made)
                self.written.closed(node.ino)
        self.handles[info.fh].caller = caller
        if flags & os.O_TRUNC:
            try:
                await self._cut_here(node, 0, caller)
            except BaseException:
                await self._release(info.fh)
                raise
        return info

    async def _cut_here(self, node: Inode, size: int, caller: Caller) -> None:
        """Cut a file open for writing on this node to `size` (the writer takes the
        size first, as `caller`)."""
        assert self.written is not None
        await self.written.cut_to(node.ino, size, caller,
                                  functools.partial(self.settle, node.ino))

    async def row(self, ino: int) -> Inode:
        """The row of `ino` as the store holds it now (a reading node's worker)."""
        return await self._read_meta(0, lambda s: s.get(ino))

    async def cut(self, node: Inode, size: int, uid: int) -> None:
        """(MountWrites) cut a file's chunk files here to `size`, on its lane's threads
        in `uid`'s turn (straight on the lane's limiter, a user's hundreds of cuts at
        once went before another's turn)."""
        await self._in_turn(node, uid, self.vol.pool.truncate_chunks, node.ino,
                            self.vol.layout(node), size)

    @_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        # Refused before the file is made (a create that failed after left a name the
        # kernel did not know of: the next create of it was EEXIST).
        self._may_open(ctx, len(self.vol.pool.local_members()))
        if self.written is not None:  # a node: made by the writer, on its own members
            node = await self.written.create(_caller(ctx), parent_inode, name,
                                             stat.S_IMODE(mode), bool(flags & os.O_EXCL))
            info = await self._open_here(node, flags, ctx, judged=True)
            return info, self.attrs(node, (parent_inode, name))
        if self.names is not None:
            self.names.check_writable()  # (a node holding no members: why not, said)
        node = self._create(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        return self._open_handle(node, flags, ctx), self.attrs(node)

    @_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        entry = self.handles[fh].entry
        node = entry.node
        end = self._size(node)
        n = min(size, end - off)
        if n <= 0:
            return b""
        buf = bytearray(n)
        assert entry.chunks is not None
        await self.settle(node.ino)
        uid = self.handles[fh].uid  # (windows read ahead: counted as its user's)
        await self._io(entry.chunks, uid, entry.chunks.read, off, memoryview(buf),
                       tenant_of(uid), end)
        if not self.noatime:
            self._relatime(node)
        # pyfuse3 replies with any buffer (PyObject_GetBuffer), though its stub says bytes;
        # bytes(buf) would copy every read once more
        return buf  # type: ignore[return-value]

    async def _io(self, chunks: ChunkFiles, uid: int, fn: Callable[..., T], *args: Any,
                  first: bool = False) -> T:
        """`fn(*args)`, I/O of `chunks`, on a worker thread in `uid`'s turn (threads of
        their own for files on other nodes; `first`: ahead of the uid's own waiting)."""
        return await self.lanes.of(chunks.owners).run(uid, fn, *args, first=first)

    def _relatime(self, node: Inode) -> None:
        if self.store.readonly:  # reads go on where changes are refused (a fenced daemon)
            return
        now = time.time_ns()
        if (node.atime_ns <= node.mtime_ns or node.atime_ns <= node.ctime_ns
                or now - node.atime_ns > DAY_NS):
            self.store.touch(node, atime_ns=now)

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self.handles[fh]
        entry = handle.entry
        node = entry.node
        if self.written is not None and node.ino not in self.written.files:
            raise OSError(errno.EBADF, "not open for writing on this node")
        append = not self.enable_writeback_cache and bool(handle.flags & os.O_APPEND)
        if append:
            if self.written is not None:
                await self.written.uncut(node.ino)
            off = self._size(node)  # without the writeback cache, appends are placed here
        if self.written is not None:  # a node's: its size held here, told at close
            allowed = off + len(buf)
            await self.written.allow(node.ino, allowed, handle.caller)
            end: int | None = None
            try:
                # (the writer's RENW of our members holds this file's writes: `holding`;
                # one landing mid-copy would go to the old file its readers keep)
                await self._uncut(node.ino)
                if append:  # (placed again: a cut by the writer may have run meanwhile,
                    off = min(off, self._size(node))  # and the append lands where it left)
                with self._entering(node.ino):
                    await self._write_data(handle, off, buf)
                end = off + len(buf)
            finally:
                self.written.wrote(node.ino, allowed, end)
            return len(buf)
        if node.ino in self.vol.untaken and off > node.size:  # (as a truncate that grows)
            await self.cut_far(node, handle.uid)
        await self._uncut(node.ino)  # (a cut's chunk files are cut off trio's thread)
        if append:  # (placed again after a cut of it: where the cut left it)
            off = self._size(node)
        with self._entering(node.ino), self._charged(node, off + len(buf)):
            self.vol.note_write(entry)
            await self._write_data(handle, off, buf)
            if off + len(buf) > node.size:
                self.store.touch(node, size=off + len(buf))
        if not self.enable_writeback_cache:
            # With the writeback cache the kernel owns mtime and sends it as setattr;
            # a late writeback must not undo a utimens, so only set it here without.
            now = time.time_ns()
            self.store.touch(node, mtime_ns=now, ctime_ns=now)
        return len(buf)

    @contextlib.contextmanager
    def _charged(self, node: Inode, end: int) -> Iterator[None]:
        """Room for `node` growing to `end` bytes, charged to its owner (as quotas are)
        until the store's size says so: the check and the size it admits are split by
        awaits, in which the owner's other writes would pass the same check (16 of 40
        tries of 8 writes at once went past a quota)."""
        # (a chown meanwhile changes node.uid; a file holding a byte is charged a BLOCK)
        grow, owner = growth(node.size, end), node.uid
        self.vol.quotas.room(owner, grow)
        if grow <= 0:
            yield
            return
        self.vol.quotas.reserve(owner, grow)
        try:
            yield
        finally:
            self.vol.quotas.release(owner, grow)

    async def _write_data(self, handle: Handle, off: int, buf: bytes) -> None:
        """A write's bytes to the chunk files: landed behind the answer (write-behind,
        in the file's lane), or before it."""
        chunks = handle.entry.chunks
        assert chunks is not None
        ino = handle.entry.node.ino
        if self.nursery is not None and self.write_behind and not self.enable_writeback_cache:
            pieces = chunks.admit(off, len(buf))  # a member out of service, no room: now
            behind = self.behind.get(ino)
            if behind is None:
                behind = self.behind[ino] = WriteBehind(  # (the lane's when each is
                    self.write_behind, lambda: self.lanes.of(chunks.owners).budget)  # queued)
            try:  # (an earlier write's failure: told this writer)
                handle.heard_failures(behind)
                await behind.submit(self.nursery,
                                    lambda: chunks.write(off, memoryview(buf), pieces),
                                    # (landed ahead of the writer's own I/O waiting:
                                    # another user's read or close of the file waits
                                    # for it, not for her whole queue)
                                    functools.partial(self._io, chunks, handle.uid,
                                                      first=True),
                                    handle.uid)
            except BaseException:  # (not queued: what admit counted goes)
                chunks.unadmit(pieces)
                raise
        else:
            await self._io(chunks, handle.uid, chunks.write, off, memoryview(buf))

    @_errors
    async def flush(self, fh: int) -> None:
        handle = self.handles[fh]
        node = handle.entry.node
        await self.settle(node.ino)
        handle.heard_failures(self.behind.get(node.ino))  # (close() returns its errno)
        if self.written is not None and handle.writes and node.ino in self.written.files:
            assert handle.caller is not None
            await self.written.tell(node.ino, handle.caller)  # (close-to-open)
            return
        if handle.flags & os.O_ACCMODE != os.O_RDONLY:  # (a reader's close changed nothing,
            self.store.flush(node)                      # so it fails on nothing unsaved)
            if self.vol.readers:  # close-to-open for the pool's reading nodes: what
                self.store.commit()  # this close wrote, their next open sees

    @_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.handles[fh]
        entry = handle.entry
        await self.settle(entry.node.ino)
        handle.heard_failures(self.behind.get(entry.node.ino))
        if entry.chunks is not None:
            await self._io(entry.chunks, handle.uid, entry.chunks.sync, datasync,
                           self._size(entry.node))
        held = self._held(entry.node.ino)
        if held is not None and self.written is not None:  # (sized durably, by whoever
            await self.written.tell(entry.node.ino, handle.caller or held.caller)  # asks)
            return
        self.store.flush(entry.node)
        await self.syncs.durable()
        handle.heard_losses(self.store.groups_lost)

    @_errors
    async def release(self, fh: int) -> None:
        await self._release(fh)

    async def _release(self, fh: int) -> None:
        ino = self.handles[fh].entry.node.ino
        await self.settle(ino)  # before the last release closes the chunk descriptors
        handle = self.handles.pop(fh)
        self._closed(handle.uid, ino)
        self.vol.release(ino)
        if ino not in self.vol.open_inodes:
            self.blocks.closed(ino)
        if ino not in self.vol.open_inodes and self.written is not None:
            self.written.closed(ino)
        if ino not in self.vol.open_inodes and self.held_open is not None:
            self.held_open.closed(ino)
        if ino not in self.vol.open_inodes:
            behind = self.behind.pop(ino, None)
            if behind is not None and behind.error is not None:
                log.warning("inode %d: a write failed after its last flush (%s); nobody "
                            "was left to tell", ino, behind.error)

    async def _truncate(self, node: Inode, size: int, uid: int) -> None:
        """Set a file's size: the store's now, the chunk files (and the sync that comes
        first) from a worker thread in `uid`'s turn, the file's writes waiting
        meanwhile.  The sync is the store's shared one (a user looping O_TRUNC opens
        held the thread for an fsync each, then a lane's threads with one each, and
        everyone's fsyncs waited behind hers)."""
        async with self._chunk_files_held(node.ino):
            if node.ino in self.vol.untaken and size > node.size:  # (its hole would
                await self._cut_far_held(node, uid)  # read a dead node's untold bytes)
            if not self.vol.resize(node, size):
                return
            self.truncating.add(node.ino)
            try:
                await self._in_turn(node, uid, self.vol.cut, node.ino,
                                    self.vol.layout(node), size,
                                    functools.partial(trio.from_thread.run,
                                                      self.syncs.synced))
            finally:
                self.truncating.discard(node.ino)
            self.vol.truncated(node)

    async def renew(self, node: Inode, uid: int) -> None:
        """A lent file's chunk files made anew before its access changes (`Volume.renew`),
        its writes (and `open_read`s: `renewing`) waiting meanwhile; RENEWS_PER_USER of
        `uid`'s tenant at once (each a copy of the file)."""
        async with self.renew_turns.turn(uid), self._chunk_files_held(node.ino):
            self.vol.renew_begun(node.ino)  # (`renewing` sees it: open_read judges again)
            # (the old files count in the owner's quota while kept: what is left of it)
            await self._in_turn(node, uid, self.vol.renew, node,
                                self.vol.quotas.left(node.uid))

    async def cut_far(self, node: Inode, uid: int) -> None:
        """(The writer, having refused a node's last close of a file on that node's
        members.)  Its chunk files there cut to its size here, in `uid`'s turn, its
        writes here waiting meanwhile: the bytes the node wrote past it were never
        taken.  (The node cut them itself to the size the store last committed, and
        with it this mount's writes since: this mount holds a file's size until its
        close.)"""
        async with self._chunk_files_held(node.ino):
            await self._cut_far_held(node, uid)

    async def _cut_far_held(self, node: Inode, uid: int) -> None:
        """`cut_far`, its chunk files held already (`_chunk_files_held`).  CUT_BACK: a
        node whose caller holds the file open for writing again leaves it (its first
        open there cut it, and what it wrote since is its own: this cut may come late,
        after the node gave up waiting for the answer it cut for)."""
        await self._in_turn(node, uid, self.vol.pool.truncate_far, node.ino,
                            self.vol.layout(node), node.size, True)
        self.vol.untaken.discard(node.ino)
        entry = self.vol.open_inodes.get(node.ino)
        if entry is not None and entry.chunks is not None:
            entry.chunks.drop_read_ahead()  # (windows fetched before hold them)

    async def cut_elsewhere(self, ino: int) -> None:
        """(A node's chunk service, the writer's TRUN of `ino` done here, its writes
        held.)  A file open for writing here that a truncate on the writer cut: its
        size here is the writer's now, and the kernel's view of it is dropped (held
        at the size before, a close here told that size and grew the file back, its
        cut bytes zeros, and an O_APPEND here wrote past them)."""
        if self.written is not None and (ino in self.written.files
                                         or ino in self.written.untold):
            owner = await self.written.cut_elsewhere(ino)
            if owner is not None:
                await self.inode_changed(ino, owner)

    def writing_here(self, ino: int) -> bool:
        """Whether this node's mount holds `ino` open for writing (`MountWrites`)."""
        return self.written is not None and ino in self.written.files

    def holding(self, ino: int) -> contextlib.AbstractAsyncContextManager[None]:
        """The file's chunk files held for a change made elsewhere (the writer's RENW
        of this node's members): see `_chunk_files_held`."""
        return self._chunk_files_held(ino)

    async def renewing(self, ino: int) -> bool:
        """Whether the inode's chunk files were being cut or renewed: then this returned
        once they are (and the change that renewed them is made)."""
        if ino not in self._cutting:
            return False
        await self._uncut(ino)
        return True

    @contextlib.asynccontextmanager
    async def _chunk_files_held(self, ino: int) -> AsyncIterator[None]:
        """The file's chunk files are the caller's to cut or renew: writes answered
        before have landed, and new ones wait until it is done (`_uncut`)."""
        await self._uncut(ino)
        cutting = self._cutting[ino] = trio.Event()
        try:
            while self._entering_writes[ino]:
                await self._entered.setdefault(ino, trio.Event()).wait()
            await self.settle(ino)
            yield
        finally:
            del self._cutting[ino]
            cutting.set()

    async def _in_turn(self, node: Inode, uid: int, fn: Callable[..., Any], *args: Any
                       ) -> None:
        """Blocking `fn(*args)` on the file's lane's threads in `uid`'s turn, finished
        once begun."""
        lane = self.lanes.of(self.vol.pool.owners(self.vol.layout(node).used_members()))
        with trio.CancelScope(shield=True):
            await lane.run(uid, fn, *args)

    async def _uncut(self, ino: int) -> None:
        """Wait while a cut of `ino` runs (`_truncate`)."""
        while (cutting := self._cutting.get(ino)) is not None:
            await cutting.wait()

    @contextlib.contextmanager
    def _entering(self, ino: int) -> Iterator[None]:
        """A write of `ino` from its `_uncut` on until it is queued behind (or landed): a
        cut begun meanwhile waits for it (`_chunk_files_held`).  A write waiting for a
        write-behind slot was neither, so a cut's settle missed it, and it landed while
        the cut ran: bytes it answered for cut to zeros under the size it set."""
        self._entering_writes[ino] += 1
        try:
            yield
        finally:
            self._entering_writes[ino] -= 1
            if not self._entering_writes[ino]:
                del self._entering_writes[ino]
                entered = self._entered.pop(ino, None)
                if entered is not None:
                    entered.set()

    async def settle(self, ino: int) -> None:
        """Every write of `ino` answered so far is on its members (or failed: each
        handle that writes hears of it, `Handle.heard_failures`)."""
        behind = self.behind.get(ino)
        if behind is not None:
            await behind.drain()

    # ---- directories -------------------------------------------------------

    @_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = await self._read_meta(ctx.uid, lambda s: s.get(inode))
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        self._opened(ctx)
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = Handle(self.vol.acquire(node), 0, self.store.groups_lost, ctx.uid)
        return fh

    @_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self.handles[fh]
        node = handle.entry.node
        # Offsets: 1 after ".", 2 after "..", then 2 + the entry's cookie.
        if start_id < 1 and not pyfuse3.readdir_reply(token, b".", self.attrs(node), 1):
            return
        if start_id < 2:
            parent = await self._read_meta(handle.uid, lambda s: s.get(s.parent_of(node.ino)))
            if not pyfuse3.readdir_reply(token, b"..", self.attrs(parent), 2):
                return
        # Pages as large as the reply takes: a first small one (a 4 KiB reply holds 25
        # to 128 entries), doubling while the reply takes them all.  One request may
        # list thousands (a getdents of 1 MiB is one readdir since Linux 6.16): it
        # steps aside each slice (`fair.Slice`).
        after, limit, share = max(start_id - 2, 0), FIRST_PAGE, Slice()
        while True:
            def page(s: MetaStore, after: int = after, limit: int = limit
                     ) -> tuple[list[Entry], bool]:
                return s.readdir_page(node.ino, after, limit, PAGE_TARGETS,
                                      LOAD_BITE if self.reads is None else limit)
            entries, more = await self._read_meta(handle.uid, page)
            await self.blocks.count([e.inode for e in entries], handle.uid)
            for i, e in enumerate(entries):
                if i % BITE == 0:
                    await share.due()
                if not pyfuse3.readdir_reply(token, e.name, self.attrs(e.inode, (node.ino, e.name)),
                                             e.cookie + 2):
                    return
                after = e.cookie
            if not more:  # (the last page)
                break
            limit = next_page(limit, entries)
        if not self.noatime:
            self._relatime(node)

    @_errors
    async def releasedir(self, fh: int) -> None:
        handle = self.handles.pop(fh)
        self._closed(handle.uid)
        self.vol.release(handle.entry.node.ino)

    @_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.syncs.durable()
        self.handles[fh].heard_losses(self.store.groups_lost)

    @_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        if self.reads is not None:  # (what the writer published, read off the loop)
            await self.reads.run(self.vol.published, ctx.uid)
        s = pyfuse3.StatvfsData()
        total = pool_totals(await self.space.usage(ctx.uid))  # members sharing a disk count once
        bsize = 4096
        s.f_bsize = s.f_frsize = bsize
        s.f_blocks = total["size"] // bsize
        s.f_bfree = (total["size"] - total["used"]) // bsize
        s.f_bavail = total["free"] // bsize
        used = self.vol.count_inodes()
        s.f_files = max(used * 2, 1 << 24)
        s.f_ffree = s.f_favail = s.f_files - used
        s.f_namemax = NAME_MAX
        return s

    # ---- xattrs ------------------------------------------------------------

    def _layout_of(self, node: Inode) -> bytes:
        if node.is_reg:
            lay = self.vol.layout(node)
            return format_layout({"stripe_unit": lay.unit, "stripe_width": lay.width,
                                  "first_member": lay.first})
        if node.is_dir:
            return format_layout({
                "stripe_unit": node.stripe_unit or self.vol.pool.stripe_unit,
                "stripe_width": node.stripe_width or len(self.vol.pool.members)})
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if name == CONTROL_XATTR:  # (a name no file can be given: setxattr refuses it)
            if inode == ROOT_INO and self.control_path:
                return self.control_path.encode()  # (clients find the daemon: no server)
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        node = await self._read_meta(ctx.uid, lambda s: s.get(inode))
        if name == LAYOUT_XATTR:
            return self._layout_of(node)
        value = await self._read_meta(ctx.uid, lambda s: s.getxattr(inode, name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        check_sizes(name, value)
        if ctx.uid:  # (on a reading node too: the writer's store takes its bytes)
            await self.xattr_pace.turn(tenant_of(ctx.uid), len(name) + len(value))
        if self.names is not None:  # a reading node: set by the writer, for this caller
            await self.names.ask(_caller(ctx), "node_setxattr", {
                "ino": inode, "name": b64(name), "value": b64(value),
                "token": os.urandom(12).hex()})
            return
        set_xattr(self.vol, self.store.get(inode), name, value, ctx.uid)

    @_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        """The file's attribute names; trusted.* ones to root alone (the kernel lists to
        others what a FUSE filesystem gives it, and they are root's to know of)."""
        def read(s: MetaStore) -> list[bytes]:
            s.get(inode)
            return s.listxattr(inode)
        names = await self._read_meta(ctx.uid, read)
        if ctx.uid == 0:
            return names
        return [n for n in names if not n.startswith(b"trusted.")]

    @_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if self.names is not None:  # a reading node: removed by the writer, for this caller
            await self.names.ask(_caller(ctx), "node_removexattr", {
                "ino": inode, "name": b64(name), "token": os.urandom(12).hex()})
            return
        remove_xattr(self.vol, self.store.get(inode), name)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return True


def _lookup(store: MetaStore, parent: int, name: bytes) -> Inode | None:
    """The inode `name` names in `parent`; None where `parent` is a directory without it
    (ENOENT or ENOTDIR where `parent` is gone or no directory)."""
    try:
        return store.lookup(parent, name)
    except FileNotFoundError:
        if not store.get(parent).is_dir:
            raise
        return None

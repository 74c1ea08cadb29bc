"""A volume: the pool's members and its metadata store, opened together.

This is what the FUSE handlers and the control server both work on: it
formats a pool, opens and recovers it, tracks which inodes are open (so an
unlinked file keeps its data until the last close), reclaims orphans, and
checks the invariants that tie metadata to chunk files.  It holds no FUSE or
trio code, so tools can use it on an unmounted pool.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mxfs.errors import MxfsError
from mxfs.io import Layout
from mxfs.io.batch import sync_all
from mxfs.meta import Inode, MetaStore, Unusable, backup, lease, location
from mxfs.meta.check import problems as store_problems
from mxfs.meta.feed_notes import Noted, channel
from mxfs.meta.sqlite_engine import DB_NAME
from mxfs.meta.sqlite_space import Reserve, make_room
from mxfs.meta.survey import display_name, files_with_data, inode_numbers
from mxfs.pool import ChunkFiles, Pool
from mxfs.pool.closer import CLOSER, close_later
from mxfs.pool.key import load_key, read_key
from mxfs.pool.lock import release_pool_lock, take_pool_lock, write_lock_info
from mxfs.pool.pool import META_ROW, MemberCall, unlink_cut
from mxfs.pool.remote import Owner, RemoteMembers
from mxfs.pool.revoke import Held
from mxfs.proto.messages import MemberUsage
from mxfs.vol.node_holds import STALL_S, NodeHolds
from mxfs.vol.overdrafts import Overdrafts
from mxfs.vol.quota import Freeing, Quotas
from mxfs.vol.reclaim_queue import ReclaimQueue
from mxfs.vol.spares import Spares
from mxfs.vol.tenants import tenant_of

log = logging.getLogger("mxfs.volume")

# xattr bytes of removed files freed a reclaim round at most (8 MiB: 24-37 ms of the loop to
# delete, and the commit after; 1 MiB is 40 MiB a second at a round each 25 ms)
XATTR_BITE = 1 << 20
LENGTHS_BITE = 64  # ... summed for so many removed files at a time, until the bite is full
PENDING_BITE = 4096  # orphans freed at once (one commit and one sync) by `reclaim_pending`
CLOSE_DRAIN_S = 5.0  # seconds a clean close frees queued orphans for, at most (`close`)
RENEWALS_KEPT = 4096  # inodes whose renews are counted (`Volume.renewals`) at most
MAX_HELD_PER_USER = 64 << 30  # bytes of one user's removed or renewed files kept readable


@dataclass
class OpenInode:
    """State shared by every open handle of one inode."""

    node: Inode
    chunks: ChunkFiles | None
    count: int = 0
    wrote: bool = False
    # A reader was told the generation since this inode's writes last gave it a new
    # one: the next write gives another, so that reader sees the file changed.
    told: bool = False


@dataclass
class Recovery:
    """What mounting found to repair."""

    unclean: bool
    orphans: int = 0  # found in the rows: freed, or queued for the daemon to free
    trimmed: list[int] = field(default_factory=list)


class Volume:
    """Pool + metadata; one per daemon, used from one thread except for chunk I/O."""

    def __init__(self, pool: Pool, store: MetaStore, lock_fd: int | None = None) -> None:
        self.pool = pool
        self.store = store
        self.checked = True  # (whether close may mark the store clean: `open`)
        store.on_settled = pool.meta_committed
        self.open_inodes: dict[int, OpenInode] = {}
        store.held = self.open_inodes.__contains__  # (their objects stay the store's)
        # Orphans no longer open, freed in bites by owner in turn (after a commit).
        self.pending_reclaim = ReclaimQueue()
        self._far_pending: dict[int, list[int]] = {}  # ... their other nodes' members
        self.freeing = Freeing()  # what the queued orphans hold, by owner (for quotas)
        self.holds = NodeHolds()  # files other nodes' mounts hold open (the writer's)
        self.held_orphans: set[int] = set()  # orphans kept for them until their last close
        # Hidden inodes made ahead for KV chunks (root's layout), so a put needs no commit.
        self.spares = Spares(store, pool, self.pick_layout, self.layout)
        self.held = Held(pool)  # chunk files of dropped files whose writers hold on
        self.held.may_keep = self._may_keep
        self.held.on_refilled = functools.partial(
            self.caught, what="wrote into a dropped file through a descriptor it kept "
            "(its member's file system takes writes into immutable files: XFS)")
        # Tenants caught writing past their word: their creates refused a while.
        self.overdrafts = Overdrafts()
        # Bytes of removed or renewed files one user may keep readable for their readers
        # (`pool/revoke.py`: past it, the next are cut at once); the mount option.
        self.max_held_per_user = MAX_HELD_PER_USER
        # Files whose chunk-file descriptors were handed to readers (`open_read`) since
        # their chunk files were made: renewed before their access changes (`renew`).
        self.lent: set[int] = set()
        # Descriptors an earlier daemon handed out outlive it (a crash, an upgrade), and
        # `lent` starts empty: so every inode numbered when this mount began counts as
        # lent (`may_be_lent`) until it is renewed (`renewed_old`).
        self.lent_through = store.engine.sequences()["ino"]
        self.renewed_old: set[int] = set()
        # Renews begun, by inode (an `open_read` that saw one begin opens again), and
        # how often the count was cleared (kept for RENEWALS_KEPT inodes at most).
        self.renewals: Counter[int] = Counter()
        self.renewals_cleared = 0
        # Per-user limits on bytes and inodes (files kept for readers count as theirs).
        self.quotas = Quotas(store, self.freeing.of, self._held_of)
        self._lock_fd = lock_fd
        self.lease: lease.Lease | None = None  # the daemon's, in the store (meta/lease.py)
        self.keeper: lease.Keeper | None = None  # renews it; the daemon starts it
        # Reading nodes alive (the writer's keeper counts them): while there are any, a
        # close commits at once, so their next open sees it (close-to-open).
        self.readers = 0
        # ... each with the epoch it joined under (what other nodes hold here, such as
        # KV pins, ends with their epoch: `fs/kv_ops.py`).
        self.reader_epochs: dict[str, int] = {}
        # Files a node held open for writing when it died (or joined again): their
        # chunk files there may hold bytes past the size this writer took, never told.
        # Cut back before this writer's mount grows the file (a hole would read them:
        # `Ops.cut_far`); a node that opens one again cuts them itself (its first open).
        self.untaken: set[int] = set()
        # Called by mount-time work a bite at a time (the daemon's: `fs/startup.py`).
        self.progress: Callable[[], None] = lambda: None
        # Set when mount found the store damaged and put a backup in its place.
        self.restored_from: str | None = None
        # A reading node's view of what the writer published (`publish_stats`): when it
        # was read, and the stats.
        self._stats: tuple[float, dict[str, Any] | None] = (-STATS_FRESH_S, None)
        # The services of the nodes whose members this node reads (or, the writer,
        # writes), each with its owner's name (None: the writer node), kept current by
        # the keeper after each renewal.
        self.owner_views: list[tuple[RemoteMembers, str | None]] = []

    @classmethod
    def open(cls, spec: str, readonly: bool = False, recover_meta: bool = False,
             degraded: bool = False, hold: str | None = None) -> Volume:
        """Open a pool; with `recover_meta`, a damaged store is replaced by its newest
        good backup (the mount says so; changes made after that backup are lost); with
        `degraded`, missing members are marked failed instead of refused.

        With `hold` (who is asking, e.g. "mxfs put"), the pool lock is taken before
        the store is touched and kept until `close`.  Recovering swaps the store's files,
        so `recover_meta` always holds it (as "mxfs mount" until `lock` names the mount).
        """
        pool = Pool.open(spec, degraded=degraded)
        if hold is None and recover_meta:
            hold = "mxfs mount"
        if hold is not None and hold != "mxfs mount":
            pool.require_members(hold)
        lock_fd = take_pool_lock(pool, hold) if hold is not None else None
        try:
            if not pool.node:
                tighten(pool)  # before the store is opened: files it makes take its modes
            restored = _recover_store(pool) if recover_meta and not pool.node else None
            where = location.public(pool.meta_location)
            store, uuid = _open_store(pool, readonly or bool(pool.node))
            if uuid != pool.uuid:
                store.close()
                raise MxfsError(f"metadata store in {where} belongs to pool {uuid}, "
                                f"not {pool.uuid}", "restore the right metadata store")
            views: list[tuple[RemoteMembers, str | None]] = []
            if pool.node:
                try:
                    views = join_owner(pool, store)
                except BaseException:
                    store.close()
                    raise
            other = lease.live_elsewhere(store) if hold is not None and not pool.node \
                else None
            if other is not None:
                now = store.engine.clock()
                store.close()
                raise _served_elsewhere(other, now)
        except BaseException:
            if lock_fd is not None:
                release_pool_lock(lock_fd)
            raise
        vol = cls(pool, store, lock_fd)
        vol.owner_views = views
        vol.restored_from = restored
        # Only a store checked here (a mount's `_recover_store`), or found clean, is
        # marked clean at close: a tool opening one a crash left would hide the crash
        # from the next mount's check (`sqlite_engine.file_problem`).
        vol.checked = recover_meta or store.setting("clean") == "1"
        return vol

    @classmethod
    def claim(cls, spec: str, who: str) -> Volume:
        """Open an unmounted pool for an offline writer, holding the pool lock (taken before
        the store is opened) so it cannot be mounted meanwhile; `close` gives it back."""
        return cls.open(spec, hold=who)

    def backup_meta(self) -> str:
        """Blocking (worker thread): an online copy of the store on the next member."""
        if not backup.supported(self.store):
            raise OSError(errno.EOPNOTSUPP, f"a {self.store.engine.kind} store is copied by "
                          "its server's own tools (pg_dump, replicas), or by mxfs meta dump")
        return backup.backup(self.store, self.pool.backup_dir).path

    # ---- the pool lock (a daemon or an offline writer) ---------------------

    def lock(self, mountpoint: str, socket_path: str, ttl: float = lease.TTL_S,
             node_name: str = "", addr: str = "") -> None:
        """Claim the pool for one daemon; a second mount is refused, naming the holder.
        A pool whose metadata is on a server (reached from every node) is also leased
        for `ttl` seconds, its commits fenced by the lease's epoch, and its keeper made
        (`keeper.start()`); a store on the node's own member needs only the file lock.
        The writer's lease names its node (`node_name`, else its host) and chunk
        service (`addr`, "IP:PORT"; `lease.STARTING` until `announce`), for the
        reading nodes.  A reading node holds a lease of its own node instead
        (`_lock_node`).

        If `open` already holds the lock for this volume, it now names the mount.
        """
        if self._lock_fd is None:
            self._lock_fd = take_pool_lock(self.pool, "mxfs mount", mountpoint, socket_path)
        else:
            write_lock_info(self._lock_fd, {"pid": os.getpid(), "tool": "mxfs mount",
                                             "mountpoint": mountpoint, "socket": socket_path})
        if not location.is_server(self.pool.meta_location):
            return
        if self.pool.node:
            self._lock_node(mountpoint, ttl, addr)
            return
        try:
            self.lease = lease.take(self.store, mountpoint, ttl, node=node_name, addr=addr,
                                    members=len(self.pool.members))
            # Each group the writer commits is published for the reading nodes, the
            # first as "everything": what happened before this session is unknown.
            self.store.feed = Noted(self.lease.name, self.lease.epoch,
                                    channel(self.pool.uuid))
            self.store.set_setting(MEMBERS_KEY, json.dumps(
                {"count": len(self.pool.members), "stripe_unit": self.pool.stripe_unit,
                 "owners": [m.node for m in self.pool.members],
                 "superblock": self.pool.superblock.to_bytes().decode()}))
            held = self.lease
            self.pool.epoch = lambda: held.epoch
            others = sorted({m.node for m in self.pool.members if m.node})
            if others:  # members other nodes hold: written through them (`pool/remote.py`)
                key = load_key(self.pool.members[0].path, create=True)
                self.owner_views = owner_views(self.pool, key, list(others))
                for remote, name in self.owner_views:
                    assert name is not None
                    self.pool.remotes[name] = remote
            self.keeper = lease.Keeper(self.pool.meta_location, self.lease, self.store.engine,
                                       ttl, watch=self._count_readers)
            self._count_readers(self.store)  # (those already there: before serving)
        except lease.LeaseHeld as e:
            self.unlock()
            raise _served_elsewhere(e.holder, e.now) from None
        except OSError as e:
            self.unlock()
            raise MxfsError(f"the pool's lease cannot be taken in its metadata store ({e})",
                            "check the metadata store (mxfs status) and mount again") from None

    def announce(self, addr: str, key_name: str) -> None:
        """Tell the pool's other nodes where this writer's chunk service listens (in its
        lease) and which key it takes (`pool.key.key_id`, so a joining node can check
        the key it was given).  Nothing for a pool with no lease (one node)."""
        if self.lease is None:
            return
        self.lease.addr = addr
        ttl = self.keeper.ttl if self.keeper else lease.TTL_S
        if self.pool.node:  # a node serving its own members: in its own lease
            with contextlib.closing(MetaStore.open(self.pool.meta_location)) as store:
                if not lease.renew(store, self.lease, ttl, lease.node_key(self.pool.node)):
                    raise MxfsError(f"node {self.pool.node}'s lease was taken while "
                                    "mounting", "see mxfs status for who holds it")
            return
        if not lease.renew(self.store, self.lease, ttl):
            raise MxfsError("the pool's lease was taken while mounting",
                            "see mxfs status for the node that holds it")
        self.store.set_setting(KEY_ID_KEY, key_name)

    # ---- space and inodes, on every node ------------------------------------

    def publish_stats(self, usage: list[MemberUsage]) -> None:
        """The writer: its members' space (`usage`) and the inode count, in the store
        for the reading nodes (their statfs and status would otherwise count every
        row, and they cannot see the members)."""
        self.store.set_setting(STATS_KEY, json.dumps(
            {"inodes": self.store.count_inodes(), "members": usage}))

    def published(self, store: MetaStore | None = None) -> dict[str, Any] | None:
        """A reading node: what the writer last published, read at most every
        STATS_FRESH_S seconds (statfs may be asked in a loop by anyone), from `store`
        (a worker's: the read is a round trip) or the volume's."""
        at, stats = self._stats
        if time.monotonic() - at >= STATS_FRESH_S:
            try:
                text = (store or self.store).setting(STATS_KEY)
                stats = json.loads(text) if text else None
            except (OSError, ValueError):
                stats = None
            self._stats = (time.monotonic(), stats)
        return stats

    def usage(self, call: MemberCall | None = None) -> list[MemberUsage]:
        """Each member's space (`Pool.usage`, each asked through `call`); another
        node's as its writer published it, "node" naming whose it is."""
        out = self.pool.usage(call)
        if not self.pool.node:
            return out
        theirs = {m["index"]: m for m in (self.published() or {}).get("members", [])}
        for m in out:
            pub = theirs.get(m["index"])
            if pub is not None and m.get("node"):
                m["size"], m["free"], m["used"] = (int(pub.get(k, 0)) for k in
                                                   ("size", "free", "used"))
                if "dev" in pub:  # (members sharing a disk on the writer count once)
                    m["dev"] = int(pub["dev"])
        return out

    def count_inodes(self) -> int:
        """How many inodes the pool holds (a reading node: as the writer published it)."""
        if not self.pool.node:
            return self.store.count_inodes()
        return int((self.published() or {}).get("inodes", 0))

    def _count_readers(self, store: MetaStore) -> None:
        """The writer's keeper, after each renewal: which reading nodes are alive.  A new
        one is counted (closes commit at once from now on) before its name goes into
        the lease, which its mount waits for (`lease.await_writer`)."""
        self.watch_owners(store)
        alive = lease.alive_readers(store)
        names = sorted(alive)
        self.reader_epochs = alive
        self.readers = len(names)
        if self.store.feed is not None:  # (KV keys in the feed: for reading nodes' tables)
            self.store.feed.list_kv = bool(names)
        held = self.lease
        if held is not None and names != held.readers:
            held.readers = names
            if self.keeper is not None:
                lease.renew(store, held, self.keeper.ttl)

    def _lock_node(self, mountpoint: str, ttl: float, addr: str) -> None:
        """A reading node's lease: its own row, renewed by a keeper that also reads the
        writer's lease each time, so the node knows whom to ask for the members."""
        where, key = self.pool.meta_location, lease.node_key(self.pool.node)
        try:
            with contextlib.closing(MetaStore.open(where)) as store:
                self.lease = lease.take(store, mountpoint, ttl, node=self.pool.node, key=key,
                                        addr=addr, members=len(self.pool.local_members()))
        except lease.LeaseHeld as e:
            self.unlock()
            raise MxfsError(f"node name {self.pool.node} is in use: "
                            f"{e.holder.describe()} holds it",
                            "give this node another name (mxfs node add --name)") from None
        except OSError as e:
            self.unlock()
            raise MxfsError(f"the node's lease cannot be taken in the metadata store ({e})",
                            "check the metadata server and mount again") from None
        if not lease.await_writer(self.store, self.pool.node):
            log.warning("the writer node has not seen node %s join within two of its "
                        "renewals: what it closes may show here a little later until it "
                        "does", self.pool.node)
        self.keeper = lease.Keeper(where, self.lease, self.store.engine, ttl, key=key,
                                   watch=self.watch_owners)

    def watch_owners(self, store: MetaStore) -> None:
        """(The keeper's thread, after each renewal.)  Each owner's lease read again:
        whom to ask for its members, and whether it is alive."""
        for remote, name in self.owner_views:
            read_at = time.monotonic()
            remote.update(owner_of(store, name), read_at)

    @property
    def holds_lock(self) -> bool:
        return self._lock_fd is not None

    def unlock(self) -> None:
        if self._lock_fd is not None:
            release_pool_lock(self._lock_fd)
            self._lock_fd = None

    # ---- layouts -----------------------------------------------------------

    def pick_layout(self, ino: int, unit: int | None, width: int | None, node: str = ""
                    ) -> tuple[int, int, int]:
        """A new file's layout: its directory's defaults, first member spread by inode
        (on `node`'s members, for a file that node writes)."""
        lay = self.pool.layout_for(ino, unit, width, node)
        return lay.unit, lay.width, lay.first

    def layout(self, node: Inode) -> Layout:
        assert node.stripe_unit and node.stripe_width and node.first_member is not None
        return Layout(node.stripe_unit, node.stripe_width, node.first_member,
                      len(self.pool.members))

    # ---- open files and reclaim --------------------------------------------

    def acquire(self, node: Inode, chunks: ChunkFiles | None = None) -> OpenInode:
        """Count one more open handle of `node`; chunk descriptors are shared (`chunks`:
        those of a file not open yet, made ahead)."""
        entry = self.open_inodes.get(node.ino)
        if entry is None:
            if chunks is None and node.is_reg:
                chunks = ChunkFiles(self.pool, node.ino, self.layout(node))
            entry = self.open_inodes[node.ino] = OpenInode(node, chunks)
        entry.count += 1
        return entry

    def release(self, ino: int) -> None:
        """One handle fewer; the last one writes attributes back and may reclaim."""
        entry = self.open_inodes[ino]
        entry.count -= 1
        if entry.count:
            return
        del self.open_inodes[ino]
        node = entry.node
        if entry.chunks is not None:
            entry.chunks.close()
        if node.nlink == 0:
            if not self.pool.node:  # (a node's hidden files are the writer's to reclaim)
                self.unlinked(node)
            return
        self.store.flush(node)
        if entry.wrote:
            self.store.clear_dirty_data(node.ino)

    def note_write(self, entry: OpenInode) -> None:
        """Before a write: chunk files may now outgrow the recorded size, and direct
        readers see a new generation.  Only the first write of an open, and the first
        after a reader was told the generation (`told`), store one: not every write,
        yet none a reader opened before goes unseen, whoever opened the writer when."""
        if not entry.wrote or entry.told:
            self.store.begin_write(entry.node)
            # Committed before any chunk file exists, so none can outlive its inode.
            self.store.commit()
            entry.wrote, entry.told = True, False

    def told(self, ino: int) -> None:
        """A reader was told `ino`'s generation (a LAYOUT or open_read reply, a scoped
        connection): a later write through an open that already wrote must change it."""
        entry = self.open_inodes.get(ino)
        if entry is not None:
            entry.told = True

    def check_writable(self, node: Inode) -> None:
        """Refuse to change the bytes of a sealed (direct-committed, checksummed) file."""
        if self.store.is_sealed(node.ino):
            raise OSError(errno.EPERM, "the file is sealed (written by a direct commit); "
                          "copy it to change it")

    # ---- direct writes -------------------------------------------------------

    def create_hidden(self, parent: Inode, mode: int, uid: int, gid: int, node: str = ""
                      ) -> OpenInode:
        """A file with no name yet, held open by its writer until `publish` or release,
        on this node's members (`node`'s, for a file that node writes).

        It is an orphan from birth and committed before any chunk file exists, so
        a crash or a writer that goes away leaves nothing behind.
        """
        self.pool.check_meta_room(META_ROW)
        node_row = self.store.create_hidden(parent.ino, mode, uid, gid,
                                            functools.partial(self.pick_layout, node=node))
        self.store.commit()
        return self.acquire(node_row)

    def take_spare(self, uid: int, gid: int) -> OpenInode:
        """A committed hidden file with the root's layout, held open (`vol/spares.py`)."""
        return self.acquire(*self.spares.take(uid, gid))

    def settle_hidden(self, entry: OpenInode, size: int, sync: bool = True) -> None:
        """Blocking: cut a hidden file's chunk files to `size`, and fsync them if `sync`
        (through read-only descriptors of the daemon's own, closed after: the writer's
        are closed by now, and a write descriptor kept would make the daemon a writer
        of the file, its next commit refused EBUSY after this one failed past here, a
        name taken or a quota)."""
        node = entry.node
        assert entry.chunks is not None
        layout = self.layout(node)
        self.pool.truncate_chunks(node.ino, layout, size, exact=True)
        if sync:
            fds = []
            try:
                for m in layout.used_members():
                    if not self.pool.members[m].node:
                        with contextlib.suppress(FileNotFoundError):  # (a hole)
                            fds.append(os.open(self.pool.chunk_path(m, node.ino),
                                               os.O_RDONLY | os.O_CLOEXEC))
                sync_all(fds)
            finally:
                close_later(fds)

    def publish(self, entry: OpenInode, parent: int, name: bytes, size: int, replace: bool,
                sum_unit: int, sums: bytes) -> None:
        """Name a settled hidden file and seal it with its checksums, in one change.

        The caller makes it durable (commit, then sync) before answering.
        """
        self.check_seal_room(name, sums)
        replaced = self.store.publish(entry.node.ino, parent, name, replace=replace,
                                      size=size, sum_unit=sum_unit, sums=sums)
        if replaced is not None:
            self.unlinked(replaced)

    def check_seal_room(self, name: bytes, sums: bytes) -> None:
        """ENOSPC below the metadata member's floor for a sealing commit's rows: its name
        and its sums (8 bytes a sum block: up to ~770 KB for one commit), whatever
        members the file's bytes are on.  Every seal passes here (`publish`, and
        `KVIndex.insert`), before the change: a file placed off the metadata member
        passes `Pool.check_space`, and its sums filled the store's disk for everyone.
        (The usage tally, `meta/usage.py`, charges the file's declared bytes, not its
        sums: they are at most 1/512 of them, at the 4 KiB smallest sum block.)"""
        self.pool.check_meta_room(META_ROW + len(name) + len(sums))

    def room_for_rename(self, caller: int, old_dir: Inode, old: bytes, new_dir: Inode,
                        new: bytes, replaces: bool) -> None:
        """A rename to a longer name grows the store by the difference: refused below
        the metadata member's floor (a million one-byte names, made above it, renamed
        to 255 bytes below it).  The new name is charged to `new_dir`'s owner, the
        old credited to `old_dir`'s: refused past the first's quota where it grows
        (`Quotas.room_for_rename`)."""
        if len(new) > len(old):
            self.pool.check_meta_room(len(new) - len(old))
        self.quotas.room_for_rename(caller, old_dir.uid, old, new_dir.uid, new, replaces)

    def unlinked(self, node: Inode) -> None:
        """After a namespace change dropped `node`'s last link: reclaim unless open,
        here or on another node (`vol/node_holds.py`)."""
        if node.nlink or node.ino in self.open_inodes:
            return  # (the last close here reclaims it)
        if node.ino in self.holds:
            self.held_orphans.add(node.ino)  # (freed at the nodes' last close: `let_go`)
        else:
            self._queue_reclaim(node)

    def let_go(self, inos: list[int]) -> None:
        """Nobody holds these open any longer: reclaim those that have no name.  Only
        orphans waiting for nodes are looked up (a node's closes come by the thousand,
        and a row not cached is a round trip to a metadata server)."""
        for ino in inos:
            if ino not in self.held_orphans:
                continue
            self.held_orphans.discard(ino)
            try:
                node = self.store.get(ino)
            except OSError:
                continue  # (reclaimed already)
            self.unlinked(node)

    def _queue_reclaim(self, node: Inode) -> None:
        self.pending_reclaim.push(node.ino, node.uid)
        self.freeing.add(node)

    def queue_orphans(self, inos: list[int]) -> None:
        """Queue orphans the rows list (a mount's, fsck's) to be freed as removed files
        are, their owners read in few statements (a row each was a round trip to a
        metadata server); one without an inode row is root's.  Unlike a removal freed
        within a round, their bytes count against their owners until freed (minutes,
        for a million): else a user at her quota could write them again meanwhile."""
        for start in range(0, len(inos), PENDING_BITE):
            self.progress()
            part = inos[start:start + PENDING_BITE]
            owners = {ino: uid for ino, uid, _, _ in self.store.owners(part)}
            for ino in part:
                uid = owners.get(ino, 0)
                self.pending_reclaim.push(ino, uid)
                self.freeing.add_uncredited(ino, uid)

    def _far_of(self, inos: list[int]) -> dict[int, list[int]]:
        """Other nodes' members the layouts of `inos` use (their rows still there,
        committed), for the writer to remove their chunk files through the owners.  The
        rows are read in few statements: a crash's orphans are not cached, and a row
        each was a round trip to a metadata server on the daemon's thread (512 a round)."""
        n = len(self.pool.members)
        if not inos or not self.pool.far(range(n)):
            return {}
        out = {}
        for ino, mode, unit, width, first in self.store.engine.get_many(
                "inodes", "ino", inos,
                ("ino", "mode", "stripe_unit", "stripe_width", "first_member")):
            if stat.S_ISREG(mode) and unit and width and first is not None:
                far = self.pool.far(Layout(unit, width, first, n).used_members())
                if far:
                    out[ino] = far
        return out

    def take_pending(self, most: int | None = None) -> list[int]:
        """Commit, then hand over the orphans to free (their chunk files may now go):
        only those the rows list, as the change that made one may be in a lost group.
        With `most`, at most that many (the daemon frees a removed namespace's 65,536
        chunks a round at a time, not in one stall)."""
        inos = self.pending_reclaim.take(most)
        if inos:
            try:
                self.store.commit()
                orphans = self.store.orphans_among(inos)
                bite = self._xattr_bite(orphans)
            except OSError:
                self.pending_reclaim.put_back(inos)  # tried again next round
                raise
            self.freeing.drop(set(inos) - set(orphans))  # (their change was lost)
            inos = bite
            self._far_pending.update(self._far_of(inos))
        return inos

    def _xattr_bite(self, inos: list[int]) -> list[int]:
        """The first of `inos` whose xattrs come to XATTR_BITE bytes (one at least); the
        rest back at the head of the queue: their rows' delete, and its commit, run on
        the daemon's one thread (512 files of 256 KiB of xattrs each held it ~0.3 s).
        Their bytes are summed LENGTHS_BITE files at a time, up to the bite: summed for
        all 512 where a bite holds a few, the same rows were summed again every round
        (a user's 512 removed files of 256 xattrs each: 42 ms of the thread a round)."""
        total = 0
        for start in range(0, len(inos), LENGTHS_BITE):
            part = inos[start:start + LENGTHS_BITE]
            sizes = self.store.engine.lengths("xattrs", "ino", ("name", "value"), part)
            for n, ino in enumerate(part, start):
                total += sizes.get(ino, 0)
                if total > XATTR_BITE and n:
                    self.pending_reclaim.put_back(inos[n:])
                    return inos[:n]
        return inos

    def remove_chunks(self, inos: list[int]) -> None:
        """Blocking part of reclaim, safe in a worker thread (it touches no connection
        state): the committed orphans onto stable storage, then their chunk files.  A
        power cut may lose a commit that is not synced but keep the chunk files' removal,
        which would bring back a name whose bytes are gone."""
        if inos:
            self.store.sync()
        for ino in inos:
            self._remove_chunk_files(ino, self._far_pending.pop(ino, []))

    def renew_begun(self, ino: int) -> None:
        """(The loop.)  A renew of `ino` begins: see `renewals`."""
        if len(self.renewals) >= RENEWALS_KEPT and ino not in self.renewals:
            self.renewals.clear()
            self.renewals_cleared += 1
        self.renewals[ino] += 1

    def renew_mark(self, ino: int) -> tuple[int, int]:
        """What `renew_begun` changes for `ino`: an `open_read` compares it before its
        check and after its opens."""
        return self.renewals[ino], self.renewals_cleared

    def may_be_lent(self, ino: int) -> bool:
        """Whether readers may hold descriptors of the file's chunk files: lent since
        its chunk files were made, or made before this mount and not renewed since
        (whether an earlier daemon lent them is not known)."""
        return ino in self.lent or ino <= self.lent_through and ino not in self.renewed_old

    def needs_renew(self, node: Inode) -> bool:
        """Whether a change taking a right away must renew the file (`renew`): lent
        here, or striped over other nodes' members, whose own readers this node does
        not know of."""
        return self.may_be_lent(node.ino) or \
            bool(self.pool.far(self.layout(node).used_members()))

    def renew(self, node: Inode, room: int | None = None) -> None:
        """Blocking: before a lent file's access changes (chmod, chown), its chunk files
        are made anew and this node's own descriptors of them reopened: a reader's
        descriptors keep the bytes it was allowed to read, never what is written after
        it lost the right.  Other nodes' members first (`Pool.renew_far`, RENW): an
        owner that cannot be asked fails the change, and nothing here is renewed.  The
        old files are kept within `room` (what the owner's byte quota has left: each
        node's its own, so their sum may pass it by what one node keeps)."""
        owner = tenant_of(node.uid)  # (what is kept for readers counts as its user's)
        self.pool.renew_far(node.ino, self.layout(node).used_members(), owner, room)
        self.lent.discard(node.ino)  # (before: an open_read meanwhile marks it again)
        try:
            self.held.renew(node.ino, owner, room=room)
        except BaseException:  # (a member full, or failing: still lent, renewed at the
            self.lent.add(node.ino)  # next change; forgotten, a chmod tried again
            raise                    # changed the mode with no renew)
        finally:  # (members renewed before a failure: their new files, written from now)
            self._reopen(node.ino)
        if node.ino <= self.lent_through:
            self.renewed_old.add(node.ino)

    def renew_here(self, ino: int, owner: int, members: list[int], room: int | None = None
                   ) -> None:
        """Blocking: the writer's RENW of this node's `members` of `ino` (`renew`, on
        the node that holds them): its readers' descriptors end at what they held, and
        this node's own (a write through its mount) are reopened."""
        if self.held.renew(ino, owner, members, room):
            self._reopen(ino)

    def _reopen(self, ino: int) -> None:
        entry = self.open_inodes.get(ino)
        if entry is not None and entry.chunks is not None:
            entry.chunks.reopen()

    def _remove_chunk_files(self, ino: int, far: list[int]) -> None:
        """Blocking: an orphan's chunk files go; those someone still holds open (a
        direct reader, a KV get, a writer whose daemon died) go aside first, cut after
        a grace (`pool/revoke.Held.hold_read`): their space ends with the file.  They
        count as its owner's (as queued: a crash's orphans too, `queue_orphans`)."""
        self.lent.discard(ino)
        owner = tenant_of(self.freeing.owner(ino))
        self.held.hold_read(ino, owner)  # (its user's, on other nodes too)
        self.pool.remove_chunks(ino, far, owner)

    def _held_of(self, tenant: int) -> int:
        """Bytes of `tenant`'s uids' removed or renewed files kept readable (its quota
        counts them; they are kept by tenant: `renew`, `_remove_chunk_files`)."""
        return self.held.readable_of(lambda owner: owner == tenant)

    def caught(self, tenant: int,
               what: str = "wrote past the size it declared for an unpublished file"
               ) -> None:
        """(Any thread.)  `tenant` broke its word (`what`): its penalty begins (logged
        once), `vol/overdrafts.py`."""
        period = self.overdrafts.caught(tenant)
        if period:
            log.warning("uid %d %s: its unpublished files are revoked and its creates "
                        "refused for %d s", tenant, what, period)

    def _may_keep(self, tenant: int, nbytes: int) -> bool:
        """(Under the held files' lock.)  Whether `tenant` (a user, `vol/tenants.py`)
        may keep `nbytes` more of removed or renewed files readable for their readers."""
        return self.held.readable_by.get(tenant, 0) + nbytes <= self.max_held_per_user

    def past_nodes(self, inos: list[int], mark: int | None) -> list[int]:
        """Of orphans to free, those no reading node may hold open: `inos` (committed
        by feed row `mark`) wait until every live node told its holds past it
        (`vol/node_holds.py`); those waiting before that are ready now come along."""
        now = time.monotonic()
        if inos and mark is not None and self.reader_epochs:
            self.holds.wait(inos, mark, now)
            inos = []
        free, held = self.holds.ready(self.reader_epochs)
        self.freeing.drop(held)  # (held open on a node: queued again at its last close)
        self.held_orphans.update(held)
        behind = self.holds.behind(self.reader_epochs, now)
        if behind and not self.holds.stalled:
            log.warning("%d removed files wait to be freed until node(s) %s say which they "
                        "hold open (not heard from for %d s: check that they reach this "
                        "node's chunk service and the metadata server)",
                        self.holds.waiting, ", ".join(behind), STALL_S)
        self.holds.stalled = bool(behind)
        return inos + free

    def drop_inodes(self, inos: list[int]) -> None:
        self.store.drop_inodes(inos)
        self.freeing.drop(inos)

    def reclaim_pending(self, for_s: float | None = None) -> int:
        """Free the orphans queued (at unmount, by tools): bite after bite, each one
        commit, one sync and one change (one sync an orphan: ~3 ms each, an hour for
        a dropped KV namespace of a million chunks); with `for_s`, no bite begins after
        that many seconds.  How many are left queued (still orphan rows: the next
        mount frees them)."""
        end = None if for_s is None else time.monotonic() + for_s
        while (end is None or time.monotonic() < end) and \
                (inos := self.take_pending(PENDING_BITE)):
            self.remove_chunks(inos)
            self.drop_inodes(inos)
        return len(self.pending_reclaim)

    def resize(self, node: Inode, size: int) -> bool:
        """Set a file's size in the store, committed; True if it shrank: then the
        caller `cut`s its chunk files (from a worker thread) and tells `truncated`."""
        if not self.store.resize(node, size):
            return False
        self.store.commit()
        return True

    def cut(self, ino: int, layout: Layout, size: int,
            synced: Callable[[], None] | None = None) -> None:
        """Blocking: a shrunk file's chunk files cut to `size`, this node's and other
        nodes' (`Pool.truncate_far`, round trips), once its size is on stable storage
        (a crash mid-cut is trimmed again at mount, via dirty_data: a power cut must
        not keep the cut and lose the size).  `synced` puts the committed changes
        there: the daemon's sync shared by every request (`fs/meta_ops.SharedSync`),
        else the store's own."""
        (synced or self.store.sync)()
        self.pool.truncate_chunks(ino, layout, size)

    def truncated(self, node: Inode) -> None:
        """Every chunk file of `node` is cut to its size (windows read ahead of it
        before hold the bytes before: dropped)."""
        entry = self.open_inodes.get(node.ino)
        if entry is None:
            self.store.clear_dirty_data(node.ino)
        elif entry.chunks is not None:
            entry.chunks.drop_read_ahead()

    def lost_files(self, limit: int = 1000, store: MetaStore | None = None
                   ) -> tuple[int, list[str]]:
        """Files with bytes on a failed member: (how many, the first `limit` of their
        names), for `mxfs status` and the degraded mount's warning; read from `store`
        if given (a reader of its own, in a worker thread), else the pool's."""
        failed = {m.index for m in self.pool.failed}
        if not failed:
            return 0, []
        rows = store or self.store
        count = 0
        names: list[str] = []
        for f in list(files_with_data(rows)):
            lay = Layout(f.stripe_unit, f.stripe_width, f.first_member, len(self.pool.members))
            if lay.holding(f.size) & failed:
                count += 1
                if len(names) < limit:
                    names.append(display_name(rows, f.ino))
        return count, names

    # ---- mount-time recovery and checks ------------------------------------

    def recover(self, drain: bool = True) -> Recovery:
        """Reclaim orphans and trim chunk files past recorded sizes; mark the store in use.
        (A reading node repairs nothing: the pool is its writer node's to recover.  It
        takes over what its own members hold aside, as the writer does: a daemon that
        died within a grace left its readers' files there whole, for good.)

        Orphans are queued as removed files are (`queue_orphans`); with `drain` (tools)
        freed before this returns, in bites, else (the daemon) by its reclaim rounds
        once it serves: their number is a tenant's to choose (a dropped KV namespace of
        a million chunks), and a mount that freed them first outran systemd's start
        timeout and was killed and begun again for ever.  Serving first is safe: inode
        numbers come from a sequence and are never handed out again (`Engine.next_id`),
        so an orphan's chunk files stay its own until freed, and its row stays until
        then, so a crash meanwhile leaves it to the next mount."""
        if self.pool.node:
            self.held.adopt()
            return Recovery(unclean=False)
        report = Recovery(unclean=self.store.setting("clean") != "1")
        self.held.adopt()
        if self.restored_from is not None:
            # Files made after the backup have chunk files but no inode now: drop them,
            # or a later file given the same number would find their bytes.
            inodes = inode_numbers(self.store)
            for member, ino in self.pool.iter_chunks():
                if ino not in inodes:
                    unlink_cut(self.pool.chunk_path(member, ino))
        orphans = self.store.orphans()
        self.queue_orphans(orphans)
        report.orphans = len(orphans)
        if drain and not self.reader_epochs:  # (reading nodes may hold some open: freed
            self.reclaim_pending()  # once they told their holds again, by the daemon)
        for ino in self.store.dirty_data():
            node = self.store.get(ino)
            if node.is_reg:
                self.pool.truncate_chunks(ino, self.layout(node), node.size)
                report.trimmed.append(ino)
            self.store.clear_dirty_data(ino)
        self.store.set_setting("clean", "0")
        self.store.durable()
        if report.unclean or report.orphans:  # (after a clean stop, only files reading
            # nodes held open are left: no warning)
            log.log(logging.WARNING if report.unclean else logging.INFO,
                    "recovered pool %s: unclean=%s, %d orphans %s, %d files trimmed",
                    self.pool.uuid, report.unclean, report.orphans,
                    "freed" if drain else "to free while serving", len(report.trimmed))
        return report

    def sweep_strays(self, older_than_s: float) -> int:
        """(Blocking; a node holding members.)  Remove the chunk files on this node's
        members whose inode the pool no longer has and that nothing changed for
        `older_than_s` (written to, by this node's clock: at least ten minutes, so
        a writer whose commits stall a while keeps what it wrote); how many.  The
        writer removes a file's chunk files on other nodes through their owners, and an
        owner it could not reach then (dead, cut off) kept them.  Inode numbers are
        never reused, so a file without a row now never gets one; the age spares a file
        whose row the writer has not committed yet.  The rows are read on a connection
        of its own; a member that cannot be listed is left to the next sweep."""
        cutoff = time.time() - older_than_s
        with contextlib.closing(MetaStore.open(self.pool.meta_location, readonly=True)) \
                as store:
            inodes = inode_numbers(store)
        removed = 0
        for m in self.pool.local_members():
            try:
                found = self.pool.iter_chunks([m])
            except OSError as e:
                log.warning("member %d: its chunk files could not be listed (%s)", m, e)
                continue
            for member, ino in found:
                if ino in inodes:
                    continue
                path = self.pool.chunk_path(member, ino)
                try:
                    if os.stat(path).st_mtime > cutoff:
                        continue
                    unlink_cut(path)  # (any holder's descriptor keeps nothing)
                except FileNotFoundError:
                    continue
                removed += 1
        if removed:
            log.warning("removed %d chunk files of removed files from node %s's members "
                        "(their removal could not reach this node then)", removed,
                        self.pool.node)
        return removed

    def problems(self) -> list[str]:
        """Every broken invariant: the store's own, plus chunk files without a live file."""
        problems = [p.text for p in store_problems(self.store)]
        inodes = inode_numbers(self.store)
        for member, ino in self.pool.iter_chunks():
            if ino not in inodes:
                problems.append(f"chunk file of inode {ino} on member {member} has no inode")
        return problems

    def close(self, clean: bool = True) -> None:
        """Write everything back and mark the store clean (only after a clean unmount).
        A store made read-only (a daemon whose lease another host took) is left as is."""
        if self.keeper is not None:
            self.keeper.stop()
            self.keeper = None
        for remote, _ in self.owner_views:
            remote.close()
        if self.pool.node and self.lease is not None:
            try:
                with contextlib.closing(MetaStore.open(self.pool.meta_location)) as store:
                    lease.drop(store, self.lease, lease.node_key(self.pool.node))
            except OSError as e:  # it runs out by itself
                log.warning("the node's lease could not be given back (%s)", e)
            self.lease = None
        if self.store.readonly:
            self.open_inodes.clear()
            self.store.close()
            self.unlock()
            return
        for entry in list(self.open_inodes.values()):
            entry.count = 1
            self.release(entry.node.ino)
        self.pending_reclaim.push_all(self.spares.close(), 0)
        if not CLOSER.drain(CLOSE_DRAIN_S):  # (the pool's members let go of, as it ends)
            log.warning("%d descriptors of members' files are still closing (a member "
                        "that does not answer)", CLOSER.pending)
        # A few seconds of bites at most, none after a failed start or a crash of the
        # serving loop (a million queued held a stop past systemd's timeout, and a
        # failed start the pool's lock): those left stay orphan rows, which the next
        # mount frees; nor while nodes may hold some.  Leaving them is no unclean stop.
        if clean and not self.reader_epochs:
            left = self.reclaim_pending(CLOSE_DRAIN_S)
            if left:
                log.info("%d removed files left to free at the next mount", left)
        self.store.flush_all()
        if clean and self.checked:
            self.store.set_setting("clean", "1")
        self.store.durable()
        if self.lease is not None:
            try:
                lease.drop(self.store, self.lease)
            except OSError as e:  # it runs out by itself
                log.warning("the pool's lease could not be given back (%s)", e)
            self.lease = None
        self.store.close()
        self.unlock()


MEMBERS_KEY = "members"  # what the writer last said of its members, for reading nodes
STATS_KEY = "pool_stats"  # its members' space and the inode count (`publish_stats`)
STATS_FRESH_S = 5.0  # a reading node reads them at most this often
STATS_EVERY_S = 10.0  # the writer publishes them this often
KEY_ID_KEY = "key_id"  # the pool key's name (`pool.key.key_id`), for joining nodes


def owner_of(store: MetaStore, name: str | None = None) -> Owner | None:
    """The writer node, as its lease says (None: no writer); with `name`, the node of
    that name that holds members (None: it never joined)."""
    if name is None:
        held = lease.writer(store)
        if held is None:
            return None
        return Owner(held[0].name, held[0].addr, held[0].epoch, held[1])
    for n in lease.nodes(store):
        if n["name"] == name and n["role"] == "reader":
            return Owner(name, n["addr"], n["epoch"], n["state"] == "alive")
    return None


def owner_views(pool: Pool, key: bytes, names: list[str | None]
                ) -> list[tuple[RemoteMembers, str | None]]:
    """A `RemoteMembers` for each of `names` (None: the writer node), each reading its
    owner's lease again on one store connection of its own when it needs to (for the
    readers' threads)."""
    where = pool.meta_location
    lookups: list[MetaStore] = []
    lock = threading.Lock()

    def refresher(name: str | None) -> Callable[[], Owner | None]:
        def refresh() -> Owner | None:
            with lock:
                if not lookups:
                    try:
                        lookups.append(MetaStore.open(where, readonly=True))
                    except Unusable as e:  # (the server away: this read's EIO, not a bug)
                        raise OSError(errno.EIO, str(e)) from None
                try:
                    return owner_of(lookups[0], name)
                except OSError:
                    with contextlib.suppress(OSError):
                        lookups.pop().close()
                    raise
        return refresh

    return [(RemoteMembers(key, pool.uuid, refresher(name)), name) for name in names]


def join_owner(pool: Pool, store: MetaStore) -> list[tuple[RemoteMembers, str | None]]:
    """Name a reading node's members from the store (the writer node's, this node's
    own, other nodes'), and the services that read the others' (`pool/remote.py`)."""
    text = store.setting(MEMBERS_KEY)
    if text is None:
        raise MxfsError(f"pool {pool.uuid} has no members named in its metadata store",
                        "mount it once on its writer node (the one holding its members)")
    known = json.loads(text)
    count = int(known["count"])
    owners = [str(o) for o in known.get("owners") or [""] * count]
    writer = owner_of(store)
    others = sorted({o for o in owners if o and o != pool.node})
    views = owner_views(pool, read_key(pool.key_file), [None, *others])
    for remote, name in views:
        remote.update(owner_of(store, name))
        pool.remotes[remote.owner.node if remote.owner else name or "?"] = remote
    pool.remote = views[0][0]
    pool.name_members(owners, int(known["stripe_unit"]), writer.node if writer else "?")
    if pool.own_paths and pool.node not in owners:
        raise MxfsError(f"node {pool.node} names member folders, and the pool gives it no "
                        "member", "join again without --member, or make the pool with "
                        f"{pool.node}:PATH members")
    return views


def reach_owners(pool: Pool, store: MetaStore) -> None:
    """For a tool on this node (`mxfs scrub`): the chunk services of the nodes holding
    the members this node does not (`pool.remote_of`), as a mount reaches them."""
    if pool.node:
        join_owner(pool, store)
        return
    names = sorted({m.node for m in pool.members if m.node})
    if not names:
        return  # (a pool of one node's members: nothing to reach)
    for remote, name in owner_views(pool, load_key(pool.members[0].path), [*names]):
        remote.update(owner_of(store, name))
        pool.remotes[str(name)] = remote


def _served_elsewhere(holder: lease.Lease, now: float) -> MxfsError:
    """`now`: by the store's clock, as the lease's expiry is."""
    return MxfsError(f"the pool is mounted on {holder.describe()}; its lease runs "
                     f"{max(0.0, holder.expires - now):.0f} s more",
                     f"unmount it there (mxfs umount {holder.mountpoint}); if that node is "
                     "gone, mount again once the lease has run out")


def _recover_store(pool: Pool) -> str | None:
    """If the store is damaged, put the newest good backup in its place; say which.
    (A server's store is its operator's to recover.)"""
    if pool.meta_url:
        return None
    try:
        return backup.recover(pool.meta_dir, pool.uuid, pool.backup_dirs())
    except Unusable as e:
        raise MxfsError(str(e), "restore a dump: mxfs meta restore FILE POOL") from None
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise _full(e.strerror or "the metadata member is full") from None


def _open_store(pool: Pool, readonly: bool) -> tuple[MetaStore, str | None]:
    """The pool's store, opened, and the pool it says it is.  A local store that cannot
    be opened for an I/O error on a nearly full member is opened again with its reserve
    given back (`make_room`), and still failing there is "full", not "restore it from a
    backup" (a reading node's is on a server, read-only)."""
    where = location.public(pool.meta_location)
    local = None if pool.meta_url else os.path.join(pool.meta_dir, DB_NAME)
    for again in (False, True):
        try:
            store = MetaStore.open(pool.meta_location, readonly=readonly)
            try:
                return store, store.setting("pool_uuid")
            except BaseException:
                store.close()
                raise
        except (Unusable, OSError) as e:
            if local is not None and _io_failure(e):
                if again and Reserve(local).short():
                    raise _full(f"the metadata member of {where} is full") from None
                if not again and make_room(local):
                    continue
            raise MxfsError(f"metadata store in {where} cannot be opened ({e})",
                            "restore it from a backup (mxfs meta restore)") from None
    raise AssertionError("unreachable")


def _io_failure(e: Exception) -> bool:
    """An open that failed for its storage (no room, an I/O error), not its contents."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)
    text = str(e)
    return any(s in text for s in ("disk I/O error", "disk is full", "unable to open"))


def _full(what: str) -> MxfsError:
    """A store that cannot be opened because its member is full (not damaged)."""
    return MxfsError(f"{what}: its store cannot be opened", "free space on it (remove "
                     "files there that are not the pool's, or grow it); the store is left "
                     "as it is")


def tighten(pool: Pool) -> None:
    """Make the store, its lock and its backups root's alone: 0700 folders, 0600 files.

    They hold every file name and xattr of the pool, whatever the modes of its
    directories; pools made by older versions (0755/0644) are fixed here.
    """
    for folder in [pool.meta_dir, *pool.backup_dirs()]:
        backup.private(folder)

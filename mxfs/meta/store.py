"""The namespace rules, written once above the engine primitives (`meta/engine.py`).

Every namespace change is one engine change (`txn`), so a crash never leaves an
entry pointing nowhere nor an unreachable inode holding space: an inode whose last
link goes is listed in `orphans` in the same change, and its data is reclaimed when
it is no longer open (or at the next mount, if the daemon died).  A change reads
what it decides on inside itself, so an engine may run it again after a conflict.

The daemon keeps the inodes it touches in memory; data attributes (size, times)
that writes change are held there and written back on flush, fsync and release
("dirty"), while namespace fields are written through at once, by typed setters
only.  What a change did to memory is journaled and put back if the change fails,
and the journals of a group's changes are kept until it commits: a group the engine
loses (a conflict, a full or lost server) puts memory back to the last commit, so
cached inodes, open files' among them, never run ahead of the rows.

Only the pool's one writer, a daemon while it holds the lease (`sole_writer`), answers
inodes from memory; a store beside other writers (tools, several processes, another
node) reads an inode's row at every `get`, into the object it holds, so no change
writes back a field another writer changed since it was cached.  The sole writer also
keeps names, seals and the inode count (`meta/sole_cache.py`), so the kernel's lookup before
an unlink, a rename or a create spares the change its reads.  The rows check what the
cache says: a change removes or moves an entry only where it still names the inode it
was read to name (`expect`), and a taken name fails its insert, so a cached read
another writer made stale conflicts, and the change runs again on fresh reads; a
change that fails after a cached read is run once more without the cache, so a
failure is never the cache's alone.  A directory's times are written once per group
of changes, as it commits (`_touch_dir`).

Inodes whose chunk files may run past the recorded size are listed in `dirty_data`,
so a mount after a crash can trim them.
"""

from __future__ import annotations

import errno
import logging
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from mxfs.meta import location
from mxfs.meta.engine import Conflict, Engine, fail
from mxfs.meta.feed_notes import Noted
from mxfs.meta.inode import ROOT_INO, Entry, Inode, LayoutPicker
from mxfs.meta.inode_cache import InodeCache
from mxfs.meta.kv_rows import KVRows
from mxfs.meta.names import check_name
from mxfs.meta.schema import INODE_COLUMNS
from mxfs.meta.sole_cache import SoleCache
from mxfs.meta.usage import NAME_ROW, Usage, charged_size, xattr_cost

log = logging.getLogger("mxfs.meta")

T = TypeVar("T")
Owned = tuple[int, int]  # (xattr bytes, bytes of the names in it) of one inode: what a
#                           chown moves (names are their directory's owner's)
_CACHE_LIMIT = 200_000  # inodes memory holds past those it must keep (`_evict`)
LOAD_BITE = 64  # inodes a readdir page reads at a time (`readdir_page`)
_EVICT_LOOK = 8  # of the least recently used, looked at per inode read in past the limit
LINK_MAX = 65_000  # hard links to one file (ext4's bound; each name is charged to
#                     the owner of the directory it is in, not the file's: `_charge_name`)
MAX_DEPTH = 1024  # levels a rename's ancestry walk goes up at most (ELOOP past them:
#                   a refused walk, run again on fresh rows, reads as many)
_BORN = ""  # journal mark: an inode made by the change (dropped from memory on undo)
_XATTRS = "\0xattrs"  # journal mark: (uid, bytes) added to a uid's xattr tally
_NAMES = "\0names"  # ... and to its names' tally


class MetaStore:
    """The pool's namespace over one engine connection; one per daemon or tool."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # The inodes in memory, least recently used first (`_evict`).
        self._cache = InodeCache()
        # Inodes held open (the volume's handles hold these objects): never dropped from
        # memory, or a later change would go to a copy the handle never sees (a trim
        # at the limit split one inode in two: a size written back, an unlink unseen).
        self.held: Callable[[int], bool] = lambda ino: False
        self._journal: list[tuple[Inode, str, object]] = []
        self._group_journal: list[tuple[Inode, str, object]] = []  # of the open group
        # (directory, name) -> its inode, or None: no such entry
        self._sole = SoleCache()  # names, seals, the inode count (`sole_writer`)
        engine.on_group_lost = self._group_lost
        engine.before_commit = self._before_commit
        # Told when no group is open (all committed): the pool's metadata room counts
        # what the open group will write at its commit until then.
        self.on_settled: Callable[[], None] = lambda: None
        self._dir_times: dict[int, Inode] = {}  # directories whose times wait for commit
        # Groups of changes lost so far: an fsync that has not heard of a loss since
        # its handle last synced must fail, as the loss may have held its changes.
        self.groups_lost = 0
        self.kv = KVRows(self)
        self.usage = Usage()  # bytes and inodes by uid, once counted (`count_usage`)
        self.follow = False  # another node writes the rows: inodes are read afresh (`get`)
        # What each group changed, published as it commits (`meta/change_feed.py`): set
        # on a writer whose pool other nodes may mount.
        self.feed: Noted | None = None
        # Inodes whose names and xattrs a chown is measuring off the thread (`owned`),
        # with the changes to them since (`watch_owned`).
        self._watched: dict[int, int] = {}
        self._owned_changed: set[int] = set()  # ... and whose the open group changed
        self._kv_changed: set[str] = set()  # KV namespaces the open group changed

    # ---- lifecycle -------------------------------------------------------

    @classmethod
    def format(cls, where: str, pool_uuid: str, stripe_unit: int,
               root_uid: int = 0, root_gid: int = 0) -> MetaStore:
        """Make a fresh store at `where` with an empty root directory."""
        store = cls(location.create(where))

        def init() -> None:
            e = store.engine
            e.upsert("settings", {"key": "pool_uuid", "value": pool_uuid})
            e.upsert("settings", {"key": "clean", "value": "1"})
            ino = e.next_id("ino")
            if ino != ROOT_INO:
                raise fail(errno.EIO, f"a fresh store numbered its root {ino}")
            now = time.time_ns()
            e.insert("inodes", dict(zip(INODE_COLUMNS, (
                ROOT_INO, stat.S_IFDIR | 0o755, root_uid, root_gid, 2, 0, now, now, now, 0,
                None, stripe_unit, None, None, 0), strict=True)))
        store.txn(init)
        store.engine.durable()
        return store

    @classmethod
    def open(cls, where: str, readonly: bool = False) -> MetaStore:
        """The store at `where` (`location.connect`); `Unusable` if it cannot serve."""
        return cls(location.connect(where, readonly=readonly))

    @property
    def readonly(self) -> bool:
        """Changes are refused: opened read-only, or fenced (`Engine.fenced`)."""
        return self.engine.readonly or self.engine.fenced is not None

    def close(self) -> None:
        self.engine.close()

    def setting(self, key: str) -> str | None:
        row = self.engine.get("settings", {"key": key}, ("value",))
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        self.txn(lambda: self.engine.upsert("settings", {"key": key, "value": value}))

    def drop_setting(self, key: str) -> None:
        self.txn(lambda: self.engine.delete("settings", {"key": key}))

    def settings(self, prefix: str) -> list[tuple[str, str]]:
        """(key, value) of every setting whose key starts with `prefix`."""
        return [(k, v) for k, v in self.engine.scan("settings", ("key", "value"))
                if k.startswith(prefix)]

    # ---- changes ---------------------------------------------------------

    def txn(self, fn: Callable[[], T]) -> T:
        """Run `fn` as one atomic change (inside an open one: as part of it).  If it
        fails, or the engine runs it again after a conflict, what it did to cached
        inodes is put back first."""
        if self.engine.in_change:
            return fn()
        self._journal.clear()
        self._sole.begin()
        if self.feed is not None:
            self.feed.mark()
        try:
            try:
                result = self.engine.txn(fn, undo=self._undo_memory)
            except OSError as e:
                if not self._sole.hit or e.errno == errno.ELOOP:  # (a walk too deep is
                    raise  # as deep read afresh: it ran twice, from memory, then rows)
                self._sole.drop_read(e.errno or 0)
                self._sole.begin()  # its cached answers are dropped: fresh reads now
                result = self.engine.txn(fn, undo=self._undo_memory)
            self._group_journal += self._journal
            self._settled()
            return result
        finally:
            self._journal.clear()
            self._sole.begin()

    def _settled(self) -> None:
        """After a commit may have happened: a committed group's journal is spent."""
        if self.engine.group_age() is None:
            self._group_journal.clear()
            self._kv_changed.clear()
            self._owned_changed.clear()
            if self.feed is not None:
                self.feed.settled()
            self.on_settled()

    def _undo_memory(self) -> None:
        self._sole.undo(births=sum(1 for _, name, _ in self._journal if name == _BORN))
        if self.feed is not None:
            self.feed.undo()
        self._put_back(self._journal)

    def _put_back(self, journal: list[tuple[Inode, str, object]]) -> None:
        # (A journaled inode that memory let go of since (`_evict`) and read again from
        # the rows the change wrote is another object now: it is put back too, or it
        # kept what the rows no longer hold; made by the change, it goes.)
        cache = self._cache
        for node, name, old in reversed(journal):
            now = cache.get(node.ino)
            if name == _BORN:
                if now is node or now is not None and not self.held(node.ino):
                    del cache[node.ino]
                self.usage.add(node.uid, node.mode, node.size, -1)
            elif name == _XATTRS:
                assert isinstance(old, tuple)
                self.usage.add_xattrs(old[0], -old[1])
            elif name == _NAMES:
                assert isinstance(old, tuple)
                self.usage.add_names(old[0], -old[1])
            else:
                self.usage.change(node, name, old)
                setattr(node, name, old)
                if now is not None and now is not node:
                    setattr(now, name, old)
        journal.clear()

    def _group_lost(self) -> None:
        """The engine dropped a whole group: memory back to the last commit (the change
        running, then the group's earlier ones), clean inodes read again from the rows."""
        self._put_back(self._journal)
        self._put_back(self._group_journal)
        self._forget_clean()
        self._sole.forget()
        self._dir_times.clear()
        self.usage.forget()
        for ino in self._watched:  # (what was measured may be what the group undid)
            self._watched[ino] += 1
        if self.feed is not None:
            self.feed.lose()
        self.groups_lost += 1

    def group_changes(self, max_age: float) -> None:
        """Group changes into engine transactions ended at most `max_age` seconds after
        their first change (the daemon calls `commit_if_due`), on fsync, and before
        anything touches chunk files.  Tools leave it off: each change commits."""
        self.engine.group(max_age)

    def commit_if_due(self) -> None:
        self.engine.commit_if_due()
        self._settled()

    def commit(self) -> None:
        """Every change so far committed (not yet on stable storage: `sync`).  A group
        another writer's conflict undid is EBUSY here: its changes cannot be run again."""
        try:
            self.engine.commit()
        except Conflict as e:
            raise fail(errno.EBUSY, f"a group of changes conflicted with another writer "
                       f"and was lost ({e})") from None
        self._settled()

    def sync(self) -> None:
        """Put every committed change on stable storage.  Blocking; touches no
        connection state, so a worker thread may run it."""
        self.engine.sync()

    def durable(self) -> None:
        """Commit and sync: every change so far survives a crash."""
        self.commit()
        self.engine.sync()

    def watch_space(self) -> bool:
        """Called now and then by the daemon; True while the store's storage is nearly
        full (the daemon then cuts back writers that wrote past their declared sizes)."""
        return self.engine.watch_space()

    # ---- inodes ----------------------------------------------------------

    def get(self, ino: int) -> Inode:
        """The inode, from memory when it is there and no one else writes the rows (the
        sole writer, `sole_writer`); otherwise (a follower, `follow`, or a store beside
        other writers: tools, several processes) its row is read every time, into the
        object it already holds (unless memory holds data fields not yet written,
        `dirty`), so open handles see what the others made of it, and a change never
        writes back fields another writer changed since they were cached (a link count
        was lost so)."""
        cache = self._cache
        node = cache.get(ino)
        if node is not None:
            try:
                cache.move_to_end(ino)  # (the most recently used: the last to go)
            except KeyError:  # (let go of meanwhile by a store reading beside this one)
                node = None
            else:
                if node.dirty or self._sole.on and not self.follow:
                    return node
        row = self.engine.get("inodes", {"ino": ino}, INODE_COLUMNS)
        if row is None:
            if node is not None:
                cache.pop(ino, None)
            raise fail(errno.ENOENT)
        if node is None:
            # (setdefault: a store reading beside this one (`read_beside`) may have
            # made it meanwhile; every holder must have the one object)
            node = cache.setdefault(ino, Inode(*row))
            if cache.over(_CACHE_LIMIT):
                self._evict()
        for name, value in zip(INODE_COLUMNS, row, strict=True):
            setattr(node, name, value)
        return node

    def _evict(self) -> None:
        """Memory past `_CACHE_LIMIT` inodes (or their symlink targets past
        `inode_cache.TARGET_BYTES`): the least recently used let go of, a few
        for each inode read in (so memory stays at the limit), those with unsaved changes
        (`dirty`) or held open kept and moved to the recent end.  A pass over them all at
        the limit held the daemon's one thread 160-240 ms for 200,000 inodes, and any
        user's walk of her tree came back to it."""
        cache, held = self._cache, self.held
        for _ in range(_EVICT_LOOK):
            if not cache.over(_CACHE_LIMIT):
                return
            try:
                ino = next(iter(cache))
            except (StopIteration, RuntimeError):  # (empty, or changed meanwhile by a
                return                             # store reading beside this one)
            node = cache.get(ino)
            if node is None:
                continue
            if node.dirty or held(ino):
                try:
                    cache.move_to_end(ino)
                except KeyError:
                    pass
            else:
                cache.pop(ino, None)

    def _forget_clean(self) -> None:
        """Forget every inode with no unsaved change and not held open, in place (the
        dict may be shared): after a lost group, whose rows memory may have read."""
        for ino, node in list(self._cache.items()):
            if not node.dirty and not self.held(ino):
                self._cache.pop(ino, None)

    def read_beside(self, main: MetaStore) -> None:
        """Read the rows afresh (`follow`) into `main`'s inodes: this store's connection
        serves a follower daemon's reads from a worker thread (`fs/store_worker.py`),
        and what it reads is what the daemon's handles and handlers hold.  Only for a
        follower: its inodes are never changed here, only refreshed from the rows."""
        self.follow = True
        self._cache = main._cache
        self.held = lambda ino: main.held(ino)  # (the main store's handles' objects)

    def write_fields(self, node: Inode, values: dict[str, object],
                     owned: Owned | None = None) -> None:
        """Write fields of an inode row and of its cached object (inside a change);
        `owned`: what a chown moves, as measured (`owned`), else read here."""
        assert self.engine.in_change
        journal = self._journal
        if self.feed is not None:
            self.feed.ino(node.ino, data="size" in values or "mtime_ns" in values)
        for name, value in values.items():
            journal.append((node, name, getattr(node, name)))
            if name == "uid" and value != node.uid and self.usage.counted:
                assert isinstance(value, int)  # (a chown takes its xattrs, a
                #                                directory's chown the names in it too)
                moved, named = owned if owned is not None else self.owned(node.ino)
                self._charge_xattrs(node, node.uid, -moved)
                self._charge_xattrs(node, value, moved)
                self._charge_names(node, node.uid, -named)
                self._charge_names(node, value, named)
            self.usage.change(node, name, value)
            setattr(node, name, value)
        self.engine.patch("inodes", {"ino": node.ino}, values)

    def _data_fields(self, node: Inode) -> dict[str, object]:
        """What memory holds of a dirty inode's data fields, written back now."""
        if not node.dirty:
            return {}
        self._journal.append((node, "dirty", True))
        node.dirty = False
        return {"size": node.size, "atime_ns": node.atime_ns, "mtime_ns": node.mtime_ns,
                "ctime_ns": node.ctime_ns}

    def touch(self, node: Inode, *, size: int | None = None, atime_ns: int | None = None,
              mtime_ns: int | None = None, ctime_ns: int | None = None) -> None:
        """Data attributes that writes and reads change: held in memory, written back by
        `flush` (and by any change to the inode)."""
        if size is not None:
            self.usage.change(node, "size", size)
            node.size = size
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        if ctime_ns is not None:
            node.ctime_ns = ctime_ns
        node.dirty = True

    def set_attrs(self, node: Inode, *, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None, atime_ns: int | None = None,
                  mtime_ns: int | None = None, ctime_ns: int | None = None,
                  owned: Owned | None = None) -> None:
        """Change attributes now (chmod, chown, utimens); data fields memory held are
        written back in the same change.  One that may take someone's right to read a
        file away gives it a new generation: the connections other nodes' readers were
        handed for it (scoped to a generation: `fs/chunk_service.py`) read no more.
        `owned`: the file's xattrs and names as measured off the thread for a chown
        (`watch_owned`), else read here."""
        def change() -> None:
            values = self._data_fields(node)
            if node.is_reg and node.takes_read(mode, uid, gid):
                values["generation"] = node.generation + 1
            for name, value in (("mode", mode), ("uid", uid), ("gid", gid),
                                ("atime_ns", atime_ns), ("mtime_ns", mtime_ns),
                                ("ctime_ns", ctime_ns)):
                if value is not None:
                    values[name] = value
            if values:
                self.write_fields(node, values, owned)
        self.txn(change)

    def set_layout(self, node: Inode, unit: int, width: int) -> None:
        """A directory's default layout, or an empty file's own."""
        self.txn(lambda: self.write_fields(node, {"stripe_unit": unit, "stripe_width": width}))

    def begin_write(self, node: Inode, dirty_data: bool = True) -> None:
        """Before the first write of an open: direct readers see a new generation, and
        the chunk files may now outgrow the recorded size (`dirty_data`: not for a file
        another node writes through its mount, whose chunk files that node keeps to
        the size it last told)."""
        def change() -> None:
            self.write_fields(node, {"generation": node.generation + 1})
            if dirty_data:
                self.mark_dirty_data(node.ino)
        self.txn(change)

    def resize(self, node: Inode, size: int) -> bool:
        """Set a file's size now (a new generation); True if it shrank, in which case the
        file is in `dirty_data` until its chunk files are cut."""
        def change() -> bool:
            shrink = size < node.size
            if shrink:
                self.mark_dirty_data(node.ino)
            self.write_fields(node, {"size": size, "generation": node.generation + 1})
            return shrink
        return self.txn(change)

    def flush(self, node: Inode) -> None:
        if node.dirty:
            self.txn(lambda: self.write_fields(node, self._data_fields(node)))

    def flush_all(self) -> None:
        # (a snapshot first, in one call: on a reading node a worker thread's reads
        # reorder the shared cache, and an OrderedDict refuses any change mid-iteration)
        dirty = [n for n in list(self._cache.values()) if n.dirty]
        if dirty:
            def change() -> None:
                for n in dirty:
                    self.write_fields(n, self._data_fields(n))
            self.txn(change)

    def forget(self, ino: int) -> None:
        node = self._cache.get(ino)
        if node is not None and not node.dirty:
            self._cache.pop(ino, None)

    def count_inodes(self) -> int:
        """How many inodes the pool holds.  A sole writer counts the rows once and then
        keeps count (statfs asks for it, and a count is a scan of every row); after a
        failed change or a lost group it counts again."""
        if self._sole.inodes is not None:
            return self._sole.inodes
        n = self.engine.count("inodes")
        self._sole.counted(n)
        return n

    def inode_exists(self, ino: int) -> bool:
        """Asked of the rows, not memory (for readers beside the daemon)."""
        return self.engine.get("inodes", {"ino": ino}, ("ino",)) is not None

    # ---- namespace -------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Inode:
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self.parent_of(parent))
        ino = self.entry_ino(parent, name)
        if ino is None:
            raise fail(errno.ENOENT)
        return self.get(ino)

    def parent_of(self, dir_ino: int) -> int:
        if dir_ino == ROOT_INO:
            return ROOT_INO
        cached = self._sole.parent(dir_ino, self.engine.in_change)
        if cached is not None:
            return cached
        row = self.engine.get("dentries", {"ino": dir_ino}, ("parent",))
        if row is None:
            raise fail(errno.ENOENT)
        self._sole.learn_parent(dir_ino, int(row[0]))
        return int(row[0])

    def sole_writer(self, on: bool) -> None:
        """No other writer changes the rows from now on (a daemon holding the pool's
        lease), so names and seals are cached; or that no longer holds."""
        self._sole.on = on
        self._sole.forget()
        self.engine.sole_writer(on)

    def entry_ino(self, parent: int, name: bytes) -> int | None:
        """The inode `name` in `parent` names (None: no such entry), from the cache when
        it has the name."""
        key = (parent, name)
        known, ino = self._sole.name(key, self.engine.in_change)
        if known:
            return ino
        row = self.engine.get("dentries", {"parent": parent, "name": name}, ("ino",))
        ino = row[0] if row else None
        self._name(key, ino)
        return ino

    def _name(self, key: tuple[int, bytes], ino: int | None) -> None:
        """Cache what `key` names (noted inside a change: dropped if it fails)."""
        self._sole.set_name(key, ino, self.engine.in_change)

    def _dir(self, ino: int) -> Inode:
        node = self.get(ino)
        if not node.is_dir:
            raise fail(errno.ENOTDIR)
        if node.nlink == 0:
            raise fail(errno.ENOENT)
        return node

    def _add_entry(self, parent: int, name: bytes, ino: int) -> None:
        """(Callers looked the name up in the change: a taken one is EEXIST there, or,
        taken meanwhile by another writer, EEXIST or a conflict by the change's end.)"""
        cookie = self.engine.next_id("dentry")
        self.engine.put("dentries", {"id": cookie, "parent": parent, "name": name, "ino": ino})
        self._name((parent, name), ino)
        self._entry_changed(parent, name)
        self._charge_name(parent, len(name))

    def _remove_entry(self, parent: int, name: bytes, ino: int) -> None:
        """(`ino`: what the change read the entry to name; if it names another now, or
        is gone, the change conflicts and runs again.)"""
        self.engine.remove("dentries", {"parent": parent, "name": name, "ino": ino},
                           expect=True)
        self._name((parent, name), None)
        self._entry_changed(parent, name)
        self._charge_name(parent, -len(name))

    def _move_entry(self, parent: int, name: bytes, ino: int, new_parent: int,
                    new_name: bytes) -> None:
        self.engine.patch("dentries", {"parent": parent, "name": name, "ino": ino},
                          {"parent": new_parent, "name": new_name}, expect=True)
        self._name((parent, name), None)
        self._name((new_parent, new_name), ino)
        self._entry_changed(parent, name)
        self._entry_changed(new_parent, new_name)
        if new_parent == parent:
            self._charge_name(parent, len(new_name) - len(name), rows=0)
        else:
            self._charge_name(parent, -len(name))
            self._charge_name(new_parent, len(new_name))

    def _point_entry(self, parent: int, name: bytes, ino: int, new_ino: int) -> None:
        """The entry that names `ino` names `new_ino` instead (its name, and who is
        charged it, stay)."""
        self.engine.patch("dentries", {"parent": parent, "name": name, "ino": ino},
                          {"ino": new_ino}, expect=True)
        self._name((parent, name), new_ino)
        self._entry_changed(parent, name)

    def _charge_name(self, parent: int, nbytes: int, rows: int | None = None) -> None:
        """The owner of directory `parent` is charged a name in it of `nbytes` more
        (less, if negative) and its row (`rows`: that many rows; by default one more,
        or one fewer).  A name is the cost of whoever owns the directory it is in, as
        ext4 charges a directory's blocks: were it the file's owner's, anyone could
        spend a user's quota by linking her file from a folder of his, which she
        cannot clean up; a directory's owner can always remove the names in it."""
        self._owned_moved(parent)
        if not self.usage.counted:
            return
        d = self.get(parent)
        if rows is None:
            rows = 1 if nbytes >= 0 else -1
        self._charge_names(d, d.uid, nbytes + rows * NAME_ROW)

    def charge_key(self, node: Inode, nbytes: int) -> None:
        """(Inside a change.)  KV chunk `node`'s key row stored (`nbytes`: its
        `usage.key_cost`) or removed (less): charged to the chunk's writer, its inode's
        owner, as a name is to its folder's (a user put 5,000 chunks with 1 KiB keys, 44
        MB of the store, charged nothing)."""
        self._owned_moved(node.ino)
        self._charge_names(node, node.uid, nbytes)

    def _charge_names(self, node: Inode, uid: int, delta: int) -> None:
        """Add `delta` bytes to `uid`'s names tally, put back if the change fails."""
        if delta and self.usage.counted:
            self.usage.add_names(uid, delta)
            self._journal.append((node, _NAMES, (uid, delta)))

    def _touch_dir(self, d: Inode, now: int, nlink_delta: int = 0) -> None:
        """A directory's times (and link count) after a change of its entries.  In a
        group the times alone are held in memory and written once, as the group
        commits: one statement a group, not one a change (a server runs each)."""
        if nlink_delta or not self.engine.grouped:
            values = {**self._data_fields(d), "mtime_ns": now, "ctime_ns": now}
            if nlink_delta:
                values["nlink"] = d.nlink + nlink_delta
            self.write_fields(d, values)
            return
        self._journal += [(d, "mtime_ns", d.mtime_ns), (d, "ctime_ns", d.ctime_ns),
                          (d, "dirty", d.dirty)]
        d.mtime_ns = d.ctime_ns = now
        d.dirty = True  # (kept in memory until written)
        self._dir_times[d.ino] = d

    def _entry_changed(self, parent: int, name: bytes) -> None:
        if self.feed is not None:
            self.feed.name(parent, name)

    def note_kv(self, what: int, ns: str, key: bytes = b"") -> None:
        """Inside a change: a KV key stored or removed, or a namespace gone, for the
        change feed (`meta/feed_notes.py`)."""
        self._kv_changed.add(ns)
        if self.feed is not None:
            self.feed.kv(what, ns, key)

    def kv_uncommitted(self, ns: str) -> bool:
        """Whether the open group changed namespace `ns`'s KV rows: a connection of
        another's (a worker's) would not see those rows till it commits."""
        return ns in self._kv_changed

    def _before_commit(self) -> None:
        """As a group commits: the directory times it held, then what it changed."""
        self._write_dir_times()
        feed = self.feed
        if feed is None or self.readonly:
            return
        change = feed.take()
        if change is not None:  # (in the group's transaction, which is open)
            self.engine.publish(feed.row(change), feed.channel)

    def _write_dir_times(self) -> None:
        """Before a group commits: the times of the directories its changes touched."""
        dirs, self._dir_times = self._dir_times, {}
        live = [d for d in dirs.values() if d.dirty]
        if not live or self.readonly:  # (a daemon whose lease went writes nothing)
            return

        def change() -> None:
            for d in live:
                self.write_fields(d, self._data_fields(d))
        try:
            self.txn(change)
        except BaseException:
            if self.engine.group_age() is not None:  # (the group lives: written later)
                self._dir_times.update(dirs)
            raise

    def _insert_inode(self, parent: Inode, mode: int, uid: int, gid: int, nlink: int,
                      now: int, rdev: int = 0, target: bytes | None = None,
                      layout_for: LayoutPicker | None = None) -> Inode:
        """A new inode row (inside a change); files get `layout_for`'s layout."""
        ino = self.engine.next_id("ino")
        unit, width, first = parent.stripe_unit, parent.stripe_width, None
        if stat.S_ISREG(mode):
            assert layout_for is not None
            unit, width, first = layout_for(ino, unit, width)
        node = Inode(ino, mode, uid, gid, nlink, len(target) if target else 0, now, now, now,
                     rdev, target, unit, width, first)
        self.engine.put("inodes", {c: getattr(node, c) for c in INODE_COLUMNS})
        self._cache[ino] = node
        if self._cache.over(_CACHE_LIMIT):
            self._evict()
        self._journal.append((node, _BORN, None))
        self._sole.born()
        self.usage.add(uid, mode, node.size)
        return node

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
               rdev: int = 0, target: bytes | None = None,
               layout_for: LayoutPicker | None = None) -> Inode:
        """Make a new inode and its entry; a regular file gets `layout_for`'s layout."""
        check_name(name)
        is_dir = stat.S_ISDIR(mode)

        def change() -> Inode:
            d = self._dir(parent)
            if self.entry_ino(parent, name) is not None:
                raise fail(errno.EEXIST)
            now = time.time_ns()
            node = self._insert_inode(d, mode, uid, gid, 2 if is_dir else 1, now, rdev,
                                      target, layout_for)
            self._add_entry(parent, name, node.ino)
            self._touch_dir(d, now, 1 if is_dir else 0)
            if is_dir:
                self._sole.made_dir(node.ino, parent)
            return node
        return self.txn(change)

    def create_hidden(self, parent: int, mode: int, uid: int, gid: int,
                      layout_for: LayoutPicker) -> Inode:
        """A regular file with no entry yet (a direct write before its commit).

        It is an orphan from birth, so a crash before `publish` reclaims it.
        Its layout comes from `parent`, the directory it will be published in.
        """
        def change() -> Inode:
            d = self._dir(parent)
            node = self._insert_inode(d, stat.S_IFREG | stat.S_IMODE(mode), uid, gid, 0,
                                      time.time_ns(), layout_for=layout_for)
            self.engine.put("orphans", {"ino": node.ino})
            self._seal_known(node.ino, False)
            return node
        return self.txn(change)

    def publish(self, ino: int, parent: int, name: bytes, *, replace: bool, size: int,
                sum_unit: int, sums: bytes) -> Inode | None:
        """Give a hidden file its size, its entry and its seal (checksums, xxh3-64 per
        `sum_unit` bytes) in one change, atomically replacing what was there if
        `replace` (EEXIST otherwise: the first writer wins).

        Returns the replaced inode when that was its last link (now an orphan).
        """
        check_name(name)

        def change() -> Inode | None:
            d = self._dir(parent)
            node = self.get(ino)
            if node.nlink != 0:
                raise fail(errno.EINVAL, f"inode {ino} is already published")
            old_ino = self.entry_ino(parent, name)
            old = self.get(old_ino) if old_ino is not None else None
            now = time.time_ns()
            if old is not None:
                if not replace:
                    raise fail(errno.EEXIST)
                if old.is_dir:
                    raise fail(errno.EISDIR)
                self._remove_entry(parent, name, old.ino)
                self.drop_link(old, now)
            self._add_entry(parent, name, ino)
            self.engine.remove("orphans", {"ino": ino})
            self.write_fields(node, {"nlink": 1, "size": size, "ctime_ns": now, "mtime_ns": now})
            self.seal(ino, sum_unit, sums)
            self._touch_dir(d, now)
            return old if old is not None and old.nlink == 0 else None
        return self.txn(change)

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        check_name(name)

        def change() -> Inode:
            d = self._dir(parent)
            node = self.get(ino)
            if node.is_dir:
                raise fail(errno.EPERM)
            if node.nlink == 0:
                raise fail(errno.ENOENT)
            if node.nlink >= LINK_MAX:  # (as ext4)
                raise fail(errno.EMLINK)
            if self.entry_ino(parent, name) is not None:
                raise fail(errno.EEXIST)
            now = time.time_ns()
            self._add_entry(parent, name, ino)
            self.write_fields(node, {"nlink": node.nlink + 1, "ctime_ns": now})
            self._touch_dir(d, now)
            return node
        return self.txn(change)

    def drop_link(self, node: Inode, now: int) -> None:
        """One link fewer; at zero the inode becomes an orphan awaiting reclaim."""
        nlink = 0 if node.is_dir else max(node.nlink - 1, 0)
        self.write_fields(node, {"nlink": nlink, "ctime_ns": now})
        if nlink == 0:
            self.engine.upsert("orphans", {"ino": node.ino})  # (unless it is one)

    def unlink(self, parent: int, name: bytes) -> Inode:
        """Remove a non-directory entry; returns the inode (nlink 0: now an orphan)."""
        def change() -> Inode:
            d = self._dir(parent)
            ino = self.entry_ino(parent, name)
            if ino is None:
                raise fail(errno.ENOENT)
            node = self.get(ino)
            if node.is_dir:
                raise fail(errno.EISDIR)
            now = time.time_ns()
            self._remove_entry(parent, name, ino)
            self.drop_link(node, now)
            self._touch_dir(d, now)
            return node
        return self.txn(change)

    def _is_empty(self, ino: int) -> bool:
        return next(self.engine.scan("dentries", ("id",), {"parent": ino}, limit=1),
                    None) is None

    def rmdir(self, parent: int, name: bytes) -> Inode:
        def change() -> Inode:
            d = self._dir(parent)
            ino = self.entry_ino(parent, name)
            if ino is None:
                raise fail(errno.ENOENT)
            node = self.get(ino)
            if not node.is_dir:
                raise fail(errno.ENOTDIR)
            if not self._is_empty(ino):
                raise fail(errno.ENOTEMPTY)
            now = time.time_ns()
            self._remove_entry(parent, name, ino)
            self.drop_link(node, now)
            self._touch_dir(d, now, -1)
            self._sole.set_parent(ino, None)
            return node
        return self.txn(change)

    def _is_ancestor(self, ancestor: int, ino: int) -> bool:
        """Whether `ancestor` is `ino` or above it; ELOOP past MAX_DEPTH levels (a walk
        of a million levels held the thread for each rename into the deepest)."""
        for _ in range(MAX_DEPTH):
            if ino == ROOT_INO:
                return ancestor == ROOT_INO
            if ino == ancestor:
                return True
            ino = self.parent_of(ino)
        raise fail(errno.ELOOP)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               noreplace: bool = False, exchange: bool = False) -> Inode | None:
        """Move an entry; returns a replaced inode whose last link went, else None."""
        check_name(new_name)

        def change() -> Inode | None:
            od, nd = self._dir(old_parent), self._dir(new_parent)
            src_ino = self.entry_ino(old_parent, old_name)
            if src_ino is None:
                raise fail(errno.ENOENT)
            src = self.get(src_ino)
            dst_ino = self.entry_ino(new_parent, new_name)
            dst = self.get(dst_ino) if dst_ino is not None else None
            if src.is_dir and new_parent != old_parent and self._is_ancestor(src_ino,
                                                                             new_parent):
                raise fail(errno.EINVAL)
            if exchange:
                self._exchange(od, old_name, src, nd, new_name, dst)
                return None
            if dst is not None:
                if noreplace:
                    raise fail(errno.EEXIST)
                if dst.ino == src.ino:
                    return None  # two links to one inode: POSIX says do nothing
                if src.is_dir and not dst.is_dir:
                    raise fail(errno.ENOTDIR)
                if dst.is_dir and not src.is_dir:
                    raise fail(errno.EISDIR)
                if dst.is_dir and not self._is_empty(dst.ino):
                    raise fail(errno.ENOTEMPTY)
            now = time.time_ns()
            if dst is not None:
                self._remove_entry(new_parent, new_name, dst.ino)
                self.drop_link(dst, now)
            self._move_entry(old_parent, old_name, src.ino, new_parent, new_name)
            if src.is_dir:
                self._sole.set_parent(src.ino, new_parent)
            if dst is not None and dst.is_dir:
                self._sole.set_parent(dst.ino, None)
            self.write_fields(src, {"ctime_ns": now})
            moved_dir = src.is_dir and old_parent != new_parent
            replaced_dir = dst is not None and dst.is_dir
            if old_parent == new_parent:
                self._touch_dir(od, now, -1 if replaced_dir else 0)
            else:
                self._touch_dir(od, now, -1 if moved_dir else 0)
                self._touch_dir(nd, now, (1 if moved_dir else 0) - (1 if replaced_dir else 0))
            return dst if dst is not None and dst.nlink == 0 else None
        return self.txn(change)

    def _exchange(self, od: Inode, old_name: bytes, src: Inode, nd: Inode, new_name: bytes,
                  dst: Inode | None) -> None:
        """RENAME_EXCHANGE: two entries swap their inodes."""
        if dst is None:
            raise fail(errno.ENOENT)
        if dst.is_dir and od.ino != nd.ino and self._is_ancestor(dst.ino, od.ino):
            raise fail(errno.EINVAL)
        now = time.time_ns()
        self._point_entry(od.ino, old_name, src.ino, dst.ino)
        self._point_entry(nd.ino, new_name, dst.ino, src.ino)
        for moved, parent in ((src, nd.ino), (dst, od.ino)):
            if moved.is_dir:
                self._sole.set_parent(moved.ino, parent)
        for n in (src, dst):
            self.write_fields(n, {"ctime_ns": now})
        delta = int(src.is_dir) - int(dst.is_dir)
        if od.ino == nd.ino:
            self._touch_dir(od, now)
        else:
            self._touch_dir(od, now, -delta)
            self._touch_dir(nd, now, delta)

    def readdir(self, parent: int, after: int, limit: int = 512) -> list[Entry]:
        """Entries with cookie > `after`, in cookie order (stable while entries change),
        their inodes read in one go."""
        return self.readdir_page(parent, after, limit, sys.maxsize, max(limit, 1))[0]

    def readdir_page(self, parent: int, after: int, limit: int, max_targets: int,
                     bite: int = LOAD_BITE) -> tuple[list[Entry], bool]:
        """`readdir`'s entries, their inodes read `bite` at a time, the page cut after
        the bite whose symlink targets passed `max_targets` bytes (a page read in one go
        on the daemon's thread, 512 of 4 KiB targets, held it 3-4.6 ms; off it, on a
        reading node's store worker, a bite is a round trip to the server, and `bite`
        the page); and whether entries may follow (the page was full, or cut)."""
        rows = list(self.engine.scan("dentries", ("id", "name", "ino"), {"parent": parent},
                                     order="id", after=after, limit=limit))
        entries: list[Entry] = []
        targets = 0
        for start in range(0, len(rows), bite):
            part = rows[start:start + bite]
            self._load([ino for _, _, ino in part])
            for cookie, name, ino in part:
                node = self.get(ino)
                entries.append(Entry(cookie, bytes(name), node))
                targets += node.size if node.target is not None else 0
            if targets > max_targets and start + bite < len(rows):
                return entries, True
        return entries, len(rows) == limit

    def _load(self, inos: list[int]) -> None:
        """Read the inodes memory lacks in one go (`get_many`), into memory."""
        cache = self._cache
        missing = [i for i in inos if i not in cache]
        if len(missing) < 2:
            return
        for row in self.engine.get_many("inodes", "ino", missing, INODE_COLUMNS):
            cache.setdefault(row[0], Inode(*row))
            if cache.over(_CACHE_LIMIT):
                self._evict()

    # ---- xattrs ----------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes | None:
        row = self.engine.get("xattrs", {"ino": ino, "name": name}, ("value",))
        return bytes(row[0]) if row else None

    def listxattr(self, ino: int) -> list[bytes]:
        return [bytes(r[0]) for r in self.engine.scan("xattrs", ("name",), {"ino": ino},
                                                      order="name")]

    def xattr_usage(self, ino: int, but: bytes = b"") -> tuple[int, int, int]:
        """(names, bytes of names and values) of an inode's xattrs, leaving out `but`
        (the one about to be replaced), and the bytes of `but` (0 if it has none)."""
        names = held = replaced = 0
        for name, value in self.engine.scan("xattrs", ("name", "value"), {"ino": ino}):
            if bytes(name) != but:
                names += 1
                held += len(name) + len(value)
            else:
                replaced = len(name) + len(value)
        return names, held, replaced

    def _charge_xattrs(self, node: Inode, uid: int, delta: int) -> None:
        """Add `delta` bytes to `uid`'s xattr tally, put back if the change fails."""
        self._owned_moved(node.ino)
        if delta and self.usage.counted:
            self.usage.add_xattrs(uid, delta)
            self._journal.append((node, _XATTRS, (uid, delta)))

    def _old_xattr(self, node: Inode, name: bytes) -> int | None:
        """Bytes of `node`'s xattr `name` (name and value) when usage is counted and it
        has one (inside a change)."""
        if not self.usage.counted:
            return None
        row = self.engine.get("xattrs", {"ino": node.ino, "name": name}, ("value",))
        return None if row is None else xattr_cost(name, len(row[0]))

    def setxattr(self, node: Inode, name: bytes, value: bytes) -> None:
        def change() -> None:
            old = self._old_xattr(node, name)
            self.engine.upsert("xattrs", {"ino": node.ino, "name": name, "value": value})
            self._charge_xattrs(node, node.uid, xattr_cost(name, len(value)) - (old or 0))
            self.write_fields(node, {"ctime_ns": time.time_ns()})
        self.txn(change)

    def removexattr(self, node: Inode, name: bytes) -> bool:
        def change() -> bool:
            old = self._old_xattr(node, name)
            if not self.engine.delete("xattrs", {"ino": node.ino, "name": name}):
                return False
            self._charge_xattrs(node, node.uid, -(old or 0))
            self.write_fields(node, {"ctime_ns": time.time_ns()})
            return True
        return self.txn(change)

    # ---- reclaim and recovery ---------------------------------------------

    def orphans(self) -> list[int]:
        return [r[0] for r in self.engine.scan("orphans", ("ino",))]

    def orphans_among(self, inos: list[int]) -> list[int]:
        """Those of `inos` the rows list as orphans (asked of the rows: memory's last
        link gone may have been in a lost group), in one statement."""
        listed = {r[0] for r in self.engine.get_many("orphans", "ino", inos, ("ino",))}
        return [i for i in inos if i in listed]

    def drop_inodes(self, inos: list[int]) -> None:
        """Forget orphans for good, in one change of a statement per table."""
        if not inos:
            return
        gone = self.owners(inos) if self.usage.counted else []
        xattrs = self.engine.lengths("xattrs", "ino", ("name", "value"), inos,
                                     NAME_ROW) if gone else {}

        def change() -> None:
            for table in ("inodes", "xattrs", "orphans", "dirty_data", "sealed"):
                self.engine.remove_many(table, "ino", inos)
            if self.feed is not None:
                for ino in inos:
                    self.feed.ino(ino, data=True)
        self.txn(change)
        for ino in inos:
            self._cache.pop(ino, None)
            self._owned_moved(ino)
        self._sole.dropped(inos)
        for ino, uid, mode, size in gone:
            self.usage.add(uid, mode, size, -1)
            self.usage.add_xattrs(uid, -xattrs.get(ino, 0))

    def owners(self, inos: list[int]) -> list[tuple[int, int, int, int]]:
        """(ino, uid, mode, size) of each of `inos` as memory has it (the rows for the
        inodes it does not hold)."""
        cached = [n for i in set(inos) if (n := self._cache.get(i)) is not None]
        out = [(n.ino, n.uid, n.mode, n.size) for n in cached]
        held = {n.ino for n in cached}
        rest = [i for i in set(inos) if i not in held]
        if rest:
            out += [(r[0], r[1], r[2], r[3]) for r in self.engine.get_many(
                "inodes", "ino", rest, ("ino", "uid", "mode", "size"))]
        return out

    def count_usage(self) -> Usage:
        """Bytes and inodes by uid (`meta/usage.py`): counted from every row the first
        time (and after a lost group), memory's sizes of open files included."""
        if not self.usage.counted:
            xattrs = self.engine.lengths("xattrs", "ino", ("name", "value"), None, NAME_ROW)
            names = self.engine.lengths("dentries", "parent", ("name",), None, NAME_ROW)
            for ino, n in self.engine.lengths("kv", "ino", ("ns", "key"), None,
                                              NAME_ROW).items():
                names[ino] = names.get(ino, 0) + n  # (a chunk's key: `charge_key`)
            cache = self._cache
            rows = []
            for ino, uid, mode, size in self.engine.scan("inodes",
                                                         ("ino", "uid", "mode", "size")):
                node = cache.get(ino)
                if node is not None:
                    uid, mode, size = node.uid, node.mode, node.size
                rows.append((uid, mode, size, xattrs.get(ino, 0), names.get(ino, 0)))
            self.usage.recount(rows)
        return self.usage

    def charged_bytes(self, node: Inode, owned: Owned | None = None) -> int:
        """What `node` counts against its owner's byte quota (`meta/usage.py`): its size
        (a file's, a BLOCK at least, a link's), its extended attributes and the names
        in it (a directory's) or its key (a KV chunk's), as a chown moves them
        (`write_fields`); `owned`: those two as measured, else read here."""
        xattrs, names = owned if owned is not None else self.owned(node.ino)
        return charged_size(node.mode, node.size) + xattrs + names

    def owned(self, ino: int) -> Owned:
        """The bytes of `ino`'s xattrs and of the names in it, a directory's, or of its
        key, a KV chunk's (a row's overhead each), in the rows: what a chown moves
        between owners.  A folder of 65,000 names takes 17 ms to sum, so a writer's
        chown asks it of a worker's connection, which sees committed rows only:
        `watch_owned` says whether they were the file's still."""
        xattrs = self.engine.lengths("xattrs", "ino", ("name", "value"), [ino], NAME_ROW)
        names = self.engine.lengths("dentries", "parent", ("name",), [ino], NAME_ROW)
        key = self.engine.lengths("kv", "ino", ("ns", "key"), [ino], NAME_ROW)
        return xattrs.get(ino, 0), names.get(ino, 0) + key.get(ino, 0)

    @contextmanager
    def watch_owned(self, ino: int) -> Iterator[Callable[[], bool]]:
        """While inside: whether the names in `ino` or its xattrs changed (or a group
        was lost) since it began, asked of the callable given."""
        watched = self._watched
        first = ino not in watched
        if first:
            watched[ino] = 0
        since = watched[ino]
        try:
            yield lambda: watched[ino] != since
        finally:
            if first:
                del watched[ino]

    def owned_uncommitted(self, ino: int) -> bool:
        """Whether the open group changed the names in `ino` or its xattrs (rows a
        worker's connection would not see till it commits)."""
        return ino in self._owned_changed

    def _owned_moved(self, ino: int) -> None:
        """A change to the names in `ino` or to its xattrs (a chown measuring them
        measures again)."""
        self._owned_changed.add(ino)
        if ino in self._watched:
            self._watched[ino] += 1

    def mark_dirty_data(self, ino: int) -> None:
        self.txn(lambda: self.engine.upsert("dirty_data", {"ino": ino}))  # (unless listed)

    def clear_dirty_data(self, ino: int) -> None:
        self.txn(lambda: self.engine.remove("dirty_data", {"ino": ino}))

    def dirty_data(self) -> list[int]:
        return [r[0] for r in self.engine.scan("dirty_data", ("ino",))]

    # ---- sealed files ------------------------------------------------------

    def seal(self, ino: int, sum_unit: int, sums: bytes) -> None:
        """Record a direct-committed file's checksums (inside its publishing change)."""
        self.engine.upsert("sealed", {"ino": ino, "sum_unit": sum_unit, "sums": sums})
        self._seal_known(ino, True)

    def _seal_known(self, ino: int, sealed: bool) -> None:
        self._sole.set_sealed(ino, sealed, self.engine.in_change)

    def seal_of(self, ino: int) -> tuple[int, bytes] | None:
        """(sum_unit, packed little-endian xxh3-64 sums) of a sealed file, else None."""
        row = self.engine.get("sealed", {"ino": ino}, ("sum_unit", "sums"))
        return (row[0], bytes(row[1])) if row else None

    def is_sealed(self, ino: int) -> bool:
        known = self._sole.sealed.get(ino)
        if known is None:
            known = self.engine.get("sealed", {"ino": ino}, ("ino",)) is not None
            self._seal_known(ino, known)
        return known

    # ---- repairs (fsck, on a held pool) -------------------------------------

    def repair_nlink(self, ino: int, nlink: int) -> None:
        self.txn(lambda: self.write_fields(self.get(ino), {"nlink": nlink}))

    def drop_entry(self, parent: int, name: bytes) -> None:
        """Remove an entry without touching its inode (it points nowhere)."""
        def change() -> None:
            self.engine.remove("dentries", {"parent": parent, "name": name})
            self._name((parent, name), None)
            self._entry_changed(parent, name)
        self.txn(change)

    def adopt(self, ino: int, parent: int, name: bytes) -> None:
        """Give an unreachable inode an entry (fsck's /lost+found) and the link count
        that entry makes."""
        def change() -> None:
            node, d = self.get(ino), self._dir(parent)
            now = time.time_ns()
            self._add_entry(parent, name, ino)
            if node.is_dir:
                self._sole.set_parent(ino, parent)
            self.write_fields(node, {"nlink": 2 if node.is_dir else 1, "ctime_ns": now})
            self._touch_dir(d, now, 1 if node.is_dir else 0)
        self.txn(change)

"""The metadata store: inodes, directory entries, xattrs and layouts in SQLite (WAL).

Every namespace change is one transaction, so a crash never leaves an entry
pointing nowhere nor an unreachable inode holding space: an inode whose last
link goes is listed in `orphans` in the same transaction, and its data is
reclaimed when it is no longer open (or at the next mount, if the daemon died).

The daemon is the only writer, on one thread.  It keeps the inodes it touches
in memory; data attributes (size, times) that writes change are held there and
written back on flush, fsync and release ("dirty"), while namespace fields are
written through at once.  Inodes whose chunk files may run past the recorded
size are listed in `dirty_data`, so a mount after a crash can trim them.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

ROOT_INO = 1
NAME_MAX = 255
SCHEMA_VERSION = 3
DB_NAME = "mxfs.db"
# Space held on the metadata member for the store alone (a preallocated file beside it):
# when writers fill the member, it is given back so that commits, unlinks and KV
# eviction still go through, and taken again once space returns.
RESERVE_NAME = "reserve"
RESERVE_MIN, RESERVE_MAX = 4 << 20, 32 << 20
# Blocks allocated ahead (past the end, the size unchanged) for the WAL and the database
# to grow into, so that a commit needs no new space even while a writer fills the member.
GROWTH_ROOM = 4 << 20  # about what the WAL holds between two checkpoints (1000 pages)
_FALLOC_FL_KEEP_SIZE = 1

log = logging.getLogger("mxfs.meta")

_SCHEMA = """
CREATE TABLE settings(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE inodes(
    ino INTEGER PRIMARY KEY AUTOINCREMENT,
    mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    nlink INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    rdev INTEGER NOT NULL DEFAULT 0,
    target BLOB,
    stripe_unit INTEGER, stripe_width INTEGER, first_member INTEGER,
    generation INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE dentries(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL,
    UNIQUE(parent, name)
);
CREATE INDEX dentries_by_ino ON dentries(ino);
CREATE INDEX dentries_by_parent ON dentries(parent, id);
CREATE TABLE xattrs(ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
                    PRIMARY KEY(ino, name)) WITHOUT ROWID;
CREATE TABLE orphans(ino INTEGER PRIMARY KEY);
CREATE TABLE dirty_data(ino INTEGER PRIMARY KEY);
CREATE TABLE sealed(ino INTEGER PRIMARY KEY, sum_unit INTEGER NOT NULL, sums BLOB NOT NULL);
CREATE TABLE kv_ns(ns TEXT PRIMARY KEY, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
                   mode INTEGER NOT NULL, capacity INTEGER NOT NULL DEFAULT 0);
CREATE TABLE kv(ns TEXT NOT NULL, key BLOB NOT NULL, ino INTEGER NOT NULL,
                size INTEGER NOT NULL, atime INTEGER NOT NULL,
                PRIMARY KEY(ns, key)) WITHOUT ROWID;
CREATE INDEX kv_by_ino ON kv(ino);
"""

# Statements that bring a store of schema version N (the key) to N + 1.
_MIGRATIONS = {
    1: ["CREATE TABLE sealed(ino INTEGER PRIMARY KEY, sum_unit INTEGER NOT NULL,"
        " sums BLOB NOT NULL)"],
    2: ["CREATE TABLE kv_ns(ns TEXT PRIMARY KEY, uid INTEGER NOT NULL, gid INTEGER NOT NULL,"
        " mode INTEGER NOT NULL, capacity INTEGER NOT NULL DEFAULT 0)",
        "CREATE TABLE kv(ns TEXT NOT NULL, key BLOB NOT NULL, ino INTEGER NOT NULL,"
        " size INTEGER NOT NULL, atime INTEGER NOT NULL, PRIMARY KEY(ns, key)) WITHOUT ROWID",
        "CREATE INDEX kv_by_ino ON kv(ino)"],
}

_COLUMNS = ("ino", "mode", "uid", "gid", "nlink", "size", "atime_ns", "mtime_ns", "ctime_ns",
            "rdev", "target", "stripe_unit", "stripe_width", "first_member", "generation")
_DATA_FIELDS = ("size", "atime_ns", "mtime_ns", "ctime_ns")
_CACHE_LIMIT = 200_000
DIR_SIZE = 4096

# (ino, directory's default unit, directory's default width) -> (unit, width, first member)
LayoutPicker = Callable[[int, "int | None", "int | None"], tuple[int, int, int]]


def create_schema(db: sqlite3.Connection) -> None:
    """The tables and indexes of the current schema, in an empty database."""
    for stmt in _SCHEMA.split(";"):
        if stmt.strip():
            db.execute(stmt)


def fail(code: int, what: str = "") -> OSError:
    return OSError(code, what or os.strerror(code))


@dataclass(slots=True)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    target: bytes | None = None
    stripe_unit: int | None = None
    stripe_width: int | None = None
    first_member: int | None = None
    generation: int = 0
    dirty: bool = field(default=False, compare=False)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def apparent_size(self) -> int:
        """st_size as users see it: a directory reports a block, as on ext4."""
        return DIR_SIZE if self.is_dir else self.size


@dataclass(frozen=True, slots=True)
class Entry:
    cookie: int
    name: bytes
    inode: Inode


def _check_name(name: bytes) -> None:
    """The kernel's rules for a name, for every path that makes one (mount or direct)."""
    if len(name) > NAME_MAX:
        raise fail(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise fail(errno.EINVAL)


def _fallocate_keep_size(fd: int, offset: int, length: int) -> None:
    """fallocate(2) with FALLOC_FL_KEEP_SIZE: blocks past the end, contents untouched
    (posix_fallocate may emulate by writing, which a live WAL must never see)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _is_full(e: sqlite3.Error) -> bool:
    return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or \
        "disk is full" in str(e)


def as_os_error(e: sqlite3.Error | OverflowError) -> OSError:
    """The errno an engine error means to a caller: full is ENOSPC, else EIO."""
    if isinstance(e, OverflowError):
        return fail(errno.EOVERFLOW, f"a value is too large for the metadata store ({e})")
    if _is_full(e):
        return fail(errno.ENOSPC, "the metadata member is full")
    if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_READONLY or \
            "readonly" in str(e):
        return fail(errno.EROFS, f"the metadata store cannot be written ({e})")
    return fail(errno.EIO, f"metadata store error ({e})")


class MetaStore:
    """The pool's namespace; one instance per daemon (the single writer)."""

    def __init__(self, path: str, readonly: bool = False) -> None:
        self.path = path
        uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
        if not readonly and not os.path.exists(path):
            raise FileNotFoundError(path)
        self.db = sqlite3.connect(uri, uri=True, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout=5000")
        if not readonly:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
        self._cache: dict[int, Inode] = {}
        self._in_txn = False
        self._group_open = False
        self._group_started = 0.0
        # The daemon turns this on and calls commit_if_due; tools commit each change.
        self.group_commit = False
        self.reserve_path = os.path.join(os.path.dirname(path), RESERVE_NAME)
        self.space_low = False  # the member is nearly full (the daemon cuts overdrafts back)
        if not readonly:
            self.keep_reserve()

    # ---- lifecycle -------------------------------------------------------

    @classmethod
    def format(cls, meta_dir: str, pool_uuid: str, stripe_unit: int,
               root_uid: int = 0, root_gid: int = 0) -> MetaStore:
        """Make a fresh store with an empty root directory."""
        path = os.path.join(meta_dir, DB_NAME)
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)
        sqlite3.connect(path).close()
        store = cls(path)
        now = time.time_ns()
        with store.transaction():
            create_schema(store.db)
            store.db.executemany("INSERT INTO settings VALUES (?, ?)", [
                ("schema_version", str(SCHEMA_VERSION)), ("pool_uuid", pool_uuid),
                ("clean", "1")])
            store.db.execute(
                "INSERT INTO inodes(ino, mode, uid, gid, nlink, size, atime_ns, mtime_ns,"
                " ctime_ns, stripe_unit) VALUES (?, ?, ?, ?, 2, 0, ?, ?, ?, ?)",
                (ROOT_INO, stat.S_IFDIR | 0o755, root_uid, root_gid, now, now, now, stripe_unit))
        store.durable()
        return store

    @classmethod
    def open(cls, meta_dir: str, readonly: bool = False) -> MetaStore:
        path = os.path.join(meta_dir, DB_NAME)
        store = cls(path, readonly=readonly)
        version = int(store.setting("schema_version") or 0)
        if version < SCHEMA_VERSION and not readonly and version in _MIGRATIONS:
            with store.transaction():
                while version < SCHEMA_VERSION:
                    for stmt in _MIGRATIONS[version]:
                        store.db.execute(stmt)
                    version += 1
                store.set_setting("schema_version", str(version))
        if version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"metadata schema {version} is not {SCHEMA_VERSION}")
        return store

    def close(self) -> None:
        self.commit()
        self.db.close()

    def setting(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, value))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic namespace change, inside the current group commit.

        Changes are grouped into one SQLite transaction that `commit` ends (the
        daemon commits every few milliseconds, on fsync and before touching chunk
        files), each change in its own savepoint: a failed change is undone alone,
        and a crash loses at most the last uncommitted group, whole changes only.
        """
        if self._in_txn:
            yield
            return
        try:
            if not self._group_open:
                self.db.execute("BEGIN IMMEDIATE")
                self._group_open = True
                self._group_started = time.monotonic()
            self.db.execute("SAVEPOINT change")
        except sqlite3.Error as e:
            raise as_os_error(e) from None
        self._in_txn = True
        try:
            yield
        except BaseException as e:
            self._undo_change()
            if isinstance(e, sqlite3.Error | OverflowError):
                if isinstance(e, sqlite3.Error) and _is_full(e):
                    self.release_reserve()
                raise as_os_error(e) from None
            raise
        else:
            self.db.execute("RELEASE change")
        finally:
            self._in_txn = False
        if not self.group_commit:
            self.commit()

    def _undo_change(self) -> None:
        """Roll back the failed change alone; if the engine dropped the whole group (it
        may, on a full disk), say so and forget what memory held of it."""
        self._cache = {i: n for i, n in self._cache.items() if n.dirty}
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK TO change")
                self.db.execute("RELEASE change")
                return
            except sqlite3.Error:
                pass
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        if self._group_open:
            log.error("metadata store: the open group of changes was rolled back")
        self._group_open = False

    def commit(self) -> None:
        """End the current group: every change so far is committed (not yet fsynced).

        A full metadata member gives back the store's reserve and tries once more;
        if that fails too the group stays open (if the engine kept it) and the
        caller gets ENOSPC: the daemon goes on and commits once space returns.
        """
        if not self._group_open:
            return
        if self._space_short():
            self.release_reserve()  # before the engine fails (it may drop the whole group)
        for attempt in (1, 2):
            try:
                self.db.execute("COMMIT")
                self._group_open = False
                return
            except sqlite3.Error as e:
                if not self.db.in_transaction:
                    self._group_open = False
                    self._cache = {i: n for i, n in self._cache.items() if n.dirty}
                    log.error("metadata store: a group of changes was lost (%s)", e)
                    raise as_os_error(e) from None
                if attempt == 2 or not _is_full(e) or not self.release_reserve():
                    raise as_os_error(e) from None

    # ---- the space reserve ---------------------------------------------------

    def _space_short(self) -> bool:
        """Is the metadata member nearly full (less free than the reserve holds)?"""
        try:
            st = os.statvfs(os.path.dirname(self.path))
        except OSError:
            return False
        self.space_low = st.f_bavail * st.f_frsize < RESERVE_MIN
        return self.space_low

    def _reserve_target(self) -> int:
        st = os.statvfs(os.path.dirname(self.path))
        return min(max(st.f_blocks * st.f_frsize // 100, RESERVE_MIN), RESERVE_MAX)

    def keep_reserve(self) -> bool:
        """Hold the reserve (again), and growth room for the WAL and the database, if
        there is room for them and more; True if the reserve is held."""
        try:
            target = self._reserve_target()
            st = os.statvfs(os.path.dirname(self.path))
            if st.f_bavail * st.f_frsize < 3 * target:
                return False  # not while writers are short of space themselves
            self._grow_room()
            try:
                if os.stat(self.reserve_path).st_blocks * 512 >= target:
                    return True
            except FileNotFoundError:
                pass
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, target)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            log.debug("metadata reserve not held: %s", e)
            try:
                os.truncate(self.reserve_path, 0)
            except OSError:
                pass
            return False

    def _grow_room(self) -> None:
        """Allocate GROWTH_ROOM past the end of the WAL and the database (sizes kept)."""
        for path in (self.path + "-wal", self.path):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                end = os.fstat(fd).st_size
                if os.fstat(fd).st_blocks * 512 < end + GROWTH_ROOM // 2:
                    _fallocate_keep_size(fd, end, GROWTH_ROOM)
            except OSError as e:
                log.debug("no growth room for %s: %s", path, e)
            finally:
                os.close(fd)

    def release_reserve(self) -> bool:
        """Give the reserve's space to the store now; True if there was some to give."""
        try:
            held = os.stat(self.reserve_path).st_blocks
            os.truncate(self.reserve_path, 0)
        except OSError:
            return False
        if held:
            log.warning("metadata member %s is full: released the metadata reserve so "
                        "changes can still be committed; free space on it",
                        os.path.dirname(self.path))
        return held > 0

    def watch_space(self) -> None:
        """Called now and then: give the reserve up before the member is full, and take
        it again once writers freed space."""
        if self._space_short():
            self.release_reserve()
        else:
            self.keep_reserve()

    def commit_if_due(self, max_age: float) -> None:
        if self._group_open and time.monotonic() - self._group_started >= max_age:
            self.commit()

    def durable(self) -> None:
        """Commit, then push every committed transaction to stable storage.

        With synchronous=NORMAL, commits reach the WAL without fsync and
        checkpoints fsync the database; fsyncing the WAL makes both durable.
        """
        self.commit()
        self.sync_wal()

    def sync_wal(self) -> None:
        """fsync the WAL only (touches no connection state, so any thread may call it)."""
        wal = self.path + "-wal"
        try:
            fd = os.open(wal, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- inodes ----------------------------------------------------------

    def get(self, ino: int) -> Inode:
        node = self._cache.get(ino)
        if node is not None:
            return node
        row = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM inodes WHERE ino=?",
                              (ino,)).fetchone()
        if row is None:
            raise fail(errno.ENOENT)
        node = Inode(*row)
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache = {i: n for i, n in self._cache.items() if n.dirty}
        self._cache[ino] = node
        return node

    def _write(self, node: Inode, *cols: str) -> None:
        self.db.execute(f"UPDATE inodes SET {', '.join(c + '=?' for c in cols)} WHERE ino=?",
                        [getattr(node, c) for c in cols] + [node.ino])

    def save(self, node: Inode, *cols: str) -> None:
        """Write the named columns of a cached inode now."""
        with self.transaction():
            self._write(node, *cols)

    def touch_data(self, node: Inode) -> None:
        """Note that size or times changed in memory; written back by `flush`."""
        node.dirty = True

    def flush(self, node: Inode) -> None:
        if node.dirty:
            with self.transaction():
                self._write(node, *_DATA_FIELDS)
            node.dirty = False

    def flush_all(self) -> None:
        dirty = [n for n in self._cache.values() if n.dirty]
        if dirty:
            with self.transaction():
                for n in dirty:
                    self._write(n, *_DATA_FIELDS)
            for n in dirty:
                n.dirty = False

    def forget(self, ino: int) -> None:
        node = self._cache.get(ino)
        if node is not None and not node.dirty:
            del self._cache[ino]

    def count_inodes(self) -> int:
        return self.db.execute("SELECT count(*) FROM inodes").fetchone()[0]

    # ---- namespace -------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Inode:
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self.parent_of(parent))
        row = self.db.execute("SELECT ino FROM dentries WHERE parent=? AND name=?",
                              (parent, name)).fetchone()
        if row is None:
            raise fail(errno.ENOENT)
        return self.get(row[0])

    def parent_of(self, dir_ino: int) -> int:
        if dir_ino == ROOT_INO:
            return ROOT_INO
        row = self.db.execute("SELECT parent FROM dentries WHERE ino=?", (dir_ino,)).fetchone()
        if row is None:
            raise fail(errno.ENOENT)
        return row[0]

    def _dir(self, ino: int) -> Inode:
        node = self.get(ino)
        if not node.is_dir:
            raise fail(errno.ENOTDIR)
        if node.nlink == 0:
            raise fail(errno.ENOENT)
        return node

    def entry_ino(self, parent: int, name: bytes) -> int | None:
        row = self.db.execute("SELECT ino FROM dentries WHERE parent=? AND name=?",
                              (parent, name)).fetchone()
        return row[0] if row else None

    def _touch_dir(self, d: Inode, now: int, nlink_delta: int = 0) -> None:
        d.mtime_ns = d.ctime_ns = now
        d.nlink += nlink_delta
        self._write(d, "mtime_ns", "ctime_ns", "nlink")

    def _insert_inode(self, parent: Inode, mode: int, uid: int, gid: int, nlink: int,
                      now: int, rdev: int = 0, target: bytes | None = None,
                      layout_for: LayoutPicker | None = None) -> Inode:
        """Insert an inode row (inside a transaction); files get `layout_for`'s layout."""
        unit, width = parent.stripe_unit, parent.stripe_width
        size = len(target) if target else 0
        cur = self.db.execute(
            "INSERT INTO inodes(mode, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns,"
            " rdev, target, stripe_unit, stripe_width) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (mode, uid, gid, nlink, size, now, now, now, rdev, target, unit, width))
        ino = cur.lastrowid
        assert ino is not None
        first = None
        if stat.S_ISREG(mode):
            assert layout_for is not None
            unit, width, first = layout_for(ino, unit, width)
            self.db.execute("UPDATE inodes SET stripe_unit=?, stripe_width=?, first_member=?"
                            " WHERE ino=?", (unit, width, first, ino))
        node = Inode(ino, mode, uid, gid, nlink, size, now, now, now, rdev, target, unit, width,
                     first)
        self._cache[ino] = node
        return node

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *,
               rdev: int = 0, target: bytes | None = None,
               layout_for: LayoutPicker | None = None) -> Inode:
        """Make a new inode and its entry; a regular file gets `layout_for`'s layout."""
        _check_name(name)
        d = self._dir(parent)
        if self.entry_ino(parent, name) is not None:
            raise fail(errno.EEXIST)
        now = time.time_ns()
        is_dir = stat.S_ISDIR(mode)
        with self.transaction():
            node = self._insert_inode(d, mode, uid, gid, 2 if is_dir else 1, now, rdev, target,
                                      layout_for)
            self.db.execute("INSERT INTO dentries(parent, name, ino) VALUES (?,?,?)",
                            (parent, name, node.ino))
            self._touch_dir(d, now, 1 if is_dir else 0)
        return node

    def create_hidden(self, parent: int, mode: int, uid: int, gid: int,
                      layout_for: LayoutPicker) -> Inode:
        """A regular file with no entry yet (a direct write before its commit).

        It is an orphan from birth, so a crash before `publish` reclaims it.
        Its layout comes from `parent`, the directory it will be published in.
        """
        d = self._dir(parent)
        with self.transaction():
            node = self._insert_inode(d, stat.S_IFREG | stat.S_IMODE(mode), uid, gid, 0,
                                      time.time_ns(), layout_for=layout_for)
            self.db.execute("INSERT INTO orphans VALUES (?)", (node.ino,))
        return node

    def publish(self, ino: int, parent: int, name: bytes, replace: bool) -> Inode | None:
        """Give a hidden file its entry, atomically replacing what was there if `replace`.

        Returns the replaced inode when that was its last link (now an orphan).
        """
        _check_name(name)
        d = self._dir(parent)
        node = self.get(ino)
        if node.nlink != 0:
            raise fail(errno.EINVAL, f"inode {ino} is already published")
        old_ino = self.entry_ino(parent, name)
        old = self.get(old_ino) if old_ino is not None else None
        if old is not None:
            if not replace:
                raise fail(errno.EEXIST)
            if old.is_dir:
                raise fail(errno.EISDIR)
        now = time.time_ns()
        with self.transaction():
            if old is not None:
                self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
                self._drop_link(old, now)
            self.db.execute("INSERT INTO dentries(parent, name, ino) VALUES (?,?,?)",
                            (parent, name, ino))
            self.db.execute("DELETE FROM orphans WHERE ino=?", (ino,))
            node.nlink = 1
            node.ctime_ns = node.mtime_ns = now
            self._write(node, "nlink", "ctime_ns", "mtime_ns", "size")
            self._touch_dir(d, now)
        return old if old is not None and old.nlink == 0 else None

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        _check_name(name)
        d = self._dir(parent)
        node = self.get(ino)
        if node.is_dir:
            raise fail(errno.EPERM)
        if node.nlink == 0:
            raise fail(errno.ENOENT)
        if self.entry_ino(parent, name) is not None:
            raise fail(errno.EEXIST)
        now = time.time_ns()
        with self.transaction():
            self.db.execute("INSERT INTO dentries(parent, name, ino) VALUES (?,?,?)",
                            (parent, name, ino))
            node.nlink += 1
            node.ctime_ns = now
            self._write(node, "nlink", "ctime_ns")
            self._touch_dir(d, now)
        return node

    def _drop_link(self, node: Inode, now: int) -> None:
        """One link fewer; at zero the inode becomes an orphan awaiting reclaim."""
        node.nlink -= 2 if node.is_dir else 1
        if node.is_dir or node.nlink < 0:
            node.nlink = 0
        node.ctime_ns = now
        self._write(node, "nlink", "ctime_ns")
        if node.nlink == 0:
            self.db.execute("INSERT OR IGNORE INTO orphans VALUES (?)", (node.ino,))

    def unlink(self, parent: int, name: bytes) -> Inode:
        """Remove a non-directory entry; returns the inode (nlink 0: now an orphan)."""
        d = self._dir(parent)
        ino = self.entry_ino(parent, name)
        if ino is None:
            raise fail(errno.ENOENT)
        node = self.get(ino)
        if node.is_dir:
            raise fail(errno.EISDIR)
        now = time.time_ns()
        with self.transaction():
            self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
            self._drop_link(node, now)
            self._touch_dir(d, now)
        return node

    def _is_empty(self, ino: int) -> bool:
        return self.db.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1",
                               (ino,)).fetchone() is None

    def rmdir(self, parent: int, name: bytes) -> Inode:
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
        with self.transaction():
            self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
            self._drop_link(node, now)
            self._touch_dir(d, now, -1)
        return node

    def _is_ancestor(self, ancestor: int, ino: int) -> bool:
        while ino != ROOT_INO:
            if ino == ancestor:
                return True
            ino = self.parent_of(ino)
        return ancestor == ROOT_INO

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               noreplace: bool = False, exchange: bool = False) -> Inode | None:
        """Move an entry; returns a replaced inode whose last link went, else None."""
        _check_name(new_name)
        od, nd = self._dir(old_parent), self._dir(new_parent)
        src_ino = self.entry_ino(old_parent, old_name)
        if src_ino is None:
            raise fail(errno.ENOENT)
        src = self.get(src_ino)
        dst_ino = self.entry_ino(new_parent, new_name)
        dst = self.get(dst_ino) if dst_ino is not None else None
        if src.is_dir and new_parent != old_parent and self._is_ancestor(src_ino, new_parent):
            raise fail(errno.EINVAL)
        now = time.time_ns()
        if exchange:
            if dst is None:
                raise fail(errno.ENOENT)
            if dst.is_dir and old_parent != new_parent and self._is_ancestor(dst.ino, old_parent):
                raise fail(errno.EINVAL)
            with self.transaction():
                self.db.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?",
                                (dst.ino, old_parent, old_name))
                self.db.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?",
                                (src.ino, new_parent, new_name))
                delta = int(src.is_dir) - int(dst.is_dir)
                for n in (src, dst):
                    n.ctime_ns = now
                    self._write(n, "ctime_ns")
                if old_parent == new_parent:
                    self._touch_dir(od, now)
                else:
                    self._touch_dir(od, now, -delta)
                    self._touch_dir(nd, now, delta)
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
        with self.transaction():
            if dst is not None:
                self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?",
                                (new_parent, new_name))
                self._drop_link(dst, now)
            self.db.execute("UPDATE dentries SET parent=?, name=? WHERE parent=? AND name=?",
                            (new_parent, new_name, old_parent, old_name))
            src.ctime_ns = now
            self._write(src, "ctime_ns")
            moved_dir = src.is_dir and old_parent != new_parent
            replaced_dir = dst is not None and dst.is_dir
            if old_parent == new_parent:
                self._touch_dir(od, now, -1 if replaced_dir else 0)
            else:
                self._touch_dir(od, now, -1 if moved_dir else 0)
                self._touch_dir(nd, now, (1 if moved_dir else 0) - (1 if replaced_dir else 0))
        return dst if dst is not None and dst.nlink == 0 else None

    def readdir(self, parent: int, after: int, limit: int = 512) -> list[Entry]:
        """Entries with cookie > `after`, in cookie order (stable while entries change)."""
        rows = self.db.execute(
            "SELECT id, name, ino FROM dentries WHERE parent=? AND id>? ORDER BY id LIMIT ?",
            (parent, after, limit)).fetchall()
        return [Entry(cookie, name, self.get(ino)) for cookie, name, ino in rows]

    # ---- xattrs ----------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes | None:
        row = self.db.execute("SELECT value FROM xattrs WHERE ino=? AND name=?",
                              (ino, name)).fetchone()
        return row[0] if row else None

    def listxattr(self, ino: int) -> list[bytes]:
        return [r[0] for r in self.db.execute("SELECT name FROM xattrs WHERE ino=? ORDER BY name",
                                              (ino,))]

    def setxattr(self, node: Inode, name: bytes, value: bytes) -> None:
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", (node.ino, name, value))
            node.ctime_ns = time.time_ns()
            self._write(node, "ctime_ns")

    def removexattr(self, node: Inode, name: bytes) -> bool:
        with self.transaction():
            cur = self.db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (node.ino, name))
            if cur.rowcount:
                node.ctime_ns = time.time_ns()
                self._write(node, "ctime_ns")
        return cur.rowcount > 0

    # ---- reclaim and recovery ---------------------------------------------

    def orphans(self) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT ino FROM orphans")]

    def drop_inode(self, ino: int) -> None:
        """Forget an orphan for good, after its chunk files are gone."""
        with self.transaction():
            for table in ("inodes", "xattrs", "orphans", "dirty_data", "sealed"):
                self.db.execute(f"DELETE FROM {table} WHERE ino=?", (ino,))
        self._cache.pop(ino, None)

    def mark_dirty_data(self, ino: int) -> None:
        self.db.execute("INSERT OR IGNORE INTO dirty_data VALUES (?)", (ino,))

    def clear_dirty_data(self, ino: int) -> None:
        self.db.execute("DELETE FROM dirty_data WHERE ino=?", (ino,))

    def dirty_data(self) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT ino FROM dirty_data")]

    # ---- sealed files ------------------------------------------------------

    def seal(self, ino: int, sum_unit: int, sums: bytes) -> None:
        """Record a direct-committed file's checksums (xxh3-64 per `sum_unit` bytes)."""
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO sealed VALUES (?,?,?)", (ino, sum_unit, sums))

    def seal_of(self, ino: int) -> tuple[int, bytes] | None:
        """(sum_unit, packed little-endian xxh3-64 sums) of a sealed file, else None."""
        row = self.db.execute("SELECT sum_unit, sums FROM sealed WHERE ino=?", (ino,)).fetchone()
        return (row[0], row[1]) if row else None

    def is_sealed(self, ino: int) -> bool:
        return self.db.execute("SELECT 1 FROM sealed WHERE ino=?", (ino,)).fetchone() is not None

    def bytes_by_use(self) -> dict[str, int]:
        """Bytes of regular files by what wrote them: KV chunks, direct commits (sealed:
        checkpoints, models), and files written through the mount."""
        kv, sealed, total = self.db.execute(
            "SELECT (SELECT coalesce(sum(size), 0) FROM kv), "
            "(SELECT coalesce(sum(i.size), 0) FROM sealed s JOIN inodes i ON i.ino=s.ino "
            " WHERE s.ino NOT IN (SELECT ino FROM kv) AND i.nlink > 0), "
            "(SELECT coalesce(sum(size), 0) FROM inodes WHERE (mode & ?) = ? AND nlink > 0)",
            (stat.S_IFMT(0o177777), stat.S_IFREG)).fetchone()
        return {"kv": kv, "sealed": sealed, "files": total - kv - sealed}

    # ---- the KV chunk index ----------------------------------------------------
    # A KV chunk is a sealed regular inode with nlink 1 whose one reference is its
    # row in `kv` (not a directory entry).

    def kv_namespaces(self) -> list[tuple[str, int, int, int, int]]:
        """(ns, uid, gid, mode, capacity) of every namespace."""
        return self.db.execute("SELECT ns, uid, gid, mode, capacity FROM kv_ns").fetchall()

    def kv_set_namespace(self, ns: str, uid: int, gid: int, mode: int, capacity: int) -> None:
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO kv_ns VALUES (?,?,?,?,?)",
                            (ns, uid, gid, mode, capacity))

    def kv_drop_namespace(self, ns: str) -> None:
        with self.transaction():
            self.db.execute("DELETE FROM kv_ns WHERE ns=?", (ns,))

    def kv_rows(self) -> Iterator[tuple[str, bytes, int, int, int, int, bytes]]:
        """(ns, key, ino, size, atime, sum_unit, sums) of every chunk, least recently used
        first."""
        return iter(self.db.execute(
            "SELECT kv.ns, kv.key, kv.ino, kv.size, kv.atime, s.sum_unit, s.sums FROM kv "
            "JOIN sealed s ON s.ino=kv.ino ORDER BY kv.atime"))

    def kv_publish(self, ino: int, ns: str, key: bytes, size: int, atime: int) -> None:
        """Give a hidden file its index entry (EEXIST if the key is taken: first wins)."""
        node = self.get(ino)
        if node.nlink != 0:
            raise fail(errno.EINVAL, f"inode {ino} is already published")
        with self.transaction():
            try:
                self.db.execute("INSERT INTO kv VALUES (?,?,?,?,?)", (ns, key, ino, size, atime))
            except sqlite3.IntegrityError:
                raise fail(errno.EEXIST) from None
            self.db.execute("DELETE FROM orphans WHERE ino=?", (ino,))
            node.nlink, node.size = 1, size
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self._write(node, "nlink", "size", "mtime_ns", "ctime_ns")

    def kv_remove(self, entries: list[tuple[str, bytes, int]]) -> list[Inode]:
        """Drop (ns, key, ino) entries in one change; their inodes become orphans."""
        nodes = []
        with self.transaction():
            self.db.executemany("DELETE FROM kv WHERE ns=? AND key=?",
                                [(ns, key) for ns, key, _ in entries])
            now = time.time_ns()
            for _, _, ino in entries:
                node = self.get(ino)
                self._drop_link(node, now)
                nodes.append(node)
        return nodes

    def kv_touch(self, rows: list[tuple[int, str, bytes]]) -> None:
        """Write back access times: (atime, ns, key)."""
        with self.transaction():
            self.db.executemany("UPDATE kv SET atime=? WHERE ns=? AND key=?", rows)

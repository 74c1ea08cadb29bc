"""The embedded engine: one SQLite database in WAL mode on the metadata member.

WAL with synchronous=NORMAL: a commit reaches the WAL without an fsync, `sync`
fsyncs the WAL (any thread may), checkpoints fsync the database.  Changes are
savepoints inside one `BEGIN IMMEDIATE` transaction per group, so a failed change
is undone alone and a crash loses at most the last group, whole changes only.
Writers from other connections wait on SQLite's lock (busy timeout) and, past it,
are a `Conflict` that `txn` runs again.  The store's space on a member others fill
is `sqlite_space.Reserve`'s; SQLite's errors leave here as errnos.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from mxfs.meta import sql
from mxfs.meta.engine import Conflict, Engine, Row, Unusable, Where, expected, fail
from mxfs.meta.schema import SCHEMA_VERSION, SEQUENCES, TABLES
from mxfs.meta.sqlite_space import Reserve

log = logging.getLogger("mxfs.meta")

DB_NAME = "mxfs.db"
FILES = (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm")
_D = sql.SQLITE
# Sequences live in a table of their own here (PostgreSQL has real ones).
_SEQUENCES_DDL = "CREATE TABLE sequences(name TEXT PRIMARY KEY, value INTEGER NOT NULL)"

# Statements that bring a store of schema version N (the key) to N + 1.  Versions 1-3
# numbered inodes and entries with AUTOINCREMENT; 4 draws them from `sequences`,
# starting past every number the old counters handed out; 5 adds the change feed.
_MIGRATIONS = {
    1: ["CREATE TABLE sealed(ino INTEGER PRIMARY KEY, sum_unit INTEGER NOT NULL,"
        " sums BLOB NOT NULL)"],
    2: ["CREATE TABLE kv_ns(ns TEXT PRIMARY KEY, uid INTEGER NOT NULL, gid INTEGER NOT NULL,"
        " mode INTEGER NOT NULL, capacity INTEGER NOT NULL DEFAULT 0)",
        "CREATE TABLE kv(ns TEXT NOT NULL, key BLOB NOT NULL, ino INTEGER NOT NULL,"
        " size INTEGER NOT NULL, atime INTEGER NOT NULL, PRIMARY KEY(ns, key)) WITHOUT ROWID",
        "CREATE INDEX kv_by_ino ON kv(ino)"],
    3: [_SEQUENCES_DDL,
        "INSERT INTO sequences SELECT 'ino', max(coalesce((SELECT seq FROM sqlite_sequence"
        " WHERE name='inodes'), 0), coalesce((SELECT max(ino) FROM inodes), 0))",
        "INSERT INTO sequences SELECT 'dentry', max(coalesce((SELECT seq FROM sqlite_sequence"
        " WHERE name='dentries'), 0), coalesce((SELECT max(id) FROM dentries), 0))"],
    4: [*sql.create_table(_D, TABLES["changes"]), "INSERT INTO sequences VALUES ('change', 0)"],
}


def _code(e: sqlite3.Error) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF  # the primary code


def _overflow(e: OverflowError) -> OSError:
    return fail(errno.EOVERFLOW, f"a value is too large for the metadata store ({e})")


# get_many binds at most this many keys per statement (SQLite's limit is 32766), and
# pads shorter lists to a power of two, so few statement texts are made.
_MANY = 512


def _padded(keys: list[object]) -> list[object]:
    n = 1
    while n < len(keys):
        n *= 2
    return keys + [keys[-1]] * (n - len(keys))


def _is_full(e: sqlite3.Error) -> bool:
    return _code(e) == sqlite3.SQLITE_FULL or "disk is full" in str(e)


class SqliteEngine(Engine):
    kind = "sqlite"

    def __init__(self, path: str, readonly: bool = False, busy_ms: int = 5000) -> None:
        super().__init__()
        self.path = path
        self.readonly = readonly
        if not os.path.exists(path):
            raise Unusable(f"{path} does not exist")
        uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
        try:
            self.db = sqlite3.connect(uri, uri=True, isolation_level=None,
                                      check_same_thread=False)
            self.db.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
            if not readonly:
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error as e:
            raise Unusable(f"{path} cannot be opened ({e})") from None
        self._sql = sql.Statements(_D)  # statement texts by shape
        self._drawn: dict[str, int] = {}  # sequences drawn in the open group
        self._floor: dict[str, int] = {}  # the highest this connection ever drew
        self._group_open = False
        self._group_started = 0.0
        self._checkpointer: sqlite3.Connection | None = None  # (`checkpoint_apart`)
        self._wal_fd: int | None = None  # (`sync`)
        self._wal_lock = threading.Lock()
        self.reserve = Reserve(path)
        if not readonly:
            self.reserve.keep()

    # ---- making and opening ----------------------------------------------------

    @classmethod
    def create(cls, folder: str) -> SqliteEngine:
        """A new, empty store (the current schema) in `folder`; older files go."""
        path = os.path.join(folder, DB_NAME)
        for name in FILES:
            if os.path.exists(os.path.join(folder, name)):
                os.unlink(os.path.join(folder, name))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        eng = cls(path)
        eng.txn(eng._create_schema)
        return eng

    def _create_schema(self) -> None:
        for t in TABLES.values():
            for stmt in sql.create_table(_D, t):
                self.db.execute(stmt)
        self.db.execute(_SEQUENCES_DDL)
        self.db.executemany("INSERT INTO sequences VALUES (?, 0)", [(s,) for s in SEQUENCES])
        self.db.execute("INSERT INTO settings VALUES ('schema_version', ?)",
                        (str(SCHEMA_VERSION),))

    @classmethod
    def open(cls, folder: str, readonly: bool = False, busy_ms: int = 5000) -> SqliteEngine:
        """The store in `folder`, brought to the current schema unless `readonly`.
        Another writer's lock is waited for `busy_ms`, then it is a `Conflict`."""
        eng = cls(os.path.join(folder, DB_NAME), readonly=readonly, busy_ms=busy_ms)
        try:
            eng._migrate()
        except BaseException:
            eng.db.close()
            raise
        return eng

    def _migrate(self) -> None:
        try:
            row = self.db.execute("SELECT value FROM settings WHERE key='schema_version'"
                                  ).fetchone()
        except sqlite3.Error as e:
            raise Unusable(f"{self.path} is not an mxfs metadata store ({e})") from None
        version = int(row[0]) if row else 0
        if version < SCHEMA_VERSION and not self.readonly and version in _MIGRATIONS:
            def step() -> None:
                v = version
                while v < SCHEMA_VERSION:
                    for stmt in _MIGRATIONS[v]:
                        self.db.execute(stmt)
                    v += 1
                self.db.execute("UPDATE settings SET value=? WHERE key='schema_version'",
                                (str(v),))
            try:
                self.txn(step)
            except sqlite3.Error as e:
                raise Unusable(f"{self.path}: schema {version} cannot be migrated ({e})") \
                    from None
            log.info("metadata store %s: schema %d migrated to %d", self.path, version,
                     SCHEMA_VERSION)
            version = SCHEMA_VERSION
        if version != SCHEMA_VERSION:
            raise Unusable(f"{self.path}: metadata schema {version} is not {SCHEMA_VERSION}")

    # ---- statements ------------------------------------------------------------

    def _run(self, text: str, params: Sequence[object]) -> sqlite3.Cursor:
        try:
            return self.db.execute(text, params)
        except sqlite3.Error as e:
            raise self._error(e) from None
        except OverflowError as e:
            raise _overflow(e) from None

    def _error(self, e: sqlite3.Error) -> Exception:
        """What an SQLite error means to the caller: a conflict to run again, or an errno."""
        code = _code(e)
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "database is locked" in str(e):
            return Conflict(str(e))
        if _is_full(e):
            self.reserve.release()
            return fail(errno.ENOSPC, "the metadata member is full")
        if code == sqlite3.SQLITE_CONSTRAINT and "UNIQUE" in str(e):  # a `put`'s key
            return fail(errno.EEXIST, f"a row's key is taken ({e})")
        if code == sqlite3.SQLITE_READONLY or "readonly" in str(e):
            return fail(errno.EROFS, f"the metadata store cannot be written ({e})")
        return fail(errno.EIO, f"metadata store error ({e})")

    # ---- rows --------------------------------------------------------------------

    # The primitives below run on every namespace change: each is one statement, its
    # text cached by shape, errors mapped in place (no extra call per statement).

    def get(self, table: str, where: Where, columns: Sequence[str]) -> Row | None:
        key = ("get", table, tuple(where), tuple(columns))
        text = self._sql[key]
        try:
            row: Row | None = self.db.execute(text, tuple(where.values())).fetchone()
            return row
        except sqlite3.Error as e:
            raise self._error(e) from None
        except OverflowError as e:
            raise _overflow(e) from None

    def get_many(self, table: str, column: str, keys: Iterable[object],
                 columns: Sequence[str], where: Where | None = None) -> list[Row]:
        keys = list(dict.fromkeys(keys))
        where = where or {}
        out: list[Row] = []
        for i in range(0, len(keys), _MANY):
            part = _padded(keys[i:i + _MANY])
            text = self._sql[("get_many", table, column, tuple(columns), len(part),
                              tuple(where))]
            out += self._run(text, (*part, *where.values())).fetchall()
        return out

    def lengths(self, table: str, column: str, measured: Sequence[str],
                keys: Iterable[object] | None = None, per_row: int = 0) -> dict[Any, int]:
        if keys is None:
            rows = self._run(self._sql[("lengths", table, column, tuple(measured), -1,
                                         per_row)],
                             ()).fetchall()
        else:
            wanted, rows = list(dict.fromkeys(keys)), []
            for i in range(0, len(wanted), _MANY):
                part = _padded(wanted[i:i + _MANY])
                rows += self._run(self._sql[("lengths", table, column, tuple(measured),
                                             len(part), per_row)], part).fetchall()
        return {k: int(n or 0) for k, n in rows}

    def scan(self, table: str, columns: Sequence[str], where: Where | None = None, *,
             order: str | None = None, after: object = None,
             limit: int | None = None) -> Iterator[Row]:
        key, params = sql.scan_shape(table, columns, where or {}, order, after, limit)
        text = self._sql[key]
        cur = self._run(text, params)
        while True:
            try:
                rows = cur.fetchmany(1024)
            except sqlite3.Error as e:
                raise self._error(e) from None
            if not rows:
                return
            yield from rows

    def count(self, table: str, where: Where | None = None) -> int:
        where = where or {}
        return int(self._run(self._sql[("count", table, tuple(where))],
                             tuple(where.values())).fetchone()[0])

    def _write(self, key: sql.Shape, params: Sequence[object]) -> sqlite3.Cursor:
        if self.readonly:
            raise fail(errno.EROFS, "the metadata store is open read-only")
        text = self._sql[key]
        try:
            return self.db.execute(text, params)
        except sqlite3.Error as e:
            raise self._error(e) from None
        except OverflowError as e:
            raise _overflow(e) from None

    def insert(self, table: str, row: Mapping[str, object]) -> bool:
        return self._write(("insert", table, tuple(row)), tuple(row.values())).rowcount > 0

    def put(self, table: str, row: Mapping[str, object]) -> None:
        self._write(("put", table, tuple(row)), tuple(row.values()))

    def upsert(self, table: str, row: Mapping[str, object]) -> None:
        self._write(("upsert", table, tuple(row)), tuple(row.values()))

    def patch(self, table: str, where: Where, values: Mapping[str, object], *,
              expect: bool = False) -> None:
        cur = self._write(("update", table, tuple(where), tuple(values)),
                          (*values.values(), *where.values()))
        if expect:
            expected(cur.rowcount, table)

    def update(self, table: str, where: Where, values: Mapping[str, object]) -> int:
        return self._write(("update", table, tuple(where), tuple(values)),
                           (*values.values(), *where.values())).rowcount

    def update_many(self, table: str, where: Sequence[str], columns: Sequence[str],
                    rows: Iterable[Row]) -> None:
        self._writable()
        text = self._sql[("update", table, tuple(where), tuple(columns))]
        try:
            self.db.executemany(text, rows)
        except sqlite3.Error as e:
            raise self._error(e) from None

    def delete(self, table: str, where: Where) -> int:
        return self._write(("delete", table, tuple(where)), tuple(where.values())).rowcount

    def remove(self, table: str, where: Where, *, expect: bool = False) -> None:
        cur = self._write(("delete", table, tuple(where)), tuple(where.values()))
        if expect:
            expected(cur.rowcount, table)

    def remove_many(self, table: str, column: str, keys: Iterable[object]) -> None:
        keys = list(dict.fromkeys(keys))
        for i in range(0, len(keys), _MANY):
            part = _padded(keys[i:i + _MANY])
            self._write(("delete_many", table, column, len(part)), part)

    def next_id(self, sequence: str) -> int:
        """Counted in memory while the group holds SQLite's write lock (nobody else can
        draw meanwhile), written back with the group's commit: no statement per number.
        An undone change leaves a gap; numbers this connection drew are never drawn
        again by it, and a lost group's numbers never reached the disk."""
        if not self.in_change:
            raise RuntimeError("next_id outside a change")
        value = self._drawn.get(sequence)
        if value is None:
            value = self._stored(sequence)
        value += 1
        self._drawn[sequence] = self._floor[sequence] = value
        return value

    def _stored(self, sequence: str) -> int:
        row = self._run("SELECT value FROM sequences WHERE name=?", (sequence,)).fetchone()
        if row is None:
            raise ValueError(f"no sequence {sequence!r}")
        return max(int(row[0]), self._floor.get(sequence, 0))

    def sequences(self) -> dict[str, int]:
        """The last number each sequence handed out."""
        stored = dict(self._run("SELECT name, value FROM sequences", ()).fetchall())
        return {name: max(value, self._drawn.get(name, 0)) for name, value in stored.items()}

    def restart_sequences(self, values: Mapping[str, int]) -> None:
        """Go on from `values` (a copy's): never back below what was handed out."""
        if not self.in_change:
            raise RuntimeError("restart_sequences outside a change")
        for name, value in values.items():
            self._drawn[name] = max(self._drawn.get(name) or self._stored(name), value)

    def _write_sequences(self) -> None:
        for name, value in self._drawn.items():
            self.db.execute("UPDATE sequences SET value=? WHERE name=?", (value, name))

    # ---- changes -----------------------------------------------------------------

    def _begin(self) -> None:
        self._writable()
        try:
            if not self._group_open:
                self.db.execute("BEGIN IMMEDIATE")
                self._group_open = True
                self._group_started = time.monotonic()
            self.db.execute("SAVEPOINT change")
        except sqlite3.Error as e:
            raise self._error(e) from None

    def _settle(self) -> None:
        """Nothing to wait for: every statement ran when it was called."""

    def _end(self) -> None:
        try:
            self.db.execute("RELEASE change")
        except sqlite3.Error as e:
            raise self._error(e) from None
        if not self.grouped:
            self.commit()

    def _undo(self) -> None:
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK TO change")
                self.db.execute("RELEASE change")
            except sqlite3.Error:
                pass
            else:
                if not self.grouped:  # nothing else is in it: do not hold the lock on
                    try:
                        self.commit()
                    except OSError:
                        pass  # an earlier change's commit failed: it stays open, as then
                return
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if self._group_open:
            log.error("metadata store: the open group of changes was rolled back")
        self._group_open = False
        self._drawn.clear()
        self.on_group_lost()

    def commit(self) -> None:
        """End the current group.  A full metadata member gives back the reserve and
        tries once more; if that fails too the group stays open (if SQLite kept it) and
        the caller gets ENOSPC: the daemon goes on and commits once space returns."""
        if not self._group_open:
            return
        self.before_commit()
        if self.reserve.short():
            self.reserve.release()  # before SQLite fails (it may drop the whole group)
        for attempt in (1, 2):
            try:
                self._write_sequences()
                self.db.execute("COMMIT")
                self._group_open = False
                self._drawn.clear()
                return
            except sqlite3.Error as e:
                if not self.db.in_transaction:
                    self._group_open = False
                    self._drawn.clear()
                    log.error("metadata store: a group of changes was lost (%s)", e)
                    self.on_group_lost()
                    raise self._error(e) from None
                if attempt == 2 or not _is_full(e) or not self.reserve.release():
                    raise self._error(e) from None

    def sync(self) -> None:
        """fsync the WAL through a descriptor kept from its first sync to close: an open
        each time failed with the daemon's descriptors gone (a tenant's directory fsync
        with them).  The WAL stays the same file while this connection is open (SQLite
        removes it at the last close, checkpoints reuse or truncate it in place).  Under
        its lock: syncs run in worker threads, and a close meanwhile would leave one
        fsyncing a closed (or reused) descriptor number."""
        with self._wal_lock:
            if self._wal_fd is None:
                try:
                    self._wal_fd = os.open(self.path + "-wal", os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    return
            os.fsync(self._wal_fd)

    def group_age(self) -> float | None:
        return time.monotonic() - self._group_started if self._group_open else None

    # ---- the store as a whole ---------------------------------------------------

    def integrity(self) -> list[str]:
        try:
            rows = self.db.execute("PRAGMA integrity_check").fetchall()
        except sqlite3.Error as e:
            return [f"sqlite: {e}"]
        return [f"sqlite: {r[0]}" for r in rows if r[0] != "ok"]

    def watch_space(self) -> bool:
        return self.reserve.watch()

    def copy_to(self, target: str) -> None:
        """An online, consistent copy of the committed store into the new file `target`
        (SQLite's backup API, through a read connection of its own: any thread)."""
        src = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            dst = sqlite3.connect(target)
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error as e:  # the target's disk full, say: an OSError like any
                raise OSError(errno.EIO, f"copying the metadata store to {target}: {e}") from e
            finally:
                dst.close()
        finally:
            src.close()

    def dump_sql(self) -> Iterator[str]:
        """SQLite's own SQL text of the committed store (`.sql` dumps)."""
        src = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            yield from src.iterdump()
        finally:
            src.close()

    def checkpoint_apart(self) -> Callable[[], None] | None:
        """SQLite checkpoints in the commit that takes the WAL past 1,000 pages: it
        copies them into the database and fsyncs it, on the daemon's one thread.  The
        call returned checkpoints (PASSIVE: never waiting for this connection's group)
        from a connection of its own whenever the WAL changed since its last run, so a
        commit's has little left to copy; SQLite's own stays, as the one that lets the
        WAL start again from its head (a checkpoint apart leaves this connection's next
        group reading frames, and the WAL grew past the room kept after its end for a
        full member, `sqlite_space`: creates on a full member failed), and the WAL cut
        back at each restart had to find new blocks (on a full member a group was
        lost)."""
        if self.readonly:
            return None
        other = self._checkpointer = sqlite3.connect(self.path, isolation_level=None,
                                                     check_same_thread=False)
        # (its files opened now, not at its first checkpoint: the daemon's descriptors
        # settle at mount, and a count of them after a user's requests means theirs)
        other.execute("SELECT count(*) FROM sqlite_master").fetchone()
        last: list[tuple[int, int] | None] = [None]  # the WAL's (size, mtime) then

        def checkpoint() -> None:
            try:
                st = os.stat(self.path + "-wal")
                if (st.st_size, st.st_mtime_ns) == last[0]:
                    return  # (nothing written since)
                other.execute("PRAGMA wal_checkpoint(PASSIVE)")
                last[0] = (st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                pass
            except sqlite3.Error as e:  # (the reserve is the committing thread's to give)
                if not _is_full(e):
                    raise fail(errno.EIO, f"metadata store checkpoint failed ({e})") from None
        return checkpoint

    def close(self) -> None:
        try:
            self.commit()
        finally:
            self.db.close()
            if self._checkpointer is not None:
                self._checkpointer.close()
            with self._wal_lock:
                if self._wal_fd is not None:
                    os.close(self._wal_fd)
                    self._wal_fd = None


def file_problem(path: str, thorough: bool = True) -> tuple[str | None, str | None]:
    """(why the SQLite store file at `path` cannot be used or None, its pool uuid).

    `PRAGMA quick_check` reads every page (a 378 MB store: 2 s cold, and it grows with
    what tenants store); without `thorough` it runs only on a store its last daemon
    did not close cleanly (setting "clean", written after its last sync), where a
    crash or a lost write may have left damage.  A store closed clean is read only as
    far as its header, schema and settings: damage that came at rest shows as an
    error where it lies, and `mxfs fsck` checks it all."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            clean = None if thorough else db.execute(
                "SELECT value FROM settings WHERE key='clean'").fetchone()
            if clean is None or clean[0] != "1":
                (check,) = db.execute("PRAGMA quick_check").fetchone()
                if check != "ok":
                    return f"damaged ({check})", None
            row = db.execute("SELECT value FROM settings WHERE key='pool_uuid'").fetchone()
        finally:
            db.close()
    except sqlite3.Error as e:
        return f"unreadable ({e})", None
    if row is None:
        return "not an mxfs metadata store", None
    return None, row[0]


def load_sql(text: str, path: str) -> None:
    """Build the SQLite file `path` (new, empty) from a `.sql` dump's text."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.executescript(text)
    except sqlite3.Error as e:
        raise ValueError(f"not a metadata dump ({e})") from None
    finally:
        db.close()

"""The shared engine: PostgreSQL through psycopg 3.

The store is a set of tables (`meta/schema.py`) and two sequences in the database the
URL names (a database of its own: the table names are plain).  Changes are
savepoints inside one REPEATABLE READ transaction per group; a serialization failure
or deadlock (SQLSTATE 40001, 40P01) rolls the transaction back and is a `Conflict`
that `txn` runs again.  Commits are durable when the server says so
(synchronous_commit), so `sync` has nothing to do.  A lost connection is EIO for the
change (and the group) it held, and is made again at the next change: nothing the
server did not commit is ever taken as done.  The SQL is `meta/sql.py`'s, which
CockroachDB and YugabyteDB accept too.  Credentials come from libpq's own places
(`~/.pgpass`, `PGPASSFILE`, a service file), never from a superblock.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import psycopg
from psycopg import errors as pgerr

from mxfs.meta import sql
from mxfs.meta.engine import Conflict, Engine, Row, Unusable, Where, fail
from mxfs.meta.schema import SCHEMA_VERSION, SEQUENCES, TABLES

log = logging.getLogger("mxfs.meta")

_D = sql.POSTGRES
# Each nextval hands this many numbers to the connection: one round trip per block.
BLOCK = 64
# 55P03: a lock not granted within lock_timeout (another writer holds the row)
_CONFLICTS = (pgerr.SerializationFailure, pgerr.DeadlockDetected, pgerr.LockNotAvailable)


def _seq(name: str) -> str:
    return f"mxfs_seq_{name}"


def public(url: str) -> str:
    """`url` without a password (in its user part or as a parameter): what a
    superblock may record and a message may show."""
    u = urlsplit(url)
    netloc = u.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}@{host}"
    query = [(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True) if k != "password"]
    out = f"{u.scheme}://{netloc}{u.path}"  # (urlunsplit drops an empty host's //)
    return out + (f"?{urlencode(query, safe='/')}" if query else "")


def _line(e: BaseException) -> str:
    """libpq's message on one line (it spreads hints over several)."""
    return " ".join(str(e).split())


class PgEngine(Engine):
    kind = "postgresql"

    def __init__(self, url: str, readonly: bool = False, busy_ms: int = 5000) -> None:
        super().__init__()
        self.url = url
        self.readonly = readonly
        self.busy_ms = busy_ms
        self._poisoned = False  # a conflict: the transaction's snapshot is spent
        self.conn: psycopg.Connection[Any] | None = None
        self._sql = sql.Statements(_D)  # statement texts by shape
        self._blocks: dict[str, tuple[int, int]] = {}  # sequence: (next, end) in hand
        self._group_open = False
        self._group_started = 0.0
        self._connect()

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except psycopg.Error as e:
            raise Unusable(f"the metadata server {public(self.url)} cannot be reached "
                           f"({_line(e)})") from None
        if self.readonly:
            conn.execute("SET default_transaction_read_only = on")
        # Another writer's row lock is waited for busy_ms, then it is a conflict.
        conn.execute(f"SET lock_timeout = {max(int(self.busy_ms), 1)}")
        self.conn = conn
        return conn

    def _live(self) -> psycopg.Connection[Any]:
        """The connection, made again if the last one was lost (never inside a group)."""
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            if self._group_open:
                raise fail(errno.EIO, "the metadata server's connection was lost")
            try:
                return self._connect()
            except Unusable as e:
                raise fail(errno.EIO, str(e)) from None
        return conn

    # ---- making and opening ----------------------------------------------------

    @classmethod
    def create(cls, url: str) -> PgEngine:
        """A new, empty store in the database at `url`; a store there before is gone."""
        eng = cls(url)
        eng.txn(eng._create_schema)
        return eng

    def _create_schema(self) -> None:
        for t in TABLES.values():
            self._exec(f"DROP TABLE IF EXISTS {t.name}")
        for s in SEQUENCES:
            self._exec(f"DROP SEQUENCE IF EXISTS {_seq(s)}")
        for t in TABLES.values():
            for stmt in sql.create_table(_D, t):
                self._exec(stmt)
        for s in SEQUENCES:
            self._exec(f"CREATE SEQUENCE {_seq(s)} INCREMENT BY {BLOCK}")
        self._exec("INSERT INTO settings VALUES ('schema_version', %s)", (str(SCHEMA_VERSION),))
        self._blocks.clear()

    @classmethod
    def open(cls, url: str, readonly: bool = False, busy_ms: int = 5000) -> PgEngine:
        eng = cls(url, readonly=readonly, busy_ms=busy_ms)
        try:
            row = eng._exec("SELECT value FROM settings WHERE key='schema_version'").fetchone()
        except OSError as e:
            eng.close()
            raise Unusable(f"{public(url)} holds no mxfs metadata store ({e})") from None
        version = int(row[0]) if row else 0
        if version != SCHEMA_VERSION:
            eng.close()
            raise Unusable(f"{public(url)}: metadata schema {version} is not {SCHEMA_VERSION}")
        return eng

    # ---- statements ------------------------------------------------------------

    def _exec(self, text: str, params: Sequence[object] = ()) -> psycopg.Cursor[Any]:
        conn = self._live()
        try:
            return conn.execute(text, params)  # type: ignore[arg-type]
        except psycopg.Error as e:
            raise self._error(e) from None

    def _error(self, e: psycopg.Error) -> Exception:
        if isinstance(e, _CONFLICTS):
            self._poisoned = True
            return Conflict(_line(e))
        if isinstance(e, pgerr.DiskFull | pgerr.OutOfMemory | pgerr.InsufficientResources):
            return fail(errno.ENOSPC, f"the metadata server is full ({_line(e)})")
        if isinstance(e, pgerr.ReadOnlySqlTransaction):
            return fail(errno.EROFS, "the metadata store is open read-only")
        if isinstance(e, pgerr.NumericValueOutOfRange | psycopg.DataError):
            return fail(errno.EOVERFLOW, f"a value is too large for the metadata store "
                        f"({_line(e)})")
        if isinstance(e, psycopg.OperationalError):
            log.error("metadata server %s: %s", public(self.url), _line(e))
        return fail(errno.EIO, f"metadata store error ({_line(e)})")

    def _writable(self) -> None:
        if self.readonly:
            raise fail(errno.EROFS, "the metadata store is open read-only")

    # ---- rows --------------------------------------------------------------------

    def get(self, table: str, where: Where, columns: Sequence[str]) -> Row | None:
        text = self._sql[("get", table, tuple(where), tuple(columns))]
        return self._exec(text, tuple(where.values())).fetchone()

    def scan(self, table: str, columns: Sequence[str], where: Where | None = None, *,
             order: str | None = None, after: object = None,
             limit: int | None = None) -> Iterator[Row]:
        key, params = sql.scan_shape(table, columns, where or {}, order, after, limit)
        text = self._sql[key]
        yield from self._exec(text, params).fetchall()

    def count(self, table: str, where: Where | None = None) -> int:
        where = where or {}
        row = self._exec(self._sql[("count", table, tuple(where))],
                         tuple(where.values())).fetchone()
        return int(row[0]) if row else 0

    def insert(self, table: str, row: Mapping[str, object]) -> bool:
        self._writable()
        return self._exec(self._sql[("insert", table, tuple(row))],
                          tuple(row.values())).rowcount > 0

    def upsert(self, table: str, row: Mapping[str, object]) -> None:
        self._writable()
        self._exec(self._sql[("upsert", table, tuple(row))], tuple(row.values()))

    def update(self, table: str, where: Where, values: Mapping[str, object]) -> int:
        self._writable()
        return self._exec(self._sql[("update", table, tuple(where), tuple(values))],
                          (*values.values(), *where.values())).rowcount

    def update_many(self, table: str, where: Sequence[str], columns: Sequence[str],
                    rows: Iterable[Row]) -> None:
        self._writable()
        text = self._sql[("update", table, tuple(where), tuple(columns))]
        conn = self._live()
        try:
            with conn.cursor() as cur:
                cur.executemany(text, list(rows))  # type: ignore[arg-type]
        except psycopg.Error as e:
            raise self._error(e) from None

    def delete(self, table: str, where: Where) -> int:
        self._writable()
        return self._exec(self._sql[("delete", table, tuple(where))],
                          tuple(where.values())).rowcount

    def next_id(self, sequence: str) -> int:
        """From a block of BLOCK numbers drawn with one nextval: sequences are outside
        transactions, so no number is handed out twice, by any connection, ever."""
        self._writable()
        nxt, end = self._blocks.get(sequence, (0, 0))
        if nxt >= end:
            row = self._exec("SELECT nextval(%s)", (_seq(sequence),)).fetchone()
            assert row is not None
            nxt, end = int(row[0]), int(row[0]) + BLOCK
        self._blocks[sequence] = (nxt + 1, end)
        return nxt

    def sequences(self) -> dict[str, int]:
        """An upper bound of the numbers each sequence handed out."""
        out = {}
        for s in SEQUENCES:
            row = self._exec(f"SELECT last_value, is_called FROM {_seq(s)}").fetchone()
            assert row is not None
            out[s] = int(row[0]) + BLOCK - 1 if row[1] else 0
        return out

    def restart_sequences(self, values: Mapping[str, int]) -> None:
        self._writable()
        have = self.sequences()
        for name, value in values.items():
            if value > have.get(name, 0):
                self._exec("SELECT setval(%s, %s)", (_seq(name), value))
        self._blocks.clear()

    # ---- changes -----------------------------------------------------------------

    def _begin(self) -> None:
        self._writable()
        if not self._group_open:
            self._exec("BEGIN ISOLATION LEVEL REPEATABLE READ")
            self._group_open = True
            self._group_started = time.monotonic()
        self._exec("SAVEPOINT change")

    def _end(self) -> None:
        self._exec("RELEASE SAVEPOINT change")
        if not self.grouped:
            self.commit()

    def _undo(self) -> None:
        conn = self.conn
        if conn is not None and not conn.broken and not conn.closed and self._group_open:
            if not self._poisoned:
                try:
                    conn.execute("ROLLBACK TO SAVEPOINT change")
                    conn.execute("RELEASE SAVEPOINT change")
                    if not self.grouped:
                        self.commit()
                    return
                except psycopg.Error:
                    pass
            try:
                conn.execute("ROLLBACK")
            except psycopg.Error:
                pass
        if self._group_open and self.grouped:
            log.error("metadata store: the open group of changes was rolled back")
        self._group_open = self._poisoned = False
        self.on_group_lost()

    def commit(self) -> None:
        if not self._group_open:
            return
        conn = self.conn
        try:
            if conn is None or conn.broken or conn.closed:
                raise fail(errno.EIO, "the metadata server's connection was lost")
            conn.execute("COMMIT")
        except psycopg.Error as e:
            self._group_open = self._poisoned = False
            err = self._error(e)
            self._poisoned = False
            if self.grouped:
                log.error("metadata store: a group of changes was lost (%s)", err)
            self.on_group_lost()
            raise err from None
        except OSError:
            self._group_open = False
            log.error("metadata store: a group of changes was lost (the connection went)")
            self.on_group_lost()
            raise
        self._group_open = False

    def sync(self) -> None:
        """Nothing to do: the server made each commit durable before answering."""

    def group_age(self) -> float | None:
        return time.monotonic() - self._group_started if self._group_open else None

    # ---- the store as a whole ---------------------------------------------------

    def integrity(self) -> list[str]:
        return []

    def close(self) -> None:
        try:
            if self.conn is not None and not self.conn.closed and not self.conn.broken:
                self.commit()
        finally:
            if self.conn is not None:
                self.conn.close()

"""The shared engine: PostgreSQL through psycopg 3.

The store is a set of tables (`meta/schema.py`) and two sequences in the database the
URL names (a database of its own: the table names are plain).  Changes are
savepoints inside one REPEATABLE READ transaction per group; a serialization failure
or deadlock (SQLSTATE 40001, 40P01), or a lock waited for past busy_ms, rolls the
transaction back and is a `Conflict` that `txn` runs again; a statement alone (no
group open) that waits out a lock is EAGAIN, the caller's to try again.  Commits are
durable when the server says so (synchronous_commit), so `sync` has nothing to do.

A connection lost with nothing in flight is made again at once and the statement run
again.  One lost inside a group loses the group (EIO, `on_group_lost`), and one that
cannot be made again means the server is *away*: one error line is logged, every
change and every commit fails with EIO at once (no request waits on the network), and
a thread dials again every RETRY_S; the first request after it got through logs one
line and goes on.  A lost group holds commits off for RETRY_S at least, so a caller
that fsyncs right after its change hears of the loss: nothing the server did not
commit is taken as done.  Every wait is bounded: connect_timeout, TCP keepalives and
tcp_user_timeout (unless the URL sets its own), lock_timeout and statement_timeout, and
on the client every wait for an answer (WAIT_S: a Unix socket has no TCP timeouts).
Every hold is bounded too: a process that stops inside a transaction (SIGSTOP, a hung
thread) has it ended by the server after IDLE_TXN_MS, so the rows it locked (the
lease's, a directory's) are not held from everyone else for as long as it sleeps.
The connection is in pipeline mode: a change's writes that give no answer (`put`,
`patch`, `remove`, `upsert`) and its SAVEPOINT are sent without waiting, and waited for
with the next statement that answers, or at the change's end with its RELEASE
(`_settle`), so their errors still fail that change, undone whole; a change costs the
round trips of its reads and one more.  COMMIT is always waited for, and a COMMIT the
server answered with ROLLBACK is a lost group.

While the store is the pool's sole writer (`sole_writer`: a daemon holding the lease)
a change takes no savepoint, which spares it two statements: none of its writes can
fail but by a fault of the server, which loses the group anyway (no other writer
takes a name or conflicts, and integers too large are refused before they are sent).
A change that fails before it wrote (a rule's error) leaves the group be; one that
fails after loses its group.  The SQL is `meta/sql.py`'s, which
CockroachDB and YugabyteDB accept too.  Credentials come from libpq's own places
(`~/.pgpass`, `PGPASSFILE`, a service file), never from a superblock.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import psycopg
from psycopg import errors as pgerr
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from mxfs.meta import sql
from mxfs.meta.engine import Conflict, Engine, Row, Unusable, Where, expected, fail
from mxfs.meta.schema import SCHEMA_VERSION, SEQUENCES, TABLES

log = logging.getLogger("mxfs.meta")

_D = sql.POSTGRES
# Each nextval hands this many numbers to the connection: one round trip per block.
BLOCK = 64
# 55P03: a lock not granted within lock_timeout (another writer holds the row)
_CONFLICTS = (pgerr.SerializationFailure, pgerr.DeadlockDetected, pgerr.LockNotAvailable)
# Seconds between tries to reach a server that went away; also how long a lost group
# holds commits off.
RETRY_S = 1.0
# No statement runs longer than this (a backstop: row locks wait busy_ms).
STATEMENT_MS = 60_000
# A transaction left idle this long is ended by the server, its locks with it: a group
# commits within GROUP_COMMIT_S (50 ms), so only a stopped or hung process gets near it,
# and it stays well inside a lease's TTL (30 s), so a node that took a stopped holder's
# lease over is not kept from its rows for longer than the takeover itself waited.
IDLE_TXN_MS = 10_000
# No wait on the server's answer lasts longer than this (`_Bounded`).
WAIT_S = STATEMENT_MS / 1000 + 5
# Statements sent without waiting, at most, before the engine waits for them anyway.
QUEUE = 256
# get_many binds at most this many keys per statement (one array parameter).
MANY = 1024
# A full server is logged at most once in this many seconds (each change is ENOSPC).
FULL_QUIET_S = 60.0
# libpq's waits, unless the URL sets them: connecting, and a server that stops answering
# on TCP mid-statement (keepalives while it computes, tcp_user_timeout while it is sent).
_WAITS = {"connect_timeout": "5", "keepalives": "1", "keepalives_idle": "10",
          "keepalives_interval": "5", "keepalives_count": "3", "tcp_user_timeout": "15000"}

Conn = psycopg.Connection[Any]


class _Bounded(psycopg.Connection[Any]):
    """A connection whose every wait for the server ends within WAIT_S.  On a Unix
    socket libpq's own bounds (keepalives, tcp_user_timeout) do not apply, and a server
    that stops (SIGSTOP, a hung host) neither answers nor closes it; nor does it run
    its statement_timeout.  Past the bound the connection is closed: what it was in the
    middle of is unknown, so it is lost, and the server is away until a redial."""

    mxfs_wait_s = WAIT_S  # (`PgEngine.bound_waits`)

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        bound = min(WAIT_S, self.mxfs_wait_s)
        try:
            return super().wait(gen, interval, bound if timeout is None else timeout)
        except pgerr._WaitTimeout:
            self.pgconn.finish()
            raise psycopg.OperationalError(f"no answer from the server in {bound:g} s") \
                from None


def _seq(name: str) -> str:
    return f"mxfs_seq_{name}"


# A change feed row is numbered under a lock held to its commit: a number is drawn only
# after every smaller one committed (or was rolled back), so a follower that read up to
# N never misses a row numbered below N that commits later.
_FEED_LOCK = 0x6D786673  # "mxfs"
_PUBLISH = ("INSERT INTO changes (seq, node, epoch, at, body) SELECT "
            f"nextval('{_seq('change')}'), %s, %s, %s, %s FROM "
            "(SELECT pg_advisory_xact_lock(%s)) AS held")


# libpq's parameters that hold a secret (the server's password, the client key's
# passphrase); a file's path (passfile, sslkey) is no secret: its mode guards it.
SECRET_PARAMS = frozenset({"password", "sslpassword"})


def public(url: str) -> str:
    """`url` without its secrets (a password in its user part, SECRET_PARAMS): what a
    superblock (mode 0644) may record and a message may show."""
    u = urlsplit(url)
    netloc = u.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}@{host}"
    query = [(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True)
             if k not in SECRET_PARAMS]
    out = f"{u.scheme}://{netloc}{u.path}"  # (urlunsplit drops an empty host's //)
    return out + (f"?{urlencode(query, safe='/')}" if query else "")


def _line(e: BaseException) -> str:
    """libpq's message on one line (it spreads hints over several)."""
    return " ".join(str(e).split())


def _lock_timeout_as_cancel(e: psycopg.Error) -> bool:
    """A lock_timeout the server reported as a cancel at the user's request (57014, not
    55P03: its timer fired as the lock was granted, seen once in CI with a 1 ms
    timeout); mxfs cancels no statement of its own, so a cancel that does not name
    the statement timeout (STATEMENT_MS) is taken as the conflict it was."""
    if not isinstance(e, pgerr.QueryCanceled):
        return False
    return "statement timeout" not in (e.diag.message_primary or "")


def _gone(conn: Conn | None) -> bool:
    return conn is None or conn.closed or conn.broken


# The fence a group passes before it commits (`PgEngine.set_fence`).
_FENCE = "UPDATE settings SET value = value WHERE key = %s AND value = %s"


def _pipe(conn: Conn) -> psycopg.Pipeline:
    pipe: psycopg.Pipeline = conn.mxfs_pipeline[1]  # type: ignore[attr-defined]
    return pipe


def _cur(conn: Conn) -> psycopg.Cursor[Any]:
    """The connection's one cursor: a new one per statement costs more than the
    statement (each answer is taken before the next statement that answers)."""
    cur: psycopg.Cursor[Any] = conn.mxfs_cursor  # type: ignore[attr-defined]
    return cur


def _close(conn: Conn) -> None:
    """Leave pipeline mode (quietly: the connection may be broken) and close."""
    held = getattr(conn, "mxfs_pipeline", None)
    if held is not None:
        conn.mxfs_pipeline = None  # type: ignore[attr-defined]
        try:
            held[0].__exit__(None, None, None)
        except Exception:
            pass
    conn.close()


def _fits(params: Iterable[object]) -> None:
    """Integers past bigint are EOVERFLOW before they are sent: at the server they
    would fail the transaction (the whole group, without a savepoint)."""
    for p in params:
        if type(p) is int and not -(1 << 63) <= p < 1 << 63:
            raise fail(errno.EOVERFLOW, f"{p} is too large for the metadata store")


def _drain(conn: Conn) -> None:
    """After an error: take every answer still due, so the pipeline is usable again, and
    forget every prepared statement, here and on the server.  (psycopg prepares a
    statement after a few runs; in a pipeline an error, or the ROLLBACK after it, can
    leave it counting one as made that the server skipped or deallocated: "prepared
    statement ... does not exist" on its next run.)"""
    if _gone(conn):
        return
    try:
        _pipe(conn).sync()
    except psycopg.Error:
        pass
    try:
        conn._prepared.clear()  # (psycopg's own record of them)
        conn.execute("DEALLOCATE ALL")
        _pipe(conn).sync()
    except psycopg.Error:
        pass


class _Redial:
    """Connects in a thread of its own, every RETRY_S, until it gets through, so that
    requests meanwhile fail at once instead of each waiting on connect_timeout."""

    def __init__(self, connect: Callable[[], Conn], delay: float) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._conn: Conn | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(delay,), name="mxfs-pg-redial",
                         daemon=True).start()

    def _run(self, delay: float) -> None:
        while not self._stop.wait(delay):
            delay = RETRY_S
            try:
                conn = self._connect()
            except Exception:  # Unusable, or anything else: the thread must not end
                continue
            with self._lock:
                if self._stop.is_set():
                    _close(conn)
                else:
                    self._conn = conn
            return

    def take(self) -> Conn | None:
        """The connection, once one was made (then the thread is done)."""
        with self._lock:
            conn, self._conn = self._conn, None
        return conn

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            if self._conn is not None:
                _close(self._conn)
                self._conn = None


class PgListener:
    """A connection of its own, waiting for NOTIFY on one channel (`location.listen`).
    A plain connection: its waits are bounded by the caller's timeout, and whoever
    reads the rows after each wait finds a server that stopped answering."""

    def __init__(self, url: str, channel: str) -> None:
        have = conninfo_to_dict(url)
        waits = {k: v for k, v in _WAITS.items() if k not in have}
        try:
            self.conn = psycopg.Connection.connect(
                make_conninfo(url, **waits, application_name="mxfs change feed"),
                autocommit=True)
            self.conn.execute(f"LISTEN {channel}")  # (an identifier: `change_feed.channel`)
        except psycopg.Error as e:
            raise Unusable(f"the metadata server {public(url)} cannot be reached "
                           f"({_line(e)})") from None

    def wait(self, timeout: float) -> None:
        try:
            for _ in self.conn.notifies(timeout=timeout, stop_after=1):
                pass
        except psycopg.Error as e:
            raise fail(errno.EIO, f"the change feed's connection was lost ({_line(e)})") \
                from None

    def close(self) -> None:
        self.conn.close()


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
        self._redial: _Redial | None = None  # set while the server is away
        self._away = ""  # why it is away, for each refused request
        self._fence: tuple[str, str] | None = None  # (settings key, value): `set_fence`
        self._full_said = -FULL_QUIET_S  # when "full" was last logged
        self._queued = 0  # statements sent and not yet waited for
        self._savepoints = True  # each change undoable alone (off: `sole_writer`)
        self._wrote = False  # the change running wrote (without a savepoint: no undo)
        # The change's `expect` writes: a cursor of each, with its table, checked by
        # `_settle` once their answers are in.
        self._expects: list[tuple[psycopg.Cursor[Any], str]] = []
        self._wait_s = WAIT_S  # the longest wait for an answer (`bound_waits`)
        self.conn = self._connect()

    def _connect(self) -> Conn:
        """A new connection, set up; `Unusable` if the server cannot be reached."""
        have = conninfo_to_dict(self.url)
        waits = {k: v for k, v in _WAITS.items() if k not in have}
        try:
            conn = _Bounded.connect(make_conninfo(self.url, **waits), autocommit=True)
            conn.mxfs_wait_s = self._wait_s
            if self.readonly:
                conn.execute("SET default_transaction_read_only = on")
            # Another writer's row lock is waited for busy_ms, then it is a conflict.
            conn.execute(f"SET lock_timeout = {max(int(self.busy_ms), 1)}")
            conn.execute(f"SET statement_timeout = {STATEMENT_MS}")
            conn.execute(f"SET idle_in_transaction_session_timeout = {IDLE_TXN_MS}")
            held = conn.pipeline()
            conn.mxfs_pipeline = (held, held.__enter__())  # type: ignore[attr-defined]
            conn.mxfs_cursor = conn.cursor()  # type: ignore[attr-defined]
        except psycopg.Error as e:
            raise Unusable(f"the metadata server {public(self.url)} cannot be reached "
                           f"({_line(e)})") from None
        return conn

    def bound_waits(self, seconds: float) -> None:
        if isinstance(self.conn, _Bounded):
            self.conn.mxfs_wait_s = seconds
        self._wait_s = seconds

    def _live(self) -> Conn:
        """The connection; one that was lost is made again outside a group.  While the
        server is away: EIO at once, until the redial thread got through."""
        conn = self.conn
        if not _gone(conn):
            assert conn is not None
            return conn
        if self._group_open:  # (a loss seen drops the group; this is a backstop)
            self._went_away(f"the metadata server {public(self.url)} went away",
                            lost_group=True)
            self._lose_group(None)
            raise fail(errno.EIO, self._away)
        if self._redial is None:  # lost just now, nothing in flight: once more at once
            if conn is not None:
                _close(conn)
            try:
                self.conn = self._connect()
                return self.conn
            except Unusable as e:
                self._went_away(str(e), lost_group=False)
        assert self._redial is not None
        conn = self._redial.take()
        if conn is None:
            raise fail(errno.EIO, self._away)
        self._redial, self._away, self.conn = None, "", conn
        log.info("metadata server %s is back: changes are taken again", public(self.url))
        return conn

    def _went_away(self, why: str, lost_group: bool) -> None:
        """The server cannot be reached (`why`, a sentence): log it once, refuse changes,
        dial again."""
        if self._redial is not None:
            return
        self._away = f"{why}; changes fail until it is back"
        log.error("%s%s", self._away,
                  "; the open group of changes was lost" if lost_group else "")
        self._queued = 0
        if self.conn is not None:
            _close(self.conn)
        self._redial = _Redial(self._connect, RETRY_S)

    def _lost(self, conn: Conn, e: psycopg.Error) -> bool:
        """Was `e` the connection going?  Then the server is away, and a group it held
        is lost."""
        if not _gone(conn):
            return False
        lost_group = self._group_open
        self._went_away(f"the metadata server {public(self.url)} went away ({_line(e)})",
                        lost_group)
        if lost_group:
            self._lose_group(None)
        return True

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
        if version == 4 and not readonly:
            try:
                eng.txn(eng._add_feed)
                version = SCHEMA_VERSION
                log.info("metadata store %s: schema 4 migrated to %d", public(url), version)
            except OSError as e:
                eng.close()
                raise Unusable(f"{public(url)}: schema 4 cannot be migrated ({e})") from None
        if version != SCHEMA_VERSION:
            eng.close()
            raise Unusable(f"{public(url)}: metadata schema {version} is not {SCHEMA_VERSION}")
        return eng

    def _add_feed(self) -> None:
        """Schema 4 -> 5: the change feed (one migrator at a time: the table lock)."""
        self._exec("LOCK TABLE settings IN EXCLUSIVE MODE")
        row = self._exec("SELECT value FROM settings WHERE key='schema_version'").fetchone()
        if row is not None and int(row[0]) >= 5:
            return
        for stmt in sql.create_table(_D, TABLES["changes"]):
            self._exec(stmt)
        self._exec(f"CREATE SEQUENCE {_seq('change')} INCREMENT BY {BLOCK}")
        self._exec("UPDATE settings SET value=%s WHERE key='schema_version'",
                   (str(SCHEMA_VERSION),))

    # ---- statements ------------------------------------------------------------

    def _exec(self, text: str, params: Sequence[object] = (), *,
              again: bool = False) -> psycopg.Cursor[Any]:
        """Run one statement and wait for its answer (and for every statement sent
        before it); `again`: it only reads (or begins), so after a connection lost
        outside a group it is run once more on a new one."""
        conn = self._live()
        try:
            cur = _cur(conn).execute(text, params)
            _pipe(conn).sync()
            self._queued = 0
            return cur
        except psycopg.Error as e:
            self._queued = 0
            if again and not self._group_open and _gone(conn):
                return self._retry(text, params)
            _drain(conn)
            raise self._error(e, conn) from None

    def _retry(self, text: str, params: Sequence[object]) -> psycopg.Cursor[Any]:
        conn = self._live()  # (EIO, the server away, if it cannot be made again)
        try:
            cur = _cur(conn).execute(text, params)
            _pipe(conn).sync()
            return cur
        except psycopg.Error as e:
            _drain(conn)
            raise self._error(e, conn) from None

    def _send(self, text: str, params: Sequence[object] = (),
              expect: str | None = None) -> None:
        """Send a statement without waiting for it (inside a change; outside one it is
        waited for at once).  Its error comes with a later statement's, or `_settle`'s.
        `expect`: its table; a row must match, checked by `_settle`."""
        _fits(params)
        self._wrote = True
        if not self._depth:
            cur = self._exec(text, params)
            if expect is not None:
                expected(cur.rowcount, expect)
            return
        conn = self._live()
        try:
            if expect is None:
                _cur(conn).execute(text, params)
            else:
                self._expects.append((conn.cursor().execute(text, params), expect))
        except psycopg.Error as e:  # (an earlier statement's error, maybe)
            self._queued = 0
            _drain(conn)
            raise self._error(e, conn) from None
        self._queued += 1
        if self._queued >= QUEUE:
            self._wait()

    def _wait(self) -> None:
        """Wait for every statement sent; raise the first one's error."""
        if not self._queued:
            return
        conn = self._live()
        self._queued = 0
        try:
            _pipe(conn).sync()
        except psycopg.Error as e:
            _drain(conn)
            raise self._error(e, conn) from None

    def _error(self, e: psycopg.Error, conn: Conn | None = None) -> Exception:
        if conn is not None and self._lost(conn, e):
            return fail(errno.EIO, self._away)
        if isinstance(e, _CONFLICTS) or _lock_timeout_as_cancel(e):
            if not self._group_open:  # (a statement alone: no change to run again)
                return fail(errno.EAGAIN, f"the metadata store's rows are locked by "
                            f"another session past {self.busy_ms} ms ({_line(e)}): try "
                            "again")
            self._poisoned = True
            return Conflict(_line(e))
        if isinstance(e, pgerr.DiskFull | pgerr.OutOfMemory | pgerr.InsufficientResources):
            return self._full(e)
        if isinstance(e, pgerr.UniqueViolation):  # a `put`'s key
            return fail(errno.EEXIST, f"a row's key is taken ({_line(e)})")
        if isinstance(e, pgerr.ReadOnlySqlTransaction):
            return fail(errno.EROFS, "the metadata store is open read-only")
        if isinstance(e, pgerr.NumericValueOutOfRange | psycopg.DataError):
            return fail(errno.EOVERFLOW, f"a value is too large for the metadata store "
                        f"({_line(e)})")
        if isinstance(e, psycopg.OperationalError):  # (a statement_timeout, say)
            log.error("metadata server %s: %s", public(self.url), _line(e))
        return fail(errno.EIO, f"metadata store error ({_line(e)})")

    def _full(self, e: psycopg.Error) -> OSError:
        """ENOSPC for the change; one log line, not one per change."""
        err = fail(errno.ENOSPC, f"the metadata server {public(self.url)} is full "
                   f"({_line(e)})")
        now = time.monotonic()
        if now - self._full_said >= FULL_QUIET_S:
            self._full_said = now
            log.error("%s: changes that need room fail with ENOSPC", err.strerror)
        return err

    # ---- rows --------------------------------------------------------------------

    def get(self, table: str, where: Where, columns: Sequence[str]) -> Row | None:
        text = self._sql[("get", table, tuple(where), tuple(columns))]
        return self._exec(text, tuple(where.values()), again=True).fetchone()

    def get_many(self, table: str, column: str, keys: Iterable[object],
                 columns: Sequence[str], where: Where | None = None) -> list[Row]:
        keys = list(dict.fromkeys(keys))
        where = where or {}
        text = self._sql[("get_many", table, column, tuple(columns), 0, tuple(where))]
        out: list[Row] = []
        for i in range(0, len(keys), MANY):
            out += self._exec(text, (keys[i:i + MANY], *where.values()),
                              again=True).fetchall()
        return out

    def lengths(self, table: str, column: str, measured: Sequence[str],
                keys: Iterable[object] | None = None, per_row: int = 0) -> dict[Any, int]:
        if keys is None:
            rows = self._exec(self._sql[("lengths", table, column, tuple(measured), -1,
                                         per_row)],
                              (), again=True).fetchall()
        else:
            wanted, rows = list(dict.fromkeys(keys)), []
            text = self._sql[("lengths", table, column, tuple(measured), 0, per_row)]
            for i in range(0, len(wanted), MANY):
                rows += self._exec(text, (wanted[i:i + MANY],), again=True).fetchall()
        return {k: int(n or 0) for k, n in rows}

    def scan(self, table: str, columns: Sequence[str], where: Where | None = None, *,
             order: str | None = None, after: object = None,
             limit: int | None = None) -> Iterator[Row]:
        key, params = sql.scan_shape(table, columns, where or {}, order, after, limit)
        text = self._sql[key]
        yield from self._exec(text, params, again=True).fetchall()

    def count(self, table: str, where: Where | None = None) -> int:
        where = where or {}
        row = self._exec(self._sql[("count", table, tuple(where))],
                         tuple(where.values()), again=True).fetchone()
        return int(row[0]) if row else 0

    def _write(self, text: str, params: Sequence[object]) -> int:
        """A write whose answer is waited for: how many rows it changed."""
        self._writable()
        _fits(params)
        n = self._exec(text, params).rowcount
        self._wrote = self._wrote or n != 0
        return n

    def insert(self, table: str, row: Mapping[str, object]) -> bool:
        return self._write(self._sql[("insert", table, tuple(row))], tuple(row.values())) > 0

    def put(self, table: str, row: Mapping[str, object]) -> None:
        self._writable()
        self._send(self._sql[("put", table, tuple(row))], tuple(row.values()))

    def upsert(self, table: str, row: Mapping[str, object]) -> None:
        self._writable()
        self._send(self._sql[("upsert", table, tuple(row))], tuple(row.values()))

    def patch(self, table: str, where: Where, values: Mapping[str, object], *,
              expect: bool = False) -> None:
        self._writable()
        self._send(self._sql[("update", table, tuple(where), tuple(values))],
                   (*values.values(), *where.values()), table if expect else None)

    def update(self, table: str, where: Where, values: Mapping[str, object]) -> int:
        return self._write(self._sql[("update", table, tuple(where), tuple(values))],
                           (*values.values(), *where.values()))

    def update_many(self, table: str, where: Sequence[str], columns: Sequence[str],
                    rows: Iterable[Row]) -> None:
        self._writable()
        text = self._sql[("update", table, tuple(where), tuple(columns))]
        rows = list(rows)
        for r in rows:
            _fits(r)
        conn = self._live()
        self._wait()
        self._wrote = True
        try:
            with conn.cursor() as cur:
                cur.executemany(text, rows)
            _pipe(conn).sync()
        except psycopg.Error as e:
            _drain(conn)
            raise self._error(e, conn) from None

    def delete(self, table: str, where: Where) -> int:
        return self._write(self._sql[("delete", table, tuple(where))], tuple(where.values()))

    def remove(self, table: str, where: Where, *, expect: bool = False) -> None:
        self._writable()
        self._send(self._sql[("delete", table, tuple(where))], tuple(where.values()),
                   table if expect else None)

    def remove_many(self, table: str, column: str, keys: Iterable[object]) -> None:
        self._writable()
        keys = list(dict.fromkeys(keys))
        text = self._sql[("delete_many", table, column, 0)]
        for i in range(0, len(keys), MANY):
            self._send(text, (keys[i:i + MANY],))

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

    def _publish(self, row: Mapping[str, object], channel: str) -> None:
        self._send(_PUBLISH, (row["node"], row["epoch"], row["at"], row["body"], _FEED_LOCK))
        self._send("SELECT pg_notify(%s, '')", (channel,))

    def sequences(self) -> dict[str, int]:
        """An upper bound of the numbers each sequence handed out."""
        out = {}
        for s in SEQUENCES:
            row = self._exec(f"SELECT last_value, is_called FROM {_seq(s)}",
                             again=True).fetchone()
            assert row is not None
            out[s] = int(row[0]) + BLOCK - 1 if row[1] else 0
        return out

    def feed_mark(self) -> int:
        """(Feed rows draw their numbers one `nextval` each, under the feed's lock:
        `last_value` is the last row's, exactly; `sequences` is a bound above it.)"""
        row = self._exec(f"SELECT last_value, is_called FROM {_seq('change')}",
                         again=True).fetchone()
        assert row is not None
        return int(row[0]) if row[1] else 0

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
            self._exec("BEGIN ISOLATION LEVEL REPEATABLE READ", again=True)
            self._group_open = True
            self._group_started = time.monotonic()
        self._expects.clear()
        self._wrote = False
        if not self._savepoints:
            return
        conn = self._live()
        try:  # sent with the change's first statement that waits
            _cur(conn).execute("SAVEPOINT change")
        except psycopg.Error as e:
            _drain(conn)
            raise self._error(e, conn) from None
        self._queued += 1

    def _settle(self) -> None:
        """Wait for the change's statements; RELEASE goes with them, or, when `expect`
        writes are to be checked first (a conflict must still roll the savepoint back),
        right after, with whatever waits next."""
        expects, self._expects = self._expects, []
        if expects or not self._savepoints:
            self._wait()
            for cur, table in expects:
                expected(cur.rowcount, table)
        if not self._savepoints:
            return
        conn = self._live()
        try:
            _cur(conn).execute("RELEASE SAVEPOINT change")
        except psycopg.Error as e:
            self._queued = 0
            _drain(conn)
            raise self._error(e, conn) from None
        self._queued += 1
        if not expects:
            self._wait()

    def _end(self) -> None:
        if not self.grouped:
            self.commit()

    def _undo(self) -> None:
        if not self._group_open:  # (lost with its connection: already forgotten)
            return
        conn = self.conn
        self._queued = 0
        self._expects.clear()
        if not _gone(conn):
            assert conn is not None
            _drain(conn)  # (answers still due: the error's, and what it made skip)
        if (not self._savepoints and not self._wrote and not self._poisoned
                and not _gone(conn) and conn is not None
                and conn.info.transaction_status == pq.TransactionStatus.INTRANS):
            if not self.grouped:  # (nothing to undo: it failed before it wrote)
                self.commit()
            return
        if not _gone(conn) and not self._poisoned and self._savepoints:
            assert conn is not None
            try:
                conn.execute("ROLLBACK TO SAVEPOINT change")
                conn.execute("RELEASE SAVEPOINT change")
                _pipe(conn).sync()
                _drain(conn)
                if not self.grouped:
                    self.commit()
                return
            except psycopg.Error as e:
                if self._lost(conn, e):
                    return
        if not _gone(conn):
            assert conn is not None
            try:
                conn.execute("ROLLBACK")
                _pipe(conn).sync()
                _drain(conn)
                if not self.grouped and not self._poisoned:  # (it held this change
                    self._group_open = False                 # alone, and no conflict
                    return                                   # made memory stale)
            except psycopg.Error as e:
                if self._lost(conn, e):
                    return
                _drain(conn)
        self._lose_group("the open group of changes was rolled back")

    def sole_writer(self, on: bool) -> None:
        self._savepoints = not on

    def clock(self) -> float:
        """The server's clock (every node's daemon reads the same one)."""
        row = self._exec("SELECT extract(epoch FROM clock_timestamp())::float8",
                         again=True).fetchone()
        assert row is not None
        return float(row[0])

    def set_fence(self, key: str, value: str) -> None:
        self._fence = (key, value)

    def _check_fence(self, conn: Conn) -> None:
        """The fence, in the open group's transaction, just before its COMMIT: the row
        must still hold this writer's value.  Touching it (an update to itself) also
        makes a takeover committed since the group's snapshot a serialization failure.
        A group that fails it is rolled back and the writer fenced for good."""
        assert self._fence is not None
        key, value = self._fence
        why = f"another node took the pool (its {key} is no longer {value})"
        try:
            cur = _cur(conn).execute(_FENCE, (key, value))
            _pipe(conn).sync()
            held = cur.rowcount == 1
        except psycopg.Error as e:
            _drain(conn)
            err = self._error(e, conn)
            if not isinstance(err, Conflict):
                raise err from None
            held = False
        if held:
            return
        try:
            conn.execute("ROLLBACK")
            _pipe(conn).sync()
        except psycopg.Error:
            pass
        _drain(conn)
        self.fenced = f"this node may change nothing more: {why}"
        raise fail(errno.EROFS, f"a group of changes was refused: {why}")

    def _lose_group(self, why: str | None) -> None:
        """Forget the open group (`why` logged if it was a group; None: said already)."""
        if why and self.grouped:
            log.error("metadata store: %s", why)
        self._group_open = self._poisoned = False
        self.on_group_lost()

    def commit(self) -> None:
        """End the open group.  With none open, EIO while the server is away (or a lost
        group holds commits off): a caller's fsync must not pass then."""
        if not self._group_open:
            if self._redial is not None:
                self._live()
            return
        self.before_commit()
        conn = self._live()
        try:
            self._wait()  # (nothing is due between changes; a backstop)
            if self._fence is not None:
                self._check_fence(conn)
            cur = conn.execute("COMMIT")
            _pipe(conn).sync()
        except (psycopg.Error, OSError, Conflict) as e:
            err: Exception = e
            if isinstance(e, psycopg.Error):
                _drain(conn)
                err = self._error(e, conn)
            if self._group_open:  # (not lost with its connection: said there)
                self._lose_group(f"a group of changes was lost ({err})")
            raise err from None
        self._group_open = False
        if cur.statusmessage != "COMMIT":  # the server rolled it back: not committed
            self._poisoned = False
            self._lose_group("a group of changes was rolled back by the server")
            raise fail(errno.EIO, f"the metadata server rolled back a group of changes "
                       f"({cur.statusmessage})")

    def sync(self) -> None:
        """Nothing to do: the server made each commit durable before answering."""

    def group_age(self) -> float | None:
        return time.monotonic() - self._group_started if self._group_open else None

    # ---- the store as a whole ---------------------------------------------------

    def integrity(self) -> list[str]:
        return []

    def close(self) -> None:
        try:
            if not _gone(self.conn):
                self.commit()
        finally:
            if self._redial is not None:
                self._redial.stop()
            if self.conn is not None:
                _close(self.conn)

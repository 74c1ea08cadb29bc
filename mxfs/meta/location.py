"""Where a pool's store lives, and which engine serves it.

A folder (the metadata member's `meta/`) holds the embedded SQLite store; a
`postgresql://` URL (or `postgres://`) names a database on a shared server.
Everything that opens a store comes through here, so nothing above `meta/` knows
which engine runs.
"""

from __future__ import annotations

from typing import Any, Protocol

from mxfs.meta.engine import Engine, Unusable

_SCHEMES = ("postgresql://", "postgres://")


def is_server(where: str) -> bool:
    """Does `where` name a server (a URL) rather than a folder of the pool?"""
    return where.startswith(_SCHEMES)


def connect(where: str, readonly: bool = False) -> Engine:
    """An engine connection to the existing store at `where` (`Unusable` if none)."""
    if is_server(where):
        engine: Engine = _pg().PgEngine.open(where, readonly=readonly)
        return engine
    from mxfs.meta.sqlite_engine import SqliteEngine
    return SqliteEngine.open(where, readonly=readonly)


class Listener(Protocol):
    """Waits for a channel's notifications (`meta/change_feed.py`)."""

    def wait(self, timeout: float) -> None:
        """Return at the next notification, or after `timeout` seconds; EIO if the
        connection is lost."""

    def close(self) -> None: ...


def listen(where: str, channel: str) -> Listener | None:
    """A connection of its own listening on `channel` (None: a store on a node's own
    member, which no other node reads; `Unusable` if the server cannot be reached)."""
    if not is_server(where):
        return None
    listener: Listener = _pg().PgListener(where, channel)
    return listener


def create(where: str) -> Engine:
    """A new, empty store at `where` (a store there before is gone)."""
    if is_server(where):
        engine: Engine = _pg().PgEngine.create(where)
        return engine
    from mxfs.meta.sqlite_engine import SqliteEngine
    return SqliteEngine.create(where)


def set_aside(where: str) -> None:
    """Rename the embedded store's files in the folder `where` out of the way (kept for
    the operator, never read again): after its rows moved to another engine."""
    import os
    import time

    from mxfs.meta.sqlite_engine import FILES
    stamp = time.time_ns()
    for name in FILES:
        path = os.path.join(where, name)
        if os.path.exists(path):
            os.rename(path, f"{path}.migrated-{stamp}")


def public(where: str) -> str:
    """`where` as it may be written down and shown: a URL loses its password."""
    return str(_pg().public(where)) if is_server(where) else where


def _pg() -> Any:  # the module, imported only where a server is named
    try:
        from mxfs.meta import pg_engine
    except ImportError as e:
        raise Unusable(f"PostgreSQL stores need psycopg 3 ({e})") from None
    return pg_engine

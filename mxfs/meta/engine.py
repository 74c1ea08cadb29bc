"""The engine primitives the namespace rules are written against.

An engine stores rows of the tables in `meta/schema.py` and offers little more:
point reads, scans, counts, inserts that report a taken key instead of raising,
upserts, updates, deletes, sequences, and changes.  Every rule (names, link
counts, orphans, seals, the KV index) lives above it, in `meta/store.py`, so a new
engine implements only this file's abstract methods and passes the conformance
suite (`tests/test_meta_conformance.py`).

A *change* is one atomic unit of the namespace.  `txn(fn)` runs `fn` as one change
and runs it again when the engine reports a conflict with another writer; `fn` must
therefore read what it decides on inside itself.  Changes may be *grouped*
(`group(max_age)`): the engine then ends them in one engine transaction that
`commit` ends, at most `max_age` seconds after its first change, so a crash loses at
most the last group, and only whole changes.  Writes that give no answer (`put`,
`patch`, `remove`, `upsert`) may be sent without waiting for them (PostgreSQL
pipelines them): their errors fail the change by its end, so a change is still
undone whole, and what its caller was told stays true.  Errors leave an engine as `OSError`s
with the errno a caller should see (ENOSPC, EROFS, EIO, EOVERFLOW), never as the
engine library's own types.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

log = logging.getLogger("mxfs.meta")

T = TypeVar("T")
Row = tuple[Any, ...]
Where = Mapping[str, object]

# How often a change is run again when it keeps conflicting with other writers.
RETRIES = 50


class Conflict(Exception):
    """Another writer's transaction conflicted with this change; running it again may
    succeed (SQLite: the database stayed locked; PostgreSQL: SQLSTATE 40001/40P01)."""


class Unusable(Exception):
    """The store cannot be opened: missing, damaged, not an mxfs store, or a schema this
    version cannot read.  The message says which."""


def fail(code: int, what: str = "") -> OSError:
    return OSError(code, what or os.strerror(code))


class Engine(ABC):
    """One connection to one store.  Not thread-safe, except `sync`."""

    kind: str = ""  # "sqlite", "postgresql": for messages
    readonly: bool = False
    # Why this writer may change nothing more (its lease ran out or was taken: another
    # node serves the pool now); None while it may.  Set from any thread.
    fenced: str | None = None

    def __init__(self) -> None:
        self._depth = 0  # > 0 while a change runs
        self._max_age: float | None = None  # grouping: end groups this old
        self.on_group_lost: Callable[[], None] = lambda: None
        # Called by `commit` while a group is open, before it ends: the owner writes
        # what it held in memory for the group (in changes of its own, part of it).
        self.before_commit: Callable[[], None] = lambda: None

    def _writable(self) -> None:
        if self.readonly:
            raise fail(errno.EROFS, "the metadata store is open read-only")
        if self.fenced is not None:
            raise fail(errno.EROFS, self.fenced)

    def clock(self) -> float:
        """Seconds since the epoch by the store's clock: the one clock every node that
        shares the store agrees on (leases expire by it)."""
        return time.time()

    def set_fence(self, key: str, value: str) -> None:  # noqa: B027 (a local store's is its file lock)
        """From now on, a group commits only while the `settings` row `key` still holds
        `value` (checked in the group's own transaction, just before it commits): a
        writer another node has taken the store from cannot commit one more change.  A
        store on this node's own files needs none: the node's file lock fences it."""

    # ---- rows --------------------------------------------------------------------

    @abstractmethod
    def get(self, table: str, where: Where, columns: Sequence[str]) -> Row | None:
        """The named columns of the one row matching `where` (equalities), or None."""

    @abstractmethod
    def get_many(self, table: str, column: str, keys: Iterable[object],
                 columns: Sequence[str], where: Where | None = None) -> list[Row]:
        """The named columns of every row whose `column` is one of `keys` (and that
        matches `where`, equalities), in few statements (not one per key): in no
        particular order, none for a missing key."""

    @abstractmethod
    def lengths(self, table: str, column: str, measured: Sequence[str],
                keys: Iterable[object] | None = None, per_row: int = 0) -> dict[Any, int]:
        """The summed byte lengths of the `measured` columns of the rows whose `column`
        is one of `keys` (every row: None), `per_row` more a row, by that column's
        value, added up by the store (a removed file's 256 KiB of xattrs was read into
        memory to be counted)."""

    @abstractmethod
    def scan(self, table: str, columns: Sequence[str], where: Where | None = None, *,
             order: str | None = None, after: object = None,
             limit: int | None = None) -> Iterator[Row]:
        """Rows matching `where`, in `order` (one column), only those with `order` >
        `after` when given, at most `limit`.  Consume them before writing."""

    @abstractmethod
    def count(self, table: str, where: Where | None = None) -> int: ...

    @abstractmethod
    def insert(self, table: str, row: Mapping[str, object]) -> bool:
        """Add a row; False (and nothing written) when its key is taken: first wins."""

    @abstractmethod
    def put(self, table: str, row: Mapping[str, object]) -> None:
        """Add a row whose key the change knows is free (it looked, or drew the key from
        a sequence); no answer.  A taken key fails the change with EEXIST, by its end."""

    @abstractmethod
    def upsert(self, table: str, row: Mapping[str, object]) -> None:
        """Add a row, or replace the one with its key (a table of key columns only:
        add it unless it is there); no answer."""

    @abstractmethod
    def update(self, table: str, where: Where, values: Mapping[str, object]) -> int:
        """Set `values` on the rows matching `where`; how many matched."""

    @abstractmethod
    def patch(self, table: str, where: Where, values: Mapping[str, object], *,
              expect: bool = False) -> None:
        """`update` without the count: no answer.  `expect`: a row matches (the change
        read it so, maybe from a cache); if none does, the change is a `Conflict`, by
        its end, and runs again."""

    @abstractmethod
    def update_many(self, table: str, where: Sequence[str], columns: Sequence[str],
                    rows: Iterable[Row]) -> None:
        """For each row (values of `columns`, then of `where`): one update."""

    @abstractmethod
    def delete(self, table: str, where: Where) -> int:
        """Remove the rows matching `where`; how many went."""

    @abstractmethod
    def remove(self, table: str, where: Where, *, expect: bool = False) -> None:
        """`delete` without the count: no answer.  `expect` as for `patch`."""

    def checkpoint_apart(self) -> Callable[[], None] | None:
        """Leave the store's checkpoints out of its commits: a blocking call that
        checkpoints through a connection of its own, for a worker thread to run now
        and then (None: an engine whose server checkpoints alone)."""
        return None

    @abstractmethod
    def remove_many(self, table: str, column: str, keys: Iterable[object]) -> None:
        """Remove every row whose `column` is one of `keys`, in few statements."""

    def sole_writer(self, on: bool) -> None:  # noqa: B027 (most engines spare nothing)
        """No other writer changes the rows from now on (or that no longer holds): an
        engine may then spare what only guards against other writers."""

    @abstractmethod
    def next_id(self, sequence: str) -> int:
        """The next number of `sequence` (`schema.SEQUENCES`): never handed out twice,
        even by a change that is later undone."""

    @abstractmethod
    def sequences(self) -> dict[str, int]:
        """At least the last number each sequence handed out (a dump records them)."""

    def feed_mark(self) -> int:
        """The number of the last change feed row committed (or being committed now):
        a follower that read this far has read every change committed before."""
        return self.sequences()["change"]

    @abstractmethod
    def restart_sequences(self, values: Mapping[str, int]) -> None:
        """Go on from `values` (a copy's), never back below what was handed out; within
        a change."""

    def publish(self, row: Mapping[str, object], channel: str) -> None:
        """Add a row of the change feed (`meta/change_feed.py`) to the open group, as
        it commits (`before_commit`), numbered after every row committed before it.  A
        server engine also tells `channel`'s listeners, at commit."""
        self._depth += 1  # (part of the group's transaction, as a change's writes are)
        try:
            self._publish(row, channel)
        finally:
            self._depth -= 1

    def _publish(self, row: Mapping[str, object], channel: str) -> None:
        """(One writer here: the file lock orders the numbers.)"""
        self.put("changes", {"seq": self.next_id("change"), **row})

    # ---- changes -----------------------------------------------------------------

    @abstractmethod
    def _begin(self) -> None:
        """Start a change (and, when none is open, the engine transaction)."""

    @abstractmethod
    def _settle(self) -> None:
        """The change's work is done: wait for what was sent without waiting, and raise
        its error (the change is then undone as if `fn` had raised it)."""

    @abstractmethod
    def _end(self) -> None:
        """End the change; commit it too unless changes are grouped."""

    @abstractmethod
    def _undo(self) -> None:
        """Undo the failed change alone.  If the engine dropped the whole group, call
        `on_group_lost` (memory of the group's earlier changes is stale now)."""

    @abstractmethod
    def commit(self) -> None:
        """End the open group: every change so far is committed (maybe not yet on
        stable storage: `sync`)."""

    @abstractmethod
    def sync(self) -> None:
        """Put every committed change on stable storage.  Blocking, and it touches no
        connection state, so a worker thread may run it while the owner goes on."""

    @abstractmethod
    def group_age(self) -> float | None:
        """Seconds since the open group's first change; None when no group is open."""

    @property
    def in_change(self) -> bool:
        return self._depth > 0

    def txn(self, fn: Callable[[], T], undo: Callable[[], None] | None = None) -> T:
        """Run `fn` as one change, again (after `undo`, which puts memory back) as long
        as the engine reports a conflict.  Inside another change, `fn` is part of it."""
        if self._depth:
            return fn()
        for attempt in range(RETRIES):
            try:
                self._begin()
            except Conflict:
                _pause(attempt)
                continue
            self._depth = 1
            try:
                result = fn()
                self._settle()
            except BaseException as e:
                self._depth = 0
                self._undo()
                if undo is not None:
                    undo()
                if isinstance(e, Conflict):
                    _pause(attempt)
                    continue
                raise
            self._depth = 0
            try:
                self._end()
            except Conflict:
                if undo is not None:
                    undo()
                _pause(attempt)
                continue
            return result
        raise fail(errno.EBUSY, f"the metadata store stayed busy with other writers "
                   f"({RETRIES} tries)")

    def group(self, max_age: float | None) -> None:
        """Group changes into engine transactions of at most `max_age` seconds (None:
        each change is committed as it ends).  The owner calls `commit_if_due`."""
        self._max_age = max_age

    @property
    def grouped(self) -> bool:
        return self._max_age is not None

    def commit_if_due(self) -> None:
        age = self.group_age()
        if age is not None and self._max_age is not None and age >= self._max_age:
            self.commit()

    def durable(self) -> None:
        """Commit, then put everything committed on stable storage."""
        self.commit()
        self.sync()

    # ---- the store as a whole ---------------------------------------------------

    @abstractmethod
    def integrity(self) -> list[str]:
        """Damage the engine itself finds in its storage, one line each (none: sound)."""

    def bound_waits(self, seconds: float) -> None:
        """From now on no wait for the store's answer lasts past `seconds`: a daemon
        serving every user from one thread treats a server that stopped answering as
        away after that long, not after the bound a long statement needs (mount-time
        scans).  An engine on local files has nothing to bound."""
        return None

    def watch_space(self) -> bool:
        """Called now and then by the daemon: True while the store's storage is nearly
        full (the daemon then cuts back direct writers that wrote past their size)."""
        return False

    @abstractmethod
    def close(self) -> None: ...


def expected(rowcount: int, table: str) -> None:
    """After an `expect` write: none matched, so what the change read is stale."""
    if rowcount == 0:
        raise Conflict(f"a row of {table} the change read is gone or changed")


def _pause(attempt: int) -> None:
    """Back off before running a conflicting change again (up to 50 ms, jittered)."""
    time.sleep(min(0.05, 0.001 * 2 ** min(attempt, 6)) * random.random())

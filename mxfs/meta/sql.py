"""The statements of the SQL engines, built from `meta/schema.py`.

One builder for SQLite and PostgreSQL: they differ only in the placeholder and the
type names.  The statements stay in the subset PostgreSQL's distributed relatives
(CockroachDB, YugabyteDB) accept too: plain SELECT/INSERT/UPDATE/DELETE on one table,
`ON CONFLICT ... DO NOTHING | DO UPDATE SET ... = excluded....`, `LIMIT` as a
parameter.  Table and column names come from the schema only (checked here), so
no caller's text ever becomes SQL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mxfs.meta.schema import BLOB, INT, TABLES, TEXT, Table


@dataclass(frozen=True)
class Dialect:
    mark: str  # the placeholder: "?" or "%s"
    types: dict[str, str]
    without_rowid: bool = False  # SQLite: tables keyed by anything but one integer
    arrays: bool = False  # `= ANY(array)` binds any number of keys as one parameter


SQLITE = Dialect("?", {INT: "INTEGER", TEXT: "TEXT", BLOB: "BLOB"}, without_rowid=True)
POSTGRES = Dialect("%s", {INT: "BIGINT", TEXT: "TEXT", BLOB: "BYTEA"}, arrays=True)


def table(name: str) -> Table:
    t = TABLES.get(name)
    if t is None:
        raise ValueError(f"no table {name!r} in the metadata schema")
    return t


def _check(t: Table, columns: Sequence[str]) -> None:
    bad = [c for c in columns if c not in t.names]
    if bad:
        raise ValueError(f"table {t.name} has no column {bad[0]!r}")


def _where(d: Dialect, t: Table, where: Sequence[str]) -> str:
    _check(t, where)
    return " WHERE " + " AND ".join(f"{c}={d.mark}" for c in where) if where else ""


def create_table(d: Dialect, t: Table) -> list[str]:
    cols = ", ".join(f"{c.name} {d.types[c.kind]}" + ("" if c.null else " NOT NULL")
                     for c in t.columns)
    tail = ""
    int_key = len(t.key) == 1 and next(c for c in t.columns if c.name == t.key[0]).kind == INT
    if d.without_rowid and not int_key and not t.rekeyed:
        tail = " WITHOUT ROWID"  # clustered by the key, unless renames move rows often
    out = [f"CREATE TABLE {t.name}({cols}, PRIMARY KEY({', '.join(t.key)})){tail}"]
    for cols_ in t.indexes:
        out.append(f"CREATE INDEX {t.name}_by_{'_'.join(cols_)} ON {t.name}({', '.join(cols_)})")
    return out


def select(d: Dialect, name: str, columns: Sequence[str], where: Sequence[str],
           order: str | None = None, after: bool = False, limit: bool = False) -> str:
    t = table(name)
    _check(t, columns)
    sql = f"SELECT {', '.join(columns)} FROM {t.name}{_where(d, t, where)}"
    if after:
        assert order is not None
        sql += (" AND " if where else " WHERE ") + f"{order}>{d.mark}"
    if order is not None:
        _check(t, [order])
        sql += f" ORDER BY {order}"
    if limit:
        sql += f" LIMIT {d.mark}"
    return sql


def _one_of(d: Dialect, column: str, n: int) -> str:
    """`column` is one of `n` keys: `= ANY(array)` (one parameter) where the dialect has
    arrays, else `IN (...)` with `n` placeholders."""
    keys = f"= ANY({d.mark})" if d.arrays else f"IN ({', '.join(d.mark for _ in range(n))})"
    return f" WHERE {column} {keys}"


def select_in(d: Dialect, name: str, columns: Sequence[str], column: str, n: int,
              where: Sequence[str] = ()) -> str:
    """(The keys bind first, then `where`'s values.)

    With `where` and arrays, the keys are a table joined on: each is one probe of the
    index on (`where`, `column`).  PostgreSQL plans `column = ANY(keys) AND ...` from
    statistics, and while they are missing or old (a KV namespace that grew since) it
    scanned every row of the namespace for each lookup (20,480 rows for 128 keys)."""
    t = table(name)
    _check(t, [*columns, column, *where])
    if where and d.arrays:
        cols = ", ".join(f"{t.name}.{c}" for c in columns)
        on = "".join(f" AND {t.name}.{c}={d.mark}" for c in where)
        return (f"SELECT {cols} FROM unnest({d.mark}) AS want(k) "
                f"JOIN {t.name} ON {t.name}.{column} = want.k{on}")
    also = "".join(f" AND {c}={d.mark}" for c in where)
    return f"SELECT {', '.join(columns)} FROM {t.name}{_one_of(d, column, n)}{also}"


def lengths(d: Dialect, name: str, column: str, measured: Sequence[str], n: int,
            per_row: int = 0) -> str:
    """The summed byte lengths of the `measured` columns (and `per_row` a row) by
    `column` (for `n` keys of it; every row for n < 0): the server adds them up, no
    value is fetched."""
    t = table(name)
    _check(t, [column, *measured])
    total = " + ".join([*(f"length({c})" for c in measured), str(int(per_row))])
    where = _one_of(d, column, n) if n >= 0 else ""
    return f"SELECT {column}, SUM({total}) FROM {t.name}{where} GROUP BY {column}"


def delete_in(d: Dialect, name: str, column: str, n: int) -> str:
    t = table(name)
    _check(t, [column])
    return f"DELETE FROM {t.name}{_one_of(d, column, n)}"


def count(d: Dialect, name: str, where: Sequence[str]) -> str:
    t = table(name)
    return f"SELECT count(*) FROM {t.name}{_where(d, t, where)}"


def insert(d: Dialect, name: str, columns: Sequence[str]) -> str:
    t = table(name)
    _check(t, columns)
    marks = ", ".join(d.mark for _ in columns)
    return f"INSERT INTO {t.name}({', '.join(columns)}) VALUES ({marks}) ON CONFLICT DO NOTHING"


def put(d: Dialect, name: str, columns: Sequence[str]) -> str:
    """A plain insert: a taken key is an error (unique violation)."""
    t = table(name)
    _check(t, columns)
    marks = ", ".join(d.mark for _ in columns)
    return f"INSERT INTO {t.name}({', '.join(columns)}) VALUES ({marks})"


def upsert(d: Dialect, name: str, columns: Sequence[str]) -> str:
    t = table(name)
    _check(t, columns)
    marks = ", ".join(d.mark for _ in columns)
    rest = [c for c in columns if c not in t.key]
    action = ("DO UPDATE SET " + ", ".join(f"{c}=excluded.{c}" for c in rest)) if rest \
        else "DO NOTHING"
    return (f"INSERT INTO {t.name}({', '.join(columns)}) VALUES ({marks}) "
            f"ON CONFLICT ({', '.join(t.key)}) {action}")


def update(d: Dialect, name: str, where: Sequence[str], columns: Sequence[str]) -> str:
    t = table(name)
    _check(t, columns)
    sets = ", ".join(f"{c}={d.mark}" for c in columns)
    return f"UPDATE {t.name} SET {sets}{_where(d, t, where)}"


def delete(d: Dialect, name: str, where: Sequence[str]) -> str:
    t = table(name)
    return f"DELETE FROM {t.name}{_where(d, t, where)}"


# A statement's shape, its key among the texts: (op, table, *what it names).
Shape = tuple[Any, ...]


def statement(d: Dialect, key: Shape) -> str:
    """The text of a primitive's statement from its shape: (op, table, *what it names)."""
    op, name, *rest = key
    if op == "get":
        return select(d, name, rest[1], rest[0])
    if op == "get_many":
        return select_in(d, name, rest[1], rest[0], rest[2], rest[3])
    if op == "put":
        return put(d, name, rest[0])
    if op == "scan":
        where, cols, order, after, limit = rest
        return select(d, name, cols, where, order, after, limit)
    if op == "count":
        return count(d, name, rest[0])
    if op == "insert":
        return insert(d, name, rest[0])
    if op == "upsert":
        return upsert(d, name, rest[0])
    if op == "update":
        return update(d, name, rest[0], rest[1])
    if op == "delete":
        return delete(d, name, rest[0])
    if op == "delete_many":
        return delete_in(d, name, rest[0], rest[1])
    if op == "lengths":
        return lengths(d, name, rest[0], rest[1], rest[2], rest[3])
    raise ValueError(f"no statement {op!r}")


def scan_shape(table: str, columns: Sequence[str], where: Mapping[str, object],
               order: str | None, after: object, limit: int | None
               ) -> tuple[Shape, list[object]]:
    """A scan's statement key and its parameters, in the order the text binds them."""
    key = ("scan", table, tuple(where), tuple(columns), order, after is not None,
           limit is not None)
    params = [*where.values()]
    if after is not None:
        params.append(after)
    if limit is not None:
        params.append(limit)
    return key, params


class Statements(dict[Shape, str]):
    """One dialect's statement texts by shape, each built on first use: a dict, so the
    primitives on every namespace change pay one lookup for their text."""

    def __init__(self, d: Dialect) -> None:
        super().__init__()
        self.dialect = d

    def __missing__(self, key: Shape) -> str:
        text = self[key] = statement(self.dialect, key)
        return text

"""Dumps of the metadata store, and restoring a pool's store from one.

A JSON dump (`.json`, zstd-compressed as `.json.zst`) is engine-neutral: every row
of every table in `meta/schema.py` and where each sequence stands, read and written
through the engine primitives.  `.sql` dumps are SQLite's own text, for the
embedded store.  Dumps of older versions (schema 3, whose sequences were SQLite's
`sqlite_sequence`) load too.  A dump is written 0600 beside its name and renamed
over it when whole.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import IO, Any, Protocol, cast

import zstandard

from mxfs.meta import location
from mxfs.meta.backup import create_private, install, problem
from mxfs.meta.engine import Engine
from mxfs.meta.schema import SCHEMA_VERSION, SEQUENCES, TABLES
from mxfs.meta.sqlite_engine import DB_NAME, SqliteEngine, load_sql
from mxfs.meta.store import MetaStore

FORMAT = "mxfs-meta"
_RESTORE_FOLDER = "restore"
# schema 3 numbered with AUTOINCREMENT: sqlite_sequence named the tables
_OLD_SEQUENCES = {"inodes": "ino", "dentries": "dentry"}


def _kind(out: str) -> str:
    kind = out.removesuffix(".zst")
    if kind.endswith(".json"):
        return "json"
    if kind.endswith(".sql"):
        return "sql"
    raise ValueError(f"{out}: name it .sql, .json, .sql.zst or .json.zst")


def dump(store: MetaStore, out: str) -> int:
    """Write the store as JSON or SQL (by `out`'s name); the rows written.  An OSError of
    the file's own (its folder missing, no space, not allowed) names `out`, the path the
    caller gave, never the temporary file it is written as."""
    kind = _kind(out)
    engine = store.engine
    if kind == "sql" and not isinstance(engine, SqliteEngine):
        raise ValueError(f"{out}: .sql dumps are SQLite's; name it .json or .json.zst")
    tmp = os.path.join(os.path.dirname(out) or ".", f".{os.path.basename(out)}.{os.getpid()}")
    try:
        fd = create_private(tmp)
    except OSError as e:
        raise OSError(e.errno, e.strerror, out) from None
    raw = os.fdopen(fd, "wb")
    try:
        try:
            sink = _Sink(raw, out)
            stream: _Writer = sink
            if out.endswith(".zst"):
                stream = zstandard.ZstdCompressor(level=6).stream_writer(  # (it calls
                    cast(IO[bytes], sink), closefd=False)  # write and flush alone)
            if kind == "json":
                rows = _write_json(engine, stream)
            else:
                assert isinstance(engine, SqliteEngine)
                rows = 0
                for line in engine.dump_sql():
                    stream.write((line + "\n").encode())
                    rows += line.startswith("INSERT")
            stream.close()
            sink.finish()
        finally:  # (after a failed write the buffer's flush at close fails again, unnamed;
            with contextlib.suppress(OSError):  # after finish there is nothing to flush)
                raw.close()
        try:
            os.rename(tmp, out)
        except OSError as e:
            raise OSError(e.errno, e.strerror, out) from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return rows


class _Sink:
    """The dump's temporary file, as its writers see it: a failure to write it (a full
    disk, often only at the last flush) is reported as the dump's, by the name `out`."""

    def __init__(self, raw: IO[bytes], out: str) -> None:
        self.raw, self.out = raw, out

    def write(self, data: bytes) -> int:
        try:
            return self.raw.write(data)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.out) from None

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.out) from None

    def close(self) -> None:
        self.flush()  # (the file itself is closed by its owner)

    def finish(self) -> None:
        """Every byte on disk (fsync) before the rename: the name shows a whole dump."""
        self.flush()
        try:
            os.fsync(self.raw.fileno())
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.out) from None


class _Writer(Protocol):
    """Where a dump's bytes go: its file, or a compressor writing to it."""

    def write(self, data: bytes, /) -> int: ...

    def close(self) -> None: ...


def _write_json(engine: Engine, stream: _Writer) -> int:
    tables, rows = {}, 0
    for t in TABLES.values():
        if t.transient:
            continue
        data = [[_json_value(v) for v in r] for r in engine.scan(t.name, t.names)]
        tables[t.name] = {"columns": list(t.names), "rows": data}
        rows += len(data)
    stream.write(json.dumps({"format": FORMAT, "schema_version": SCHEMA_VERSION,
                             "sequences": engine.sequences(), "tables": tables}).encode())
    return rows


def _json_value(v: object) -> object:
    return {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes | memoryview) else v


def _read(source: str) -> bytes:
    with open(source, "rb") as f:
        data = f.read()
    if source.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def load_json(doc: dict[str, Any], engine: Engine) -> None:
    """Fill an empty store's rows and sequences from a JSON dump, in one change."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not an mxfs metadata dump")
    seqs: dict[str, int] = {s: 0 for s in SEQUENCES}
    seqs.update({k: int(v) for k, v in (doc.get("sequences") or {}).items() if k in seqs})

    def rows(name: str) -> Iterator[dict[str, Any]]:  # JSON values, bytes decoded
        t = doc["tables"][name]
        for r in t["rows"]:
            yield {c: base64.b64decode(v["b64"]) if isinstance(v, dict) else v
                   for c, v in zip(t["columns"], r, strict=True)}

    def fill() -> None:
        for name in doc["tables"]:
            if name == "sqlite_sequence":
                for r in rows(name):
                    seq = _OLD_SEQUENCES.get(str(r["name"]))
                    if seq:
                        seqs[seq] = max(seqs[seq], int(r["seq"]))
                continue
            if name not in TABLES:
                raise ValueError(f"the dump holds a table {name!r} this version does not know")
            for r in rows(name):
                if name == "settings" and r.get("key") == "schema_version":
                    continue  # the engine's own
                if name == "inodes":
                    seqs["ino"] = max(seqs["ino"], int(r["ino"]))
                if name == "dentries":
                    seqs["dentry"] = max(seqs["dentry"], int(r["id"]))
                engine.upsert(name, r)
        engine.restart_sequences(seqs)
    engine.txn(fill)


def copy_rows(src: Engine, dst: Engine) -> int:
    """Make `dst` hold exactly `src`'s rows, in one change of `dst`; rows copied.
    Its sequences go on from past either's numbers."""
    def fill() -> int:
        n = 0
        for t in TABLES.values():
            dst.delete(t.name, {})
        for t in TABLES.values():
            if t.transient:
                continue
            for r in list(src.scan(t.name, t.names)):
                row = dict(zip(t.names, r, strict=True))
                if t.name == "settings" and row["key"] == "schema_version":
                    continue
                dst.insert(t.name, row)
                n += 1
        dst.upsert("settings", {"key": "schema_version", "value": str(SCHEMA_VERSION)})
        dst.restart_sequences(src.sequences())
        return n
    return dst.txn(fill)


def restore(source: str, where: str, pool_uuid: str, work: str | None = None) -> str:
    """Replace the (unmounted, held) store at `where` with the dump `source`, once
    it is checked to be a sound store of this pool; where the previous store is kept.
    The dump is built into an SQLite store in `work` (default: `where`, a folder)
    first; a server's store then takes its rows in one transaction, its previous rows
    kept as a JSON dump in `work`.

    `ValueError` when `source` is not a dump, or not this pool's.
    """
    work = work or where
    data = _read(source)
    folder = os.path.join(work, _RESTORE_FOLDER)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    built = os.path.join(folder, DB_NAME)
    try:
        if _kind(source) == "json":
            try:
                doc = json.loads(data)
            except ValueError as e:
                raise ValueError(f"not a metadata dump ({e})") from None
            engine = SqliteEngine.create(folder)
            try:
                load_json(doc, engine)
            finally:
                engine.close()
        else:
            for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm"):
                if os.path.exists(os.path.join(folder, name)):
                    os.unlink(os.path.join(folder, name))
            os.close(create_private(built))
            load_sql(data.decode(errors="replace"), built)
            SqliteEngine.open(folder).close()  # older schemas are brought up to date
        why = problem(built, pool_uuid)
        if why is not None:
            raise ValueError(f"the store it holds {why}")
        if not location.is_server(where):
            return install(built, where)
        target = MetaStore.open(where)
        src = SqliteEngine.open(folder, readonly=True)
        try:
            kept = os.path.join(work, f"replaced-{time.time_ns()}.json")
            dump(target, kept)
            copy_rows(src, target.engine)
        finally:
            src.close()
            target.close()
        return kept
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)

"""Copies of the metadata store: online backups, dumps, restores, and picking a good copy.

The store lives on one member; losing it loses the pool's namespace even though
every chunk file survives.  So the daemon copies it with SQLite's online backup
API (a consistent snapshot, taken beside the running daemon through its own
read connection) into `meta-backup/` on the next member, keeping the newest few.
A dump is SQL or JSON, zstd-compressed when its name ends in `.zst`.  Stdlib and
zstandard only.

Every copy is as private as the store (0600 files, 0700 folders), created so from
the start: it holds every file name and xattr of the pool, whatever its modes.
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import stat
import time
from dataclasses import dataclass

import zstandard

from mxfs.meta.store import DB_NAME, SCHEMA_VERSION, create_schema

KEEP = 3
_PREFIX, _SUFFIX = "mxfs-", ".db"


@dataclass(frozen=True)
class Copy:
    path: str
    taken_ns: int


def backup(db_path: str, folder: str, keep: int = KEEP) -> Copy:
    """Copy the store at `db_path` online into `folder` (atomically), keeping `keep` copies."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    private(folder)
    taken = time.time_ns()
    final = os.path.join(folder, f"{_PREFIX}{taken}{_SUFFIX}")
    tmp = final + ".tmp"
    src = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        os.close(_create_private(tmp))  # SQLite keeps an existing file's mode (and its journal's)
        dst = sqlite3.connect(tmp)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
    finally:
        src.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    _sync_dir(folder)
    for old in copies(folder)[keep:]:
        os.unlink(old.path)
    return Copy(final, taken)


def private(folder: str) -> None:
    """`folder` 0700 and the files in it 0600, where looser (and ours to change).

    Best effort: a missing folder, one not ours, or a failed member is left alone.
    """
    try:
        if stat.S_IMODE(os.stat(folder).st_mode) & 0o077:
            os.chmod(folder, 0o700)
        with os.scandir(folder) as it:
            for e in it:
                if e.is_file(follow_symlinks=False) and \
                        stat.S_IMODE(e.stat(follow_symlinks=False).st_mode) & 0o077:
                    os.chmod(e.path, 0o600)
    except OSError:
        pass


def _create_private(path: str) -> int:
    """A new empty 0600 file at `path` (a stale one from a crash is replaced); its fd."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def copies(folder: str) -> list[Copy]:
    """Backups in `folder`, newest first."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith(_PREFIX) and n.endswith(_SUFFIX):
            try:
                out.append(Copy(os.path.join(folder, n), int(n[len(_PREFIX):-len(_SUFFIX)])))
            except ValueError:
                continue
    return sorted(out, key=lambda c: -c.taken_ns)


def problem(path: str, pool_uuid: str | None = None) -> str | None:
    """Why the store at `path` cannot be used (None: it is sound and this pool's)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            (check,) = db.execute("PRAGMA quick_check").fetchone()
            if check != "ok":
                return f"damaged ({check})"
            row = db.execute("SELECT value FROM settings WHERE key='pool_uuid'").fetchone()
        finally:
            db.close()
    except sqlite3.Error as e:
        return f"unreadable ({e})"
    if row is None:
        return "not an mxfs metadata store"
    if pool_uuid is not None and row[0] != pool_uuid:
        return f"belongs to pool {row[0]}"
    return None


def newest_good(folders: list[str], pool_uuid: str) -> Copy | None:
    for c in sorted((c for f in folders for c in copies(f)), key=lambda c: -c.taken_ns):
        if problem(c.path, pool_uuid) is None:
            return c
    return None


def restore_file(source: str, meta_dir: str) -> str:
    """Put a sound copy in place of the store; the old one is kept beside it. Returns it."""
    target = os.path.join(meta_dir, DB_NAME)
    kept = f"{target}.replaced-{time.time_ns()}"
    if os.path.exists(target):
        os.rename(target, kept)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(target + suffix):
            os.rename(target + suffix, kept + suffix)
    tmp = target + ".restoring"
    with open(source, "rb") as src, os.fdopen(_create_private(tmp), "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
        dst.flush()
        os.fsync(dst.fileno())
    os.rename(tmp, target)
    _sync_dir(meta_dir)
    return kept


# ---- dumps ------------------------------------------------------------------------


def _open_out(fd: int, path: str) -> tuple[object, object]:
    raw = os.fdopen(fd, "wb")  # closed by the caller, after the compressor
    if path.endswith(".zst"):
        return zstandard.ZstdCompressor(level=6).stream_writer(raw), raw
    return raw, raw


def dump(db_path: str, out: str) -> int:
    """Write the store as SQL or JSON (by name: .sql or .json, optionally .zst); rows written.

    Written 0600 beside `out` and renamed over it when whole, so no reader ever sees
    it open (an older `out` may be readable, and a reader's descriptor outlives a chmod).
    """
    kind = out.removesuffix(".zst")
    if not kind.endswith((".json", ".sql")):
        raise ValueError(f"{out}: name it .sql, .json, .sql.zst or .json.zst")
    tmp = os.path.join(os.path.dirname(out) or ".", f".{os.path.basename(out)}.{os.getpid()}")
    src = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        stream, raw = _open_out(_create_private(tmp), out)
        try:
            rows = _write_dump(src, stream, kind.endswith(".json"))
        finally:
            stream.close()  # type: ignore[attr-defined]
            if raw is not stream:
                raw.close()  # type: ignore[attr-defined]
        os.rename(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        src.close()
    return rows


def _write_dump(src: sqlite3.Connection, stream: object, as_json: bool) -> int:
    rows = 0
    if as_json:
        tables = {}
        for (name,) in src.execute("SELECT name FROM sqlite_master WHERE type='table' AND "
                                   "(name NOT LIKE 'sqlite_%' OR name='sqlite_sequence')"):
            cur = src.execute(f"SELECT * FROM {name}")  # noqa: S608 - our own tables
            cols = [d[0] for d in cur.description]
            data = [[_json_value(v) for v in r] for r in cur]
            tables[name] = {"columns": cols, "rows": data}
            rows += len(data)
        stream.write(json.dumps({"format": "mxfs-meta", "schema_version": SCHEMA_VERSION,
                                 "tables": tables}).encode())  # type: ignore[attr-defined]
    else:
        for line in src.iterdump():
            stream.write((line + "\n").encode())  # type: ignore[attr-defined]
            rows += line.startswith("INSERT")
    return rows


def _json_value(v: object) -> object:
    return {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v


def load_dump(source: str, db_out: str) -> None:
    """Build a store at `db_out` from a dump (SQL or JSON, optionally .zst)."""
    with open(source, "rb") as f:
        data = f.read()
    if source.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    os.close(_create_private(db_out))
    db = sqlite3.connect(db_out, isolation_level=None)
    try:
        if source.removesuffix(".zst").endswith(".json"):
            doc = json.loads(data)
            if doc.get("format") != "mxfs-meta":
                raise ValueError(f"{source} is not an mxfs metadata dump")
            create_schema(db)
            db.execute("BEGIN")
            for name, t in doc["tables"].items():
                if name == "sqlite_sequence":  # inode numbers are never reused: keep the counter
                    db.execute("DELETE FROM sqlite_sequence")
                marks = ",".join("?" * len(t["columns"]))
                db.executemany(f"INSERT OR REPLACE INTO {name} ({','.join(t['columns'])}) "  # noqa: S608
                               f"VALUES ({marks})",
                               [[base64.b64decode(v["b64"]) if isinstance(v, dict) else v
                                 for v in r] for r in t["rows"]])
            db.execute("COMMIT")
        else:
            db.executescript(data.decode())
    finally:
        db.close()


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

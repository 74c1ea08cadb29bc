"""Copies of the metadata store: online backups, choosing a good one, putting it back.

The store lives on one member; losing it loses the pool's namespace even though
every chunk file survives.  So the daemon copies it online (SQLite's backup API: a
consistent snapshot, taken beside the running daemon through its own read
connection) into `meta-backup/` on the next member, keeping the newest few, and a
mount that finds the store damaged puts the newest good copy in its place.

Every copy is as private as the store (0600 files, 0700 folders), created so from
the start: it holds every file name and xattr of the pool, whatever its modes.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass

from mxfs.meta.engine import Unusable
from mxfs.meta.sqlite_engine import DB_NAME, SqliteEngine, file_problem
from mxfs.meta.sqlite_space import Reserve, make_room
from mxfs.meta.store import MetaStore

log = logging.getLogger("mxfs.meta")

KEEP = 3
_PREFIX, _SUFFIX = "mxfs-", ".db"


@dataclass(frozen=True)
class Copy:
    path: str
    taken_ns: int


def supported(store: MetaStore) -> bool:
    """Does this engine keep copies of its own?  (A server's are its operator's.)"""
    return isinstance(store.engine, SqliteEngine)


def backup(store: MetaStore, folder: str, keep: int = KEEP) -> Copy:
    """Copy the committed store online into `folder` (atomically), keeping `keep`
    copies.  Blocking, and safe in a worker thread beside the store's owner."""
    engine = store.engine
    if not isinstance(engine, SqliteEngine):
        raise Unusable(f"{engine.kind} stores are copied by their server's own tools")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    private(folder)
    taken = time.time_ns()
    final = os.path.join(folder, f"{_PREFIX}{taken}{_SUFFIX}")
    tmp = final + ".tmp"
    os.close(create_private(tmp))  # SQLite keeps an existing file's mode (and its journal's)
    try:
        engine.copy_to(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    except BaseException:  # a full member, say: no half copy left to be taken for a backup
        for leftover in (tmp, tmp + "-journal"):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        raise
    sync_dir(folder)
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


def create_private(path: str) -> int:
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


def problem(path: str, pool_uuid: str | None = None, thorough: bool = True) -> str | None:
    """Why the copy (or store file) at `path` cannot be used (None: sound, this pool's);
    without `thorough`, a store closed clean is not read page by page (`file_problem`)."""
    why, uuid = file_problem(path, thorough)
    if why is None and pool_uuid is not None and uuid != pool_uuid:
        return f"belongs to pool {uuid}"
    return why


def newest_good(folders: list[str], pool_uuid: str) -> Copy | None:
    for c in sorted((c for f in folders for c in copies(f)), key=lambda c: -c.taken_ns):
        if problem(c.path, pool_uuid) is None:
            return c
    return None


def install(source: str, meta_dir: str) -> str:
    """Put a sound copy in place of the store; the old one is kept beside it. Returns it."""
    target = os.path.join(meta_dir, DB_NAME)
    kept = f"{target}.replaced-{time.time_ns()}"
    if os.path.exists(target):
        os.rename(target, kept)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(target + suffix):
            os.rename(target + suffix, kept + suffix)
    tmp = target + ".restoring"
    with open(source, "rb") as src, os.fdopen(create_private(tmp), "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
        dst.flush()
        os.fsync(dst.fileno())
    os.rename(tmp, target)
    sync_dir(meta_dir)
    return kept


def recover(where: str, pool_uuid: str, folders: list[str]) -> str | None:
    """If the store at `where` is missing or damaged, put the newest good copy from
    `folders` in its place and say which (None: the store is sound).  `Unusable` when
    no good copy exists; OSError(ENOSPC) when the store cannot be read because its
    member is full (the reserve given back first), which no copy would mend.  Only the
    embedded store keeps copies.  Every mount runs this: a store its daemon closed
    clean is not read page by page (`file_problem`), or the mount took longer the more
    tenants stored."""
    primary = os.path.join(where, DB_NAME)
    why = problem(primary, pool_uuid, thorough=False) if os.path.exists(primary) \
        else "missing"
    if why is not None and why.startswith("unreadable") and make_room(primary):
        why = problem(primary, pool_uuid, thorough=False)  # (its reserve given back)
        if why is not None and why.startswith("unreadable") and Reserve(primary).short():
            # A full member, not a damaged store: a backup put in its place would have
            # lost every change made since it was taken.
            raise OSError(errno.ENOSPC, f"the metadata member of {primary} is full")
    if why is None:
        return None
    good = newest_good(folders, pool_uuid)
    if good is None:
        raise Unusable(f"metadata store {primary} is {why} and no good backup was found")
    install(good.path, where)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(good.taken_ns / 1e9))
    log.warning("metadata store %s was %s: recovered from the backup of %s (%s); changes "
                "made after it are lost", primary, why, when, good.path)
    return f"{good.path} (taken {when}; the store was {why})"


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Read-only walks of the whole store, for tools and reports: names of inodes, the
files holding data, sealed files with their sums, bytes by use.  Scans through the
engine primitives; none of them runs on a hot path."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mxfs.meta.inode import ROOT_INO
from mxfs.meta.store import MetaStore
from mxfs.text import shown, shown_key


@dataclass(frozen=True)
class FileRow:
    """A regular file's row as layouts need it."""

    ino: int
    size: int
    stripe_unit: int
    stripe_width: int
    first_member: int


@dataclass(frozen=True)
class SealedRow:
    file: FileRow
    sum_unit: int
    sums: bytes


def path_of(store: MetaStore, ino: int) -> str:
    """A path that reaches `ino` (one of its names), or "<inode N>" if none does; for a
    report, so its names are shown escaped (`mxfs.text.shown`: tenants choose them)."""
    parts: list[str] = []
    seen = set()
    while ino != ROOT_INO:
        row = store.engine.get("dentries", {"ino": ino}, ("parent", "name"))
        if row is None or ino in seen:
            return f"<inode {ino}>" + ("/" + "/".join(reversed(parts)) if parts else "")
        seen.add(ino)
        parts.append(shown(bytes(row[1])))
        ino = row[0]
    return "/" + "/".join(reversed(parts))


def display_name(store: MetaStore, ino: int) -> str:
    """A file's path, or its KV namespace and key, shown escaped as `path_of`'s."""
    kv = store.kv.key_of(ino)
    if kv is not None:
        ns, key = kv
        return f"kv:{shown(ns)}/{shown_key(key)}"
    return path_of(store, ino)


def inode_numbers(store: MetaStore) -> set[int]:
    return {r[0] for r in store.engine.scan("inodes", ("ino",))}


def _file(row: tuple[Any, ...]) -> FileRow | None:
    ino, mode, size, unit, width, first = row
    if not stat.S_ISREG(mode) or unit is None or width is None or first is None:
        return None
    return FileRow(ino, size, unit, width, first)


_FILE_COLUMNS = ("ino", "mode", "size", "stripe_unit", "stripe_width", "first_member")


def files_with_data(store: MetaStore) -> Iterator[FileRow]:
    """Every regular file holding at least one byte."""
    for row in list(store.engine.scan("inodes", _FILE_COLUMNS)):
        f = _file(row)
        if f is not None and f.size > 0:
            yield f


def sealed_inos(store: MetaStore) -> list[int]:
    """The inode numbers of the sealed files, in order."""
    return [r[0] for r in store.engine.scan("sealed", ("ino",), order="ino")]


def sizes_of(store: MetaStore, inos: list[int], bite: int = 1000) -> dict[int, int]:
    """The sizes of the inodes `inos` (those that exist), asked a bite at a time."""
    out: dict[int, int] = {}
    for start in range(0, len(inos), bite):
        for ino, size in store.engine.get_many("inodes", "ino", inos[start:start + bite],
                                               ("ino", "size")):
            out[ino] = size
    return out


def sealed_file(store: MetaStore, ino: int) -> SealedRow | None:
    """The sealed file `ino` with its sums, as the rows hold it now (None: not one)."""
    seal = store.engine.get("sealed", {"ino": ino}, ("sum_unit", "sums"))
    row = store.engine.get("inodes", {"ino": ino}, _FILE_COLUMNS) if seal else None
    f = _file(row) if row is not None else None
    return None if f is None or seal is None else SealedRow(f, seal[0], bytes(seal[1]))


def sealed_files(store: MetaStore) -> Iterator[SealedRow]:
    """Every sealed file with its sums, by inode number: read one at a time (all of
    them at once, a tenant's files of 96,000 sums each held several times the table in
    memory), so the rows may change between two."""
    for ino in sealed_inos(store):
        s = sealed_file(store, ino)
        if s is not None:
            yield s


def bytes_by_use(store: MetaStore) -> dict[str, int]:
    """Bytes of regular files by what wrote them: KV chunks, direct commits (sealed:
    checkpoints, models), and files written through the mount."""
    e = store.engine
    kv = {ino: size for ino, size in e.scan("kv", ("ino", "size"))}
    sealed = {r[0] for r in e.scan("sealed", ("ino",))}
    files = sealed_total = 0
    for ino, mode, nlink, size in e.scan("inodes", ("ino", "mode", "nlink", "size")):
        if not stat.S_ISREG(mode) or nlink <= 0:
            continue
        files += size
        if ino in sealed and ino not in kv:
            sealed_total += size
    kv_total = sum(kv.values())
    return {"kv": kv_total, "sealed": sealed_total, "files": files - kv_total - sealed_total}

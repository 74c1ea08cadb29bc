"""`mxfs fsck`: check an unmounted pool's metadata against its chunk files, and repair.

Every finding is one line naming the inode or path and what was (or would be)
done.  Repairs keep data where they can: an inode no entry reaches is linked
into `/lost+found` (as e2fsck does), not dropped; only bytes nothing refers to
(chunk files without an inode, tails past a file's size) are removed.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from mxfs.fs.volume import Volume
from mxfs.io import Layout
from mxfs.meta import ROOT_INO, MetaStore

LOST_FOUND = b"lost+found"
_S_IFMT = stat.S_IFMT(0o177777)


@dataclass
class Finding:
    kind: str
    text: str
    repaired: bool = False
    fatal: bool = False  # cannot be repaired here (restore from a backup)

    def line(self) -> str:
        state = "repaired" if self.repaired else ("NOT REPAIRABLE" if self.fatal else "found")
        return f"{state}: {self.kind}: {self.text}"


def path_of(store: MetaStore, ino: int) -> str:
    """A path that reaches `ino` (one of its names), or "<inode N>" if none does."""
    parts: list[str] = []
    seen = set()
    while ino != ROOT_INO:
        row = store.db.execute("SELECT parent, name FROM dentries WHERE ino=? LIMIT 1",
                               (ino,)).fetchone()
        if row is None or ino in seen:
            return f"<inode {ino}>" + ("/" + "/".join(reversed(parts)) if parts else "")
        seen.add(ino)
        parts.append(os.fsdecode(row[1]))
        ino = row[0]
    return "/" + "/".join(reversed(parts))


def lost_files(vol: Volume, limit: int = 1000) -> tuple[int, list[str]]:
    """Files with bytes on a failed member: (how many, the first `limit` of their names)."""
    failed = {m.index for m in vol.pool.failed}
    if not failed:
        return 0, []
    count, names = 0, []
    rows = vol.store.db.execute(
        "SELECT ino, size, stripe_unit, stripe_width, first_member FROM inodes "
        "WHERE (mode & ?) = ? AND size > 0", (_S_IFMT, stat.S_IFREG)).fetchall()
    for ino, size, unit, width, first in rows:
        if Layout(unit, width, first, len(vol.pool.members)).holding(size) & failed:
            count += 1
            if len(names) < limit:
                names.append(display_name(vol.store, ino))
    return count, names


def display_name(store: MetaStore, ino: int) -> str:
    """A file's path, or its KV namespace and key."""
    row = store.db.execute("SELECT ns, key FROM kv WHERE ino=?", (ino,)).fetchone()
    if row is not None:
        key = bytes(row[1])
        return f"kv:{row[0]}/" + (key.decode() if key.isascii() else "0x" + key.hex())
    return path_of(store, ino)


def fsck(vol: Volume, repair: bool) -> list[Finding]:
    """Every inconsistency of the pool, repaired when `repair` (the pool must be locked)."""
    if repair and not vol.holds_lock:
        raise ValueError("fsck repairs only a pool it holds: Volume.open(spec, hold=...)")
    store, q = vol.store, vol.store.db.execute
    out: list[Finding] = []

    def found(kind: str, text: str, fix: object = None, fatal: bool = False) -> None:
        f = Finding(kind, text, fatal=fatal)
        if repair and fix is not None:
            fix()  # type: ignore[operator]
            f.repaired = True
        out.append(f)

    for (ok,) in q("PRAGMA integrity_check"):
        if ok != "ok":
            found("sqlite", ok, fatal=True)
    if any(f.fatal for f in out):
        return out  # nothing else can be trusted; restore the metadata store
    with store.transaction():
        for cookie, parent, ino in q("SELECT id, parent, ino FROM dentries WHERE ino NOT IN "
                                     "(SELECT ino FROM inodes)").fetchall():
            found("dangling entry", f"entry {cookie} in {path_of(store, parent)} points to "
                  f"missing inode {ino}: removed",
                  lambda c=cookie: q("DELETE FROM dentries WHERE id=?", (c,)))
        for ns, key, ino in q("SELECT ns, key, ino FROM kv WHERE ino NOT IN "
                              "(SELECT ino FROM inodes)").fetchall():
            found("dangling KV chunk", f"{ns}/{key!r} points to missing inode {ino}: dropped",
                  lambda n=ns, k=key: q("DELETE FROM kv WHERE ns=? AND key=?", (n, k)))
        for (ino,) in q("SELECT ino FROM inodes WHERE ino != ? AND ino NOT IN (SELECT ino FROM "
                        "dentries) AND ino NOT IN (SELECT ino FROM orphans) AND ino NOT IN "
                        "(SELECT ino FROM kv)", (ROOT_INO,)).fetchall():
            found("unreachable inode", f"inode {ino}: linked as /lost+found/{ino}",
                  lambda i=ino: _to_lost_found(vol, i))
        for ino, nlink, links in q(
                "SELECT i.ino, i.nlink, (SELECT count(*) FROM dentries d WHERE d.ino=i.ino) + "
                "(SELECT count(*) FROM kv WHERE kv.ino=i.ino) AS n FROM inodes i "
                "WHERE (i.mode & ?) != ? AND i.ino NOT IN (SELECT ino FROM orphans) "
                "AND i.nlink != n", (_S_IFMT, stat.S_IFDIR)).fetchall():
            found("link count", f"{path_of(store, ino)} has nlink {nlink} but {links} names: "
                  f"set to {links}", lambda i=ino, n=links: _set_nlink(store, i, n))
        for ino, nlink, subdirs in q(
                "SELECT i.ino, i.nlink, (SELECT count(*) FROM dentries d JOIN inodes c "
                "ON c.ino=d.ino WHERE d.parent=i.ino AND (c.mode & ?1)=?2) FROM inodes i "
                "WHERE (i.mode & ?1)=?2 AND i.nlink > 0", (_S_IFMT, stat.S_IFDIR)).fetchall():
            if nlink != 2 + subdirs:
                found("directory link count", f"{path_of(store, ino)} has nlink {nlink}, "
                      f"{subdirs} subdirectories: set to {2 + subdirs}",
                      lambda i=ino, n=2 + subdirs: _set_nlink(store, i, n))
    store.commit()
    for ino in store.orphans():
        found("orphan", f"inode {ino} has no name and no open handle: reclaimed",
              lambda i=ino: vol.reclaim(i))
    for ino in store.dirty_data():
        found("unsynced size", f"{path_of(store, ino)} was being written at a crash: its "
              "chunk files were cut to the recorded size",
              lambda i=ino: (vol.pool.truncate_chunks(i, vol.layout(store.get(i)),
                                                      store.get(i).size)
                             if store.get(i).is_reg else None,
                             store.clear_dirty_data(i)))
    out += _chunk_findings(vol, repair)
    store.durable()
    return out


def _chunk_findings(vol: Volume, repair: bool) -> list[Finding]:
    """Chunk files against inodes: strays, tails past the size, missing sealed data."""
    store, out = vol.store, []
    inodes = {ino: (mode, size) for ino, mode, size in
              store.db.execute("SELECT ino, mode, size FROM inodes")}
    for member, ino in vol.pool.iter_chunks():
        path = vol.pool.chunk_path(member, ino)
        if ino not in inodes or not stat.S_ISREG(inodes[ino][0]):
            f = Finding("stray chunk file", f"{path} belongs to no file: removed")
            if repair:
                os.unlink(path)
                f.repaired = True
            out.append(f)
            continue
        node = store.get(ino)
        want = vol.layout(node).chunk_length(member, node.size)
        have = os.stat(path).st_size
        if have > want:
            f = Finding("tail", f"{path_of(store, ino)}: member {member} holds {have - want} "
                        "bytes past the file's size: cut")
            if repair:
                os.truncate(path, want)
                f.repaired = True
            out.append(f)
    for (ino,) in store.db.execute("SELECT ino FROM sealed WHERE ino IN (SELECT ino FROM "
                                   "inodes)").fetchall():
        node = store.get(ino)
        lay = vol.layout(node)
        for m in lay.used_members():
            want = lay.chunk_length(m, node.size)
            try:
                have = os.stat(vol.pool.chunk_path(m, ino)).st_size
            except FileNotFoundError:
                have = 0
            if have < want:
                out.append(Finding("missing data", f"{path_of(store, ino)}: member {m} holds "
                                   f"{have} of its {want} bytes (lost; scrub names the files)",
                                   fatal=True))
    return out


def _set_nlink(store: MetaStore, ino: int, n: int) -> None:
    node = store.get(ino)
    node.nlink = n
    store.save(node, "nlink")


def _to_lost_found(vol: Volume, ino: int) -> None:
    store = vol.store
    lf = store.entry_ino(ROOT_INO, LOST_FOUND)
    if lf is None:
        lf = store.create(ROOT_INO, LOST_FOUND, stat.S_IFDIR | 0o700, 0, 0).ino
    node = store.get(ino)
    name = str(ino).encode()
    store.db.execute("INSERT INTO dentries(parent, name, ino) VALUES (?,?,?)", (lf, name, ino))
    node.nlink = 2 if node.is_dir else 1
    node.ctime_ns = time.time_ns()
    store.save(node, "nlink", "ctime_ns")
    if node.is_dir:
        d = store.get(lf)
        d.nlink += 1
        store.save(d, "nlink")

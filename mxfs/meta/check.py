"""Invariants of the metadata store, checked after crashes and by tools.

Each broken invariant is one line naming the inode or entry: a dangling entry,
an entry under a non-directory, an unreachable inode that is not an orphan, or a
link count that disagrees with the entries.
"""

from __future__ import annotations

import stat

from mxfs.meta.store import ROOT_INO, MetaStore

_S_IFMT, _S_IFDIR = stat.S_IFMT(0o177777), stat.S_IFDIR


def invariant_problems(store: MetaStore) -> list[str]:
    """Namespace invariants; each broken one is a line naming the inode."""
    q = store.db.execute
    problems = []
    for (ok,) in q("PRAGMA integrity_check"):
        if ok != "ok":
            problems.append(f"sqlite: {ok}")
    for cookie, parent, ino in q("SELECT id, parent, ino FROM dentries WHERE ino NOT IN "
                                 "(SELECT ino FROM inodes)"):
        problems.append(f"entry {cookie} in directory {parent} points to missing inode {ino}")
    for ns, key, ino in q("SELECT ns, key, ino FROM kv WHERE ino NOT IN (SELECT ino FROM inodes)"):
        problems.append(f"KV chunk {key!r} of namespace {ns} points to missing inode {ino}")
    for cookie, parent in q("SELECT d.id, d.parent FROM dentries d LEFT JOIN inodes i "
                            "ON i.ino=d.parent WHERE i.ino IS NULL OR (i.mode & ?) != ?",
                            (_S_IFMT, _S_IFDIR)):
        problems.append(f"entry {cookie} has parent {parent}, which is not a directory")
    for ino, nlink, _mode in q(
            "SELECT ino, nlink, mode FROM inodes WHERE ino != ? AND ino NOT IN "
            "(SELECT ino FROM dentries) AND ino NOT IN (SELECT ino FROM orphans) "
            "AND ino NOT IN (SELECT ino FROM kv)",
            (ROOT_INO,)):
        problems.append(f"inode {ino} is unreachable (nlink {nlink}) and not an orphan")
    for ino, nlink, links in q(
            "SELECT i.ino, i.nlink, count(d.id) + (SELECT count(*) FROM kv WHERE kv.ino=i.ino) "
            "FROM inodes i LEFT JOIN dentries d ON d.ino=i.ino WHERE (i.mode & ?) != ? "
            "GROUP BY i.ino HAVING i.nlink != count(d.id) + "
            "(SELECT count(*) FROM kv WHERE kv.ino=i.ino)", (_S_IFMT, _S_IFDIR)):
        problems.append(f"inode {ino} has nlink {nlink} but {links} entries (names and KV keys)")
    for ino, nlink, subdirs in q(
            "SELECT i.ino, i.nlink, (SELECT count(*) FROM dentries d JOIN inodes c "
            "ON c.ino=d.ino WHERE d.parent=i.ino AND (c.mode & ?1)=?2) FROM inodes i "
            "WHERE (i.mode & ?1)=?2 AND i.nlink > 0", (_S_IFMT, _S_IFDIR)):
        if nlink != 2 + subdirs:
            problems.append(f"directory {ino} has nlink {nlink} but {subdirs} subdirectories")
    return problems

def inode_numbers(store: MetaStore) -> set[int]:
    return {r[0] for r in store.db.execute("SELECT ino FROM inodes")}

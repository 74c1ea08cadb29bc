"""The store's invariants, written once: checked after crashes (`Volume.problems`) and
by `mxfs fsck`, which repairs what they find.

Each broken invariant is a `Problem` naming the inode or entry: damage the engine
finds in its own storage, an entry or KV row pointing to a missing inode, an entry
under a non-directory, an unreachable inode that is not an orphan, a link count that
disagrees with the entries (names and KV keys), a directory whose link count is not
2 plus its subdirectories.  They are computed from scans through the engine
primitives, so every engine is checked by the same rules.
"""

from __future__ import annotations

import stat
from collections import Counter
from dataclasses import dataclass

from mxfs.meta.inode import ROOT_INO
from mxfs.meta.store import MetaStore

ENGINE = "engine"
DANGLING_ENTRY = "dangling entry"
DANGLING_KV = "dangling KV chunk"
PARENT_NOT_DIR = "parent not a directory"
UNREACHABLE = "unreachable inode"
LINK_COUNT = "link count"
DIR_LINK_COUNT = "directory link count"


@dataclass(frozen=True)
class Problem:
    kind: str
    text: str
    ino: int = 0  # the inode concerned (the missing one, for dangling rows)
    parent: int = 0  # entries: where the entry is
    name: bytes = b""  # entries: its name; KV rows: the key
    ns: str = ""  # KV rows: the namespace
    found: int = 0  # link counts: the count the rows make
    cookie: int = 0  # entries: the readdir cookie


def problems(store: MetaStore) -> list[Problem]:
    """Every broken invariant of the store.  Damage the engine reports comes alone:
    nothing else can be trusted then."""
    out = [Problem(ENGINE, line) for line in store.engine.integrity()]
    if out:
        return out
    e = store.engine
    inodes = {ino: (mode, nlink) for ino, mode, nlink in e.scan("inodes",
                                                                ("ino", "mode", "nlink"))}
    entries = list(e.scan("dentries", ("id", "parent", "name", "ino")))
    kv = list(e.scan("kv", ("ns", "key", "ino")))
    orphans = {r[0] for r in e.scan("orphans", ("ino",))}
    links: Counter[int] = Counter()
    subdirs: Counter[int] = Counter()
    for cookie, parent, name, ino in entries:
        name = bytes(name)
        links[ino] += 1
        if ino not in inodes:
            out.append(Problem(DANGLING_ENTRY, f"entry {cookie} in directory {parent} points "
                               f"to missing inode {ino}", ino, parent, name, cookie=cookie))
        elif stat.S_ISDIR(inodes[ino][0]):
            subdirs[parent] += 1
        if parent not in inodes or not stat.S_ISDIR(inodes[parent][0]):
            out.append(Problem(PARENT_NOT_DIR, f"entry {cookie} has parent {parent}, which is "
                               "not a directory", ino, parent, name, cookie=cookie))
    for ns, key, ino in kv:
        key = bytes(key)
        links[ino] += 1
        if ino not in inodes:
            out.append(Problem(DANGLING_KV, f"KV chunk {key!r} of namespace {ns} points to "
                               f"missing inode {ino}", ino, name=key, ns=ns))
    for ino, (mode, nlink) in sorted(inodes.items()):
        if ino != ROOT_INO and not links[ino] and ino not in orphans:
            out.append(Problem(UNREACHABLE, f"inode {ino} is unreachable (nlink {nlink}) and "
                               "not an orphan", ino))
        if stat.S_ISDIR(mode):
            if nlink > 0 and nlink != 2 + subdirs[ino]:
                out.append(Problem(DIR_LINK_COUNT, f"directory {ino} has nlink {nlink} but "
                                   f"{subdirs[ino]} subdirectories", ino,
                                   found=2 + subdirs[ino]))
        elif nlink != links[ino]:
            out.append(Problem(LINK_COUNT, f"inode {ino} has nlink {nlink} but {links[ino]} "
                               "entries (names and KV keys)", ino, found=links[ino]))
    return out

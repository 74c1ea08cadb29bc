"""Bytes and inodes each uid owns, kept up to date as the namespace changes (quotas).

A uid owns the inodes whose `uid` it is, the bytes of its regular files' sizes
(apparent sizes: a sparse file counts its size; a KV chunk is a regular file too), a
BLOCK at least for a file holding any byte (what its chunk file takes of a member: a
user put 5,000 one-byte KV chunks, 22 MB of members, charged 4.9 KiB), and of its
symbolic links' targets, and what its inodes cost the metadata store: their extended
attributes (names and values), the names in its directories and its KV chunks' keys,
NAME_ROW bytes each besides the name's own (a hard link is a name: a user with a quota
of ten inodes made 20,000 links, 12 MB of the store, charged nothing; a chunk's key,
with its namespace's name, is its writer's, the owner of its inode: `key_cost`).  A
name is its directory's owner's, as ext4 charges a directory's blocks, not its file's:
another user's links to her file, in a folder of his, spent her quota and she could
not remove them; a directory's owner can always remove the names in it.  Unlinked files
still open count until they are reclaimed, as on any filesystem.

Nothing is stored: the tally is counted from the rows once (`MetaStore.count_usage`,
a scan of every inode, which a daemon does only when a quota is set or asked about),
then every change to memory's inodes moves it, journal put-backs included.  A lost
group of changes makes it uncounted again, and the next use counts afresh.
"""

from __future__ import annotations

import stat
from collections import Counter
from collections.abc import Callable, Iterable

from mxfs.meta.inode import Inode

# The inode fields a tally depends on (a file's type never changes).
COUNTED = frozenset(("size", "uid"))
NAME_ROW = 128  # what a name costs the store besides its bytes (its row, its indexes)
BLOCK = 4096  # what a file holding any byte costs at least: a member's block (and inode)


def charged_size(mode: int, size: int) -> int:
    """What an inode's size costs its owner's byte quota: a regular file's size, a BLOCK
    at least once it holds a byte (an empty one holds no block); a link's target."""
    if stat.S_ISREG(mode):
        return file_cost(size)
    return size if stat.S_ISLNK(mode) else 0


def file_cost(size: int) -> int:
    """What a regular file (a KV chunk too) of `size` bytes is charged (`charged_size`)."""
    return max(size, BLOCK) if size > 0 else 0


def growth(old: int, new: int) -> int:
    """What a regular file growing from `old` to `new` bytes adds to its charge (none
    if it does not grow it: one byte past an empty file is a BLOCK, the next ones
    within it nothing)."""
    return max(0, file_cost(new) - file_cost(old))



def xattr_cost(name: bytes, value_len: int) -> int:
    """What an extended attribute costs its file's owner: its name, its value and
    NAME_ROW (charged its bytes alone, a user's 1-byte attributes cost the store 500
    times what her quota counted: 256 a file, on every file she owns)."""
    return len(name) + value_len + NAME_ROW

def key_cost(ns: str, key: bytes) -> int:
    """What a KV chunk's key costs its writer: its row's key, namespace and NAME_ROW (the
    store measures the namespace's characters, as `len` does)."""
    return len(ns) + len(key) + NAME_ROW


class Group:
    """What the uids of one group own together (a user's and her subordinate uids':
    `vol/quota.py`)."""

    __slots__ = ("bytes", "inodes", "xattrs", "names")

    def __init__(self) -> None:
        self.bytes = self.inodes = self.xattrs = self.names = 0

    def owned_bytes(self) -> int:
        return self.bytes + self.xattrs + self.names


class Usage:
    def __init__(self) -> None:
        self.counted = False
        self.bytes: Counter[int] = Counter()
        self.inodes: Counter[int] = Counter()
        self.xattrs: Counter[int] = Counter()  # bytes of xattr names and values
        self.names: Counter[int] = Counter()  # bytes of names in the uid's dirs and of its
        #                                       KV chunks' keys, rows too
        # Moves on whenever a uid starts or stops being counted.
        self.generation = 0
        # The same by group of uids (`grouped`), kept as the tally moves: a quota check
        # reads its user's at once (summed over her 65,536 subordinate uids at each
        # check, or grouped again whenever one started or stopped owning anything,
        # one user's xattr set and removed in a loop held the thread 21 ms a time).
        self._group: Callable[[int], int] | None = None
        self._group_stamp: object = None
        self._groups: dict[int, Group] = {}

    def grouped(self, group: Callable[[int], int], stamp: object) -> dict[int, Group]:
        """The tally by `group(uid)`, kept from now on; counted again (every uid) only
        when `stamp` (what `group` answers, e.g. the subordinate uids' generation)
        changed."""
        if self._group != group or self._group_stamp != stamp:
            self._group, self._group_stamp, self._groups = group, stamp, {}
            for uid in self.uids():
                g = self._of(uid)
                g.bytes += self.bytes[uid]
                g.inodes += self.inodes[uid]
                g.xattrs += self.xattrs[uid]
                g.names += self.names[uid]
        return self._groups

    def _of(self, uid: int) -> Group:
        assert self._group is not None
        key = self._group(uid)
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = Group()
        return found

    def recount(self, rows: Iterable[tuple[int, int, int, int, int]]) -> None:
        """Start again from (uid, mode, size, xattr bytes, bytes of the names in it or of
        its KV key) of every inode."""
        self.forget()
        self.generation += 1
        for uid, mode, size, xattrs, names in rows:
            self.inodes[uid] += 1
            if charged := charged_size(mode, size):
                self.bytes[uid] += charged
            if xattrs:
                self.xattrs[uid] += xattrs
            if names:
                self.names[uid] += names
        self.counted = True

    def forget(self) -> None:
        """Memory and the rows parted (a lost group): count again at the next use."""
        self.counted = False
        self.generation += 1
        self._group_stamp = object()  # (grouped again at the next ask)
        self.bytes.clear()
        self.inodes.clear()
        self.xattrs.clear()
        self.names.clear()

    def add_xattrs(self, uid: int, delta: int) -> None:
        if self.counted and self._group is not None:
            self._of(uid).xattrs += delta
        self._moved(_add(self.xattrs, uid, delta if self.counted else 0))

    def add_names(self, uid: int, delta: int) -> None:
        if self.counted and self._group is not None:
            self._of(uid).names += delta
        self._moved(_add(self.names, uid, delta if self.counted else 0))

    def _moved(self, keys_changed: bool) -> None:
        if keys_changed:
            self.generation += 1

    def add(self, uid: int, mode: int, size: int, sign: int = 1) -> None:
        """An inode born (sign 1) or gone for good (sign -1)."""
        if not self.counted:
            return
        self._moved(uid not in self.inodes)
        charged = sign * charged_size(mode, size)
        self.inodes[uid] += sign
        self.bytes[uid] += charged
        if self._group is not None:
            g = self._of(uid)
            g.inodes += sign
            g.bytes += charged
        self._tidy(uid)

    def change(self, node: Inode, name: str, value: object) -> None:
        """`node`'s field `name` is about to become `value` (called before it does)."""
        if not self.counted or name not in COUNTED or getattr(node, name) == value:
            return
        self.add(node.uid, node.mode, node.size, -1)
        uid = value if name == "uid" else node.uid
        size = value if name == "size" else node.size
        assert isinstance(uid, int) and isinstance(size, int)
        self.add(uid, node.mode, size)

    def _tidy(self, uid: int) -> None:
        if not self.inodes[uid] and not self.bytes[uid]:
            del self.inodes[uid]
            del self.bytes[uid]
            self.generation += 1

    def owned_bytes(self, uid: int) -> int:
        """What a byte quota counts: file (`charged_size`) and link sizes, xattrs, names
        and keys."""
        return self.bytes[uid] + self.xattrs[uid] + self.names[uid]

    def uids(self) -> set[int]:
        """Every uid the tally counts anything of."""
        return set(self.inodes) | set(self.bytes) | set(self.xattrs) | set(self.names)


def _add(tally: Counter[int], uid: int, delta: int) -> bool:
    """Add `delta` to `uid`'s count; whether `uid` started or stopped being counted."""
    if not delta:
        return False
    new = uid not in tally
    tally[uid] += delta
    if not tally[uid]:
        del tally[uid]
        return not new
    return new

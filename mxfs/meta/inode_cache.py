"""The inodes the store holds in memory, least recently used first, with the bytes of
the symlink targets among them counted.

Memory is bounded by how many inodes it holds (`store._CACHE_LIMIT`) and by those
bytes: a symlink's target is up to 4 KiB, and a tenant's 200,000 symlinks, each read
once (an `ls -l` of her tree), held 800 MiB of the daemon everyone shares under a bound
on their count alone.  A follower daemon's reads beside its thread share this object
(`MetaStore.read_beside`), so each way in and out holds a lock: an OrderedDict
subclass's `setdefault` calls `__setitem__` from C, and a thread switch between its
look and its insert gave two holders two objects for one inode.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from mxfs.meta.inode import Inode

TARGET_BYTES = 64 << 20  # symlink targets memory holds at most (16,000 of 4 KiB)

_ABSENT = object()


def _bytes(node: Inode) -> int:
    return len(node.target) if node.target else 0


class InodeCache(OrderedDict[int, Inode]):
    """An OrderedDict of inodes by number that knows its symlink targets' bytes.  The
    ways in and out are `__setitem__`, `setdefault`, `__delitem__`, `pop`, `popitem`
    and `clear`, each whole under the lock; reads (`get`, iteration) and `move_to_end`
    are OrderedDict's own.  Not to be copied (`copy`, `|`: a plain dict's semantics)."""

    def __init__(self) -> None:
        super().__init__()
        self.target_bytes = 0
        self._lock = threading.RLock()  # (re-entered nowhere; safe if C ever calls back)

    def over(self, limit: int) -> bool:
        """More than `limit` inodes, or more than TARGET_BYTES of symlink targets."""
        return len(self) > limit or self.target_bytes > TARGET_BYTES

    def __setitem__(self, ino: int, node: Inode) -> None:
        with self._lock:
            old = super().get(ino)
            super().__setitem__(ino, node)
            self.target_bytes += _bytes(node) - (_bytes(old) if old is not None else 0)

    def setdefault(self, ino: int, node: Inode) -> Inode:
        """The inode held for `ino`, or `node` put in for it: one object for every
        holder, whichever thread asks."""
        with self._lock:
            old = super().get(ino)
            if old is not None:
                return old
            super().__setitem__(ino, node)
            self.target_bytes += _bytes(node)
            return node

    def __delitem__(self, ino: int) -> None:
        with self._lock:
            node = super().__getitem__(ino)
            super().__delitem__(ino)
            self.target_bytes -= _bytes(node)

    def pop(self, ino: int, default: object = _ABSENT) -> Inode | None:  # type: ignore[override]
        with self._lock:
            node = super().get(ino)
            if node is None:
                if default is _ABSENT:
                    raise KeyError(ino)
                return default  # type: ignore[return-value]
            super().__delitem__(ino)
            self.target_bytes -= _bytes(node)
            return node

    def popitem(self, last: bool = True) -> tuple[int, Inode]:
        with self._lock:
            ino, node = super().popitem(last)
            self.target_bytes -= _bytes(node)
            return ino, node

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self.target_bytes = 0

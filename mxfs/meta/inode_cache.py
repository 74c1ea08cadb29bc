"""The inodes the store holds in memory, least recently used first, with the bytes of
the symlink targets among them counted.

Memory is bounded by how many inodes it holds (`store._CACHE_LIMIT`) and by those
bytes: a symlink's target is up to 4 KiB, and a tenant's 200,000 symlinks, each read
once (an `ls -l` of her tree), held 800 MiB of the daemon everyone shares under a bound
on their count alone.  A follower daemon's reads beside its thread share this object
(`MetaStore.read_beside`), so the count is changed under a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from mxfs.meta.inode import Inode

TARGET_BYTES = 64 << 20  # symlink targets memory holds at most (16,000 of 4 KiB)

class InodeCache(OrderedDict[int, Inode]):
    """An OrderedDict of inodes by number that knows its symlink targets' bytes.  Every
    way in and out goes through `__setitem__` (an OrderedDict subclass's `setdefault`
    calls it), `__delitem__`, `pop` or `clear`."""

    def __init__(self) -> None:
        super().__init__()
        self.target_bytes = 0
        self._lock = threading.Lock()

    def _count(self, node: Inode, sign: int) -> None:
        if node.target:
            with self._lock:
                self.target_bytes += sign * len(node.target)

    def over(self, limit: int) -> bool:
        """More than `limit` inodes, or more than TARGET_BYTES of symlink targets."""
        return len(self) > limit or self.target_bytes > TARGET_BYTES

    def __setitem__(self, ino: int, node: Inode) -> None:
        old = super().get(ino)
        super().__setitem__(ino, node)
        if old is not None:
            self._count(old, -1)
        self._count(node, 1)

    def __delitem__(self, ino: int) -> None:
        node = super().__getitem__(ino)
        super().__delitem__(ino)
        self._count(node, -1)

    def pop(self, ino: int, default: Inode | None = None) -> Inode | None:  # type: ignore[override]
        try:
            node = super().__getitem__(ino)
            super().__delitem__(ino)
        except KeyError:  # (absent, or popped meanwhile by the thread beside)
            return default
        self._count(node, -1)
        return node

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self.target_bytes = 0

"""Per-user quotas: how many bytes and inodes a uid may own, enforced by the daemon.

Limits live in the metadata store's settings (`quota.UID`, and `quota.default` for
every uid without one of its own), so they survive remounts and travel with dumps;
`mxfs quota` sets them through the daemon.  What a uid owns is the store's tally
(`meta/usage.py`: its inodes, its regular files' sizes, KV chunks among them, and its
inodes' extended attributes)
plus what its unpublished direct writes and KV chunks declared, and the shares of it
reserved for nodes writing its files through their mounts (`reserved`:
`fs/node_writes.Rooms`): a
direct writer is charged its declared size when it creates the file, and its chunk
files are cut back to that size (`fs/session.py`), so descriptors a writer holds
cannot take it past its quota either.

Growth is checked where it happens: a create, a write or truncate past the end of a
file (charged to the file's owner, as quotas are), a direct or KV create, a KV put.
Root is counted but never refused, as on any filesystem.
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mxfs.meta import Inode, MetaStore
from mxfs.meta.usage import NAME_ROW
from mxfs.proto.messages import QuotaReport, QuotaRow
from mxfs.units import format_size

PREFIX = "quota."
DEFAULT = "default"  # the limits of every uid without its own


@dataclass(frozen=True)
class Quota:
    bytes: int = 0  # 0: no limit
    inodes: int = 0

    def __bool__(self) -> bool:
        return bool(self.bytes or self.inodes)

    def text(self) -> str:
        return f"{self.bytes} {self.inodes}"

    @classmethod
    def parse(cls, text: str) -> Quota:
        b, i = (int(x) for x in text.split())
        return cls(max(b, 0), max(i, 0))


NONE = Quota()


class Freeing:
    """Bytes and inodes, by owner, of orphans queued to be freed (no longer open; the
    daemon frees them within a round): kept as they are queued and dropped, so a quota
    check that looks at them costs nothing however long the queue."""

    def __init__(self) -> None:
        self._queued: dict[int, tuple[int, int]] = {}  # ino -> (uid, bytes)
        self.bytes: Counter[int] = Counter()
        self.inodes: Counter[int] = Counter()

    def add(self, node: Inode) -> None:
        if node.ino in self._queued:
            return
        nbytes = node.size if node.is_reg else 0
        self._queued[node.ino] = (node.uid, nbytes)
        self.bytes[node.uid] += nbytes
        self.inodes[node.uid] += 1

    def drop(self, inos: Iterable[int]) -> None:
        for ino in inos:
            queued = self._queued.pop(ino, None)
            if queued is None:
                continue
            uid, nbytes = queued
            self.bytes[uid] -= nbytes
            self.inodes[uid] -= 1
            if not self.inodes[uid]:
                del self.inodes[uid], self.bytes[uid]

    def of(self, uid: int) -> tuple[int, int]:
        return self.bytes[uid], self.inodes[uid]

    def owner(self, ino: int) -> int:
        """The uid owning queued orphan `ino` (0 if not queued)."""
        return self._queued.get(ino, (0, 0))[0]


class Quotas:
    def __init__(self, store: MetaStore,
                 freeing: Callable[[int], tuple[int, int]] = lambda uid: (0, 0),
                 held: Callable[[int], int] = lambda uid: 0) -> None:
        self.store = store
        # Bytes and inodes of a uid's orphans that wait to be freed (reclaim runs every
        # few milliseconds): not held against it, so a write right after an unlink fits.
        self.freeing = freeing
        # Bytes of a uid's removed or renewed files kept for their readers a while
        # (`pool/revoke.py`): held against it.
        self.held = held
        self.reserved: Counter[int] = Counter()  # declared by unpublished files, by uid
        self.limits: dict[str, Quota] = {}
        for key, value in store.settings(PREFIX):
            try:
                self.limits[key[len(PREFIX):]] = Quota.parse(value)
            except ValueError:
                continue  # (not one of ours: never written by `set`)

    def of(self, uid: int) -> Quota:
        """The limits that hold for `uid`: its own, else the default."""
        return self.limits.get(str(uid)) or self.limits.get(DEFAULT, NONE)

    def left(self, uid: int) -> int | None:
        """Bytes `uid` may still come to own (None: no byte limit holds for it)."""
        quota = self.of(uid) if uid != 0 and self.limits else None
        if not quota or not quota.bytes:
            return None
        owned = self.store.count_usage().owned_bytes(uid) + self.reserved[uid] + \
            self.held(uid)
        return max(0, quota.bytes - owned + self.freeing(uid)[0])

    def room(self, uid: int, nbytes: int = 0, inodes: int = 0) -> None:
        """EDQUOT if `uid` owning `nbytes` and `inodes` more would pass its quota."""
        if uid == 0 or not self.limits:
            return
        quota = self.of(uid)
        if not quota:
            return
        usage = self.store.count_usage()
        if quota.bytes and nbytes > 0:
            owned = usage.owned_bytes(uid) + self.reserved[uid] + self.held(uid)
            if owned + nbytes > quota.bytes:
                owned -= self.freeing(uid)[0]
            if owned + nbytes > quota.bytes:
                raise OSError(errno.EDQUOT, f"uid {uid} owns {format_size(owned)} of its "
                              f"{format_size(quota.bytes)} quota and this needs "
                              f"{format_size(nbytes)} more: remove files, or ask root to "
                              "raise it (mxfs quota)")
        if quota.inodes and inodes > 0:
            owned = usage.inodes[uid]
            if owned + inodes > quota.inodes:
                owned -= self.freeing(uid)[1]
            if owned + inodes > quota.inodes:
                raise OSError(errno.EDQUOT, f"uid {uid} owns {owned} of its {quota.inodes} "
                              "inodes (files, folders and KV chunks): remove some, or ask "
                              "root to raise its quota (mxfs quota)")

    def room_for_name(self, uid: int, name: bytes, target: bytes = b"", inodes: int = 0
                      ) -> None:
        """EDQUOT if `uid` may not be charged a new name (a hard link's, or a new
        inode's with `inodes` 1) and a link's `target` (`meta/usage.py`)."""
        self.room(uid, len(name) + NAME_ROW + len(target), inodes)

    def reserve(self, uid: int, nbytes: int) -> None:
        self.reserved[uid] += nbytes

    def release(self, uid: int, nbytes: int) -> None:
        self.reserved[uid] -= nbytes
        if self.reserved[uid] <= 0:
            del self.reserved[uid]

    def set(self, who: str, quota: Quota) -> None:
        """Set (or with an empty quota, clear) the limits of a uid ("1001") or the
        default; written through to the store at once."""
        if quota:
            self.store.set_setting(PREFIX + who, quota.text())
            self.limits[who] = quota
            self.store.count_usage()  # (counted now, not on a tenant's next write)
        else:
            self.store.drop_setting(PREFIX + who)
            self.limits.pop(who, None)

    def report(self, uid: int | None = None, most: int = 1000) -> QuotaReport:
        """What `mxfs quota` shows: each uid's usage against its limits (only `uid`'s
        when given; else every uid with a quota of its own or anything owned, the
        `most` largest by bytes), and the default."""
        usage = self.store.count_usage()
        if uid is not None:
            uids = [uid]
        else:
            named = {int(k) for k in self.limits if k != DEFAULT}
            owners = sorted(set(usage.inodes) | set(self.reserved),
                            key=lambda u: -usage.owned_bytes(u))
            uids = sorted(named | set(owners[:most]))
        rows: list[QuotaRow] = []
        for u in uids:
            quota = self.of(u) if u != 0 else NONE
            rows.append({"uid": u, "bytes": usage.owned_bytes(u), "xattr_bytes": usage.xattrs[u],
                         "name_bytes": usage.names[u],
                         "reserved": self.reserved[u],
                         "inodes": usage.inodes[u], "bytes_limit": quota.bytes,
                         "inodes_limit": quota.inodes,
                         "own": str(u) in self.limits})
        default = self.limits.get(DEFAULT, NONE)
        return {"users": rows, "default": {"bytes_limit": default.bytes,
                                           "inodes_limit": default.inodes}}


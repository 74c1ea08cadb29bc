"""What a publishing store noted of each group of changes, and a feed row's body: the
writer's half of the change feed (`meta/change_feed.py` reads the rows).

`Noted` collects, in each open group, the inodes whose rows were written (apart: those
whose data changed, size or mtime), the names added, removed or moved, and the KV keys
stored and dropped and namespaces removed, in order (reading nodes keep their
namespaces' presence tables by them: `fs/kv_views.py`); a failed change's notes are
dropped, a lost group's too.  A row carries MAX_NAME_BYTES of names at most (past it,
"everything", as past MAX_NOTED things: a row's bytes are bounded, and so what a
follower fetches in one batch) and MAX_KV_BYTES of KV notes: past it
the namespaces with the most are each told as one "every key of it" note (KV_RESET),
so one tenant's eviction of 65,536 keys makes reading nodes refill that namespace's
table, not every tenant's.  `Change` is one group's (or several merged), encoded
compactly in its row; a body this version cannot read is "everything".
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

MAX_NOTED = 20_000  # past it a group is published as "everything"
MAX_KV_BYTES = 1 << 20  # KV keys one row carries; past it, the largest namespaces reset
MAX_NAME_BYTES = 1 << 20  # names one row carries; past it the group is "everything"
# What a KV note says: a key stored or removed, a namespace gone, or any of its keys
# may have changed (its notes did not fit in the row).
KV_REMOVED, KV_STORED, KV_GONE, KV_RESET = 0, 1, 2, 3

_HEAD = struct.Struct("!BIII")  # flags, inodes, inodes with new data, names
_INO = struct.Struct("!q")
_NAME = struct.Struct("!qH")  # directory, length of the name that follows
_KV = struct.Struct("!BI")  # (after the names) flags (_EVERYTHING: of KV), KV notes
_KV_NOTE = struct.Struct("!BHH")  # what, namespace bytes, key bytes (then both)
_EVERYTHING = 1
_DATA = b""  # (a name is never empty)


def channel(pool_uuid: str) -> str:
    """The notification channel of a pool (an SQL identifier: letters and digits)."""
    return "mxfs_" + pool_uuid.replace("-", "")


@dataclass
class Change:
    """One published group (or, from `FeedReader`, several merged)."""

    inos: set[int] = field(default_factory=set)  # attributes changed
    names: set[tuple[int, bytes]] = field(default_factory=set)
    everything: bool = False
    data: set[int] = field(default_factory=set)  # data changed (size, mtime) too
    # KV keys stored and removed, namespaces gone, in commit order: (what, ns, key)
    kv: list[tuple[int, str, bytes]] = field(default_factory=list)
    kv_everything: bool = False  # KV keys changed that are not listed (too many)

    def __bool__(self) -> bool:
        return self.everything or self.kv_everything or \
            bool(self.inos or self.data or self.names or self.kv)

    @property
    def kv_unknown(self) -> bool:
        """Whether KV keys changed that `kv` does not list."""
        return self.everything or self.kv_everything

    def merge(self, other: Change) -> None:
        self.everything |= other.everything
        self.kv_everything |= other.kv_everything
        if self.everything:
            self.inos.clear()
            self.data.clear()
            self.names.clear()
        else:
            self.inos |= other.inos
            self.data |= other.data
            self.names |= other.names
        if self.kv_unknown:
            self.kv.clear()
        else:
            self.kv += other.kv

    def encode(self) -> bytes:
        if self.everything or len(self.inos) + len(self.data) + len(self.names) > MAX_NOTED \
                or sum(len(name) for _, name in self.names) > MAX_NAME_BYTES:
            return _HEAD.pack(_EVERYTHING, 0, 0, 0)
        out = [_HEAD.pack(0, len(self.inos), len(self.data), len(self.names))]
        out += [_INO.pack(i) for i in sorted(self.inos)]
        out += [_INO.pack(i) for i in sorted(self.data)]
        for parent, name in sorted(self.names):
            out += [_NAME.pack(parent, len(name)), name]
        kv = None if self.kv_everything else _fitted(self.kv)
        if kv is None:
            out.append(_KV.pack(_EVERYTHING, 0))
        elif kv:
            out.append(_KV.pack(0, len(kv)))
            for what, ns, key in kv:
                raw = ns.encode()
                out += [_KV_NOTE.pack(what, len(raw), len(key)), raw, key]
        return b"".join(out)

    @classmethod
    def decode(cls, body: bytes) -> Change:
        """A row's body; one this version cannot read is "everything" (never less)."""
        try:
            flags, n_inos, n_data, n_names = _HEAD.unpack_from(body)
            if flags & _EVERYTHING:
                return cls(everything=True)
            at = _HEAD.size
            inos = {_INO.unpack_from(body, at + k * _INO.size)[0] for k in range(n_inos)}
            at += n_inos * _INO.size
            data = {_INO.unpack_from(body, at + k * _INO.size)[0] for k in range(n_data)}
            at += n_data * _INO.size
            names = set()
            for _ in range(n_names):
                parent, n = _NAME.unpack_from(body, at)
                at += _NAME.size
                name = bytes(body[at:at + n])
                if len(name) != n:
                    raise ValueError("a name runs past the body")
                at += n
                names.add((parent, name))
            kv: list[tuple[int, str, bytes]] = []
            if at < len(body):
                kv_flags, n_kv = _KV.unpack_from(body, at)
                at += _KV.size
                if kv_flags & _EVERYTHING:
                    return cls(inos, names, data=data, kv_everything=True)
                for _ in range(n_kv):
                    what, n_ns, n_key = _KV_NOTE.unpack_from(body, at)
                    if what > KV_RESET:
                        raise ValueError(f"a KV note says {what}, unknown here")
                    at += _KV_NOTE.size
                    ns, key = bytes(body[at:at + n_ns]), bytes(body[at + n_ns:at + n_ns + n_key])
                    if len(ns) + len(key) != n_ns + n_key:
                        raise ValueError("a KV note runs past the body")
                    at += n_ns + n_key
                    kv.append((what, ns.decode(), key))
            return cls(inos, names, data=data, kv=kv)
        except (struct.error, ValueError):  # (UnicodeDecodeError is one)
            return cls(everything=True)


def _fitted(kv: list[tuple[int, str, bytes]]) -> list[tuple[int, str, bytes]] | None:
    """KV notes as a row carries them: the namespaces with the most bytes of notes each
    told as one KV_RESET (after the others' notes, which keep their order) until the
    rest fit; None if even that does not (thousands of namespaces: "every KV key")."""
    count = len(kv)
    size = sum(len(ns.encode()) + len(key) for _, ns, key in kv)
    if count <= MAX_NOTED and size <= MAX_KV_BYTES:
        return kv
    per: dict[str, list[int]] = {}  # namespace: [notes, bytes]
    for _, ns, key in kv:
        tally = per.setdefault(ns, [0, 0])
        tally[0] += 1
        tally[1] += len(ns.encode()) + len(key)
    reset: list[str] = []
    for ns, (notes, nbytes) in sorted(per.items(), key=lambda item: -item[1][1]):
        if count <= MAX_NOTED and size <= MAX_KV_BYTES:
            break
        reset.append(ns)
        count -= notes - 1
        size -= nbytes - len(ns.encode())
    if count > MAX_NOTED or size > MAX_KV_BYTES:
        return None
    gone = set(reset)
    return [n for n in kv if n[1] not in gone] + [(KV_RESET, ns, b"") for ns in reset]


class Noted:
    """What the open group of a publishing store changed (`MetaStore.feed`).  The
    running change's notes are dropped if it fails (`mark`, `undo`), the group's if it
    is lost (`lose`)."""

    def __init__(self, node: str, epoch: int, channel: str) -> None:
        self.node = node
        self.epoch = epoch
        self.channel = channel
        # (inode, None) or (inode, b"") when its data changed, or (directory, name)
        self._items: list[tuple[int, bytes | None]] = []
        self._kv: list[tuple[int, str, bytes]] = []
        self._mark = self._kv_mark = 0
        self.everything = True  # until a first group commits: a writer's session starts
        self._sent = False  # the open group's row is written
        self.published = 0  # groups published (status; when to prune: `change_feed`)
        self.published_bytes = 0  # bytes of their rows' bodies
        self._body = 0  # the open group's row's
        # Whether KV keys are listed (while reading nodes are alive: they keep tables by
        # them); else a group that changed any says only "every KV key" (a few bytes).
        self.list_kv = True
        self._kv_unlisted = False

    def ino(self, ino: int, data: bool = False) -> None:
        self._items.append((ino, _DATA if data else None))

    def name(self, parent: int, name: bytes) -> None:
        self._items.append((parent, name))

    def kv(self, what: int, ns: str, key: bytes = b"") -> None:
        """A KV key stored or removed (KV_STORED, KV_REMOVED), a namespace gone (KV_GONE)."""
        if self.list_kv:
            self._kv.append((what, ns, key))
        else:
            self._kv_unlisted = True

    def mark(self) -> None:
        """A change starts."""
        self._mark, self._kv_mark = len(self._items), len(self._kv)

    def undo(self) -> None:
        """The running change failed: what it noted did not happen."""
        del self._items[self._mark:]
        del self._kv[self._kv_mark:]

    def lose(self) -> None:
        """The whole group was lost: nothing of it happened, its row included."""
        self._items.clear()
        self._kv.clear()
        self._kv_unlisted = False
        self._mark = self._kv_mark = 0
        self._sent = False

    def take(self) -> Change | None:
        """What the group changed, to publish as it commits (None: nothing new)."""
        items, self._items, self._mark = self._items, [], 0
        kv, self._kv, self._kv_mark = self._kv, [], 0
        unlisted, self._kv_unlisted = self._kv_unlisted, False
        if not items and not kv and not unlisted and (self._sent or not self.everything):
            return None
        self._sent = True
        change = Change(everything=self.everything, kv=kv, kv_everything=unlisted)
        if not change.everything:
            for a, b in items:
                if b is None:
                    change.inos.add(a)
                elif b is _DATA:
                    change.data.add(a)
                else:
                    change.names.add((a, b))
        return change

    def settled(self) -> None:
        """No group is open: the one whose row was written committed."""
        if self._sent:
            self._sent = False
            self.everything = False
            self.published += 1
            self.published_bytes += self._body

    def row(self, change: Change) -> dict[str, object]:
        body = change.encode()
        self._body = len(body)
        return {"node": self.node, "epoch": self.epoch, "at": time.time_ns(), "body": body}

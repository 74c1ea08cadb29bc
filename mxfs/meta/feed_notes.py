"""What a publishing store noted of each group of changes, and a feed row's body: the
writer's half of the change feed (`meta/change_feed.py` reads the rows).

`Noted` collects, in each open group, the inodes whose rows were written (apart: those
whose data changed, size or mtime) and the names added, removed or moved; a failed
change's notes are dropped, a lost group's too.  `Change` is one group's (or several
merged), encoded compactly in its row; a body this version cannot read is "everything".
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

MAX_NOTED = 20_000  # past it a group is published as "everything"

_HEAD = struct.Struct("!BIII")  # flags, inodes, inodes with new data, names
_INO = struct.Struct("!q")
_NAME = struct.Struct("!qH")  # directory, length of the name that follows
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

    def __bool__(self) -> bool:
        return self.everything or bool(self.inos or self.data or self.names)

    def merge(self, other: Change) -> None:
        self.everything |= other.everything
        if self.everything:
            self.inos.clear()
            self.data.clear()
            self.names.clear()
        else:
            self.inos |= other.inos
            self.data |= other.data
            self.names |= other.names

    def encode(self) -> bytes:
        if self.everything or len(self.inos) + len(self.data) + len(self.names) > MAX_NOTED:
            return _HEAD.pack(_EVERYTHING, 0, 0, 0)
        out = [_HEAD.pack(0, len(self.inos), len(self.data), len(self.names))]
        out += [_INO.pack(i) for i in sorted(self.inos)]
        out += [_INO.pack(i) for i in sorted(self.data)]
        for parent, name in sorted(self.names):
            out += [_NAME.pack(parent, len(name)), name]
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
            return cls(inos, names, data=data)
        except (struct.error, ValueError):
            return cls(everything=True)


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
        self._mark = 0
        self.everything = True  # until a first group commits: a writer's session starts
        self._sent = False  # the open group's row is written
        self.published = 0  # groups published (status)

    def ino(self, ino: int, data: bool = False) -> None:
        self._items.append((ino, _DATA if data else None))

    def name(self, parent: int, name: bytes) -> None:
        self._items.append((parent, name))

    def mark(self) -> None:
        """A change starts."""
        self._mark = len(self._items)

    def undo(self) -> None:
        """The running change failed: what it noted did not happen."""
        del self._items[self._mark:]

    def lose(self) -> None:
        """The whole group was lost: nothing of it happened, its row included."""
        self._items.clear()
        self._mark = 0
        self._sent = False

    def take(self) -> Change | None:
        """What the group changed, to publish as it commits (None: nothing new)."""
        items, self._items, self._mark = self._items, [], 0
        if not items and (self._sent or not self.everything):
            return None
        self._sent = True
        change = Change(everything=self.everything)
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

    def row(self, change: Change) -> dict[str, object]:
        return {"node": self.node, "epoch": self.epoch, "at": time.time_ns(),
                "body": change.encode()}

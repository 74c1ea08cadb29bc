"""Removed files waiting to be freed, handed out by owner in turn.

The daemon frees a bite of them a round (`fs/daemon.py`).  First come, first served,
one user's mass removal (a KV namespace of 65,536 chunks, a tree of small files) held
every other user's removed files behind it for as long as it took: a user who removed
a large file to make room for a write found the pool still full.  Each owner (by
tenant: `vol/tenants.py`) now has a line of its own (`vol/tenant_lines.py`) and a bite
takes one file from each line in turn, so another user's removal waits a round or
two, not for the whole queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from mxfs.vol.tenant_lines import Lines
from mxfs.vol.tenants import tenant_of


class ReclaimQueue:
    def __init__(self) -> None:
        self._lines: Lines[int] = Lines()  # by owner's tenant
        self._again: deque[int] = deque()  # taken but not freed: first in the next bite

    def __len__(self) -> int:
        return len(self._again) + len(self._lines)

    def push(self, ino: int, uid: int) -> None:
        """Queue removed file `ino`, owned by `uid`."""
        self._lines.push(tenant_of(uid), ino)

    def push_all(self, inos: Iterable[int], uid: int) -> None:
        for ino in inos:
            self.push(ino, uid)

    def put_back(self, inos: list[int]) -> None:
        """`inos`, taken by `take` and not freed (a failed commit, a bite cut short),
        go first in the next bite, in order."""
        self._again.extendleft(reversed(inos))

    def take(self, most: int | None = None) -> list[int]:
        """At most `most` (None: all) queued files: those put back first, then one from
        each owner's line in turn."""
        most = len(self) if most is None else min(most, len(self))
        out = [self._again.popleft() for _ in range(min(most, len(self._again)))]
        while len(out) < most:
            out.append(self._lines.pop())
        return out

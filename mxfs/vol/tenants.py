"""Who a uid answers to, for the daemon's per-user limits and turns.

A user may run processes as her subordinate uids (/etc/subuid: rootless containers,
`newuidmap`): 65,536 of them by useradd's default.  Counted apart, each would have a
user's share of connections, turns, descriptors in flight, pins and claims, and one
user would hold the daemon's totals alone.  So a subordinate uid answers to the user
the file names: her limits are shared by all her uids.  Permissions and ownership
still go by the uid itself.  The file is read again when it changes (looked at once
a second at most).
"""

from __future__ import annotations

import bisect
import os
import pwd
import threading
import time

SUBUID = "/etc/subuid"
LOOK_S = 1.0  # the file is looked at (stat) this often at most


class Tenants:
    def __init__(self, path: str = SUBUID) -> None:
        self.path = path
        self._lock = threading.Lock()  # (asked from worker threads too)
        self._looked = -LOOK_S
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of what was read
        self._starts: list[int] = []  # range starts, sorted
        self._ranges: list[tuple[int, int, int]] = []  # (start, end, owner uid)

    def of(self, uid: int) -> int:
        """The uid whose limits `uid` shares: the user owning the subordinate range it
        falls in, else itself."""
        self._refresh()
        k = bisect.bisect_right(self._starts, uid) - 1
        if k >= 0:
            start, end, owner = self._ranges[k]
            if start <= uid < end:
                return owner
        return uid

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._looked < LOOK_S:
            return
        with self._lock:
            self._looked = now
            try:
                st = os.stat(self.path)
            except OSError:
                self._stamp, self._starts, self._ranges = None, [], []
                return
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._ranges = _read(self.path)
                self._starts = [r[0] for r in self._ranges]
                self._stamp = stamp


def _read(path: str) -> list[tuple[int, int, int]]:
    """(start, end, owner) of each range in a subuid file ("name-or-uid:start:count"),
    sorted; lines that name no known user or are malformed are left out."""
    ranges = []
    try:
        with open(path, "rb") as f:
            lines = f.read(1 << 20).decode(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        name, start, count = parts[0], int(parts[1]), int(parts[2])
        try:
            owner = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
        if count > 0 and owner != 0:
            ranges.append((start, start + count, owner))
    return sorted(ranges)


TENANTS = Tenants()


def tenant_of(uid: int) -> int:
    """`uid`'s tenant (`Tenants.of`), from the system's subordinate uid file."""
    return TENANTS.of(uid)

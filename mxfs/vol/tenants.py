"""Who a uid answers to, for the daemon's per-user limits and turns.

A user may run processes as her subordinate uids (/etc/subuid: rootless containers,
`newuidmap`): 65,536 of them by useradd's default.  Counted apart, each would have a
user's share of connections, turns, descriptors in flight, pins and claims, and one
user would hold the daemon's totals alone.  So a subordinate uid answers to the user
the file names: her connections, turns, descriptors in flight, unpublished files, KV
read leases and claims are counted together, and her quota bounds what all her uids own
(`vol/quota.py`).  Permissions and ownership still go by the uid itself.  The daemon
reads the file again, off its thread, once a second when it changed (`refresh`).
"""

from __future__ import annotations

import bisect
import os
import pwd

SUBUID = "/etc/subuid"


class Tenants:
    def __init__(self, path: str = SUBUID) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of what was read
        # (range starts sorted, (start, end, owner) ranges): one tuple, replaced whole
        # (asked from worker threads while it is read again)
        self._table: tuple[list[int], list[tuple[int, int, int]]] = ([], [])
        # Moves on after each new table: what was grouped by tenant is grouped again.
        self.generation = 0

    def of(self, uid: int) -> int:
        """The uid whose limits `uid` shares: the user owning the subordinate range it
        falls in, else itself (as of the last `refresh`)."""
        starts, ranges = self._table
        k = bisect.bisect_right(starts, uid) - 1
        if k >= 0:
            start, end, owner = ranges[k]
            if start <= uid < end:
                return owner
        return uid

    def refresh(self) -> None:
        """Blocking (names are resolved through NSS, which may ask a directory server):
        read the file again if it changed since the last time."""
        try:
            st = os.stat(self.path)
        except OSError:
            if self._stamp is not None:
                self._stamp, self._table = None, ([], [])
                self.generation += 1
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            ranges = _read(self.path)
            self._table = ([r[0] for r in ranges], ranges)
            self._stamp = stamp
            self.generation += 1


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
        # (ASCII digits: int() of others' digits, "²", raised and ended the refresh)
        if len(parts) != 3 or not all(p.isascii() and p.isdecimal() for p in parts[1:]):
            continue
        name, start, count = parts[0], int(parts[1]), int(parts[2])
        try:
            owner = int(name) if name.isascii() and name.isdecimal() else \
                pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
        if count > 0 and owner != 0:
            ranges.append((start, start + count, owner))
    return sorted(ranges)


TENANTS = Tenants()


def tenant_of(uid: int) -> int:
    """`uid`'s tenant (`Tenants.of`), from the system's subordinate uid file."""
    return TENANTS.of(uid)

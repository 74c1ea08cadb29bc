"""Whether a caller could reach the mount point through the kernel: search permission
on every folder above it, judged by their mode bits as the caller's uid and groups.

The control socket is open to everyone (0666), and each request's path is judged from
the pool's root down (`vol/access.py`); the folders above the mount point are another
file system's, which the daemon never saw.  A pool mounted under a folder closed to a
user (`/srv/teamA/pool`, `/srv/teamA` 0750) handed her chunk descriptors of any file
`cat` refused her: a connection of a caller who cannot reach the mount point is now
refused.  Judged at connect, off the loop (the folders may be on a network file
system), and kept REACH_S per caller.  POSIX ACLs of those folders are not read: a
user let in by an ACL alone is refused here (give her the folder's group instead).
"""

from __future__ import annotations

import os
import stat
import time

import trio

from mxfs.vol.access import Caller

REACH_S = 1.0  # how long a judgement stands for one uid and its groups


def _above(mountpoint: str) -> list[str]:
    """The folders a path walk to `mountpoint` searches: / down to its parent."""
    path, out = os.path.dirname(os.path.abspath(mountpoint)), []
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out[::-1]
        path = parent


def may_search(st: os.stat_result, uid: int, gids: frozenset[int]) -> bool:
    """Whether `uid` (in `gids`) may search a folder of `st` by its mode bits."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


class MountReach:
    """Who may reach `mountpoint` (see the module's docstring)."""

    def __init__(self, mountpoint: str) -> None:
        self._above = _above(mountpoint)
        self._judged: dict[tuple[int, frozenset[int]], tuple[float, bool]] = {}
        self._limiter = trio.CapacityLimiter(2)

    def reaches(self, uid: int, gids: frozenset[int]) -> bool:
        """(Blocking.)  Whether every folder above the mount point lets the caller by
        (one that cannot be looked at lets nobody by)."""
        try:
            return all(may_search(os.stat(d), uid, gids) for d in self._above)
        except OSError:
            return False

    async def may_reach(self, caller: Caller) -> bool:
        if caller.uid == 0:
            return True
        gids = frozenset({caller.gid, *caller.gids})
        key, now = (caller.uid, gids), time.monotonic()
        judged = self._judged.get(key)
        if judged is not None and judged[0] > now:
            return judged[1]
        if len(self._judged) > 4096:  # (bounded: callers come and go)
            self._judged = {k: v for k, v in self._judged.items() if v[0] > now}
            if len(self._judged) > 4096:
                self._judged.clear()
        ok = await trio.to_thread.run_sync(self.reaches, caller.uid, gids,
                                           limiter=self._limiter)
        self._judged[key] = (time.monotonic() + REACH_S, ok)
        return ok

"""Whether a caller could reach the mount point through the kernel: search permission
on every folder above it, judged by their mode bits as the caller's uid and groups.

The control socket is open to everyone (0666), and each request's path is judged from
the pool's root down (`vol/access.py`); the folders above the mount point are another
file system's, which the daemon never saw.  A pool mounted under a folder closed to a
user (`/srv/teamA/pool`, `/srv/teamA` 0750) handed her chunk descriptors of any file
`cat` refused her: a connection of a caller who cannot reach the mount point is now
refused.  Judged at connect, off the loop (the folders may be on a network file
system), and kept REACH_S per caller.  A folder's POSIX access ACL is judged as the
kernel judges it (acl(5)): judged by its mode bits alone, a user an ACL entry shuts
out of a 0755 folder was let by, and one an entry lets into a 0750 folder refused.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
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


ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_ENTRY = struct.Struct("<HHI")  # tag, perm, id
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_X = 1  # the search (execute) bit of an entry's perm


def may_search(st: os.stat_result, uid: int, gids: frozenset[int],
               acl: bytes | None = None) -> bool:
    """Whether `uid` (in `gids`) may search a folder of `st` with access ACL `acl`
    (the xattr's value; None: none, its mode bits alone)."""
    if uid == 0:
        return True
    if acl is not None:
        return _acl_allows(acl, st.st_uid, st.st_gid, uid, gids)
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _acl_allows(acl: bytes, owner: int, group: int, uid: int, gids: frozenset[int]
                ) -> bool:
    """The kernel's check of an access ACL for search (acl(5), "access check
    algorithm"); one it could not have stored lets nobody by."""
    body = acl[4:]
    if len(acl) < 4 or int.from_bytes(acl[:4], "little") != _ACL_VERSION or \
            len(body) % _ACL_ENTRY.size:
        return False
    entries = [_ACL_ENTRY.unpack_from(body, i) for i in range(0, len(body), _ACL_ENTRY.size)]
    mask = next((perm for tag, perm, _ in entries if tag == _MASK), 0o7)
    if owner == uid:
        return any(tag == _USER_OBJ and perm & _X for tag, perm, _ in entries)
    for tag, perm, who in entries:
        if tag == _USER and who == uid:
            return bool(perm & mask & _X)
    matched = False
    for tag, perm, who in entries:
        if tag == _GROUP_OBJ and group in gids or tag == _GROUP and who in gids:
            if perm & mask & _X:
                return True
            matched = True
    if matched:
        return False
    return any(tag == _OTHER and perm & _X for tag, perm, _ in entries)


def _acl_of(folder: str) -> bytes | None:
    """`folder`'s access ACL, None where it has none (or its file system keeps none)."""
    try:
        return os.getxattr(folder, ACL_XATTR)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


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
            return all(may_search(os.stat(d), uid, gids, _acl_of(d)) for d in self._above)
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

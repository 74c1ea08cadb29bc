"""The pool lock: one flock on the metadata member's meta/daemon.lock.

Exclusive for a mount or an offline writer, shared for offline readers
(`OfflinePool`); the file holds JSON naming the exclusive holder.  It is taken
without opening the store, so a tool that replaces a missing or damaged store can
hold the pool first.  (A pool whose store is on a server is also held by a lease row
in it, `meta/lease.py`, since a server is reached from every node.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mxfs.errors import MxfsError
from mxfs.pool.pool import Pool

LOCK_NAME = "daemon.lock"
LOCK_BYTES = 4096  # the holder's name, padded (`write_lock_info`); what readers read


def take_pool_lock(pool: Pool, who: str, mountpoint: str | None = None,
                   socket_path: str | None = None) -> int:
    """Lock `pool` exclusively for `who` (e.g. "mxfs meta restore"); the locked fd.

    Refused with one line naming the holder: a mount (where, pid) or a tool (pid).
    """
    os.makedirs(pool.meta_dir, mode=0o700, exist_ok=True)
    path = os.path.join(pool.meta_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except PermissionError:
        raise _private_lock(path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = read_lock_info(pool)
        again = "already " if who == "mxfs mount" else ""
        raise MxfsError(f"pool {pool.uuid} is {again}{describe_holder(holder)}",
                        _holder_fix(holder)) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        write_lock_info(fd, {"pid": os.getpid(), "tool": who, "mountpoint": mountpoint,
                              "socket": socket_path})
    except BaseException:
        os.close(fd)  # (and the flock with it)
        raise
    return fd


def make_pool_lock(pool: Pool) -> None:
    """The lock file, its block taken, as mkfs makes the pool (`write_lock_info`)."""
    fd = os.open(os.path.join(pool.meta_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        write_lock_info(fd, None)
    finally:
        os.close(fd)


def release_pool_lock(fd: int) -> None:
    """Forget the holder (its block kept: `write_lock_info`), then let go of the lock."""
    try:
        write_lock_info(fd, None)
    except OSError:
        pass  # (the flock goes with the descriptor: a stale name is only a name)
    finally:
        os.close(fd)


@contextmanager
def pool_lock(pool: Pool, who: str) -> Iterator[None]:
    """Hold `pool` for an offline tool for the whole block."""
    fd = take_pool_lock(pool, who)
    try:
        yield
    finally:
        release_pool_lock(fd)


def write_lock_info(fd: int, info: dict[str, Any] | None) -> bool:
    """Name the holder (None: nobody) in LOCK_BYTES, padded, written over in place (the
    file keeps its block); False where the member had no room for it.  The flock is the
    lock, the name only says who holds it (readers take a lock without one as held by
    someone), so a metadata member that filled up since still mounts, and its users free
    space through the mount: truncated and written again, the name took a new block,
    and a full member refused every mount and tool."""
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
        os.fchmod(fd, 0o600)  # made by an older version: private from now on
    data = json.dumps(info).encode() if info is not None else b""
    data = data.ljust(LOCK_BYTES)  # (JSON allows the spaces after it)
    try:
        os.pwrite(fd, data, 0)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return False
    if os.fstat(fd).st_size > len(data):  # (a longer holder's name before)
        os.ftruncate(fd, len(data))
    return True


def describe_holder(holder: dict[str, Any] | None) -> str:
    """What holds a pool, as the end of "pool X is ...": a mount, a tool, or readers."""
    if holder is None:
        return "mounted or read offline (OfflinePool) by another process"
    pid = f" (pid {holder['pid']})" if holder.get("pid") else ""
    if holder.get("mountpoint"):
        return f"mounted at {holder['mountpoint']}{pid}"
    return f"in use by {holder.get('tool') or 'another process'}{pid}"


def _holder_fix(holder: dict[str, Any] | None) -> str:
    if holder is not None and holder.get("mountpoint"):
        return "unmount it first (mxfs umount)"
    if holder is not None and holder.get("tool") == "mxfs mount":
        return "it is being mounted; unmount it first (mxfs umount)"
    if holder is not None and holder.get("tool"):
        return f"wait for {holder['tool']} to finish, then try again"
    return "wait for it to finish, or unmount it (mxfs umount), then try again"


def _private_lock(path: str) -> MxfsError:
    return MxfsError(f"the pool lock {path} is root's (a pool's metadata is private)",
                     "run as root, or ask through the mount point")


def read_lock_info(pool: Pool) -> dict[str, Any] | None:
    """Who holds the pool exclusively (pid, tool, mountpoint or None, socket), or None
    when nobody does (or only offline readers do)."""
    path = os.path.join(pool.meta_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise _private_lock(path) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.pread(fd, LOCK_BYTES, 0)
            try:
                info = json.loads(raw)
            except ValueError:  # taken a moment ago, not yet named
                info = None
            if not isinstance(info, dict):
                return {"pid": None, "tool": None, "mountpoint": None, "socket": None}
            return info
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def refuse_in_use(members: list[str]) -> None:
    """Refuse to wipe members of a pool that is mounted or held by a tool (mkfs --force):
    the running daemon would go on serving, and answering for, a pool that is gone."""
    for member in members:
        try:
            pool = Pool.open(member, degraded=True)
        except (MxfsError, OSError):
            continue  # no pool here, or one too broken to mount
        holder = read_lock_info(pool)
        if holder is not None:
            raise MxfsError(f"member {member} belongs to pool {pool.uuid}, which is "
                            f"{describe_holder(holder)}", _holder_fix(holder))

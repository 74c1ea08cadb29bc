"""Write descriptors the daemon handed out, and where their right to write ends.

A direct writer (`create`, `kv_create`) gets O_WRONLY descriptors of its hidden
file's chunk files, and the daemon cannot take them back.  So a file changes state
only once nobody can write it any more:

- a commit is refused (EBUSY) while any descriptor for writing one of its chunk
  files is open anywhere: the kernel refuses a read lease on a file open for
  writing, whoever holds it (a child that inherited it, a copy in flight in a
  socket), so a sealed file can never be rewritten in place behind its checksums;
- a file dropped (abort, a refused commit, its connection gone) while writers
  remain has its chunk files moved aside into `chunks/held/` on their member,
  where `Held.sweep` cuts them to nothing every second and removes them once the
  last writer is gone: the writer keeps no space, nothing is hidden from `du` or
  fsck, and the inode number can be reused without a stray writer reaching the
  new file.  Held files are made immutable in between (where the member's file
  system keeps the flag): that refuses `fallocate` through the kept descriptors on
  ext4 and XFS (a writer reserved a member's free space within each second between
  cuts) and, on ext4, their writes too.
"""

from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterable

from mxfs.pool.pool import CHUNK_DIR, Pool

log = logging.getLogger("mxfs.pool")

HELD_DIR = "held"
_unsupported_warned = False
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def set_immutable(path: str, on: bool) -> bool:
    """Blocking: set or clear the file's immutable flag; False where its file system
    keeps none (or the file is gone): there held files are cut every second alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        want = flags[0] | _FS_IMMUTABLE_FL if on else flags[0] & ~_FS_IMMUTABLE_FL
        if want != flags[0]:
            flags[0] = want
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def writers_remain(paths: Iterable[str]) -> bool:
    """Blocking: whether any of `paths` is open for writing by anyone (this process
    included: the caller holds none).  Missing files have no writers.  A filesystem
    without leases cannot tell: it answers False, with one warning."""
    global _unsupported_warned
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except BlockingIOError:
            return True
        except OSError as e:
            if not _unsupported_warned:
                _unsupported_warned = True
                log.warning("the filesystem of %s takes no leases (%s): descriptors kept by "
                            "direct writers past their commit cannot be detected",
                            path, os.strerror(e.errno or errno.EINVAL))
        finally:
            os.close(fd)
    return False


class Held:
    """Chunk files of dropped files whose writers still hold descriptors (held and
    swept from worker threads)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.files: list[str] = []
        self._lock = threading.Lock()

    def _folder(self, member: int) -> str:
        return os.path.join(self.pool.members[member].path, CHUNK_DIR, HELD_DIR)

    def hold(self, ino: int) -> int:
        """Blocking: move `ino`'s chunk files aside (cut to nothing); how many moved."""
        moved = 0
        stamp = time.time_ns()
        for m in self.pool.local_members():  # (other nodes' are theirs to hold)
            src = self.pool.chunk_path(m, ino)
            dst = os.path.join(self._folder(m), f"{ino}.{stamp}")
            try:
                os.truncate(src, 0)
                os.makedirs(self._folder(m), mode=0o700, exist_ok=True)
                os.rename(src, dst)
            except FileNotFoundError:
                continue
            set_immutable(dst, True)
            with self._lock:
                self.files.append(dst)
            moved += 1
        return moved

    def adopt(self) -> None:
        """Blocking, at mount: take over what an earlier daemon held (its writers may
        outlive it), then sweep."""
        for m in self.pool.local_members():
            try:
                names = os.listdir(self._folder(m))
            except FileNotFoundError:
                continue
            self.files += [os.path.join(self._folder(m), n) for n in names
                           if os.path.join(self._folder(m), n) not in self.files]
        self.sweep()

    def sweep(self) -> int:
        """Blocking: cut every held file to nothing again, and remove those nobody
        writes any more; how many are still held."""
        with self._lock:
            swept = list(self.files)
        kept = []
        for path in swept:
            try:
                set_immutable(path, False)  # (an immutable file is neither cut nor removed)
                if writers_remain([path]):
                    os.truncate(path, 0)
                    set_immutable(path, True)
                    kept.append(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:  # a member gone: kept, tried again next time
                log.warning("held chunk file %s: %s", path, e.strerror)
                kept.append(path)
        with self._lock:  # (with those held meanwhile)
            self.files = kept + self.files[len(swept):]
            return len(self.files)

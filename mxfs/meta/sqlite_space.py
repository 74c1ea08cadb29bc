"""Space for the SQLite store on a metadata member that writers may fill.

A full metadata member must never stop the store, so unlinks, rmdir and KV
eviction can always give space back.  The store allocates growth room past the end
of its WAL and database (`fallocate` with KEEP_SIZE: sizes and contents untouched),
so a commit needs no new blocks; it holds a `reserve` file and gives it back before a
commit when the member has less free than the reserve (and on SQLITE_FULL, trying
once more), taking it again once writers freed space.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("mxfs.meta")

RESERVE_NAME = "reserve"
RESERVE_MIN, RESERVE_MAX = 4 << 20, 32 << 20
# Blocks allocated ahead (past the end, the size unchanged) for the WAL and the database
# to grow into, so that a commit needs no new space even while a writer fills the member.
GROWTH_ROOM = 4 << 20  # about what the WAL holds between two checkpoints (1000 pages)
_FALLOC_FL_KEEP_SIZE = 1
# (the process's own libc, loaded once: `ctypes.util.find_library` runs ldconfig in a
# subprocess, 1.5-5 ms of the daemon's one thread each time the WAL grew 2 MiB)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _fallocate_keep_size(fd: int, offset: int, length: int) -> None:
    """fallocate(2) with FALLOC_FL_KEEP_SIZE: blocks past the end, contents untouched
    (posix_fallocate may emulate by writing, which a live WAL must never see)."""
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class Reserve:
    """The reserve file and growth room of the store at `db_path`."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self.folder = os.path.dirname(db_path)
        self.path = os.path.join(self.folder, RESERVE_NAME)
        self.low = False  # the member is nearly full

    def short(self) -> bool:
        """Is the metadata member nearly full (less free than the reserve holds)?"""
        try:
            st = os.statvfs(self.folder)
        except OSError:
            return False
        self.low = st.f_bavail * st.f_frsize < RESERVE_MIN
        return self.low

    def _target(self) -> int:
        st = os.statvfs(self.folder)
        return min(max(st.f_blocks * st.f_frsize // 100, RESERVE_MIN), RESERVE_MAX)

    def keep(self) -> bool:
        """Hold the reserve (again), and growth room for the WAL and the database, if
        there is room for them and more; True if the reserve is held."""
        try:
            target = self._target()
            st = os.statvfs(self.folder)
            if st.f_bavail * st.f_frsize < 3 * target:
                return False  # not while writers are short of space themselves
            self._grow_room()
            try:
                if os.stat(self.path).st_blocks * 512 >= target:
                    return True
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, target)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            log.debug("metadata reserve not held: %s", e)
            try:
                os.truncate(self.path, 0)
            except OSError:
                pass
            return False

    def _grow_room(self) -> None:
        """Allocate GROWTH_ROOM past the end of the WAL and the database (sizes kept)."""
        for path in (self.db_path + "-wal", self.db_path):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                end = os.fstat(fd).st_size
                if os.fstat(fd).st_blocks * 512 < end + GROWTH_ROOM // 2:
                    _fallocate_keep_size(fd, end, GROWTH_ROOM)
            except OSError as e:
                log.debug("no growth room for %s: %s", path, e)
            finally:
                os.close(fd)

    def release(self) -> bool:
        """Give the reserve's space to the store now; True if there was some to give."""
        try:
            held = os.stat(self.path).st_blocks
            os.truncate(self.path, 0)
        except OSError:
            return False
        if held:
            log.warning("metadata member %s is full: released the metadata reserve so "
                        "changes can still be committed; free space on it", self.folder)
        return held > 0

    def watch(self) -> bool:
        """Give the reserve up before the member is full, and take it again once writers
        freed space; True while the member is short."""
        if self.short():
            self.release()
        else:
            self.keep()
        return self.low


def make_room(db_path: str) -> bool:
    """After the store at `db_path` could not be opened or read: where its member is
    nearly full, give its reserve back (opening takes a few pages: its -shm, its -wal)
    and say so (True: try again); False where the member has room, and the failure is
    the store's.  Only then: a tool that gave the reserve back at every open (fsck of an
    unmounted pool) left it to whatever filled the member, and the next mount none."""
    room = Reserve(db_path)
    if not room.short():
        return False
    room.release()
    return True

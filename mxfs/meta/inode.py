"""What the store hands out: inodes (as the daemon caches them) and directory entries."""

from __future__ import annotations

import stat
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT_INO = 1
DIR_SIZE = 4096

# (ino, directory's default unit, directory's default width) -> (unit, width, first member)
LayoutPicker = Callable[[int, "int | None", "int | None"], tuple[int, int, int]]


@dataclass(slots=True)
class Inode:
    """One inode row.  The daemon shares these objects with open handles; only the
    store changes them (typed setters), so memory and rows cannot drift apart."""

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    target: bytes | None = None
    stripe_unit: int | None = None
    stripe_width: int | None = None
    first_member: int | None = None
    generation: int = 0
    dirty: bool = field(default=False, compare=False)  # size or times not yet written

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def apparent_size(self) -> int:
        """st_size as users see it: a directory reports a block, as on ext4."""
        return DIR_SIZE if self.is_dir else self.size

    def takes_read(self, mode: int | None, uid: int | None, gid: int | None) -> bool:
        """Whether setting these attributes (None: unchanged) may take away someone's
        right to read this file: a new owner or group, or a read bit cleared.  Only
        then does the file get a new generation (scoped readers of other nodes lose it:
        `MetaStore.set_attrs`) and a lent file's chunk files renewed (`Volume.renew`):
        a change that takes nothing away (a chmod to the same mode, or one that adds
        bits) leaves the descriptors handed out reading on, and costs no copy."""
        return uid is not None and uid != self.uid or gid is not None and gid != self.gid \
            or mode is not None and bool(self.mode & ~mode & 0o444)


@dataclass(frozen=True, slots=True)
class Entry:
    cookie: int
    name: bytes
    inode: Inode

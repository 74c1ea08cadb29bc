"""Whose are a chunk file's blocks past its end: a writer's reservation, or the file
system's own speculative preallocation.

A direct writer that reserves a member's space with fallocate(KEEP_SIZE) and keeps its
descriptors is caught by the blocks its chunk file holds past its declared length
(`pool.overallocated`).  XFS reserves such blocks itself for any buffered writer that
extends a file (speculative preallocation: 208 MiB past the end of a 300 MiB file
written in 1 MiB pieces), trimmed only at its last close; after writeback they are
unwritten extents, as a fallocate's are.  The inode tells them apart: XFS flags it
PREALLOC only when someone called fallocate on it.  Other file systems preallocate
nothing past the end that their block count shows, so there the blocks are the
writer's.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct

XFS_SUPER_MAGIC = 0x58465342
FS_IOC_FSGETXATTR = 0x801C581F  # _IOR('X', 31, struct fsxattr)
FS_XFLAG_PREALLOC = 0x2  # the inode has blocks fallocate reserved
_FSXATTR = struct.Struct("IIIII8x")  # xflags, extsize, nextents, projid, cowextsize

_libc = ctypes.CDLL(None, use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]


def fs_type(path: str) -> int | None:
    """The file system magic of `path` (statfs's f_type), or None if it cannot be read."""
    buf = ctypes.create_string_buffer(256)  # (struct statfs is 120 bytes on 64-bit)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def reserved_by_writer(path: str) -> bool:
    """Blocking: whether the blocks chunk file `path` holds past its end may be a
    writer's fallocate: True unless it is on XFS and its inode was never fallocated
    (then they are XFS's own speculative preallocation: an honest buffered writer's
    file, held and its writer penalised, would otherwise be lost)."""
    if fs_type(path) != XFS_SUPER_MAGIC:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return True
    try:
        xflags = _FSXATTR.unpack(fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(_FSXATTR.size)))[0]
    except OSError:
        return True
    finally:
        os.close(fd)
    return bool(xflags & FS_XFLAG_PREALLOC)

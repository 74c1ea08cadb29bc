"""Timed, verified sequential I/O shared by `mxfs demo` and the benchmarks in tools/.

Buffers are allocated and touched once by the caller and reused, so a run
measures I/O rather than first-touch page faults.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

import xxhash

from mxfs.errors import MxfsError
from mxfs.vol.mounts import ensure_runtime_dir

# Dropping the page cache is machine-wide: a process that needs it to stay put for a
# moment (a test checking what a read left cached, beside others dropping it) holds
# this lock exclusively; every drop here takes it shared.  Root's own folder: a lock
# file anyone could make (/run/lock) would let any user hold drops off for ever.
CACHE_LOCK_DIR = "/run/mxfs"
CACHE_LOCK = f"{CACHE_LOCK_DIR}/page-cache.lock"


def page_cache_lock() -> int:
    """A descriptor of the page-cache lock (root only), to flock shared or exclusive."""
    ensure_runtime_dir(CACHE_LOCK_DIR)
    return os.open(CACHE_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def drop_caches() -> bool:
    """Empty the kernel's page cache (root only); False when it could not."""
    if os.geteuid() != 0:
        return False
    try:
        lock = page_cache_lock()
    except (OSError, MxfsError):
        lock = -1  # no lock to take: drop anyway
    try:
        if lock >= 0:
            fcntl.flock(lock, fcntl.LOCK_SH)
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            return False
        return True
    finally:
        if lock >= 0:
            os.close(lock)


def write_file(path: str, size: int, block: memoryview, fsync: bool = True) -> tuple[float, str]:
    """Write `size` bytes cycling through `block` to a new file (one already there is
    removed first, untimed; never written through: it may be a link); returns
    (seconds, xxh3 of the bytes)."""
    h = xxhash.xxh3_64()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        left = size
        while left:
            piece = block[: min(left, len(block))]
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])
            h.update(piece)
            left -= len(piece)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start, h.hexdigest()


def read_file(path: str, buf: bytearray) -> tuple[float, str, int]:
    """Read a whole file into a reused buffer; returns (seconds, xxh3, bytes)."""
    start = time.perf_counter()
    secs, digest, total = read_fd(os.open(path, os.O_RDONLY), buf)
    return time.perf_counter() - start, digest, total


def read_fd(fd: int, buf: bytearray) -> tuple[float, str, int]:
    """`read_file` of a file opened, closed after."""
    h = xxhash.xxh3_64()
    view = memoryview(buf)
    total = 0
    start = time.perf_counter()
    try:
        while n := os.readv(fd, [view]):
            h.update(view[:n])
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - start, h.hexdigest(), total

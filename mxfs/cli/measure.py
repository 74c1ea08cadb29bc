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

# Dropping the page cache is machine-wide: a process that needs it to stay put for a
# moment (a test checking what a read left cached, beside others dropping it) holds
# this lock exclusively; every drop here takes it shared.
CACHE_LOCK = "/run/lock/mxfs-page-cache"


def drop_caches() -> bool:
    """Empty the kernel's page cache (root only); False when it could not."""
    if os.geteuid() != 0:
        return False
    with contextlib.ExitStack() as held:
        with contextlib.suppress(OSError):
            lock = held.enter_context(open(CACHE_LOCK, "a"))
            fcntl.flock(lock, fcntl.LOCK_SH)
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            return False
    return True


def write_file(path: str, size: int, block: memoryview, fsync: bool = True) -> tuple[float, str]:
    """Write `size` bytes cycling through `block`; returns (seconds, xxh3 of the bytes)."""
    h = xxhash.xxh3_64()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
    h = xxhash.xxh3_64()
    view = memoryview(buf)
    total = 0
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [view]):
            h.update(view[:n])
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - start, h.hexdigest(), total

"""Which pages of a file range sit in the page cache (mincore over a mapping).

Direct readers use it to pick, piece by piece, between a buffered read (the bytes
are cached: a memory copy) and an O_DIRECT one (they are not: the device DMAs
straight into the caller's buffer, without filling the cache on the way).
"""

from __future__ import annotations

import ctypes
import mmap

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_BIT0 = bytes(i & 1 for i in range(256))


class Residency:
    """The cached pages of [start, stop) of a file, looked up by byte range."""

    def __init__(self, fd: int, start: int, stop: int) -> None:
        self.first = start // PAGE
        n = max(0, (stop + PAGE - 1) // PAGE - self.first)
        self.pages = bytes(n)  # all "not cached" if the probe cannot run
        if n == 0:
            return
        length = n * PAGE
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd,
                          self.first * PAGE)
        if addr in (None, _MAP_FAILED):
            return
        try:
            vec = ctypes.create_string_buffer(n)
            if _libc.mincore(ctypes.c_void_p(addr), length, vec) == 0:
                self.pages = vec.raw
        finally:
            _libc.munmap(ctypes.c_void_p(addr), length)

    def cached_fraction(self, offset: int, length: int) -> float:
        """The share of [offset, offset + length)'s pages in the page cache (0..1)."""
        lo = offset // PAGE - self.first
        hi = (offset + length + PAGE - 1) // PAGE - self.first
        pages = self.pages[max(lo, 0):max(hi, 0)]
        if not pages:
            return 0.0
        # mincore defines only bit 0 of each byte; clear the others before counting.
        cached = len(pages) - pages.translate(_BIT0).count(0)
        return cached / len(pages)

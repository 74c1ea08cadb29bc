"""Read-ahead of another node's stripes for one open file, as an NFS client reads ahead.

Through the mount, the kernel asks for a file in requests of 128 KiB, a dozen at a time;
each one sent on to the owner node is a round trip for a sliver of one stripe unit,
and a reading node got 0.45 of the link's ceiling that way.  A file read in order is
fetched instead in windows of whole stripe rows (every member's share of a window in
one request, all members at once), the next window while the current one is served,
and the kernel's requests are answered from them.  Reads that do not follow on from
the last ones (a mapping touched here and there) go straight to the members.

Windows belong to one `ChunkFiles` (one open inode) and go with it at the last close,
so what a reading node's next open sees is fetched afresh (close-to-open).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

WINDOW = 16 << 20  # bytes fetched at once, at least (rounded up to whole stripe rows)
MAX_WINDOW = 64 << 20  # ... and at most
AHEAD = 4  # windows fetched ahead of the one being read (a round trip each: latency
           # bound, a reading node got 0.95, 1.29 and 1.39 GB/s with 1, 2 and 4 ahead)
BUDGET = 512 << 20  # bytes of windows held in all: past it, nothing more is read ahead
_fetchers: ThreadPoolExecutor | None = None  # (not the I/O pool: a fetch waits on it)
_fetchers_lock = threading.Lock()
_held = 0  # bytes of windows held by every ReadAhead (under _fetchers_lock)


def _hold(n: int, force: bool = False) -> bool:
    """Count `n` more bytes of windows if the budget allows (always, for n <= 0, or
    with `force`: a read is waiting on them)."""
    global _held
    with _fetchers_lock:
        if n > 0 and _held + n > BUDGET and not force:
            return False
        _held += n
        return True


def fetchers() -> ThreadPoolExecutor:
    global _fetchers
    with _fetchers_lock:
        if _fetchers is None:
            _fetchers = ThreadPoolExecutor(8, thread_name_prefix="mxfs-ahead")
        return _fetchers


def window_size(row: int) -> int:
    """Whole stripe rows (`row`: unit x width bytes), WINDOW at least."""
    rows = max(1, -(-WINDOW // row))
    return max(row, min(rows * row, MAX_WINDOW // row * row))


class ReadAhead:
    """Windows of one file's bytes, fetched by `fetch(offset, buf)` (blocking)."""

    def __init__(self, row: int, fetch: Callable[[int, memoryview], None]) -> None:
        self.size = window_size(row)
        self.fetch = fetch
        self._windows: dict[int, Future[bytearray]] = {}
        self._lock = threading.Lock()
        self._end = -1  # where the last read ended: reads near it are in order

    def read(self, offset: int, buf: memoryview) -> bool:
        """Fill `buf` from windows if this read follows on from the last ones (and
        fetch the next window ahead); False, touching nothing, if it does not."""
        with self._lock:
            if self._end < 0 or abs(offset - self._end) > self.size:
                self._end = offset + len(buf)
                return False
            self._end = max(self._end, offset + len(buf))
            first, last = offset // self.size, (offset + len(buf) - 1) // self.size
            # (the one behind stays: reads in flight come a little out of order)
            for w in [w for w in self._windows if not first - 1 <= w <= last + AHEAD]:
                self._drop(w)
            wanted = {w: self._start(w, ahead=w > last)
                      for w in range(first, last + 1 + AHEAD)}
        at = 0
        for w in range(first, last + 1):
            fut = wanted[w]
            assert fut is not None  # (not ahead: always started)
            data = fut.result()  # (an error fetching it is this read's error)
            lo = max(offset + at, w * self.size) - w * self.size
            n = min(len(buf) - at, self.size - lo)
            buf[at:at + n] = data[lo:lo + n]
            at += n
        return True

    def _start(self, w: int, ahead: bool) -> Future[bytearray] | None:
        """Window `w`, fetched now if it is not held (or failed); None for a window
        ahead that the budget has no room for."""
        fut = self._windows.get(w)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            return fut
        if fut is not None:
            self._drop(w)
        if not _hold(self.size, force=not ahead):
            return None
        fut = self._windows[w] = fetchers().submit(self._fetch, w)
        return fut

    def _drop(self, w: int) -> None:
        del self._windows[w]
        _hold(-self.size)

    def _fetch(self, w: int) -> bytearray:
        data = bytearray(self.size)
        self.fetch(w * self.size, memoryview(data))
        return data

    def close(self) -> None:
        """Drop every window (it may be read again: windows are fetched afresh)."""
        with self._lock:
            for w in list(self._windows):
                self._drop(w)

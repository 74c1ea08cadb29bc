"""Read-ahead of another node's stripes for one open file, as an NFS client reads ahead.

Through the mount, the kernel asks for a file in requests of 128 KiB, a dozen at a time;
each one sent on to the owner node is a round trip for a sliver of one stripe unit,
and a reading node got 0.45 of the link's ceiling that way.  A file read in order is
fetched instead in windows of whole stripe rows (every member's share of a window in
one request, all members at once), the next window while the current one is served,
and the kernel's requests are answered from them.  Reads that do not follow on from
the last ones (a mapping touched here and there) go straight to the members.

Windows belong to one `ChunkFiles` (one open inode) and go with it at the last close,
so what a reading node's next open sees is fetched afresh (close-to-open).  Every
window, the one a read waits on too, counts against one BUDGET of the node's memory,
and against the share of it of the user whose read fetched it (`reader`: a tenant,
PER_USER; root only the budget): past either a read gets just what it asked for,
fetched as a stray read is (files held open with their windows once held 1,680 MiB
of a 512 MiB budget, and one user's few files, 1 GiB stripe units and windows kept
open, held all of it: everyone else's reads of far files went unwindowed).  A window is
MAX_WINDOW at most, whatever the stripe row (a 1 GiB unit is no 4 GiB fetch per
128 KiB read), and the fetcher threads take fetches in turn by file, not first come
first served: one file's windows ahead do not queue another's read.  A window dropped
(a write, a cut, the last close) before its fetch began is never fetched, and one
whose fetch runs stays counted until the fetch ends: read, then write or close, in a
loop, once fetched windows nobody read and held their buffers outside the budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

WINDOW = 16 << 20  # bytes fetched at once, at least (rounded up to whole stripe rows)
MAX_WINDOW = 64 << 20  # ... and at most
AHEAD = 4  # windows fetched ahead of the one being read (a round trip each: latency
           # bound, a reading node got 0.95, 1.29 and 1.39 GB/s with 1, 2 and 4 ahead)
BUDGET = 512 << 20  # bytes of windows held in all: past it, reads are not windowed
PER_USER = BUDGET // 4  # ... and by the windows one user's reads fetched
_fetchers: ThreadPoolExecutor | None = None  # (not the I/O pool: a fetch waits on it)
_fetchers_lock = threading.Lock()
_held = 0  # bytes of windows held by every ReadAhead (under _fetchers_lock)
_held_by: dict[int, int] = {}  # ... by the tenant whose read fetched them
_queued: OrderedDict[object, deque[Callable[[], None]]] = OrderedDict()
# fetches waiting for a fetcher thread, by whose they are, in turn (under _fetchers_lock)


def _hold(n: int, tenant: int) -> bool:
    """Count `n` more bytes of windows fetched for `tenant` if the budget and its
    share allow (always, for n <= 0)."""
    global _held
    with _fetchers_lock:
        mine = _held_by.get(tenant, 0)
        if n > 0 and (_held + n > BUDGET or tenant != 0 and mine + n > PER_USER):
            return False
        _held += n
        if mine + n:
            _held_by[tenant] = mine + n
        else:
            _held_by.pop(tenant, None)
        return True


def fetchers() -> ThreadPoolExecutor:
    global _fetchers
    with _fetchers_lock:
        if _fetchers is None:
            _fetchers = ThreadPoolExecutor(8, thread_name_prefix="mxfs-ahead")
        return _fetchers


def _submit(who: object, fn: Callable[[], bytearray], first: bool) -> Future[bytearray]:
    """`fn()` on a fetcher thread, in `who`'s turn (`first`: before `who`'s others, a
    read waits on it).  Each call queues one `_next`, which runs whoever's turn it is:
    a file with four windows queued ahead holds up another's read by one fetch."""
    fut: Future[bytearray] = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:  # (as a ThreadPoolExecutor's own work item)
                fut.set_exception(e)

    with _fetchers_lock:
        calls = _queued.setdefault(who, deque())
        if first:
            calls.appendleft(run)
        else:
            calls.append(run)
    fetchers().submit(_next)
    return fut


def _next() -> None:
    """The first queued fetch of the one whose turn it is, who then goes to the back."""
    with _fetchers_lock:
        who, calls = _queued.popitem(last=False)  # (never empty: a `_next` per fetch)
        run = calls.popleft()
        if calls:
            _queued[who] = calls
    run()


def window_size(row: int) -> int:
    """Whole stripe rows (`row`: unit x width bytes), WINDOW at least, and MAX_WINDOW
    at most: a row over it (a 1 GiB unit) is read MAX_WINDOW at a time, not a row."""
    if row >= MAX_WINDOW:
        return MAX_WINDOW
    rows = max(1, -(-WINDOW // row))
    return min(rows * row, MAX_WINDOW // row * row)


class ReadAhead:
    """Windows of one file's bytes, fetched by `fetch(offset, buf)` (blocking)."""

    def __init__(self, row: int, fetch: Callable[[int, memoryview], None]) -> None:
        self.size = window_size(row)
        self.fetch = fetch
        self._windows: dict[int, Future[bytearray]] = {}
        # window: the tenant whose read fetched it, and the bytes it holds (to the end)
        self._held_for: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._end = -1  # where the last read ended: reads near it are in order
        self._final = False  # its file's last close came: no window is started again

    def read(self, offset: int, buf: memoryview, reader: int = 0, end: int | None = None
             ) -> bool:
        """Fill `buf` from windows if this read follows on from the last ones (and
        fetch the next windows ahead, counted as `reader`'s); False, leaving `buf` to
        the caller, if it does not or the budget has no room for the windows it
        needs.  `end`: the file's size now; no window is fetched past it (a file
        smaller than a window fetched four windows of nothing ahead, 64 MiB of the
        budget, and those fetches went on after its reader closed it)."""
        with self._lock:
            if self._final:  # (a read that began before the last close: windows it
                return False  # started now would hold the budget for good)
            if self._end < 0 or abs(offset - self._end) > self.size:
                self._end = offset + len(buf)
                return False
            self._end = max(self._end, offset + len(buf))
            first, last = offset // self.size, (offset + len(buf) - 1) // self.size
            # (the one behind stays: reads in flight come a little out of order)
            for w in [w for w in self._windows if not first - 1 <= w <= last + AHEAD]:
                self._drop(w)
            upto = offset + len(buf)
            needed = [self._start(w, reader, end, min(self.size, upto - w * self.size))
                      for w in range(first, last + 1)]
            if None in needed:
                return False
            for w in range(last + 1, last + 1 + AHEAD):
                self._start(w, reader, end, 0)
        at = 0
        for w, fut in enumerate(needed, first):
            assert fut is not None
            try:
                data = fut.result()  # (an error fetching it is this read's error)
            except CancelledError:  # dropped meanwhile (a write, the feed): read it
                return False        # straight, as those after the drop are
            lo = max(offset + at, w * self.size) - w * self.size
            n = min(len(buf) - at, self.size - lo)
            if lo + n > len(data):  # (fetched to an end the caller's read is past)
                return False
            buf[at:at + n] = data[lo:lo + n]
            at += n
        return True

    def _start(self, w: int, reader: int, end: int | None, need: int
               ) -> Future[bytearray] | None:
        """Window `w`, held (or fetched now for `reader`, up to `end` if given) with
        the first `need` bytes a read waits on (0: a window ahead, none yet); None
        if it is past `end`, or the budget or the reader's share has no room."""
        length = self.size if end is None else min(self.size, end - w * self.size)
        if length <= 0:
            return None
        fut = self._windows.get(w)
        if fut is not None and not (fut.done() and fut.exception() is not None) \
                and self._held_for[w][1] >= need:  # (one to an older end serves the
            return fut                              # bytes it holds)
        if fut is not None:  # (failed, or fetched to an end the file has grown past)
            self._drop(w)
        if not _hold(length, reader):
            return None
        self._held_for[w] = (reader, length)
        fut = self._windows[w] = _submit(self, lambda: self._fetch(w, length),
                                         first=need > 0)
        return fut

    def _drop(self, w: int) -> None:
        """Forget window `w`: its fetch is cancelled if it has not begun, and its bytes
        go back to the budget once no fetch holds them (a fetch running goes on, and
        its buffer is memory held until it ends)."""
        fut, (payer, length) = self._windows.pop(w), self._held_for.pop(w)
        fut.cancel()
        fut.add_done_callback(lambda _: _hold(-length, payer))  # (now, if it is done)

    def _fetch(self, w: int, length: int) -> bytearray:
        data = bytearray(length)
        self.fetch(w * self.size, memoryview(data))
        return data

    def close(self, final: bool = False) -> None:
        """Drop every window (it may be read again: windows are fetched afresh);
        `final`: the file's last close, after which none is started."""
        with self._lock:
            self._final = self._final or final
            for w in list(self._windows):
                self._drop(w)

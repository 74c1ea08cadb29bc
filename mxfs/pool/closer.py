"""Descriptors of members' files, closed off the caller's thread, each mount's apart.

close(2) can wait on a file's filesystem: a FUSE member sends FLUSH and waits for its
daemon, an NFS member writes dirty pages back.  Closed on the daemon's loop (a file's
last release, a reply's descriptors once sent), a member that stopped answering held
every user's requests until it came back; closed in a worker thread under a file's
lock, it held that file's I/O.  Here a sorting thread reads which mount and inode each
descriptor is of (`/proc/self/fdinfo`, which asks no filesystem) and hands it to that
mount's closing threads (PER_MOUNT: one slow close, a tenant's gigabytes written back,
does not hold every later one there): a hung member's descriptors wait for it (no new
ones are opened there meanwhile: opens wait on it too), and every other mount's are
closed at once.  A thread looks at its queue every POLL_S (no wake-up a descriptor)
and ends after LINGER_S idle: an idle pool holds none.

Descriptors are the process's, so is this: one closer for every pool it opens.  The
daemon's own descriptors still closing are not anyone's: a lease probe that finds a
file open waits for those of its file (`wait_closed`) before it says so
(`pool/revoke.py`), else a commit just after the reply that sent a writer its
descriptors was refused, and a file just released held aside as if still open.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

LINGER_S = 2.0  # an idle thread waits this long for more descriptors, then ends
POLL_S = 0.005  # ... looking at its queue this often
PER_MOUNT = 4  # threads closing one mount's descriptors at once
SORT_BITE = 64  # descriptors sorted at a time (`wait_closed` sees them move)
WAITS_MOST = 12  # `wait_closed` gives up after this many timeouts, moving or not (the
# file's own close hung while others of its mount went on)
SORTING = -2  # (the sorting thread's queue, among the mounts')
UNKNOWN = -1  # a mount or inode fdinfo did not tell

File = tuple[int, int]  # (mount id, inode number): what a descriptor is of


def fdinfo(fd: int) -> File:
    """The mount id and inode number of `fd`'s file (UNKNOWN where not told)."""
    mount = ino = UNKNOWN
    for _ in range(2):  # (once more: a moment out of descriptors)
        try:
            info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            text = os.read(info, 4096)
        finally:
            os.close(info)
        for line in text.splitlines():
            try:
                if line.startswith(b"mnt_id:"):
                    mount = int(line.split()[1])
                elif line.startswith(b"ino:"):
                    ino = int(line.split()[1])
            except (ValueError, IndexError):
                pass
        break
    return mount, ino


class Closer:
    def __init__(self, close: Callable[[int], None] = os.close) -> None:
        self._close_fd = close  # (a test's may wait, as a hung member's close does)
        self._lock = threading.Lock()
        self._closed = threading.Condition(self._lock)  # `wait_closed` and `drain`
        self._waiting = 0  # ... how many wait on it
        self._queued: dict[int, deque[tuple[int, File]]] = {}  # (fd, file) by mount
        self._sorting: deque[tuple[int, int]] = deque()  # (fd, ticket)
        self._serving: Counter[int] = Counter()  # threads running, by queue
        self._busy: Counter[int] = Counter()  # ... of them, closing one now
        self._tickets = itertools.count(1)
        self._handed = 0  # the last ticket handed over
        self._sorted = 0  # ... the last one sorted
        self._files: Counter[File] = Counter()  # sorted and not closed yet
        self._pending = 0  # handed over and not closed yet
        self.closes = 0  # closed since the process began (`wait_closed`'s `since`)
        self._closes_of: Counter[int] = Counter()  # ... by mount

    def close(self, fds: Iterable[int]) -> None:
        """Close `fds` soon (any thread, the loop's too: never waits).  The caller gives
        them up now: it must not use them again."""
        with self._lock:
            before = len(self._sorting)
            self._sorting.extend((fd, next(self._tickets)) for fd in fds)
            added = len(self._sorting) - before
            if not added:
                return
            self._pending += added
            self._handed = self._sorting[-1][1]
            start = self._starts(SORTING)
        self._start(SORTING, start)

    @property
    def pending(self) -> int:
        """Descriptors handed over and not closed yet (those of a hung member wait):
        still the process's, counted against its limit (`fs/descriptors.py`)."""
        return self._pending

    def wait_closed(self, file: File, timeout: float, since: int) -> bool:
        """Blocking: wait for the descriptors handed over by now that may be of `file`
        (an inode of a mount, as `fdinfo` reads them) to be closed, for as long as
        they move: given up once `timeout` passes with none of its mount closed and
        none of them sorted (its member stopped answering), or after WAITS_MOST
        timeouts.  A time alone was not enough: on a loaded machine a commit just
        after the reply that sent its descriptors found the daemon's copies still
        queued 5 s later, and was refused.  Whether some may
        have been closed, all now, or any descriptor was closed after `since`
        (`closes`, read before the look that found the file open): a look worth taking
        again."""
        with self._lock:
            handed = self._handed

            def done() -> bool:
                return self._sorted >= handed and not self._may_hold(file)
            if done():
                return self.closes > since
            end = time.monotonic() + WAITS_MOST * timeout
            while True:
                moved = self._moved(file, handed)
                if self._wait(done, timeout):
                    return True
                if self._moved(file, handed) == moved or time.monotonic() >= end:
                    return False

    def _moved(self, file: File, handed: int) -> tuple[int, int]:
        """(Under the lock.)  How far the descriptors handed over by ticket `handed`
        that may be of `file` have got: tickets sorted (of those: later ones, handed
        all the time, moved while a hung member's close stood still), and closes of its
        mount (of any, where it is not told)."""
        mount = file[0]
        return (min(self._sorted, handed),
                self.closes if mount == UNKNOWN else self._closes_of[mount])

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` for every descriptor handed over to be closed (before a
        process that opened the pool lets go of its members); whether they were."""
        with self._lock:
            return self._wait(lambda: not self._pending, timeout)

    def _may_hold(self, file: File) -> bool:
        """(Under the lock.)  Whether a descriptor not closed yet may be of `file`."""
        mount, ino = file
        if mount == UNKNOWN or ino == UNKNOWN:  # (not told: any may be)
            return bool(self._files)
        return bool(self._files[file] or self._files[UNKNOWN, ino] or
                    self._files[mount, UNKNOWN] or self._files[UNKNOWN, UNKNOWN])

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """(Under the lock.)"""
        self._waiting += 1
        try:
            return self._closed.wait_for(done, timeout)
        finally:
            self._waiting -= 1

    def _starts(self, key: int) -> int:
        """(Under the lock, `key`'s queue grown.)  How many threads to start for it (one
        running looks at its queue every POLL_S)."""
        if key == SORTING:
            want = 0 if self._serving[key] else 1
        else:  # (as many as it has waiting past its idle threads, PER_MOUNT at most)
            idle = self._serving[key] - self._busy[key]
            want = min(PER_MOUNT - self._serving[key], len(self._queued[key]) - idle)
        if want <= 0:
            return 0
        self._serving[key] += want
        return want

    def _start(self, key: int, n: int) -> None:
        for _ in range(n):
            try:
                threading.Thread(target=self._serve, args=(key,), daemon=True,
                                 name=f"mxfs-close-{key}").start()
            except RuntimeError as e:  # (no thread to be had: the next hand-over tries)
                with self._lock:
                    self._serving[key] -= 1
                log.warning("no thread to close descriptors with (%s): they wait", e)

    def _serve(self, key: int) -> None:
        with self._lock:  # (counted in `_serving`: the queue stays while it runs)
            queue = self._sorting if key == SORTING else self._queued[key]
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if key == SORTING:  # (a bite at a time: each one sorted is progress)
                    batch = [queue.popleft() for _ in range(min(SORT_BITE, len(queue)))]
                elif queue:  # (one at a time: a slow one holds no other)
                    batch = [queue.popleft()]
                    self._busy[key] += 1
                else:
                    batch = []
                if not batch and time.monotonic() - idle_since > LINGER_S:
                    self._serving[key] -= 1
                    if not self._serving[key]:
                        del self._serving[key]
                        if key != SORTING and not queue:
                            del self._queued[key]
                    return
            if not batch:
                time.sleep(POLL_S)
                continue
            if key == SORTING:
                self._sort(batch)  # type: ignore[arg-type]
            else:
                self._close(key, *batch[0])
            idle_since = time.monotonic()

    def _sort(self, batch: list[tuple[int, int]]) -> None:
        sorted_ = [(fd, fdinfo(fd)) for fd, _ in batch]
        starts: dict[int, int] = {}
        with self._lock:
            for fd, file in sorted_:
                self._queued.setdefault(file[0], deque()).append((fd, file))
                self._files[file] += 1
            for mount in {file[0] for _, file in sorted_}:
                starts[mount] = self._starts(mount)
            self._sorted = batch[-1][1]
            if self._waiting:
                self._closed.notify_all()
        for mount, n in starts.items():
            self._start(mount, n)

    def _close(self, mount: int, fd: int, file: File) -> None:
        try:
            self._close_fd(fd)
        except OSError as e:  # (a write-back failure: the writes' fsync reports it)
            log.debug("mount %d: closing a descriptor: %s", mount, e)
        with self._lock:
            self._busy[mount] -= 1
            if not self._busy[mount]:
                del self._busy[mount]
            self._pending -= 1
            self.closes += 1
            self._closes_of[mount] += 1
            self._files[file] -= 1
            if not self._files[file]:
                del self._files[file]
            if self._waiting:
                self._closed.notify_all()


CLOSER = Closer()  # (the process's)
close_later = CLOSER.close

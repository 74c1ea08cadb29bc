"""Descriptors of members' files, closed off the caller's thread, each mount's in turn.

close(2) can wait on a file's filesystem: a FUSE member sends FLUSH and waits for its
daemon, an NFS member writes dirty pages back.  Closed on the daemon's loop (a file's
last release, a reply's descriptors once sent), a member that stopped answering held
every user's requests until it came back; closed in a worker thread under a file's
lock, it held that file's I/O.  Here a sorting thread reads which mount and inode each
descriptor is of (`/proc/self/fdinfo`, which asks no filesystem) and hands it to that
mount's closing thread: a hung member's descriptors wait for it (no new ones are
opened there meanwhile: opens wait on it too), and every other mount's are closed at
once.  A thread lingers a moment for more, then ends: an idle pool holds none.

Descriptors are the process's, so is this: one closer for every pool it opens.  The
daemon's own descriptors still closing are not anyone's: a lease probe that finds a
file open waits for those of its inode (`wait_closed`) before it says so
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
SORTING = -2  # (the sorting thread's queue, among the mounts')
UNKNOWN = -1  # a mount or inode fdinfo did not tell


def _fdinfo(fd: int) -> tuple[int, int]:
    """The mount id and inode number of `fd`'s file (UNKNOWN where not told)."""
    mount = ino = UNKNOWN
    try:
        info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(info, 4096)
        finally:
            os.close(info)
        for line in text.splitlines():
            if line.startswith(b"mnt_id:"):
                mount = int(line.split()[1])
            elif line.startswith(b"ino:"):
                ino = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return mount, ino


class Closer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Condition(self._lock)  # `wait_closed` and `drain`
        self._waiting = 0  # ... how many wait on it
        self._queued: dict[int, deque[tuple[int, int]]] = {}  # (fd, inode) by mount id
        self._sorting: deque[tuple[int, int]] = deque()  # (fd, ticket)
        self._serving: set[int] = set()  # queues whose thread runs (SORTING among them)
        self._tickets = itertools.count(1)
        self._handed = 0  # the last ticket handed over
        self._sorted = 0  # ... the last one sorted
        self._inos: Counter[int] = Counter()  # sorted and not closed yet, by inode
        self._pending = 0  # handed over and not closed yet

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
            start = self._woken(SORTING)
        if start:
            self._thread(SORTING)

    @property
    def pending(self) -> int:
        """Descriptors handed over and not closed yet (those of a hung member wait)."""
        return self._pending

    def wait_closed(self, ino: int, timeout: float) -> bool:
        """Blocking: wait up to `timeout` for those descriptors handed over by now that
        may be of inode `ino` (of any mount) to be closed; whether there may have been
        some, all closed now (a look worth taking again)."""
        with self._lock:
            handed = self._handed

            def done() -> bool:
                return self._sorted >= handed and not (self._inos[ino] or
                                                       self._inos[UNKNOWN])
            if done():
                return False
            return self._wait(done, timeout)

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` for every descriptor handed over to be closed (before a
        process that opened the pool lets go of its members); whether they were."""
        with self._lock:
            return self._wait(lambda: not self._pending, timeout)

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """(Under the lock.)"""
        self._waiting += 1
        try:
            return self._closed.wait_for(done, timeout)
        finally:
            self._waiting -= 1

    def _woken(self, key: int) -> bool:
        """(Under the lock, `key`'s queue grown.)  Whether its thread must be started
        (one running looks at its queue every POLL_S: no wake-up for each descriptor,
        which cost a file's open and close through the mount a sixth more)."""
        if key in self._serving:
            return False
        self._serving.add(key)
        return True

    def _thread(self, key: int) -> None:
        threading.Thread(target=self._serve, args=(key,), daemon=True,
                         name=f"mxfs-close-{key}").start()

    def _serve(self, key: int) -> None:
        queue = self._sorting if key == SORTING else self._queued[key]
        idle_since = time.monotonic()
        while True:
            with self._lock:
                batch = list(queue)
                queue.clear()
                if not batch and time.monotonic() - idle_since > LINGER_S:
                    self._serving.discard(key)
                    return
            if not batch:
                time.sleep(POLL_S)
                continue
            if key == SORTING:
                self._sort(batch)
            else:
                self._close(key, batch)
            idle_since = time.monotonic()

    def _sort(self, batch: list[tuple[int, int]]) -> None:
        sorted_ = [(fd, *_fdinfo(fd)) for fd, _ in batch]
        start = []
        with self._lock:
            for fd, mount, ino in sorted_:
                self._queued.setdefault(mount, deque()).append((fd, ino))
                self._inos[ino] += 1
                if self._woken(mount):
                    start.append(mount)
            self._sorted = batch[-1][1]
            if self._waiting:
                self._closed.notify_all()
        for mount in start:
            self._thread(mount)

    def _close(self, mount: int, batch: list[tuple[int, int]]) -> None:
        for fd, ino in batch:
            try:
                os.close(fd)
            except OSError as e:  # (a write-back failure: the writes' fsync reports it)
                log.debug("mount %d: closing a descriptor: %s", mount, e)
            with self._lock:
                self._pending -= 1
                self._inos[ino] -= 1
                if not self._inos[ino]:
                    del self._inos[ino]
                if self._waiting:
                    self._closed.notify_all()


CLOSER = Closer()  # (the process's)
close_later = CLOSER.close
wait_closed = CLOSER.wait_closed

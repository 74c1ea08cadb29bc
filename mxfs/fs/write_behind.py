"""Writes through the mount, answered before they reach the members (write-behind).

Without the kernel's writeback cache each write() waits for its FUSE request, so
the daemon's copy into the members' page cache sat on the writer's critical path:
the next request could not start until it ended.  Now a write is handed to a worker
thread and answered at once, and the kernel's transfer of the next request overlaps
it.  Per inode the writes land one after another in the order they came (an
overwrite never lands before what it overwrites), at most DEPTH of them queued.
Whatever must see the bytes (a read, fsync, flush at close, a truncate, the direct
path's open, a release) drains the queue first: to the newest write queued when it was
called, never for the writes queued after it (a writer writing on and on kept a
reader's read and close waiting for as long as it wrote).  What all queues hold is
bounded (BUDGET) and handed out by the writer's uid in turn (`fs/fair.RoundRobin`):
one user's many queued writes make another's wait for one of them to land at most,
never for all of them.

A failure (ENOSPC, EIO) is kept and raised by the next write, flush or fsync of the
inode, as the kernel reports writeback errors; close() sees it through flush.  What a
daemon crash can lose beyond today: up to DEPTH acknowledged, not yet fsynced writes
of each file being written, which POSIX allows for any write not followed by fsync.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio

from mxfs.fs.fair import RoundRobin

log = logging.getLogger("mxfs.fs")

DEPTH = 4  # queued writes per inode: 4 MiB of 1 MiB requests held at most
# Queued writes in the whole daemon, whatever the number of files written at once (a
# user opening thousands must not fill the daemon's memory): 64 MiB at most, one uid
# (but root) holding 3 in 4 of it (`fs/fair.Lane`).
BUDGET = 64

# How a write runs: `run(write)` calls the blocking `write` in a worker thread (the
# daemon's: in its opener's turn for I/O threads, `MxfsOperations._io`).
Run = Callable[[Callable[[], None]], Awaitable[None]]


class WriteBehind:
    """The queue of one open inode's writes not yet on its members."""

    def __init__(self, depth: int = DEPTH,
                 budget: Callable[[], RoundRobin] | None = None) -> None:
        """`budget()`: the lane's, shared by every queue of the lane, bounding what all
        hold; a slot of it per queued write, taken in the writer's turn.  Asked at each
        write, as the file's lane may be another by then (`fs/fair.Lanes`)."""
        self._slots = trio.Semaphore(depth)
        self._budget = budget
        # Set when the newest queued write has landed: writes land in the order they
        # were queued (each waits for the one before), so then every earlier one has too.
        self._last: trio.Event | None = None
        self._pending = 0
        self.error: OSError | None = None  # the first failure no writer has heard of
        self.failures = 0  # failures so far (each handle reports those past its count)
        self.last_error: OSError | None = None

    @property
    def pending(self) -> int:
        return self._pending

    async def submit(self, nursery: trio.Nursery, write: Callable[[], None], run: Run,
                     uid: int) -> None:
        """Queue `write` (blocking, landed by `run`) behind the earlier ones; waits only
        while DEPTH writes are queued, or for the writer `uid`'s turn at the budget.
        (A failure of an earlier one: the caller's handle reports it first.)"""
        await self._slots.acquire()
        budget = self._budget() if self._budget is not None else None
        if budget is not None:
            try:
                uid = await budget.take(uid)  # (the tenant charged)
            except BaseException:  # cancelled while waiting: nothing was queued
                self._slots.release()
                raise
        before, done = self._last, trio.Event()
        self._last = done
        self._pending += 1
        nursery.start_soon(self._land, before, done, write, run, uid, budget)

    async def _land(self, before: trio.Event | None, done: trio.Event,
                    write: Callable[[], None], run: Run, uid: int,
                    budget: RoundRobin | None) -> None:
        # Shielded: an acknowledged write is finished even while the daemon stops.
        with trio.CancelScope(shield=True):
            try:
                if before is not None:
                    await before.wait()
                await run(write)
            except OSError as e:
                self._failed(e)
            except Exception:  # a bug must not end the daemon: the writer gets EIO
                log.exception("a write behind failed")
                self._failed(OSError(errno.EIO, "write failed"))
            finally:
                done.set()
                self._slots.release()
                if budget is not None:
                    budget.give(uid)
                self._pending -= 1
                if self._last is done:
                    self._last = None

    async def drain(self) -> None:
        """Wait until every write queued before this call has landed (or failed: its
        failure is counted by then), not for those queued meanwhile."""
        last = self._last
        if last is not None:
            await last.wait()

    def _failed(self, e: OSError) -> None:
        self.error = self.error or e
        self.failures += 1
        self.last_error = e

    def failure_since(self, seen: int) -> tuple[OSError | None, int]:
        """The last failure if any came after the `seen` first (a handle's count, as the
        kernel's errseq keeps one per open file: each writer hears of a failure, and a
        reader's close takes it from nobody), and the count now."""
        if self.failures > seen and self.last_error is not None:
            self.error = None  # (heard by a writer: not "nobody was left to tell")
            return self.last_error, self.failures
        return None, self.failures

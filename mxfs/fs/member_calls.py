"""Calls into the members' filesystems (stat, statvfs) made for a request, never on the
loop, and never waiting long on a member that stopped answering.

A member's device can hang (a dying drive, a stuck target): a stat or statvfs of it
then never returns, and on the loop it would hold every user's request behind it.
Here such calls run in worker threads; a member with STALLED calls not yet back is
left out of new ones (`guarded` answers None for it) until they come back; a request
waits WAIT_S for its calls at most (a thread, then the call), and is answered without
those that did not come back.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

from mxfs.pool.pool import member_space
from mxfs.proto.messages import MemberUsage
from mxfs.vol.volume import Volume

T = TypeVar("T")

STALLED = 2  # calls in flight on one member past which it is left out
THREADS = 16  # threads for these calls
WAIT_S = 1.0  # a request waits this long for its calls (a thread stuck past it ends alone)


class MemberCalls:
    def __init__(self, members: int) -> None:
        self._limiter = trio.CapacityLimiter(THREADS)
        self._on = [threading.Semaphore(STALLED) for _ in range(members)]

    def guarded(self, member: int, fn: Callable[[], T]) -> T | None:
        """(Worker thread.) `fn()`, a call into `member`'s filesystem; None if the member
        has STALLED calls hanging."""
        on = self._on[member]
        if not on.acquire(blocking=False):
            return None
        try:
            return fn()
        finally:
            on.release()

    async def run(self, fn: Callable[[], T]) -> T | None:
        """`fn()` in a worker thread (it makes its member calls through `guarded`); None if
        it did not end (a thread found for it first) within WAIT_S."""
        with trio.move_on_after(WAIT_S):
            return await trio.to_thread.run_sync(fn, limiter=self._limiter,
                                                 abandon_on_cancel=True)
        return None


class MemberSpace:
    """The members' space as statfs, df and status ask it: each member asked in a
    member call of its own, at once; one that does not answer in time shows as such."""

    def __init__(self, vol: Volume) -> None:
        self.calls = MemberCalls(len(vol.pool.members))
        self._vol = vol

    async def usage(self) -> list[MemberUsage]:
        pool, answers = self._vol.pool, {}

        async def ask(m: int) -> None:
            space = functools.partial(member_space, pool.members[m].path)
            answers[m] = await self.calls.run(functools.partial(self.calls.guarded, m, space))

        async with trio.open_nursery() as nursery:
            for m in pool.members:
                if not m.node and not m.failed:
                    nursery.start_soon(ask, m.index)
        return self._vol.usage(lambda m, _: answers.get(m))

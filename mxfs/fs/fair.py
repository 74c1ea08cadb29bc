"""Fair service on the daemon's one trio thread: no user's request holds it for long,
and no user's many requests crowd out another's.

Two rules, both cheap:
- **Slices.** A request that works through many items (keys to put or delete, chunks
  of a namespace being removed, namespaces to report) does them a bite at a time and,
  once it has held the thread for SLICE_S, steps aside until the others wait
  (`Slice`, `in_bites`): another user's request waits about a slice, not the whole
  request (a removal of 65,536 chunks once held everyone for 48 s).
- **Turns.** One uid has at most `max_active_per_user` requests in service at once,
  over all its connections; the rest wait for a turn (`Turns.turn`).  A user with
  hundreds of connections therefore adds a few bites to another user's wait, not
  hundreds.  Root is trusted and not held to it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import trio
import trio.testing

T = TypeVar("T")

BITE = 16  # items handled between two looks at the clock
SLICE_S = 0.001  # how long one request holds the thread before it lets others run
YIELD_MAX_S = 0.05  # how long it then lets them: the heavy request is not starved


class Slice:
    """One request's share of the thread, measured from its last yield."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def due(self) -> None:
        """If this request has held the thread SLICE_S, step aside until every other
        task waits (for I/O, a timer, a thread), or at most YIELD_MAX_S.

        A plain yield would not do: a light request makes several trio checkpoints
        on its way (reading, its turn, replying), and a heavy one that got the thread
        back at each would add a slice to every one of them."""
        if time.perf_counter() - self._since >= SLICE_S:
            with trio.move_on_after(YIELD_MAX_S):
                await trio.testing.wait_all_tasks_blocked()
            self._since = time.perf_counter()


async def in_bites(items: Sequence[T], bite: int = BITE) -> AsyncIterator[Sequence[T]]:
    """`items` a bite at a time, yielding to other tasks each slice."""
    share = Slice()
    for start in range(0, len(items), bite):
        if start:
            await share.due()
        yield items[start:start + bite]


class Turns:
    """At most `per_user` requests of one uid in service at once (root: no bound)."""

    def __init__(self, per_user: int) -> None:
        self.per_user = per_user
        self._limiters: dict[int, trio.Semaphore] = {}
        self._users: dict[int, int] = {}  # requests in service or waiting, by uid

    @asynccontextmanager
    async def turn(self, uid: int) -> AsyncIterator[None]:
        if uid == 0:
            yield
            return
        sem = self._limiters.get(uid)
        if sem is None:
            sem = self._limiters[uid] = trio.Semaphore(self.per_user)
        self._users[uid] = self._users.get(uid, 0) + 1
        try:
            async with sem:
                yield
        finally:
            self._users[uid] -= 1
            if not self._users[uid]:  # nobody of this uid in line: forget its semaphore
                del self._users[uid], self._limiters[uid]

    def waiting(self) -> dict[int, int]:
        """Requests in service or waiting for a turn, by uid (for `mxfs status`)."""
        return dict(self._users)

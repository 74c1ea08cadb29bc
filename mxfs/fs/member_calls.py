"""Calls into the members' filesystems (stat, statvfs) made for a request, never on the
loop, and never waiting long on a member that stopped answering.

A member's device can hang (a dying drive, a stuck target): a stat or statvfs of it
then never returns, and on the loop it would hold every user's request behind it.
Here such calls run in worker threads, handed out by uid in turn (`fair.RoundRobin`:
one user's flood of stats waits behind itself).  A member is left out of new calls
(`guarded` answers None for it) while one of its calls has not come back in WAIT_S,
or STALLED of them in SLOW_S; a request waits WAIT_S for its calls at most, and is
answered without those that did not come back.  A call that names the members it
touches waits (on the loop, holding no thread) until each has fewer than PER_MEMBER
such calls in flight: within the first second of a hang the guard still lets calls
in, and a steady stream of gets took all the threads, every user's calls then
waiting behind one member.  Those places too are handed out by uid in turn, one uid
holding 3 of a member's 4 at most: one user's slow calls on a member do not keep
another's out of it.  A member left out needs no place: its calls answer None at once.

A call the request stopped waiting for runs on to its end in a task of its own, which
holds the call's thread, its uid's turn and its places until the thread returns: let
go at WAIT_S, a user's slow calls (stats of 512 files a readdir page, in a loop) left
their threads running, more of hers took others, and all 16 were hers, every user's
lookups, readdirs and statfs waiting.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Generic, TypeVar

import trio

from mxfs.fs.fair import RoundRobin
from mxfs.pool.pool import NotAnswering, member_space
from mxfs.proto.messages import MemberUsage
from mxfs.vol.volume import Volume

T = TypeVar("T")

STALLED = 2  # calls in flight on one member that, all slow, leave it out
SLOW_S = 0.2  # ... slow: a stat or statvfs of a member in service takes microseconds
THREADS = 16  # threads for these calls
PER_MEMBER = 4  # calls in flight on one member at once (of those that name it)
PLACE_WAIT_S = 10.0  # ... how long a call waits for a place among them
WAIT_S = 1.0  # a request waits this long for its calls (one begun runs on, in its turn)


class MemberCalls:
    def __init__(self, members: int) -> None:
        self._limiter = trio.CapacityLimiter(THREADS)
        self._turns = RoundRobin(THREADS, THREADS * 3 // 4)
        self._lock = threading.Lock()
        self._since: list[dict[int, float]] = [{} for _ in range(members)]  # in flight
        self._tokens = itertools.count()
        self._per_member = [RoundRobin(PER_MEMBER, PER_MEMBER * 3 // 4)
                            for _ in range(members)]

    def guarded(self, member: int, fn: Callable[[], T]) -> T | None:
        """(Worker thread.) `fn()`, a call into `member`'s filesystem; None if the member
        does not answer (see the module's docstring)."""
        now = time.monotonic()
        with self._lock:
            if self._left_out(member, now):
                return None
            token = next(self._tokens)
            calls = self._since[member]
            calls[token] = now
        try:
            return fn()
        finally:
            with self._lock:
                del calls[token]

    def _left_out(self, member: int, now: float) -> bool:
        """Whether `member`'s calls in flight say it does not answer (the lock held)."""
        ages = sorted((now - t for t in self._since[member].values()), reverse=True)
        return bool(ages) and (ages[0] > WAIT_S or len(ages) >= STALLED and ages[-1] > SLOW_S)

    @contextlib.asynccontextmanager
    async def _on(self, members: Iterable[int], uid: int) -> AsyncIterator[None]:
        """A place among each of `members`' PER_MEMBER calls, in `uid`'s turn (taken in
        order: no two callers wait on each other); EIO for a member with no place
        free in PLACE_WAIT_S (its calls in flight have not come back).  A member left
        out is skipped: `guarded` answers None for it without touching it, and its
        places may be held by calls that never come back."""
        async with contextlib.AsyncExitStack() as places:
            for m in sorted(set(members)):
                with self._lock:
                    if self._left_out(m, time.monotonic()):
                        continue
                with trio.move_on_after(PLACE_WAIT_S) as waited:
                    await places.enter_async_context(self._per_member[m].slot(uid))
                if waited.cancelled_caught:
                    raise NotAnswering(errno.EIO, f"member {m} is not answering: its "
                                       f"calls have not come back in {PLACE_WAIT_S:.0f} s")
            yield

    async def run(self, fn: Callable[[], T], uid: int, members: Iterable[int] = ()
                  ) -> T | None:
        """`fn()` in a worker thread in `uid`'s turn (it makes its member calls through
        `guarded`; `members`: those it touches); None if it did not end (a place and a
        thread found for it first) within WAIT_S.  The call runs in a task of its own
        (`_call`): one not begun by then is not begun, one begun runs on to its end,
        holding its thread, turn and places."""
        call = _Call[T]()
        trio.lowlevel.spawn_system_task(self._call, call, fn, uid, tuple(members),
                                        context=contextvars.copy_context())
        try:
            with trio.move_on_after(WAIT_S):
                await call.done.wait()
        finally:
            call.waiting.cancel()  # (a call still waiting for its turn is not begun)
        if call.failed is not None:
            raise call.failed
        return call.answer

    async def _call(self, call: _Call[T], fn: Callable[[], T], uid: int,
                    members: tuple[int, ...]) -> None:
        """(A system task.)  `run`'s call: its places and turn taken while its requester
        waits, then its thread run to its end; the thread given up only when trio
        itself ends (the task then cancelled)."""
        try:
            async with contextlib.AsyncExitStack() as held:
                with call.waiting:
                    await held.enter_async_context(self._on(members, uid))
                    await held.enter_async_context(self._turns.slot(uid))
                if call.waiting.cancelled_caught:
                    return
                call.answer = await trio.to_thread.run_sync(fn, limiter=self._limiter,
                                                            abandon_on_cancel=True)
        except Exception as e:  # (the requester's to raise, if it still waits)
            call.failed = e
        finally:
            call.done.set()

    async def run_whole(self, fn: Callable[[], T], uid: int, members: Iterable[int] = ()
                        ) -> T:
        """`fn()` in a worker thread in `uid`'s turn, waited for whole: for calls that
        hand out what they open (descriptors), which must not be abandoned midway.
        `fn` makes its member calls through `guarded` and fails where one answers None,
        and `members` names those it touches: a hung member holds PER_MEMBER threads
        at most, and only the callers on it wait for it."""
        async with self._on(members, uid), self._turns.slot(uid):
            return await trio.to_thread.run_sync(fn, limiter=self._limiter)


class _Call(Generic[T]):
    """One call of `MemberCalls.run`, between its task and its requester."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.waiting = trio.CancelScope()  # over its wait for places and a turn
        self.answer: T | None = None
        self.failed: Exception | None = None


class MemberSpace:
    """The members' space as statfs, df and status ask it: each member asked in a
    member call of its own, at once; one that does not answer in time shows as such."""

    def __init__(self, vol: Volume) -> None:
        self.calls = MemberCalls(len(vol.pool.members))
        self._vol = vol

    async def usage(self, uid: int) -> list[MemberUsage]:
        pool, answers = self._vol.pool, {}

        async def ask(m: int) -> None:
            space = functools.partial(member_space, pool.members[m].path)
            answers[m] = await self.calls.run(functools.partial(self.calls.guarded, m, space),
                                              uid, (m,))

        async with trio.open_nursery() as nursery:
            for m in pool.members:
                if not m.node and not m.failed:
                    nursery.start_soon(ask, m.index)
        return self._vol.usage(lambda m, _: answers.get(m))

"""Fair service on the daemon's one trio thread: no user's request holds it for long,
and no user's many requests crowd out another's.

Two rules, both cheap:
- **Slices.** A request that works through many items (keys to put or delete, chunks
  of a namespace being removed, namespaces to report, a directory's entries) does them
  a bite at a time and, once it has held the thread for SLICE_S, steps aside until the
  others wait (`Slice`, `in_bites`): another user's request waits about a slice, not
  the whole request (a removal of 65,536 chunks once held everyone for 48 s).
- **Turns.** One uid has at most `max_active_per_user` requests in service at once,
  over all its connections; the rest wait for a turn (`Turns.turn`).  A user with
  hundreds of connections therefore adds a few bites to another user's wait, not
  hundreds.  Root is trusted and not held to it.

And what requests share off the thread (a store connection, the threads a reading node
sends KV on with, a lane's I/O threads and its budget of writes answered before they
land) is handed out by uid in turn (`RoundRobin`), not first come first served: a user
with many calls queued waits behind its own.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

try:  # (trio.testing imports pytest: 66 ms of every daemon's start)
    from trio._core import wait_all_tasks_blocked
except ImportError:  # (a trio that moved it)
    from trio.testing import wait_all_tasks_blocked

from mxfs.vol.tenants import tenant_of

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
                await wait_all_tasks_blocked()
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

    def __init__(self, per_user: int, aside_per_user: int = 64) -> None:
        self.per_user = per_user
        self.aside_per_user = aside_per_user  # requests of one uid out of its turns
        self._limiters: dict[int, trio.Semaphore] = {}
        self._users: dict[int, int] = {}  # requests in service or waiting, by uid
        self._aside: Counter[int] = Counter()  # ... of them stepped aside (`aside`)

    @asynccontextmanager
    async def turn(self, uid: int, at_once: bool = False) -> AsyncIterator[None]:
        """`uid`'s turn; `at_once`: a free one is taken without a checkpoint (a read's
        turn, taken with every recv: no other user waits any longer for it)."""
        uid = tenant_of(uid)  # (a user's subordinate uids share her turns)
        if uid == 0:
            yield
            return
        sem = self._limiters.get(uid)
        if sem is None:
            sem = self._limiters[uid] = trio.Semaphore(self.per_user)
        self._users[uid] = self._users.get(uid, 0) + 1
        try:
            if at_once and sem.value:  # (free: nobody of hers waits for it)
                sem.acquire_nowait()
            else:
                await sem.acquire()
            try:
                yield
            finally:
                sem.release()
        finally:
            self._users[uid] -= 1
            if not self._users[uid]:  # nobody of this uid in line: forget its semaphore
                del self._users[uid], self._limiters[uid]

    @asynccontextmanager
    async def aside(self, uid: int) -> AsyncIterator[None]:
        """(Inside `turn(uid)`.)  Step out of the turn while the request waits on
        another user (a `kv_wait` on keys others claimed: eight of them held all of a
        user's turns, every other request of hers waiting behind them up to a minute),
        and back in after, in line (shielded: the turn's end gives back what it took).
        `aside_per_user` of one uid's at once (a coroutine each); more wait in turn."""
        uid = tenant_of(uid)
        sem = self._limiters.get(uid)
        if sem is None or self._aside[uid] >= self.aside_per_user:  # (root: no turns)
            yield
            return
        self._aside[uid] += 1
        sem.release()
        try:
            yield
        finally:
            with trio.CancelScope(shield=True):
                await sem.acquire()
            self._aside[uid] -= 1
            if not self._aside[uid]:
                del self._aside[uid]

    def waiting(self) -> dict[int, int]:
        """Requests in service or waiting for a turn, by uid (for `mxfs status`)."""
        return dict(self._users)


class RoundRobin:
    """`slots` things used at once (a store connection; sender threads), handed out by
    uid in turn: a freed one goes to the first waiting call of the uid that waited
    longest for one, which then goes to the back of the line of uids.  One uid (but
    root) holds at most `per_user` at once, so another user's call waits for one of
    them to free, never behind every call of the first (the writer of 48 puts queued
    ahead of it, first come first served)."""

    def __init__(self, slots: int, per_user: int | None = None) -> None:
        self.slots = slots
        self.per_user = per_user
        self._free = slots
        self._held: Counter[int] = Counter()
        self._waiting: OrderedDict[int, deque[trio.Event]] = OrderedDict()
        # Calls waiting `first`, at the front of their uid's line in the order they came
        # (not newest first: one file's writes, each taking the front again, held
        # another's there for as long as the first kept writing).
        self._first: set[trio.Event] = set()

    @asynccontextmanager
    async def slot(self, uid: int, first: bool = False) -> AsyncIterator[None]:
        held = await self.take(uid, first)
        try:
            yield
        finally:
            self.give(held)

    async def take(self, uid: int, first: bool = False) -> int:
        """One slot for `uid`, in its tenant's turn (`vol/tenants.py`), held until
        `give` of the tenant returned: for one taken in a task and given back by
        another (a write answered, then landed).  `first`: ahead of the tenant's own
        calls waiting (not of other tenants')."""
        uid = tenant_of(uid)
        if self._free and uid not in self._waiting and self._may(uid):
            self._take(uid)
            return uid
        turn = trio.Event()
        calls = self._waiting.setdefault(uid, deque())
        if first:  # (behind the uid's other first ones: a run at its line's front)
            ahead = 0
            while ahead < len(calls) and calls[ahead] in self._first:
                ahead += 1
            calls.insert(ahead, turn)
            self._first.add(turn)
        else:
            calls.append(turn)
        try:
            await turn.wait()
        except BaseException:  # cancelled: out of the line, or the slot passed on
            if turn.is_set():
                self.give(uid)
            else:
                self._forget(uid, turn)
            raise
        return uid

    def busy(self) -> int:
        return self.slots - self._free

    def queued(self) -> int:
        return sum(len(calls) for calls in self._waiting.values())

    def _may(self, uid: int) -> bool:
        return uid == 0 or self.per_user is None or self._held[uid] < self.per_user

    def _take(self, uid: int) -> None:
        self._free -= 1
        self._held[uid] += 1

    def give(self, uid: int) -> None:
        """Give back a slot `uid` took: to the first uid in line that may hold one."""
        self._free += 1
        self._held[uid] -= 1
        if self._held[uid] <= 0:
            del self._held[uid]
        while self._free:
            uid = next((u for u in self._waiting if self._may(u)), -1)
            if uid < 0:
                return
            calls = self._waiting.pop(uid)
            turn = calls.popleft()
            self._first.discard(turn)
            if calls:
                self._waiting[uid] = calls  # (to the back of the line of uids)
            self._take(uid)
            turn.set()

    def _forget(self, uid: int, turn: trio.Event) -> None:
        calls = self._waiting.get(uid)
        self._first.discard(turn)
        if calls is not None:
            calls.remove(turn)
            if not calls:
                del self._waiting[uid]


class Lane:
    """What data I/O that waits on the same nodes shares: worker threads and a budget
    of writes landed behind their answers, both handed out by uid in turn (one uid,
    but root, 3 in 4 of them): another user's write is answered while one user's
    queued writes land, not after all of them."""

    def __init__(self, threads: int, budget: int) -> None:
        self.limiter = trio.CapacityLimiter(threads)
        self.turns = RoundRobin(threads, max(1, threads * 3 // 4))
        self.budget = RoundRobin(budget, max(1, budget * 3 // 4))

    async def run(self, uid: int, fn: Callable[..., T], *args: Any, first: bool = False
                  ) -> T:
        """Blocking `fn(*args)` on one of the lane's threads, in `uid`'s turn (`first`:
        ahead of the uid's own calls waiting: a write already answered, which others'
        reads and closes of the file wait for)."""
        async with self.turns.slot(uid, first):
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def idle(self) -> bool:
        """Nothing queued or in flight: it holds nothing of anyone's."""
        return not (self.turns.busy() or self.turns.queued() or self.budget.busy()
                    or self.budget.queued())


class Lanes:
    """A lane for this node's own files, and one for each set of other nodes files
    stripe over (their I/O waits on those nodes): a slow node holds only the lanes of
    the files striped over it, never those of files on this node's members or on
    other nodes' alone.  At most MAX_FAR_LANES sets hold one at once, each with a
    quarter of the write-behind budget, and the rest share one: threads and queued
    writes stay bounded however many sets users' layouts make.

    A set's lane is its own while it has I/O queued or in flight; once idle, it goes
    to a new set that finds every lane taken (the one used longest ago first), and
    the set takes a lane afresh at its next I/O.  Before, the first sets to see I/O
    held theirs for the life of the mount: one user touching files on eight node
    subsets after mount left every later far file to the shared lane, behind any slow
    node there.  Idle means now, not for a while: a lane holds nothing when idle, so
    handing it on costs its set nothing, and a user cannot keep lanes by touching a
    set now and then, only by keeping I/O in flight on it.

    Sets, not nodes: a file striped over nodes a and b waits on both, so it shares
    only with files that wait on exactly those; keyed by node, its I/O would need a
    thread of a's lane and of b's, and, holding one while it waited for the other,
    would make a's files wait on b."""

    MAX_FAR_LANES = 8

    def __init__(self, threads: int, budget: int) -> None:
        self.threads, self.budget = threads, budget
        self.own = Lane(threads, budget)
        self._far: OrderedDict[tuple[str, ...], Lane] = OrderedDict()  # used last, last
        self._rest: Lane | None = None

    def of(self, owners: tuple[str, ...]) -> Lane:
        """The lane of files striped over the members of `owners` (none: this node's)."""
        if not owners:
            return self.own
        lane = self._far.get(owners)
        if lane is not None:
            self._far.move_to_end(owners)
            return lane
        if len(self._far) >= self.MAX_FAR_LANES:
            idle = next((k for k, far in self._far.items() if far.idle()), None)
            if idle is None:  # every lane busy: share the rest's
                if self._rest is None:
                    self._rest = Lane(self.threads, max(1, self.budget // 4))
                return self._rest
            del self._far[idle]
        lane = self._far[owners] = Lane(self.threads, max(1, self.budget // 4))
        return lane

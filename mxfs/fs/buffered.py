"""Bytes of control messages the daemon holds for each tenant, within a budget.

A connection's inbox holds a frame while it arrives (up to 1 MiB, for up to
`frame_timeout`), and a reply is held until its peer reads it: counted by
connection alone, one user's 512 connections held 0.5-1 GiB of the daemon's
memory at no cost to her.  Every connection's inbox (a request until it is served:
parsed, it waits for its turn as memory) and unsent reply are counted against its
tenant (`vol/tenants.py`), at most `max_buffered_per_user` bytes (root: not bound).
Room for bytes is taken before they are read: a frame is read only
once its whole length has room (a connection waits in its tenant's line, first come
first served, until its deadline).  A reply cannot wait so (it is memory already),
so a request enters service only while its tenant's unsent replies are under the
budget (`reply_room`, in the tenant's turn): those in service at once may pass it
by their replies, `max_active_per_user` of them at most.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import trio


@dataclass(eq=False)
class Hold:
    """What one connection holds of its tenant's budget."""

    tenant: int
    inbox: int = 0  # room taken for its inbox: what it holds, and what it may read
    reply: int = 0  # its reply not yet sent


@dataclass(eq=False)
class _Waiter:
    hold: Hold
    want: int  # the inbox room it asks for, in all
    granted: trio.Event = field(default_factory=trio.Event)


class Buffered:
    """The tenants' bytes buffered, and the connections waiting for room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: Counter[int] = Counter()  # inboxes and replies, by tenant
        self.replies: Counter[int] = Counter()  # ... of them replies
        self._line: dict[int, deque[_Waiter]] = {}  # waiting for inbox room, by tenant
        self._sent: dict[int, trio.Event] = {}  # set when a tenant's replies shrink

    def room(self, tenant: int) -> float:
        """Bytes `tenant` may take now without waiting (none while others wait)."""
        if tenant == 0:
            return math.inf
        if tenant in self._line:
            return 0
        return max(0, self.limit - self.held[tenant])

    async def take(self, hold: Hold, want: int, deadline: float) -> bool:
        """Grow `hold`'s inbox room to `want` bytes, waiting in its tenant's line until
        `deadline`; False if it did not come (or never can: over the whole budget)."""
        more = want - hold.inbox
        if more <= 0:
            return True
        if self.room(hold.tenant) >= more:
            self._add(hold, more)
            return True
        if want + hold.reply > self.limit:
            return False
        waiter = _Waiter(hold, want)
        self._line.setdefault(hold.tenant, deque()).append(waiter)
        try:
            with trio.move_on_at(deadline):
                await waiter.granted.wait()
        finally:
            if not waiter.granted.is_set():  # (timed out or cancelled: out of line)
                line = self._line[hold.tenant]
                line.remove(waiter)
                if not line:
                    del self._line[hold.tenant]
                self._wake(hold.tenant)  # (the next may fit where it did not)
        return waiter.granted.is_set()

    def keep(self, hold: Hold, inbox: int) -> None:
        """Shrink `hold`'s inbox room to `inbox` bytes (what it holds now)."""
        if inbox < hold.inbox:
            self._add(hold, inbox - hold.inbox)

    def reply(self, hold: Hold, n: int) -> None:
        """`hold`'s reply is now `n` bytes (0: sent, or given up); never waits."""
        change, hold.reply = n - hold.reply, n
        self.replies[hold.tenant] += change
        if not self.replies[hold.tenant]:
            del self.replies[hold.tenant]
        self._count(hold.tenant, change)
        if change < 0:
            sent = self._sent.pop(hold.tenant, None)
            if sent is not None:
                sent.set()

    def drop(self, hold: Hold) -> None:
        """The connection ended: all it held goes back."""
        self.keep(hold, 0)
        self.reply(hold, 0)

    async def reply_room(self, tenant: int, deadline: float) -> bool:
        """Wait until `tenant`'s unsent replies are under the budget (until `deadline`):
        a request is served only then, so its reply is made only then."""
        while tenant != 0 and self.replies[tenant] >= self.limit:
            sent = self._sent.setdefault(tenant, trio.Event())
            with trio.move_on_at(deadline) as scope:
                await sent.wait()
            if scope.cancelled_caught:
                return self.replies[tenant] < self.limit
        return True

    def _add(self, hold: Hold, change: int) -> None:
        hold.inbox += change
        self._count(hold.tenant, change)

    def _count(self, tenant: int, change: int) -> None:
        self.held[tenant] += change
        if not self.held[tenant]:
            del self.held[tenant]
        if change < 0:
            self._wake(tenant)

    def _wake(self, tenant: int) -> None:
        """Grant the tenant's waiting connections their room, first come first served,
        while the first in line fits."""
        line = self._line.get(tenant)
        while line:
            first = line[0]
            more = first.want - first.hold.inbox
            if self.held[tenant] + more > self.limit:
                return
            line.popleft()
            self._add(first.hold, more)
            first.granted.set()
        self._line.pop(tenant, None)

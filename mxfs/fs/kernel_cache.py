"""How long the kernel may keep this daemon's answers (names, absent names, attributes),
and, on a reading node, which of them it may still hold.

Where every change passes through this daemon (one node), the kernel sees each go by
and may keep answers for long (TIMEOUT); changes made behind its back (direct-path
commits) invalidate what they touch.  A reading node's rows change on another node:
while it follows the change feed (`fs/feed_follower.py`) what changed is invalidated as
it commits, so answers are kept FEED_TIMEOUT, a backstop; without the feed (not yet
reached, or lost) the kernel asks again after FOLLOW_TIMEOUT.  When the feed cannot say
what changed (it was pruned past this node, a new writer session began) every answer
the kernel may still hold is invalidated: that is why they are remembered here, each
until its timeout has run out, at most HELD_LIMIT (past it answers are short again).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

TIMEOUT = 300.0
FEED_TIMEOUT = 60.0
FOLLOW_TIMEOUT = 1.0
HELD_LIMIT = 200_000
EXPIRE_STEP = 4  # run-out answers forgotten at each answer given
EXPIRE_BITE = 1024  # ... and at most once the table is full

Key = int | tuple[int, bytes]  # an inode's attributes, or a (directory, name) entry


class KernelCache:
    def __init__(self, follow: bool) -> None:
        self.follow = follow  # another node changes the rows
        self.feed_live = False  # ... and this node hears of each change as it commits
        # key -> when its answer runs out, in that order (every answer is kept as long:
        # a refreshed one goes to the end), so the expired are popped from the front (a
        # full table of live answers was rebuilt at each new key: 13 ms each)
        self._held: OrderedDict[Key, float] = OrderedDict()
        self._lock = threading.Lock()  # (`held` is asked from the feed's thread)

    @property
    def answers_s(self) -> float:
        """How long the kernel keeps an answer given now (without the HELD_LIMIT)."""
        return TIMEOUT if not self.follow else FEED_TIMEOUT if self.feed_live \
            else FOLLOW_TIMEOUT

    def timeout(self, key: Key) -> float:
        """The timeout of an answer about `key`, given now."""
        if not self.follow:
            return TIMEOUT
        if not self.feed_live:
            return FOLLOW_TIMEOUT
        now = time.monotonic()
        with self._lock:
            self._expire(now, EXPIRE_STEP)  # (a few at each answer: the table keeps up)
            if len(self._held) >= HELD_LIMIT and key not in self._held:
                self._expire(now, EXPIRE_BITE)
                if len(self._held) >= HELD_LIMIT:
                    return FOLLOW_TIMEOUT
            self._held[key] = now + FEED_TIMEOUT
            self._held.move_to_end(key)
        return FEED_TIMEOUT

    def _expire(self, now: float, most: int) -> None:
        """(Under the lock.)  Forget `most` answers run out at most (a full table run
        out at once took 68 ms of the answer that found it full)."""
        held = self._held
        for _ in range(most):
            if not held or next(iter(held.values())) > now:
                return
            held.popitem(last=False)

    def held(self) -> tuple[list[int], list[tuple[int, bytes]]]:
        """(inodes, entries) whose answers the kernel may still hold: copied under the
        lock, sorted out after (sorted under it, 200,000 held every answer 38 ms)."""
        with self._lock:
            kept = list(self._held.items())
        now = time.monotonic()
        inos = [k for k, until in kept if until > now and isinstance(k, int)]
        names = [k for k, until in kept if until > now and not isinstance(k, int)]
        return inos, names

"""Mount-time progress, told to whoever waits for the daemon to answer.

What a mount does before it serves grows with what tenants stored (the KV index's
rows, the orphans a crash left, a store checked after a crash): systemd's start
timeout (the unit's TimeoutStartSec) and `mxfs mount`'s (`vol/mounts.READY_TIMEOUT`)
killed a start that outran them, and the next began again from scratch, for ever.
Each step of that work (`Startup.step`) tells systemd to wait EXTEND_S more
(EXTEND_TIMEOUT_USEC) and writes "wait" on `mxfs mount`'s pipe, which then waits
READY_TIMEOUT more: a start that stops making progress still times out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

EXTEND_S = 120  # each step keeps a start alive this long past the timeouts
EVERY_S = 1.0  # told at most this often (the KV index's load steps every 4,096 chunks)


class Startup:
    def __init__(self, notify: Callable[[str], None],
                 waiting: Callable[[], None] | None = None) -> None:
        self._notify = notify  # systemd's (`fs/daemon.notify_systemd`)
        self._waiting = waiting  # "wait" to `mxfs mount`, through the ready pipe
        self._last = float("-inf")

    def step(self) -> None:
        """Mount-time work goes on: ask for more time, if not asked within EVERY_S."""
        now = time.monotonic()
        if now - self._last < EVERY_S:
            return
        self._last = now
        self._notify(f"EXTEND_TIMEOUT_USEC={EXTEND_S * 1_000_000}")
        if self._waiting is not None:
            self._waiting()

"""Tenants caught writing past their word, and how long their new files are refused.

A direct writer holds descriptors the daemon cannot take back; what it writes past
its declared size, or reserves past its file's end (fallocate KEEP_SIZE), is cut back
within a second (`fs/session.cut_back`).  One file at a time that was not enough: a
tenant holding a thousand unpublished files filled the metadata member with the next
each time the last was cut, and every other tenant's creates and mkdirs failed ENOSPC
for as long as she liked.  So one caught file costs her them all (cut back and held,
their commits refused), and her new direct and KV creates are refused for a penalty
(`left`), doubled at each repeat up to PENALTY_DOUBLINGS times, started afresh once
she kept to her word QUIET_S: a sustained fill is one brief fill a penalty.  Counted
by tenant (a user's subordinate uids are hers: `vol/tenants.py`); root is never
refused.  Asked and told from the loop and from worker threads (hence the lock).
"""

from __future__ import annotations

import math
import threading
import time

PENALTY_S = 30  # s: the first offence's (the mount option overdraft_penalty_s)
PENALTY_DOUBLINGS = 4  # a repeat doubles it, up to 16 times the first (8 minutes)
QUIET_S = 1800  # s without an offence after a penalty ends: the next is a first again


class Overdrafts:
    def __init__(self, penalty_s: int = PENALTY_S) -> None:
        self.penalty_s = penalty_s
        self._lock = threading.Lock()
        self._by_tenant: dict[int, tuple[float, float]] = {}  # (penalised until, period)

    def caught(self, tenant: int) -> float:
        """`tenant` was caught overdrawing: the penalty it begins (s), or 0 if one runs
        already (the same fill, found again by another look) or the tenant is root."""
        if tenant == 0:
            return 0
        now = time.monotonic()
        with self._lock:
            until, period = self._by_tenant.get(tenant, (-math.inf, 0.0))
            if now < until:
                return 0
            # (a first offence, or one within QUIET_S of the last penalty's end)
            period = self.penalty_s if now - until > QUIET_S else min(period * 2,
                                                                      self.most_s())
            self._by_tenant = {t: v for t, v in self._by_tenant.items()  # (a tenant's
                               if now - v[0] <= QUIET_S}  # entry kept while it counts)
            self._by_tenant[tenant] = (now + period, period)
            return period

    def left(self, tenant: int) -> float:
        """Seconds `tenant`'s penalty has to run (0: none)."""
        got = self._by_tenant.get(tenant)
        return 0 if got is None else max(0.0, got[0] - time.monotonic())

    def most_s(self) -> int:
        """The longest a penalty grows to."""
        return self.penalty_s << PENALTY_DOUBLINGS

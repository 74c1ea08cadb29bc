"""Failures of single requests, logged without letting one tenant flood the log.

The daemon answers a failed request with an errno and goes on; the failure is
logged once with its op and caller (with a traceback for unexpected ones),
then counted: every 1000th repeat of the same kind is logged again with the
count, so a client sending a million bad requests costs a few log lines.

A kind is (op, exception type, the caller's tenant): a user's subordinate uids
(`vol/tenants.py`, 65,536 of them) are one caller here, or cycling through them
logged every note afresh.  The table keeps the KEYS kinds seen most recently:
past it the least recently seen goes (clearing it whole, as it was, let any user
with enough uids or kinds have every note of everyone's logged again).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mxfs.vol.tenants import tenant_of

KEYS = 10_000  # kinds counted at once
EVERY = 1000  # a kind seen again is logged each EVERY times


class FailureLog:
    def __init__(self, log: logging.Logger, tenant: Callable[[int], int] = tenant_of) -> None:
        self.log = log
        self.tenant = tenant  # uid -> the uid whose kinds it shares
        # (op, exception type, tenant) -> times seen, the most recently seen last
        self.counts: OrderedDict[tuple[str, str, int | None], int] = OrderedDict()

    def note(self, op: str, caller: Any, err: BaseException, trace: bool = True,
             level: int | None = None) -> None:
        """Log `err` from serving `op` for `caller` (None: no caller), rate-limited; at
        ERROR with its traceback (`trace`), else WARNING, unless `level` says."""
        uid = getattr(caller, "uid", None)
        tenant = None if uid is None else self.tenant(uid)
        key = (op[:32], type(err).__name__, tenant)
        n = self.counts.pop(key, 0) + 1
        self.counts[key] = n
        if len(self.counts) > KEYS:  # bounded however many uids and kinds there are
            self.counts.popitem(last=False)
        if n != 1 and n % EVERY:
            return
        who = f"pid {caller.pid} uid {caller.uid}" if caller is not None else "the daemon"
        if level is None:
            level = logging.ERROR if trace else logging.WARNING
        self.log.log(level, "%s for %s failed (%s: %s)%s%s", op[:32], who, type(err).__name__,
                     err, f"; {n} times so far" if n > 1 else "",
                     f" (uid {uid} is user {tenant}'s)" if tenant != uid else "",
                     exc_info=err if trace and n == 1 else None)

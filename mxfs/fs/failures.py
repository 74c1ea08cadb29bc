"""Failures of single requests, logged without letting one tenant flood the log.

The daemon answers a failed request with an errno and goes on; the failure is
logged once with its op and caller (with a traceback for unexpected ones),
then counted: every 1000th repeat of the same kind is logged again with the
count, so a client sending a million bad requests costs a few log lines.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any


class FailureLog:
    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.counts: Counter[tuple[str, str, int | None]] = Counter()

    def note(self, op: str, caller: Any, err: BaseException, trace: bool = True) -> None:
        """Log `err` from serving `op` for `caller` (None: no caller), rate-limited."""
        uid = getattr(caller, "uid", None)
        key = (op[:32], type(err).__name__, uid)
        if len(self.counts) > 10_000:  # bounded however many uids and kinds there are
            self.counts.clear()
        self.counts[key] += 1
        n = self.counts[key]
        if n != 1 and n % 1000:
            return
        who = f"pid {caller.pid} uid {caller.uid}" if caller is not None else "the daemon"
        level = logging.ERROR if trace else logging.WARNING
        self.log.log(level, "%s for %s failed (%s: %s)%s", op[:32], who, type(err).__name__,
                     err, f"; {n} times so far" if n > 1 else "",
                     exc_info=err if trace and n == 1 else None)

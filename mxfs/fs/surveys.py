"""Answers that read every row of the pool (`mxfs df`'s bytes by use, `mxfs status`'s
lost files), computed off the daemon's thread.

A scan of a large pool takes seconds; on the trio thread it would hold every request
to the mount up, and any local user may ask for one in a loop.  So each runs in a
worker thread on a read-only store of its own, after the daemon commits what it holds
(the reader then sees every change answered so far), one at a time, and its answer is
reused for FRESH_S: callers asking meanwhile wait for it or take it, and a loop costs
one scan per FRESH_S.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import Any

import trio

from mxfs.meta import MetaStore, Unusable

# Seconds an answer is served again before it is computed anew.
FRESH_S = 5.0


class Surveys:
    def __init__(self, where: str, commit: Callable[[], None]) -> None:
        self.where = where  # the store's location (`meta/location.py`)
        self.commit = commit  # the daemon's store's (on its thread)
        self._lock = trio.Lock()
        self._answers: dict[str, tuple[float, Any]] = {}

    async def get(self, name: str, survey: Callable[[MetaStore], Any]) -> Any:
        """`survey(store)`'s answer, at most FRESH_S old."""
        async with self._lock:
            held = self._answers.get(name)
            if held is not None and time.monotonic() - held[0] < FRESH_S:
                return held[1]
            self.commit()
            answer = await trio.to_thread.run_sync(self._run, survey)
            self._answers[name] = (time.monotonic(), answer)
            return answer

    def _run(self, survey: Callable[[MetaStore], Any]) -> Any:
        try:
            store = MetaStore.open(self.where, readonly=True)
        except Unusable as e:  # (a server away, say)
            raise OSError(errno.EIO, f"the metadata store cannot be read now: {e}") from None
        try:
            return survey(store)
        finally:
            store.close()

"""Python's garbage collector kept from holding every user's requests.

A full collection walks every object the collector tracks, on whichever thread made the
allocation that set it off, holding the interpreter: with a million KV chunks indexed
(one object each) it held the daemon's one trio thread 200 ms, and it came again each
time a quarter as many objects more had lived long.  What the mount loaded is frozen
(`gc.freeze`), and what lived through a full collection is frozen again, at most every
`gc_freeze_s` (a mount option): the next full collections walk only what came since.
Frozen objects are still freed when nothing refers to them; a cycle among them that
becomes garbage waits for the thaw, every THAW_S, after which one full collection walks
everything again.  The thaw comes first, whatever else: frozen at each full collection
(every few seconds under load, once little is left to walk), a busy daemon never
thawed, and froze each request's cycles alive at that moment for good.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import trio

from mxfs.proto.messages import GcStatus

LOOK_S = 1.0  # how often it looks for a full collection to freeze after
FREEZE_S = 600  # what lived through a full collection is frozen at most this often
THAW_S = 3600.0  # how often frozen objects are let go to the next full collection


class GcKeeper:
    """Freezes what lived through full collections (see the module's docstring)."""

    def __init__(self, freeze_s: float = FREEZE_S) -> None:
        self.freeze_s = freeze_s
        self._full = False  # a full collection ran since the last look
        self.freezes = self.thaws = 0
        self._thawed = self._frozen = time.monotonic()

    def start(self) -> None:
        """At mount, before serving: collect what loading left, and freeze the rest
        (the index, the store's inodes)."""
        gc.collect()
        gc.freeze()
        self.freezes += 1
        self._frozen = time.monotonic()
        if self._seen not in gc.callbacks:
            gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info.get("generation") == 2:
            self._full = True

    def look(self) -> None:
        """Thaw every THAW_S; else freeze after a full collection, `freeze_s` after the
        last freeze at the soonest."""
        now = time.monotonic()
        full, self._full = self._full, False
        if now - self._thawed >= THAW_S:
            gc.unfreeze()
            self._thawed = now
            self.thaws += 1
        elif full and now - self._frozen >= self.freeze_s:
            gc.freeze()
            self._frozen = now
            self.freezes += 1

    async def run(self) -> None:
        try:
            while True:
                await trio.sleep(LOOK_S)
                self.look()
        finally:
            with contextlib.suppress(ValueError):  # (ended before the mount answered)
                gc.callbacks.remove(self._seen)

    def status(self) -> GcStatus:
        return {"frozen": gc.get_freeze_count(), "freezes": self.freezes,
                "thaws": self.thaws, "full_collections": gc.get_stats()[2]["collections"]}


GC_KEEPER = GcKeeper()  # the daemon's (one a process, as the collector is)

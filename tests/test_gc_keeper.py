"""The daemon's garbage collector keeper (`fs/gc_keeper.py`): what lives through full
collections is frozen, and thawed on its own schedule whatever the load."""

from __future__ import annotations

import gc
import time

import pytest

from mxfs.fs import gc_keeper
from mxfs.fs.gc_keeper import GcKeeper

pytestmark = pytest.mark.unit


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_busy_daemon_thaws_on_time_and_freezes_no_oftener_than_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen at each full collection, which comes every few seconds under load once
    little is left unfrozen, a busy daemon never thawed: each request's cycles alive at
    a freeze were kept for good, the frozen count growing without bound.  The thaw
    comes first, every THAW_S, and a freeze at most every `freeze_s`."""
    monkeypatch.setattr(gc_keeper, "THAW_S", 0.5)
    keeper = GcKeeper(freeze_s=0.2)
    try:
        keeper.start()
        frozen_at_start = gc.get_freeze_count()
        most = 0
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            for _ in range(2000):  # (a request's cycles, garbage a moment later)
                _Cycle()
            keeper._full = True  # (a full collection at every look, as under load)
            keeper.look()
            most = max(most, gc.get_freeze_count())
            time.sleep(0.05)
        assert keeper.thaws >= 3
        assert 2 <= keeper.freezes - 1 <= 2.5 / 0.2 + 1
        gc.collect()
        assert gc.get_freeze_count() < frozen_at_start + 50_000 and most < 10 ** 6
    finally:
        gc.callbacks.remove(keeper._seen)
        gc.unfreeze()

"""What a reading node remembers of the answers its kernel may hold (`fs/kernel_cache.py`):
forgotten as they run out, a few at a time, never a whole table at one answer."""

from __future__ import annotations

import time

import pytest

from mxfs.fs import kernel_cache
from mxfs.fs.kernel_cache import FEED_TIMEOUT, FOLLOW_TIMEOUT, KernelCache

pytestmark = pytest.mark.unit


def test_a_full_table_run_out_is_forgotten_a_bite_at_each_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A table full of answers run out was emptied by the answer that found it full,
    68 ms of the daemon's thread at 200,000: now EXPIRE_BITE at most, and EXPIRE_STEP
    at every answer, so the table keeps up as answers run out."""
    monkeypatch.setattr(kernel_cache, "HELD_LIMIT", 5000)
    monkeypatch.setattr(kernel_cache, "EXPIRE_BITE", 100)
    monkeypatch.setattr(kernel_cache, "FEED_TIMEOUT", 0.05)
    cache = KernelCache(follow=True)
    cache.feed_live = True
    for ino in range(5000):
        assert cache.timeout(ino) == 0.05
    assert len(cache._held) == 5000
    time.sleep(0.1)  # (all run out)
    assert cache.held() == ([], [])  # (none the kernel may still hold)
    assert cache.timeout((1, b"new")) == 0.05
    step = kernel_cache.EXPIRE_STEP
    assert len(cache._held) == 5000 - step + 1  # (a few at each answer)
    monkeypatch.setattr(kernel_cache, "EXPIRE_STEP", 0)
    ino = 5000
    while len(cache._held) < 5000:  # (full again)
        cache.timeout(ino)
        ino += 1
    assert cache.timeout((1, b"newer")) == 0.05
    assert len(cache._held) == 5000 - 100 + 1  # (full: a bite, not the table)

def test_answers_held_are_those_not_run_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_cache, "FEED_TIMEOUT", 0.2)
    cache = KernelCache(follow=True)
    assert cache.timeout(5) == FOLLOW_TIMEOUT  # (no feed yet: short, not remembered)
    cache.feed_live = True
    cache.timeout(5)
    time.sleep(0.3)
    cache.timeout(6)
    cache.timeout((1, b"a"))
    assert cache.held() == ([6], [(1, b"a")])
    assert KernelCache(follow=False).timeout(5) > FEED_TIMEOUT

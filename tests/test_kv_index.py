"""The KV index's choice of eviction victims (`vol/kv_index.py`), on namespaces held in
memory: how many chunks one walk looks at when a user's chunks are pinned."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace
from typing import cast

import pytest

from mxfs.vol.kv_index import TOUCH_BITE, VICTIMS, Chunk, KVIndex, Namespace
from mxfs.vol.volume import Volume

pytestmark = pytest.mark.unit


class _Moves(OrderedDict[bytes, Chunk]):
    """A namespace's chunks that count the pinned ones a walk passed (each is moved to
    the recent end)."""

    moved = 0

    def move_to_end(self, key: bytes, last: bool = True) -> None:
        self.moved += 1
        super().move_to_end(key, last)


def _index() -> KVIndex:
    """An index of no store: a reading node's loads nothing."""
    return KVIndex(cast(Volume, SimpleNamespace(pool=SimpleNamespace(node="reader"))))


def _space(*pinned: bool) -> tuple[Namespace, _Moves]:
    """One-byte chunks k0, k1, ..., least recently used first, pinned as told."""
    space = Namespace("n", 1000, 1000, 0o700, 0)
    space.chunks = chunks = _Moves()
    for i, pin in enumerate(pinned):
        chunk = chunks[b"k%d" % i] = Chunk(ino=i, size=1, atime=i, sum_unit=1, sums=b"",
                                           tenant=1000)
        space.used += chunk.cost
        if pin:
            space.pin(chunk)
    return space, chunks


def test_a_walk_passes_a_bounded_number_of_pinned_chunks() -> None:
    index, pinned = _index(), 3 * VICTIMS + 5
    space, chunks = _space(*[True] * pinned, False, False)
    for walk in range(1, 4):  # each walk passes VICTIMS pinned chunks, then stops
        assert index.victims(space, 0) == []
        assert chunks.moved == walk * VICTIMS
        assert next(iter(chunks)) == b"k%d" % (walk * VICTIMS)
    # The next goes on past them, to the unpinned ones behind.
    assert [k for _, k in index.victims(space, 0)] == [b"k%d" % pinned, b"k%d" % (pinned + 1)]
    assert chunks.moved == pinned and len(chunks) == pinned + 2 and space.pinned == pinned


def test_no_walk_once_nothing_unpinned_is_left() -> None:
    index = _index()
    space, chunks = _space(*[True] * (VICTIMS // 2))
    assert index.victims(space, 0) == [] and chunks.moved == 0
    assert index.victims(space, 0, most=16) == [] and chunks.moved == 0
    # Once the one unpinned chunk is taken the walk ends: the pinned behind it stay.
    space, chunks = _space(True, False, *[True] * 100)
    assert [k for _, k in index.victims(space, 0)] == [b"k1"] and chunks.moved == 1
    assert list(chunks)[:2] == [b"k1", b"k2"]
    # (What the daemon's eviction asks before it walks again: `KVOps._evict`.)
    assert index.may_evict(space, 0) and not index.may_evict(space, space.used)
    assert not index.may_evict(_space(True, True)[0], 0)


def test_access_times_written_back_a_bounded_bite_a_round_each_key_once() -> None:
    """100,000 keys looked up (a user pinning them in a loop) are not one round's
    write-back on the daemon's thread: each flush writes TOUCH_BITE at most, the longest
    waiting first, and a key touched again meanwhile is written once, its latest time."""
    written: list[list[tuple[int, str, bytes]]] = []
    index = KVIndex(cast(Volume, SimpleNamespace(
        pool=SimpleNamespace(node="reader"),
        store=SimpleNamespace(kv=SimpleNamespace(touch=written.append)))))
    space = Namespace("n", 1000, 1000, 0o700, 0)
    n = 100_000
    for i in range(n):
        space.chunks[b"k%d" % i] = Chunk(ino=i, size=1, atime=0, sum_unit=1, sums=b"",
                                         tenant=1000)
    for i in range(n):
        assert index.lookup(space, b"k%d" % i) is not None
    for i in range(0, n, 7):  # looked up again before their write-back
        index.lookup(space, b"k%d" % i)
    first = index.flush()
    assert len(written[0]) == TOUCH_BITE and first == TOUCH_BITE
    assert [key for _, _, key in written[0]] == [b"k%d" % i for i in range(TOUCH_BITE)]
    while index.flush():
        assert len(written[-1]) <= TOUCH_BITE
    rows = [row for batch in written for row in batch]
    assert len(rows) == n and len({key for _, _, key in rows}) == n
    assert all(atime == space.chunks[key].atime for atime, _, key in rows)
    assert index.flush() == 0 and len(written) == -(-n // TOUCH_BITE)

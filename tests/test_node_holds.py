"""What the writer counts of files other nodes hold open (mxfs.vol.node_holds): an
orphan is freed only once every live node said its holds past the feed row that
unlinked it, and never while one holds it."""

from __future__ import annotations

import pytest

from mxfs.vol import node_holds
from mxfs.vol.node_holds import NodeHolds


def test_an_orphan_waits_for_every_live_nodes_word_past_its_row() -> None:
    h = NodeHolds()
    h.heard("b", 1, 10)
    h.wait([5, 6], 12, now=0.0)
    assert h.ready({"b": 1, "c": 3}) == ([], [])  # (b's word is behind; c said nothing)
    h.heard("b", 1, 12)
    h.heard("c", 2, 99)  # (another epoch's word counts for nothing)
    assert h.ready({"b": 1, "c": 3}) == ([], [])
    h.heard("c", 3, 12)
    h.hold("c", 3, 6)  # (c had 6 open: held, not freed; its last close frees it)
    assert h.ready({"b": 1, "c": 3}) == ([5], [6])
    assert h.waiting == 0 and 6 in h
    assert h.let_go("c", 3, 6) and 6 not in h


def test_with_no_live_node_nothing_waits() -> None:
    h = NodeHolds()
    h.wait([7], 40, now=0.0)
    assert h.ready({}) == ([7], [])


def test_a_file_two_nodes_hold_is_free_after_both_let_go() -> None:
    h = NodeHolds()
    h.hold("b", 1, 9)
    h.hold("c", 1, 9)
    h.hold("b", 1, 9)  # (told twice: held once)
    assert not h.let_go("b", 1, 9)
    assert not h.let_go("b", 1, 9)  # (not held by b any more)
    assert not h.let_go("c", 2, 9)  # (another epoch's let-go)
    assert h.let_go("c", 1, 9)


def test_a_node_that_joined_again_or_died_holds_nothing_of_before() -> None:
    h = NodeHolds()
    h.hold("b", 1, 3)
    h.hold("b", 1, 4)
    h.hold("c", 1, 4)
    assert h.hold("b", 2, 5) == [3]  # (b's epoch 1 holds went: 4 is c's still)
    assert 4 in h and 5 in h
    assert h.drop("c") == [4]
    assert h.nodes() == {"b": 2}


def test_a_stall_names_the_nodes_behind() -> None:
    h = NodeHolds()
    h.heard("b", 1, 50)
    h.wait([1], 40, now=0.0)
    h.wait([2], 60, now=0.0)
    assert h.behind({"b": 1, "c": 1}, now=1.0) == []
    assert h.behind({"b": 1, "c": 1}, now=node_holds.STALL_S + 1) == ["c"]


def test_a_node_holds_a_bounded_number_and_its_word_is_still_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_holds, "MAX_HOLDS", 2)
    h = NodeHolds()
    h.hold("b", 1, 1)
    h.hold("b", 1, 2)
    assert h.hold("b", 1, 3) == [] and 3 not in h  # (past the bound: not kept, no error
    assert "b" in h.over  # that would leave the rest of the word untaken for good)
    assert h.let_go("b", 1, 1) and h.hold("b", 1, 3) == [] and 3 in h


def test_a_whole_word_in_parts_lets_go_only_what_no_part_named() -> None:
    h = NodeHolds()
    for ino in (1, 2, 3, 50):
        h.hold("b", 1, ino)
    h.hold("c", 1, 50)
    assert h.whole("b", 1, 0, [1, 2], last=False) == []
    assert 3 in h and 50 in h  # (nothing let go before the last part)
    assert h.whole("b", 1, 1, [4], last=False) == [] and 4 in h  # (taken at once)
    assert sorted(h.whole("b", 1, 2, [9], last=True) or []) == [3]  # (50: c holds it)
    assert all(i in h for i in (1, 2, 4, 9, 50)) and 3 not in h
    # A part out of order (one lost): nothing let go, the node is told to say all again.
    assert h.whole("b", 1, 0, [1], last=False) == []
    assert h.whole("b", 1, 2, [2], last=True) is None
    assert all(i in h for i in (1, 2, 4, 9))
    assert h.whole("b", 1, 1, [2], last=True) is None  # (the gathering was given up)
    assert h.whole("b", 1, 0, [1, 2, 4, 9], last=True) == []  # (one part: whole at once)
    # b joined again (epoch 2) holding nothing: its whole word lets epoch 1's all go.
    assert sorted(h.whole("b", 2, 0, [], last=True) or []) == [1, 2, 4, 9]
    assert not any(i in h for i in (1, 2, 4, 9))


def test_words_are_taken_once_and_a_dropped_node_is_known_no_more() -> None:
    h = NodeHolds()
    assert h.fresh("b", 1, 1) and not h.knows("b", 1)
    h.took("b", 1, 1)
    assert h.knows("b", 1) and not h.fresh("b", 1, 1) and h.fresh("b", 1, 2)
    assert h.fresh("b", 2, 1) and not h.knows("b", 2)  # (a new epoch starts anew)
    h.hold("b", 1, 8)
    assert h.drop("b", 1) == [8]
    assert not h.knows("b", 1)  # (its next word that is not whole is told: again)

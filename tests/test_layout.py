"""Stripe math as properties: every byte has exactly one home, and back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mxfs.io import Layout

UNITS = st.sampled_from([4096, 8192, 65536, 1 << 20])


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    members = draw(st.integers(1, 8))
    width = draw(st.integers(1, members))
    first = draw(st.integers(0, members - 1))
    return Layout(draw(UNITS), width, first, members)


@given(layouts(), st.integers(0, 1 << 40))
def test_locate_and_back(lay: Layout, offset: int) -> None:
    member, chunk_off = lay.locate(offset)
    assert lay.slot(member) is not None
    assert lay.file_offset(member, chunk_off) == offset


@given(layouts(), st.integers(0, 1 << 30), st.integers(0, 1 << 22))
def test_plan_covers_each_byte_once(lay: Layout, offset: int, length: int) -> None:
    pieces = lay.plan(offset, length)
    covered = sorted((o, n) for p in pieces for o, n in p.spans)
    pos = 0
    for o, n in covered:
        assert o == pos and n > 0
        pos += n
    assert pos == length
    assert len({p.member for p in pieces}) == len(pieces)
    for p in pieces:
        # each piece is one contiguous range of its chunk file, in buffer order
        chunk = p.chunk_offset
        for o, n in p.spans:
            assert lay.locate(offset + o) == (p.member, chunk)
            assert lay.locate(offset + o + n - 1) == (p.member, chunk + n - 1)
            chunk += n


@given(layouts(), st.integers(0, 40))
def test_chunk_length_is_the_highest_byte_held(lay: Layout, stripes: int) -> None:
    size = stripes * lay.unit // 3 + stripes
    expected = {m: 0 for m in range(lay.members)}
    for pos in range(0, size, 997):
        m, c = lay.locate(pos)
        expected[m] = max(expected[m], c + 1)
    if size:
        m, c = lay.locate(size - 1)
        expected[m] = max(expected[m], c + 1)
    for m in range(lay.members):
        got = lay.chunk_length(m, size)
        assert got >= expected[m]
        if got:
            # the last byte it claims really maps into the file
            assert lay.file_offset(m, got - 1) < size


def test_small_files_sit_on_one_member() -> None:
    lay = Layout(1 << 20, 4, 2, 4)
    assert {p.member for p in lay.plan(0, 1000)} == {2}


def test_invalid_layouts_are_refused() -> None:
    import pytest

    for args in [(1000, 1, 0, 1), (4096, 0, 0, 2), (4096, 3, 0, 2), (4096, 1, 2, 2)]:
        with pytest.raises(ValueError):
            Layout(*args)

"""Safetensors headers, valid and broken, and the property every one must meet: for
`tests/test_header_fuzz.py` (a few thousand cases) and `tools/fuzz_header.py` (as many
as you let it run).

Here, not in mxfs/: hypothesis is a test dependency, not a runtime one.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from mxfs.load.header import DTYPE_BITS, HeaderError, header_length, parse_header

_INTS = st.one_of(st.integers(-3, 70), st.integers(-(2**64), 2**64), st.just(2**80),
                  st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none())


@st.composite
def tensor_entry(draw: st.DrawFn) -> object:
    if draw(st.integers(0, 20)) == 0:
        return draw(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(_INTS)))
    entry: dict[str, object] = {}
    if draw(st.integers(0, 15)):
        entry["dtype"] = draw(st.one_of(st.sampled_from(sorted(DTYPE_BITS)), st.text(max_size=6),
                                        st.integers()))
    if draw(st.integers(0, 15)):
        entry["shape"] = draw(st.one_of(st.lists(st.integers(0, 9), max_size=4),
                                        st.lists(_INTS, max_size=4), _INTS))
    if draw(st.integers(0, 15)):
        entry["data_offsets"] = draw(st.one_of(
            st.lists(st.integers(0, 400), min_size=2, max_size=2).map(sorted),
            st.lists(_INTS, max_size=3), _INTS))
    return entry


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """(JSON header bytes, size of the data section after it)."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        raw = draw(st.binary(max_size=200))
    elif kind == 1:
        raw = b"[" * draw(st.integers(1, 3000)) + b"]"
    else:
        doc: dict[str, object] = {name: draw(tensor_entry()) for name in
                                  draw(st.lists(st.text(max_size=8), max_size=6, unique=True))}
        if draw(st.integers(0, 5)) == 0:
            doc["__metadata__"] = draw(st.one_of(
                st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
                st.dictionaries(st.text(max_size=4), _INTS, max_size=2), _INTS))
        raw = json.dumps(doc, default=str).encode()
        if draw(st.integers(0, 10)) == 0 and raw:
            cut = draw(st.integers(0, len(raw) - 1))
            raw = raw[:cut]
    return raw, draw(st.integers(0, 500))


def check_one(raw: bytes, data_size: int) -> None:
    """Either a header whose every tensor lies inside the data, or one HeaderError."""
    file_size = 8 + len(raw) + data_size
    prefix = len(raw).to_bytes(8, "little")
    try:
        n = header_length("f", prefix, file_size)
        h = parse_header("f", raw[:n], file_size)
    except HeaderError as e:
        assert str(e).startswith("f: ")
        return
    spans = sorted((t.begin, t.end) for t in h.tensors.values() if t.nbytes)
    for t in h.tensors.values():
        assert h.data_start <= t.begin <= t.end <= file_size
    for (_, end), (begin, _) in zip(spans, spans[1:], strict=False):
        assert begin >= end

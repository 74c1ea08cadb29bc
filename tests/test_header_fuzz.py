"""The safetensors header parser never crashes and never lets a bad range through.

A few thousand cases here; `tools/fuzz_header.py` runs the same property 100,000+ times.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from strategies import headers

from mxfs.load.header import HeaderError, header_length, parse_header


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


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(headers())
def test_parser_never_crashes(case: tuple[bytes, int]) -> None:
    check_one(*case)

#!/usr/bin/env python3
"""Fuzz the safetensors header parser: N cases of the property in tools/header_cases.py.

Two generators: hypothesis' broken headers (tools/header_cases.py), and typed-field
mutations of valid headers (lists, objects, booleans, floats, huge and negative
numbers where strings and ints belong; offsets that overlap, run out of range or
do not match dtype x shape).  Either way only HeaderError may come out.

    python tools/fuzz_header.py --cases 100000 --typed 100000
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time

from header_cases import check_one, headers
from hypothesis import HealthCheck, given, settings

from mxfs.load.header import DTYPE_BITS, MAX_DIM, HeaderError, parse_header

# Values of the wrong type or size for any field of a header.
JUNK: list[object] = [
    [], [1], ["F32"], [[1, 2]], [[[[]]]], {}, {"a": 1}, {"dtype": "F32"}, True, False, None,
    0.0, 1.5, -1.0, float("inf"), float("-inf"), float("nan"), 1e300, 2**70, -(2**70),
    2**63, 2**64 - 1, -1, 0, "", "F32", "1", "\u00e9", [2**70], [0, 2**70], [True, 4],
    [1.0, 4.0], [-1, 3], ["0", "4"], [None, None], [0, 4, 8], {"0": 4},
]


def _junk(rng: random.Random) -> object:
    return copy.deepcopy(rng.choice(JUNK))  # a copy: mutations edit values in place


_WHOLE = sorted(d for d, bits in DTYPE_BITS.items() if bits % 8 == 0)


def valid_doc(rng: random.Random) -> tuple[dict[str, object], int]:
    """A correct header of 1-4 tensors laid end to end, and its data size."""
    doc: dict[str, object] = {}
    at = 0
    for i in range(rng.randint(1, 4)):
        dtype = rng.choice(_WHOLE)
        shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
        size = DTYPE_BITS[dtype] // 8
        for d in shape:
            size *= d
        doc[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    if rng.random() < 0.3:
        doc["__metadata__"] = {"format": "pt"}
    return doc, at


def _mutate(rng: random.Random, doc: dict[str, object], data_size: int) -> None:
    """Change one field of `doc` in place into something a parser must refuse or survive."""
    names = [n for n in doc if n != "__metadata__"]
    name = rng.choice(names)
    entry = doc[name]
    if not isinstance(entry, dict):
        doc[name] = _junk(rng)
        return
    kind = rng.randrange(13)
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if kind == 0:
        entry["dtype"] = _junk(rng)
    elif kind == 1:
        entry["shape"] = _junk(rng)
    elif kind == 2 and isinstance(shape, list):
        shape.insert(rng.randint(0, len(shape)), _junk(rng))
    elif kind == 3 and isinstance(shape, list):
        shape[:] = [0, rng.choice([2**70, 2**63, 2**64, 2**62 * 3])] + shape  # zero-sized
    elif kind == 4:
        entry["data_offsets"] = _junk(rng)
    elif kind == 5 and isinstance(offsets, list) and offsets:
        offsets[rng.randrange(len(offsets))] = _junk(rng)
    elif kind == 6 and isinstance(offsets, list) and len(offsets) == 2:
        i = rng.randrange(2)
        if type(offsets[i]) is int:
            offsets[i] += rng.choice([-1, 1, -(2**70), 2**70, data_size + 1])
    elif kind == 7 and isinstance(offsets, list) and len(offsets) == 2:
        other = doc[rng.choice(names)]
        if isinstance(other, dict) and isinstance(other.get("data_offsets"), list):
            entry["data_offsets"] = list(other["data_offsets"])  # overlaps or duplicates
    elif kind == 8:
        doc["__metadata__"] = rng.choice([_junk(rng), {"k": _junk(rng)}])
    elif kind == 9:
        entry[rng.choice(["dtype", "shape", "data_offsets", "extra"])] = {
            "nested": [_junk(rng), {"deeper": _junk(rng)}]}
    elif kind == 10:
        entry.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    elif kind == 11:
        doc[name] = _junk(rng)
    else:
        entry["dtype"] = rng.choice(sorted(DTYPE_BITS))  # a size that may no longer match


def typed_case(rng: random.Random) -> tuple[bytes, int]:
    """(JSON header bytes, data size): a valid header with one to three fields broken."""
    doc, data_size = valid_doc(rng)
    for _ in range(rng.randint(1, 3)):
        _mutate(rng, doc, data_size)
    return json.dumps(doc).encode(), data_size + rng.choice([0, 0, 0, 1, 7])


def check_typed(raw: bytes, data_size: int) -> None:
    """check_one, and an accepted header's shapes fit int64 (a zero-sized shape too)."""
    check_one(raw, data_size)
    try:
        h = parse_header("f", raw, 8 + len(raw) + data_size)
    except HeaderError:
        return
    for t in h.tensors.values():
        assert isinstance(t.dtype, str) and all(0 <= d <= MAX_DIM for d in t.shape), t


def run_typed(cases: int, seed: int = 0) -> int:
    """Check `cases` typed mutations (deterministic for a seed); returns how many ran."""
    rng = random.Random(seed)
    for _ in range(cases):
        check_typed(*typed_case(rng))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="hypothesis cases")
    ap.add_argument("--typed", type=int, default=100_000, help="typed-field mutations")
    ap.add_argument("--seed", type=int, default=0, help="seed of the typed mutations")
    args = ap.parse_args()
    count = 0

    @settings(max_examples=args.cases, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(headers())
    def run(case: tuple[bytes, int]) -> None:
        nonlocal count
        count += 1
        check_one(*case)

    start = time.perf_counter()
    if args.cases:
        run()
    count += run_typed(args.typed, args.seed)
    print(f"fuzz_header: {count} cases, no crash, no out-of-range tensor "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Fuzz the safetensors header parser: N cases of the property in tests/test_header_fuzz.py.

    python tools/fuzz_header.py --cases 100000
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from strategies import headers  # noqa: E402
from test_header_fuzz import check_one  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
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
    run()
    print(f"fuzz_header: {count} cases, no crash, no out-of-range tensor "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

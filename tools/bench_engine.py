#!/usr/bin/env python3
"""Compare the two I/O engines on the direct read path, side by side in one run.

Writes one file into a fresh 4-member pool, then reads it whole with
DirectFile.read_into into a touched, aligned buffer, cold and warm, with the thread
pool and with the io_uring engine (when built), each with buffered reads only
(odirect "never") and with O_DIRECT for uncached pieces ("auto", the default),
alternating, medians of --repeat.

    python tools/bench_engine.py --size 1GiB --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

from mxfs.cli.demo import run_mxfs
from mxfs.cli.measure import drop_caches, write_file
from mxfs.cli.scratch import scratch_dir
from mxfs.client.direct import DirectFile, aligned_like, open_reader
from mxfs.io import batch
from mxfs.units import parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    native, why = batch.native_engine()
    engines = {"threads": None, **({"io_uring": native} if native else {})}
    if not native:
        print(f"io_uring engine unavailable: {why}", file=sys.stderr)
    base = scratch_dir("mxfs-bench-engine-", args.dir)
    members = [os.path.join(base, f"member{i}") for i in range(4)]
    mnt = os.path.join(base, "mnt")
    for p in [*members, mnt]:
        os.makedirs(p)
    run_mxfs("mkfs", *[a for m in members for a in ("--member", m)])
    run_mxfs("mount", members[0], mnt)
    arms = [(e, policy) for e in engines for policy in ("never", "auto")]
    results: dict[str, dict[str, list[float]]] = {
        f"{e}, odirect {p}": {"cold": [], "warm": []} for e, p in arms}
    try:
        path = os.path.join(mnt, "data")
        write_file(path, parse_size(args.size), memoryview(os.urandom(8 << 20)))
        reader = open_reader(path)
        assert isinstance(reader, DirectFile)
        buf = aligned_like(reader.size, 0)
        reader.read_into(0, buf)  # touch the buffer outside the clock
        for _ in range(args.repeat):
            for engine, policy in arms:
                batch._native = engines[engine]
                reader.odirect = policy
                name = f"{engine}, odirect {policy}"
                for kind in ("cold", "warm"):
                    if kind == "cold":
                        drop_caches()
                    start = time.perf_counter()
                    reader.read_into(0, buf)
                    results[name][kind].append(reader.size / (time.perf_counter() - start) / 1e9)
        reader.close()
    finally:
        run_mxfs("umount", mnt)
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nDirectFile.read_into of {args.size}, GB/s, median (min-max) of {args.repeat}\n")
    print("| engine | cold | warm |\n|---|---:|---:|")
    for name, r in results.items():
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
                 for v in (r["cold"], r["warm"])]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark the mount against a plain folder on the same disk, side by side in one run.

The same bytes each way: a sequential write and read of one large file through
the mount, into a plain folder, and straight from the pool's chunk files (the
raw ceiling of the members); cold (caches dropped, needs root) and warm; then
creates, stats and unlinks per second.  Repeats and reports medians and the
ratio mxfs / plain for each step, with the targets of issue 2.

    python tools/bench_fs.py --size 2GiB --repeat 3 --json bench.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from mxfs.cli.demo import bench_args, save_results, scratch_pool
from mxfs.cli.measure import drop_caches, read_file, write_file
from mxfs.units import parse_size

TARGETS = {"write": 0.40, "read_cold": 0.50, "read_warm": 0.80, "create": 0.20,
           "stat": 0.20, "unlink": 0.20}
BLOCK = 8 << 20


def read_chunks_raw(paths: list[str], bufs: list[bytearray]) -> float:
    """Read every chunk file of the file in parallel, one thread per member."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as ex:
        list(ex.map(read_file, paths, bufs))
    return time.perf_counter() - start


def metadata_rates(folder: str, n: int) -> dict[str, float]:
    d = os.path.join(folder, "meta")
    os.mkdir(d)
    names = [os.path.join(d, f"f{i:06d}") for i in range(n)]
    rates = {}
    t = time.perf_counter()
    for p in names:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    rates["create"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for p in names:
        os.stat(p)
    rates["stat"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for p in names:
        os.unlink(p)
    rates["unlink"] = n / (time.perf_counter() - t)
    os.rmdir(d)
    return rates


def one_round(mnt: str, plain: str, members: list[str], size: int, files: int,
              block: memoryview, buf: bytearray, chunk_bufs: list[bytearray]) -> dict:
    r: dict[str, dict[str, float]] = {}
    gbps = lambda s: size / s / 1e9  # noqa: E731
    t_m, d_m = write_file(os.path.join(mnt, "big"), size, block)
    t_p, d_p = write_file(os.path.join(plain, "big"), size, block)
    assert d_m == d_p
    r["write"] = {"mxfs": gbps(t_m), "plain": gbps(t_p)}
    ino = os.stat(os.path.join(mnt, "big")).st_ino
    chunks = [os.path.join(m, "chunks", f"{ino % 256:02x}", str(ino)) for m in members]
    cold = drop_caches()
    t_m, d, _ = read_file(os.path.join(mnt, "big"), buf)
    assert d == d_p
    drop_caches()
    t_p, _, _ = read_file(os.path.join(plain, "big"), buf)
    drop_caches()
    t_raw = read_chunks_raw(chunks, chunk_bufs)
    r["read_cold" if cold else "read_first"] = {"mxfs": gbps(t_m), "plain": gbps(t_p),
                                                "raw_chunks": gbps(t_raw)}
    for side in (mnt, plain):  # bring both wholly into the page cache first
        read_file(os.path.join(side, "big"), buf)
    t_m, _, _ = read_file(os.path.join(mnt, "big"), buf)
    t_p, _, _ = read_file(os.path.join(plain, "big"), buf)
    r["read_warm"] = {"mxfs": gbps(t_m), "plain": gbps(t_p)}
    m_rates, p_rates = metadata_rates(mnt, files), metadata_rates(plain, files)
    for k in m_rates:
        r[k] = {"mxfs": m_rates[k], "plain": p_rates[k]}
    os.unlink(os.path.join(mnt, "big"))
    os.unlink(os.path.join(plain, "big"))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--files", type=int, default=5000, help="files for the metadata steps")
    ap.add_argument("--stripe-unit", default="1MiB")
    ap.add_argument("-o", dest="options", default="", help="mount options to test")
    bench_args(ap)
    args = ap.parse_args()
    size = parse_size(args.size)
    with scratch_pool("mxfs-bench-", args.dir, mkfs=("--stripe-unit", args.stripe_unit),
                      mount=["-o", args.options] if args.options else []) as pool:
        members, mnt, plain = pool.members, pool.mnt, pool.plain
        block = memoryview(bytearray(os.urandom(BLOCK)))
        buf = bytearray(BLOCK)
        chunk_bufs = [bytearray(BLOCK) for _ in members]
        rounds = []
        for i in range(args.repeat):
            rounds.append(one_round(mnt, plain, members, size, args.files, block, buf,
                                    chunk_bufs))
            print(f"round {i + 1}/{args.repeat} done", file=sys.stderr)
    summary = {}
    for step in rounds[0]:
        summary[step] = {k: statistics.median(r[step][k] for r in rounds) for k in rounds[0][step]}
        summary[step]["ratio"] = statistics.median(r[step]["mxfs"] / r[step]["plain"]
                                                   for r in rounds)
    unit = lambda s: "GB/s" if s.startswith(("read", "write")) else "ops/s"  # noqa: E731
    print(f"\nmxfs vs plain folder, {args.size} file, 4 folder members on one disk, "
          f"median of {args.repeat}\n")
    print("| step | mxfs | plain | raw chunks | mxfs/plain | target | met |")
    print("|---|---:|---:|---:|---:|---:|:---:|")
    for step, v in summary.items():
        target = TARGETS.get(step)
        raw = f"{v['raw_chunks']:.2f}" if "raw_chunks" in v else ""
        fmt = ".2f" if unit(step) == "GB/s" else ".0f"
        met = "" if target is None else ("yes" if v["ratio"] >= target else "no")
        print(f"| {step} ({unit(step)}) | {v['mxfs']:{fmt}} | {v['plain']:{fmt}} | {raw} | "
              f"{v['ratio']:.0%} | {'' if target is None else f'{target:.0%}'} | {met} |")
    save_results(args, rounds=rounds, median=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

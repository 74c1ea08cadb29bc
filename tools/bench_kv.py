#!/usr/bin/env python3
"""KV spill benchmark: KVStore against raw member I/O and a file-per-chunk store.

For chunks of 2, 16 and 64 MiB (64 MiB is 256 tokens of a Qwen2.5-32B-like model),
the same bytes each way, in one run:
  raw      parallel O_DIRECT writes and reads of each chunk's share on every member
           (the ceiling; reads are cold by nature)
  kv       KVStore put and get (into caller buffers), one at a time and batched,
           gets cold (caches dropped), from 1 process and from 4
  files    a plain directory, one file per chunk (LMCache local-disk style), cold reads
Then small-chunk operations (4 KiB puts and gets, single and batched) and eviction
speed (deletes a second).  Medians of --repeat.

    python tools/bench_kv.py --total 1GiB --repeat 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from mxfs.cli.bench import raw_io
from mxfs.cli.demo import ScratchPool, bench_args, save_results, scratch_pool
from mxfs.cli.measure import drop_caches
from mxfs.kv import KVStore
from mxfs.units import parse_size

MIB = 1 << 20
SEGMENT = 16 * MIB

READER = r"""
import sys, time
from mxfs.kv import KVStore
mount, size, start_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
keys = sys.argv[4:]
kv = KVStore(mount, "bench")
bufs = [bytearray(size) for _ in range(4)]
while time.time() < start_at:
    time.sleep(0.001)
t = time.perf_counter()
for i in range(0, len(keys), 4):
    got = kv.batch_get(keys[i:i + 4], bufs[:len(keys[i:i + 4])])
    assert all(got), "miss"
print(time.perf_counter() - t)
"""


def aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)
    buf.write(bytes(n))  # touched once, outside the clock
    return buf


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def files_put(folder: str, count: int, data: bytes) -> None:
    for c in range(count):
        with open(os.path.join(folder, f"chunk-{c}"), "wb") as f:
            f.write(data)


def files_get(folder: str, count: int, buf: bytearray) -> None:
    for c in range(count):
        with open(os.path.join(folder, f"chunk-{c}"), "rb", buffering=0) as f:
            f.readinto(buf)


def multi_get(mnt: str, size: int, keys: list[str], procs: int) -> float:
    start_at = time.time() + 3.0  # after every process has imported
    ps = [subprocess.Popen([sys.executable, "-c", READER, mnt, str(size), str(start_at),
                            *keys[i::procs]], stdout=subprocess.PIPE, text=True)
          for i in range(procs)]
    times = []
    for p in ps:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        times.append(float(out))
    return max(times)


def chunk_round(kv: KVStore, members: list[str], mnt: str, plain: str, size: int, count: int,
                data: bytes, buf: mmap.mmap, outs: list[bytearray], r: int) -> dict[str, float]:
    """One round of every arm for one chunk size: GB/s each."""
    res: dict[str, float] = {}
    nbytes = size * count
    raws = [os.path.join(m, "raw.bin") for m in members]
    res["raw_write"] = nbytes / timed(lambda: raw_io(raws, nbytes, buf, True)) / 1e9
    drop_caches()
    res["raw_read"] = nbytes / timed(lambda: raw_io(raws, nbytes, buf, False)) / 1e9
    keys = [f"r{r}-{size}-{c}" for c in range(count)]
    res["kv_put"] = nbytes / timed(lambda: [kv.put(k, data) for k in keys]) / 1e9
    drop_caches()
    res["kv_get"] = nbytes / timed(lambda: [kv.get(k, out=outs[0]) for k in keys]) / 1e9
    bkeys = [f"b{r}-{size}-{c}" for c in range(count)]
    step = len(outs)
    groups = [bkeys[i:i + step] for i in range(0, count, step)]
    res["kv_batch_put"] = nbytes / timed(lambda: [kv.batch_put(g, [data] * len(g))
                                                  for g in groups]) / 1e9
    drop_caches()
    res["kv_batch_get"] = nbytes / timed(lambda: [kv.batch_get(g, outs[:len(g)])
                                                  for g in groups]) / 1e9
    drop_caches()
    res["kv_get_4proc"] = nbytes / multi_get(mnt, size, bkeys, 4) / 1e9
    res["files_put"] = nbytes / timed(lambda: files_put(plain, count, data)) / 1e9
    os.sync()
    drop_caches()
    res["files_get"] = nbytes / timed(lambda: files_get(plain, count, outs[0])) / 1e9
    kv._call("kv_evict", keep=0)  # free the space for the next round
    for n in os.listdir(plain):
        os.unlink(os.path.join(plain, n))
    return res


def small_round(kv: KVStore, r: int) -> dict[str, float]:
    """4 KiB chunks: operations a second, single and batched; then evictions a second."""
    small, n = os.urandom(4096), 2000
    keys = [f"s{r}-{i}" for i in range(n)]
    res = {"put": n / timed(lambda: [kv.put(k, small) for k in keys]),
           "get": n / timed(lambda: [kv.get(k) for k in keys])}
    groups = [[f"sb{r}-{i}" for i in range(b, b + 32)] for b in range(0, n, 32)]
    res["batch_put"] = n / timed(lambda: [kv.batch_put(g, [small] * len(g)) for g in groups])
    res["batch_get"] = n / timed(lambda: [kv.batch_get(g) for g in groups])
    many = [f"e{r}-{i}" for i in range(20000)]
    for i in range(0, len(many), 100):
        kv.batch_put(many[i:i + 100], [b"e"] * 100)
    before = kv.usage()["chunks"]
    secs = timed(lambda: kv._call("kv_evict", keep=0))
    res["evict"] = (before - kv.usage()["chunks"]) / secs
    time.sleep(5)  # let the daemon reclaim the evicted chunk files before the next round
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total", default="1GiB", help="bytes per chunk size and arm")
    ap.add_argument("--sizes", default="2MiB,16MiB,64MiB")
    bench_args(ap)
    args = ap.parse_args()
    with scratch_pool("mxfs-bench-kv-", args.dir) as pool:
        results = run(args, pool)
    report(args, results)
    return 0


def run(args: argparse.Namespace, pool: ScratchPool) -> dict[str, list[dict[str, float]]]:
    """Every arm for every chunk size, then small operations; --repeat rounds each."""
    members, mnt, plain = pool.members, pool.mnt, pool.plain
    total = parse_size(args.total)
    results: dict[str, list[dict[str, float]]] = {}
    kv = KVStore(mnt, "bench")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(4, total // size)
        data = os.urandom(size)
        buf = aligned(max(size, -(-size * count // len(members) // 4096) * 4096))
        buf[:size] = data
        outs = [bytearray(size) for _ in range(min(count, 8))]
        label = f"{size // MIB}MiB"
        rounds = results.setdefault(label, [])
        for r in range(args.repeat):
            res = chunk_round(kv, members, mnt, plain, size, count, data, buf, outs, r)
            rounds.append(res)
            print(f"{label} round {r + 1}: " + ", ".join(f"{k} {v:.2f}"
                                                           for k, v in res.items()),
                  file=sys.stderr)
    ops = results.setdefault("4KiB ops/s", [])
    for r in range(args.repeat):
        res = small_round(kv, r)
        ops.append(res)
        print(f"small ops round {r + 1}: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                       res.items()), file=sys.stderr)
    kv.close()
    return results


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for label, rs in results.items()}
    print("\nKV chunks, GB/s (small ops: per second), 4 folder members on one disk, "
          f"median of {args.repeat}\n")
    cols = list(next(iter(med.values())).keys())
    print("| chunk | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for label, m in med.items():
        if "ops" in label:
            continue
        print(f"| {label} | " + " | ".join(f"{m[c]:.2f}" for c in cols) + " |")
    ops_med = med["4KiB ops/s"]
    print("\n| 4 KiB chunks | per second |\n|---|---:|")
    for k, v in ops_med.items():
        print(f"| {k} | {v:.0f} |")
    print("\n| ratio | value | target | met |\n|---|---:|---:|:---:|")
    for label, rs in results.items():
        if "ops" in label:
            continue
        big = parse_size(label) >= 16 * MIB  # the 90% target is for 16 MiB and up
        for what, a, b, target in (("get / raw read", "kv_get", "raw_read", 0.9 if big else None),
                                   ("batch get / raw read", "kv_batch_get", "raw_read",
                                    0.9 if big else None),
                                   ("get / files get (cold)", "kv_get", "files_get", 2.0),
                                   ("batch get / files get", "kv_batch_get", "files_get", 2.0),
                                   ("4-process get / files get", "kv_get_4proc", "files_get",
                                    2.0),
                                   ("put / raw write", "kv_put", "raw_write", None)):
            v = statistics.median(r[a] / r[b] for r in rs)
            met = "" if target is None else ("yes" if v >= target else "no")
            print(f"| {label} {what} | {v:.2f} | {target or ''} | {met} |")
    for k in ("put", "get", "batch_put", "batch_get"):
        v = ops_med[k]
        print(f"| 4 KiB {k} ops/s | {v:.0f} | 2000 | {'yes' if v >= 2000 else 'no'} |")
    print(f"| evictions/s | {ops_med['evict']:.0f} | 10000 | "
          f"{'yes' if ops_med['evict'] >= 10000 else 'no'} |")
    save_results(args, rounds=results, median=med)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""KV spill benchmark: KVStore and mxfs's engine adapters against raw member I/O, a
file-per-chunk store, and the KV stores of SGLang, LMCache and vLLM.

For chunks of 2, 16 and 64 MiB (64 MiB is 256 tokens of a Qwen2.5-32B-like model),
the same chunks each way, in batches of --batch, in one run:
  raw      parallel O_DIRECT writes and reads of each chunk's share on every member
           (the ceiling; reads are cold by nature)
  kv       KVStore put and get (into caller buffers), one at a time and batched,
           gets cold (caches dropped), from 1 process and from 4
  files    a plain directory, one file per chunk (LMCache local-disk style), cold reads
  engines  (tools/peers_kv.py) through each engine's own interface, mxfs's adapter
           beside the engine's own store in a plain folder: SGLang's HiCacheFile,
           LMCache's fs L2 adapter and LocalDiskBackend, vLLM's fs offloading tier;
           put, put + sync (os.sync after the puts, timed), lookups, cold and warm gets
Then small-chunk operations (4 KiB puts and gets, single, single sent without waiting
(`put_nowait`, then `flush`) and batched) beside a file per
chunk in a plain folder and a round trip that does nothing, and eviction speed (deletes
a second).  Every chunk read is compared with what was stored (outside
the clock).  Medians of --repeat rounds; mxfs/peer ratios are medians of per-round
ratios of speeds (above 1, mxfs is ahead).  An engine that does not import is skipped
with the reason; the engines live in their own virtualenv:

    python tools/bench_kv.py --total 1GiB --repeat 3
    .venv-engines/bin/python tools/bench_kv.py --total 1GiB --repeat 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import peers_kv as peers
import torch
import xxhash
from rig import ceiling, make_rig

from mxfs.cli.bench import raw_io
from mxfs.cli.demo import ScratchPool, bench_args, save_results, scratch_pool
from mxfs.cli.measure import drop_caches
from mxfs.kv import KVStore
from mxfs.units import parse_size

MIB = 1 << 20
SEGMENT = 16 * MIB
LOOKUPS = 4096  # keys looked up per arm and size, in passes over its chunks

READER = r"""
import sys, time, xxhash
from mxfs.kv import KVStore
mount, size, start_at, batch = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
pairs = [a.split(":") for a in sys.argv[5:]]
kv = KVStore(mount, "bench")
bufs = [bytearray(size) for _ in range(batch)]
while time.time() < start_at:
    time.sleep(0.001)
took, bad = 0.0, 0
for i in range(0, len(pairs), batch):
    part = pairs[i:i + batch]
    t = time.perf_counter()
    got = kv.batch_get([k for k, _ in part], bufs[:len(part)])
    took += time.perf_counter() - t
    assert all(got), "miss"
    bad += sum(xxhash.xxh3_64_hexdigest(b) != d for b, (_, d) in zip(bufs, part))
print(took, bad)
"""

Items = Sequence[Any]


def aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)
    buf.write(bytes(n))  # touched once, outside the clock
    return buf


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def calls(items: Items, call: Callable[[Any], object], after: Callable[[Any, Any], None]
          ) -> float:
    """Seconds of `call(item)` summed over the items; `after(item, result)` (the check)
    runs between them, outside the clock."""
    took = 0.0
    for item in items:
        start = time.perf_counter()
        out = call(item)
        took += time.perf_counter() - start
        after(item, out)
    return took


class Mismatch(Exception):
    pass


def contents(size: int, batch: int) -> list[torch.Tensor]:
    """batch + 1 distinct chunk contents (chunk c holds number c % (batch + 1)), so no
    two chunks of a batch, nor of neighbouring batches, hold the same bytes."""
    base = torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(size))
    return [base + v for v in range(batch + 1)]


def same(buf: Any, want: torch.Tensor, what: str) -> None:
    if not peers.holds(buf, want):
        raise Mismatch(f"{what} read back other bytes")


def files_put(folder: str, chunks: list[torch.Tensor]) -> None:
    for c, data in enumerate(chunks):
        with open(os.path.join(folder, f"chunk-{c}"), "wb") as f:
            f.write(data.numpy().data)


def files_get(folder: str, chunks: list[torch.Tensor], buf: bytearray) -> float:
    def read(c: int) -> None:
        with open(os.path.join(folder, f"chunk-{c}"), "rb", buffering=0) as f:
            f.readinto(buf)

    return calls(range(len(chunks)), read, lambda c, _: same(buf, chunks[c], f"file {c}"))


def multi_get(mnt: str, size: int, keys: list[str], digests: list[str], procs: int,
              batch: int) -> float:
    start_at = time.time() + 3.0  # after every process has imported
    pairs = [f"{k}:{d}" for k, d in zip(keys, digests, strict=True)]
    ps = [subprocess.Popen([sys.executable, "-c", READER, mnt, str(size), str(start_at),
                            str(batch), *pairs[i::procs]],
                           stdout=subprocess.PIPE, text=True)
          for i in range(procs)]
    times = []
    for p in ps:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, "a reader failed"
        took, bad = out.split()
        if int(bad):
            raise Mismatch(f"a reader got {bad} chunks of other bytes")
        times.append(float(took))
    return max(times)


def chunk_round(kv: KVStore, pool: ScratchPool, size: int, count: int, batch: int,
                variants: list[torch.Tensor], buf: mmap.mmap, outs: list[bytearray],
                r: int) -> dict[str, float]:
    """One round of the KVStore and baseline arms for one chunk size: GB/s each."""
    res: dict[str, float] = {}
    nbytes = size * count
    chunks = [variants[c % len(variants)] for c in range(count)]
    raws = [os.path.join(m, "raw.bin") for m in pool.members]
    share = -(-nbytes // len(raws) // 4096) * 4096
    digest = xxhash.xxh3_64_hexdigest(memoryview(buf)[:share])
    res["raw_write"] = nbytes / timed(lambda: raw_io(raws, nbytes, buf, True)) / 1e9
    buf[:share] = bytes(share)
    drop_caches()
    res["raw_read"] = nbytes / timed(lambda: raw_io(raws, nbytes, buf, False)) / 1e9
    if xxhash.xxh3_64_hexdigest(memoryview(buf)[:share]) != digest:
        raise Mismatch("raw read back other bytes")
    keys = [f"r{r}-{size}-{c}" for c in range(count)]
    res["kv_put"] = nbytes / timed(lambda: [kv.put(keys[c], chunks[c]) for c in range(count)]) / 1e9
    drop_caches()

    def got_one(c: int, ok: object) -> None:
        assert ok, f"kv get: chunk {c} missing"
        same(outs[0], chunks[c], f"kv get {c}")

    res["kv_get"] = nbytes / calls(range(count), lambda c: kv.get(keys[c], out=outs[0]),
                                   got_one) / 1e9
    bkeys = [f"b{r}-{size}-{c}" for c in range(count)]
    groups = [list(range(i, min(i + batch, count))) for i in range(0, count, batch)]
    res["kv_batch_put"] = nbytes / timed(lambda: [
        kv.batch_put([bkeys[c] for c in g], [chunks[c] for c in g]) for g in groups]) / 1e9
    drop_caches()

    def got_batch(g: list[int], oks: list[object]) -> None:
        assert all(oks), "kv batch get: a chunk missing"
        for j, c in enumerate(g):
            same(outs[j], chunks[c], f"kv batch get {c}")

    res["kv_batch_get"] = nbytes / calls(groups, lambda g: kv.batch_get(
        [bkeys[c] for c in g], outs[:len(g)]), got_batch) / 1e9
    drop_caches()
    digests = [xxhash.xxh3_64_hexdigest(t.numpy().data) for t in chunks]
    res["kv_get_4proc"] = nbytes / multi_get(pool.mnt, size, bkeys, digests, 4, 4) / 1e9
    res["files_put"] = nbytes / timed(lambda: files_put(pool.plain, chunks)) / 1e9
    os.sync()
    drop_caches()
    res["files_get"] = nbytes / files_get(pool.plain, chunks, outs[0]) / 1e9
    kv.clear()  # free the space for the next round
    for n in os.listdir(pool.plain):
        os.unlink(os.path.join(pool.plain, n))
    return res


def engine_round(arm: peers.Arm, ctx: peers.Ctx) -> dict[str, float | None]:
    """One arm of one engine on one chunk size: GB/s (lookups: keys a second)."""
    nbytes = ctx.size * ctx.count
    os.makedirs(ctx.folder, exist_ok=True)
    drv = arm.make(ctx)
    try:
        batches = ctx.batches()
        put = sum(drv.put(b) for b in batches)
        sync = timed(os.sync)
        drop_caches()
        # Engines ask for every request they schedule: enough passes over the keys that
        # a lookup's steady cost shows, not only the first call's.
        passes = -(-LOOKUPS // ctx.count)
        looks = [drv.exists(b) for _ in range(passes) for b in batches]
        drv.begin_get()
        drop_caches()
        cold = sum(drv.get(b) for b in batches)
        drv.begin_get()
        warm = sum(drv.get(b) for b in batches)
    finally:
        drv.close()
        peers.clean(arm, ctx)
    seen = [t for t in looks if t is not None]
    exists = ctx.count * passes / sum(seen) if len(seen) == len(looks) else None
    return {"put": nbytes / put / 1e9, "put_sync": nbytes / (put + sync) / 1e9,
            "lookups": exists, "get": nbytes / cold / 1e9, "get_warm": nbytes / warm / 1e9}


def small_round(kv: KVStore, folder: str, r: int, n: int) -> dict[str, float]:
    """4 KiB chunks: operations a second, single and batched; then evictions a second.
    Beside them, one round trip's floor (a request that does nothing: `kv_stats`) and
    the peer a user would pick, a file per chunk in a plain folder (created, written and
    closed; opened, read and closed): its creates are the file system's, as each
    mxfs chunk's are."""
    small = os.urandom(4096)
    keys = [f"s{r}-{i}" for i in range(n)]
    res = {"round_trip": n / timed(lambda: [kv.usage() for _ in keys])}
    res |= small_files(os.path.join(folder, f"small-{r}"), keys, small)
    res["put"] = n / timed(lambda: [kv.put(k, small) for k in keys])
    got: list[Any] = []

    def get_each() -> None:
        got.extend(kv.get(k) for k in keys)

    res["get"] = n / timed(get_each)
    if any(bytes(g) != small for g in got):
        raise Mismatch("4 KiB get read back other bytes")
    sent = [f"sn{r}-{i}" for i in range(n)]

    def put_nowait() -> None:
        for k in sent:
            kv.put_nowait(k, small)
        if kv.flush() != n:
            raise Mismatch("puts sent without waiting did not all store their chunk")

    res["put_nowait"] = n / timed(put_nowait)
    if any(g is None or bytes(g) != small for g in kv.batch_get(sent[:: max(1, n // 64)])):
        raise Mismatch("a 4 KiB chunk put without waiting read back other bytes")
    groups = [[f"sb{r}-{i}" for i in range(b, min(b + 32, n))] for b in range(0, n, 32)]
    res["batch_put"] = n / timed(lambda: [kv.batch_put(g, [small] * len(g)) for g in groups])
    got = []

    def get_batches() -> None:
        for g in groups:
            got.extend(kv.batch_get(g))

    res["batch_get"] = n / timed(get_batches)
    if any(g is None or bytes(g) != small for g in got):
        raise Mismatch("4 KiB batch get read back other bytes")
    many = [f"e{r}-{i}" for i in range(10 * n)]
    for i in range(0, len(many), 100):
        kv.batch_put(many[i:i + 100], [b"e"] * len(many[i:i + 100]))
    before = kv.usage()["chunks"]
    secs = timed(lambda: kv.clear())
    res["evict"] = (before - kv.usage()["chunks"]) / secs
    time.sleep(min(5.0, n / 400))  # let the daemon reclaim the evicted chunk files
    return res


def small_files(folder: str, keys: list[str], small: bytes) -> dict[str, float]:
    """A file per 4 KiB chunk: puts and gets a second (each read back compared)."""
    os.makedirs(folder)
    paths = [os.path.join(folder, k) for k in keys]

    def put(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, small)
        finally:
            os.close(fd)

    def get(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def put_all() -> None:
        for p in paths:
            put(p)

    res = {"files_put": len(paths) / timed(put_all)}
    got: list[bytes] = []
    res["files_get"] = len(paths) / timed(lambda: got.extend(get(p) for p in paths))
    if any(g != small for g in got):
        raise Mismatch("a 4 KiB file read back other bytes")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total", default="1GiB", help="bytes per chunk size and arm")
    ap.add_argument("--sizes", default="2MiB,16MiB,64MiB")
    ap.add_argument("--batch", type=int, default=8, help="chunks a batched call")
    ap.add_argument("--small", type=int, default=2000,
                    help="4 KiB operations a round (evictions: 10 times as many)")
    ap.add_argument("--engines", default="all",
                    help="engine arms: all, none, or keys (" + ",".join(
                        a.key for a in peers.ARMS) + ")")
    bench_args(ap)
    args = ap.parse_args()
    peers.quiet()
    size = parse_size(args.total)
    with make_rig(args.rig, args.dir, gib_each=max(8, 8 * -(-size // 2**30))) as rig, \
            scratch_pool("mxfs-bench-kv-", args.dir, members=rig.members, plain=rig.plain,
                         mkfs=["--stripe-unit", args.stripe_unit]) as pool:
        args.rig_ceiling = ceiling(rig, size, args.repeat)  # saved with the args
        print(f"rig: {rig.describe()}; raw O_DIRECT ceiling: one member "
              f"{args.rig_ceiling['member_alone_GBps']:.2f} GB/s, all at once "
              f"{args.rig_ceiling['all_members_GBps']:.2f} GB/s", file=sys.stderr)
        results = run(args, pool)
    return report(args, results)


def chosen_arms(args: argparse.Namespace) -> tuple[list[peers.Arm], dict[str, str]]:
    want = {a.key for a in peers.ARMS} if args.engines == "all" else (
        set() if args.engines == "none" else set(args.engines.split(",")))
    unknown = want - {a.key for a in peers.ARMS}
    if unknown:
        raise SystemExit(f"bench_kv: no engine arm {', '.join(sorted(unknown))}")
    arms, skipped = [], {}
    for arm in peers.ARMS:
        if arm.key not in want:
            continue
        why = arm.missing()
        if why:
            skipped[arm.key] = why
        else:
            arms.append(arm)
    return arms, skipped


def run(args: argparse.Namespace, pool: ScratchPool) -> dict[str, Any]:
    """Every arm for every chunk size, then small operations; --repeat rounds each."""
    total = parse_size(args.total)
    chunk_rounds: dict[str, list[dict[str, float]]] = {}
    engine_rounds: dict[str, dict[str, list[dict[str, float | None]]]] = {}
    failed: dict[str, str] = {}
    arms, skipped = chosen_arms(args)
    for key, why in skipped.items():
        print(f"bench_kv: {key} skipped: {why}", file=sys.stderr)
    kv = KVStore(pool.mnt, "bench")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(4, total // size)
        variants = contents(size, args.batch)
        buf = aligned(max(size, -(-size * count // len(pool.members) // 4096) * 4096))
        buf[:size] = variants[0].numpy().data
        outs = [bytearray(size) for _ in range(min(count, args.batch))]
        label = f"{size // MIB}MiB" if size >= MIB else f"{size // 1024}KiB"
        rounds = chunk_rounds.setdefault(label, [])
        by_arm = engine_rounds.setdefault(label, {})
        for r in range(args.repeat):
            try:
                res = chunk_round(kv, pool, size, count, args.batch, variants, buf, outs, r)
            except (Mismatch, AssertionError) as e:
                failed[f"kvstore {label}"] = str(e)
                print(f"bench_kv: kvstore {label}: {e}", file=sys.stderr)
                continue
            rounds.append(res)
            print(f"{label} round {r + 1}: " + ", ".join(f"{k} {v:.2f}"
                                                           for k, v in res.items()),
                  file=sys.stderr)
            order = arms[r % len(arms):] + arms[:r % len(arms)] if arms else []
            for arm in order:
                if f"{arm.key} {label}" in failed:
                    continue
                ctx = peers.Ctx(size, count, args.batch, variants, pool.mnt,
                                os.path.join(pool.plain, arm.key), f"bench-{arm.key}", r + 1)
                try:
                    got = engine_round(arm, ctx)
                except Exception as e:  # noqa: BLE001 - a failed arm is reported, not a crash
                    failed[f"{arm.key} {label}"] = f"{type(e).__name__}: {e}"
                    print(f"bench_kv: {arm.key} {label} failed:\n{traceback.format_exc()}",
                          file=sys.stderr)
                    continue
                by_arm.setdefault(arm.key, []).append(got)
                print(f"  {arm.key}: " + ", ".join(
                    f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in got.items()),
                    file=sys.stderr)
    ops: list[dict[str, float]] = []
    for r in range(args.repeat):
        try:
            res = small_round(kv, pool.plain, r, args.small)
        except Mismatch as e:
            failed["4KiB ops"] = str(e)
            break
        ops.append(res)
        print(f"small ops round {r + 1}: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                       res.items()), file=sys.stderr)
    kv.close()
    return {"chunks": chunk_rounds, "ops": ops, "engines": engine_rounds,
            "skipped": skipped, "failed": failed,
            "labels": {a.key: f"{a.engine} {a.label}" for a in peers.ARMS},
            "mxfs": {a.key: a.mxfs for a in peers.ARMS},
            "engine_of": {a.key: a.engine for a in peers.ARMS}}


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def report(args: argparse.Namespace, results: dict[str, Any]) -> int:
    chunks, ops, engines = results["chunks"], results["ops"], results["engines"]
    failed, skipped = results["failed"], results["skipped"]
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for label, rs in chunks.items() if rs}
    print(f"\nKV chunks, GB/s (small ops: per second), rig {args.rig}, stripe unit "
          f"{args.stripe_unit}, batches of {args.batch}, median of {args.repeat}\n")
    if med:
        cols = list(next(iter(med.values())).keys())
        print("| chunk | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for label, m in med.items():
            print(f"| {label} | " + " | ".join(f"{m[c]:.2f}" for c in cols) + " |")
    ops_med = {k: statistics.median(r[k] for r in ops) for k in ops[0]} if ops else {}
    if ops_med:
        print("\n| 4 KiB chunks | per second |\n|---|---:|")
        for k, v in ops_med.items():
            print(f"| {k} | {v:.0f} |")
    eng_med = {label: {arm: {k: median([r[k] for r in rs]) for k in rs[0]}
                       for arm, rs in by_arm.items()} for label, by_arm in engines.items()}
    labels, is_mxfs, engine_of = results["labels"], results["mxfs"], results["engine_of"]
    if any(eng_med.values()):
        print("\nengines, each through its own interface: GB/s (lookups: keys a second); "
              "put + sync: os.sync after the puts counted; gets cold and warm\n")
        print("| arm | chunk | put | put + sync | lookups/s | get cold | get warm "
              "| bytes equal |\n|---|---|---:|---:|---:|---:|---:|:---:|")
        for label, by_arm in eng_med.items():
            for arm, m in by_arm.items():
                print(f"| {arm}: {labels[arm]} | {label} | {fmt(m['put'])} | "
                      f"{fmt(m['put_sync'])} | {fmt(m['lookups'], 0)} | {fmt(m['get'])} | "
                      f"{fmt(m['get_warm'])} | {'NO' if f'{arm} {label}' in failed else 'yes'} |")
    ratios: dict[str, dict[str, float | None]] = {}
    rig = str(getattr(args, "rig", None) or "plain")
    get_target = 2.0 if rig.startswith("members") else 1.0
    rows: list[str] = []
    for label, by_arm in engines.items():
        for ours in [a for a in by_arm if is_mxfs[a]]:
            for peer in [a for a in by_arm if not is_mxfs[a] and engine_of[a] == engine_of[ours]]:
                a, b = by_arm[ours], by_arm[peer]
                n = min(len(a), len(b))
                got = {k: median([None if a[i][k] is None or b[i][k] is None
                                  else a[i][k] / b[i][k] for i in range(n)])
                       for k in a[0]}
                ratios[f"{ours}/{peer} {label}"] = got
                rows.append(f"| {engine_of[ours]} {label} | {ours} / {peer} | "
                            + " | ".join(fmt(got[k]) for k in
                                         ("put", "put_sync", "lookups", "get", "get_warm"))
                            + f" | {get_target} | "
                            + ("" if got["get"] is None else
                               "yes" if got["get"] >= get_target else "no") + " |")
    if rows:
        print("\n| engine, chunk | mxfs / peer (speed) | put | put + sync | lookups | get cold "
              "| get warm | get target | met |\n|---|---|---:|---:|---:|---:|---:|---:|:---:|")
        print("\n".join(rows))
    if skipped:
        print("\n| skipped | why |\n|---|---|")
        for k, why in skipped.items():
            print(f"| {k}: {labels[k]} | {why} |")
    print("\n| ratio | value | target | met |\n|---|---:|---:|:---:|")
    for label, rs in chunks.items():
        if not rs:
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
    for k, peer in (("put", "files_put"), ("get", "files_get")):
        if k in ops_med and peer in ops_med:
            v = statistics.median(r[k] / r[peer] for r in ops)
            print(f"| 4 KiB single {k} / a file per chunk | {v:.2f} | | |")
    for k in ("put", "put_nowait", "get", "batch_put", "batch_get"):
        if k in ops_med:
            v, want = ops_med[k], 5000 if k.startswith("put") else 2000
            print(f"| 4 KiB {k} ops/s | {v:.0f} | {want} | {'yes' if v >= want else 'no'} |")
    if "evict" in ops_med:
        print(f"| evictions/s | {ops_med['evict']:.0f} | 10000 | "
              f"{'yes' if ops_med['evict'] >= 10000 else 'no'} |")
    for k, why in failed.items():
        print(f"bench_kv: {k} FAILED: {why}", file=sys.stderr)
    save_results(args, rounds=chunks, median=med, ops=ops, ops_median=ops_med,
                 engines=engines, engines_median=eng_med, ratios=ratios, skipped=skipped,
                 failed=failed, labels=labels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

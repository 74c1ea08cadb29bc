#!/usr/bin/env python3
"""Benchmark the mount against a plain folder, side by side in one run, on a rig.

The same bytes each way, through the mount and into the rig's plain folder (on
`--rig plain` a folder on the same disk; on `--rig members:N:MBPS` one more drive
like each member):

  write        sequential 8 MiB writes of one large file, then fsync
  torch_save   torch.save of a state dict of bf16 weights, then fsync (what Hugging
               Face Trainer, Lightning and plain loops do to checkpoint)
  save_file    safetensors.save_file of the same state dict, then fsync
  read_cold    the large file read back after drop_caches (and the pool's chunk
               files read straight, one thread per member: the raw ceiling)
  read_warm    the same, from the page cache
  create, stat, rename, readdir, unlink   per second, on empty files in one folder
  small_read   small files (4 KiB) opened, read and closed, per second, caches dropped
               first (each close is a release the daemon answers, its chunk
               descriptors closed off its thread: `pool/closer.py`)
  small_reread the same files read so again, caches dropped again: files read before
               (a model's config and tokenizer files after the kernel forgot them;
               the daemon has counted their blocks: `fs/block_counts.py`)
  direct_commit  files made, written and published through the direct path
               (mxfs.client.writer.create_file ... commit) per second; the plain
               side is the same writer's temp file + rename

Beside them, the rig's raw ceilings: O_DIRECT reads, and buffered writes + fsync of
the same bytes, of each member alone and of all at once.  `--meta URL` puts the
pool's metadata on a PostgreSQL server (`mxfs mkfs --meta`), to compare the
engines.  `--steps` runs only some steps: `meta` the metadata ones (create ...
unlink, direct_commit and the small reads, without the rig's ceilings), `data` the
bandwidth ones, or step names (create, stat, rename, readdir and unlink run together,
as do write and the reads, torch_save and save_file, and the small reads).  Repeats
and reports medians, the ratio mxfs / plain, and the targets of issues 2 and 14.

    python tools/bench_fs.py --size 2GiB --repeat 3 --rig members:4:500 --json out.json
    python tools/bench_fs.py --steps meta --files 3000 --meta postgresql:///db?host=/run/pg
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_ckpt as peers  # noqa: E402
from rig import ceiling, make_rig, write_ceiling  # noqa: E402

from mxfs.cli.demo import bench_args, save_results, scratch_pool  # noqa: E402
from mxfs.cli.measure import drop_caches, read_file, write_file  # noqa: E402
from mxfs.client.writer import create_file  # noqa: E402
from mxfs.fs.block_counts import SETTLE_S  # noqa: E402
from mxfs.units import parse_size  # noqa: E402

# Targets as ratios to the plain folder (issue 2, raised by issue 14 item 4).
TARGETS = {"write": 0.80, "torch_save": 0.80, "save_file": 0.80, "read_cold": 0.80,
           "read_warm": 0.80, "create": 0.20, "stat": 0.20, "unlink": 0.20}
BLOCK = 8 << 20
BANDWIDTH = ("write", "torch_save", "save_file", "read_cold", "read_first", "read_warm")
# What --steps may name, and the parts of a round each needs (a part runs its steps
# together: the metadata rates work on the files create made).
PARTS = {"big": ("write", "read", "read_cold", "read_first", "read_warm"),
         "saves": ("torch_save", "save_file"),
         "names": ("create", "stat", "rename", "readdir", "unlink"),
         "direct": ("direct_commit",),
         "small": ("small_read", "small_reread")}
GROUPS = {"all": tuple(PARTS), "data": ("big", "saves"),
          "meta": ("names", "direct", "small")}


def parts_of(steps: str) -> set[str]:
    """The parts of a round `--steps` asks for (comma-separated groups and names)."""
    out: set[str] = set()
    for word in filter(None, (w.strip() for w in steps.split(","))):
        if word in GROUPS:
            out.update(GROUPS[word])
            continue
        part = next((p for p, names in PARTS.items() if word in names), None)
        if part is None:
            known = sorted({*GROUPS, *(n for names in PARTS.values() for n in names)})
            raise SystemExit(f"--steps: no step {word!r} (one of {', '.join(known)})")
        out.add(part)
    if not out:
        raise SystemExit("--steps: name at least one step")
    return out


def read_chunks_raw(paths: list[str], bufs: list[bytearray]) -> float:
    """Read every chunk file of the file in parallel, one thread per member."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as ex:
        list(ex.map(read_file, paths, bufs))
    return time.perf_counter() - start


def weights(total: int) -> dict[str, torch.Tensor]:
    """bf16 tensors of whole 4096-wide rows adding up to about `total` bytes."""
    g = torch.Generator().manual_seed(0)
    per = 4096 * 4096 * 2
    out, left, i = {}, total, 0
    while left > 0:
        rows = max(1, min(4096, left // (2 * 4096)))
        out[f"layers.{i}.weight"] = torch.randn(rows, 4096, generator=g).bfloat16()
        left -= min(per, rows * 4096 * 2)
        i += 1
    return out


def metadata_rates(folder: str, n: int) -> dict[str, float]:
    d = os.path.join(folder, "meta")
    os.mkdir(d)
    names = [os.path.join(d, f"f{i:06d}") for i in range(n)]
    moved = [p + ".r" for p in names]
    rates = {}

    def rate(step: str, fn: Any, paths: list[str], *more: list[str]) -> None:
        t = time.perf_counter()
        for args in zip(paths, *more, strict=True):
            fn(*args)
        rates[step] = n / (time.perf_counter() - t)

    rate("create", lambda p: os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)),
         names)
    rate("stat", os.stat, names)
    rate("rename", os.rename, names, moved)
    t = time.perf_counter()
    for _ in range(3):
        with os.scandir(d) as it:
            assert sum(1 for _ in it) == n
    rates["readdir"] = 3 * n / (time.perf_counter() - t)  # entries per second
    rate("unlink", os.unlink, moved)
    os.rmdir(d)
    return rates


def small_reads(folder: str, n: int) -> tuple[float, float]:
    """Files of 4 KiB opened, read and closed per second, their caches dropped first:
    read the first time, then again."""
    d = os.path.join(folder, "small")
    os.mkdir(d)
    names = [os.path.join(d, f"s{i:05d}") for i in range(n)]
    data = os.urandom(4096)
    for p in names:
        with open(p, "wb") as f:
            f.write(data)
    time.sleep(SETTLE_S)  # (files written a while ago, as a model's are: not just closed)
    rates = []
    for _ in range(2):
        drop_caches()
        t = time.perf_counter()
        for p in names:
            with open(p, "rb") as f:
                if f.read() != data:
                    raise SystemExit(f"{p} read back different")
        rates.append(n / (time.perf_counter() - t))
    for p in names:
        os.unlink(p)
    os.rmdir(d)
    return rates[0], rates[1]


def direct_commits(folder: str, n: int) -> float:
    """Files of 64 KiB made, written and published per second through create_file."""
    d = os.path.join(folder, "direct")
    os.mkdir(d)
    data = memoryview(bytearray(os.urandom(64 << 10)))
    t = time.perf_counter()
    for i in range(n):
        w = create_file(os.path.join(d, f"c{i:05d}"), size=len(data))
        with w:
            w.write_at(0, data)
            w.commit(len(data))
    rate = n / (time.perf_counter() - t)
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)
    return rate


def saves(mnt: str, plain: str, state: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """torch.save and save_file with fsync into each side; every copy checked."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, dict[str, float]] = {}
    for step, save, check in (("torch_save", peers.torch_save, peers.torch_check),
                              ("save_file", peers.safetensors_save, peers.safetensors_check)):
        out[step] = {}
        for side, folder in (("mxfs", mnt), ("plain", plain)):
            path = os.path.join(folder, f"{step}.bin")
            drop_caches()
            _, durable = save(state, path)
            bad = check(state, path)
            if bad:
                raise SystemExit(f"{step} into {side} read back different: {bad}")
            os.unlink(path)
            out[step][side] = nbytes / durable / 1e9
    return out


def one_round(pool: Any, size: int, files: int, block: memoryview, buf: bytearray,
              chunk_bufs: list[bytearray], state: dict[str, torch.Tensor],
              parts: set[str]) -> dict:
    r: dict[str, dict[str, float]] = {}
    written = write_big(pool, size, block, r) if "big" in parts else 0
    if "saves" in parts:
        r.update(saves(pool.mnt, pool.plain, state))
    if "big" in parts:
        read_big(pool, size, buf, chunk_bufs, written, r)
    if "names" in parts:
        m_rates, p_rates = metadata_rates(pool.mnt, files), metadata_rates(pool.plain, files)
        for k in m_rates:
            r[k] = {"mxfs": m_rates[k], "plain": p_rates[k]}
    if "direct" in parts:
        n = max(50, files // 10)
        r["direct_commit"] = {"mxfs": direct_commits(pool.mnt, n),
                              "plain": direct_commits(pool.plain, n)}
    if "small" in parts:
        n = max(100, files // 3)
        (m_first, m_again), (p_first, p_again) = (small_reads(pool.mnt, n),
                                                  small_reads(pool.plain, n))
        r["small_read"] = {"mxfs": m_first, "plain": p_first}
        r["small_reread"] = {"mxfs": m_again, "plain": p_again}
    return r


def write_big(pool: Any, size: int, block: memoryview, r: dict[str, dict[str, float]]
              ) -> Any:
    """The large file written into each side (it stays for `read_big`); its digest."""
    mnt, plain = pool.mnt, pool.plain
    gbps = lambda s: size / s / 1e9  # noqa: E731
    drop_caches()
    t_m, d_m = write_file(os.path.join(mnt, "big"), size, block)
    drop_caches()
    t_p, d_p = write_file(os.path.join(plain, "big"), size, block)
    assert d_m == d_p
    r["write"] = {"mxfs": gbps(t_m), "plain": gbps(t_p)}
    return d_p


def read_big(pool: Any, size: int, buf: bytearray, chunk_bufs: list[bytearray], d_p: Any,
             r: dict[str, dict[str, float]]) -> None:
    """read_cold (or read_first) and read_warm of the large file, each side; removed."""
    mnt, plain, members = pool.mnt, pool.plain, pool.members
    gbps = lambda s: size / s / 1e9  # noqa: E731
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
    os.unlink(os.path.join(mnt, "big"))
    os.unlink(os.path.join(plain, "big"))


def summarize(rounds: list[dict]) -> dict[str, dict[str, float]]:
    summary = {}
    for step in rounds[0]:
        summary[step] = {k: statistics.median(r[step][k] for r in rounds) for k in rounds[0][step]}
        summary[step]["ratio"] = statistics.median(r[step]["mxfs"] / r[step]["plain"]
                                                   for r in rounds)
    return summary


def report(summary: dict[str, dict[str, float]], ceil: dict[str, float], title: str) -> None:
    print(f"\n{title}\n")
    print("| step | mxfs | plain | raw chunks | mxfs / plain | of the rig's ceiling "
          "| target | met |")
    print("|---|---:|---:|---:|---:|---:|---:|:---:|")
    for step, v in summary.items():
        bandwidth = step in BANDWIDTH
        unit = "GB/s" if bandwidth else "entries/s" if step == "readdir" else "ops/s"
        fmt = ".2f" if bandwidth else ".0f"
        raw = f"{v['raw_chunks']:.2f}" if "raw_chunks" in v else ""
        top = (ceil.get("write_all_members_GBps") if step in ("write", "torch_save",
                                                               "save_file")
               else ceil.get("all_members_GBps") if step.startswith("read_")
               and step != "read_warm" else None)
        of = "" if top is None else f"{v['mxfs'] / top:.0%}"
        target = TARGETS.get(step)
        met = "" if target is None else ("yes" if v["ratio"] >= target else "no")
        print(f"| {step} ({unit}) | {v['mxfs']:{fmt}} | {v['plain']:{fmt}} | {raw} | "
              f"{v['ratio']:.0%} | {of} | {'' if target is None else f'{target:.0%}'} "
              f"| {met} |")
    if not ceil:
        return
    print(f"\nrig ceilings (GB/s): O_DIRECT reads one member {ceil['member_alone_GBps']:.2f}, "
          f"all {ceil['all_members_GBps']:.2f}; writes + fsync one member "
          f"{ceil['write_member_alone_GBps']:.2f}, all {ceil['write_all_members_GBps']:.2f} "
          f"(O_DIRECT all {ceil['write_all_members_odirect_GBps']:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2GiB", help="bytes of the large file and the state dict")
    ap.add_argument("--files", type=int, default=5000, help="files for the metadata steps")
    ap.add_argument("--meta", help="the pool's metadata on this PostgreSQL server "
                    "(postgresql://...; default: SQLite on the members)")
    ap.add_argument("-o", dest="options", default="", help="mount options to test")
    ap.add_argument("--steps", default="all", help="the steps to run, comma-separated: "
                    "all (default), data (the bandwidth steps), meta (create, stat, rename, "
                    "readdir, unlink, direct_commit, small_read, small_reread), or step names")
    bench_args(ap)
    args = ap.parse_args()
    size = parse_size(args.size)
    parts = parts_of(args.steps)
    mkfs = ["--stripe-unit", args.stripe_unit, *(["--meta", args.meta] if args.meta else [])]
    state = weights(size) if "saves" in parts else {}
    with make_rig(args.rig, args.dir, gib_each=max(8, 4 * -(-size // 2**30))) as rig, \
            scratch_pool("mxfs-bench-", args.dir, members=rig.members, plain=rig.plain,
                         mkfs=mkfs,
                         mount=["-o", args.options] if args.options else []) as pool:
        ceil = ({**ceiling(rig, size, args.repeat), **write_ceiling(rig, size, args.repeat)}
                if parts & {"big", "saves"} else {})
        block = memoryview(bytearray(os.urandom(BLOCK)))
        buf = bytearray(BLOCK)
        chunk_bufs = [bytearray(BLOCK) for _ in pool.members]
        rounds = []
        for i in range(args.repeat):
            rounds.append(one_round(pool, size, args.files, block, buf, chunk_bufs, state,
                                    parts))
            print(f"round {i + 1}/{args.repeat} done", file=sys.stderr)
        title = (f"mxfs vs plain folder, {args.size}, {rig.describe()}, metadata "
                 f"{'on PostgreSQL' if args.meta else 'in SQLite'}, median of {args.repeat}")
    summary = summarize(rounds)
    report(summary, ceil, title)
    save_results(args, rig_ceiling=ceil, rounds=rounds, median=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

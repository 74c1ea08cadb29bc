#!/usr/bin/env python3
"""Checkpoint benchmark: mxfs.ckpt against its baselines, the same state dict each way.

A state dict of bf16 weights plus fp32 Adam moments (exp_avg, exp_avg_sq) is saved
into a fresh 4-member pool and into a plain folder on the same disk:
  (copy) a bare copy of every tensor into a preallocated host buffer: what blocking
         must cost at least
  (a) raw: the same bytes written with O_DIRECT to one file per member, in parallel,
      then fsync (the members' ceiling)
  (b) mxfs.ckpt.save: time blocked (until staged) and time to durable (wait())
  (c) torch.save + fsync, to the mount and to the plain folder
  (d) DCP save and async_save with FileSystemWriter to the plain folder
  (e) DCP save and async_save with mxfs.ckpt.dcp.Writer on the mount
"Durable" means every byte fsynced and the checkpoint listed.  Medians of --repeat.

    python tools/bench_ckpt.py --size 2GiB --repeat 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import mxfs.ckpt as ck
from mxfs.ckpt.dcp import Writer
from mxfs.ckpt.tree import flatten
from mxfs.cli.bench import raw_io
from mxfs.cli.demo import ScratchPool, bench_args, save_results, scratch_pool
from mxfs.client import direct
from mxfs.units import parse_size

LAYER = 4096 * 4096  # parameters per tensor
SEGMENT = 16 << 20


def training_state(total: int) -> dict[str, object]:
    """bf16 weights and fp32 exp_avg / exp_avg_sq: 10 bytes a parameter, up to `total`."""
    g = torch.Generator().manual_seed(0)
    model, avg, sq = {}, {}, {}
    i = 0
    while 10 * LAYER * i < total:
        w = torch.randn(4096, 4096, generator=g)
        model[f"layers.{i}.weight"] = w.bfloat16()
        avg[i] = w * 0.01
        sq[i] = w * w
        i += 1
    return {"model": model, "optim": {"state": {i: {"exp_avg": avg[i], "exp_avg_sq": sq[i]}
                                                for i in avg},
                                      "param_groups": [{"lr": 1e-4, "params": list(avg)}]},
            "step": 1}


def nbytes_of(state: dict[str, object]) -> int:
    return sum(t.numel() * t.element_size() for _, t in flatten(state)[1])


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2GiB")
    bench_args(ap)
    args = ap.parse_args()
    with scratch_pool("mxfs-bench-ckpt-", args.dir) as pool:
        rounds, size = run(args, pool)
    report(args, rounds, size)
    return 0


def run(args: argparse.Namespace, pool: ScratchPool) -> tuple[list[dict[str, float]], int]:
    """Every arm, --repeat times; seconds per arm and round."""
    members, mnt, plain = pool.members, pool.mnt, pool.plain
    raws = [os.path.join(m, "raw.bin") for m in members]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rounds: list[dict[str, float]] = []
    try:
        state = training_state(parse_size(args.size))
        size = nbytes_of(state)
        flat = [t for _, t in flatten(state)[1]]
        copy_buf = torch.empty(size, dtype=torch.uint8)
        copy_buf.fill_(0)  # touched once, outside the clock
        raw_buf = mmap.mmap(-1, -(-size // 4096) * 4096 + 4096)
        raw_buf.write(bytes(len(raw_buf)))

        def bare_copy() -> None:
            off = 0
            for t in flat:
                n = t.numel() * t.element_size()
                copy_buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
                off += n

        saver = ck.Checkpointer()
        saver.save(state, os.path.join(mnt, "warmup")).wait()  # staging allocated once
        ck.remove(os.path.join(mnt, "warmup"))

        def mxfs_save(r: int, res: dict[str, float]) -> None:
            start = time.perf_counter()
            snap = saver.save(state, os.path.join(mnt, f"ck-{r}"))
            snap.staged()
            res["b_mxfs_blocked"] = time.perf_counter() - start
            snap.wait()
            res["b_mxfs_durable"] = time.perf_counter() - start

        def torch_save(path: str) -> None:
            torch.save(state, path)
            fsync_path(path)

        def dcp_async(writer: object, res: dict[str, float], key: str) -> None:
            start = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=writer)
            res[key + "_blocked"] = time.perf_counter() - start
            fut.result()
            res[key + "_durable"] = time.perf_counter() - start

        for r in range(args.repeat):
            res: dict[str, float] = {}
            res["copy"] = timed(bare_copy)
            res["a_raw"] = timed(lambda: raw_io(raws, size, raw_buf, True))
            mxfs_save(r, res)
            res["c_torch_save_mount"] = timed(lambda: torch_save(os.path.join(mnt, "t.pt")))
            res["c_torch_save_plain"] = timed(lambda: torch_save(os.path.join(plain, "t.pt")))
            res["d_dcp_save_plain"] = timed(lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(os.path.join(plain, "d"))))
            dcp_async(dcp.FileSystemWriter(os.path.join(plain, "da")), res, "d_dcp_async_plain")
            res["e_dcp_save_mxfs"] = timed(lambda: dcp.save(
                state, storage_writer=Writer(os.path.join(mnt, "e"))))
            dcp_async(Writer(os.path.join(mnt, "ea")), res, "e_dcp_async_mxfs")
            rounds.append(res)
            for d in (mnt, plain):  # free the space for the next round
                for n in os.listdir(d):
                    p = os.path.join(d, n)
                    shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
            print(f"round {r + 1}/{args.repeat}: " + ", ".join(f"{k} {v:.2f}s"
                                                              for k, v in res.items()),
                  file=sys.stderr)
    finally:
        dist.destroy_process_group()
        direct._clients.clear()
    return rounds, size


def report(args: argparse.Namespace, rounds: list[dict[str, float]], size: int) -> None:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}

    def ratio(a: str, b: str) -> float:
        return statistics.median(r[a] / r[b] for r in rounds)

    print(f"\ncheckpoint save, {size / 2**30:.2f} GiB (bf16 weights + fp32 Adam moments), "
          f"4 folder members on one disk, seconds (GB/s), median of {args.repeat}\n")
    print("| arm | seconds | GB/s |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {size / v / 1e9:.2f} |")
    checks = [
        ("(b) blocked / bare copy", ratio("b_mxfs_blocked", "copy"), 1.2, "<="),
        ("(b) durable / (a) raw", ratio("b_mxfs_durable", "a_raw"), 1.15, "<="),
        ("torch.save plain / (b) durable", ratio("c_torch_save_plain", "b_mxfs_durable"), 3.0,
         ">="),
        ("(b) blocked / DCP async blocked", ratio("b_mxfs_blocked", "d_dcp_async_plain_blocked"),
         1.0, "<="),
        ("DCP save plain / (e) DCP save mxfs", ratio("d_dcp_save_plain", "e_dcp_save_mxfs"),
         None, ""),
        ("torch.save mount / (b) durable", ratio("c_torch_save_mount", "b_mxfs_durable"), None,
         ""),
    ]
    print("\n| ratio | value | target | met |\n|---|---:|---:|:---:|")
    for name, value, target, how in checks:
        met = "" if target is None else (
            "yes" if (value <= target if how == "<=" else value >= target) else "no")
        print(f"| {name} | {value:.2f} | {'' if target is None else how + ' ' + str(target)} "
              f"| {met} |")
    save_results(args, bytes=size, rounds=rounds, median=med)


if __name__ == "__main__":
    sys.exit(main())

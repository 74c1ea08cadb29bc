#!/usr/bin/env python3
"""Checkpoint benchmark: mxfs.ckpt against its ceiling and the checkpointers users pick.

A state dict of bf16 weights plus fp32 Adam moments (exp_avg, exp_avg_sq) is saved
into a fresh 4-member pool and into a plain folder on the same disk, every arm the
same state, in one run:
  copy     a bare copy of every tensor into a preallocated host buffer: what blocking
           must cost at least
  raw      the same bytes written with O_DIRECT to one file per member, in parallel,
           then fsync (the members' ceiling)
  mxfs     mxfs.ckpt.save (blocked until staged, durable at wait()) as it is by
           default, and with overlap=True (each range written as staging passes it) and
           overlap=False (written once all is staged): what the overlap gains and costs
           on this host; DCP save and async_save with mxfs.ckpt.dcp.Writer; torch.save
           + fsync into the mount
  peers    (tools/peers_ckpt.py) into the plain folder: torch.save, safetensors
           save_file, DCP FileSystemWriter with thread_count 1, 2 and 4, DCP async_save
           thread- and process-based
For every arm: the time the training loop is blocked and the time until durable
(every file fsynced, by the bench where the peer does not, and the checkpoint
listed); every checkpoint is loaded back its own way and compared byte for byte
(untimed).  Arms run in a rotating order; medians of --repeat rounds; ratios are
mxfs/peer speed (peer seconds / mxfs seconds, median of per-round ratios: above 1,
mxfs is ahead).  `--skip` leaves arms out by key.

Memory: besides the state, the bench holds one checkpoint's worth at a time, so a
checkpoint of a third of the host's memory can be measured: the copy and raw arms share
a buffer made (and touched) for them each round, outside the clock, and a
`Checkpointer`'s staging is made and touched just before its arm and given back after
it (a trainer keeps it across saves; so the arm finds it ready, as the trainer's next
save would).

    python tools/bench_ckpt.py --size 2GiB --repeat 3
    python tools/bench_ckpt.py --size 8GiB --repeat 3 --skip mxfs_overlap,dcp_t1,dcp_t2
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import peers_ckpt as peers
import torch
import torch.distributed as dist
from peers_ckpt import Arm
from rig import ceiling, make_rig

import mxfs.ckpt as ck
from mxfs.ckpt.dcp import Reader, Writer
from mxfs.ckpt.tree import flatten
from mxfs.cli.bench import raw_io
from mxfs.cli.demo import ScratchPool, bench_args, save_results, scratch_pool
from mxfs.cli.measure import drop_caches
from mxfs.client import direct
from mxfs.units import parse_size

LAYER = 4096 * 4096  # parameters per tensor
MXFS = "mxfs"  # the arm every peer is compared with


def training_state(total: int) -> dict[str, object]:
    """bf16 weights and fp32 exp_avg / exp_avg_sq: 10 bytes a parameter, up to `total`
    (whole 4096 x 4096 layers; narrower ones when `total` is under one layer)."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, min(4096, total // (10 * 4096)))
    model, avg, sq = {}, {}, {}
    i = 0
    while 10 * 4096 * rows * i < total:
        w = torch.randn(rows, 4096, generator=g)
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


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--dcp-threads", default="1,2,4",
                    help="thread_count values for the DCP FileSystemWriter arms")
    ap.add_argument("--async-threads", type=int, default=1,
                    help="thread_count of the FileSystemWriter behind DCP async_save")
    ap.add_argument("--skip", default="", help="arms to leave out, by key (comma-separated)")
    bench_args(ap)
    args = ap.parse_args()
    size = parse_size(args.size)
    with make_rig(args.rig, args.dir, gib_each=max(4, 4 * -(-size // 2**30))) as rig, \
            scratch_pool("mxfs-bench-ckpt-", args.dir, members=rig.members,
                         plain=rig.plain, mkfs=["--stripe-unit", args.stripe_unit]) as pool:
        args.rig_ceiling = ceiling(rig, size, args.repeat)  # saved with the args
        print(f"rig: {rig.describe()}; raw O_DIRECT ceiling: one member "
              f"{args.rig_ceiling['member_alone_GBps']:.2f} GB/s, all at once "
              f"{args.rig_ceiling['all_members_GBps']:.2f} GB/s", file=sys.stderr)
        rounds, checks, size, labels = run(args, pool)
    return report(args, rounds, checks, size, labels)


def mxfs_arms(saver: ck.Checkpointer, overlap: ck.Checkpointer, serial: ck.Checkpointer
              ) -> list[Arm]:
    def saving(s: ck.Checkpointer) -> Callable[[Any, str], tuple[float, float]]:
        def save(state: Any, path: str) -> tuple[float, float]:
            start = time.perf_counter()
            snap = s.save(state, path)
            snap.staged()
            blocked = time.perf_counter() - start
            snap.wait()
            return blocked, time.perf_counter() - start
        return save

    def check(state: Any, path: str) -> str | None:
        return peers.difference(state, ck.load(path))

    return [
        Arm(MXFS, "mxfs.ckpt.save", "mount", saving(saver), check),
        Arm("mxfs_overlap", "mxfs.ckpt.save, overlap=True (written as staged)", "mount",
            saving(overlap), check),
        Arm("mxfs_after_staging", "mxfs.ckpt.save, overlap=False (written once all staged)",
            "mount", saving(serial), check),
        Arm("mxfs_dcp", "DCP save, mxfs.ckpt.dcp.Writer", "mount",
            peers.dcp_save(Writer), peers.dcp_check(Reader)),
        Arm("mxfs_dcp_async", "DCP async_save (thread), mxfs.ckpt.dcp.Writer", "mount",
            peers.dcp_async(Writer, "thread"), peers.dcp_check(Reader)),
        Arm("torch_save_mount", "torch.save + fsync", "mount", peers.torch_save,
            peers.torch_check),
    ]


def copy_and_raw(flat: list[torch.Tensor], raws: list[str], size: int
                 ) -> dict[str, dict[str, float]]:
    """The bare copy of every tensor and the raw O_DIRECT write, into and from one
    buffer made and touched for them outside the clock, and given back after."""
    raw_buf = mmap.mmap(-1, -(-size // 4096) * 4096 + 4096)
    copy_buf = torch.frombuffer(raw_buf, dtype=torch.uint8)
    copy_buf.fill_(0)
    start = time.perf_counter()
    off = 0
    for t in flat:
        n = t.numel() * t.element_size()
        copy_buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
        off += n
    copied = time.perf_counter() - start
    del copy_buf
    wrote = timed(partial(raw_io, raws, size, raw_buf, True))
    raw_buf.close()
    return {"copy": {"blocked": copied, "durable": copied},
            "raw": {"blocked": wrote, "durable": wrote}}


def ready(saver: ck.Checkpointer, size: int) -> None:
    """`saver`'s staging made and touched, as a trainer's is from its second save on
    (room for the header besides the tensors: the save finds it large enough)."""
    saver.staging.ensure(size + (64 << 20)).fill_(0)


def remove(path: str) -> None:
    if os.path.isdir(path):
        try:
            ck.remove(path)
            return
        except (ck.CheckpointError, OSError):
            pass
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def run(args: argparse.Namespace, pool: ScratchPool
        ) -> tuple[list[dict[str, dict[str, float]]], dict[str, str | None], int,
                   dict[str, tuple[str, str]]]:
    """Every arm, --repeat times: {arm: {blocked, durable}} per round, and each arm's
    equal-bytes verdict (None: equal, else the first difference)."""
    members, mnt, plain = pool.members, pool.mnt, pool.plain
    raws = [os.path.join(m, "raw.bin") for m in members]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rounds: list[dict[str, dict[str, float]]] = []
    checks: dict[str, str | None] = {}
    savers = [ck.Checkpointer(), ck.Checkpointer(overlap=True), ck.Checkpointer(overlap=False)]
    try:
        state = training_state(parse_size(args.size))
        size = nbytes_of(state)
        flat = [t for _, t in flatten(state)[1]]

        threads = tuple(int(n) for n in args.dcp_threads.split(",") if n)
        skip = set(args.skip.split(",")) - {""}
        arms = [a for a in mxfs_arms(*savers) + peers.peers(threads, args.async_threads)
                if a.key not in skip]
        labels = {a.key: (a.label, a.where) for a in arms}
        staged_by = dict(zip((MXFS, "mxfs_overlap", "mxfs_after_staging"), savers,
                             strict=True))
        for key, one in staged_by.items():  # plans made once; staging before each arm
            if key not in labels:
                continue
            one.save(state, os.path.join(mnt, "warmup")).wait()
            ck.remove(os.path.join(mnt, "warmup"))
            one.staging.release()
        for arm in arms:
            if arm.setup:
                arm.setup(plain if arm.where == "plain" else mnt)
        for r in range(args.repeat):
            res: dict[str, dict[str, float]] = {}
            drop_caches()
            res.update(copy_and_raw(flat, raws, size))
            order = arms[r % len(arms):] + arms[:r % len(arms)]  # spread the disk's drift
            for arm in order:
                path = os.path.join(mnt if arm.where == "mount" else plain, f"{arm.key}-{r}")
                saver = staged_by.get(arm.key)
                if saver is not None:
                    ready(saver, size)
                blocked, durable = arm.save(state, path)
                if saver is not None:
                    saver.staging.release()
                res[arm.key] = {"blocked": blocked, "durable": durable}
                verdict = arm.check(state, path)
                if verdict or arm.key not in checks:
                    checks[arm.key] = verdict
                remove(path)
                gc.collect()
                drop_caches()
            rounds.append(res)
            print(f"round {r + 1}/{args.repeat}: " + ", ".join(
                f"{k} {v['blocked']:.2f}/{v['durable']:.2f}s" for k, v in res.items()),
                file=sys.stderr)
            for d in (mnt, plain):  # anything left (warm-ups), for the next round
                for n in os.listdir(d):
                    remove(os.path.join(d, n))
    finally:
        peers.stop_process_checkpointer()
        for one in savers:
            one.close()
        dist.destroy_process_group()
        direct._clients.clear()
    return rounds, checks, size, labels


def report(args: argparse.Namespace, rounds: list[dict[str, dict[str, float]]],
           checks: dict[str, str | None], size: int, labels: dict[str, tuple[str, str]]
           ) -> int:
    arms = list(rounds[0])
    med = {k: {m: statistics.median(r[k][m] for r in rounds) for m in ("blocked", "durable")}
           for k in arms}

    def ratio(a: str, b: str, what: str = "durable", wb: str | None = None) -> float:
        """Median over rounds of a's seconds over b's."""
        return statistics.median(r[a][what] / r[b][wb or what] for r in rounds)

    labels = {"copy": ("bare copy into a host buffer", ""),
              "raw": ("raw O_DIRECT, all members", "members"), **labels}
    print(f"\ncheckpoint save, {size / 2**30:.2f} GiB (bf16 weights + fp32 Adam moments), "
          f"rig {args.rig}, stripe unit {args.stripe_unit}, median of {args.repeat}; "
          "blocked: the training "
          "loop waits; durable: every byte fsynced\n")
    print("| arm | into | blocked s | durable s | durable GB/s | bytes equal |\n"
          "|---|---|---:|---:|---:|:---:|")
    for k in arms:
        m = med[k]
        eq = "" if k in ("copy", "raw") else ("yes" if checks.get(k) is None else "NO")
        print(f"| {k}: {labels[k][0]} | {labels[k][1]} | {m['blocked']:.2f} | "
              f"{m['durable']:.2f} | {size / m['durable'] / 1e9:.2f} | {eq} |")
    others = [k for k in arms if k not in ("copy", "raw", MXFS)]
    print("\n| mxfs.ckpt against | blocked: mxfs/peer speed | durable: mxfs/peer speed |\n"
          "|---|---:|---:|")
    for k in others:
        print(f"| {k} | {ratio(k, MXFS, 'blocked'):.2f} | {ratio(k, MXFS):.2f} |")
    dcp_peers = [k for k in others if k.startswith("dcp")]
    plain_peers = [k for k in others if labels[k][1] == "plain"]
    targets: list[tuple[str, float, float | None, str]] = [
        ("blocked / bare copy", ratio(MXFS, "copy", "blocked"), 1.2, "<="),
        ("durable / raw", ratio(MXFS, "raw"), 1.15, "<="),
        ("raw / durable (share of the write ceiling)", ratio("raw", MXFS), 0.9, ">="),
    ]
    if "torch_save" in arms:
        targets.append(("torch.save plain / mxfs durable", ratio("torch_save", MXFS), 3.0,
                        ">="))
    if dcp_peers:
        best = min(dcp_peers, key=lambda k: med[k]["durable"])
        targets.append((f"best DCP durable ({best}) / mxfs durable",
                        min(ratio(k, MXFS) for k in dcp_peers), 1.0, ">="))
        async_peers = [k for k in dcp_peers if "async" in k]
        if async_peers:
            targets.append(("DCP async blocked (least) / mxfs blocked",
                            min(ratio(k, MXFS, "blocked") for k in async_peers), 1.0, ">="))
    if plain_peers:
        targets.append(("best peer durable / mxfs durable",
                        min(ratio(k, MXFS) for k in plain_peers), 1.0, ">="))
    print("\n| ratio | value | target | met |\n|---|---:|---:|:---:|")
    for name, value, target, how in targets:
        met = "" if target is None else (
            "yes" if (value <= target if how == "<=" else value >= target) else "no")
        print(f"| {name} | {value:.2f} | {'' if target is None else how + ' ' + str(target)} "
              f"| {met} |")
    bad = {k: v for k, v in checks.items() if v is not None}
    for k, v in bad.items():
        print(f"bench_ckpt: {k} did not load back equal: {v}", file=sys.stderr)
    save_results(args, bytes=size, rounds=rounds, median=med,
                 labels={k: v[0] for k, v in labels.items()},
                 into={k: v[1] for k, v in labels.items()},
                 equal={k: v is None for k, v in checks.items()},
                 differences=bad, ratios={k: {"blocked": ratio(k, MXFS, "blocked"),
                                              "durable": ratio(k, MXFS)} for k in others})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

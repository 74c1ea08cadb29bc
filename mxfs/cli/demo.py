"""`mxfs demo`: the main job on an embedded default.

Builds a pool of four folder members in a scratch folder and mounts it; runs the three
jobs mxfs is for (a model load, a checkpoint, a KV prefix reused across processes), each
against its baseline (`demo_jobs.py`); then writes and reads a few files through the
mount and through a plain folder on the same disk, checks every byte (xxh3), prints
the throughput of each side by side, and unmounts and cleans up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mxfs.cli.measure import drop_caches, read_file, write_file
from mxfs.cli.scratch import parent_for, scratch_dir
from mxfs.errors import MxfsError
from mxfs.proc import python_module
from mxfs.units import format_size

BLOCK = 8 << 20
FILES = 4


@dataclass
class Leg:
    name: str
    mxfs_s: float
    plain_s: float
    nbytes: int

    def row(self) -> dict[str, float | str]:
        return {"step": self.name, "bytes": self.nbytes,
                "mxfs_GBps": self.nbytes / self.mxfs_s / 1e9,
                "plain_GBps": self.nbytes / self.plain_s / 1e9,
                "ratio": self.plain_s / self.mxfs_s}


def _write_files(folder: str, size: int, block: memoryview) -> tuple[float, list[str]]:
    results = [write_file(os.path.join(folder, f"file{i}.bin"), size // FILES, block)
               for i in range(FILES)]
    return sum(t for t, _ in results), [d for _, d in results]


def _read_files(folder: str, buf: bytearray) -> tuple[float, list[str]]:
    results = [read_file(os.path.join(folder, f"file{i}.bin"), buf) for i in range(FILES)]
    return sum(r[0] for r in results), [r[1] for r in results]


def run_mxfs(*args: str) -> str:
    """Run the mxfs command as a user would (the demo and tools/ benchmarks do)."""
    res = subprocess.run(python_module("mxfs", *args), capture_output=True, text=True)
    if res.returncode:
        raise MxfsError(f"mxfs {args[0]} failed: {res.stderr.strip()}", "see the message above")
    return res.stdout


@dataclass
class ScratchPool:
    """A pool of four folder members, its mount point and a plain folder beside them."""

    base: str
    members: list[str]
    mnt: str
    plain: str


@contextmanager
def scratch_pool(prefix: str, where: str = "/var/tmp",
                 mkfs: Sequence[str] = (), mount: Sequence[str] = (), keep: bool = False,
                 members: Sequence[str] | None = None, plain: str | None = None
                 ) -> Iterator[ScratchPool]:
    """Make, mount, and afterwards unmount and remove (unless `keep`) a scratch pool in
    a fresh folder of its own in `where` (`scratch.py`): four folder members there, or
    the `members` and `plain` folders given (a bench rig's devices, the rig's to
    remove)."""
    base = scratch_dir(prefix, where)
    pool = ScratchPool(base, list(members or [os.path.join(base, f"member{i}")
                                              for i in range(4)]),
                       os.path.join(base, "mnt"), plain or os.path.join(base, "plain"))
    for p in [*pool.members, pool.mnt, pool.plain]:
        os.makedirs(p, exist_ok=False)
    run_mxfs("mkfs", *mkfs, *[a for m in pool.members for a in ("--member", m)])
    run_mxfs("mount", *mount, pool.members[0], pool.mnt)
    try:
        yield pool
    finally:
        if not keep:
            res = subprocess.run(python_module("mxfs", "umount", pool.mnt),
                                 capture_output=True)
            if res.returncode:
                subprocess.run(python_module("mxfs", "umount", "--lazy", pool.mnt),
                               capture_output=True)
            shutil.rmtree(base, ignore_errors=True)  # (ours alone: made by mkdtemp)


def bench_args(ap: argparse.ArgumentParser) -> None:
    """The options every benchmark in tools/ takes."""
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--dir", default="/var/tmp", help="where the scratch pool's folder is "
                    "made (one that other users can change is refused)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--rig", default="plain", help="plain (folders on one disk) or "
                    "members:N:MBPS (N loop-device XFS members capped at MBPS MB/s each; "
                    "tools/rig.py)")
    ap.add_argument("--stripe-unit", default="1MiB", help="the scratch pool's stripe unit")


def save_results(args: argparse.Namespace, **results: Any) -> None:
    """Write a benchmark's arguments and results to --json, when asked."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)


def run_demo(size: int, scratch: str | None, keep: bool, as_json: bool) -> int:
    with parent_for(scratch or "/var/tmp") as where:
        return _run_demo(size, where, keep, as_json)


def _run_demo(size: int, where: str, keep: bool, as_json: bool) -> int:
    size = max(size - size % (FILES * 4096), FILES * 4096)
    free = shutil.disk_usage(where).free
    if free < 2 * size + (1 << 30):
        raise MxfsError(f"{where} has {format_size(free)} free; the demo needs "
                        f"{format_size(2 * size + (1 << 30))}", "pass a smaller --size or --dir")
    say = (lambda *a: None) if as_json else print
    job_bytes = max(16 << 20, min(256 << 20, size // 4))
    with scratch_pool("mxfs-demo-", where, mkfs=("--label", "demo"), keep=keep) as pool:
        say(f"mxfs demo: pool of 4 folder members in {pool.base}")
        jobs = _demo_jobs(pool, job_bytes, say)
        say(f"  files through the mount and a plain folder, {format_size(size)} each way")
        legs, info = _demo_legs(pool, size, say)
    base, mnt = pool.base, pool.mnt
    rows = [leg.row() for leg in legs]
    if as_json:
        print(json.dumps({"scratch": base, "kept": keep, "verified": True, "jobs": jobs,
                          "steps": rows, "pool": info.get("pool_uuid")}, indent=2))
        return 0
    from mxfs.cli.demo_jobs import print_jobs

    print_jobs(jobs["model"], jobs["checkpoint"], jobs["kv"])
    _print_table(rows)
    print("  every tensor, chunk and byte verified; "
          + (f"pool left mounted on {mnt}" if keep else "pool unmounted and removed"))
    print("  next: mxfs bench run MOUNT --out DIR (your own members against their ceiling), "
          "docs/operations.md (a pool of your own)")
    return 0


def _demo_jobs(pool: ScratchPool, nbytes: int, say: Any) -> dict[str, Any]:
    from mxfs.cli.demo_jobs import ckpt_job, kv_job, model_job

    say(f"  loading a {format_size(nbytes)} model three ways ...")
    model = model_job(pool.mnt, pool.plain, nbytes)
    say("  saving a checkpoint, and the same with torch.save ...")
    ckpt = ckpt_job(pool.mnt, pool.plain, nbytes)
    say("  putting a KV prefix from one process, getting it from another ...")
    kv = kv_job(pool.mnt, nbytes)
    for name in ("model.safetensors", "step-100.pt"):
        os.unlink(os.path.join(pool.plain, name))
    return {"model": model, "checkpoint": ckpt, "kv": kv}


def _demo_legs(pool: ScratchPool, size: int, say: Any) -> tuple[list[Leg], dict[str, Any]]:
    """Write, read cold, read warm, through the mount and the plain folder; verify."""
    mnt, plain = pool.mnt, pool.plain
    block = memoryview(bytearray(os.urandom(BLOCK)))
    buf = bytearray(BLOCK)
    legs = []
    say("  writing (fsync per file) ...")
    w_m, dig_w = _write_files(mnt, size, block)
    w_p, dig_p = _write_files(plain, size, block)
    legs.append(Leg("write", w_m, w_p, size))
    cold = drop_caches()
    say(f"  reading back ({'cold cache' if cold else 'warm cache: not root'}) ...")
    r_m, dig_rm = _read_files(mnt, buf)
    r_p, dig_rp = _read_files(plain, buf)
    legs.append(Leg("read (cold)" if cold else "read", r_m, r_p, size))
    say("  reading again (warm cache) ...")
    r2_m, dig_rm2 = _read_files(mnt, buf)
    r2_p, _ = _read_files(plain, buf)
    legs.append(Leg("re-read (warm)", r2_m, r2_p, size))
    if not (dig_w == dig_rm == dig_rm2 == dig_p == dig_rp):
        raise MxfsError("data read back differs from what was written",
                        "this is a bug: please report it with the demo output")
    status = subprocess.run(python_module("mxfs", "status", "--json", mnt),
                            capture_output=True, text=True)
    info = json.loads(status.stdout) if status.returncode == 0 else {}
    return legs, info


# Why a step through the mount can be behind the plain folder (docs/benchmarks.md).
BEHIND_WHY = {
    "write": "each write crosses FUSE to the daemon; loaders and checkpoints write "
             "the members directly (mxfs.ckpt, the rows above)",
    "read (cold)": "each read crosses FUSE to the daemon; mxfs.load reads the members "
                   "directly (the rows above)",
    "re-read (warm)": "served from the page cache by the kernel's FUSE read path, about "
                      "half as fast as ext4's on this kernel (the daemon does nothing); "
                      "mxfs.load reads the members' cached pages directly",
}


def _print_table(rows: list[dict[str, float | str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mxfs vs a plain folder on the same disk (GB/s)")
    for col in ("step", "mxfs", "plain folder", "mxfs / plain"):
        table.add_column(col, justify="right" if col != "step" else "left")
    for r in rows:
        table.add_row(str(r["step"]), f"{r['mxfs_GBps']:.2f}", f"{r['plain_GBps']:.2f}",
                      f"{r['ratio']:.0%}")
    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(table)
    for r in rows:
        if float(r["ratio"]) < 1 and str(r["step"]) in BEHIND_WHY:
            console.print(f"  {r['step']}: {float(r['ratio']):.0%}: {BEHIND_WHY[str(r['step'])]}")

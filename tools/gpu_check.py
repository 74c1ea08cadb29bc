#!/usr/bin/env python3
"""The loader on a CUDA machine, without FUSE: both device paths against the raw ceiling.

Makes a 4-member pool of folders on local disk, puts a synthetic model into it
offline (`mxfs put`'s code: no FUSE needed), opens it with OfflinePool and loads
it into GPU memory, cold (caches dropped) and warm, medians of --repeat:
  (a) raw: parallel O_DIRECT reads of the model's chunk files into host memory
  (b) mxfs.load to cuda:0 through pinned staging buffers (mode "stream")
  (b') mxfs.load to cuda:0 with GPUDirect Storage through kvikio (mode "gds"), or
       the reason it cannot run
  (c) safetensors.torch.load_file(device="cuda:0") from a plain folder
Every loaded tensor is checked byte for byte against safetensors' once.  Results go
to OUT/gpu_check.json and OUT/gpu_check.md.  tools/gpu_check.sh runs it.

    python tools/gpu_check.py --size 4GiB --repeat 3 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from bench_load import raw_chunks, synthetic_model
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

from mxfs.cli.measure import drop_caches
from mxfs.client.direct import open_reader
from mxfs.errors import MxfsError
from mxfs.fs.offline_put import put_files
from mxfs.fs.volume import format_pool
from mxfs.load import load_file
from mxfs.load.gds import GdsReader, Unavailable
from mxfs.load.tensors import touch_pages as touch
from mxfs.pool.offline import OfflinePool
from mxfs.units import parse_size


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def timed(fn, dev: torch.device) -> float:  # noqa: ANN001 - a tiny local helper
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    if isinstance(out, dict) and dev.type == "cpu":
        touch(out)  # a dry run: safetensors' CPU tensors are lazily mapped
    sync()
    del out
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda:0", help="cpu: a dry run of the script")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: this torch sees no CUDA device", file=sys.stderr)
        return 2
    base = tempfile.mkdtemp(prefix="mxfs-gpu-check-", dir=args.dir)
    try:
        return run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(args: argparse.Namespace, base: str) -> int:
    members = [os.path.join(base, f"member{i}") for i in range(4)]
    for m in members:
        os.makedirs(m)
    format_pool(members, 1 << 20)
    plain = os.path.join(base, "model.safetensors")
    model = synthetic_model(parse_size(args.size))
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    save_file(model, plain)
    del model
    put_files(members[0], [plain], "/")
    dev = torch.device(args.device)
    facts: dict = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none",
                   "torch": torch.__version__,
                   "bytes": nbytes, "repeat": args.repeat}
    with OfflinePool(members[0]) as pool:
        ino = pool.resolve("/model.safetensors").ino
        chunks = [c for c in (pool.pool.chunk_path(m, ino) for m in range(4))
                  if os.path.exists(c)]
        bufs = [mmap.mmap(-1, os.path.getsize(c) + 4096) for c in chunks]
        for b in bufs:
            b.write(bytes(len(b)))
        arms = {
            "a_raw_chunks": lambda: raw_chunks(chunks, bufs),
            "b_mxfs_stream": lambda: load_file("/model.safetensors", dev, mode="stream",
                                               pool=pool),
            "c_safetensors": lambda: st_load_file(plain, device=str(dev)),
        }
        try:
            with open_reader("/model.safetensors", pool=pool) as r:
                GdsReader(r, dev).close()
            arms["b_mxfs_gds"] = lambda: load_file("/model.safetensors", dev, mode="gds",
                                                   pool=pool)
        except Unavailable as e:
            facts["gds_unavailable"] = str(e)
        want = st_load_file(plain, device=str(dev))
        for name in ("b_mxfs_stream", "b_mxfs_gds"):
            if name in arms:
                facts[f"{name}_equal"] = same_bytes(arms[name](), want)
        del want
        facts["cold_is_cold"] = drop_caches()
        rounds = []
        for r in range(args.repeat):
            result = {}
            for name, arm in arms.items():
                drop_caches()
                cold = timed(arm, dev)
                warm = timed(arm, dev)
                result[name] = {"cold": nbytes / cold / 1e9, "warm": nbytes / warm / 1e9}
            rounds.append(result)
            print(f"round {r + 1}/{args.repeat}: " + ", ".join(
                f"{k} {v['cold']:.2f}/{v['warm']:.2f}" for k, v in result.items()),
                file=sys.stderr, flush=True)
    report(args, facts, rounds)
    return 0


def report(args: argparse.Namespace, facts: dict, rounds: list[dict]) -> None:
    med = {arm: {k: statistics.median(r[arm][k] for r in rounds) for k in ("cold", "warm")}
           for arm in rounds[0]}
    lines = [f"GPU check: {facts['gpu']}, torch {facts['torch']}, "
             f"{facts['bytes'] / 2**30:.2f} GiB model, GB/s, median of {args.repeat}", "",
             "| arm | cold | warm |", "|---|---:|---:|"]
    lines += [f"| {arm} | {v['cold']:.2f} | {v['warm']:.2f} |" for arm, v in med.items()]
    lines.append("")
    for arm in med:
        if arm.startswith("b_"):
            lines.append(f"{arm} / a_raw_chunks cold: "
                         f"{statistics.median(r[arm]['cold'] / r['a_raw_chunks']['cold'] for r in rounds):.2f}; "  # noqa: E501
                         f"/ c_safetensors cold: "
                         f"{statistics.median(r[arm]['cold'] / r['c_safetensors']['cold'] for r in rounds):.2f}")  # noqa: E501
    lines += [f"{k}: {v}" for k, v in facts.items() if k not in ("gpu", "torch", "bytes")]
    lines.append("(mxfs arms read uncached stripes O_DIRECT, which leaves the page cache "
                 "empty: their warm runs are cold again; only safetensors' warm is cached)")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"facts": facts, "rounds": rounds, "median": med}, f, indent=1)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MxfsError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        sys.exit(1)

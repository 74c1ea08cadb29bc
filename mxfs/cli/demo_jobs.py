"""The three jobs of `mxfs demo`, each against what a user does without mxfs.

- A model loaded by the direct path (`mxfs.load.load_file`) against `safetensors`
  through the mount and from a plain folder on the same disk; every page touched, the
  tensors compared.
- A checkpoint saved by `mxfs.ckpt` (the time the training loop is blocked, the time
  until it is durable) against `torch.save` and an fsync to the plain folder; loaded
  back and compared.
- A KV prefix put by one process and got by another (cold), against recomputing it:
  the TTFT model (`mxfs.kv.ttft`) at the bandwidth measured here, reading all of it
  and as the reuse policy (`mxfs.kv.reuse_policy`) would: only what is faster to read
  than to compute, so never slower than recomputing.
The load and checkpoint jobs run ROUNDS times, each side first in turn (this disk's
cache favours whoever reads or writes second), and show medians. Every row where mxfs
is not ahead says why underneath.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from mxfs.cli.measure import drop_caches
from mxfs.errors import MxfsError
from mxfs.kv.reuse_policy import ReusePolicy
from mxfs.kv.ttft import H200_FLOPS, MODELS, break_even_gbps, load_s, recompute_s

TENSOR = 16 << 20  # bytes of one demo weight
KV_CHUNK = 2 << 20  # one chunk: 8 tokens of Qwen2.5-32B's KV (256 KiB a token)
PREFIX_TOKENS = 16384  # the prefix the TTFT line speaks of
POLICY_CHUNK = 256  # tokens of a chunk the reuse policy decides on (LMCache's)
UTIL = 0.4  # the share of an H200's FLOPs a prefill is taken to reach
ROUNDS = 3  # of the load and checkpoint jobs, each side first in turn: medians shown

PUT_PREFIX = r"""
import sys
from mxfs.kv import KVStore
from mxfs.kv.keys import ChunkKey
mount, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with KVStore(mount, "demo") as kv:
    for i in range(0, n, 8):
        part = range(i, min(i + 8, n))
        kv.batch_put([f"prefix-{j}" for j in part],
                     [bytes([j % 251]) * size for j in part])
"""


def _weights(nbytes: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(2048, TENSOR // 4096, generator=g).bfloat16()
            for i in range(max(1, nbytes // TENSOR))}


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def model_job(mnt: str, plain: str, nbytes: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file

    from mxfs.load import load_file
    from mxfs.load.tensors import touch_pages

    weights = _weights(nbytes)
    paths = [os.path.join(d, "model.safetensors") for d in (mnt, plain)]
    for p in paths:
        save_file(weights, p)
    size = os.path.getsize(paths[0])
    arms = [("mxfs", load_file, paths[0]), ("safetensors_mount", st_load, paths[0]),
            ("safetensors_plain", st_load, paths[1])]
    times: dict[str, list[float]] = {key: [] for key, _, _ in arms}
    for r in range(ROUNDS):
        for key, fn, p in arms[r:] + arms[:r]:  # each arm first once
            drop_caches()

            def load(fn: Any = fn, p: str = p) -> dict[str, Any]:
                tensors = fn(p)
                touch_pages(tensors)  # every page in memory: a lazy map is not a load
                return tensors

            seconds, got = _timed(load)
            if set(got) != set(weights) or not all(torch.equal(got[k], weights[k])
                                                   for k in weights):
                raise MxfsError(f"the model loaded by {key} differs from what was saved",
                                "this is a bug: please report it with the demo output")
            times[key].append(seconds)
            del got
    return {"job": "load a model", "bytes": size,
            **{key + "_s": statistics.median(t) for key, t in times.items()}}


def ckpt_job(mnt: str, plain: str, nbytes: int) -> dict[str, Any]:
    import torch

    import mxfs.ckpt as ck

    state: dict[str, Any] = {"model": _weights(nbytes), "step": 100}
    size = sum(t.numel() * t.element_size() for t in state["model"].values())
    times: dict[str, list[float]] = {"blocked_s": [], "durable_s": [], "torch_save_s": []}
    folder = os.path.join(mnt, "ckpt")

    def mxfs_save(saver: Any, step: int) -> None:
        t0 = time.perf_counter()
        snap = saver.save(state, os.path.join(folder, f"step-{step}"))
        snap.staged()
        times["blocked_s"].append(time.perf_counter() - t0)
        snap.wait()
        times["durable_s"].append(time.perf_counter() - t0)

    def torch_save() -> None:
        p = os.path.join(plain, "step-100.pt")
        torch.save(state, p)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    # One checkpointer saving every few steps, as a training job keeps one; each side
    # goes first in turn (the disk's cache favours whichever writes second).
    saver = ck.Checkpointer()
    try:
        for r in range(ROUNDS):
            if r:
                shutil.rmtree(os.path.join(folder, f"step-{r - 1}"))  # (room: one kept)
            for first in (r % 2 == 0, r % 2 == 1):
                if first:
                    mxfs_save(saver, r)
                else:
                    times["torch_save_s"].append(_timed(torch_save)[0])
    finally:
        saver.close()
    back = ck.load(os.path.join(folder, f"step-{ROUNDS - 1}"))
    if back["step"] != 100 or not all(torch.equal(back["model"][k], v)
                                      for k, v in state["model"].items()):
        raise MxfsError("the checkpoint loaded back differs from what was saved",
                        "this is a bug: please report it with the demo output")
    return {"job": "save a checkpoint", "bytes": size,
            **{key: statistics.median(t) for key, t in times.items()}}


def kv_job(mnt: str, nbytes: int) -> dict[str, Any]:
    from mxfs.kv import KVStore

    n = max(8, nbytes // KV_CHUNK)
    res = subprocess.run([sys.executable, "-P", "-c", PUT_PREFIX, mnt, str(n), str(KV_CHUNK)],
                         capture_output=True, text=True)
    if res.returncode:
        raise MxfsError(f"the KV writer process failed: {res.stderr.strip()[-300:]}",
                        "see the message above")
    drop_caches()
    outs = [bytearray(KV_CHUNK) for _ in range(n)]
    with KVStore(mnt, "demo") as kv:
        keys = [f"prefix-{j}" for j in range(n)]
        seconds, hits = _timed(lambda: kv.batch_exists(keys))
        t, got = _timed(lambda: [ok for i in range(0, n, 8)
                                 for ok in kv.batch_get(keys[i:i + 8], outs[i:i + 8])])
        seconds += t
    if hits != n or not all(got) or any(outs[j] != bytes([j % 251]) * KV_CHUNK
                                        for j in range(n)):
        raise MxfsError("KV chunks read back differ from what the writer put",
                        "this is a bug: please report it with the demo output")
    gbps = n * KV_CHUNK / seconds / 1e9
    m = MODELS["qwen2.5-32b"]
    policy = ReusePolicy(POLICY_CHUNK, m.kv_bytes_per_token() * POLICY_CHUNK, m.prefill_flops,
                         read_bps=gbps * 1e9, seconds_per_flop=1 / (H200_FLOPS * UTIL),
                         latency_s=0.005)
    plan = policy.plan(PREFIX_TOKENS, PREFIX_TOKENS // POLICY_CHUNK)
    return {"job": "reuse a KV prefix", "bytes": n * KV_CHUNK, "get_s": seconds,
            "gbps": gbps, "model": m.name, "tokens": PREFIX_TOKENS,
            "kv_gb": m.kv_bytes_per_token() * PREFIX_TOKENS / 1e9,
            "load_s": load_s(m, PREFIX_TOKENS, gbps, 0.005),
            "recompute_s": recompute_s(m, PREFIX_TOKENS, H200_FLOPS, UTIL),
            "policy_s": plan.expected_s, "policy_chunks": plan.read_chunks,
            "chunks": plan.found_chunks,
            "break_even_gbps": break_even_gbps(m, PREFIX_TOKENS, H200_FLOPS, UTIL)}


def print_jobs(model: dict[str, Any], ckpt: dict[str, Any], kv: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from mxfs.units import format_size

    def rate(nbytes: int, s: float) -> str:
        return f"{nbytes / s / 1e9:.2f} GB/s"

    mb, cb = model["bytes"], ckpt["bytes"]
    table = Table(title="what mxfs is for, each against what you would do without it")
    for col in ("job", "mxfs", "without mxfs", "mxfs gains"):
        table.add_column(col, justify="right" if col == "mxfs gains" else "left")
    table.add_row(f"load a {format_size(mb)} model, cold", f"mxfs.load {rate(mb, model['mxfs_s'])}",
                  f"safetensors via the mount {rate(mb, model['safetensors_mount_s'])}",
                  f"{model['safetensors_mount_s'] / model['mxfs_s']:.2f}x")
    table.add_row("", "", f"safetensors, plain folder {rate(mb, model['safetensors_plain_s'])}",
                  f"{model['safetensors_plain_s'] / model['mxfs_s']:.2f}x")
    table.add_row(f"checkpoint {format_size(cb)}: training blocked",
                  f"{ckpt['blocked_s']:.2f} s", f"torch.save + fsync {ckpt['torch_save_s']:.2f} s",
                  f"{ckpt['torch_save_s'] / ckpt['blocked_s']:.2f}x")
    table.add_row("  ... until durable", f"{ckpt['durable_s']:.2f} s",
                  f"{ckpt['torch_save_s']:.2f} s",
                  f"{ckpt['torch_save_s'] / ckpt['durable_s']:.2f}x")
    table.add_row(f"KV prefix put by another process ({format_size(kv['bytes'])})",
                  f"got cold at {kv['gbps']:.2f} GB/s", "", "")
    table.add_row(f"  TTFT of {kv['model']}, {kv['tokens']}-token prefix "
                  f"({kv['kv_gb']:.1f} GB of KV)",
                  f"{kv['load_s']:.2f} s (load at that rate)",
                  f"{kv['recompute_s']:.2f} s (recompute, H200 at {UTIL:.0%})",
                  f"{kv['recompute_s'] / kv['load_s']:.2f}x")
    table.add_row("  ... as the reuse policy reads it",
                  f"{kv['policy_s']:.2f} s (reads {kv['policy_chunks']} of {kv['chunks']} "
                  "chunks)", f"{kv['recompute_s']:.2f} s",
                  f"{kv['recompute_s'] / kv['policy_s']:.2f}x")
    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(table)
    for line in behind_why(model, ckpt, kv):
        console.print(f"  {line}")


def behind_why(model: dict[str, Any], ckpt: dict[str, Any], kv: dict[str, Any]) -> list[str]:
    """A line for each row above where mxfs is not ahead, saying why."""
    lines = []
    peer = min(model["safetensors_mount_s"], model["safetensors_plain_s"])
    if peer < model["mxfs_s"]:
        lines.append(f"load, cold: {peer / model['mxfs_s']:.2f}x: every reader is bound by "
                     "the one disk under these folder members, and a reader that follows "
                     "another may find the bytes in this machine's host cache of the disk "
                     "(a guest's drop_caches does not empty it); mxfs.load gains with "
                     "members on devices of their own")
    if ckpt["torch_save_s"] < ckpt["durable_s"]:
        lines.append(f"until durable: {ckpt['torch_save_s'] / ckpt['durable_s']:.2f}x: both "
                     "are bound by the members' write rate (here folders on one disk: mxfs "
                     "cannot stripe over it); mxfs's gain is the time training is blocked")
    if kv["recompute_s"] < kv["load_s"]:
        lines.append(f"reading the whole prefix: {kv['recompute_s'] / kv['load_s']:.2f}x: "
                     f"it beats recomputing above {kv['break_even_gbps']:.1f} GB/s, and this "
                     f"disk gives {kv['gbps']:.2f}; the reuse policy reads only what is "
                     "faster to read than to compute, so an engine with it is never slower")
    return lines

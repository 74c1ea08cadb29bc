"""The GPU check's checkpoints: a state dict on the device saved by mxfs.ckpt and by torch.save.

A training state (bf16 weights, fp32 Adam moments: 10 bytes a parameter) made on the
device, then:
  (floor) every tensor copied into one preallocated pinned host buffer: what the
          training loop must be blocked for at least
  (mxfs)  mxfs.ckpt.Checkpointer.save: blocked = until `staged()` (the tensors are in
          pinned staging and may change), durable = until `wait()` (fsynced, committed,
          listed); the first save (which allocates the staging buffer) apart from the
          steady ones, as a training loop sees them
  (torch) torch.save of the same device tensors to a plain folder, then fsync:
          blocked = durable
On the mount when FUSE works, else into a plain folder (mxfs.ckpt's plain writer:
the same staging, no pool).  Both loaded back to the device and compared byte for byte.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any

import torch
from gpu_check_common import gbps, median, same_bytes, sync, timed

import mxfs.ckpt as ck
from mxfs.ckpt.tree import flatten
from mxfs.load.staging import aligned_host

LAYER = 4096 * 4096  # parameters per tensor, fewer for small sizes


def training_state(total: int, dev: torch.device) -> dict[str, Any]:
    """bf16 weights and fp32 exp_avg / exp_avg_sq on `dev`, about `total` bytes."""
    per = min(LAYER, max(1024, total // 40 // 1024 * 1024))
    g = torch.Generator(device=dev).manual_seed(0)
    model, optim = {}, {}
    for i in range(max(1, -(-total // (10 * per)))):
        w = torch.randn(per // 1024, 1024, generator=g, device=dev)
        model[f"layers.{i}.weight"] = w.bfloat16()
        optim[i] = {"exp_avg": w * 0.01, "exp_avg_sq": w * w}
    return {"model": model, "optim": {"state": optim,
                                      "param_groups": [{"lr": 1e-4, "params": list(optim)}]},
            "step": 1}


def _named(state: Any) -> dict[str, torch.Tensor]:
    return dict(flatten(state)[1])


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_floor(named: dict[str, torch.Tensor], dev: torch.device) -> float:
    """Seconds to copy every tensor into one preallocated pinned (on CUDA) host buffer."""
    total = sum(t.numel() * t.element_size() for t in named.values())
    host = aligned_host(total, dev.type == "cuda")
    host.zero_()

    def copy() -> None:
        at = 0
        for t in named.values():
            n = t.numel() * t.element_size()
            host[at:at + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            at += n
    copy()  # once untimed: the first copy pays for the device's copy engine setup
    return timed(copy, dev)[0]


def run(args: argparse.Namespace, work: str, mount: str, why_unmounted: str) -> dict[str, Any]:
    dev = torch.device(args.device)
    state = training_state(args.ckpt_size, dev)
    named = _named(state)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    where = os.path.join(mount, "ckpt") if mount else os.path.join(work, "ckpt")
    plain = os.path.join(work, "plain")
    os.makedirs(where, exist_ok=True)
    os.makedirs(plain)
    out: dict[str, Any] = {
        "bytes": nbytes, "tensors": len(named), "device": str(dev),
        "target": "mxfs mount (direct writes to the pool)" if mount else
        f"plain folder: {why_unmounted} (mxfs.ckpt's plain writer, same staging)"}
    out["copy_floor_s"] = _copy_floor(named, dev)
    saver = ck.Checkpointer(keep_last=1)
    blocked, durable = [], []
    try:
        for step in range(args.repeat + 1):
            sync(dev)
            t0 = time.perf_counter()
            snap = saver.save(state, os.path.join(where, f"step-{step}"))
            snap.staged()
            blocked.append(time.perf_counter() - t0)
            snap.wait()
            durable.append(time.perf_counter() - t0)
    finally:
        saver.close()
    out.update(first_blocked_s=blocked[0], first_durable_s=durable[0],
               blocked_s=median(blocked[1:]), durable_s=median(durable[1:]))
    back = ck.load(os.path.join(where, f"step-{args.repeat}"), device=dev)
    out["equal_mxfs"] = same_bytes(_named(back), named) and back["step"] == 1
    del back
    saves = []
    for step in range(args.repeat):
        p = os.path.join(plain, f"step-{step}.pt")

        def save(p: str = p) -> None:
            torch.save(state, p)
            _fsync(p)
        saves.append(timed(save, dev)[0])
        if step < args.repeat - 1:
            os.unlink(p)
    out["torch_save_s"] = median(saves)
    back = torch.load(p, map_location=dev, weights_only=True)
    out["equal_torch_save"] = same_bytes(_named(back), named)
    del back
    out["blocked_vs_torch_save"] = out["torch_save_s"] / out["blocked_s"]
    out["durable_vs_torch_save"] = out["torch_save_s"] / out["durable_s"]
    out["durable_GBps"] = gbps(nbytes, out["durable_s"])
    out["torch_save_GBps"] = gbps(nbytes, out["torch_save_s"])
    shutil.rmtree(plain, ignore_errors=True)
    return out

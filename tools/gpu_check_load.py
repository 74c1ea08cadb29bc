"""The GPU check's model loads: both device paths of mxfs.load against the raw ceiling.

A 4-member pool of folders of its own; a synthetic model put in offline (`mxfs put`'s
code: no FUSE needed), opened with OfflinePool and loaded to the device, cold (caches
dropped) and warm, each round:
  (a) raw: parallel O_DIRECT reads of the model's chunk files into host memory; and
      (a') the same bytes copied from pinned host memory to the device: the host link's
      ceiling for any load to it
  (b) mxfs.load through pinned staging buffers (mode "stream")
  (b') mxfs.load with GPUDirect Storage through kvikio (mode "gds"), or why not
  (c) safetensors.torch.load_file(device=...) from a plain folder
  (f) fastsafetensors (ParallelLoader, as vLLM drives it) from the plain folder, without
      GDS and with it; (g) InstantTensor's safe_open: each where its wheel imports
      (`gpu_check.sh --fetch` brings them) and the device allows, else skipped with why
Every loaded tensor is checked byte for byte against safetensors' once.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch
from gpu_check_common import describe, gbps, median, raw_reads, same_bytes, timed
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

from mxfs.admin.offline_put import put_files
from mxfs.cli.measure import drop_caches
from mxfs.client.direct import DirectFile, open_reader
from mxfs.load import load_file
from mxfs.load.gds import GdsReader, Unavailable
from mxfs.load.tensors import touch_pages
from mxfs.vol.format import format_pool

HIDDEN, FFN = 4096, 11008  # Llama-2-7B-like layers, shrunk for small sizes


def _layer_bytes(h: int, f: int) -> int:
    return 4 * h * h * 2 + 3 * (f * h + 4 * f) + 2 * h


def synthetic_model(total: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """bf16 attention and fp8 MLP weights (with fp32 scales) up to `total` bytes, in host
    memory (drawn on `dev`: a GPU draws gigabytes in moments); layers are shrunk (same
    shapes' ratios) when `total` holds fewer than four full ones."""
    s = min(1.0, math.sqrt(total / (4 * _layer_bytes(HIDDEN, FFN))))
    h, f = max(64, int(HIDDEN * s) // 64 * 64), max(64, int(FFN * s) // 64 * 64)
    g = torch.Generator(device=dev).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    size, layer = 0, 0
    while size < total:
        p = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = torch.randn(
                h, h, generator=g, dtype=torch.bfloat16, device=dev).cpu()
        for name, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
            w = torch.randn(*shape, generator=g, device=dev).clamp(-4, 4)
            tensors[p + f"mlp.{name}.weight"] = w.to(torch.float8_e4m3fn).cpu()
            tensors[p + f"mlp.{name}.weight_scale"] = torch.rand(shape[0], generator=g,
                                                                 device=dev).cpu()
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        size += _layer_bytes(h, f)
        layer += 1
    return tensors


Tensors = dict[str, torch.Tensor]


def peer_arms(path: str, dev: torch.device) -> tuple[dict[str, Callable[[], Tensors]],
                                                      dict[str, str]]:
    """The specialised loaders a user would pick instead, reading the plain file, and why
    any is missing here."""
    arms: dict[str, Callable[[], Tensors]] = {}
    skipped: dict[str, str] = {}
    try:
        from fastsafetensors import SingleGroup
        from fastsafetensors.parallel_loader import ParallelLoader

        def fastsafe(nogds: bool) -> Tensors:
            loader = ParallelLoader(pg=SingleGroup(), hf_weights_files=[path], queue_size=2,
                                    use_tqdm_on_load=False, device=str(dev), nogds=nogds)
            try:  # its buffers go with the loader: keep copies, as vLLM's weights do
                return {n: t.clone() for n, t in loader.iterate_weights()}
            finally:
                loader.close()

        arms["f_fastsafetensors"] = lambda: fastsafe(True)
        if dev.type == "cuda":
            arms["f_fastsafetensors_gds"] = lambda: fastsafe(False)
        else:
            skipped["f_fastsafetensors_gds"] = "GPUDirect Storage needs a CUDA device"
    except ImportError as e:
        skipped["f_fastsafetensors"] = f"fastsafetensors does not import ({e})"
    if dev.type != "cuda":
        skipped["g_instanttensor"] = "InstantTensor loads to CUDA or ROCm devices only"
        return arms, skipped
    try:
        from instanttensor import safe_open

        def instant() -> Tensors:
            with safe_open(path, framework="pt", device=dev.index or 0) as f:
                return dict(f.tensors())  # they own their memory (copy=True)

        arms["g_instanttensor"] = instant
    except ImportError as e:
        skipped["g_instanttensor"] = f"instanttensor does not import ({e})"
    return arms, skipped


def _timed_load(fn: Callable[[], Any], dev: torch.device) -> float:
    def go() -> None:
        out = fn()
        if isinstance(out, dict) and dev.type == "cpu":
            touch_pages(out)  # a dry run: safetensors' CPU tensors are lazily mapped
    return timed(go, dev)[0]


def _pinned_copy(nbytes: int, dev: torch.device) -> Callable[[], None]:
    """`nbytes` from pinned host memory to the device: the link's ceiling."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def copy() -> None:
        device.copy_(host, non_blocking=True)
    return copy


def cache_model(pool: Any) -> None:
    """The model's chunk files in the page cache, every member at once (`mxfs warm`)."""
    with open_reader("/model.safetensors", pool=pool) as r:
        assert isinstance(r, DirectFile)  # an unmounted pool's file
        r.cache()


def run(args: argparse.Namespace, work: str, emit: Callable[[dict[str, Any]], None]
        ) -> dict[str, Any]:
    """The loads, every round handed to `emit` as it ends (a timeout keeps them)."""
    dev = torch.device(args.device)
    members = [os.path.join(work, f"member{i}") for i in range(4)]
    for m in members:
        os.makedirs(m)
    format_pool(members, 1 << 20)
    plain = os.path.join(work, "model.safetensors")
    model = synthetic_model(args.size, dev)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    save_file(model, plain)
    del model
    put_files(members[0], [plain], "/")
    out: dict[str, Any] = {"bytes": nbytes, "repeat": args.repeat, "pool": "unmounted "
                           "(OfflinePool: the load needs no FUSE)", "equal": {}, "rounds": []}
    from mxfs.pool.offline import OfflinePool

    with OfflinePool(members[0]) as pool:
        ino = pool.resolve("/model.safetensors").ino
        chunks = [c for c in (pool.pool.chunk_path(m, ino) for m in range(4))
                  if os.path.exists(c)]
        bufs = [memoryview(mmap.mmap(-1, -(-os.path.getsize(c) // 4096) * 4096))
                for c in chunks]
        for b in bufs:
            b[:] = bytes(len(b))  # touched once: the clock measures reads, not page faults
        arms: dict[str, Callable[[], Any]] = {
            "a_raw_chunks": lambda: raw_reads(chunks, bufs),
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
            out["gds_unavailable"] = str(e)
        if dev.type == "cuda":
            arms["a_pinned_to_device"] = _pinned_copy(nbytes, dev)
        peers, out["skipped"] = peer_arms(plain, dev)
        want = st_load_file(plain, device=str(dev))
        for name in ("b_mxfs_stream", "b_mxfs_gds"):
            if name in arms:
                out["equal"][name] = same_bytes(arms[name](), want)
        for name, peer in peers.items():
            try:  # a peer that fails here (no cuFile, a device it refuses) is skipped
                out["equal"][name] = same_bytes(peer(), want)
                arms[name] = peer
            except Exception as e:  # noqa: BLE001 - any failure of a peer is its own
                out["skipped"][name] = describe(e)
        del want
        out["cold_is_cold"] = drop_caches()
        for _ in range(args.repeat):
            result = {}
            for name, arm in arms.items():
                drop_caches()
                cold = _timed_load(arm, dev)
                if name.startswith("b_mxfs"):
                    cache_model(pool)
                warm = _timed_load(arm, dev)
                result[name] = {"cold": gbps(nbytes, cold), "warm": gbps(nbytes, warm)}
            out["rounds"].append(result)
            out["median"] = {arm: {k: median([r[arm][k] for r in out["rounds"]])
                                   for k in ("cold", "warm")} for arm in result}
            emit(out)
    out["note"] = ("mxfs arms read uncached stripes O_DIRECT, which leaves the page cache "
                   "empty: before their warm runs the chunk files are read into it (as "
                   "`mxfs warm` does), so warm is a load from the node's memory for every arm")
    return out

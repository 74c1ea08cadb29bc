#!/usr/bin/env python3
"""Model loading benchmark: mxfs.load against its baselines, the same bytes each way.

Writes a synthetic model (bf16 and fp8 tensors of real LLM shapes) into a fresh
4-member pool and into a plain folder, then loads it, cold (caches dropped) and
warm, five ways:
  (a) raw: parallel O_DIRECT reads of the file's chunk files (the members' ceiling),
      into buffers touched once before the clock; (a fresh) the same reads into new,
      untouched buffers: the fair ceiling of a CPU load, which must fill new memory
  (b reader) the direct path's reader alone: the whole file into a touched aligned
      buffer, as (a) reads into touched buffers (the read half of every mode)
  (b reader fresh) the same reads into a new buffer, and (m) the first touch of a new
      buffer of the same size with no I/O: what a CPU load pays for memory that no
      process has used yet (a load must put its bytes in such memory; on the
      development VM, whose host takes freed pages back, this is what bounds them)
  (b) mxfs.load.load_file through the direct path: mode "read" (O_DIRECT into one
      buffer), "map" (the CPU default) and "stream" (through the bounded staging
      buffers a GPU load uses, here copied to CPU memory)
  (c) safetensors.torch.load_file through the FUSE mount
  (d) safetensors.torch.load_file from the plain folder
  (e) torch.load of the same tensors (torch.save file in the plain folder)
  (f) the loaders a user would pick instead, from the plain folder, driven as vLLM
      drives them: Run:ai Model Streamer (SafetensorsStreamer, each tensor cloned as
      vLLM does) and fastsafetensors (ParallelLoader on the CPU, nogds); skipped with
      the reason where they do not import
and, with the same tensors in 4 shards and a model.safetensors.index.json, mxfs.load's
load_model through the mount against safetensors loading each shard from the plain folder.
safetensors hands back mmap-backed tensors, so every arm touches every page of
every tensor before the clock stops.  Medians of --repeat rounds.  --rig picks where
members and the plain folder live (tools/rig.py); the rig's own ceiling (raw O_DIRECT
reads of each member alone and of all at once) is measured first and shown beside.

    python tools/bench_load.py --size 2GiB --repeat 3
    python tools/bench_load.py --size 2GiB --rig members:4:200
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from rig import ceiling, make_rig
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

from mxfs.cli.demo import ScratchPool, bench_args, save_results, scratch_pool
from mxfs.cli.measure import drop_caches
from mxfs.client import direct
from mxfs.client.direct import aligned_like, open_reader
from mxfs.load import load_file, load_model
from mxfs.load.tensors import touch_pages as touch
from mxfs.units import parse_size

HIDDEN, FFN = 4096, 11008  # Llama-2-7B-like layer shapes
PAGE = 4096


def synthetic_model(total: int) -> dict[str, torch.Tensor]:
    """Layers of bf16 attention and fp8 MLP weights (with scales) up to `total` bytes."""
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    size, layer = 0, 0
    while size < total:
        p = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = torch.randn(
                HIDDEN, HIDDEN, generator=g, dtype=torch.bfloat16)
        for name, shape in (("gate_proj", (FFN, HIDDEN)), ("up_proj", (FFN, HIDDEN)),
                            ("down_proj", (HIDDEN, FFN))):
            w = torch.randn(*shape, generator=g).clamp(-4, 4)
            tensors[p + f"mlp.{name}.weight"] = w.to(torch.float8_e4m3fn)
            tensors[p + f"mlp.{name}.weight_scale"] = torch.rand(shape[0], generator=g)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        layer += 1
    return tensors


def write_shards(model: dict[str, torch.Tensor], folder: str, n: int) -> None:
    """The model as `n` safetensors shards and the index naming each tensor's shard."""
    os.makedirs(folder)
    names = list(model)
    step = -(-len(names) // n)
    weight_map = {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = names[i * step:(i + 1) * step]
        save_file({k: model[k] for k in part}, os.path.join(folder, fname))
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def load_shards(folder: str) -> dict[str, torch.Tensor]:
    """What an engine does without mxfs: safetensors' load_file on each shard."""
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".safetensors"):
            out.update(st_load_file(os.path.join(folder, fname)))
    return out


def raw_chunks(paths: list[str], bufs: list[mmap.mmap]) -> int:
    """Read each chunk file whole with O_DIRECT, one thread per member."""
    def one(path: str, buf: mmap.mmap) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        done = 0
        try:
            view = memoryview(buf)
            while n := os.preadv(fd, [view], done):
                done += n
                if n < len(view):
                    break
        finally:
            os.close(fd)
        return done
    with ThreadPoolExecutor(len(paths)) as ex:
        return sum(ex.map(one, paths, bufs))


Tensors = Iterator[tuple[str, torch.Tensor]]


def peer_loaders(path: str) -> tuple[dict[str, Callable[[], Tensors]], dict[str, str]]:
    """The peers a user would load `path` with, as vLLM drives them, and why any is
    missing."""
    loaders: dict[str, Callable[[], Tensors]] = {}
    skipped: dict[str, str] = {}
    try:
        from runai_model_streamer import SafetensorsStreamer

        def runai() -> Tensors:
            with SafetensorsStreamer() as streamer:
                streamer.stream_files([path], device="cpu")
                for name, t in streamer.get_tensors():
                    yield name, t.clone()  # its buffers are reused: vLLM clones
        loaders["f_runai_streamer_plain"] = runai
    except ImportError as e:
        skipped["f_runai_streamer_plain"] = f"runai-model-streamer does not import ({e})"
    try:
        from fastsafetensors import SingleGroup
        from fastsafetensors.parallel_loader import ParallelLoader

        def fastsafe() -> Tensors:
            loader = ParallelLoader(pg=SingleGroup(), hf_weights_files=[path], queue_size=2,
                                    use_tqdm_on_load=False, device="cpu", nogds=True)
            try:
                yield from loader.iterate_weights()
            finally:
                loader.close()
        loaders["f_fastsafetensors_plain"] = fastsafe
    except ImportError as e:
        skipped["f_fastsafetensors_plain"] = f"fastsafetensors does not import ({e})"
    return loaders, skipped


def peer_arms(plain: str) -> tuple[dict[str, Callable[[], int]], dict[str, str]]:
    """Arms touching every page of each tensor as the peer yields it; each peer's
    tensors checked equal to safetensors' once, outside the clock."""
    path = os.path.join(plain, "model.safetensors")
    loaders, skipped = peer_loaders(path)
    want = st_load_file(path)
    for name, load in loaders.items():
        got = dict(load())
        if sorted(got) != sorted(want) or not all(torch.equal(got[n], want[n]) for n in want):
            raise SystemExit(f"bench_load: {name} returned other tensors than safetensors")
    del want
    return {name: partial(_touch_each, load) for name, load in loaders.items()}, skipped


def _touch_each(load: Callable[[], Tensors]) -> int:
    return sum(touch({n: t}) for n, t in load())


def first_touch(nbytes: int) -> None:
    """Write every byte of a new buffer of `nbytes` (as `aligned_like` makes them for a
    load): the cost of fresh memory alone."""
    buf = aligned_like(nbytes, 0)
    ctypes.memset(direct.address_of(buf), 0, nbytes)


def timed(fn, *args):  # noqa: ANN001, ANN201 - a tiny local helper
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2GiB")
    bench_args(ap)
    args = ap.parse_args()
    size = parse_size(args.size)
    with make_rig(args.rig, args.dir, gib_each=max(4, 4 * -(-size // 2**30))) as rig, \
            scratch_pool("mxfs-bench-load-", args.dir, members=rig.members,
                         plain=rig.plain, mkfs=["--stripe-unit", args.stripe_unit]) as pool:
        ceil = ceiling(rig, size, args.repeat)
        rounds, nbytes, skipped = run(args, pool)
    report(args, rounds, nbytes, rig.describe(), ceil, skipped)
    return 0


def run(args: argparse.Namespace, pool: ScratchPool
        ) -> tuple[list[dict], int, dict[str, str]]:
    """Every arm cold and warm, --repeat times: GB/s."""
    members, mnt, plain = pool.members, pool.mnt, pool.plain
    rounds = []
    try:
        model = synthetic_model(parse_size(args.size))
        nbytes = sum(t.numel() * t.element_size() for t in model.values())
        save_file(model, os.path.join(plain, "model.safetensors"))
        shutil.copyfile(os.path.join(plain, "model.safetensors"),
                        os.path.join(mnt, "model.safetensors"))
        torch.save(model, os.path.join(plain, "model.pt"))
        write_shards(model, os.path.join(plain, "sharded"), 4)
        shutil.copytree(os.path.join(plain, "sharded"), os.path.join(mnt, "sharded"))
        del model
        on_mxfs = os.path.join(mnt, "model.safetensors")
        ino = os.stat(on_mxfs).st_ino
        chunks = [os.path.join(m, "chunks", f"{ino % 256:02x}", str(ino)) for m in members]
        bufs = [mmap.mmap(-1, os.path.getsize(c) + PAGE) for c in chunks]
        for b in bufs:  # touch the O_DIRECT buffers once, outside the clock
            b.write(bytes(len(b)))
            b.seek(0)
        reader = open_reader(on_mxfs)
        touched = aligned_like(reader.size, 0)
        touched[:] = bytes(len(touched))  # touched once, outside the clock, like (a)'s
        arms = {
            "a_raw_chunks": lambda: raw_chunks(chunks, bufs),
            "a_raw_chunks_fresh": lambda: raw_chunks(chunks, [mmap.mmap(-1, len(b))
                                                              for b in bufs]),
            "b_mxfs_reader": lambda: reader.read_into(0, touched),
            "b_mxfs_reader_fresh": lambda: reader.read_into(0, aligned_like(reader.size, 0)),
            "m_fresh_memory_touch": lambda: first_touch(reader.size),
            "b_mxfs_load": lambda: touch(load_file(on_mxfs, mode="read")),
            "b_mxfs_load_map": lambda: touch(load_file(on_mxfs, mode="map")),
            "b_mxfs_load_stream": lambda: touch(load_file(on_mxfs, mode="stream")),
            "c_safetensors_mount": lambda: touch(st_load_file(on_mxfs)),
            "d_safetensors_plain": lambda: touch(st_load_file(
                os.path.join(plain, "model.safetensors"))),
            "e_torch_load_plain": lambda: touch(torch.load(os.path.join(plain, "model.pt"))),
            "b_mxfs_load_model_sharded": lambda: touch(dict(load_model(
                os.path.join(mnt, "sharded")))),
            "d_safetensors_sharded_plain": lambda: touch(load_shards(
                os.path.join(plain, "sharded"))),
        }
        peers, skipped = peer_arms(plain)
        arms.update(peers)
        for r in range(args.repeat):
            result: dict[str, dict[str, float]] = {}
            for name, arm in arms.items():
                drop_caches()
                direct._clients.clear()
                cold, _ = timed(arm)
                warm, _ = timed(arm)
                result[name] = {"cold": nbytes / cold / 1e9, "warm": nbytes / warm / 1e9}
            rounds.append(result)
            print(f"round {r + 1}/{args.repeat} done", file=sys.stderr)
        reader.close()
    finally:
        direct._clients.clear()
    return rounds, nbytes, skipped


def report(args: argparse.Namespace, rounds: list[dict], nbytes: int, rig: str,
           ceil: dict[str, float], skipped: dict[str, str]) -> None:
    med = {arm: {k: statistics.median(r[arm][k] for r in rounds) for k in ("cold", "warm")}
           for arm in rounds[0]}

    def ratio(a: str, b: str, k: str) -> float:
        return statistics.median(r[a][k] / r[b][k] for r in rounds)

    print(f"\nmodel load, {nbytes / 2**30:.2f} GiB of bf16 + fp8 tensors, {rig}, stripe unit "
          f"{args.stripe_unit}, GB/s, median of {args.repeat}\n")
    print("| arm | cold | warm |")
    print("|---|---:|---:|")
    print(f"| rig ceiling: one member alone, raw O_DIRECT | {ceil['member_alone_GBps']:.2f} | |")
    print(f"| rig ceiling: all members at once, raw O_DIRECT | {ceil['all_members_GBps']:.2f} "
          "| |")
    for arm, v in med.items():
        print(f"| {arm} | {v['cold']:.2f} | {v['warm']:.2f} |")
    for arm, why in skipped.items():
        print(f"| {arm} | skipped: {why} | |")
    checks = [("(b reader)/(a) cold", ratio("b_mxfs_reader", "a_raw_chunks", "cold"), 0.9),
              ("(b)/(a) cold", ratio("b_mxfs_load", "a_raw_chunks", "cold"), 0.9),
              ("(b)/(a fresh) cold: against the fair CPU ceiling",
               ratio("b_mxfs_load", "a_raw_chunks_fresh", "cold"), 0.9),
              ("(b map)/(a fresh) cold", ratio("b_mxfs_load_map", "a_raw_chunks_fresh", "cold"),
               0.9),
              ("(b reader fresh)/(b reader) cold: the cost of new memory",
               ratio("b_mxfs_reader_fresh", "b_mxfs_reader", "cold"), None),
              ("(b)/(b reader fresh) cold", ratio("b_mxfs_load", "b_mxfs_reader_fresh", "cold"),
               None),
              ("(b map)/(a) cold", ratio("b_mxfs_load_map", "a_raw_chunks", "cold"), 0.9),
              ("(b map)/(c) cold", ratio("b_mxfs_load_map", "c_safetensors_mount", "cold"), 3.0),
              ("(b map)/(d) warm", ratio("b_mxfs_load_map", "d_safetensors_plain", "warm"), 1.0),
              ("(b)/(c) cold", ratio("b_mxfs_load", "c_safetensors_mount", "cold"), 3.0),
              ("(b)/(d) warm", ratio("b_mxfs_load", "d_safetensors_plain", "warm"), 1.0),
              ("(b)/(e) cold", ratio("b_mxfs_load", "e_torch_load_plain", "cold"), None),
              ("(b sharded)/(d sharded) cold", ratio("b_mxfs_load_model_sharded",
                                                     "d_safetensors_sharded_plain", "cold"), None),
              ("(b sharded)/(d sharded) warm", ratio("b_mxfs_load_model_sharded",
                                                     "d_safetensors_sharded_plain", "warm"), 1.0)]
    peers = [a for a in med if a.startswith("f_")]
    for peer in peers:
        for k in ("cold", "warm"):
            checks.append((f"(b map)/({peer}) {k}", ratio("b_mxfs_load_map", peer, k), 1.0))
    print("\n| ratio | value | target | met |\n|---|---:|---:|:---:|")
    for name, value, target in checks:
        met = "" if target is None else ("yes" if value >= target else "no")
        print(f"| {name} | {value:.2f} | {'' if target is None else target} | {met} |")
    save_results(args, bytes=nbytes, rig=rig, ceiling=ceil, skipped=skipped, rounds=rounds,
                 median=med)


if __name__ == "__main__":
    sys.exit(main())

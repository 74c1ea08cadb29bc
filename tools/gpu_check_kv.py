"""The GPU check's KV tier: chunks put from device memory, got straight into device buffers.

KV chunks (random bytes, made on the device) are put, then got into preallocated
device tensors, cold (caches dropped) and warm, each round:
  (a) raw: the mxfs chunks' own chunk files read with O_DIRECT into host memory, 16
      at a time (the members' ceiling for those bytes)
  (b) mxfs: `KVStore.batch_get` into the device tensors (each block's xxh3 checked
      before it counts as a hit), on the mount; where FUSE is missing the KVStore
      cannot run (its index lives in the daemon), so the chunks go into the unmounted
      pool with `mxfs put`'s code and are read by the same direct reader (OfflinePool)
      through a pinned buffer, and the KVStore arm says why it was skipped
  (c) plain: one file per chunk in a plain folder, read one after another into a
      pinned buffer and copied to the device (what a simple file tier does)
Every get's bytes are compared with what was put.
"""

from __future__ import annotations

import argparse
import glob
import mmap
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from gpu_check_common import gbps, median, raw_reads, sync, timed

from mxfs.admin.offline_put import put_files
from mxfs.cli.measure import drop_caches
from mxfs.client.direct import DirectFile, open_reader
from mxfs.io import read_batch
from mxfs.load.staging import aligned_host, writable_view

BATCH = 16  # chunks a get asks for at once (KVStore's own bound with 4 members)


def chunk_size(args: argparse.Namespace) -> int:
    """--kv-chunk, else 2 MiB (8 tokens of a 32B model's KV), less for tiny runs, but
    always above the inline bound, so the direct path is what runs."""
    if args.kv_chunk:
        return args.kv_chunk
    return max(512 << 10, min(2 << 20, args.kv_size // 8)) // 4096 * 4096


def _chunk_files(members: list[str]) -> set[str]:
    return {p for m in members for p in glob.glob(os.path.join(m, "chunks", "*", "*"))}


def _fsync_write(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


class Plain:
    """One file per chunk in a plain folder."""

    def __init__(self, folder: str, n: int) -> None:
        self.paths = [os.path.join(folder, f"chunk-{i:06d}.bin") for i in range(n)]

    def put(self, src: torch.Tensor) -> None:
        for i, p in enumerate(self.paths):
            row = src[i].cpu()  # held: the view points into it
            _fsync_write(p, writable_view(row))

    def get(self, outs: torch.Tensor, host: torch.Tensor) -> int:
        view = writable_view(host)
        for i, p in enumerate(self.paths):
            with open(p, "rb", buffering=0) as f:
                f.readinto(view)
            outs[i].copy_(host)  # from pinned memory: waits for the copy
        return len(self.paths)


def _kvstore(mount: str, keys: list[str]) -> tuple[Any, Callable[[torch.Tensor], None],
                                                    Callable[[torch.Tensor], int]]:
    from mxfs.kv import KVStore

    kv = KVStore(mount, "gpu-check")

    def put(src: torch.Tensor) -> None:
        for i in range(0, len(keys), BATCH):
            stored = kv.batch_put(keys[i:i + BATCH], list(src[i:i + BATCH]))
            if not all(stored):
                raise RuntimeError(f"KVStore stored {sum(stored)} of {len(stored)} new chunks")

    def get(outs: torch.Tensor) -> int:
        hits = 0
        for i in range(0, len(keys), BATCH):
            hits += sum(bool(g) for g in kv.batch_get(keys[i:i + BATCH],
                                                      list(outs[i:i + BATCH])))
        return hits
    return kv, put, get


def _offline(member: str, plain: Plain, chunk: int, pin: bool
             ) -> tuple[Any, Callable[[torch.Tensor], int]]:
    """The unmounted pool's direct reader, BATCH chunks a batch through one pinned buffer."""
    from mxfs.pool.offline import OfflinePool

    pool = OfflinePool(member)
    names = ["/" + os.path.basename(p) for p in plain.paths]
    host = aligned_host(BATCH * chunk, pin)
    view = writable_view(host)

    def get(outs: torch.Tensor) -> int:
        for i in range(0, len(names), BATCH):
            part = names[i:i + BATCH]
            # (with a pool, open_reader gives a DirectFile)
            readers = [cast(DirectFile, open_reader(name, pool=pool)) for name in part]
            try:
                read_batch([op for j, r in enumerate(readers)
                            for op in r.plan_reads([(0, view[j * chunk:(j + 1) * chunk])])])
            finally:
                for r in readers:
                    r.close()
            outs[i:i + len(part)].copy_(host[:len(part) * chunk].view(len(part), chunk))
        return len(names)
    return pool, get


def run(args: argparse.Namespace, work: str, mount: str, why_unmounted: str,
        members: list[str]) -> dict[str, Any]:
    dev = torch.device(args.device)
    pin = dev.type == "cuda"
    chunk = chunk_size(args)
    n = max(4, args.kv_size // chunk)
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randint(0, 256, (n, chunk), dtype=torch.uint8, generator=g, device=dev)
    outs = torch.empty_like(src)
    keys = [f"gpu-check/layer-all/chunk-{i:06d}" for i in range(n)]
    folder = os.path.join(work, "plain-kv")
    os.makedirs(folder)
    plain = Plain(folder, n)
    out: dict[str, Any] = {"chunks": n, "chunk_bytes": chunk, "bytes": n * chunk,
                           "device": str(dev), "repeat": args.repeat}
    before = _chunk_files(members)
    out["put_s"] = {"c_plain_files": timed(lambda: plain.put(src), dev)[0]}
    host = aligned_host(chunk, pin)
    arms: dict[str, Callable[[], int]] = {}
    closing: Any = None
    if mount:
        closing, put, get = _kvstore(mount, keys)
        out["put_s"]["b_mxfs_kvstore"] = timed(lambda: put(src), dev)[0]
        arms["b_mxfs_kvstore"] = lambda: get(outs)
        out["mxfs_arm"] = "KVStore on the mount"
    else:
        out["b_mxfs_kvstore"] = {"skipped": f"KVStore needs a mounted pool: {why_unmounted}"}
        out["put_s"]["b_mxfs_offline"] = timed(
            lambda: put_files(members[0], plain.paths, "/"), dev)[0]
        closing, get = _offline(members[0], plain, chunk, pin)
        arms["b_mxfs_offline"] = lambda: get(outs)
        out["mxfs_arm"] = ("unmounted pool: OfflinePool's direct reader (the read path "
                           "KVStore uses); put = mxfs put's code, from the plain files")
    try:
        files = sorted(p for p in _chunk_files(members) - before if os.path.getsize(p))
        bufs = [memoryview(mmap.mmap(-1, -(-os.path.getsize(p) // 4096) * 4096)) for p in files]
        for b in bufs:
            b[:] = bytes(len(b))
        raw_bytes = sum(os.path.getsize(p) for p in files)
        out["raw_files"], out["raw_bytes"] = len(files), raw_bytes
        arms = {"a_raw_chunks": lambda: raw_reads(files, bufs), **arms,
                "c_plain_files": lambda: plain.get(outs, host)}
        out["equal"] = _check(arms, outs, src, n, dev)
        out["cold_is_cold"] = drop_caches()
        out["rounds"] = []
        for _ in range(args.repeat):
            result: dict[str, Any] = {}
            for name, arm in arms.items():
                result[name] = {}
                drop_caches()
                for kind in ("cold", "warm"):
                    outs.zero_()
                    seconds, got = timed(arm, dev)
                    result[name][kind] = gbps(raw_bytes if name == "a_raw_chunks"
                                              else n * chunk, seconds)
                    if name != "a_raw_chunks" and (got != n or not torch.equal(outs, src)):
                        out["equal"][name] = False
            out["rounds"].append(result)
        out["median"] = {arm: {k: median([r[arm][k] for r in out["rounds"]])
                               for k in ("cold", "warm")} for arm in arms}
    finally:
        closing.close()
    out["put_GBps"] = {k: gbps(n * chunk, s) for k, s in out["put_s"].items()}
    return out


def _check(arms: dict[str, Callable[[], int]], outs: torch.Tensor, src: torch.Tensor,
           n: int, dev: torch.device) -> dict[str, bool]:
    """Each getting arm once, untimed: every chunk a hit and its bytes equal to the put's."""
    equal = {}
    for name, arm in arms.items():
        if name == "a_raw_chunks":
            continue
        outs.zero_()
        got = arm()
        sync(dev)
        equal[name] = got == n and torch.equal(outs, src)
    return equal

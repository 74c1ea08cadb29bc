"""The checkpointers a trainer would pick instead of mxfs.ckpt, as their users drive them.

Used by tools/bench_ckpt.py.  Every arm saves the same state dict and reports two
times: how long the training loop is blocked (until the call returns, or until the
peer says its copy of the state is staged) and how long until the checkpoint is
durable (every file the peer wrote fsynced, and the folders that name them: the bench
does the fsyncs the peer leaves out, inside the clock).  Every arm's checkpoint is
then loaded back the peer's own way and compared with the state byte for byte.

    torch.save                  + fsync of the file and its folder
    safetensors.save_file       tensors by their dotted names, the rest of the tree as
                                JSON in the header's metadata; + fsync
    DCP FileSystemWriter        dcp.save, thread_count 1, 2, 4 (fsyncs its files itself)
    DCP async_save, thread      FileSystemWriter staged by DCP, written on a thread
    DCP async_save, process     async_checkpointer_type=PROCESS: a checkpoint daemon
                                process (started once, outside the clock) writes it
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mxfs.ckpt.tree import flatten, unflatten

Save = Callable[[Any, str], tuple[float, float]]
Check = Callable[[Any, str], str | None]


@dataclass
class Arm:
    """One checkpointer: `save(state, path)` gives (blocked, durable) seconds;
    `check(state, path)` gives None when the checkpoint loads back equal, else why not."""

    key: str
    label: str
    where: str  # "plain" or "mount": the folder the bench hands it
    save: Save
    check: Check
    setup: Callable[[str], None] | None = None  # once, before the first round (untimed)


# ---- durability --------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under `path` (or `path` itself), every folder there, and the
    folder that names `path`: what "durable" asks of a peer that leaves it out."""
    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for name in files:
                fsync_path(os.path.join(root, name))
            fsync_path(root)
    else:
        fsync_path(path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


# ---- equality ----------------------------------------------------------------------------


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def difference(want: Any, got: Any, where: str = "") -> str | None:
    """Where `got` differs from `want` (tensors byte for byte), or None."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: {type(got).__name__}, not a tensor"
        if not same_bytes(want, got):
            return (f"{where}: {got.dtype} {tuple(got.shape)} differs from "
                    f"{want.dtype} {tuple(want.shape)}")
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(map(str, want)) != set(map(str, got)):
            return f"{where}: keys {sorted(map(str, got)) if isinstance(got, dict) else got}"
        by_name = {str(k): v for k, v in got.items()}
        for k, v in want.items():
            d = difference(v, got[k] if k in got else by_name[str(k)], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{where}: {got!r}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            d = difference(w, g, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if want == got else f"{where}: {got!r} != {want!r}"


def template(state: Any) -> Any:
    """The state's shape with fresh zeroed tensors: what DCP loads into, in place."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [template(v) for v in state]
    if isinstance(state, tuple):
        return tuple(template(v) for v in state)
    return state


# ---- the peers ---------------------------------------------------------------------------


def torch_save(state: Any, path: str) -> tuple[float, float]:
    start = time.perf_counter()
    torch.save(state, path)
    blocked = time.perf_counter() - start
    fsync_tree(path)
    return blocked, time.perf_counter() - start


def torch_check(state: Any, path: str) -> str | None:
    return difference(state, torch.load(path, weights_only=True))


def safetensors_save(state: Any, path: str) -> tuple[float, float]:
    from safetensors.torch import save_file

    start = time.perf_counter()
    tree, tensors = flatten(state)
    save_file(dict(tensors), path, metadata={"tree": json.dumps(tree)})
    blocked = time.perf_counter() - start
    fsync_tree(path)
    return blocked, time.perf_counter() - start


def safetensors_check(state: Any, path: str) -> str | None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        tree = json.loads(f.metadata()["tree"])
    return difference(state, unflatten(tree, load_file(path)))


def dcp_save(writer: Callable[[str], Any]) -> Save:
    def save(state: Any, path: str) -> tuple[float, float]:
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer(path))
        blocked = time.perf_counter() - start
        fsync_tree(path)
        return blocked, time.perf_counter() - start

    return save


def dcp_async(writer: Callable[[str], Any], kind: str, durable_fsync: bool = True) -> Save:
    """dcp.async_save: blocked until it returns (or, where it answers with staging and
    upload futures, until staging is done); durable once the upload is and fsyncs."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    how = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD

    def save(state: Any, path: str) -> tuple[float, float]:
        start = time.perf_counter()
        res = dcp.async_save(state, storage_writer=writer(path), async_checkpointer_type=how)
        if isinstance(res, Future):
            upload = res
        else:  # AsyncSaveResponse
            res.staging_completion.result()
            upload = res.upload_completion
        blocked = time.perf_counter() - start
        upload.result()
        if durable_fsync:
            fsync_tree(path)
        return blocked, time.perf_counter() - start

    return save


def dcp_check(reader: Callable[[str], Any]) -> Check:
    def check(state: Any, path: str) -> str | None:
        into = template(state)
        dcp.load(into, storage_reader=reader(path))
        return difference(state, into)

    return check


def stop_process_checkpointer() -> None:
    """End DCP's checkpoint daemon process, if one was started."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        ape._CHECKPOINT_PROCESS = None
        proc.__del__()


def peers(threads: tuple[int, ...] = (1, 2, 4), async_threads: int = 1) -> list[Arm]:
    """The peers, writing into the plain folder."""
    fs_w = dcp.FileSystemWriter
    fs_r = dcp.FileSystemReader
    arms = [
        Arm("torch_save", "torch.save + fsync", "plain", torch_save, torch_check),
        Arm("safetensors", "safetensors.save_file + fsync", "plain", safetensors_save,
            safetensors_check),
    ]
    for n in threads:
        arms.append(Arm(f"dcp_t{n}", f"DCP FileSystemWriter, thread_count {n}", "plain",
                        dcp_save(partial(fs_w, thread_count=n)), dcp_check(fs_r)))

    def writer(p: str) -> Any:
        return fs_w(p, thread_count=async_threads)

    for kind in ("thread", "process"):
        arms.append(Arm(f"dcp_async_{kind}",
                        f"DCP async_save ({kind}), thread_count {async_threads}", "plain",
                        dcp_async(writer, kind), dcp_check(fs_r),
                        setup=_warm_process if kind == "process" else None))
    return arms


def _warm_process(folder: str) -> None:
    """Start DCP's checkpoint process once, as a trainer's first save would (untimed)."""
    path = os.path.join(folder, "dcp-process-warmup")
    dcp_async(dcp.FileSystemWriter, "process", durable_fsync=False)(
        {"w": torch.zeros(4)}, path)

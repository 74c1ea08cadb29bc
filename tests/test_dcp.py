"""torch.distributed.checkpoint through mxfs: several ranks (gloo, CPU) save, async-save, load."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Mounted, mxfs
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

import mxfs.ckpt as ck
from mxfs.ckpt.dcp import Reader, Writer

# DCP passes our error on, wrapped in its own exception when it ran inside a collective.
REFUSED = (ck.CheckpointError, CheckpointException)

RANK = r"""
import gc, os, sys, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from mxfs.ckpt.dcp import Reader, Writer

root = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

def main():
    mesh = init_device_mesh("cpu", (world,))

    def state(scale):
        g = torch.Generator().manual_seed(7)
        full = torch.randn(8 * world, 33, generator=g) * scale
        return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                          "b": torch.arange(10.0) * scale,  # replicated: one rank writes it
                          "h": (torch.ones(5) * scale).bfloat16()},
                "extra": {"step": int(scale), "note": "hi"}}

    dcp.save(state(1), storage_writer=Writer(root + "/sync"))
    dcp.async_save(state(2), storage_writer=Writer(root + "/async")).result()
    for name, scale in (("sync", 1), ("async", 2)):
        want = state(scale)
        got = state(0)
        dcp.load(got, storage_reader=Reader(root + "/" + name))
        assert torch.equal(got["model"]["w"].to_local(), want["model"]["w"].to_local()), name
        assert torch.equal(got["model"]["b"], want["model"]["b"]), name
        assert torch.equal(got["model"]["h"], want["model"]["h"]), name
        assert got["extra"] == want["extra"], (name, got["extra"])

main()
# The mesh and its DTensors are gone with main(), so the process group is freed here,
# while Python runs. Left to the interpreter's exit, gloo's worker thread drops the last
# tensors of a finished collective during finalization, cannot take the GIL, exits the
# thread through a noexcept frame and aborts the rank ("terminate called without an
# active exception", about 1 run in 15 before).
gc.collect()
dist.destroy_process_group()
print("rank", rank, "ok", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(roots: list[Path], script: str = RANK) -> None:
    """A rank a root (each the same folder of the pool, seen through its rank's mount:
    ranks on several nodes), saving, async-saving and loading back (or `script`)."""
    world = len(roots)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(root)], env={**env,
                              "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, root in enumerate(roots)]
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and f"rank {r} ok" in out, err[-3000:]


SOLO = r"""
import sys, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mxfs.ckpt.catalog import CheckpointError
from mxfs.ckpt.dcp import Writer

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    dcp.save({"w": torch.ones(4) * rank}, storage_writer=Writer(sys.argv[1] + "/solo"),
             use_collectives=False)
except CheckpointError as e:
    assert "use_collectives" in str(e), e
    dist.barrier()
    dist.destroy_process_group()
    print("rank", rank, "ok", flush=True)
"""


def test_ranks_saving_without_collectives_are_refused(tmp_path: Path) -> None:
    """With use_collectives=False each rank plans alone: the coordinator published its
    own shard as the whole checkpoint, without waiting for the others, and DCP loaded
    it without a word.  Every rank is refused, and nothing is listed or left."""
    run_ranks([tmp_path] * 2, SOLO)
    assert ck.list_checkpoints(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == []


@contextlib.contextmanager
def _small_folder(path: Path, size: str) -> Iterator[Path]:
    """A real file system of `size` bytes at `path` (tmpfs): it fills up."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "mxfs-test", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_save_that_fails_leaves_nothing_and_the_name_saves_again(tmp_path: Path) -> None:
    """A DCP save that fills its file system fails, and its hidden folder goes with its
    rank files (it stayed: the pool stayed full, and a save of the same name was
    refused, "another process is saving", while the job lived).  A save with DCP's plan
    caching, whose second plan names the first save's folder, is refused the same way.
    A checkpointer's close raises a failure nothing reported."""
    big = {"a": torch.randn(1 << 20)}  # (4 MiB)
    with _small_folder(tmp_path / "small", "1m") as small:
        with pytest.raises(REFUSED + (OSError,)):
            dcp.save(big, storage_writer=Writer(small / "c"))
        assert os.listdir(small) == []
        dcp.save({"a": torch.ones(8)}, storage_writer=Writer(small / "c"))
        assert [e.name for e in ck.list_checkpoints(str(small))] == ["c"]
        saver = ck.Checkpointer()
        saver.save(big, str(small / "d"))
        with pytest.raises(ck.CheckpointError):
            saver.close()
    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp.save({"a": torch.ones(8)}, storage_writer=Writer(tmp_path / "one"), planner=planner)
    with pytest.raises(REFUSED, match="plan caching"):
        dcp.save({"a": torch.ones(8) * 2}, storage_writer=Writer(tmp_path / "two"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
    assert sorted(os.listdir(tmp_path)) == ["latest", "one", "small"]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_save_async_save_and_load_through_mxfs(mounted: Mounted, world: int) -> None:
    root = mounted.path / "dcp"
    root.mkdir()
    run_ranks([root] * world)
    for name in ("sync", "async"):
        # the manifest and one file per rank (each holds a shard of w)
        assert sorted(os.listdir(root / name)) == ["mxfs-checkpoint.json"] + [
            f"rank-{r:05}.safetensors" for r in range(world)]
        assert ck.verify(str(root / name)) == []
    assert json.loads(mxfs("ckpt", "verify", "--json", str(root / "sync")).stdout)[0]["ok"]
    assert [e.name for e in ck.list_checkpoints(str(root))] == ["sync", "async"]
    # one process, no process group: the shards come back as one full tensor
    g = torch.Generator().manual_seed(7)
    full = torch.randn(8 * world, 33, generator=g)
    got = {"model": {"w": torch.zeros(8 * world, 33), "b": torch.zeros(10),
                     "h": torch.zeros(5, dtype=torch.bfloat16)}, "extra": {}}
    dcp.load(got, storage_reader=Reader(str(root / "sync")))
    assert torch.equal(got["model"]["w"], full)
    assert torch.equal(got["model"]["b"], torch.arange(10.0))
    with pytest.raises(ck.CheckpointError, match="DCP checkpoint"):
        ck.load(str(root / "sync"))


def test_a_load_reads_a_file_in_batches_and_fills_every_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader holds about READ_BATCH bytes of a file at once: with a batch smaller
    than one tensor, every tensor is its own read, and the state loads whole."""
    from mxfs.ckpt import dcp as mxfs_dcp

    state = {f"w{i}": torch.randn(64, 33 + i) for i in range(9)}
    state["meta"] = {"step": 7}  # (a bytes item among the tensors)
    dcp.save(state, storage_writer=Writer(tmp_path / "c"))
    reads: list[int] = []
    real = mxfs_dcp.read_ranges

    def counted(path: str, info: dict[str, Any], ranges: list[tuple[int, int]]) -> Any:
        reads.append(len(ranges))
        return real(path, info, ranges)
    monkeypatch.setattr(mxfs_dcp, "read_ranges", counted)
    monkeypatch.setattr(mxfs_dcp, "READ_BATCH", 4096)
    got = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    got["meta"] = {"step": 0}
    dcp.load(got, storage_reader=Reader(tmp_path / "c"))
    assert all(torch.equal(got[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert got["meta"] == {"step": 7}
    assert len(reads) >= 9 and max(reads) <= 2


@pytest.mark.unit
def test_image_windows_put_together_are_the_staged_image() -> None:
    """Gathered a window at a time (any window, across the header, slots and the gaps
    between them), a file image is byte for byte the one staged whole."""
    from mxfs.ckpt.host_buffer import ImageWindows, stage
    from mxfs.ckpt.image import plan

    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int16)),
             ("c", torch.randn(40, 33).bfloat16().t()), ("d", torch.empty(0)),
             ("e", torch.tensor(2.5))]  # (c: not contiguous; d: no bytes)
    p = plan(named, {"format": "pt"})
    whole = torch.full((p.size,), 7, dtype=torch.uint8)
    stage(p, named, whole)
    for window in (1, 100, 4096, p.size):
        got = torch.full((p.size,), 9, dtype=torch.uint8)
        windows = ImageWindows(p, named)
        for start in range(0, p.size, window):
            end = min(p.size, start + window)
            windows.fill(got[start:end], start, end)
        assert torch.equal(got, whole), window


def test_a_save_larger_than_its_window_loads_back_equal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxfs.ckpt import dcp as mxfs_dcp

    monkeypatch.setattr(mxfs_dcp, "WINDOW", 1)  # (one checksum block a window)
    state = {f"w{i}": torch.randn(300, 257 + i) for i in range(6)}
    dcp.save(state, storage_writer=Writer(tmp_path / "c"))
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=Reader(tmp_path / "c"))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert ck.verify(str(tmp_path / "c")) == []  # (every block's checksum)


def test_single_process_dcp_on_a_plain_folder_and_refusals(tmp_path: Path) -> None:
    state = {"a": torch.randn(100, 7), "n": {"x": 3}}
    dcp.save(state, storage_writer=Writer(tmp_path / "c"))
    got = {"a": torch.zeros(100, 7), "n": {"x": 0}}  # DCP loads the keys it is given
    dcp.load(got, storage_reader=Reader(tmp_path / "c"))
    assert torch.equal(got["a"], state["a"]) and got["n"] == {"x": 3}
    with pytest.raises(REFUSED, match="already exists"):
        dcp.save(state, storage_writer=Writer(tmp_path / "c"))
    ck.save({"a": torch.ones(2)}, str(tmp_path / "plain")).wait()
    with pytest.raises(REFUSED, match="not DCP"):
        dcp.load(got, storage_reader=Reader(tmp_path / "plain"))


def test_a_damaged_dcp_entry_is_refused_in_one_line(tmp_path: Path) -> None:
    """A storage entry of the manifest's DCP metadata whose shape does not fit its
    bytes, or that lacks its place, is a damaged checkpoint, said so: it raised
    torch's RuntimeError (or a KeyError) from deep in the load, or, of length 0,
    loaded uninitialised memory."""
    state = {"a": torch.randn(3, 4)}
    for case in ("shape", "offset", "length"):
        dcp.save(state, storage_writer=Writer(tmp_path / case))
        manifest_path = tmp_path / case / "mxfs-checkpoint.json"
        manifest = json.loads(manifest_path.read_text())
        entry = manifest["dcp"]["storage"][0][1]
        if case == "shape":
            entry["shape"] = [5]
        elif case == "length":  # (none read: its tensor was uninitialised memory)
            entry["length"] = 0
        else:
            del entry["offset"]
        manifest_path.write_text(json.dumps(manifest))
        with pytest.raises(REFUSED) as e:
            dcp.load({"a": torch.zeros(3, 4)}, storage_reader=Reader(tmp_path / case))
        # (DCP's own exception carries each rank's: ours, CheckpointCorrupt, named)
        assert "DCP entry of a in the manifest is damaged" in str(e.value), str(e.value)

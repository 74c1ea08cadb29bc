"""Sharded checkpoints: `model.safetensors.index.json` or a folder of safetensors files.

`load_model` yields (name, tensor) pairs for an engine's `load_weights`, one file
at a time, so memory holds at most one shard's tensors beyond what the caller
keeps.  With `tp_rank`/`tp_size` and a `shard_dim(name, shape)` rule it reads
only the byte ranges of the slice that rank needs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mxfs.client.direct import Reader, open_reader
from mxfs.errors import MxfsError
from mxfs.load.header import TensorInfo
from mxfs.load.options import FileLoad, LoadOptions, LoadReport
from mxfs.load.staging import writable_view
from mxfs.load.tensors import check_device, load_file, read_header, torch_dtype

INDEX_NAME = "model.safetensors.index.json"
ShardRule = Callable[[str, tuple[int, ...]], "int | None"]


class _Tree:
    """The files a model path names: through the OS (a mount, any folder), or inside
    an unmounted pool (`mxfs.pool.offline.OfflinePool`)."""

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool

    def kind(self, path: str) -> str | None:
        """"file", "dir", or None when nothing is there."""
        if self.pool is None:
            return "dir" if os.path.isdir(path) else "file" if os.path.isfile(path) else None
        try:
            node = self.pool.resolve(path)
        except OSError:
            return None
        return "dir" if node.is_dir else "file" if node.is_reg else None

    def listdir(self, path: str) -> list[str]:
        return self.pool.listdir(path) if self.pool is not None else os.listdir(path)

    def size(self, path: str) -> int:
        return self.pool.resolve(path).size if self.pool is not None else os.path.getsize(path)

    def read(self, path: str) -> bytes:
        """A small file's bytes (an index)."""
        with open_reader(path, pool=self.pool) as r:
            buf = bytearray(r.size)
            r.read_into(0, memoryview(buf))
        return bytes(buf)


def shard_files(path: str, pool: Any = None) -> dict[str, list[str] | None]:
    """file -> tensor names it should hold (None: all of them), in file name order."""
    tree = _Tree(pool)
    index = path if path.endswith(".json") else os.path.join(path, INDEX_NAME)
    if tree.kind(index) == "file":
        try:
            weight_map = json.loads(tree.read(index))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MxfsError(f"{index} is not a safetensors index ({e})",
                            "it needs a weight_map of tensor name -> file") from None
        folder = os.path.dirname(index)
        files: dict[str, list[str] | None] = {}
        for name, fname in weight_map.items():
            entry = files.setdefault(os.path.join(folder, _shard_name(index, name, fname)), [])
            assert entry is not None
            entry.append(name)
        return dict(sorted(files.items()))
    kind = tree.kind(path)
    if kind == "dir":
        found = sorted(f for f in tree.listdir(path) if f.endswith(".safetensors"))
        if found:
            return {os.path.join(path, f): None for f in found}
    if kind == "file" and path.endswith(".safetensors"):
        return {path: None}
    raise MxfsError(f"{path} holds no safetensors model", f"give a folder with {INDEX_NAME} "
                    "or .safetensors files, or one of those files")


def _shard_name(index: str, tensor: str, fname: object) -> str:
    """An index's file name for `tensor`: a plain name in the index's folder, never a
    path (an index someone else wrote must not send the loader elsewhere)."""
    if not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname \
            or "\0" in fname:
        raise MxfsError(f"{index}: tensor {tensor!r} names file {fname!r}, not a file "
                        "beside the index", "an index's weight_map names plain file names")
    return fname


def slice_bounds(length: int, rank: int, size: int) -> tuple[int, int]:
    """The [start, stop) of `rank`'s share of `length` rows (like torch.chunk)."""
    step = math.ceil(length / size) if length else 0
    start = min(rank * step, length)
    return start, min(start + step, length)


def _read_slice(reader: Reader, info: TensorInfo, dim: int, rank: int, size: int
                ) -> torch.Tensor:
    """Only the bytes of rank's slice along `dim`: one contiguous run per outer index."""
    dtype = torch_dtype(info, reader.path)
    shape = list(info.shape)
    start, stop = slice_bounds(shape[dim], rank, size)
    out_shape = shape[:dim] + [stop - start] + shape[dim + 1:]
    out = torch.empty(out_shape, dtype=dtype)
    if out.numel() == 0:
        return out
    elem = out.element_size()
    inner = math.prod(shape[dim + 1:]) * elem
    outer = math.prod(shape[:dim])
    run = (stop - start) * inner
    view = writable_view(out)
    ranges = [(info.begin + (i * shape[dim] + start) * inner, view[i * run:(i + 1) * run])
              for i in range(outer)]
    reader.read_many(ranges)
    return out


def load_model(path: str, device: str | torch.device = "cpu", *,
               tp_rank: int = 0, tp_size: int = 1, shard_dim: ShardRule | None = None,
               progress: bool | None = None, pool: Any = None,
               options: LoadOptions | None = None, report: LoadReport | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a (sharded) model; with tp_size > 1, only this rank's slices.

    `progress` shows a bar per shard on stderr (default: for models over 1 GiB when
    stderr is a terminal); throughput goes to the log either way.  With `pool` (an
    `OfflinePool`), `path` is inside that unmounted pool.  `options` say how bytes
    move (default: `LoadOptions.from_env()`); `report` gets what each file did.
    """
    opts = options or LoadOptions.from_env()
    dev = check_device(device)
    if not 0 <= tp_rank < tp_size:
        raise MxfsError(f"tp_rank {tp_rank} is not within 0..{tp_size - 1}",
                        "pass 0 <= tp_rank < tp_size")
    files = shard_files(path, pool)
    sizes = {f: _Tree(pool).size(f) for f in files}
    if progress is None:
        progress = sum(sizes.values()) > 1 << 30 and sys.stderr.isatty()
    with _Bar(progress, sum(sizes.values())) as bar:
        for file, names in files.items():
            yield from _load_shard(file, names, dev, tp_rank, tp_size, shard_dim, pool,
                                   opts, report)
            bar.advance(sizes[file])


class _Bar:
    """A rich progress bar over bytes of shards, or nothing."""

    def __init__(self, show: bool, total: int) -> None:
        self.progress = None
        if show:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            self.progress = Progress("loading", BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), transient=True)
            self.task = self.progress.add_task("load", total=total)

    def __enter__(self) -> _Bar:
        if self.progress:
            self.progress.start()
        return self

    def advance(self, n: int) -> None:
        if self.progress:
            self.progress.advance(self.task, n)

    def __exit__(self, *exc: object) -> None:
        if self.progress:
            self.progress.stop()


def _missing(file: str, name: str) -> MxfsError:
    return MxfsError(f"{file} has no tensor {name!r} named by the index",
                     "the index and the shard files do not match")


def _load_shard(file: str, names: list[str] | None, dev: torch.device, tp_rank: int,
                tp_size: int, shard_dim: ShardRule | None, pool: Any, opts: LoadOptions,
                report: LoadReport | None) -> Iterator[tuple[str, torch.Tensor]]:
    """One shard's tensors, whole or this rank's slices."""
    if tp_size == 1 or shard_dim is None:
        tensors = load_file(file, dev, opts.mode, pool, opts.staging, odirect=opts.odirect,
                            gds=opts.gds, report=report)
        for name in names or list(tensors):
            if name not in tensors:
                raise _missing(file, name)
            yield name, tensors.pop(name)
        return
    reader = open_reader(file, pool=pool, odirect=opts.odirect)
    moved = 0
    try:
        header = read_header(reader)
        wanted = names or [t.name for t in header.ordered()]
        for name in wanted:
            info = header.tensors.get(name)
            if info is None:
                raise _missing(file, name)
            dim = shard_dim(name, info.shape)
            if dim is None or not info.shape:
                t = torch.empty(info.shape, dtype=torch_dtype(info, file))
                if info.nbytes:
                    reader.read_into(info.begin, writable_view(t))
            else:
                t = _read_slice(reader, info, dim % len(info.shape), tp_rank, tp_size)
            reader.check_unchanged()
            moved += t.numel() * t.element_size()
            yield name, t.to(dev) if dev.type != "cpu" else t
    finally:
        reader.close()
        if report is not None:
            report.files.append(FileLoad(file, moved, "slices"))

"""Loading and verifying checkpoints: every byte checked against its xxh3 before use.

A data file is read whole through the direct path (every member at once) into
one aligned buffer; each block's checksum is compared with the manifest's, and
a mismatch names the file, the tensors it touches and, on mxfs, the member
holding it.  Uncompressed tensors are views of the buffer; compressed ones
are decoded frame by frame in parallel.
"""

from __future__ import annotations

import base64
import math
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
import zstandard

from mxfs.ckpt.catalog import DAMAGED, CheckpointError, checkpoint_folder, read_manifest
from mxfs.ckpt.image import dtype_named, frame_count, itemsize
from mxfs.ckpt.tree import unflatten
from mxfs.client.direct import DirectFile, PlainFile, Reader, open_reader
from mxfs.client.remote_file import RemoteFile
from mxfs.io.batch import executor
from mxfs.io.checksum import unpack_sums
from mxfs.load.staging import writable_view
from mxfs.load.tensors import check_device
from mxfs.safe_open import open_regular


class CheckpointCorrupt(CheckpointError):
    """Bytes of a checkpoint that do not match their checksum."""


@dataclass(frozen=True)
class Damage:
    file: str
    begin: int
    end: int
    tensors: list[str]
    member: int | None

    def describe(self) -> str:
        where = f" (on member {self.member})" if self.member is not None else ""
        names = ", ".join(self.tensors) or "the header"
        return (f"{self.file}: bytes [{self.begin}, {self.end}){where} fail their checksum; "
                f"tensors: {names}")


def _sums(path: str, info: dict[str, Any]) -> tuple[int, int, tuple[int, ...]]:
    """(size, block size, checksums) of a data file, checked for consistency."""
    size, unit = int(info["size"]), int(info["sum_unit"])
    try:
        sums = unpack_sums(base64.b64decode(info["sums"], validate=True))
    except (ValueError, struct.error):
        raise CheckpointCorrupt(f"{path}: its checksums are not readable", DAMAGED) from None
    if unit <= 0 or len(sums) != -(-size // unit):
        raise CheckpointCorrupt(f"{path}: {len(sums)} checksums for {size} bytes", DAMAGED)
    return size, unit, sums


def open_data(folder: str, fname: str, dir_fd: int | None = None) -> Reader:
    """A reader of the data file `fname` (a plain name: `read_manifest` checked it) of
    the checkpoint `folder` (`dir_fd`: the folder, open).  It must be a regular file of
    that folder: not a link (root verifying a tenant's checkpoint would read what it
    names), not a FIFO; the reader (direct, through the daemon, by name) is checked to
    read that very file."""
    if dir_fd is None:
        with checkpoint_folder(folder) as fd:
            return open_data(folder, fname, fd)
    path = os.path.join(folder, fname)
    try:
        fd = open_regular(fname, dir_fd)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing", DAMAGED) from None
    except OSError as e:
        raise CheckpointCorrupt(f"{path} {e.strerror}", DAMAGED) from None
    try:
        st = os.fstat(fd)
        try:
            r = open_reader(path)
        except OSError as e:
            raise CheckpointCorrupt(f"{path} cannot be read ({e.strerror})", DAMAGED) from None
    finally:
        os.close(fd)
    if not _same_file(r, st):
        r.close()
        raise CheckpointCorrupt(f"{path} was replaced while it was opened",
                                "try again once nobody changes the checkpoint")
    return r


def _same_file(r: Reader, st: os.stat_result) -> bool:
    if isinstance(r, PlainFile):
        got = os.fstat(r.fd)
        return (got.st_dev, got.st_ino) == (st.st_dev, st.st_ino)
    if isinstance(r, DirectFile | RemoteFile) and r.client is not None:
        return r.ino == st.st_ino and os.stat(r.client.mountpoint).st_dev == st.st_dev
    return False


def _read_runs(r: Reader, info: dict[str, Any], runs: list[tuple[int, int]]
               ) -> tuple[list[torch.Tensor], list[Damage]]:
    """Read whole blocks [first, last) for each run, every member at once; check them."""
    size, unit, sums = _sums(r.path, info)
    if r.size != size:  # (before any buffer: the manifest's size is anyone's to write)
        raise CheckpointCorrupt(f"{r.path} holds {r.size} bytes, its manifest says {size}",
                                DAMAGED)
    bufs = [torch.empty(min(size, b1 * unit) - b0 * unit, dtype=torch.uint8) for b0, b1 in runs]
    r.read_many([(b0 * unit, writable_view(b)) for (b0, _), b in zip(runs, bufs, strict=True)
                 if b.numel()])
    layout = r.layout if isinstance(r, DirectFile) else None
    jobs = [(k, writable_view(b)[(k - b0) * unit:(k - b0 + 1) * unit])
            for (b0, b1), b in zip(runs, bufs, strict=True) for k in range(b0, b1)]
    digests = executor().map(lambda job: xxhash.xxh3_64_intdigest(job[1]), jobs)
    damage = []
    for (k, _), got in zip(jobs, digests, strict=True):
        if got != sums[k]:
            begin, end = k * unit, min(size, (k + 1) * unit)
            hit = [n for n, t in info["tensors"].items() if _overlaps(t, begin, end)]
            damage.append(Damage(r.path, begin, end, hit,
                                 layout.locate(begin)[0] if layout else None))
    return bufs, damage


def _read_file(r: Reader, info: dict[str, Any]) -> tuple[torch.Tensor, list[Damage]]:
    """The whole file's bytes and the blocks that fail their checksum."""
    size, unit, _ = _sums(r.path, info)
    bufs, damage = _read_runs(r, info, [(0, -(-size // unit))])
    return bufs[0], damage


def read_ranges(path: str, info: dict[str, Any], ranges: list[tuple[int, int]]
                ) -> list[torch.Tensor]:
    """The bytes of each (offset, length) range of the data file `path` (in its
    checkpoint's folder, as `open_data`), read by whole verified blocks."""
    size, unit, _ = _sums(path, info)
    for off, n in ranges:
        if off < 0 or n < 0 or off + n > size:
            raise CheckpointCorrupt(f"{path}: range [{off}, {off + n}) is outside the file",
                                    "the checkpoint is damaged; load an older one")
    blocks = sorted({k for off, n in ranges if n
                     for k in range(off // unit, (off + n - 1) // unit + 1)})
    runs: list[tuple[int, int]] = []
    for k in blocks:
        if runs and runs[-1][1] == k:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    with open_data(os.path.dirname(path), os.path.basename(path)) as r:
        bufs, damage = _read_runs(r, info, runs)
    if damage:
        raise CheckpointCorrupt(damage[0].describe(), "load an older checkpoint (mxfs ckpt ls)")
    out = []
    for off, n in ranges:
        if not n:
            out.append(torch.empty(0, dtype=torch.uint8))
            continue
        i = next(i for i, (b0, b1) in enumerate(runs) if b0 * unit <= off < b1 * unit)
        base = runs[i][0] * unit
        out.append(bufs[i][off - base:off - base + n])
    return out


def _overlaps(t: dict[str, Any], begin: int, end: int) -> bool:
    where = t.get("stored", t)
    return int(where["offset"]) < end and begin < int(where["offset"]) + int(where["length"])


def _tensor(buf: torch.Tensor, name: str, t: dict[str, Any], path: str) -> torch.Tensor:
    dtype, shape = dtype_named(t["dtype"], CheckpointError, path), tuple(int(x) for x in t["shape"])
    nbytes = math.prod(shape) * itemsize(dtype)
    stored = t.get("stored")
    if stored is None:
        off = int(t["offset"])
        if int(t["length"]) != nbytes or off + nbytes > buf.numel() or off % itemsize(dtype):
            raise CheckpointCorrupt(f"{path}: tensor {name} does not fit its manifest entry",
                                    "the checkpoint is damaged; load an older one")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return buf[off:off + nbytes].view(dtype).view(shape)
    frame, off, pos = int(stored["frame"]), int(stored["offset"]), 0
    frames = [int(n) for n in stored["frames"]]
    if int(t["length"]) != nbytes or len(frames) != frame_count(nbytes, frame) \
            or sum(frames) != int(stored["length"]) or off + sum(frames) > buf.numel():
        raise CheckpointCorrupt(f"{path}: tensor {name} does not fit its manifest entry",
                                DAMAGED)  # (checked before its bytes are allocated)
    if nbytes and min(frames) <= 0:  # (no frame of zstd is empty)
        raise CheckpointCorrupt(f"{path}: tensor {name} has an empty compressed frame",
                                DAMAGED)
    try:
        out = torch.empty(shape, dtype=dtype)
    except RuntimeError as e:  # (a size no memory here holds: the manifest's word)
        raise CheckpointError(f"{path}: tensor {name} of {nbytes} bytes cannot be "
                              f"allocated ({str(e).splitlines()[0][:120]})",
                              "load it on a machine with the memory, or, if the "
                              "checkpoint is damaged, load an older one") from None
    raw = writable_view(out) if nbytes else memoryview(b"")
    jobs = []
    for i, n in enumerate(frames):
        jobs.append((buf[off + pos:off + pos + int(n)], raw[i * frame:(i + 1) * frame]))
        pos += int(n)
    local = threading.local()

    def inflate(job: tuple[torch.Tensor, memoryview]) -> None:
        d = getattr(local, "d", None)
        if d is None:
            d = local.d = zstandard.ZstdDecompressor()
        src, dst = job
        got = d.decompress(writable_view(src), max_output_size=len(dst))
        if len(got) != len(dst):
            raise CheckpointCorrupt(f"{path}: tensor {name} decompresses to the wrong size",
                                    "the checkpoint is damaged; load an older one")
        dst[:] = got

    try:
        list(executor().map(inflate, jobs))
    except zstandard.ZstdError as e:
        raise CheckpointCorrupt(f"{path}: tensor {name} does not decompress ({e})",
                                "the checkpoint is damaged; load an older one") from None
    return out


def verify(path: str) -> list[Damage]:
    """Every block of the checkpoint at `path` that fails its checksum (empty: all good).
    Read VERIFY_WINDOW at a time (a block at least): read whole, a tenant's sparse data
    file of any size, taking no disk, took as much of root's memory."""
    damage = []
    with checkpoint_folder(path) as fd:
        manifest = read_manifest(path, fd)
        for fname, info in manifest["files"].items():
            with open_data(path, fname, fd) as r:
                size, unit, _ = _sums(r.path, info)
                blocks, step = -(-size // unit), max(1, VERIFY_WINDOW // unit)
                for b0 in range(0, max(blocks, 1), step):
                    damage += _read_runs(r, info, [(b0, min(blocks, b0 + step))])[1]
    return damage


VERIFY_WINDOW = 64 << 20  # bytes `verify` holds at once


def load(path: str, device: str | torch.device = "cpu", verify: bool = True) -> Any:
    """The state saved at `path`, its tensors on `device`, every byte checksum-verified.

    CPU tensors of an uncompressed checkpoint are views of one buffer per data
    file (kept alive by them).  A damaged block raises `CheckpointCorrupt`
    naming the file and the tensors.
    """
    dev = check_device(device)
    tensors: dict[str, torch.Tensor] = {}
    with checkpoint_folder(path) as fd:
        manifest = read_manifest(path, fd)
        if "tree" not in manifest:
            raise CheckpointError(f"{path} is a DCP checkpoint",
                                  "load it with torch.distributed.checkpoint.load(state, "
                                  "storage_reader=mxfs.ckpt.dcp.Reader(path))")
        for fname, info in manifest["files"].items():
            with open_data(path, fname, fd) as r:
                buf, damage = _read_file(r, info)
            if damage and verify:
                raise CheckpointCorrupt(damage[0].describe(),
                                        "load an older checkpoint (mxfs ckpt ls)")
            for name, t in info["tensors"].items():
                tensors[name] = _tensor(buf, name, t, r.path)
    if dev.type != "cpu":
        tensors = {k: v.to(dev) for k, v in tensors.items()}
    try:
        return unflatten(manifest["tree"], tensors)
    except (KeyError, ValueError, TypeError, RecursionError, RuntimeError) as e:
        raise CheckpointCorrupt(f"{path}: the manifest's structure is damaged "
                                f"({str(e).splitlines()[0][:200] if str(e) else e!r})",
                                "load an older checkpoint (mxfs ckpt ls)") from None

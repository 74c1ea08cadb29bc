"""The bytes of a checkpoint data file: a safetensors file laid out for direct writes.

The header is padded with spaces (which safetensors allows) so the data starts
on a 4 KiB boundary, and tensors are ordered by element size, largest first,
so each one starts aligned for its dtype.  The staging buffer *is* the file
image: tensors are copied once into their slots and the buffer goes to the
members as it is, with O_DIRECT.  A plan depends only on names, dtypes and
shapes, so saving the same state again reuses it.

Compressed files keep the safetensors container (each tensor stored as U8
bytes of independent zstd frames), so any safetensors reader can open them
and mxfs decodes them frame by frame, in parallel.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mxfs.io import PAGE
from mxfs.load.tensors import ST_DTYPES

ALIGN = PAGE  # slots and the image's length: what O_DIRECT writes of them need
_ST_NAMES = {dt: name for name, dt in ST_DTYPES.items() if dt is not None}


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_named(name: object, error: type[Exception], where: str) -> torch.dtype:
    """The torch dtype a manifest names, or `error` saying this torch lacks it."""
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise error(f"{where} holds dtype {name!r}, which this torch lacks",
                    "load it with a newer torch")
    return dt


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor's bytes sit in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int

    def manifest(self) -> dict[str, object]:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset, "length": self.nbytes}


@dataclass(frozen=True)
class Plan:
    """A data file's layout: header bytes, one slot per tensor, the file size."""

    header: bytes
    slots: list[Slot]
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


def signature(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[object, ...]:
    return tuple((n, t.dtype, tuple(t.shape)) for n, t in named)


def _header(entries: dict[str, dict[str, object]], metadata: dict[str, str]) -> bytes:
    """8-byte length + JSON, padded with spaces so the data starts 4 KiB aligned."""
    body = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    total = round_up(8 + len(body))
    return struct.pack("<Q", total - 8) + body + b" " * (total - 8 - len(body))


def plan(named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> Plan:
    """Lay out raw tensors: aligned data start, largest element size first."""
    order = sorted(range(len(named)), key=lambda i: -itemsize(named[i][1].dtype))
    entries: dict[str, dict[str, object]] = {}
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    pos = 0
    for i in order:
        name, t = named[i]
        n = t.numel() * itemsize(t.dtype)
        st = _ST_NAMES.get(t.dtype)
        # A dtype safetensors cannot name is kept as its bytes; the manifest has the type.
        entries[name] = {"dtype": st or "U8", "shape": list(t.shape) if st else [n],
                         "data_offsets": [pos, pos + n]}
        layout.append((name, t.dtype, tuple(t.shape), pos, n))
        pos += n
    header = _header(entries, metadata)
    slots = [Slot(name, dt, shape, len(header) + off, n) for name, dt, shape, off, n in layout]
    return Plan(header, slots, len(header) + pos)


def compressed_plan(raw: Plan, frames: dict[str, list[int]],
                    metadata: dict[str, str]) -> tuple[Plan, dict[str, int]]:
    """Lay out compressed tensors (frame lengths given); returns the plan and each offset."""
    entries: dict[str, dict[str, object]] = {}
    pos = 0
    rel: dict[str, int] = {}
    for s in raw.slots:
        n = sum(frames[s.name])
        entries[s.name] = {"dtype": "U8", "shape": [n], "data_offsets": [pos, pos + n]}
        rel[s.name] = pos
        pos += n
    header = _header(entries, {**metadata, "mxfs_compression": "zstd"})
    slots = [Slot(s.name, torch.uint8, (sum(frames[s.name]),), len(header) + rel[s.name],
                  sum(frames[s.name])) for s in raw.slots]
    return Plan(header, slots, len(header) + pos), {s.name: s.offset for s in slots}


def frame_count(nbytes: int, frame: int) -> int:
    return max(1, math.ceil(nbytes / frame)) if nbytes else 0

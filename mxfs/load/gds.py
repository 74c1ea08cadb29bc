"""GPUDirect Storage: chunk files read by DMA straight into GPU memory (kvikio / cuFile).

Chosen for CUDA loads of files on an mxfs pool when kvikio is installed and cuFile
runs with GDS.  kvikio's compatibility mode (no GDS driver, or a filesystem GDS
cannot serve) moves bytes through host buffers of its own, which is what the pinned
staging path already does under mxfs's control, so then that path runs instead.
Each member's chunk file is opened as a CuFile through /proc/self/fd: it is the very
file the daemon checked and handed over (the reopen needs root or the owner of the
chunk files).  Why GDS is not used is logged once per reason; MXFS_GDS=off turns it
off, MXFS_GDS=force uses kvikio even in compatibility mode (for comparisons).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from mxfs.client.direct import DIO_ALIGN, DirectFile, Reader
from mxfs.io import Layout

log = logging.getLogger("mxfs.load")


class Unavailable(Exception):
    """GPUDirect Storage cannot serve this load; the message says why."""


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [at, at + n) of the destination come from `member`'s chunk file at `offset`."""

    at: int
    n: int
    member: int
    offset: int


def plan(layout: Layout, offset: int, nbytes: int) -> list[Span]:
    """Every stripe piece of file range [offset, offset + nbytes), placed relative to
    `offset` in the destination (chunk offsets and destination places stay congruent
    modulo the stripe unit, so aligned device buffers get aligned DMA)."""
    spans = []
    for piece in layout.plan(offset, nbytes):
        pos = piece.chunk_offset
        for at, n in piece.spans:
            spans.append(Span(at, n, piece.member, pos))
            pos += n
    return spans


def _kvikio() -> Any:
    try:
        import kvikio
    except ImportError:
        raise Unavailable("kvikio is not installed (pip install kvikio-cu12, or kvikio-cu13 "
                          "for CUDA 13)") from None
    except Exception as e:  # its CUDA libraries failed to load
        raise Unavailable(f"kvikio does not load ({e})") from None
    return kvikio


def _compat_mode(kvikio: Any) -> bool:
    """Whether kvikio would serve reads without GDS (its POSIX compatibility mode)."""
    defaults = kvikio.defaults
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, name, None)
        if callable(fn):
            return bool(fn())
    return False


class GdsReader:
    """A file's chunk files opened for cuFile, read into one device buffer at a time."""

    def __init__(self, reader: Reader, device: torch.device) -> None:
        policy = os.environ.get("MXFS_GDS", "auto")
        if device.type != "cuda":
            raise Unavailable(f"GPUDirect Storage serves CUDA devices, not {device}")
        if not isinstance(reader, DirectFile):
            raise Unavailable(f"{reader.path} is not on an mxfs pool")
        if policy == "off":
            raise Unavailable("MXFS_GDS=off")
        kvikio = _kvikio()
        if policy != "force" and _compat_mode(kvikio):
            raise Unavailable("cuFile would run in kvikio's compatibility mode (no GDS "
                              "driver, or a member filesystem GDS cannot serve)")
        self.reader, self.device = reader, device
        self.files: dict[int, Any] = {}
        try:
            for member, fd in reader.fds.items():
                self.files[member] = kvikio.CuFile(f"/proc/self/fd/{fd}", "r")
        except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError and OSError
            self.close()
            raise Unavailable(f"cuFile cannot open the chunk files ({e}); it reopens "
                              "them, which needs root or their owner") from None

    def read_to_device(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) in a uint8 tensor on the device; the reads
        of all members run at once (kvikio splits each into parallel tasks)."""
        lead = offset % DIO_ALIGN
        raw = torch.empty(lead + nbytes + DIO_ALIGN, dtype=torch.uint8, device=self.device)
        skip = -raw.data_ptr() % DIO_ALIGN  # device address congruent with the file
        dst = raw[skip:skip + lead + nbytes]
        pending = []
        for s in plan(self.reader.layout, offset - lead, lead + nbytes):
            f = self.files.get(s.member)
            if f is None:  # never written: zeros
                dst[s.at:s.at + s.n].zero_()
                continue
            pending.append((s, f.pread(dst[s.at:s.at + s.n], s.n, s.offset)))
        for s, future in pending:
            got = future.get()
            if got < s.n:  # past the end of a sparse chunk file: zeros
                dst[s.at + got:s.at + s.n].zero_()
        torch.cuda.current_stream(self.device).synchronize()
        return dst[lead:]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


_said: set[str] = set()


def open_gds(reader: Reader, device: torch.device, required: bool) -> GdsReader | None:
    """A GdsReader, or None (the reason logged once) when GDS cannot serve this load;
    with `required`, Unavailable instead."""
    try:
        return GdsReader(reader, device)
    except Unavailable as e:
        if required:
            raise
        if str(e) not in _said:
            _said.add(str(e))
            log.info("GPUDirect Storage not used: %s; loading through pinned host buffers", e)
        return None

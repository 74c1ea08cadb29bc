"""GPUDirect Storage: chunk files read by DMA straight into GPU memory (kvikio / cuFile).

Chosen for CUDA loads of files on an mxfs pool when kvikio is installed and cuFile
runs with GDS.  kvikio's compatibility mode (no GDS driver, or a filesystem GDS
cannot serve) moves bytes through host buffers of its own, which is what the pinned
staging path already does under mxfs's control, so then that path runs instead.
Each member's chunk file is opened as a CuFile through /proc/self/fd: it is the very
file the daemon checked and handed over (the reopen needs root or the owner of the
chunk files).  Why GDS is not used is logged once per reason; the gds option
(`mxfs.load.options`; MXFS_GDS) "off" turns it off, "force" uses kvikio even in
compatibility mode (for comparisons).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from mxfs.client.direct import DIO_ALIGN, DirectFile, Reader, RemoteFile
from mxfs.io import Layout

log = logging.getLogger("mxfs.load")


class Unavailable(Exception):
    """GPUDirect Storage cannot serve this load; the message says why."""


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [at, at + n) of the destination come from `member`'s chunk file at `offset`;
    only the first `have` of them exist there, the rest are a hole (zeros)."""

    at: int
    n: int
    member: int
    offset: int
    have: int


def plan(layout: Layout, offset: int, nbytes: int, lengths: dict[int, int]) -> list[Span]:
    """Every stripe piece of file range [offset, offset + nbytes), placed relative to
    `offset` in the destination (chunk offsets and destination places stay congruent
    modulo the stripe unit, so aligned device buffers get aligned DMA), clipped to what
    each chunk file holds (`lengths`; a member without one holds nothing)."""
    spans = []
    for piece in layout.plan(offset, nbytes):
        pos = piece.chunk_offset
        for at, n in piece.spans:
            have = max(0, min(n, lengths.get(piece.member, 0) - pos))
            spans.append(Span(at, n, piece.member, pos, have))
            pos += n
    return spans


def _kvikio() -> Any:
    try:
        import kvikio
        import kvikio.defaults  # noqa: F401 - kvikio 26.x no longer imports it with the package
    except ImportError:
        raise Unavailable("kvikio is not installed (pip install kvikio-cu12, or kvikio-cu13 "
                          "for CUDA 13)") from None
    except Exception as e:  # its CUDA libraries failed to load
        raise Unavailable(f"kvikio does not load ({e})") from None
    return kvikio


def _without_gds(kvikio: Any) -> str | None:
    """Why kvikio would serve reads without GDS (through host bounce buffers), or None."""
    defaults = kvikio.defaults
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, name, None)
        if callable(fn) and fn():
            return "cuFile would run in kvikio's compatibility mode"
    driver = getattr(kvikio, "cufile_driver", None)
    try:
        available = driver.get("is_gds_available") if driver is not None else True
    except Exception:  # noqa: BLE001 - older kvikio: no such property
        available = True
    if not available:
        return "cuFile reports GDS unavailable (no nvidia-fs driver or P2P DMA support)"
    return None


class GdsReader:
    """A file's chunk files opened for cuFile, read into one device buffer at a time."""

    def __init__(self, reader: Reader, device: torch.device, policy: str | None = None
                 ) -> None:
        policy = policy or os.environ.get("MXFS_GDS") or "auto"
        if device.type != "cuda":
            raise Unavailable(f"GPUDirect Storage serves CUDA devices, not {device}")
        if isinstance(reader, RemoteFile):
            raise Unavailable(f"{reader.path} is on another node's members (its bytes come "
                              "over the network, not from a local device)")
        if not isinstance(reader, DirectFile):
            raise Unavailable(f"{reader.path} is not on an mxfs pool")
        if policy == "off":
            raise Unavailable("turned off (gds=off)")
        kvikio = _kvikio()
        why = _without_gds(kvikio) if policy != "force" else None
        if why is not None:
            raise Unavailable(why)
        self.reader, self.device = reader, device
        # What each chunk file holds: reads stop there, the rest is a hole (zeros).
        self.lengths = {m: os.fstat(fd).st_size for m, fd in reader.fds.items()}
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
        stream = torch.cuda.current_stream(self.device)
        # cuFile's DMA is on no stream: let earlier work on this memory finish first.
        stream.synchronize()
        pending = []
        for s in plan(self.reader.layout, offset - lead, lead + nbytes, self.lengths):
            if s.have < s.n:  # never written, or past a sparse chunk file's end: zeros
                dst[s.at + s.have:s.at + s.n].zero_()
            if s.have:
                f = self.files[s.member]
                pending.append((s, f.pread(dst[s.at:s.at + s.have], s.have, s.offset)))
        errors = []
        for s, future in pending:  # every read ends before any error is raised
            try:
                got = future.get()
            except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError
                errors.append(e)
                continue
            if got < s.have:
                errors.append(OSError(f"member {s.member}: {s.have - got} bytes short at "
                                      f"chunk offset {s.offset + got}"))
        stream.synchronize()
        if errors:
            raise OSError(f"GPUDirect Storage read of {self.reader.path} failed: {errors[0]}")
        return dst[lead:]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


_said: set[str] = set()


def open_gds(reader: Reader, device: torch.device, required: bool,
             policy: str | None = None) -> GdsReader | str:
    """A GdsReader, or why GDS cannot serve this load (logged once per reason);
    with `required`, Unavailable instead."""
    try:
        return GdsReader(reader, device, policy)
    except Unavailable as e:
        if required:
            raise
        if str(e) not in _said:
            _said.add(str(e))
            log.info("GPUDirect Storage not used: %s; loading through pinned host buffers", e)
        return str(e)

"""Host staging for loads to an accelerator: bounded buffers, reads and copies overlapped.

The data section goes to one device buffer (the tensors are views of it), through a
few host buffers that share the staging budget: while filled ones are copied to the
device on a side stream, the next pieces are read into the others, every member at
once.  Host memory stays at the budget whatever the model's size, and the model is
never held twice.  On
CUDA the host buffers are pinned, so copies run at PCIe speed without a bounce; other
accelerators (Ascend through torch_npu) use their own stream module the same way, from
pageable memory the read has just filled (never from mapped, not-yet-resident pages).
"""

from __future__ import annotations

import ctypes
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from mxfs.client.direct import DIO_ALIGN, Reader

STAGING = 512 << 20  # bytes of host memory a load to a device uses, all buffers together
BUFFERS = 3  # host buffers the staging is cut into
READS_AHEAD = 2  # of them being filled at once (the rest wait to be copied out)


def writable_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no numpy needed)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def aligned_host(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor whose first byte sits on an DIO_ALIGN boundary (O_DIRECT needs it)."""
    raw = torch.empty(nbytes + DIO_ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % DIO_ALIGN
    return raw[skip:skip + nbytes]


def read_to_device(reader: Reader, offset: int, nbytes: int, device: torch.device,
                   staging: int = STAGING, buffers: int = BUFFERS,
                   reads: int = READS_AHEAD) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of `reader` in a uint8 tensor on `device`.

    The staging budget is cut into `buffers` host buffers; up to `reads` of them are
    being filled at once while the filled ones are copied out in order, so a read's
    slowest member (or ring) does not leave the next read waiting.  Pieces start on
    DIO_ALIGN boundaries of the file, into DIO_ALIGN-aligned host buffers, so the
    direct reader can move them with O_DIRECT; the lead-in before `offset` is read and
    not copied.
    """
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes == 0:
        return dst
    lead = offset % DIO_ALIGN
    total = lead + nbytes  # from the DIO_ALIGN boundary at or before offset
    piece = max(DIO_ALIGN,
                min(staging // buffers, total + DIO_ALIGN) // DIO_ALIGN * DIO_ALIGN)
    starts = list(range(0, total, piece))
    # A buffer is refilled only once its copy is queued, so a read in flight needs a
    # buffer beside the one being copied out: two at least, reads one fewer at most.
    buffers = min(max(2, buffers), len(starts))
    reads = max(1, min(reads, buffers - 1))
    accel: Any = getattr(torch, device.type) if device.type != "cpu" else None
    hosts = [aligned_host(piece, pin=device.type == "cuda") for _ in range(buffers)]
    done: list[Any] = [None] * buffers  # the copy out of each host buffer, once queued
    stream = accel.Stream(device) if accel is not None else None

    def fill(k: int) -> None:
        n = min(piece, total - starts[k])
        reader.read_into(offset - lead + starts[k], writable_view(hosts[k % buffers])[:n])

    with ThreadPoolExecutor(reads, thread_name_prefix="mxfs-stage") as ahead:
        pending = deque(ahead.submit(fill, k) for k in range(min(reads, len(starts))))
        try:
            for k, start in enumerate(starts):
                pending.popleft().result()
                nxt = k + reads
                if nxt < len(starts):
                    if done[nxt % buffers] is not None:
                        done[nxt % buffers].synchronize()  # its last copy left the buffer
                    pending.append(ahead.submit(fill, nxt))
                skip = lead if k == 0 else 0
                n = min(piece, total - start)
                src = hosts[k % buffers][skip:n]
                at = start + skip - lead
                if stream is None:
                    dst[at:at + len(src)].copy_(src)
                    continue
                with accel.stream(stream):
                    dst[at:at + len(src)].copy_(src, non_blocking=True)
                    event = accel.Event()
                    event.record(stream)
                done[k % buffers] = event
        finally:
            for f in pending:  # a failed read: the others end before their buffers go
                f.cancel()
    if stream is not None:
        stream.synchronize()
    return dst

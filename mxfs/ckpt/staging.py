"""Host staging: one reusable, aligned buffer per checkpointer, pinned when CUDA is there.

Copies from GPU tensors go on a side stream into pinned memory, so the
training stream is not blocked and the copy runs at PCIe speed; the event
recorded after the last copy says when the snapshot is staged.  Copies from
CPU tensors are done before `save` returns.  The buffer grows only when a
state dict outgrows it, so a training loop allocates it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import torch

from mxfs.ckpt.image import ALIGN, Plan, round_up
from mxfs.load.staging import aligned_host
from mxfs.load.tensors import writable_view


def _pin() -> bool:
    return torch.cuda.is_available()


class Staging:
    """A 4 KiB-aligned host buffer, reused across saves.

    `shared=True` puts it in named shared memory (page-aligned), so a writer
    process can attach to it by `name` and write from it directly.
    """

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self.shm: shared_memory.SharedMemory | None = None
        self._raw: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.allocations = 0

    @property
    def name(self) -> str:
        assert self.shm is not None
        return self.shm.name

    def ensure(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of at least `nbytes` (rounded to 4 KiB), aligned to 4 KiB."""
        want = round_up(max(nbytes, 1))
        if self.buf is None or self.buf.numel() < want:
            self.release()
            if self.shared:
                self.shm = shared_memory.SharedMemory(create=True, size=want)
                raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
                if _pin():
                    torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), want, 0)
            else:
                raw = aligned_host(want, _pin())
            skip = (-raw.data_ptr()) % ALIGN
            self._raw, self.buf = raw, raw[skip:skip + want]
            self.allocations += 1
        return self.buf[:want]

    def release(self) -> None:
        """Give the memory back (a later `ensure` allocates again)."""
        self.buf = self._raw = None
        if self.shm is not None:
            if _pin():
                torch.cuda.cudart().cudaHostUnregister(
                    torch.frombuffer(self.shm.buf, dtype=torch.uint8).data_ptr())
            self.shm.close()
            self.shm.unlink()
            self.shm = None

    def view(self, nbytes: int) -> memoryview:
        assert self.buf is not None
        return writable_view(self.buf)[:round_up(max(nbytes, 1))]


def stage(plan: Plan, named: Sequence[tuple[str, torch.Tensor]], buf: torch.Tensor) -> Any:
    """Copy the header and every tensor into `buf`; returns a CUDA event to wait on, or None."""
    buf[:len(plan.header)].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
    tensors = dict(named)
    streams: dict[torch.device, Any] = {}
    for slot in plan.slots:
        t = tensors[slot.name]
        if slot.nbytes == 0:
            continue
        dst = buf[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        if t.device.type == "cuda":
            stream = streams.get(t.device)
            if stream is None:
                stream = streams[t.device] = torch.cuda.Stream(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))  # the values as of now
            with torch.cuda.stream(stream):
                dst.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the caller may free it while the copy runs
        elif t.device.type == "meta":
            raise ValueError(f"tensor {slot.name} is on the meta device: it has no data")
        else:
            dst.copy_(t if t.device.type == "cpu" else t.to("cpu"))  # other accelerators
    events = []
    for stream in streams.values():
        ev = torch.cuda.Event()
        ev.record(stream)
        events.append(ev)
    return events or None

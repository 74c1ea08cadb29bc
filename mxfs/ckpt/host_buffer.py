"""Host staging: one reusable, aligned buffer per checkpointer, pinned when CUDA is there.

Copies from GPU tensors go on a side stream into pinned memory, so the
training stream is not blocked and the copy runs at PCIe speed; the event
recorded after the last copy says when the snapshot is staged.  Copies from
CPU tensors are done before `save` returns.  The buffer grows only when a
state dict outgrows it, so a training loop allocates it once.

Staging publishes a `Watermark` as it goes (the bytes of the image, from its
start, that are final), so the writer writes each range as soon as it is
staged, while the rest is still being copied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import torch

from mxfs.ckpt.image import ALIGN, Plan, round_up
from mxfs.load.staging import aligned_host, writable_view

# Bytes of CUDA copies queued between two events the writer can wait on.
CUDA_GROUP = 32 << 20


class StagingFailed(Exception):
    """Staging stopped before the image was complete; nothing may be written."""


class Watermark:
    """How much of an image is staged: the bytes from its start that are final.

    `stage` advances it slot by slot, in image order; a writer waits on it
    range by range (`wait_until`).  CUDA copies are only queued when staging
    advances past them, so such an advance carries the events (one per side
    stream) that say when they land, and `wait_until` synchronizes on those,
    never on the training stream.  `fail` ends it: waiters raise
    `StagingFailed` instead of writing.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self._cond = threading.Condition()
        self._queued = 0  # bytes whose copies are done or queued
        self._marks: list[tuple[int, list[Any]]] = []  # (queued end, events landing it)
        self._final = 0  # bytes known to be in the buffer
        self.error: BaseException | None = None
        self.final_at: float | None = None  # when the whole image was seen final

    def advance(self, upto: int, events: list[Any] | None = None) -> None:
        """Bytes [0, upto) are copied, or queued on side streams until `events` complete."""
        with self._cond:
            self._queued = upto
            self._marks.append((upto, events or []))
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    @property
    def queued(self) -> int:
        return self._queued

    def wait_until(self, n: int) -> int:
        """Block until bytes [0, n) are final; returns how many are (at least n)."""
        n = min(n, self.total)
        with self._cond:
            while self._queued < n and self.error is None:
                self._cond.wait()
            if self.error is not None:
                raise StagingFailed(_describe(self.error)) from self.error
            if self._final >= n:
                return self._final
            take = []  # every mark up to the first that covers n
            while self._marks:
                upto, events = self._marks.pop(0)
                take.append((upto, events))
                if upto >= n:
                    break
            # Later marks whose copies have landed already come for free.
            while self._marks and all(ev.query() for ev in self._marks[0][1]):
                take.append(self._marks.pop(0))
        for _, events in take:
            for ev in events:
                ev.synchronize()
        with self._cond:
            self._final = max(self._final, take[-1][0])
            if self._final >= self.total and self.final_at is None:
                self.final_at = time.perf_counter()
            return self._final


def _describe(e: BaseException) -> str:
    return f"staging failed: {e}" if str(e) else f"staging failed: {type(e).__name__}"


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


def stage(plan: Plan, named: Sequence[tuple[str, torch.Tensor]], buf: torch.Tensor,
          mark: Watermark | None = None) -> Any:
    """Copy the header and every tensor into `buf`, advancing `mark` as each slot is final
    (or queued, with the events it waits on); returns CUDA events to wait on, or None."""
    buf[:len(plan.header)].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
    tensors = dict(named)
    streams: dict[torch.device, Any] = {}
    queued = 0  # CUDA bytes queued since the last events were recorded
    if mark is not None:
        mark.advance(plan.data_start)
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
            queued += slot.nbytes
        elif t.device.type == "meta":
            raise ValueError(f"tensor {slot.name} is on the meta device: it has no data")
        else:
            dst.copy_(t if t.device.type == "cpu" else t.to("cpu"))  # other accelerators
        if mark is not None:
            if queued >= CUDA_GROUP:
                mark.advance(slot.offset + slot.nbytes, _record(streams))
                queued = 0
            elif not queued:
                mark.advance(slot.offset + slot.nbytes)
    events = _record(streams)
    if mark is not None:
        mark.advance(plan.size, events)
    return events or None


class ImageWindows:
    """A file image's bytes a window at a time, gathered from the header and the tensors
    themselves, with no staging of the whole image: for a writer whose tensors stay
    unchanged until its write is done (DCP's `write_data`).  Windows come in file order."""

    def __init__(self, plan: Plan, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.header = plan.header
        self.slots = sorted((s for s in plan.slots if s.nbytes), key=lambda s: s.offset)
        tensors = dict(named)
        self.src = {s.name: _flat_bytes(s.name, tensors[s.name]) for s in self.slots}
        self._next = 0  # the first slot that may reach the next window

    def fill(self, buf: torch.Tensor, start: int, end: int) -> None:
        """The image's bytes [start, end) into `buf` (gaps between slots zero)."""
        pos = start
        if pos < len(self.header):
            k = min(end, len(self.header))
            buf[:k - start].copy_(torch.frombuffer(bytearray(self.header[pos:k]),
                                                   dtype=torch.uint8))
            pos = k
        while self._next < len(self.slots) and \
                self.slots[self._next].offset + self.slots[self._next].nbytes <= start:
            self._next += 1
        for slot in self.slots[self._next:]:
            if slot.offset >= end:
                break
            lo, hi = max(pos, slot.offset), min(end, slot.offset + slot.nbytes)
            buf[pos - start:lo - start].zero_()
            buf[lo - start:hi - start].copy_(self.src[slot.name][lo - slot.offset:
                                                                 hi - slot.offset])
            pos = hi
        buf[pos - start:end - start].zero_()


def _flat_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view where it is contiguous)."""
    if t.device.type == "meta":
        raise ValueError(f"tensor {name} is on the meta device: it has no data")
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _record(streams: dict[torch.device, Any]) -> list[Any]:
    """An event on every side stream: all copies queued so far have landed once they have."""
    events = []
    for stream in streams.values():
        ev = torch.cuda.Event()
        ev.record(stream)
        events.append(ev)
    return events

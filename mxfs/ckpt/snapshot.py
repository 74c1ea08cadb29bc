"""Async checkpoint snapshots: stage now, write in the background, commit atomically.

`save` copies every tensor into the checkpointer's host staging buffer (which
is laid out as the data file itself) and returns a `Snapshot` at once; a
background thread then writes the buffer to the pool's members (direct
writes, O_DIRECT, every member at once), commits the file with its
checksums, writes the manifest, renames the hidden folder into place, moves
`latest` and applies retention.  Any failure is logged, comes out of
`Snapshot.wait()`, and leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zstandard

from mxfs import __version__
from mxfs.ckpt import catalog
from mxfs.ckpt.catalog import CheckpointError
from mxfs.ckpt.image import Plan, compressed_plan, frame_count, plan, signature
from mxfs.ckpt.staging import Staging, stage
from mxfs.ckpt.tree import flatten
from mxfs.client.writer import create_file
from mxfs.io.batch import executor

log = logging.getLogger("mxfs.ckpt")

DATA_FILE = "data.safetensors"
FRAME = 1 << 20  # zstd frame: independent, so frames compress and decompress in parallel
WRITE_STEP = 256 << 20  # bytes per write call, so progress moves


class Snapshot:
    """One save in flight: `staged()` when training may go on, `wait()` when durable."""

    def __init__(self, path: str, total: int) -> None:
        self.path = path
        self.total = total
        self.written = 0
        self.state = "staging"
        self.error: BaseException | None = None
        self.reported = False
        self._staged = threading.Event()
        self._done = threading.Event()
        self._events: Any = None
        self.times: dict[str, float] = {"start": time.perf_counter()}

    def staged(self) -> Snapshot:
        """Block until every tensor is in host staging; then they may change freely."""
        self._staged.wait()
        if self._events:
            for ev in self._events:
                ev.synchronize()
            self._events = None
        return self

    def wait(self, timeout: float | None = None) -> Snapshot:
        """Block until the checkpoint is durable and listed; raise its error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} is still being written")
        if self.error is not None:
            self.reported = True
            if isinstance(self.error, CheckpointError):
                raise self.error
            raise CheckpointError(f"checkpoint {self.path} was not saved "
                                  f"({_describe(self.error)})",
                                  "the previous checkpoint is intact; fix the cause and "
                                  "save again") from self.error
        return self

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def progress(self) -> dict[str, Any]:
        return {"state": self.state, "bytes": self.written, "total": self.total}


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    return str(e) or type(e).__name__


class Checkpointer:
    """Saves state dicts, reusing one staging buffer (and its plan) across saves."""

    def __init__(self, compress: str | None = None, keep_last: int | None = None,
                 level: int = 3) -> None:
        _check_compress(compress)
        self.compress = compress
        self.keep_last = keep_last
        self.level = level
        self.staging = Staging()
        self.packed = Staging()  # compressed images, when compressing
        self._plans: dict[Any, Plan] = {}
        self._last: Snapshot | None = None
        self._lock = threading.Lock()

    def save(self, state: Any, path: str, *, compress: str | None | bool = False,
             keep_last: int | None = None, metadata: dict[str, str] | None = None
             ) -> Snapshot:
        """Stage `state` and write it to `path` in the background; see `Snapshot`."""
        compress = self.compress if compress is False else compress
        _check_compress(compress)  # type: ignore[arg-type]
        keep = self.keep_last if keep_last is None else keep_last
        path = os.path.abspath(path)
        with self._lock:
            self._finish_previous()
            if os.path.lexists(path):
                raise CheckpointError(f"checkpoint {path} already exists",
                                      "save under a new name, or remove it: mxfs ckpt rm PATH")
            tree, named = flatten(state)
            meta = {"format": "pt", "mxfs": __version__, **(metadata or {})}
            sig = (signature(named), tuple(sorted(meta.items())))
            p = self._plans.get(sig)
            if p is None:
                self._plans = {sig: (p := plan(named, meta))}
            partial = catalog.claim_partial(path)
            snap = Snapshot(path, p.size)
            buf = self.staging.ensure(p.size)
            try:
                snap._events = stage(p, named, buf)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            snap.times["staged_cpu"] = time.perf_counter()
            snap._staged.set()
            self._last = snap
            job = _Job(self, snap, p, tree, partial, compress, keep, meta)  # type: ignore[arg-type]
            threading.Thread(target=job.run, name="mxfs-ckpt-writer", daemon=True).start()
            return snap

    def _finish_previous(self) -> None:
        """The staging buffer is reused: wait for the last save; surface an unseen failure."""
        last = self._last
        if last is None:
            return
        last._done.wait()
        if last.error is not None and not last.reported:
            last.wait()  # raises: a failure must never pass silently

    def wait(self) -> None:
        """Wait for the last save (e.g. before exiting)."""
        if self._last is not None:
            self._last.wait()


class _Job:
    """The background half of one save."""

    def __init__(self, owner: Checkpointer, snap: Snapshot, p: Plan, tree: Any, partial: str,
                 compress: str | None, keep: int | None, meta: dict[str, str]) -> None:
        self.owner, self.snap, self.plan, self.tree = owner, snap, p, tree
        self.partial, self.compress, self.keep, self.meta = partial, compress, keep, meta

    def run(self) -> None:
        snap = self.snap
        try:
            snap.staged()
            snap.times["staged"] = time.perf_counter()
            snap.state = "writing"
            self._write()
            snap.state = "done"
        except BaseException as e:  # noqa: BLE001 - every failure must reach wait()
            snap.error = e
            snap.state = "failed"
            log.error("checkpoint %s failed: %s", snap.path, _describe(e))
            shutil.rmtree(self.partial, ignore_errors=True)
        finally:
            snap.times["done"] = time.perf_counter()
            snap._done.set()

    def _write(self) -> None:
        snap, raw = self.snap, self.plan
        buf = self.owner.staging.view(raw.size)
        entries = {s.name: s.manifest() for s in raw.slots}
        image, size = buf, raw.size
        if self.compress == "zstd":
            image, size = self._compress(buf, entries)
            snap.total = size
        path = os.path.join(self.partial, DATA_FILE)

        def progress(done: int) -> None:
            snap.written = done
            if done == size:
                snap.state = "committing"

        info = write_image(path, image, size, progress)
        manifest = catalog.new_manifest({DATA_FILE: {**info, "tensors": entries}},
                                        kind="state", compress=self.compress,
                                        metadata=self.meta, tree=self.tree)
        catalog.publish(self.partial, snap.path, manifest)
        if self.keep:
            catalog.prune(os.path.dirname(snap.path), self.keep,
                          protect=os.path.basename(snap.path))

    def _compress(self, buf: memoryview, entries: dict[str, dict[str, Any]]
                  ) -> tuple[memoryview, int]:
        """Independent zstd frames per tensor, compressed in parallel; returns the image."""
        raw = self.plan
        jobs: list[tuple[str, memoryview]] = []
        for s in raw.slots:
            jobs += [(s.name, buf[s.offset + o:s.offset + min(o + FRAME, s.nbytes)])
                     for o in range(0, s.nbytes, FRAME)]
        local = threading.local()
        level = self.owner.level

        def squeeze(job: tuple[str, memoryview]) -> bytes:
            c = getattr(local, "c", None)
            if c is None:
                c = local.c = zstandard.ZstdCompressor(level=level)
            return c.compress(job[1])

        blobs = list(executor().map(squeeze, jobs))
        frames: dict[str, list[int]] = {s.name: [] for s in raw.slots}
        for (name, _), blob in zip(jobs, blobs, strict=True):
            frames[name].append(len(blob))
        packed, offsets = compressed_plan(raw, frames, self.meta)
        self.owner.packed.ensure(packed.size)
        view = self.owner.packed.view(packed.size)
        view[:len(packed.header)] = packed.header
        pos = {s.name: s.offset for s in packed.slots}
        for (name, _), blob in zip(jobs, blobs, strict=True):
            view[pos[name]:pos[name] + len(blob)] = blob
            pos[name] += len(blob)
        for s in raw.slots:
            assert frame_count(s.nbytes, FRAME) == len(frames[s.name])
            entries[s.name]["stored"] = {"offset": offsets[s.name],
                                         "length": sum(frames[s.name]),
                                         "frames": frames[s.name], "frame": FRAME}
        return view, packed.size


def write_image(path: str, image: memoryview, size: int,
                progress: Callable[[int], None] = lambda done: None) -> dict[str, Any]:
    """Write a file image (4 KiB-padded buffer) and commit it; returns its manifest entry."""
    with create_file(path, size) as w:
        step = w.sum_unit * max(1, WRITE_STEP // w.sum_unit)
        for off in range(0, size, step):
            n = min(step, size - off)
            w.write_at(off, image[off:off + -(-n // 4096) * 4096], valid=n)
            progress(off + n)
        sums = w.commit(size)
    return {"size": size, "sum_unit": w.sum_unit,
            "sums": base64.b64encode(struct.pack(f"<{len(sums)}Q", *sums)).decode()}


def _check_compress(compress: str | None) -> None:
    if compress not in (None, "zstd"):
        raise CheckpointError(f"compression {compress!r} is not known", "use None or 'zstd'")


_default: Checkpointer | None = None


def save(state: Any, path: str, *, compress: str | None = None, keep_last: int | None = None,
         metadata: dict[str, str] | None = None) -> Snapshot:
    """Save `state` (nested dicts/lists of tensors and plain values) to the folder `path`.

    Returns at once with a `Snapshot`: `staged()` says training may change the
    tensors, `wait()` that the checkpoint is durable and listed.  Uses one
    process-wide `Checkpointer`, so staging memory is allocated once.
    """
    global _default
    if _default is None:
        _default = Checkpointer()
    return _default.save(state, path, compress=compress, keep_last=keep_last,
                         metadata=metadata)

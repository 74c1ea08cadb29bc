"""Async checkpoint snapshots: stage now, write in the background, commit atomically.

`save` copies every tensor into the checkpointer's host staging buffer (which
is laid out as the data file itself) and returns a `Snapshot` at once; a
background thread, started before the copy, writes the buffer to the pool's
members (direct writes, O_DIRECT, every member at once) range by range as
staging passes each (a `Watermark`), so the write runs beside the copy (where
the host has room for both: `Checkpointer(overlap=...)`); then
it commits the file with its checksums, writes the manifest, renames the
hidden folder into place, moves `latest` and applies retention (of the saver's
own checkpoints; where either fails once published, `Snapshot.warnings` says so
and the save stands).  Any failure
is logged, comes out of `Snapshot.wait()`, and leaves the previous checkpoint
as it was; a staging failure is raised by `save` itself, once the writer has
stopped and removed what it began.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from mxfs import __version__
from mxfs.ckpt import catalog, writing
from mxfs.ckpt.catalog import CheckpointError
from mxfs.ckpt.host_buffer import Staging, StagingFailed, Watermark, stage
from mxfs.ckpt.image import Plan, plan, signature
from mxfs.ckpt.tree import flatten
from mxfs.ckpt.worker import WriterProcess
from mxfs.ckpt.writing import Job, write_snapshot

log = logging.getLogger("mxfs.ckpt")


class Snapshot:
    """One save in flight: `staged()` when training may go on, `wait()` when durable."""

    def __init__(self, path: str, total: int) -> None:
        self.path = path
        self.total = total
        self.written = 0
        self.state = "staging"
        self.error: BaseException | None = None
        self.reported = False
        # What failed once the checkpoint was published (`latest` another user's file,
        # retention): each logged; the save itself succeeded.
        self.warnings: list[str] = []
        self._staged = threading.Event()
        self._done = threading.Event()
        self._events: Any = None
        self.watermark = Watermark(total)  # how much of the image is staged
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
                 level: int = 3, writer: str = "thread", overlap: bool | None = None
                 ) -> None:
        """`writer="process"` writes from a worker process (staging in shared memory),
        so compressing and checksumming never hold the trainer's GIL.

        `overlap=True` writes each range as soon as staging has passed it, so the
        write runs beside the copy; `False` writes once everything is staged.  The
        default, None, overlaps where the copy has the host to spare for it: when the
        state holds CUDA tensors (the copy engine copies) or this process may run on
        more than 2 CPUs.  On 2 CPUs the writer's I/O slows the copy training waits
        for (blocked time 1.06-1.30x, docs/benchmarks.md), so it writes after."""
        _check_compress(compress)
        if writer not in ("thread", "process"):
            raise CheckpointError(f"writer {writer!r} is not known", "use 'thread' or 'process'")
        self.compress = compress
        self.keep_last = keep_last
        self.level = level
        self.overlap = overlap
        self.staging = Staging(shared=writer == "process")
        self.packed = Staging()  # compressed images, when compressing
        self.worker = WriterProcess() if writer == "process" else None
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
            try:
                buf = self.staging.ensure(p.size)
            except BaseException:  # (pinned or shared memory not had: nothing written)
                catalog.drop_partial(partial)
                raise
            job = Job(path, partial, p, tree, compress, keep, meta,  # type: ignore[arg-type]
                      self.level, writing.WRITE_STEP)
            prev, self._last = self._last, snap
            # The writer starts first: it writes each range as soon as staging passes it
            # (or, not overlapping, once all of it has).
            threading.Thread(target=self._run, args=(snap, job, self._overlaps(named)),
                             name="mxfs-ckpt-writer", daemon=True).start()
            try:
                snap._events = stage(p, named, buf, snap.watermark)
            except BaseException as e:
                snap.watermark.fail(e)
                snap._done.wait()  # the writer has stopped and aborted its file
                catalog.drop_partial(partial)
                self._last = prev  # raised here, not to be raised again by the next save
                raise
            snap.times["staged_cpu"] = time.perf_counter()
            snap._staged.set()
            return snap

    def _overlaps(self, named: list[tuple[str, Any]]) -> bool:
        if self.overlap is not None:
            return self.overlap
        return any(t.device.type == "cuda" for _, t in named) or _cpus() > 2

    def _run(self, snap: Snapshot, job: Job, overlap: bool) -> None:
        """The background half of a save, here or in the worker process."""

        def progress(state: str, done: int, total: int) -> None:
            snap.state, snap.written, snap.total = state, done, total

        try:
            if not overlap:
                snap.watermark.wait_until(job.plan.size)
            if self.worker is not None:
                warnings = self.worker.run(job, self.staging, progress,
                                           snap.watermark.wait_until)
            else:
                warnings = write_snapshot(job, self.staging.view(job.plan.size), self.packed,
                                          progress, snap.watermark.wait_until)
            for w in warnings:
                log.warning("%s", w)
            snap.warnings = warnings
            snap.state = "done"
        except BaseException as e:  # noqa: BLE001 - every failure must reach wait()
            snap.error = e
            snap.state = "failed"
            if not isinstance(e, StagingFailed):  # save() raises that one itself
                log.error("checkpoint %s failed: %s", snap.path, _describe(e))
            catalog.drop_partial(job.partial)
        finally:
            catalog.let_go(job.partial)  # (published by the worker process, if any)
            if snap.watermark.final_at is not None:
                snap.times["staged"] = snap.watermark.final_at
            snap.times["done"] = time.perf_counter()
            snap._done.set()

    def close(self) -> None:
        """Wait for the last save and stop the worker process, if any; the last save's
        failure, if nothing reported it yet, is raised (a job's shutdown must not pass
        over a checkpoint that was never written)."""
        try:
            self._finish_previous()
        finally:
            if self.worker is not None:
                self.worker.close()

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


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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

"""The background half of a save: compress, write, commit, publish.

A writer thread of the trainer's process runs it, or the writer process
(`ckpt/worker.py`) does, from the staging buffer in shared memory; so it holds
everything it needs in a picklable `Job`.  It starts before staging does and
writes the image range by range, each once `ready` says staging has passed
it, so the write runs beside the staging copy rather than after it
(compression still waits for the whole image).
"""

from __future__ import annotations

import base64
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zstandard

from mxfs.ckpt import catalog
from mxfs.ckpt.catalog import CheckpointError
from mxfs.ckpt.host_buffer import Staging
from mxfs.ckpt.image import Plan, compressed_plan, frame_count
from mxfs.client.writer import create_file
from mxfs.io.batch import executor
from mxfs.io.checksum import pack_sums

DATA_FILE = "data.safetensors"
FRAME = 1 << 20  # zstd frame: independent, so frames compress and decompress in parallel
# Bytes per write call: a range is written once staged, so staging and writing overlap
# by all but the first range; large enough that the calls' joins cost nothing.
WRITE_STEP = 64 << 20


@dataclass
class Job:
    """What the background half of a save needs (picklable: a worker process may run it)."""

    path: str
    partial: catalog.Partial
    plan: Plan
    tree: Any
    compress: str | None
    keep: int | None
    meta: dict[str, str]
    level: int
    step: int = WRITE_STEP


def write_snapshot(job: Job, image: memoryview, packed: Staging,
                   progress: Callable[[str, int, int], None],
                   ready: Callable[[int], object] | None = None) -> list[str]:
    """Compress (optionally), write, commit and publish one snapshot, writing each range
    once `ready(end)` has returned (bytes [0, end) staged; it raises if staging failed).
    Returns warnings of what failed once it was published (`latest`, retention)."""
    raw = job.plan
    entries = {s.name: s.manifest() for s in raw.slots}
    size = raw.size
    if job.compress == "zstd":
        if ready is not None:
            ready(size)  # frames are laid out by their compressed sizes: all of it first
            ready = None
        image, size = _compress(job, image, entries, packed)
    folder = catalog.open_partial(job.partial)
    try:
        info = write_image(os.path.join(job.partial.path, DATA_FILE), image, size,
                           lambda done: progress("writing" if done < size else "committing",
                                                 done, size), ready, job.step, folder)
    finally:
        os.close(folder)
    manifest = catalog.new_manifest({DATA_FILE: {**info, "tensors": entries}},
                                    kind="state", compress=job.compress,
                                    metadata=job.meta, tree=job.tree)
    warning = catalog.publish(job.partial, job.path, manifest)
    warnings = [] if warning is None else [warning]
    if job.keep:
        try:  # (only this user's own: others' are neither counted nor removed)
            catalog.prune(os.path.dirname(job.path), job.keep,
                          protect=os.path.basename(job.path), owner=job.partial.uid)
        except (OSError, CheckpointError) as e:
            warnings.append(f"{job.path} is saved, but keep_last={job.keep} could not "
                            f"remove older checkpoints ({e}): mxfs ckpt prune "
                            f"{os.path.dirname(job.path)} --keep {job.keep}")
    return warnings


def _compress(job: Job, buf: memoryview, entries: dict[str, dict[str, Any]], packed: Staging
              ) -> tuple[memoryview, int]:
    """Independent zstd frames per tensor, compressed in parallel; returns the image."""
    raw = job.plan
    jobs: list[tuple[str, memoryview]] = []
    for s in raw.slots:
        jobs += [(s.name, buf[s.offset + o:s.offset + min(o + FRAME, s.nbytes)])
                 for o in range(0, s.nbytes, FRAME)]
    local = threading.local()

    def squeeze(item: tuple[str, memoryview]) -> bytes:
        c = getattr(local, "c", None)
        if c is None:
            c = local.c = zstandard.ZstdCompressor(level=job.level)
        return c.compress(item[1])

    blobs = list(executor().map(squeeze, jobs))
    frames: dict[str, list[int]] = {s.name: [] for s in raw.slots}
    for (name, _), blob in zip(jobs, blobs, strict=True):
        frames[name].append(len(blob))
    out, offsets = compressed_plan(raw, frames, job.meta)
    packed.ensure(out.size)
    view = packed.view(out.size)
    view[:len(out.header)] = out.header
    pos = dict(offsets)
    for (name, _), blob in zip(jobs, blobs, strict=True):
        view[pos[name]:pos[name] + len(blob)] = blob
        pos[name] += len(blob)
    for s in raw.slots:
        assert frame_count(s.nbytes, FRAME) == len(frames[s.name])
        entries[s.name]["stored"] = {"offset": offsets[s.name], "length": sum(frames[s.name]),
                                     "frames": frames[s.name], "frame": FRAME}
    return view, out.size


def write_image(path: str, image: memoryview, size: int,
                progress: Callable[[int], None] = lambda done: None,
                ready: Callable[[int], object] | None = None, step: int | None = None,
                dir_fd: int | None = None) -> dict[str, Any]:
    """Write a file image (4 KiB-padded buffer) and commit it; returns its manifest entry.

    Ranges are whole checksum blocks of about `step` bytes; with `ready`, each is
    written only once `ready(end of the range)` returns.  `dir_fd`: the folder it goes
    in, open (`create_file`)."""
    with create_file(path, size, dir_fd=dir_fd) as w:
        step = w.sum_unit * max(1, (step or WRITE_STEP) // w.sum_unit)
        for off in range(0, size, step):
            n = min(step, size - off)
            if ready is not None:
                ready(off + n)
            w.write_at(off, image[off:off + -(-n // 4096) * 4096], valid=n)
            progress(off + n)
        sums = w.commit(size)
    return _entry(size, w.sum_unit, sums)


def write_windows(path: str, size: int, fill: Callable[[torch.Tensor, int, int], None],
                  window: int = WRITE_STEP, dir_fd: int | None = None) -> dict[str, Any]:
    """Write a file image of `size` bytes a window at a time and commit it; returns its
    manifest entry (as `write_image`).  `fill(buf, start, end)` puts the image's bytes
    [start, end) into `buf`, on the caller's thread, while a thread writes the window
    filled before: two buffers of `window` bytes, never the whole image.  `dir_fd`: the
    folder it goes in, open (`create_file`)."""
    with create_file(path, size, dir_fd=dir_fd) as w:
        step = w.sum_unit * max(1, window // w.sum_unit)
        bufs = [Staging(), Staging()]
        views = [(b.ensure(step), b.view(step)) for b in bufs]
        free: queue.Queue[int] = queue.Queue()
        free.put(0)
        free.put(1)
        todo: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        failed: list[BaseException] = []

        def run() -> None:
            while (item := todo.get()) is not None:
                i, off, n = item
                if not failed:
                    try:
                        w.write_at(off, views[i][1][:-(-n // 4096) * 4096], valid=n)
                    except BaseException as e:  # noqa: BLE001 - raised by the caller
                        failed.append(e)
                free.put(i)

        writer = threading.Thread(target=run, name="mxfs-ckpt-windows", daemon=True)
        writer.start()
        try:
            for off in range(0, size, step):
                i = free.get()
                if failed:
                    break
                n = min(step, size - off)
                fill(views[i][0][:n], off, off + n)
                todo.put((i, off, n))
        finally:
            todo.put(None)
            writer.join()
        if failed:
            raise failed[0]
        sums = w.commit(size)
    return _entry(size, w.sum_unit, sums)


def _entry(size: int, sum_unit: int, sums: Any) -> dict[str, Any]:
    return {"size": size, "sum_unit": sum_unit,
            "sums": base64.b64encode(pack_sums(sums)).decode()}

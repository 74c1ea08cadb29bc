"""Run a batch of positional reads or writes, one thread per descriptor at most.

Each op is independent (a different chunk file or offset), so a batch fans out
on a shared thread pool; a batch of one runs inline to skip the hand-off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

_IOV_MAX = os.sysconf("SC_IOV_MAX")
_MAX_WORKERS = max(8, 4 * (os.cpu_count() or 2))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Fill the buffers of `bufs` in order from `fd` at `offset` (one contiguous range).

    Bytes past the end of the file read as zeros: a chunk file is sparse and
    may be shorter than the file it belongs to.
    """

    fd: int
    offset: int
    bufs: Sequence[memoryview]


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Write the buffers of `bufs` in order to `fd` at `offset`."""

    fd: int
    offset: int
    bufs: Sequence[memoryview]


def _advance(bufs: Sequence[memoryview], n: int) -> list[memoryview]:
    """The iovec left after the first `n` bytes were transferred."""
    rest: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        rest.append(b[n:] if n else b)
        n = 0
    return rest


def preadv_full(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """Read until every buffer is full or EOF; zero what EOF left unfilled."""
    done = 0
    todo = [b for b in bufs if len(b)]
    while todo:
        n = os.preadv(fd, todo[:_IOV_MAX], offset + done)
        if n == 0:
            for b in todo:
                b[:] = bytes(len(b))
            break
        done += n
        todo = _advance(todo, n)
    return done


def pwritev_full(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """Write every byte of every buffer, retrying short writes."""
    done = 0
    todo = [b for b in bufs if len(b)]
    while todo:
        n = os.pwritev(fd, todo[:_IOV_MAX], offset + done)
        done += n
        todo = _advance(todo, n)
    return done


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(_MAX_WORKERS, thread_name_prefix="mxfs-io")
    return _pool


def _run(fn: Callable[[T], int], ops: Sequence[T]) -> list[int]:
    if len(ops) == 1:
        return [fn(ops[0])]
    futures = [_executor().submit(fn, op) for op in ops]
    # Wait for every op before raising, so no thread still writes into a buffer
    # the caller is about to reuse.
    errors = [f.exception() for f in futures]
    for err in errors:
        if err is not None:
            raise err
    return [f.result() for f in futures]


def read_batch(ops: Sequence[ReadOp]) -> list[int]:
    """Run reads in parallel; returns the bytes actually read per op (rest zero-filled)."""
    return _run(lambda op: preadv_full(op.fd, op.bufs, op.offset), ops)


def write_batch(ops: Sequence[WriteOp]) -> list[int]:
    """Run writes in parallel; raises the first OSError (ENOSPC, EIO) after all finish."""
    return _run(lambda op: pwritev_full(op.fd, op.bufs, op.offset), ops)

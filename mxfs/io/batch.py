"""Run a batch of positional reads or writes, all at once.

Two engines behind one interface: the native one (native/engine.c: io_uring at a
set queue depth, one ring per core, GIL released), the default wherever it was
built and the kernel allows io_uring; and a pool of threads running
preadv/pwritev, which needs no build.  MXFS_IO_ENGINE=threads picks the pool.
`ENGINE` says which runs and why (the daemon logs it, `mxfs status` shows it).

Buffered reads and writes always run on the pool: the ring takes O_DIRECT requests
only.  A buffered request that must wait goes to an io-wq worker, and on kernel 6.18
such requests sometimes never got one: first a write, hanging the daemon that waited
for it, then reads (CI, twice: a node's window reads of its members, ~1,300 requests
at once, asked back after the stall time, on a disk busy with other tests' writes).
The ring asks back any request that gets no completion for STALL_MS (engine.c).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger("mxfs.io")

_IOV_MAX = os.sysconf("SC_IOV_MAX")
QUEUE_DEPTH = 32
STALL_MS = 10_000  # a ring request without a completion this long is taken back
_RINGS = os.cpu_count() or 1


class NativeEngine(Protocol):
    """What mxfs.io._engine offers (its stub: _engine.pyi)."""

    def run(self, ops: Sequence[tuple[int, int, memoryview]], write: bool = ..., depth: int = ...,
            stall_ms: int = ..., /) -> int: ...

    def probe(self) -> None: ...

    def taken_back(self) -> int: ...


def native_engine() -> tuple[NativeEngine | None, str]:
    """The io_uring engine module, or None and the reason it cannot run here."""
    try:
        from mxfs.io import _engine

        _engine.probe()
    except ImportError:
        return None, "native engine not built (needs liburing-dev and a compiler)"
    except OSError as e:
        return None, f"io_uring refused by the kernel ({e.strerror})"
    return _engine, "io_uring available"


def _load_native() -> tuple[NativeEngine | None, str]:
    if os.environ.get("MXFS_IO_ENGINE", "io_uring") == "threads":
        return None, "threads (MXFS_IO_ENGINE=threads)"
    engine, why = native_engine()
    return engine, "io_uring" if engine else f"threads ({why})"


_native, ENGINE = _load_native()
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


def executor() -> ThreadPoolExecutor:
    """The shared pool of threads for a client's own parallel work (checksums,
    inflates, a reader's connections), created on first use."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(_MAX_WORKERS, thread_name_prefix="mxfs-io")
    return _pool


class _Helpers:
    """Threads a batch's ops spread over, taken only while idle.

    A batch takes the helpers idle when it asks (`take`) and works beside them on its
    own thread; it never waits for one.  In the daemon each batch runs on a thread of
    its user's turn (`fs/fair.Lanes`); through one first-come pool below those turns, a
    user's fsyncs of large dirty files over every member held every thread for
    seconds, and another user's 4 KiB fsync or read, in his turn, waited behind all of
    them.  Now his batch finds no helper idle and runs on his own thread."""

    def __init__(self, most: int) -> None:
        self._idle = threading.Semaphore(most)
        self._threads = ThreadPoolExecutor(most, thread_name_prefix="mxfs-io-fan")

    def take(self, most: int, work: Callable[[], None]) -> list[Future[None]]:
        """Up to `most` idle helpers, each running `work` (then idle again)."""
        taken: list[Future[None]] = []
        while len(taken) < most and self._idle.acquire(blocking=False):
            taken.append(self._threads.submit(self._helping, work))
        return taken

    def _helping(self, work: Callable[[], None]) -> None:
        try:
            work()
        finally:
            self._idle.release()


_helpers = _Helpers(_MAX_WORKERS)


def _run(fn: Callable[[T], int], ops: Sequence[T]) -> list[int]:
    """`fn` of every op, at once on this thread and the helpers idle now; each op's
    result, or the first op's error once every op has ended."""
    if len(ops) == 1:
        return [fn(ops[0])]
    results: list[int] = [0] * len(ops)
    errors: list[BaseException | None] = [None] * len(ops)
    left, lock = iter(range(len(ops))), threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(left, None)
            if i is None:
                return
            try:
                results[i] = fn(ops[i])
            except BaseException as e:  # (raised below, once no op writes into a buffer)
                errors[i] = e

    helping = _helpers.take(len(ops) - 1, work)
    work()
    for f in helping:  # (its op may still run after this thread found none left)
        f.result()
    for err in errors:
        if err is not None:
            raise err
    return results


def sync_all(fds: Sequence[int], datasync: bool = False) -> None:
    """fsync (or fdatasync) every descriptor at once: each member's drive flushes its
    own share in parallel, not one after another."""
    sync = os.fdatasync if datasync else os.fsync
    _run(lambda fd: sync(fd) or 0, list(fds))


def _triples(ops: Sequence[ReadOp] | Sequence[WriteOp]) -> list[tuple[int, int, memoryview]]:
    out = []
    for op in ops:
        pos = op.offset
        for b in op.bufs:
            if len(b):
                out.append((op.fd, pos, b))
                pos += len(b)
    return out


def interleaved(items: Sequence[T], fd: Callable[[T], int]) -> list[T]:
    """Each descriptor's requests in their own order, the descriptors taken in turn.

    Requests arrive grouped by member (merge_runs sorts them so); run in that order,
    every request in flight would sit on one member until its run drained, and the
    members would be read one after another.  Taken in turn, the requests in flight
    span every member at once, and each member still streams in file order.
    """
    queues: dict[int, list[T]] = {}
    for item in items:
        queues.setdefault(fd(item), []).append(item)
    lists = list(queues.values())
    return [q[i] for i in range(max(map(len, lists), default=0)) for q in lists if i < len(q)]


def _run_native(triples: list[tuple[int, int, memoryview]], write: bool) -> None:
    """One ring per core: io_uring completes cached reads inline on the submitting
    thread, so a single ring would copy warm data on one core only."""
    native = _native
    assert native is not None  # _use_native said so
    triples = interleaved(triples, lambda t: t[0])
    groups = [triples[i::_RINGS] for i in range(min(_RINGS, len(triples)))]
    before = native.taken_back()
    try:
        _run(lambda g: native.run(g, write, QUEUE_DEPTH, STALL_MS), groups)
    finally:
        if (n := native.taken_back() - before) > 0:
            log.warning("io_uring: %d request(s) got no completion for %d s; taken back and "
                        "done on a thread (a kernel fault: see docs/operations.md)", n,
                        STALL_MS // 1000)


def taken_back() -> int:
    """Requests the rings of this process took back after a stall (0 without the engine)."""
    return _native.taken_back() if _native is not None else 0


def _use_native(ops: Sequence[ReadOp] | Sequence[WriteOp]) -> bool:
    """The ring pays off for more than one transfer; one runs inline on this thread."""
    return _native is not None and (len(ops) > 1 or (len(ops) == 1 and len(ops[0].bufs) > 1))


def _all_direct(ops: Sequence[ReadOp] | Sequence[WriteOp]) -> bool:
    """Is every op's descriptor O_DIRECT?"""
    return all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in {op.fd for op in ops})


def _fd(op: ReadOp | WriteOp) -> int:
    return op.fd


def read_batch(ops: Sequence[ReadOp]) -> None:
    """Fill every op's buffers, all ops at once; bytes past EOF read as zeros.
    O_DIRECT reads go to the ring, buffered ones to the threads (see the top)."""
    if _use_native(ops) and _all_direct(ops):
        _run_native(_triples(ops), write=False)
    elif ops:
        _run(lambda op: preadv_full(op.fd, op.bufs, op.offset), interleaved(ops, _fd))


def write_batch(ops: Sequence[WriteOp]) -> None:
    """Write every op's buffers, all ops at once; raises the first OSError (ENOSPC, EIO).
    O_DIRECT writes go to the ring, buffered ones to the threads (see the top)."""
    if _use_native(ops) and _all_direct(ops):
        _run_native(_triples(ops), write=True)
    elif ops:
        _run(lambda op: pwritev_full(op.fd, op.bufs, op.offset), interleaved(ops, _fd))

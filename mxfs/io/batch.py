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
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

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


class Helpers:
    """Threads a batch's calls spread over, taken only while idle.

    A batch (`begin`) takes the helpers idle when it begins, and those that go idle
    while it runs, and its own thread runs what they leave (`Begun.finish`); it never
    waits for a helper.  In the daemon each batch runs on a thread of its user's turn
    (`fs/fair.Lanes`); through one first-come pool below those turns, a user's fsyncs
    of large dirty files over every member held every thread for seconds, and another
    user's 4 KiB fsync or read, in his turn, waited behind all of them.  Now his batch
    finds no helper idle and runs on his own thread.  (Other nodes' members have
    helpers of their own, a set for each owner: `pool/remote.py`.)"""

    def __init__(self, most: int, name: str) -> None:
        self._idle = threading.Semaphore(most)
        self._threads = ThreadPoolExecutor(most, thread_name_prefix=name)

    def begin(self, calls: Sequence[Callable[[], T]], keep: int = 1) -> Begun[T]:
        """Start `calls` on the helpers idle now, all but `keep` at most (the caller's,
        at `finish`: none where it has work of its own meanwhile)."""
        begun = Begun(self, calls)
        self.recruit(begun, keep)
        return begun

    def recruit(self, begun: Begun[Any], keep: int = 1) -> None:
        """Idle helpers for `begun`'s calls not yet taken, all but `keep` of them."""
        while begun.wanted(keep) > 0 and self._idle.acquire(blocking=False):
            with begun.lock:
                begun.helpers_on += 1
            begun.helping.append(self._threads.submit(self._help, begun))

    def _help(self, begun: Begun[Any]) -> None:
        try:
            begun.work(helper=True)
        finally:
            with begun.lock:
                begun.helpers_on -= 1
            self._idle.release()


class Begun(Generic[T]):
    """Calls begun on helpers: `finish` runs on the caller's thread what they left,
    taking on the way helpers that went idle meanwhile (a batch begun while another
    held them all ran every call on its own thread after they were free again)."""

    def __init__(self, helpers: Helpers, calls: Sequence[Callable[[], T]]) -> None:
        self.helpers, self.calls = helpers, calls
        self.results: list[T | None] = [None] * len(calls)
        self.errors: list[BaseException | None] = [None] * len(calls)
        self.helping: list[Future[None]] = []
        self.lock = threading.Lock()
        self.helpers_on = 0  # helpers taken and not done
        self._calling = 0  # ... of them in a call now
        self._next = 0  # the first call not taken

    def wanted(self, keep: int) -> int:
        """More helpers the calls not yet taken could use, `keep` of them left to the
        caller (the helpers taken and between calls take the next ones)."""
        with self.lock:
            free = self.helpers_on - self._calling
            return len(self.calls) - self._next - keep - free

    def work(self, helper: bool = False) -> None:
        """Run calls not yet taken until none is left (the caller's thread takes idle
        helpers before each)."""
        while self.run_one(helper):
            pass

    def run_one(self, helper: bool = False) -> bool:
        """Run the next call not yet taken (the caller's thread first takes idle
        helpers); False if none was left."""
        if not helper:
            self.helpers.recruit(self)
        with self.lock:
            i, self._next = self._next, self._next + 1
            if i >= len(self.calls):
                return False
            self._calling += helper
        try:
            self.results[i] = self.calls[i]()
        except BaseException as e:  # (raised by `finish`, once no call runs on)
            self.errors[i] = e
        finally:
            with self.lock:
                self._calling -= helper
        return True

    def finish(self) -> list[T]:
        """Every call's result, once all ended (the first error raised then: no call
        still writes into a buffer its caller is about to reuse)."""
        self.work()
        return self.ended()

    def ended(self) -> list[T]:
        """Every call's result once the helpers' calls ended too (the first error
        raised then)."""
        for f in list(self.helping):  # (a helper's call may run after this found none)
            f.result()
        # The calls let go: their buffers' views are held no longer (a helper's pool
        # keeps its last task, this batch with it, a moment after its result came,
        # and the caller's mapping of those buffers could not close: BufferError).
        self.calls = []
        for err in self.errors:
            if err is not None:
                raise err
        return self.results  # type: ignore[return-value]


def finish_all(begun: Sequence[Begun[Any]]) -> None:
    """`finish` every batch, their calls left taken in turn (and helpers of each as
    they go idle: one after another, a file over two owners whose helpers were busy
    took the sum of their times); then raise the first failure, once all ended."""
    going = list(begun)
    while going:
        going = [b for b in going if b.run_one()]
    first: BaseException | None = None
    for b in begun:
        try:
            b.ended()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


_helpers = Helpers(_MAX_WORKERS, "mxfs-io-fan")


def _run(fn: Callable[[T], int], ops: Sequence[T]) -> list[int]:
    """`fn` of every op, at once on this thread and the helpers idle now."""
    if len(ops) == 1:
        return [fn(ops[0])]
    return _helpers.begin([functools.partial(fn, op) for op in ops]).finish()


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

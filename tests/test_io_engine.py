"""Both I/O engines move the same bytes: reads, writes, iovecs, EOF zero-fill, errors."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from mxfs.io import ReadOp, WriteOp, batch


@pytest.fixture(params=["threads", "io_uring"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "io_uring":
        native, why = batch.native_engine()
        if native is None:
            pytest.skip(why)
        monkeypatch.setattr(batch, "_native", native)
    else:
        monkeypatch.setattr(batch, "_native", None)
    return request.param


def test_reads_fill_iovecs_and_zero_past_eof(tmp_path: Path, engine: str) -> None:
    data = os.urandom(3 << 20)
    files = []
    for i in range(4):
        p = tmp_path / f"c{i}"
        p.write_bytes(data[i * 100_000:])  # different lengths, all shorter than asked
        files.append(os.open(p, os.O_RDONLY))
    try:
        bufs = [[bytearray(b"\xff" * 700_000), bytearray(b"\xff" * 3_000_000)] for _ in files]
        ops = [ReadOp(fd, 5, [memoryview(b) for b in pair]) for fd, pair in zip(files, bufs,
                                                                                 strict=True)]
        if engine == "io_uring":  # (the ring itself: read_batch gives it O_DIRECT reads)
            batch._run_native(batch._triples(ops), write=False)
        else:
            batch.read_batch(ops)
        for i, pair in enumerate(bufs):
            got = bytes(pair[0]) + bytes(pair[1])
            have = data[i * 100_000 + 5:]
            assert got[:len(have)] == have
            assert got[len(have):] == bytes(len(got) - len(have))
    finally:
        for fd in files:
            os.close(fd)


def test_writes_land_in_place(tmp_path: Path, engine: str) -> None:
    fds = [os.open(tmp_path / f"w{i}", os.O_RDWR | os.O_CREAT) for i in range(3)]
    try:
        parts = [[os.urandom(4096 * (i + 1)), os.urandom(1000)] for i in range(3)]
        batch.write_batch([WriteOp(fd, 10, [memoryview(p) for p in pair])
                           for fd, pair in zip(fds, parts, strict=True)])
        for i, pair in enumerate(parts):
            assert (tmp_path / f"w{i}").read_bytes() == bytes(10) + pair[0] + pair[1]
    finally:
        for fd in fds:
            os.close(fd)


def test_errors_come_back_as_oserror(tmp_path: Path, engine: str) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10)
    fd = os.open(p, os.O_WRONLY)  # reading it is EBADF
    try:
        with pytest.raises(OSError) as e:
            batch.read_batch([ReadOp(fd, 0, [memoryview(bytearray(10))]),
                              ReadOp(fd, 0, [memoryview(bytearray(10))])])
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_a_batch_takes_members_in_turn_each_in_its_own_order() -> None:
    from mxfs.io.batch import interleaved

    reqs = [(fd, off) for fd in (7, 8, 9) for off in range(4 if fd != 8 else 2)]
    got = interleaved(reqs, lambda r: r[0])
    assert sorted(got) == sorted(reqs)  # nothing lost or doubled
    assert [fd for fd, _ in got[:3]] == [7, 8, 9] and [fd for fd, _ in got[3:6]] == [7, 8, 9]
    for fd in (7, 8, 9):  # each member still streams in file order
        offs = [off for f, off in got if f == fd]
        assert offs == sorted(offs)


def test_a_ring_request_with_no_completion_is_taken_back(tmp_path: Path) -> None:
    """A request the kernel never completes (here a read of an empty FIFO, which waits
    for a writer; on kernel 6.18, a buffered write queued for an io-wq worker that never
    came) is cancelled after the stall time and done on the caller's thread, so the call
    returns, with that attempt's answer (a FIFO cannot be read at an offset: ESPIPE),
    and the other transfers of the batch done."""
    native, why = batch.native_engine()
    if native is None:
        pytest.skip(why)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    stuck = os.open(fifo, os.O_RDWR)  # a writer exists (us), so the read just waits
    data = os.urandom(3 * 4096)
    (tmp_path / "file").write_bytes(data)
    fine = os.open(tmp_path / "file", os.O_RDONLY)
    try:
        got = bytearray(len(data))
        before = native.taken_back()
        with pytest.raises(OSError) as e:
            native.run([(fine, 0, memoryview(got)), (stuck, 0, memoryview(bytearray(4096)))],
                       False, 8, 100)
        assert e.value.errno == errno.ESPIPE
        assert native.taken_back() == before + 1  # counted, for `mxfs status` and metrics
        assert bytes(got) == data
        os.write(stuck, b"late")  # a cancelled read took nothing from the FIFO
        assert os.read(stuck, 16) == b"late"
    finally:
        os.close(stuck)
        os.close(fine)


def test_buffered_reads_and_writes_go_to_the_threads_and_direct_ones_to_the_ring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """io-wq is where a buffered request can wait for a worker that never comes (see
    mxfs.io.batch): only O_DIRECT reads and writes use the ring."""
    native, why = batch.native_engine()
    if native is None:
        pytest.skip(why)
    rings: list[int] = []

    class Counting:
        def run(self, ops, *args):  # noqa: ANN001, ANN002, ANN202 - passes through
            rings.append(len(ops))
            return native.run(ops, *args)

        def taken_back(self) -> int:
            return native.taken_back()

    monkeypatch.setattr(batch, "_native", Counting())
    block = memoryview(bytearray(os.urandom(2 * 4096)))
    for direct in (False, True):
        rings.clear()
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        try:
            fds = [os.open(tmp_path / f"{direct}{i}", flags) for i in range(2)]
        except OSError as e:  # a filesystem without O_DIRECT (tmpfs before 6.6)
            pytest.skip(f"O_DIRECT refused here: {e}")
        aligned = mmap.mmap(-1, len(block))
        aligned[:] = block
        try:
            batch.write_batch([WriteOp(fd, 0, [memoryview(aligned)]) for fd in fds])
        finally:
            for fd in fds:
                os.close(fd)
        assert bool(rings) == direct
        for i in range(2):
            assert (tmp_path / f"{direct}{i}").read_bytes() == bytes(block)
        rings.clear()
        fds = [os.open(tmp_path / f"{direct}{i}", os.O_RDONLY | (os.O_DIRECT if direct
                                                                   else 0)) for i in range(2)]
        got = [mmap.mmap(-1, len(block)) for _ in fds]
        try:
            batch.read_batch([ReadOp(fd, 0, [memoryview(g)]) for fd, g in zip(fds, got,
                                                                                 strict=True)])
        finally:
            for fd in fds:
                os.close(fd)
        assert bool(rings) == direct and all(g[:] == bytes(block) for g in got)


def test_a_batch_never_waits_behind_another_batchs_helpers(tmp_path: Path) -> None:
    """Every helper of a set is held by one batch's slow calls (a user's fsyncs of
    large dirty files); another batch begun meanwhile runs its calls on its own thread
    and ends at once, its results and its errors its own.  Through one first-come pool,
    it waited for the slow calls to end first."""
    import threading

    helpers = batch.Helpers(2, "mxfs-test-helpers")
    release, started = threading.Event(), threading.Semaphore(0)

    def slow() -> str:
        started.release()
        release.wait(60)
        return "slow"

    slow_batch = helpers.begin([slow, slow, slow])  # (two on helpers, one kept)
    for _ in range(2):
        assert started.acquire(timeout=10)
    done = threading.Event()
    got: list[object] = []

    def other() -> None:
        got.append(helpers.begin([lambda: 1, lambda: 2, lambda: 3]).finish())
        try:
            helpers.begin([lambda: 4, lambda: 1 // 0]).finish()
        except ZeroDivisionError as e:
            got.append(type(e).__name__)
        done.set()

    threading.Thread(target=other, daemon=True).start()
    try:
        assert done.wait(10), "a batch waited for another batch's helpers"
        assert got == [[1, 2, 3], "ZeroDivisionError"]
    finally:
        release.set()
    assert slow_batch.finish() == ["slow"] * 3

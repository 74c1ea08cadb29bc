"""Read-ahead windows of another node's stripes (mxfs.pool.read_ahead): every byte a
reader gets is the file's, in order or not, with several readers at once; a failed
fetch fails the read that needed it and is fetched again; the windows held stay
within their budget and go back at close."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mxfs.pool import read_ahead
from mxfs.pool.read_ahead import ReadAhead

MiB = 1 << 20


class Source:
    """A file's bytes, fetched as a remote node would serve them (zeros past the end)."""

    def __init__(self, size: int) -> None:
        self.data = os.urandom(size)
        self.fetched: list[int] = []
        self.fail_at: int | None = None
        self.lock = threading.Lock()

    def fetch(self, offset: int, buf: memoryview) -> None:
        with self.lock:
            self.fetched.append(offset)
            if self.fail_at == offset:
                self.fail_at = None
                raise OSError(5, "node a cannot be reached")
        part = self.data[offset:offset + len(buf)]
        buf[:len(part)] = part
        buf[len(part):] = bytes(len(buf) - len(part))


def test_in_order_reads_come_from_windows_fetched_ahead() -> None:
    src = Source(50 * MiB + 12345)
    ra = ReadAhead(4 * MiB, src.fetch)
    assert ra.size % (4 * MiB) == 0 and ra.size >= read_ahead.WINDOW
    out = bytearray(len(src.data))
    view = memoryview(out)
    first = ra.read(0, view[:MiB])
    assert not first  # one read is no order yet: the caller reads it itself
    view[:MiB] = src.data[:MiB]
    for off in range(MiB, len(out), MiB):
        assert ra.read(off, view[off:off + MiB])
    assert out == src.data
    assert len(src.fetched) == len(set(src.fetched))  # each window fetched once
    ra.close()


def test_parallel_readers_a_little_out_of_order() -> None:
    src = Source(40 * MiB)
    ra = ReadAhead(MiB, src.fetch)
    out = bytearray(len(src.data))
    view = memoryview(out)
    ra.read(0, view[:MiB]) or view.__setitem__(slice(0, MiB), src.data[:MiB])

    def one(off: int) -> None:
        if not ra.read(off, view[off:off + MiB]):
            view[off:off + MiB] = src.data[off:off + MiB]

    with ThreadPoolExecutor(6) as ex:  # as the kernel sends a dozen at once
        list(ex.map(one, range(MiB, len(out), MiB)))
    assert out == src.data
    ra.close()


def test_a_read_far_from_the_last_is_not_read_ahead() -> None:
    src = Source(200 * MiB)
    ra = ReadAhead(MiB, src.fetch)
    buf = memoryview(bytearray(4096))
    assert not ra.read(0, buf)
    assert not ra.read(150 * MiB, buf)  # a jump: the caller reads it
    assert src.fetched == []
    ra.close()


def test_a_failed_fetch_fails_its_read_and_is_fetched_again() -> None:
    src = Source(64 * MiB)
    ra = ReadAhead(MiB, src.fetch)
    buf = memoryview(bytearray(MiB))
    ra.read(0, buf)
    src.fail_at = 0
    with pytest.raises(OSError):
        ra.read(MiB, buf)
    assert ra.read(2 * MiB, buf)
    assert bytes(buf) == src.data[2 * MiB:3 * MiB]
    assert src.fetched.count(0) == 2
    ra.close()


def test_windows_stay_within_the_budget_and_go_back_at_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_ahead, "BUDGET", 3 * read_ahead.WINDOW)
    before = read_ahead._held
    files = [ReadAhead(MiB, Source(200 * MiB).fetch) for _ in range(3)]
    buf = memoryview(bytearray(MiB))
    for ra in files:
        ra.read(0, buf)
        assert ra.read(MiB, buf)  # the window it needs, whatever the budget
    # past the budget, no window was fetched ahead: one each (forced) at most over it
    assert read_ahead._held - before <= read_ahead.BUDGET + 2 * read_ahead.WINDOW
    for ra in files:
        ra.close()
    assert read_ahead._held == before

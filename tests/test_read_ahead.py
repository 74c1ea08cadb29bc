"""Read-ahead windows of another node's stripes (mxfs.pool.read_ahead): every byte a
reader gets is the file's, in order or not, with several readers at once; a failed
fetch fails the read that needed it and is fetched again; the windows held, the ones
reads wait on too, stay within their budget and go back at close (a dropped one's
fetch cancelled, or counted until it ends); a window is MAX_WINDOW at most; the
fetcher threads take files in turn."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import eventually

from mxfs.pool import read_ahead
from mxfs.pool.read_ahead import ReadAhead

MiB = 1 << 20


@pytest.fixture(autouse=True)
def windows_settled() -> Iterator[None]:
    """Each test starts with no window held and leaves none: a closed file's fetches
    ahead give their windows back when they end, after the test that closed it (CI
    once began a test with 48 MiB of the last one's still in flight, and its count of
    "before" was off by that).  What a failed test leaves is let go, not carried on."""
    assert eventually(lambda: read_ahead._held == 0), "an earlier test's windows held"
    yield
    settled = eventually(lambda: read_ahead._held == 0 and not read_ahead._held_by)
    with read_ahead._fetchers_lock:
        read_ahead._held, read_ahead._held_by = 0, {}
    assert settled, "windows still held after the test"


class Source:
    """A file's bytes, fetched as a remote node would serve them (zeros past the end)."""

    def __init__(self, size: int) -> None:
        self.data = os.urandom(size)
        self.fetched: list[int] = []
        self.largest = 0  # the most bytes one fetch asked for
        self.fail_at: int | None = None
        self.lock = threading.Lock()

    def fetch(self, offset: int, buf: memoryview) -> None:
        with self.lock:
            self.fetched.append(offset)
            self.largest = max(self.largest, len(buf))
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


def test_nothing_past_the_files_end_is_fetched_or_held() -> None:
    """A file smaller than a window read in order: one fetch, of its bytes alone, and
    only those held (it fetched four whole windows of nothing ahead, which went on
    after its reader closed it, and held five windows of the budget)."""
    src = Source(MiB + 12345)
    end = len(src.data)
    ra = ReadAhead(MiB, src.fetch)
    out = bytearray(end)
    view = memoryview(out)
    read(ra, src, 0, view[:128 << 10], end)
    for off in range(128 << 10, end, 128 << 10):
        read(ra, src, off, view[off:off + (128 << 10)], end)
        assert read_ahead._held == end  # (one window, to the end)
    assert out == src.data
    assert src.fetched == [0, 0] and src.largest == end  # (the first read's, a window's)
    ra.close()


def test_a_window_fetched_to_an_old_end_is_fetched_again_past_it() -> None:
    """The file grew while a window held its bytes to the old end: a read within
    them is served from it, and one past the old end gets the new bytes, never the
    zeros the short window does not hold."""
    src = Source(4 * MiB)
    ra = ReadAhead(MiB, src.fetch)
    buf = memoryview(bytearray(MiB))
    read(ra, src, 0, buf, MiB)  # (the first: read straight)
    read(ra, src, 0, buf, MiB)  # the window, fetched to 1 MiB
    half = buf[:MiB // 2]
    read(ra, src, MiB // 2, half, 4 * MiB)  # (within what it holds: served from it)
    assert bytes(half) == src.data[MiB // 2:MiB] and src.fetched.count(0) == 2
    read(ra, src, MiB, buf, 4 * MiB)
    assert bytes(buf) == src.data[MiB:2 * MiB]
    assert src.fetched.count(0) == 3 and read_ahead._held == 4 * MiB
    ra.close()


def test_a_read_after_the_last_close_starts_no_window() -> None:
    """A read that began before its file's last close and reaches the windows after
    it: windows started then were never dropped, and held the budget for good."""
    src = Source(64 * MiB)
    ra = ReadAhead(MiB, src.fetch)
    buf = memoryview(bytearray(MiB))
    read(ra, src, 0, buf)
    ra.close(final=True)
    read(ra, src, MiB, buf)
    assert bytes(buf) == src.data[MiB:2 * MiB]
    assert read_ahead._held == 0 and src.fetched == [0, MiB]  # (both read straight)


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


def read(ra: ReadAhead, src: Source, offset: int, buf: memoryview,
         end: int | None = None) -> None:
    """As `ChunkFiles.read`: from the windows, or else straight from the source."""
    if not ra.read(offset, buf, end=end):
        src.fetch(offset, buf)


def test_windows_stay_within_the_budget_and_go_back_at_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_ahead, "BUDGET", 3 * read_ahead.WINDOW)
    files = [(ReadAhead(MiB, src.fetch), src) for src in
             (Source(20 * MiB) for _ in range(16))]
    buf = memoryview(bytearray(128 << 10))
    for ra, src in files:  # two reads in order each, the files kept open
        for off in (0, 128 << 10, 4 * MiB):
            read(ra, src, off, buf)
            assert bytes(buf) == src.data[off:off + len(buf)]  # past the budget too
    # the windows reads wait on count as well: held open, they stay within the budget
    assert read_ahead._held <= read_ahead.BUDGET
    assert read_ahead._held > 0  # (the first file's still read through them)
    for ra, _ in files:
        ra.close()
    assert eventually(lambda: read_ahead._held == 0)  # (once fetches ahead end)


def test_a_huge_stripe_row_is_read_a_window_at_most_at_a_time() -> None:
    assert read_ahead.window_size(4 << 30) <= read_ahead.MAX_WINDOW  # 1 GiB unit x 4
    assert read_ahead.window_size(48 * MiB) == 48 * MiB  # whole rows where they fit
    assert read_ahead.window_size(MiB) == read_ahead.WINDOW
    src = Source(8 * MiB)
    ra = ReadAhead(4 << 30, src.fetch)
    assert ra.size <= read_ahead.MAX_WINDOW  # (before a read: 4 GiB windows otherwise)
    buf = memoryview(bytearray(128 << 10))
    for off in (0, 128 << 10, 256 << 10):
        read(ra, src, off, buf)
        assert bytes(buf) == src.data[off:off + len(buf)]
    assert 0 < src.largest <= read_ahead.MAX_WINDOW
    ra.close()


def test_fetchers_take_files_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_ahead, "_fetchers", ThreadPoolExecutor(1))
    order: list[str] = []
    release = threading.Event()

    def fetch(name: str) -> bytearray:
        if name == "busy":
            release.wait()
        order.append(name)
        return bytearray()

    futures = [read_ahead._submit("x", lambda: fetch("busy"), first=True)]
    futures += [read_ahead._submit("a", lambda n=n: fetch(f"a{n}"), first=False)
                for n in range(1, 5)]  # one file's windows ahead, queued first
    futures.append(read_ahead._submit("b", lambda: fetch("b0"), first=False))
    futures.append(read_ahead._submit("a", lambda: fetch("a0"), first=True))
    release.set()
    for fut in futures:
        fut.result()
    # another file's fetch waits for one of the first's, not all of them; the one a
    # read waits on goes before that file's windows ahead
    assert order == ["busy", "a0", "b0", "a1", "a2", "a3", "a4"]
    read_ahead.fetchers().shutdown()


def test_one_users_windows_leave_the_rest_of_the_budget_to_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows count against the share of the user whose read fetched them: alice's
    files read in order and kept open hold her share at most, and bob's reads still
    come from windows (before, hers took the whole budget, and his went unwindowed)."""
    monkeypatch.setattr(read_ahead, "BUDGET", 8 * read_ahead.WINDOW)
    monkeypatch.setattr(read_ahead, "PER_USER", 2 * read_ahead.WINDOW)
    alice, bob = 1001, 1002
    buf = memoryview(bytearray(128 << 10))
    hers = [(ReadAhead(MiB, src.fetch), src) for src in
            (Source(40 * MiB) for _ in range(8))]
    for ra, _src in hers:  # (two reads in order each: their windows, and those ahead)
        for off in (0, 128 << 10):
            ra.read(off, buf, alice)
    assert read_ahead._held_by.get(alice, 0) <= read_ahead.PER_USER
    src = Source(40 * MiB)
    his = ReadAhead(MiB, src.fetch)
    his.read(0, buf, bob)
    assert his.read(128 << 10, buf, bob), "bob's in-order read was not windowed"
    assert bytes(buf) == src.data[128 << 10:256 << 10]
    for ra, _ in [*hers, (his, src)]:
        ra.close()
    assert eventually(lambda: not read_ahead._held_by)


class SlowSource(Source):
    """A file on a node that answers nothing until `gate` is set."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.gate, self.started = threading.Event(), threading.Event()

    def fetch(self, offset: int, buf: memoryview) -> None:
        self.started.set()
        self.gate.wait(30)
        super().fetch(offset, buf)


def test_a_dropped_window_is_not_fetched_and_counts_until_its_fetch_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows dropped (a write, a close) before their fetch began are never fetched,
    and a read waiting on one reads straight; one whose fetch runs stays counted until
    the fetch ends.  Before, every dropped window was fetched all the same, for nobody,
    its buffer outside the budget."""
    monkeypatch.setattr(read_ahead, "_fetchers", ThreadPoolExecutor(1))
    slow, src = SlowSource(100 * MiB), Source(100 * MiB)
    held, ra = ReadAhead(MiB, slow.fetch), ReadAhead(MiB, src.fetch)
    bufs = [memoryview(bytearray(128 << 10)) for _ in range(2)]
    held.read(0, bufs[0])
    ra.read(0, bufs[1])
    readers = [threading.Thread(target=read, args=(f, s, 128 << 10, b))
               for f, s, b in ((held, slow, bufs[0]), (ra, src, bufs[1]))]
    readers[0].start()
    assert slow.started.wait(10)  # its first window's fetch runs (the one fetcher)
    readers[1].start()  # (until every window of both is counted: 1 running, 9 queued)
    assert eventually(lambda: read_ahead._held == 10 * held.size)
    ra.close()
    held.close()
    readers[1].join(10)
    assert not readers[1].is_alive()  # its window dropped: it read straight
    assert bytes(bufs[1]) == src.data[128 << 10:256 << 10]
    assert read_ahead._held == held.size  # the running fetch's buffer
    slow.gate.set()
    readers[0].join(10)
    assert bytes(bufs[0]) == slow.data[128 << 10:256 << 10]
    read_ahead.fetchers().shutdown(wait=True)  # (the cancelled fetches' turns run)
    assert slow.fetched == [0] and src.fetched == [128 << 10]
    assert read_ahead._held == 0

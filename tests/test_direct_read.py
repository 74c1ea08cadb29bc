"""O_DIRECT on the direct read path: aligned middles bypass the cache, bytes stay exact."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import tempfile
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, Mounted, force_unmount, make_members, mkfs, steady_page_cache
from conftest import mxfs as mxfs_cli
from hypothesis import given, settings
from hypothesis import strategies as hs

from mxfs.cli.measure import drop_caches
from mxfs.client.direct import (
    DIO_ALIGN,
    DirectFile,
    address_of,
    aligned_like,
    open_reader,
    split_direct,
)
from mxfs.io import read_batch
from mxfs.io.residency import Residency
from mxfs.proto import MAX_FDS


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def write(path: Path, n: int, seed: int = 1) -> bytes:
    data = random.Random(seed).randbytes(n)
    path.write_bytes(data)
    return data


@pytest.mark.unit
@settings(max_examples=1000, deadline=None)
@given(offset=hs.integers(0, 3 * DIO_ALIGN), length=hs.integers(0, 5 * DIO_ALIGN),
       shift=hs.integers(0, DIO_ALIGN - 1), cut=hs.integers(0, 5 * DIO_ALIGN))
def test_split_direct_covers_the_range_and_aligns_what_goes_direct(
        offset: int, length: int, shift: int, cut: int) -> None:
    """Whatever the offset, length, buffer address and iovec cut: every byte is read once,
    from the right file offset; what goes O_DIRECT is aligned in file, length and memory."""
    backing = aligned_like(length + DIO_ALIGN, 0)[shift:shift + length]
    cut = min(cut, length)
    bufs = [b for b in (backing[:cut], backing[cut:]) if len(b)]
    ops = split_direct(10, 11, offset, bufs)
    covered = []
    for op in ops:
        pos = op.offset
        for b in op.bufs:
            covered.append((pos, address_of(b) - address_of(backing), len(b)))
            if op.fd == 11:
                assert pos % DIO_ALIGN == 0 and len(b) % DIO_ALIGN == 0
                assert address_of(b) % DIO_ALIGN == 0
            pos += len(b)
    covered.sort()
    at = offset
    for pos, start, n in covered:
        assert pos == at and start == pos - offset  # file offset matches buffer place
        at += n
    assert at == offset + length
    if (shift - offset) % DIO_ALIGN:  # the buffer does not line up: nothing goes direct
        assert all(op.fd == 10 for op in ops)


@pytest.mark.smoke
def test_forced_direct_reads_equal_the_file_at_any_offset(mounted: Mounted) -> None:
    data = write(mounted.path / "f.bin", 3 * 65536 * 4 + 12345)
    rng = random.Random(3)
    with open_reader(str(mounted.path / "f.bin")) as r:
        assert isinstance(r, DirectFile)
        assert r.direct_fds and all(is_direct(fd) for fd in r.direct_fds.values())
        assert not any(is_direct(fd) for fd in r.fds.values())
        r.odirect = "always"
        for _ in range(40):
            off = rng.randrange(len(data))
            n = rng.randrange(len(data) - off + 1)
            for buf in (aligned_like(n, off), memoryview(bytearray(n))):
                r.read_into(off, buf)
                assert bytes(buf) == data[off:off + n], (off, n)
        whole = aligned_like(len(data), 0)
        ops = r.plan_reads([(0, whole)])
        assert any(op.fd in r.direct_fds.values() for op in ops)
        read_batch(ops)
        assert bytes(whole) == data


def test_auto_reads_cached_pieces_buffered_and_cold_ones_direct(mounted: Mounted) -> None:
    data = write(mounted.path / "g.bin", 8 * 65536 + 100)
    path = str(mounted.path / "g.bin")
    with open_reader(path) as r:
        assert isinstance(r, DirectFile)
        buf = aligned_like(len(data), 0)
        r.read_into(0, buf)  # buffered or not, this reads it; now make it cached:
        with steady_page_cache():
            for m, fd in r.fds.items():
                os.pread(fd, os.fstat(fd).st_size, 0)
                assert Residency(fd, 0, os.fstat(fd).st_size).cached_fraction(
                    0, os.fstat(fd).st_size) == 1.0, m
            warm = r.plan_reads([(0, buf)])
        assert not any(op.fd in r.direct_fds.values() for op in warm)
        drop_caches()
        for fd in r.fds.values():
            assert Residency(fd, 0, os.fstat(fd).st_size).cached_fraction(
                0, os.fstat(fd).st_size) < 0.5
        cold = r.plan_reads([(0, buf)])
        assert any(op.fd in r.direct_fds.values() for op in cold)
        read_batch(cold)
        assert bytes(buf) == data


def test_cachestat_and_mincore_see_the_same_cached_pages(tmp_path: Path) -> None:
    """Residency asks cachestat(2) where the kernel has it, mincore elsewhere: over a file
    cached in patches, both give each range the same share, the kernel's own answer."""
    page = os.sysconf("SC_PAGE_SIZE")
    path = tmp_path / "patches.bin"
    write(path, 64 * page + 123)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if any(b & 1 for b in Residency(fd, 0, 65 * page, probe="mincore").pages or b""):
            pytest.skip("this filesystem keeps its pages cached (tmpfs): nothing to tell apart")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only what is read
        for first, n in ((0, 3), (10, 1), (20, 8), (63, 2)):  # the last runs past EOF
            os.pread(fd, n * page, first * page)
        size = os.fstat(fd).st_size
        fast, slow = Residency(fd, 0, size), Residency(fd, 0, size, probe="mincore")
        assert slow.pages is not None and fast.pages is None
        cached = [i for i in range(65) if slow.pages[i] & 1]
        assert cached == [0, 1, 2, 10, *range(20, 28), 63, 64]  # what was read, no more
        for off, n in ((0, size), (0, 3 * page), (page, 2 * page), (5 * page, 10 * page),
                       (20 * page + 7, 4000), (30 * page, 20 * page), (60 * page, size)):
            assert fast.cached_fraction(off, n) == slow.cached_fraction(off, n), (off, n)
        assert fast.pages is None  # answered by cachestat, never falling back here
    finally:
        os.close(fd)


def test_direct_reads_of_sparse_files_read_zeros(mounted: Mounted) -> None:
    path = mounted.path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(5 * 65536 * 4)
        f.seek(3 * 65536 + 10)
        f.write(b"x" * 70000)
    expect = path.read_bytes()
    with open_reader(str(path)) as r:
        assert isinstance(r, DirectFile)
        r.odirect = "always"
        buf = aligned_like(len(expect) - 7, 7)
        r.read_into(7, buf)
        assert bytes(buf) == expect[7:]


def test_wide_pools_read_without_o_direct_and_too_wide_ones_fail_cleanly(
        tmp_path: Path) -> None:
    """One reply carries at most MAX_FDS descriptors: with O_DIRECT ones that is 32 members.
    Wider pools read buffered; a file on more members than one reply can carry is an
    error for that request, and the daemon keeps serving."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    for width in (MAX_FDS // 2 + 8, MAX_FDS + 6):
        members = make_members(tmp_path / str(width), width)
        mkfs(members, "64KiB")
        mp = tempfile.mkdtemp(prefix="mxfs-wide-")
        mxfs_cli("mount", members[0], mp)
        try:
            data = write(Path(mp) / "wide.bin", width * 65536 + 999)
            if width <= MAX_FDS:
                with open_reader(os.path.join(mp, "wide.bin")) as r:
                    assert isinstance(r, DirectFile)
                    assert len(r.fds) == width and not r.direct_fds
                    buf = aligned_like(len(data), 0)
                    r.read_into(0, buf)
                    assert bytes(buf) == data
            else:
                with pytest.raises(OSError) as e:
                    open_reader(os.path.join(mp, "wide.bin"))
                assert e.value.errno == errno.E2BIG
            assert (Path(mp) / "wide.bin").read_bytes() == data  # the daemon still serves
        finally:
            force_unmount(mp)
            os.rmdir(mp)

"""Files read beside the mount: chunk descriptors from the daemon, bytes moved here.

`open_reader(path)` gives a `DirectFile` for a file on an mxfs mount (the daemon
checks the caller may read it and passes read-only chunk descriptors), a `RemoteFile`
for one whose members another node owns (the daemon passes connections to the
owner, scoped to the file: `client/remote_file.py`), or a `PlainFile` for any other
file, with one interface (`client/reader.py`), so loaders need not care.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from mxfs.client.control import ControlClient, ControlError, Untrusted, mount_root
from mxfs.client.reader import (
    HUGE_PAGE,
    SEGMENT,
    FileChanged,
    PlainFile,
    Reader,
    check_range,
    check_same,
    map_risk,
)
from mxfs.client.remote_file import RemoteFile
from mxfs.errors import MxfsError
from mxfs.io import PAGE, Layout, Piece, ReadOp, read_batch
from mxfs.io.batch import executor
from mxfs.io.residency import Residency
from mxfs.proto.messages import OPEN_READ

__all__ = ["DIO_ALIGN", "SEGMENT", "DirectFile", "FileChanged", "PlainFile", "Reader",
           "RemoteFile", "aligned_like", "open_reader"]

# What O_DIRECT asks of file offsets, lengths and buffer addresses (the largest
# logical block size in use; XFS and ext4 on NVMe need 512 or 4096): the page.
DIO_ALIGN = PAGE
# The most one O_DIRECT request carries (see merge_runs); MXFS_DIRECT_RUN overrides.
DIRECT_RUN = int(os.environ.get("MXFS_DIRECT_RUN", 32 << 20))
IOV_MAX = os.sysconf("SC_IOV_MAX")
_MAP_FIXED = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


class DirectFile(Reader):
    """A file on an mxfs mount, read straight from its chunk files in parallel."""

    def __init__(self, path: str, client: ControlClient | None,
                 opened: tuple[Mapping[str, Any], list[int]] | None = None,
                 pool_path: str = "") -> None:
        """Open `path` with `open_read`, or wrap what another request handed over
        (`opened`: its reply, with size, layout and members, and the descriptors;
        without a client when an unmounted pool was opened directly; `pool_path`: the
        file's path in the pool, when `check_unchanged` should look it up)."""
        self.path = path
        self.client = client
        self._pool_path = pool_path
        if opened is None:
            assert client is not None
            self._pool_path = client.pool_path(path)
            read = client.request_with_fds(OPEN_READ({"path": self._pool_path,
                                                      "odirect": True}))
            opened = read
        reply, fds = opened
        try:
            self.size = int(reply["size"])
            self.ino, self.generation = reply.get("ino"), reply.get("generation")
            self.sealed = bool(reply.get("sealed"))
            self.layout = Layout.from_description(reply["layout"])
            members, direct = reply["members"], reply.get("direct_members", [])
            self.fds = dict(zip(members, fds[:len(members)], strict=True))
            self.direct_fds = dict(zip(direct, fds[len(members):], strict=True))
        except (KeyError, TypeError, ValueError):
            for fd in fds:
                os.close(fd)
            raise
        self.odirect = "auto"

    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer from its file offset, every member at once, in one batch."""
        read_batch(self.plan_reads(ranges))

    def plan_reads(self, ranges: list[tuple[int, memoryview]]) -> list[ReadOp]:
        """The reads that fill each buffer (holes are zeroed now), to run in a batch
        that several files may share.

        A piece whose pages are mostly not cached is read with O_DIRECT where the
        buffer lines up with the file (same offset modulo 4 KiB; `aligned_like`
        makes such buffers): the aligned middle goes straight from the device into
        the buffer, the unaligned edges through the cache.  `odirect` is "auto"
        (that choice), "always" or "never".
        """
        planned = []
        for offset, buf in ranges:
            check_range(self, offset, len(buf))
            for seg in range(0, len(buf), SEGMENT):
                part = buf[seg:seg + SEGMENT]
                planned += [(p, [part[o:o + n] for o, n in p.spans])
                            for p in self.layout.plan(offset + seg, len(part))]
        cache = self._residency([p for p, _ in planned])
        ops: list[ReadOp] = []
        direct_ops: list[ReadOp] = []
        for piece, bufs in planned:
            fd = self.fds.get(piece.member)
            if fd is None:
                for b in bufs:
                    b[:] = bytes(len(b))
                continue
            direct = self.direct_fds.get(piece.member)
            if direct is not None and self._go_direct(cache, piece):
                for op in split_direct(fd, direct, piece.chunk_offset, bufs):
                    (direct_ops if op.fd == direct else ops).append(op)
            else:
                ops.append(ReadOp(fd, piece.chunk_offset, bufs))
        return merge_runs(direct_ops) + ops

    def _residency(self, pieces: list[Piece]) -> dict[int, Residency]:
        """Page-cache residency of each member's chunk range these pieces touch."""
        if self.odirect != "auto" or not self.direct_fds:
            return {}
        spans: dict[int, tuple[int, int]] = {}
        for p in pieces:
            if p.length < DIO_ALIGN:
                continue  # too short for an aligned block: always buffered (headers, rows)
            lo, hi = spans.get(p.member, (p.chunk_offset, p.chunk_offset))
            spans[p.member] = (min(lo, p.chunk_offset), max(hi, p.chunk_offset + p.length))
        return {m: Residency(self.fds[m], lo, hi) for m, (lo, hi) in spans.items()
                if m in self.direct_fds}

    def cached_fraction(self) -> float:
        """The share of the file's bytes in the page cache (0..1), over every member."""
        total = cached = 0.0
        for m, fd in self.fds.items():
            n = self.layout.chunk_length(m, self.size)
            total += n
            cached += n * Residency(fd, 0, n).cached_fraction(0, n) if n else 0
        return cached / total if total else 1.0

    def _go_direct(self, cache: dict[int, Residency], piece: Piece) -> bool:
        if self.odirect == "auto":
            res = cache.get(piece.member)
            return res is not None and \
                res.cached_fraction(piece.chunk_offset, piece.length) < 0.5
        return self.odirect == "always"

    def check_unchanged(self) -> None:
        """Raise FileChanged if the path now names another file or other bytes."""
        if self.client is None or not self._pool_path:
            return  # an unmounted pool, held by a shared lock: nothing can change it
        check_same(self.client, self._pool_path, (self.ino, self.generation, self.size),
                   self.path)

    def close(self) -> None:
        for fd in [*self.fds.values(), *self.direct_fds.values()]:
            os.close(fd)
        self.fds.clear()
        self.direct_fds.clear()

    def mappings(self) -> int:
        return 1 + (self.size + self.layout.unit - 1) // self.layout.unit

    def map_risk(self) -> str | None:
        """(`Reader.map_risk`; a sealed file's bytes never change in place.)"""
        if self.client is None:
            return None  # an unmounted pool, held by a shared lock: nothing can change it
        st = os.stat(self.path)
        if st.st_ino != self.ino:
            return "its path names another file now"
        return map_risk(st, self.path, self.sealed)

    def cache(self) -> None:
        """Read every member's chunk file into the page cache at once, and wait.

        A mapped load would otherwise page in on first touch, in file order, keeping
        only the member under the current stripe busy; and pages brought in by
        faults come as 4 KiB pages, which every later mapping of the file pays for
        (touching 1 GiB of a warm mapping: 45-60 ms over such pages, 6-10 ms over the
        large folios that reads make, kernel 6.18).  WILLNEED is no substitute:
        this kernel reads only the first 8 MiB of it.  Runs already cached are
        skipped, and a file wholly cached costs one lookup per member (cachestat: a
        mincore of every page took 20 ms of a warm 1 GiB load) and no thread.
        """
        todo = [(fd, runs) for fd in self.fds.values() if (runs := _uncached_runs(fd))]
        if todo:
            list(executor().map(lambda job: _read_runs(*job), todo))

    def map(self) -> mmap.mmap:
        """The file's stripes mapped side by side into one contiguous range.

        An anonymous mapping reserves the range (and owns it: closing it unmaps
        everything); each stripe's piece of a chunk file is then mapped over its
        place with MAP_FIXED.  Pieces past a chunk file's end stay anonymous
        zeros, so a sparse tail never raises SIGBUS.
        """
        lay = self.layout
        # A length in whole huge pages: the kernel then puts the range on a huge-page
        # boundary, so stripes of 2 MiB and more map cached huge folios a fault each.
        length = -(-max(self.size, 1) // HUGE_PAGE) * HUGE_PAGE
        region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        lengths = {m: os.fstat(fd).st_size for m, fd in self.fds.items()}
        for k in range((self.size + lay.unit - 1) // lay.unit):
            member, chunk_off = lay.locate(k * lay.unit)
            fd = self.fds.get(member)
            n = min(lay.unit, self.size - k * lay.unit, lengths.get(member, 0) - chunk_off)
            if fd is None or n <= 0:
                continue
            n = (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            got = _libc.mmap(ctypes.c_void_p(base + k * lay.unit), ctypes.c_size_t(n),
                             mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | _MAP_FIXED, fd, ctypes.c_long(chunk_off))
            if got != base + k * lay.unit:
                err = ctypes.get_errno()
                region.close()
                raise OSError(err, f"mapping stripe {k} of {self.path}: {os.strerror(err)}")
        return region


def address_of(buf: memoryview) -> int:
    """The address of a writable buffer's first byte (0 when empty)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0


def _cut(bufs: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first `n` bytes of an iovec, and the rest."""
    head: list[memoryview] = []
    rest: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            head.append(b)
            n -= len(b)
        elif n > 0:
            head.append(b[:n])
            rest.append(b[n:])
            n = 0
        else:
            rest.append(b)
    return head, rest


def split_direct(fd: int, direct: int, offset: int, bufs: list[memoryview]) -> list[ReadOp]:
    """Reads for one contiguous chunk range: its DIO_ALIGN-aligned middle from the
    O_DIRECT descriptor `direct`, the edges from the buffered `fd`.

    All of it goes buffered when the buffer does not line up with the file (its
    address and `offset` differ modulo DIO_ALIGN), or the iovec is cut between
    blocks inside the middle: O_DIRECT would refuse either.
    """
    length = sum(len(b) for b in bufs)
    lo = -offset % DIO_ALIGN
    hi = (offset + length) // DIO_ALIGN * DIO_ALIGN - offset
    if not bufs or hi <= lo or (address_of(bufs[0]) - offset) % DIO_ALIGN:
        return [ReadOp(fd, offset, bufs)]
    head, rest = _cut(bufs, lo)
    middle, tail = _cut(rest, hi - lo)
    if any(len(b) % DIO_ALIGN or address_of(b) % DIO_ALIGN for b in middle):
        return [ReadOp(fd, offset, bufs)]  # an iovec cut off the blocks: O_DIRECT refuses
    ops = [ReadOp(direct, offset + lo, middle)]
    if head:
        ops.append(ReadOp(fd, offset, head))
    if tail:
        ops.append(ReadOp(fd, offset + hi, tail))
    return ops


def merge_runs(ops: list[ReadOp], limit: int = DIRECT_RUN) -> list[ReadOp]:
    """Join reads that continue one another on the same descriptor, up to `limit` bytes
    (and IOV_MAX buffers) each, in file order: the thread pool reads each run with one
    preadv, the io_uring engine submits its buffers back to back; either way a member
    streams in order, which on the development disk beat interleaved 4 MiB reads by
    half again (docs/benchmarks.md)."""
    out: list[ReadOp] = []
    size = 0
    for op in sorted(ops, key=lambda o: (o.fd, o.offset)):
        n = sum(len(b) for b in op.bufs)
        last = out[-1] if out else None
        if (last is not None and last.fd == op.fd and last.offset + size == op.offset
                and size + n <= limit and len(last.bufs) + len(op.bufs) <= IOV_MAX):
            out[-1] = ReadOp(op.fd, last.offset, [*last.bufs, *op.bufs])
            size += n
        else:
            out.append(op)
            size = n
    return out


# Requests of `DirectFile.cache`: large enough that the kernel's readahead keeps a member busy.
PREFETCH_RUN = 8 << 20


def _uncached_runs(fd: int) -> list[int]:
    """Offsets of the PREFETCH_RUN-long runs of a chunk file not wholly in the page cache."""
    try:
        size = os.fstat(fd).st_size
    except OSError:
        return []
    cached = Residency(fd, 0, size)
    if cached.cached_fraction(0, size) == 1.0:
        return []  # warm: one lookup, not one a run
    return [off for off in range(0, size, PREFETCH_RUN)
            if cached.cached_fraction(off, PREFETCH_RUN) < 1.0]


def _read_runs(fd: int, runs: list[int]) -> None:
    """Read runs of a chunk file into the page cache (the bytes are thrown away)."""
    try:
        with mmap.mmap(-1, PREFETCH_RUN) as buf:
            for offset in runs:
                os.preadv(fd, [buf], offset)
    except OSError:
        pass  # only a head start: the load's own page faults read what is left


HUGE_MIN = 4 << 20  # buffers from this size on ask for transparent huge pages


def aligned_like(nbytes: int, offset: int) -> memoryview:
    """A new zeroed buffer of `nbytes` whose address matches file `offset` modulo
    DIO_ALIGN, so direct reads of [offset, offset + nbytes) fill it without a bounce."""
    raw = mmap.mmap(-1, nbytes + DIO_ALIGN)  # page-aligned
    if nbytes >= HUGE_MIN:
        # 2 MiB pages where the kernel allows: a fresh buffer's first touch (by the
        # kernel's copy into it) then faults 512 times less often, which is most of
        # the cost of a warm read into new memory.
        with suppress(OSError, AttributeError):
            raw.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(raw)[offset % DIO_ALIGN:offset % DIO_ALIGN + nbytes]


_clients: dict[str, ControlClient] = {}


def control_client_for(path: str) -> ControlClient | None:
    """The (shared) client of the daemon serving `path`; None when it is on no mxfs mount."""
    try:
        root = mount_root(path)
    except OSError as e:
        if e.errno != errno.ENOTCONN:
            raise
        raise MxfsError(f"the mxfs daemon serving {path} is not running (its mount is dead)",
                        "remount: mxfs umount MOUNTPOINT, then mxfs mount POOL MOUNTPOINT") \
            from None
    if root is None:
        return None
    client = _clients.get(root)
    if client is not None and not client.alive():
        client.close()  # its daemon went away (a remount): connect to the new one
        client = None
    if client is None:
        try:
            client = _clients[root] = ControlClient(root)
        except Untrusted as e:
            raise MxfsError(e.strerror or str(e), "give a path on an mxfs mount") from None
        except OSError as e:
            raise MxfsError(f"the mxfs daemon of {root} does not answer ({e.strerror or e})",
                            f"check it with: mxfs status {root}; if it died: mxfs umount "
                            f"{root}, then mxfs mount POOL {root}") from None
    return client


def open_reader(path: str, direct: bool = True, pool: Any = None,
                odirect: str | None = None) -> Reader:
    """A reader for `path`: direct from the chunk files when it is on an mxfs mount.

    With `pool` (an `mxfs.pool.offline.OfflinePool`), `path` is a path inside that
    unmounted pool, read straight from its members.  `odirect` "always"|"never"
    overrides how direct readers pick O_DIRECT (default: MXFS_ODIRECT, else auto:
    for uncached pieces).
    """
    if pool is not None:
        return _with_policy(DirectFile(path, None, pool.open_read(path)), odirect)
    client = control_client_for(path) if direct else None
    if client is None:
        return PlainFile(path)
    try:
        pool_path = client.pool_path(path)
        reply, fds = client.request_with_fds(OPEN_READ({"path": pool_path, "odirect": True,
                                                        "remote": True}))
        if "remote" in reply:  # on a reading node: connections to the owner node
            return RemoteFile(path, client, pool_path, reply, fds)
        return _with_policy(DirectFile(path, client, (reply, fds), pool_path), odirect)
    except ControlError as e:
        if e.errno in (errno.EXDEV, errno.EREMOTE):  # a link out of the mount, or a file
            return PlainFile(path)  # on another node's members with no direct read left
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, f"{path}: no such file") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(e.errno, f"{path}: {e.strerror}") from None
        raise


def _with_policy(f: DirectFile, policy: str | None) -> DirectFile:
    policy = policy or os.environ.get("MXFS_ODIRECT") or "auto"
    if policy not in ("auto", "always", "never"):
        raise MxfsError(f"O_DIRECT policy {policy!r} is not one", "use auto, always or never")
    f.odirect = policy
    return f

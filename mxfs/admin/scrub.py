"""`mxfs scrub`: read every sealed file and check each block against its xxh3.

Sealed files (checkpoints, models and KV chunks written by direct commits)
carry per-block checksums in the metadata store.  Scrub reads them from the
members' chunk files and names every file with a bad or missing block, and the
member that holds it: RAID0 keeps no second copy, so knowing exactly what is
damaged is the repair.  It runs while the pool is mounted (it opens the
metadata store read-only, beside the daemon), throttled to a byte rate.  In a pool
whose members several nodes hold it runs on any of them that holds members: the
stripes on other nodes' members are read through their owners' chunk services (as a
mount reads them); a file with stripes on a node that cannot be reached is named
as not checked, never as sound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from mxfs.io import Layout
from mxfs.io.checksum import unpack_sums
from mxfs.meta import MetaStore, survey
from mxfs.meta.survey import display_name
from mxfs.pool import Pool


@dataclass(frozen=True)
class Bad:
    path: str
    begin: int
    end: int
    member: int
    why: str  # "checksum" or "missing"

    def line(self) -> str:
        return (f"DAMAGED {self.path}: bytes [{self.begin}, {self.end}) on member "
                f"{self.member}: {self.why}")


@dataclass(frozen=True)
class Unchecked:
    path: str
    why: str  # which node could not serve its stripes, and why; or its seal's damage

    def line(self) -> str:
        return f"NOT CHECKED {self.path}: {self.why}"


@dataclass(frozen=True)
class Sealed:
    ino: int
    size: int
    layout: Layout
    sum_unit: int
    sums: tuple[int, ...]


def sealed(store: MetaStore, ino: int, members: int) -> Sealed | None:
    """The sealed file `ino` as the rows hold it now (None: removed, or no longer
    sealed)."""
    s = survey.sealed_file(store, ino)
    if s is None:
        return None
    f = s.file
    return Sealed(f.ino, f.size, Layout(f.stripe_unit, f.stripe_width, f.first_member,
                                        members), s.sum_unit, unpack_sums(s.sums))


# Bytes of a checksum block read and hashed at a time.  A block is as large as its
# committer said: bounded at commit (`io/checksum.MAX_SUM_UNIT`), but a pool may hold
# seals made before that bound, or a damaged store any size, and a tenant's sparse file
# sealed as one block of its whole size had scrub allocate twice that.
PIECE = 8 << 20


def seal_problem(f: Sealed) -> str | None:
    """Why `f`'s checksums cannot describe its bytes, if they cannot (a damaged store)."""
    if f.sum_unit <= 0 or len(f.sums) != -(-f.size // f.sum_unit):
        return (f"its seal is malformed: {len(f.sums)} checksums of {f.sum_unit} bytes "
                f"for {f.size} bytes")
    return None


def scrub_file(pool: Pool, f: Sealed, throttle: Callable[[int], None]) -> list[tuple[int, int,
                                                                                      str]]:
    """(begin, end, why) of each bad block of one sealed file; stripes on other nodes'
    members read through their owners (EIO naming the node that cannot serve them).
    A block is read PIECE bytes at a time into one buffer, its hash fed as it goes."""
    bad: list[tuple[int, int, str]] = []
    fds: dict[int, int | None] = {}
    buf = memoryview(bytearray(min(PIECE, f.size)))
    try:
        for k, want in enumerate(f.sums):
            begin = k * f.sum_unit
            n = min(f.sum_unit, f.size - begin)
            h = xxhash.xxh3_64()
            missing = False
            for at in range(begin, begin + n, PIECE):
                piece = buf[:min(PIECE, begin + n - at)]
                missing = _read_into(pool, f, fds, at, piece)
                throttle(len(piece))
                if missing:
                    break  # (the rest of the block is not wanted)
                h.update(piece)
            if missing:
                bad.append((begin, begin + n, "missing"))
            elif h.intdigest() != want:
                bad.append((begin, begin + n, "checksum"))
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    return bad


def _read_into(pool: Pool, f: Sealed, fds: dict[int, int | None], at: int,
               buf: memoryview) -> bool:
    """Read the file's bytes [at, at + len(buf)) from its members into `buf`; True if a
    member held fewer than asked (its chunk file missing or short)."""
    missing = False
    for piece in f.layout.plan(at, len(buf)):
        if pool.members[piece.member].node:
            got = pool.remote_of(piece.member).read_bytes(
                f.ino, piece.member, piece.chunk_offset, piece.length)
            missing |= _place(buf, got, piece.spans, piece.length)
            continue
        if piece.member not in fds:
            try:
                fds[piece.member] = os.open(pool.chunk_path(piece.member, f.ino),
                                            os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fds[piece.member] = None
        fd = fds[piece.member]
        got = b"" if fd is None else os.pread(fd, piece.length, piece.chunk_offset)
        missing |= _place(buf, got, piece.spans, piece.length)
    return missing


def _place(buf: memoryview, got: bytes, spans: Sequence[tuple[int, int]], length: int
           ) -> bool:
    """Put a member's bytes back at their places in the block; True if it held fewer
    than the `length` asked (its chunk file missing or short)."""
    pos = 0
    for o, m in spans:
        part = got[pos:pos + m]
        buf[o:o + len(part)] = part
        pos += m
    return len(got) < length


class Throttle:
    """Sleep enough to keep reads at or under `rate` bytes a second (0: no limit)."""

    def __init__(self, rate: int) -> None:
        self.rate, self.done, self.start = rate, 0, time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        if self.rate:
            ahead = self.done / self.rate - (time.monotonic() - self.start)
            if ahead > 0:
                time.sleep(ahead)


def scrub(pool: Pool, store: MetaStore, rate: int = 0,
          progress: Callable[[int, int], None] = lambda done, total: None
          ) -> tuple[int, list[Bad], list[Unchecked]]:
    """Check every sealed file: (files checked, damage found, files not checked).  Each
    file's sums read as it comes (all at once, several times the table in memory), and
    its damage told only if the file is still the one checked once it was read: a
    tenant who removed or replaced her file while it was read had scrub report it
    damaged (exit 1, the operator paged)."""
    inos = survey.sealed_inos(store)
    total = sum(survey.sizes_of(store, inos).values())
    throttle, bad, unchecked, checked = Throttle(rate), [], [], 0
    for ino in inos:
        f = sealed(store, ino, len(pool.members))
        if f is None:
            continue  # removed while we scrubbed
        problem = seal_problem(f)
        if problem is not None:
            unchecked.append(Unchecked(display_name(store, f.ino), problem))
            continue
        try:
            found = scrub_file(pool, f, throttle)
        except OSError as e:
            if not pool.far(f.layout.used_members()):
                raise  # (this node's own members: a real failure)
            unchecked.append(Unchecked(display_name(store, f.ino), e.strerror or str(e)))
            continue
        if found and sealed(store, ino, len(pool.members)) != f:
            continue  # (removed or sealed anew while it was read: nothing to tell)
        for begin, end, why in found:
            bad.append(Bad(display_name(store, f.ino), begin, end, f.layout.locate(begin)[0],
                           why))
        checked += 1
        progress(throttle.done, total)
    return checked, bad, unchecked

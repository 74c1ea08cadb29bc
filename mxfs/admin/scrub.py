"""`mxfs scrub`: read every sealed file and check each block against its xxh3.

Sealed files (checkpoints, models and KV chunks written by direct commits)
carry per-block checksums in the metadata store.  Scrub reads them from the
members' chunk files and names every file with a bad or missing block, and the
member that holds it: RAID0 keeps no second copy, so knowing exactly what is
damaged is the repair.  It runs while the pool is mounted (it opens the
metadata store read-only, beside the daemon), throttled to a byte rate.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mxfs.io import Layout
from mxfs.io.checksum import block_sums, unpack_sums
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
class Sealed:
    ino: int
    size: int
    layout: Layout
    sum_unit: int
    sums: tuple[int, ...]


def sealed_files(store: MetaStore, members: int) -> Iterator[Sealed]:
    for s in survey.sealed_files(store):
        f = s.file
        yield Sealed(f.ino, f.size, Layout(f.stripe_unit, f.stripe_width, f.first_member,
                                           members), s.sum_unit, unpack_sums(s.sums))


def scrub_file(pool: Pool, f: Sealed, throttle: Callable[[int], None]) -> list[tuple[int, int,
                                                                                      str]]:
    """(begin, end, why) of each bad block of one sealed file (none for one with stripes
    on other nodes' members: their owners hold those bytes)."""
    bad: list[tuple[int, int, str]] = []
    if pool.far(f.layout.used_members()):
        return bad
    fds: dict[int, int | None] = {}
    try:
        for k, want in enumerate(f.sums):
            begin = k * f.sum_unit
            n = min(f.sum_unit, f.size - begin)
            buf = bytearray(n)
            missing = False
            for piece in f.layout.plan(begin, n):
                if piece.member not in fds:
                    try:
                        fds[piece.member] = os.open(pool.chunk_path(piece.member, f.ino),
                                                    os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        fds[piece.member] = None
                fd = fds[piece.member]
                got = b"" if fd is None else os.pread(fd, piece.length, piece.chunk_offset)
                if len(got) < piece.length:
                    missing = True
                pos = 0
                for o, m in piece.spans:  # the member's bytes, back to their places
                    part = got[pos:pos + m]
                    buf[o:o + len(part)] = part
                    pos += m
            throttle(n)
            if missing:
                bad.append((begin, begin + n, "missing"))
            elif block_sums(memoryview(buf), f.sum_unit)[0] != want:
                bad.append((begin, begin + n, "checksum"))
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    return bad


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
          progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[int, list[Bad]]:
    """Check every sealed file: (files checked, damage found)."""
    files = list(sealed_files(store, len(pool.members)))
    total = sum(f.size for f in files)
    throttle, bad, checked = Throttle(rate), [], 0
    for f in files:
        if not store.inode_exists(f.ino):
            continue  # removed while we scrubbed
        for begin, end, why in scrub_file(pool, f, throttle):
            bad.append(Bad(display_name(store, f.ino), begin, end, f.layout.locate(begin)[0],
                           why))
        checked += 1
        progress(throttle.done, total)
    return checked, bad

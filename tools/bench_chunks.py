#!/usr/bin/env python3
"""Benchmark the chunk service (issue 27) against the reads a node makes of its own
members, side by side in one run.

One file of `--size` bytes in a scratch pool mounted with `-o chunk_port=0`, read from
the page cache (warm: the network path is what is measured) four ways:

  raw          the chunk files read straight, one thread per member (the ceiling)
  direct       mxfs's direct path (`DirectFile`), as `mxfs.load` reads
  chunks       every stripe through the chunk service over loopback TCP, one
               connection and thread per member (`ChunkClient.read_scatter`: each
               stripe unit received straight into its place): what a node reading
               another node's members gets, less the wire
  mount        the file read through the FUSE mount

Prints medians of `--repeat` rounds in GB/s and each as a ratio of raw.

    python tools/bench_chunks.py --size 1GiB --repeat 5 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mxfs.cli.demo import ScratchPool, bench_args, save_results, scratch_pool  # noqa: E402
from mxfs.cli.measure import write_file  # noqa: E402
from mxfs.client import ControlClient  # noqa: E402
from mxfs.client.direct import DirectFile  # noqa: E402
from mxfs.io import Layout  # noqa: E402
from mxfs.io.chunk_client import ChunkClient  # noqa: E402
from mxfs.pool import Pool  # noqa: E402
from mxfs.pool.key import load_key  # noqa: E402
from mxfs.units import format_size, parse_size  # noqa: E402

PIECE = 8 << 20  # bytes a chunk request asks for


def read_all(path: str, buf: bytearray) -> None:
    """Read a whole file into `buf`, 8 MiB at a time (no hashing: the bytes alone)."""
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(view):
            n = os.readv(fd, [view[got:got + PIECE]])
            if not n:
                break
            got += n
    finally:
        os.close(fd)


@dataclass
class ServedFile:
    """A file written through a scratch pool's mount (whole 64 MiB blocks of random
    bytes), what the daemon says of it, and its chunk files on the members."""

    size: int
    data: bytes
    stat: Any
    layout_reply: Any
    layout: Layout
    chunk_paths: list[str]


def served_file(pool: ScratchPool, path: str, size: int) -> ServedFile:
    block = os.urandom(64 << 20)
    size = max(1, size // len(block)) * len(block)
    write_file(path, size, memoryview(block))
    with ControlClient(pool.mnt) as c:
        st, lay = c.stat(), c.layout(path)
    layout = Layout.from_description(lay["layout"])
    members = Pool.open(pool.members[0])
    return ServedFile(size, block * (size // len(block)), st, lay, layout,
                      [members.chunk_path(m, lay["ino"]) for m in layout.used_members()])


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def through_chunks(addr: tuple[str, int], key: bytes, pool: str, ino: int, layout: Layout,
                   size: int, buf: bytearray) -> None:
    """Every member's chunk file through the service, a connection and thread each,
    into the right places of `buf` (the file's bytes)."""
    view = memoryview(buf)

    def member(m: int) -> None:
        with ChunkClient(*addr, key, pool) as c:
            total = layout.chunk_length(m, size)
            for off in range(0, total, PIECE):
                end = min(off + PIECE, total)
                views, c_off = [], off
                while c_off < end:  # each stripe unit straight to its place in the file
                    k = min(layout.unit - c_off % layout.unit, end - c_off)
                    f_off = layout.file_offset(m, c_off)
                    views.append(view[f_off:f_off + k])
                    c_off += k
                c.read_scatter(ino, m, off, views)

    with ThreadPoolExecutor(len(layout.used_members())) as ex:
        list(ex.map(member, layout.used_members()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_args(ap)
    ap.add_argument("--size", default="1GiB")
    args = ap.parse_args()
    size = parse_size(args.size)
    rounds: dict[str, list[float]] = {k: [] for k in ("raw", "direct", "chunks", "mount")}
    with scratch_pool("mxfs-bench-chunks-", args.dir, mkfs=("--stripe-unit", args.stripe_unit),
                      mount=("-o", "chunk_port=0")) as pool:
        path = os.path.join(pool.mnt, "big.bin")
        served = served_file(pool, path, size)
        size, data, st, lay, layout, chunk_paths = (
            served.size, served.data, served.stat, served.layout_reply, served.layout,
            served.chunk_paths)
        svc = st["chunk_service"]
        assert svc is not None
        addr, key = (svc["addr"], int(svc["port"])), load_key(pool.members[0])
        bufs = [bytearray(os.path.getsize(p)) for p in chunk_paths]
        buf = bytearray(size)
        for _ in range(args.repeat + 1):  # (the first round warms the page cache)
            with ThreadPoolExecutor(len(chunk_paths)) as ex:
                t_raw = timed(lambda: list(ex.map(read_all, chunk_paths, bufs)))
            f = DirectFile(path, ControlClient(pool.mnt))
            t_direct = timed(lambda f=f: f.read_into(0, memoryview(buf)))
            f.close()
            t_chunks = timed(lambda: through_chunks(addr, key, st["pool_uuid"], lay["ino"],
                                                    layout, size, buf))
            assert buf == data, "bytes through the chunk service differ"
            t_mount = timed(lambda: read_all(path, buf))
            for k, t in (("raw", t_raw), ("direct", t_direct), ("chunks", t_chunks),
                         ("mount", t_mount)):
                rounds[k].append(size / t / 1e9)
    medians = {k: statistics.median(v[1:]) for k, v in rounds.items()}
    print(f"{format_size(size)} from the page cache, median of {args.repeat}:")
    for k, gbps in medians.items():
        print(f"  {k:7s} {gbps:6.2f} GB/s  {gbps / medians['raw']:.2f} of raw")
    save_results(args, rounds=rounds, medians=medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark a pool whose members two nodes hold (issue 27): a model striped over every
member (`mxfs setstripe --across-nodes`) against the same bytes on the writer node's own
members, side by side in one run with the raw reads of the same chunk files.

The writer node a is this host and holds members 0 and 1; node b, a network namespace
joined to it by a veth pair (`tools/netns.py`), holds members 2 and 3 and serves them
through its chunk service; the metadata is on PostgreSQL (`--meta`: an empty database).
On `--rig members:4:MBPS` every member is an XFS loop device capped at MBPS (both
daemons run in the rig's cgroup), so the members' bandwidth, not this host's one disk,
bounds each arm.  Every round starts with the page cache dropped.  Arms, GB/s, medians
of `--repeat`:

  raw own     the own file's chunk files on members 0 and 1, read at once (O_DIRECT)
  raw all     the across file's chunk files on all four members, read at once
  own a       the own file read through a's mount (its members only)
  across a    the across file read through a's mount: members 0 and 1 here, 2 and 3
              through b's chunk service
  across b    the across file read through b's mount: 2 and 3 there, 0 and 1 through a's
  write own / write across   the files written through a's mount, fsynced
  write b     a file written through b's mount, fsynced: on b's own two members, its
              open judged and its size taken by the writer (against "write own": a's
              mount, a's two)
  write local the peer: the same bytes written to a plain file on the local drive
  local copy  the peer a user picks without mxfs: a copy of the file on the node's own
              local drive (the rig's plain folder: one more drive of the same kind),
              read buffered as any program reads it.  (An NFS export of one node's
              drives is the other peer; this machine has no NFS server to run.)

Needs root, iproute2 and nsenter (and xfsprogs for the members rig).

    python tools/bench_across.py --meta 'postgresql:///bench?host=/run/pg' --size 1GiB \\
        --rig members:4:200 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from netns import node_net, usable  # noqa: E402
from rig import BLOCK, make_rig  # noqa: E402

from mxfs.cli.demo import bench_args, run_mxfs, save_results  # noqa: E402
from mxfs.cli.measure import drop_caches  # noqa: E402
from mxfs.cli.scratch import scratch_dir  # noqa: E402
from mxfs.client.control import ControlClient  # noqa: E402
from mxfs.io import Layout  # noqa: E402
from mxfs.pool.key import key_path  # noqa: E402
from mxfs.proc import python_module  # noqa: E402
from mxfs.units import format_size, parse_size  # noqa: E402

ARMS = ("raw own", "raw all", "own a", "across a", "across b", "local copy", "write own",
        "write across", "write b", "write local")
PIECE = 16 << 20  # bytes a read or write asks for at once


def chunk_files(mnt: str, path: str, members: list[str]) -> list[str]:
    """The chunk files holding `path`'s bytes, on whichever member folder."""
    with ControlClient(mnt) as c:
        lay = c.layout(path)
    ino = lay["ino"]
    layout = Layout.from_description(lay["layout"])
    return [os.path.join(members[m], "chunks", f"{ino % 256:02x}", str(ino))
            for m in layout.used_members()]


def raw_read(paths: list[str]) -> float:
    """GB/s of O_DIRECT reads of every path at once, a thread each."""
    buf_size = BLOCK

    def one(path: str) -> int:
        import mmap

        buf = mmap.mmap(-1, buf_size)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = 0
            while n := os.preadv(fd, [buf], got):
                got += n
                if n < buf_size:
                    break
            return got
        finally:
            os.close(fd)
            buf.close()

    drop_caches()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as ex:
        moved = sum(ex.map(one, paths))
    return moved / (time.perf_counter() - start) / 1e9


def mount_read(path: str, size: int) -> float:
    """GB/s of reading `path` whole (through a mount, or a plain file), the page cache
    dropped first."""
    drop_caches()
    buf = bytearray(PIECE)
    view = memoryview(buf)
    start = time.perf_counter()
    got = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            got += n
    assert got == size, (path, got, size)
    return got / (time.perf_counter() - start) / 1e9


def mount_write(path: str, size: int) -> float:
    """GB/s of writing `size` bytes to `path` (through a mount, or a plain file),
    fsynced."""
    block = os.urandom(PIECE)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < size:
            done += f.write(block[:min(PIECE, size - done)])
        os.fsync(f.fileno())
    return size / (time.perf_counter() - start) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meta", required=True, help="an empty PostgreSQL database's URL")
    ap.add_argument("--size", default="1GiB")
    bench_args(ap)
    args = ap.parse_args()
    if not usable():
        print("bench_across: needs root, iproute2 and nsenter", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    rounds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with make_rig(args.rig, args.dir) as rig, \
            node_net(f"x{os.getpid() % 10000}", "10.238.0") as net:
        if len(rig.members) != 4:
            print("bench_across: the pool has four members (--rig members:4:MBPS)",
                  file=sys.stderr)
            return 2
        mine, theirs = rig.members[:2], rig.members[2:]
        for m in rig.members:
            os.makedirs(m, exist_ok=True)
        run_mxfs("mkfs", "--stripe-unit", args.stripe_unit, "--meta", args.meta,
                 *[a for m in [*mine, *(f"b:{p}" for p in theirs)] for a in ("--member", m)])
        base = scratch_dir("mxfs-bench-across-", args.dir)
        mnt_a, mnt_b = os.path.join(base, "a"), os.path.join(base, "b")
        os.makedirs(mnt_a)
        os.makedirs(mnt_b)
        run_mxfs("mount", "-o", f"allow_other,chunk_port=0,chunk_addr={net.host_ip},node=a",
                 mine[0], mnt_a)
        try:
            config = os.path.join(base, "node-b", "node.toml")
            run_mxfs("node", "add", "--meta", args.meta, "--key", key_path(mine[0]),
                     "--name", "b", "--config", config,
                     *[a for p in theirs for a in ("--member", p)])
            subprocess.run([*net.enter, *python_module(
                "mxfs", "mount", "-o", f"allow_other,chunk_port=0,chunk_addr={net.node_ip}",
                config, mnt_b)], check=True, capture_output=True)
            try:
                os.makedirs(os.path.join(mnt_a, "across"))
                run_mxfs("setstripe", "--across-nodes", os.path.join(mnt_a, "across"))
                own = os.path.join(mnt_a, "own.bin")
                across = os.path.join(mnt_a, "across", "m.bin")
                os.makedirs(rig.plain, exist_ok=True)
                copy = os.path.join(rig.plain, "m.bin")
                mount_write(copy, size)  # (not a mount: the same writes, to a plain file)
                for k in range(args.repeat):
                    rounds["write own"].append(mount_write(own, size))
                    rounds["write across"].append(mount_write(across, size))
                    rounds["write b"].append(mount_write(os.path.join(mnt_b, "b.bin"), size))
                    rounds["write local"].append(mount_write(copy, size))
                    rounds["raw own"].append(raw_read(chunk_files(mnt_a, own, rig.members)))
                    rounds["raw all"].append(raw_read(chunk_files(mnt_a, across,
                                                                  rig.members)))
                    rounds["own a"].append(mount_read(own, size))
                    rounds["across a"].append(mount_read(across, size))
                    time.sleep(0.5)  # (b's next open sees a's last close)
                    rounds["across b"].append(mount_read(
                        os.path.join(mnt_b, "across", "m.bin"), size))
                    rounds["local copy"].append(mount_read(copy, size))
                    print(f"round {k + 1}: " + ", ".join(
                        f"{arm} {rounds[arm][-1]:.2f}" for arm in ARMS), flush=True)
            finally:
                subprocess.run(python_module("mxfs", "umount", mnt_b), capture_output=True)
        finally:
            subprocess.run(python_module("mxfs", "umount", mnt_a), capture_output=True)
    med = {arm: statistics.median(v) for arm, v in rounds.items()}
    ratios: dict[str, Any] = {
        "across a / own a": med["across a"] / med["own a"],
        "across a / raw all": med["across a"] / med["raw all"],
        "own a / raw own": med["own a"] / med["raw own"],
        "across b / raw all": med["across b"] / med["raw all"],
        "across a / local copy": med["across a"] / med["local copy"],
        "across b / local copy": med["across b"] / med["local copy"],
        "write across / write own": med["write across"] / med["write own"],
        "write b / write own": med["write b"] / med["write own"],
        "write own / write local": med["write own"] / med["write local"],
    }
    print(f"\n{format_size(size)} a file, {rig.describe()}, medians of {args.repeat} (GB/s):")
    for arm in ARMS:
        print(f"  {arm:14} {med[arm]:6.2f}")
    for name, r in ratios.items():
        print(f"  {name:26} {r:5.2f}")
    save_results(args, medians=med, ratios=ratios, rounds=rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

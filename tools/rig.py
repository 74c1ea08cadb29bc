"""Bench rigs: where a benchmark's pool members and its peers' plain folder live.

  --rig plain            four folders on the one disk, the plain folder beside them (any
                         machine has this; striping cannot add bandwidth here)
  --rig members:N:MBPS   N loop devices formatted XFS for the pool, one more of the same
                         kind for the plain folder, each capped at MBPS MB/s by the
                         block-I/O cgroup: N drives of a real pool against the one drive a
                         user without mxfs reads from

With `--dir /dev/shm` the devices' images live in RAM: the cap alone sets each drive's
bandwidth, and the drift of the disk under /var/tmp (its all-members ceiling swung
1.05-2.0 GB/s between hours) drops out, at the cost of memory for every byte written
and of CPU for the loop driver's copies.

The benchmark process joins the rig's cgroup, so its reads, those of the daemon it
starts and the readahead done for them are all capped.  On cgroup v1 buffered
writeback is issued by kernel threads outside the cgroup and escapes the cap; reads
and O_DIRECT writes do not.  `ceiling` measures the rig itself: raw O_DIRECT reads of
each member alone and of all at once, the figures every result is set beside.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from mxfs.cli.measure import drop_caches
from mxfs.cli.scratch import scratch_dir
from mxfs.errors import MxfsError

BLOCK = 8 << 20  # O_DIRECT request size of the ceiling reads


@dataclass
class Rig:
    """Member folders for the pool, a plain folder for the peers, and what they are."""

    spec: str
    members: list[str]
    plain: str
    mbps: int | None = None
    devices: list[str] = field(default_factory=list)
    in_ram: bool = False  # the loop devices' images are in a tmpfs

    def describe(self) -> str:
        if self.mbps is None:
            return f"{len(self.members)} folder members on one disk"
        return (f"{len(self.members)} XFS loop members at {self.mbps} MB/s each "
                f"(peers on one more such device{'; images in RAM' if self.in_ram else ''})")


def in_tmpfs(path: str) -> bool:
    """Whether `path` lies on a tmpfs (the longest mount point above it)."""
    path, best, kind = os.path.realpath(path), "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and \
                    len(point) >= len(best):
                best, kind = point, fstype
    return kind == "tmpfs"


def parse_rig(spec: str) -> tuple[int, int] | None:
    """None for "plain", else (N, MBPS) of "members:N:MBPS"; a clear error otherwise."""
    if spec == "plain":
        return None
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == "members" and parts[1].isdigit() \
            and parts[2].isdigit() and int(parts[1]) >= 1 and int(parts[2]) >= 1:
        return int(parts[1]), int(parts[2])
    raise MxfsError(f"--rig {spec!r} is not a rig", "use plain or members:N:MBPS, "
                    "like members:4:200")


def _run(*cmd: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise MxfsError(f"{' '.join(cmd)} failed: {res.stderr.strip()}",
                        "the members rig needs root, losetup, mkfs.xfs (apt-get install "
                        "xfsprogs) and the blkio cgroup")
    return res.stdout.strip()


class _Cgroup:
    """A block-I/O cgroup (v1 blkio or v2 io) that caps each device's bandwidth."""

    def __init__(self, name: str) -> None:
        v1 = "/sys/fs/cgroup/blkio"
        if os.path.isdir(v1):
            self.path, self.v1 = os.path.join(v1, name), True
        elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.path, self.v1 = os.path.join("/sys/fs/cgroup", name), False
            with suppress(OSError), open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
                f.write("+io")
        else:
            raise MxfsError("no blkio or io cgroup controller on this machine",
                            "use --rig plain")
        os.makedirs(self.path, exist_ok=True)

    def cap(self, majmin: str, bytes_per_s: int) -> None:
        if self.v1:
            for kind in ("read", "write"):
                with open(os.path.join(self.path, f"blkio.throttle.{kind}_bps_device"),
                          "w") as f:
                    f.write(f"{majmin} {bytes_per_s}")
        else:
            with open(os.path.join(self.path, "io.max"), "w") as f:
                f.write(f"{majmin} rbps={bytes_per_s} wbps={bytes_per_s}")

    def join(self) -> str:
        """Move this process in; returns the cgroup it was in, to go back to."""
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        before = "/"
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if (self.v1 and "blkio" in controllers.split(",")) or \
                    (not self.v1 and controllers == ""):
                before = path
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return before

    def leave(self, before: str) -> None:
        root = os.path.dirname(self.path)
        with suppress(OSError), open(os.path.join(root + before.rstrip("/"),
                                                  "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        with suppress(OSError):
            os.rmdir(self.path)


@contextmanager
def make_rig(spec: str, where: str = "/var/tmp", gib_each: int = 16) -> Iterator[Rig]:
    """The rig `spec` names, set up under a scratch folder in `where` and removed after."""
    shape = parse_rig(spec)
    base = scratch_dir("mxfs-rig-", where)
    if shape is None:
        try:
            yield Rig(spec, [os.path.join(base, f"member{i}") for i in range(4)],
                      os.path.join(base, "plain"))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    n, mbps = shape
    if os.geteuid() != 0:
        raise MxfsError("--rig members needs root (loop devices, mounts, cgroups)",
                        "run as root or use --rig plain")
    cg = _Cgroup(f"mxfs-rig-{os.getpid()}")
    loops: list[str] = []
    mounts: list[str] = []
    before = None
    try:
        for i in range(n + 1):
            img, mnt = os.path.join(base, f"d{i}.img"), os.path.join(base, f"d{i}")
            with open(img, "wb") as f:
                f.truncate(gib_each << 30)  # sparse: only what is written takes disk
            loop = _run("losetup", "--direct-io=on", "-f", "--show", img)
            loops.append(loop)
            _run("mkfs.xfs", "-q", "-f", loop)
            os.makedirs(mnt)
            _run("mount", loop, mnt)
            mounts.append(mnt)
            cg.cap(_run("lsblk", "-dno", "MAJ:MIN", loop).replace(" ", ""),
                   mbps * 1000 * 1000)
        folders = [os.path.join(m, "member") for m in mounts[:n]]
        plain = os.path.join(mounts[n], "plain")
        before = cg.join()
        yield Rig(spec, folders, plain, mbps, loops, in_tmpfs(base))
    finally:
        if before is not None:
            cg.leave(before)
        for m in mounts:
            if subprocess.run(["umount", m], capture_output=True).returncode:
                subprocess.run(["umount", "-l", m], capture_output=True)
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        if before is None:
            cg.leave("/")
        shutil.rmtree(base, ignore_errors=True)


def write_ceiling(rig: Rig, nbytes: int, repeat: int = 3) -> dict[str, float]:
    """GB/s of raw writes of `nbytes` spread over the members, each file fsynced, the
    way the daemon writes its chunk files (buffered, then fsync): each member alone
    (the median member) and all at once; O_DIRECT writes of all at once beside them
    (on cgroup v1 only those are capped: buffered writeback escapes the cap)."""
    each = max(BLOCK, nbytes // len(rig.members) // BLOCK * BLOCK)
    paths = [f.rstrip("/") + ".wceiling" for f in rig.members]
    block = mmap.mmap(-1, BLOCK)  # page aligned, for O_DIRECT too
    block.write(os.urandom(BLOCK))

    def one(i: int, flags: int = 0) -> int:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        try:
            for k in range(each // BLOCK):
                os.pwritev(fd, [block], k * BLOCK)
            os.fsync(fd)
            return each
        finally:
            os.close(fd)

    def all_at_once(flags: int = 0) -> float:
        drop_caches()
        start = time.perf_counter()
        with ThreadPoolExecutor(len(paths)) as ex:
            moved = sum(ex.map(one, range(len(paths)), [flags] * len(paths)))
        return moved / (time.perf_counter() - start) / 1e9

    alone: list[float] = []
    together: list[float] = []
    direct: list[float] = []
    try:
        for _ in range(repeat):
            speeds = []
            for i in range(len(paths)):
                drop_caches()
                start = time.perf_counter()
                speeds.append(one(i) / (time.perf_counter() - start) / 1e9)
            alone.append(statistics.median(speeds))
            together.append(all_at_once())
            direct.append(all_at_once(os.O_DIRECT))
    finally:
        for p in paths:
            with suppress(OSError):
                os.unlink(p)
    return {"write_member_alone_GBps": statistics.median(alone),
            "write_all_members_GBps": statistics.median(together),
            "write_all_members_odirect_GBps": statistics.median(direct)}


def ceiling(rig: Rig, nbytes: int, repeat: int = 3) -> dict[str, float]:
    """GB/s of raw O_DIRECT reads of `nbytes` spread over the members: each member
    alone (the median member) and all of them at once; medians of `repeat`."""
    folders = [*rig.members, rig.plain]
    each = max(BLOCK, nbytes // len(rig.members) // BLOCK * BLOCK)
    paths = [f.rstrip("/") + ".ceiling" for f in folders]  # beside each, on its device
    block = os.urandom(BLOCK)
    for p in paths:
        with open(p, "wb") as f:
            for _ in range(each // BLOCK):
                f.write(block)
            os.fsync(f.fileno())
    bufs = [mmap.mmap(-1, BLOCK) for _ in paths]
    for b in bufs:
        b.write(bytes(BLOCK))

    def one(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            done = 0
            while n := os.preadv(fd, [bufs[i]], done):
                done += n
            return done
        finally:
            os.close(fd)

    alone: list[float] = []
    together: list[float] = []
    try:
        for _ in range(repeat):
            speeds = []
            for i in range(len(rig.members)):
                drop_caches()
                start = time.perf_counter()
                speeds.append(one(i) / (time.perf_counter() - start) / 1e9)
            alone.append(statistics.median(speeds))
            drop_caches()
            start = time.perf_counter()
            with ThreadPoolExecutor(len(rig.members)) as ex:
                moved = sum(ex.map(one, range(len(rig.members))))
            together.append(moved / (time.perf_counter() - start) / 1e9)
    finally:
        for p in paths:
            with suppress(OSError):
                os.unlink(p)
    return {"member_alone_GBps": statistics.median(alone),
            "all_members_GBps": statistics.median(together)}

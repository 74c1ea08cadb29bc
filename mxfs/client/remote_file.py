"""A file on another node's members, read beside the mount on a reading node.

The daemon there answers `open_read` with connections to the owner node's chunk
service, proved and scoped to this file (`fs/remote_reads.py`).  A `RemoteFile`
spreads the members over them (a connection a member, up to what it was given) and
receives each member's run of stripe units straight into its places in the caller's
buffer: one copy, by the kernel, where the mount costs six.

Ranges this node's page cache already holds through the mount are read from there
(a warm load reads memory, not the network).  A connection that fails or whose right
ended (the file was closed on the daemon's side, its time ran out, the owner
restarted) turns the rest of the reads over to the mount, which reads the same bytes
or fails as the mount does (EIO naming the node).
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from mxfs.client.control import ControlClient, ControlError
from mxfs.client.reader import HUGE_PAGE, SEGMENT, Reader, check_range, check_same
from mxfs.io import Layout, ReadOp, read_batch
from mxfs.io.batch import executor
from mxfs.io.chunk_client import ChunkClient
from mxfs.io.residency import Residency
from mxfs.proto.chunk_wire import WireError
from mxfs.proto.messages import CLOSE_READ

Run = tuple[int, int, int, list[memoryview]]  # inode, member, chunk offset, views it fills


class RemoteFile(Reader):
    def __init__(self, path: str, client: ControlClient, pool_path: str,
                 reply: Mapping[str, Any], fds: list[int]) -> None:
        """Wrap a reading node's `open_read` reply and the connections it sent."""
        self.path, self.client, self._pool_path = path, client, pool_path
        self.conns: list[ChunkClient] = []
        try:
            grant = reply["remote"]
            self.grant = int(grant["grant"])
            self.size = int(reply["size"])
            self.ino, self.generation = int(reply["ino"]), int(reply["generation"])
            self.layout = Layout.from_description(reply["layout"])
            while fds:
                self.conns.append(ChunkClient.adopt(fds.pop(0), str(grant["addr"]),
                                                    int(grant["epoch"])))
        except (KeyError, TypeError, ValueError):
            for fd in fds:
                os.close(fd)
            self._close_conns()
            raise
        self.mount_fd = _open_same(path, self.ino)
        self.broken: str | None = None  # why the connections are no longer used

    def read_many(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer from its file offset: what the mount holds cached from it,
        the rest from the owner, every member at once."""
        far: list[tuple[int, memoryview]] = []
        near: list[tuple[int, memoryview]] = []
        for offset, buf in ranges:
            check_range(self, offset, len(buf))
            (near if self._cached(offset, len(buf)) else far).append((offset, buf))
        if far and self.broken is None:
            try:
                self._fetch(far)
                far = []
            except (OSError, WireError) as e:
                self.broken = str(e)
                self._close_conns()
        fd = self.mount_fd
        if far and fd is None:
            raise OSError(errno.EIO, f"{self.path}: its owner node's connections failed "
                          f"({self.broken}) and the mount does not hold the file")
        ops = [ReadOp(fd, offset + o, [buf[o:o + SEGMENT]])
               for offset, buf in near + far for o in range(0, len(buf), SEGMENT)
               if fd is not None]
        if ops:
            read_batch(ops)

    def _cached(self, offset: int, n: int) -> bool:
        if self.mount_fd is None or not n:
            return False
        return Residency(self.mount_fd, offset, offset + n).cached_fraction(offset, n) >= 0.5

    def _fetch(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Every member's runs over the connections, all at once; the first failure
        raised once every receive has ended."""
        by_member: dict[int, list[tuple[int, list[memoryview]]]] = {}
        for offset, buf in ranges:
            for p in self.layout.plan(offset, len(buf)):
                by_member.setdefault(p.member, []).append(
                    (p.chunk_offset, [buf[o:o + n] for o, n in p.spans]))
        runs = [(self.ino, m, at, views) for m, member_runs in sorted(by_member.items())
                for at, views in _merged(member_runs)]
        failed = next((e for e in fetch(self.conns, runs) if e is not None), None)
        if failed is not None:
            raise failed

    def check_unchanged(self) -> None:
        check_same(self.client, self._pool_path, (self.ino, self.generation, self.size),
                   self.path)

    def map(self) -> mmap.mmap:
        """The file read into fresh private memory (there is no chunk file here to map)."""
        region = mmap.mmap(-1, -(-max(self.size, 1) // HUGE_PAGE) * HUGE_PAGE)
        with suppress(OSError, AttributeError):
            region.madvise(mmap.MADV_HUGEPAGE)
        if self.size:
            self.read_many([(0, memoryview(region)[:self.size])])
        return region

    def map_risk(self) -> str | None:
        return None  # (`map` reads it into private memory)

    def close(self) -> None:
        self._close_conns()
        if self.mount_fd is not None:
            os.close(self.mount_fd)
            self.mount_fd = None
        if self.grant:
            grant, self.grant = self.grant, 0
            with suppress(ControlError, OSError):  # (a daemon gone took its grants along)
                self.client.request(CLOSE_READ({"grant": grant}))

    def _close_conns(self) -> None:
        for c in self.conns:
            c.close()
        self.conns = []


def fetch(conns: list[ChunkClient], runs: list[Run]) -> list[Exception | None]:
    """Fill each run (inode, member, chunk offset, views) over `conns`, a member's runs
    on one connection (its requests sent ahead, `ChunkClient.fill_many`), the
    connections at once; returns once every receive has ended (none outlives the
    caller's buffers): each run's failure, or None.  A run the node refused fails
    alone; a connection that broke fails the runs left on it."""
    errors: list[Exception | None] = [None] * len(runs)
    if not conns:
        return [OSError(errno.EIO, "no connection to the owner node was handed over")
                for _ in runs]
    by_member: dict[int, list[int]] = {}
    for i, run in enumerate(runs):
        by_member.setdefault(run[1], []).append(i)
    members = sorted(by_member)

    def work(conn: ChunkClient, mine: list[int]) -> None:
        order = [i for m in mine for i in by_member[m]]
        for i, failed in zip(order, conn.fill_many([runs[i] for i in order]), strict=True):
            errors[i] = failed

    k = len(conns)
    futures = [executor().submit(work, conn, members[i::k])
               for i, conn in enumerate(conns) if members[i::k]]
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()  # (work raises nothing it does not record; a bug would show here)
    return errors


def _merged(runs: list[tuple[int, list[memoryview]]]) -> list[tuple[int, list[memoryview]]]:
    """A member's runs in chunk order, those that continue one another joined."""
    out: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, views in sorted(runs, key=lambda r: r[0]):
        if offset == end:
            out[-1][1].extend(views)
        else:
            out.append((offset, list(views)))
        end = offset + sum(len(v) for v in views)
    return out


def _open_same(path: str, ino: int) -> int | None:
    """The file opened through the mount, if the path still names inode `ino` there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_ino != ino:
        os.close(fd)
        return None
    return fd

"""What a file's chunk files hold on disk: the st_blocks `du` expects of a sparse file.

A file's size says nothing of its holes, so its blocks are the sum of its chunk files'
(one stat a member).  The stats are member calls (`fs/member_calls.py`): off the loop,
a hung member left out, and when they do not come back in time the answer is the
size's blocks.  A count is kept for the file as it was (size, mtime, ctime): KEEP_S while
the file is open here (writes land behind, a hole filled changes no size) or was
closed here in the last SETTLE_S (its descriptors closing: a member may flush, XFS
trims its preallocation), and until the file changes if it was settled so when
counted and still is.  Every
change to a closed file's bytes passes through this daemon and moves its mtime (a
write, a truncate; a writeback cache's mtime comes at the close, and direct writers
write only unpublished files, open here until published), so a closed file's count
stands: a lookup of it asks no member.  Counted at each lookup, the first access of
a small file cost a member call, a third of its time through the mount (a thread
hop, 0.37 ms of 1.4), and one user's stats of files on a member that stopped
answering waited for it.  A readdir's page is counted in one thread call.
"""

from __future__ import annotations

import functools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from mxfs.fs.member_calls import WAIT_S, MemberCalls
from mxfs.io.layout import Layout
from mxfs.meta import Inode
from mxfs.pool.pool import Pool

KEEP_S = 1.0  # a count of a file open here stands this long (writes land behind)
# ... and of a file closed here this lately: its descriptors may still be closing (a
# FUSE or NFS member flushes at the close, XFS trims its preallocation past the end)
SETTLE_S = 5.0
KEPT = 65_536  # counts kept at most (the oldest go first)

Shape = tuple[int, int, int]  # (size, mtime_ns, ctime_ns): the file a count is of
Kept = tuple[Shape, float, int, bool]  # (shape, until, blocks, counted while closed)
Chunks = list[tuple[int, str]]  # (member, chunk file path) of one file


def _shape(node: Inode) -> Shape:
    return node.size, node.mtime_ns, node.ctime_ns


class BlockCounts:
    def __init__(self, pool: Pool, layout: Callable[[Inode], Layout],
                 calls: MemberCalls, open_here: Callable[[int], bool]) -> None:
        self._pool = pool
        self._layout = layout
        self._calls = calls
        self._open_here = open_here  # (ino: whether a handle or a writer holds it here)
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._closed: OrderedDict[int, float] = OrderedDict()  # last closes, SETTLE_S

    def closed(self, ino: int) -> None:
        """The last handle of `ino` here was let go (its descriptors closing)."""
        now = time.monotonic()
        self._closed[ino] = now
        self._closed.move_to_end(ino)
        while self._closed:  # (oldest first: those past SETTLE_S go)
            first, at = next(iter(self._closed.items()))
            if now - at <= SETTLE_S and len(self._closed) <= KEPT:
                break
            del self._closed[first]

    def _settled(self, ino: int, now: float) -> bool:
        """Open nowhere here, and not closed here in the last SETTLE_S."""
        closed = self._closed.get(ino)
        return not self._open_here(ino) and (closed is None or now - closed > SETTLE_S)

    def _fresh(self, node: Inode, now: float) -> int | None:
        kept = self._kept.get(node.ino)
        if kept is None or kept[0] != _shape(node):
            return None
        if kept[1] > now or kept[3] and not self._open_here(node.ino):
            return kept[2]
        return None

    def blocks(self, node: Inode) -> int:
        """st_blocks of `node`: its chunk files' if counted lately, else its size's."""
        counted = self._fresh(node, time.monotonic())
        return counted if counted is not None else (node.size + 511) // 512

    def stands(self, node: Inode) -> bool:
        """Whether `blocks(node)` stands until the file changes (a count of it settled,
        or nothing to count); else the kernel must ask again within KEEP_S: kept the
        attributes' whole timeout (300 s), a count taken while writes still landed on a
        member was the kernel's answer long after they had (a member on a FUSE mount
        answered it to the pool above, which kept it as settled, short for good)."""
        if not node.is_reg or node.size == 0 or node.first_member is None or \
                self._pool.node:
            return True
        kept = self._kept.get(node.ino)
        return kept is not None and kept[0] == _shape(node) and kept[3] and \
            not self._open_here(node.ino)

    async def count(self, nodes: Iterable[Inode], uid: int) -> None:
        """Count, in `uid`'s turn, the chunk files of those of `nodes` not counted lately
        (a reading node's members are elsewhere; an empty file holds nothing)."""
        now = time.monotonic()
        wanted = [node for node in nodes
                  if node.is_reg and node.first_member is not None and node.size > 0
                  and not self._pool.node and self._fresh(node, now) is None]
        if not wanted:
            return
        # Each file as it was before the count: a write landing meanwhile changes the
        # row in place, and the count taken before it must not stand for the file after.
        shapes = [_shape(node) for node in wanted]
        closed = {node.ino for node in wanted if self._settled(node.ino, now)}
        counts = await self._calls.run(lambda: self._stat_all(wanted), uid)
        if counts is None:
            return
        until = time.monotonic() + KEEP_S
        for node, shape, blocks in zip(wanted, shapes, counts, strict=True):
            if blocks is not None:  # (closed all along: opened meanwhile, it may change)
                settled = node.ino in closed and self._settled(node.ino, time.monotonic())
                self._kept[node.ino] = (shape, until, blocks, settled)
                self._kept.move_to_end(node.ino)
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)

    def _stat_all(self, wanted: list[Inode]) -> list[int | None]:
        """(Worker thread.) `_stat` of each file, those past WAIT_S not counted: the
        request waits no longer, and the call holds its uid's thread till it ends.
        Their chunk paths are made here too (a readdir page of 512 files striped 16
        wide was 8,192 paths and 512 layouts made on the loop)."""
        until = time.monotonic() + WAIT_S
        return [self._stat(self._chunks(node)) if time.monotonic() < until else None
                for node in wanted]

    def _chunks(self, node: Inode) -> Chunks:
        """(Worker thread.) The chunk files of `node` on members that did not fail."""
        pool = self._pool
        return [(m, pool.chunk_path(m, node.ino))
                for m in self._layout(node).used_members() if not pool.members[m].failed]

    def _stat(self, chunks: Chunks) -> int | None:
        """(Worker thread.) The blocks of one file's chunk files (a hole, a chunk never
        written: none); None if a member did not answer (the count would be short)."""
        total = 0
        for m, path in chunks:
            blocks = self._calls.guarded(m, functools.partial(_blocks, path))
            if blocks is None:
                return None
            total += blocks
        return total


def _blocks(path: str) -> int:
    try:
        return os.stat(path).st_blocks
    except OSError:
        return 0

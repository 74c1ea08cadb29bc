"""What a file's chunk files hold on disk: the st_blocks `du` expects of a sparse file.

A file's size says nothing of its holes, so its blocks are the sum of its chunk files'
(one stat a member).  The stats are member calls (`fs/member_calls.py`): off the loop,
a hung member left out, and when they do not come back in time the answer is the
size's blocks.  A count is kept KEEP_S for the file as it was (size, mtime, ctime), so a
stat flood of unchanged files costs a lookup, and a readdir's page is counted in one
thread call.
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

KEEP_S = 1.0  # a count stands this long for the file as it was (writes land behind)
KEPT = 65_536  # counts kept at most (the oldest go first)

Shape = tuple[int, int, int]  # (size, mtime_ns, ctime_ns): the file a count is of
Chunks = list[tuple[int, str]]  # (member, chunk file path) of one file


def _shape(node: Inode) -> Shape:
    return node.size, node.mtime_ns, node.ctime_ns


class BlockCounts:
    def __init__(self, pool: Pool, layout: Callable[[Inode], Layout],
                 calls: MemberCalls) -> None:
        self._pool = pool
        self._layout = layout
        self._calls = calls
        self._kept: OrderedDict[int, tuple[Shape, float, int]] = OrderedDict()

    def _fresh(self, node: Inode, now: float) -> int | None:
        kept = self._kept.get(node.ino)
        if kept is not None and kept[0] == _shape(node) and kept[1] > now:
            return kept[2]
        return None

    def blocks(self, node: Inode) -> int:
        """st_blocks of `node`: its chunk files' if counted lately, else its size's."""
        counted = self._fresh(node, time.monotonic())
        return counted if counted is not None else (node.size + 511) // 512

    async def count(self, nodes: Iterable[Inode], uid: int) -> None:
        """Count, in `uid`'s turn, the chunk files of those of `nodes` not counted lately
        (a reading node's members are elsewhere; an empty file holds nothing)."""
        now = time.monotonic()
        wanted = [node for node in nodes
                  if node.is_reg and node.first_member is not None and node.size > 0
                  and not self._pool.node and self._fresh(node, now) is None]
        if not wanted:
            return
        counts = await self._calls.run(lambda: self._stat_all(wanted), uid)
        if counts is None:
            return
        until = time.monotonic() + KEEP_S
        for node, blocks in zip(wanted, counts, strict=True):
            if blocks is not None:
                self._kept[node.ino] = (_shape(node), until, blocks)
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

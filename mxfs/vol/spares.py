"""Hidden inodes made ahead for KV chunks, with their first chunk file made ahead too.

KV puts come by the thousand a second.  Each needs a hidden inode that is committed
before any chunk file of it exists, and then a chunk file: made one by one on the
daemon's thread, that is a commit and a file create per put (a create costs 0.1-1 ms
on a busy ext4, most of a small put).  So spares are made and committed BATCH at a
time, the next batch while LOW are left, and worker threads (MAKERS) create each one's
chunk file while puts go on: a put takes a spare whose file is ready, or creates it
itself (`ChunkFiles` serializes the two).  A spare lies on one member (the root's
stripe unit, width 1; members taken in turn by inode): a chunk of up to
`ONE_MEMBER_MAX` is one file, where striped it was one a member it touched, and a
batch of chunks still spreads over every member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mxfs.io import Layout
from mxfs.meta import ROOT_INO, Inode, MetaStore
from mxfs.meta.inode import LayoutPicker
from mxfs.pool import ChunkFiles, Pool

log = logging.getLogger("mxfs.fs")

BATCH = 64
ONE_MEMBER_MAX = 4 << 20  # KV chunks up to this size are spares, on one member each
LOW = BATCH // 2  # spares left when the next batch is made: its files are made meanwhile
# Threads making chunk files ahead: creates in the members' folders run in parallel.
MAKERS = 4


class Spares:
    def __init__(self, store: MetaStore, pool: Pool, pick: LayoutPicker,
                 layout: Callable[[Inode], Layout]) -> None:
        self.store, self.pool, self.pick, self.layout = store, pool, pick, layout
        self._ready: list[tuple[Inode, ChunkFiles]] = []
        self._worker: ThreadPoolExecutor | None = None

    def take(self, uid: int, gid: int) -> tuple[Inode, ChunkFiles]:
        """A committed hidden file (mode 0600) owned by `uid`:`gid`, and its chunk
        files (the caller holds them open: `Volume.acquire`)."""
        if len(self._ready) <= LOW:  # the next batch, while this one's files are made
            self._make()
        node, chunks = self._ready.pop()
        if (node.uid, node.gid) != (uid, gid):  # (a hidden inode: no xattrs, no names,
            #                                    no key yet: nothing else to move)
            self.store.set_attrs(node, uid=uid, gid=gid, owned=(0, 0))
        return node, chunks

    def _make(self) -> None:
        store = self.store
        def one_member(ino: int, unit: int | None, width: int | None
                       ) -> tuple[int, int, int]:
            return self.pick(ino, unit, 1)
        made = store.txn(lambda: [store.create_hidden(ROOT_INO, 0o600, 0, 0, one_member)
                                  for _ in range(BATCH)])
        store.commit()  # only once committed: no chunk file before its inode
        batch = [(n, ChunkFiles(self.pool, n.ino, self.layout(n))) for n in made]
        self._ready[:0] = batch  # taken from the end: after those made before
        if self._worker is None:
            self._worker = ThreadPoolExecutor(MAKERS, thread_name_prefix="mxfs-spares")
        ahead = [c for _, c in reversed(batch)]  # (the next one taken first)
        for k in range(MAKERS):
            self._worker.submit(_prepare, ahead[k::MAKERS])

    def close(self) -> list[int]:
        """Stop making files; the spares left (orphans, to reclaim)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        left, self._ready = self._ready, []
        for _, chunks in left:
            chunks.close()
        return [n.ino for n, _ in left]


def _prepare(files: list[ChunkFiles]) -> None:
    for chunks in files:
        try:
            chunks.prepare()
        except OSError as e:  # (the put that takes it creates the file, and hears this)
            log.debug("making a spare's chunk file ahead: %s", e)
            return

"""The store's syncs shared by every request that needs its changes durable
(mxfs/fs/meta_ops.SharedSync): on trio with a real SQLite store, its sync slowed."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from mxfs.fs.meta_ops import SharedSync
from mxfs.meta import MetaStore
from mxfs.meta.inode import ROOT_INO


def test_requests_that_ask_at_once_share_the_syncs_and_each_waits_for_one_begun_after(
        tmp_path: Path) -> None:
    """Twenty requests, each with a change of its own, ask for durability at once: the
    store syncs twice, not twenty times, and each returns only once a sync begun after
    it asked has ended (its change on stable storage).  A direct commit and a truncate
    each synced by themselves before: a user's commits in a loop put every other
    user's fsync behind all of hers."""
    store = MetaStore.format(str(tmp_path), "0" * 32, 65536)
    begun: list[int] = []  # (each sync, the number of changes committed when it began)
    ended = 0
    engine_sync = store.engine.sync

    def slow_sync() -> None:
        nonlocal ended
        begun.append(made)
        time.sleep(0.2)  # (a drive's flush: the others ask meanwhile)
        engine_sync()
        ended += 1

    store.engine.sync = slow_sync  # type: ignore[method-assign]
    syncs, made = SharedSync(store), 0

    async def change_then_durable(i: int) -> None:
        nonlocal made
        store.create(ROOT_INO, f"d{i}".encode(), 0o040755, 0, 0)
        made += 1
        mine = made
        await syncs.durable()
        # (syncs run one at a time: the first `ended` have ended)
        assert any(seen >= mine for seen in begun[:ended]), (mine, begun, ended)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(change_then_durable, i)

    try:
        trio.run(main)
        assert len(begun) == 2, begun
    finally:
        store.close()

"""The change feed: what each committed group of changes touched, for the pool's other
nodes to drop from their caches.

A node that changes the rows (the writer) notes, in each group, the inodes whose rows
it wrote (apart: those whose data changed, size or mtime) and the names it added,
removed or moved (`Noted`, in `meta/feed_notes.py`).  As the group commits, one row of
`changes` holds them, numbered in commit order (publishers take a lock, so a
number is drawn only after every smaller one committed), and the server notifies each
listener (PostgreSQL NOTIFY, delivered at commit).  A node that follows the feed
(`FeedReader`, driven by `fs/feed_follower.py`) reads the rows past the last it saw and
drops what the kernel holds of them, so the kernel may keep names and attributes long.

A writer starting a session publishes "everything" first: whatever happened while no
writer ran (an offline tool, a restore) is unknown.  Rows older than RETAIN_S are
pruned (`prune`, the writer); a follower that fell further behind is told
"everything" too.  A group that touched more than `feed_notes.MAX_NOTED` things is
published as "everything" as well: a bound on the row, and on the followers' work.
"""

from __future__ import annotations

import time

from mxfs.meta.feed_notes import Change
from mxfs.meta.store import MetaStore

RETAIN_S = 600
PRUNED_KEY = "changes_pruned"  # setting: every row numbered up to it was pruned
READ_BATCH = 256  # rows a follower reads at once
PRUNE_BATCH = 10_000  # rows pruned in one change
COLUMNS = ("seq", "node", "epoch", "body")


def prune(store: MetaStore, retain_s: float = RETAIN_S) -> int:
    """Drop feed rows older than `retain_s` (by this node's clock, which wrote them),
    PRUNE_BATCH at a time, each batch raising the pruned mark as it goes; rows dropped.
    A writer calls it now and then, on a connection of its own (`fs/daemon.py`): a
    tenant that commits in a loop (fsync after fsync) adds a row each time."""
    cutoff = time.time_ns() - int(retain_s * 1e9)
    dropped = 0
    while True:
        rows = list(store.engine.scan("changes", ("seq", "at"), order="seq",
                                      limit=PRUNE_BATCH))
        old = [seq for seq, at in rows if at < cutoff]
        if not old:
            return dropped

        def change(old: list[int] = old) -> None:
            mark = int(store.setting(PRUNED_KEY) or 0)
            store.engine.upsert("settings", {"key": PRUNED_KEY,
                                             "value": str(max(mark, old[-1]))})
            store.engine.remove_many("changes", "seq", old)
        store.txn(change)
        dropped += len(old)
        if len(old) < len(rows) or len(rows) < PRUNE_BATCH:
            return dropped


class FeedReader:
    """Reads the feed past the last row seen, through a store of its own (one thread's).
    Starts at the present: a follower starts with nothing cached."""

    def __init__(self, store: MetaStore, own_node: str = "") -> None:
        self.store = store
        self.own_node = own_node  # its own changes are not news to a node
        self.last = store.engine.sequences()["change"]

    def read(self) -> tuple[Change, int]:
        """(everything published since the last read, merged; the last number read).
        "Everything" when rows were pruned before this reader saw them (the mark read
        after the rows: a prune between would otherwise hide its gap)."""
        out, before = Change(), self.last
        while True:
            rows = list(self.store.engine.scan("changes", COLUMNS, order="seq",
                                               after=self.last, limit=READ_BATCH))
            for seq, node, _epoch, body in rows:
                self.last = seq
                if node != self.own_node:
                    out.merge(Change.decode(body))
            if len(rows) < READ_BATCH:
                break
        pruned = int(self.store.setting(PRUNED_KEY) or 0)
        if pruned > before:
            out.merge(Change(everything=True))
            self.last = max(self.last, pruned)
        return out, self.last

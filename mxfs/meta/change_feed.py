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
writer ran (an offline tool, a restore) is unknown.  A group that touched more than
`feed_notes.MAX_NOTED` things (or MAX_NAME_BYTES of names) is published as
"everything" as well: a bound on the row, and on the followers' work.

Bounds, as a tenant who commits in a loop (fsync after fsync, renames of long names)
adds a row each time, up to MAX_NOTED things each.  Rows are pruned (`prune`, the
writer) past RETAIN_S, and past KEEP_ROWS rows or KEEP_BYTES bytes (bodies, and
ROW_BYTES a row) the oldest go too, as soon as the writer has published an eighth of
either since its last prune (`PruneDue`): a flood shortens the feed's memory, it does
not fill the metadata server's disk, which every tenant shares.  A follower that fell
behind a pruned row is told "everything".  A follower that reads a backlog holds
MAX_HELD things merged at most: past them it is told "everything" and skips to the
newest row (`FeedReader.read`).  "Everything" is always a correct answer, only a
costlier one: the reading node invalidates all its kernel holds, so a flood costs
every tenant on the reading nodes their cached entries and pages, once per read,
where before it cost the store's disk and the followers' memory.  The bound is
global, not a tenant's: a row is a group, which holds every tenant's changes of those
50 ms, and its notes (`Noted`) know inodes and names, not whose they are.
"""

from __future__ import annotations

import time

from mxfs.meta.feed_notes import MAX_NOTED, Change, Noted
from mxfs.meta.store import MetaStore

RETAIN_S = 600
KEEP_ROWS = 100_000  # rows kept at most (the newest)
KEEP_BYTES = 64 << 20  # bytes of rows kept at most: bodies, and ROW_BYTES a row
ROW_BYTES = 100  # a row's own cost on the server: its tuple and index entry
PRUNE_EVERY_S = 60.0  # a writer prunes this often, sooner after a flood (`PruneDue`)
PRUNED_KEY = "changes_pruned"  # setting: every row numbered up to it was pruned
# Rows a follower reads at once: a body is ~2.5 MB at most (MAX_NOTED things, with
# MAX_NAME_BYTES of names, and MAX_KV_BYTES of keys), so a batch ~80 MB at most.
READ_BATCH = 32
SKIP_BATCH = 10_000  # rows' numbers read at once by a follower skipping to the newest
MAX_HELD = MAX_NOTED  # things a follower merges at most before it says "everything"
PRUNE_BATCH = 10_000  # rows pruned in one change
COLUMNS = ("seq", "node", "epoch", "body")


def prune(store: MetaStore, retain_s: float = RETAIN_S, keep_rows: int = KEEP_ROWS,
          keep_bytes: int = KEEP_BYTES) -> int:
    """Drop feed rows older than `retain_s` (by this node's clock, which wrote them),
    then the oldest until `keep_rows` rows and `keep_bytes` bytes are left, PRUNE_BATCH
    at a time, each batch raising the pruned mark as it goes; rows dropped.  A writer
    calls it now and then, on a connection of its own (`fs/daemon.py`, `PruneDue`)."""
    cutoff = time.time_ns() - int(retain_s * 1e9)
    dropped = 0
    while True:
        rows = list(store.engine.scan("changes", ("seq", "at"), order="seq",
                                      limit=PRUNE_BATCH))
        old = [seq for seq, at in rows if at < cutoff]
        if old:
            _drop(store, old)
            dropped += len(old)
        if len(old) < len(rows) or len(rows) < PRUNE_BATCH:
            break
    return dropped + _prune_over(store, keep_rows, keep_bytes)


def _prune_over(store: MetaStore, keep_rows: int, keep_bytes: int) -> int:
    """Drop the oldest rows past `keep_rows` rows or `keep_bytes` bytes (the server
    sums the bodies' lengths: none is fetched); rows dropped.  Rows published meanwhile
    are counted at the next prune."""
    e = store.engine
    count = e.count("changes")
    size = sum(e.lengths("changes", "node", ("body",), per_row=ROW_BYTES).values())
    dropped = 0
    while count > keep_rows or size > keep_bytes:
        seqs = [seq for seq, in e.scan("changes", ("seq",), order="seq", limit=PRUNE_BATCH)]
        if not seqs:
            break
        sizes = e.lengths("changes", "seq", ("body",), seqs, per_row=ROW_BYTES)
        over = []
        for seq in seqs:
            if count <= keep_rows and size <= keep_bytes:
                break
            over.append(seq)
            count -= 1
            size -= sizes.get(seq, 0)
        _drop(store, over)
        dropped += len(over)
    return dropped


def _drop(store: MetaStore, seqs: list[int]) -> None:
    """Remove the rows `seqs` (the oldest, in order) and raise the pruned mark to the
    last, in one change: a follower that had not read them is told "everything"."""
    def change() -> None:
        mark = int(store.setting(PRUNED_KEY) or 0)
        store.engine.upsert("settings", {"key": PRUNED_KEY,
                                         "value": str(max(mark, seqs[-1]))})
        store.engine.remove_many("changes", "seq", seqs)
    store.txn(change)


class PruneDue:
    """When a writer prunes next: PRUNE_EVERY_S after its last prune, or as soon as it
    published an eighth of KEEP_ROWS or KEEP_BYTES since (asked each second), so a flood
    between two prunes is bounded by what the writer publishes in a second."""

    def __init__(self, feed: Noted, now: float) -> None:
        self.feed = feed
        self._last = (now, feed.published, self._bytes())

    def _bytes(self) -> int:
        return self.feed.published_bytes + self.feed.published * ROW_BYTES

    def __call__(self, now: float) -> bool:
        """Whether to prune now; if so, counted as done from now."""
        at, rows, size = self._last
        if now - at < PRUNE_EVERY_S and self.feed.published - rows < KEEP_ROWS // 8 \
                and self._bytes() - size < KEEP_BYTES // 8:
            return False
        self._last = (now, self.feed.published, self._bytes())
        return True


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
        after the rows: a prune between would otherwise hide its gap), and when what it
        merged passed MAX_HELD things or a row said "everything": it then skips to the
        newest row, so it holds a batch of rows and MAX_HELD things at most, whatever
        the backlog.  KV notes past MAX_HELD become "every KV key" alone (the reading
        node's presence tables are refilled; its kernel keeps what it holds)."""
        out, before = Change(), self.last
        while True:
            rows = list(self.store.engine.scan("changes", COLUMNS, order="seq",
                                               after=self.last, limit=READ_BATCH))
            for seq, node, _epoch, body in rows:
                self.last = seq
                if node != self.own_node:
                    out.merge(Change.decode(body))
                if len(out.kv) > MAX_HELD:
                    out.merge(Change(kv_everything=True))
                if len(out.inos) + len(out.data) + len(out.names) > MAX_HELD:
                    out.merge(Change(everything=True))
                if out.everything:  # (the rows past it can tell no more)
                    self.last = rows[-1][0]
                    self._skip()
                    break
            if len(rows) < READ_BATCH or out.everything:
                break
        pruned = int(self.store.setting(PRUNED_KEY) or 0)
        if pruned > before:
            out.merge(Change(everything=True))
            self.last = max(self.last, pruned)
        return out, self.last

    def _skip(self) -> None:
        """Past every row committed now (their numbers alone): "everything" covers them.
        (Not the sequence's mark: a row numbered but not yet committed would be missed.)"""
        while True:
            seqs = list(self.store.engine.scan("changes", ("seq",), order="seq",
                                               after=self.last, limit=SKIP_BATCH))
            if seqs:
                self.last = seqs[-1][0]
            if len(seqs) < SKIP_BATCH:
                return

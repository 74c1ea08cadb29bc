"""The change feed, driven through `MetaStore` on every engine (no FUSE): what a group
of changes touched is published as it commits, read back by a follower in order, and
nothing of a change that failed or a group that was lost is ever published."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from test_presence import Reader

from mxfs.meta import ROOT_INO, MetaStore, change_feed, feed_notes
from mxfs.meta.change_feed import PRUNED_KEY, FeedReader, prune
from mxfs.meta.feed_notes import (
    KV_GONE,
    KV_REMOVED,
    KV_RESET,
    KV_STORED,
    MAX_NOTED,
    Change,
    Noted,
    channel,
)

UNIT = 1 << 20
UUID = "00000000-0000-4000-8000-000000000027"
REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755

pytestmark = pytest.mark.unit


def pick(ino: int, unit: int | None, width: int | None) -> tuple[int, int, int]:
    return unit or UNIT, width or 4, ino % 4


@pytest.fixture
def where(store_where: str) -> str:
    return store_where


@pytest.fixture
def writer(where: str) -> Iterator[MetaStore]:
    """A store publishing its changes, as a writer daemon's (grouped, sole writer)."""
    s = MetaStore.format(where, UUID, UNIT)
    s.sole_writer(True)
    s.feed = Noted("a", 7, channel(UUID))
    s.group_changes(60.0)
    yield s
    s.close()


def test_bodies_round_trip_and_damage_reads_as_everything() -> None:
    c = Change({5, 1 << 40}, {(1, b"x"), (9, b"\xff" * 255)}, data={5, 6})
    assert Change.decode(c.encode()) == c
    assert Change.decode(Change(everything=True).encode()).everything
    big = Change(set(range(MAX_NOTED + 1)))
    assert Change.decode(big.encode()) == Change(everything=True)
    body = c.encode()
    for bad in (b"", body[:-3], b"\x00" * 3):
        assert Change.decode(bad).everything, bad
    # KV notes ride in order after the names; too many bytes of keys: "every KV key"
    kv = Change({5}, kv=[(KV_STORED, "t", b"k1"), (KV_REMOVED, "t", b"k1"),
                         (KV_GONE, "\u00e9t\u00e9", b"")])
    assert Change.decode(kv.encode()) == kv
    assert Change.decode(kv.encode()[:-1]).everything
    assert not Change(kv=kv.kv).kv_unknown
    # ... as many as fit: past MAX_KV_BYTES or MAX_NOTED the namespaces with the most
    # are each one "every key of it" note; the others' notes keep their order
    many = Change(kv=[(KV_STORED, "t", os.urandom(4096)) for _ in range(300)] +
                  [(KV_REMOVED, "s", b"k1"), (KV_STORED, "s", b"k2")] +
                  [(KV_REMOVED, "u", b"%06d" % i) for i in range(MAX_NOTED)])
    assert Change.decode(many.encode()) == Change(kv=[
        (KV_REMOVED, "s", b"k1"), (KV_STORED, "s", b"k2"), (KV_RESET, "t", b""),
        (KV_RESET, "u", b"")])
    # ... and past that (more namespaces than a row lists): "every KV key"
    spread = Change(kv=[(KV_STORED, f"n{i}", b"k") for i in range(MAX_NOTED + 1)])
    assert Change.decode(spread.encode()) == Change(kv_everything=True)
    assert Change.decode(spread.encode()).kv_unknown
    unknown = Change(kv=[(KV_RESET + 1, "t", b"k")]).encode()
    assert Change.decode(unknown).everything  # (a note this version cannot read)


def test_a_reading_node_refills_only_the_namespaces_a_row_could_not_list(
        tmp_path: Path) -> None:
    """A reading node's presence tables follow each row's KV notes; a namespace told
    as "every key of it" is retired (its readers ask for a new table), the others
    keep what they hold and move by their notes."""
    from mxfs.fs.kv_views import FollowerViews
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.proto.presence import LIVE, MOVED, state_of
    from mxfs.vol.kv_presence import PresenceTable

    views = FollowerViews(StoreWorker(str(tmp_path)))  # (never opened: no fill here)
    big, small = PresenceTable(room=64), PresenceTable(room=64)
    views._hold("big", big, 1000)
    views._hold("small", small, 1000)
    for key in (b"a" * 32, b"b" * 32):
        small.add(key)
        big.add(key)
    seen = {name: os.fdopen(t.reader_fd(), "rb")  # (what a client reads)
            for name, t in (("big", big), ("small", small))}

    def state(name: str) -> int:
        return state_of(os.pread(seen[name].fileno(), 64, 0))
    flood = Change(kv=[(KV_REMOVED, "big", b"%031d" % i) for i in range(MAX_NOTED)] +
                   [(KV_STORED, "small", b"c" * 32), (KV_REMOVED, "small", b"a" * 32)])
    views.apply(Change.decode(flood.encode()))
    assert list(views.tables) == ["small"] and views.tables["small"] is small
    assert small.count == 2 and state("small") == LIVE and state("big") == MOVED
    views.apply(Change.decode(Change(kv=[(KV_STORED, f"n{i}", b"k")
                                          for i in range(MAX_NOTED + 1)]).encode()))
    assert views.tables == {} and state("small") == MOVED
    for f in seen.values():
        f.close()


def test_a_reading_nodes_table_a_chain_of_keys_overflowed_is_made_anew(
        tmp_path: Path) -> None:
    """A reading node's table follows the writer's puts, a writer's computed from the
    seed among them: keys with no room within MAX_PROBE of their home are left out
    (its readers ask the store of their chain), and once `due` the table is retired
    MOVED, the next `kv_view` making one under a fresh seed."""
    from test_presence import Reader, chain_keys

    from mxfs.fs.kv_views import FollowerViews
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.proto.presence import LIVE, MAX_PROBE, MOVED
    from mxfs.vol.kv_presence import PresenceTable

    views = FollowerViews(StoreWorker(str(tmp_path)))  # (never opened: no fill here)
    table = views._hold("t", PresenceTable(room=1000), 1000)  # (made with 1,000 keys)
    r = Reader(table)
    views.apply(Change(kv=[(KV_STORED, "t", b"v%d" % i) for i in range(1000)]))
    evil = chain_keys(table.seed, table.slots, 7, MAX_PROBE + 16)
    views.apply(Change(kv=[(KV_STORED, "t", k) for k in evil]))
    assert views.tables["t"] is table and r.state()[0] == LIVE  # (not due yet) ...
    assert r.has(evil[-1]) is None and max(r.reach(k) for k in evil) < MAX_PROBE
    views.apply(Change(kv=[(KV_STORED, "t", b"w%d" % i) for i in range(250)]))
    assert "t" not in views.tables and r.state()[0] == MOVED  # ... a quarter more: it is


def test_a_reading_nodes_tables_are_bounded_by_user_and_in_all(tmp_path: Path) -> None:
    """A reading node keeps a table for each namespace its users view: a user who
    viewed thousands held two descriptors each, for good.  Past a user's share, or the
    node's, the least recently asked goes (MOVED: its readers ask again)."""
    from mxfs.fs.kv_views import FollowerViews
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.proto.presence import LIVE, MOVED, state_of
    from mxfs.vol.kv_presence import PresenceTable

    views = FollowerViews(StoreWorker(str(tmp_path)), most=(3, 2))
    made = {f"a{i}": PresenceTable(room=8) for i in range(3)}
    seen = os.fdopen(made["a0"].reader_fd(), "rb")  # (what a client of a0 reads)
    for name, table in made.items():
        views._hold(name, table, 1000)
    assert list(views.tables) == ["a1", "a2"] and views.by_tenant[1000] == 2
    assert state_of(os.pread(seen.fileno(), 64, 0)) == MOVED
    seen.close()
    views._hold("b0", PresenceTable(room=8), 1001)
    views._hold("b1", PresenceTable(room=8), 1001)  # (3 in all: the oldest goes)
    assert list(views.tables) == ["a2", "b0", "b1"]
    assert dict(views.by_tenant) == {1000: 1, 1001: 2}
    fd = views.tables["a2"].reader_fd()
    assert state_of(os.pread(fd, 64, 0)) == LIVE
    os.close(fd)
    views.retire_all()
    assert views.tables == {} and not views.by_tenant


def test_a_key_the_feed_removes_while_a_table_fills_is_not_added_after(
        writer: MetaStore, where: str) -> None:
    """A reading node's table fills from the store a bite at a time; a key removed
    (its feed row applied) after the bite holding it was read, and before that bite
    was added, showed present for good.  The fill leaves out what the feed removed
    meanwhile, unless stored again."""
    from mxfs.fs.kv_views import FollowerViews
    from mxfs.fs.store_worker import StoreWorker
    from mxfs.proto.presence import LIVE

    writer.kv.set_namespace("ns", 0, 0, 0o777, 1 << 30)
    keys = [b"k%02d" % i for i in range(3)]
    for key in keys:
        writer.kv.publish(writer.create_hidden(ROOT_INO, 0o600, 0, 0, pick).ino, "ns",
                          key, 10, 1, UNIT, b"")
    writer.commit()
    worker = StoreWorker(where)
    views = FollowerViews(worker)
    read = worker.run

    async def run_then_feed(fn: Any, uid: int = 0) -> Any:
        out = await read(fn, uid)
        if isinstance(out, list):  # (a bite read: the feed's rows come in meanwhile)
            views.apply(Change(kv=[(KV_REMOVED, "ns", keys[0]), (KV_REMOVED, "ns", keys[1]),
                                   (KV_STORED, "ns", keys[1])]))
        return out
    worker.run = run_then_feed  # type: ignore[method-assign]
    views.live = lambda: True
    try:
        table = trio.run(views.table, "ns", 0, 0)
        reader = Reader(table)
        assert reader.state()[0] == LIVE
        assert [reader.has(k) for k in keys] == [False, True, True]
    finally:
        worker.close()


def test_kv_keys_are_listed_only_while_reading_nodes_keep_tables() -> None:
    """A writer with no reading node alive lists no KV key in the feed: a group that
    changed any says "every KV key" (a few bytes), which a node that kept tables
    anyway (its lease lapsed meanwhile) answers by dropping them."""
    noted = Noted("a", 7, channel(UUID))
    assert noted.take() is not None  # (a session's first group: everything)
    noted.settled()
    noted.kv(KV_STORED, "t", b"k1")
    listed = noted.take()
    assert listed is not None and listed.kv == [(KV_STORED, "t", b"k1")]
    assert not listed.kv_unknown
    noted.settled()
    noted.list_kv = False
    noted.kv(KV_STORED, "t", b"k2")
    noted.kv(KV_REMOVED, "t", b"k1")
    unlisted = noted.take()
    assert unlisted is not None and unlisted.kv == [] and unlisted.kv_unknown
    assert Change.decode(unlisted.encode()) == Change(kv_everything=True)
    noted.settled()
    assert noted.take() is None  # (nothing since)


def test_groups_are_published_as_they_commit(writer: MetaStore, where: str) -> None:
    follower = MetaStore.open(where, readonly=True)
    try:
        feed = FeedReader(follower, own_node="b")
        got, _ = feed.read()
        assert not got  # it starts at the present
        d = writer.create(ROOT_INO, b"d", DIR, 0, 0, layout_for=pick)
        f = writer.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
        got, _ = feed.read()
        assert not got  # the group is open: nothing committed, nothing published
        writer.commit()
        got, first = feed.read()
        assert got.everything  # a writer's first group: its session starts
        # A failed change notes nothing; the next group names what it touched.
        with pytest.raises(OSError) as e:
            writer.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
        assert e.value.errno == errno.EEXIST
        writer.rename(d.ino, b"f", ROOT_INO, b"g")
        writer.set_attrs(writer.get(d.ino), mode=DIR | 0o700)
        writer.commit()
        got, second = feed.read()
        assert second > first and not got.everything
        assert got.names == {(d.ino, b"f"), (ROOT_INO, b"g")}
        assert {ROOT_INO, d.ino} <= got.data  # (directories' times: their listings)
        assert f.ino in got.inos | got.data
        assert writer.feed is not None and writer.feed.published == 2
        # Nothing changed, nothing published.
        writer.commit()
        assert not feed.read()[0]
        # A follower's own node's changes are not news to it.
        assert not FeedReader(follower, own_node="a").read()[0]
    finally:
        follower.close()


@pytest.mark.pg
def test_a_lost_group_publishes_nothing(pg_cluster: object) -> None:
    """The server drops the writer's connection mid-group: that group's changes are
    not published, the next group's are."""
    url = pg_cluster.database()  # type: ignore[attr-defined]
    writer = MetaStore.format(url, UUID, UNIT)
    writer.feed = Noted("a", 7, channel(UUID))
    writer.group_changes(60.0)
    follower = MetaStore.open(url)
    try:
        writer.create(ROOT_INO, b"first", REG, 0, 0, layout_for=pick)
        writer.commit()
        feed = FeedReader(follower)
        writer.create(ROOT_INO, b"lost", REG, 0, 0, layout_for=pick)
        pid = writer.engine.conn.info.backend_pid  # type: ignore[attr-defined]
        follower.engine._exec("SELECT pg_terminate_backend(%s)", (pid,))  # type: ignore[attr-defined]
        with pytest.raises(OSError):
            writer.commit()
        deadline = time.monotonic() + 30
        while True:  # (refused until the engine has dialled again)
            try:
                writer.create(ROOT_INO, b"kept", REG, 0, 0, layout_for=pick)
                break
            except OSError as e:
                assert e.errno == errno.EIO and time.monotonic() < deadline
                time.sleep(0.2)
        writer.commit()
        got, _ = feed.read()
        assert got.names == {(ROOT_INO, b"kept")}
    finally:
        follower.close()
        writer.close()


def test_pruned_rows_tell_a_late_follower_everything(writer: MetaStore, where: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    follower = MetaStore.open(where, readonly=True)
    try:
        late = FeedReader(follower)
        writer.create(ROOT_INO, b"w", REG, 0, 0, layout_for=pick)
        writer.commit()
        writer.create(ROOT_INO, b"x", REG, 0, 0, layout_for=pick)
        writer.commit()
        current = FeedReader(follower)
        assert prune(writer, retain_s=3600) == 0  # nothing old enough
        monkeypatch.setattr(change_feed, "PRUNE_BATCH", 1)  # (batch after batch)
        assert prune(writer, retain_s=0) == 2
        assert int(writer.setting(PRUNED_KEY) or 0) > late.last
        assert late.read()[0].everything
        assert not current.read()[0]  # it had seen all that was pruned
        writer.create(ROOT_INO, b"y", REG, 0, 0, layout_for=pick)
        writer.commit()
        assert current.read()[0].names == {(ROOT_INO, b"y")}
    finally:
        follower.close()


@pytest.mark.pg
def test_rows_are_read_in_commit_order_by_a_follower_racing_two_writers(
        pg_cluster: object) -> None:
    """Two writers publish at once: a follower reading all the while never skips a
    row (a number drawn before another commits is never seen after it)."""
    url = pg_cluster.database()  # type: ignore[attr-defined]
    MetaStore.format(url, UUID, UNIT).close()
    names: set[tuple[int, bytes]] = set()
    stop = threading.Event()
    follower = MetaStore.open(url, readonly=True)
    feed = FeedReader(follower)

    def follow() -> None:
        while not stop.is_set():
            names.update(feed.read()[0].names)

    def write(tag: str) -> None:
        s = MetaStore.open(url)
        s.feed = Noted(tag, 1, channel(UUID))
        s.feed.everything = False
        try:
            for i in range(60):
                s.txn(lambda i=i: s.create(ROOT_INO, f"{tag}{i}".encode(), REG, 0, 0,
                                           layout_for=pick))
        finally:
            s.close()

    reader = threading.Thread(target=follow)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in "pq"]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    names.update(feed.read()[0].names)
    follower.close()
    assert names == {(ROOT_INO, f"{t}{i}".encode()) for t in "pq" for i in range(60)}


def test_a_follower_far_behind_holds_a_bounded_change(writer: MetaStore, where: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower reading a backlog merges MAX_HELD things at most: past them it is
    told "everything" and goes on from the newest row (it held the whole backlog)."""
    monkeypatch.setattr(change_feed, "MAX_HELD", 40)
    monkeypatch.setattr(change_feed, "READ_BATCH", 4)  # (batch after batch)
    monkeypatch.setattr(change_feed, "SKIP_BATCH", 3)
    writer.create(ROOT_INO, b"first", REG, 0, 0, layout_for=pick)
    writer.commit()  # (a session's first group: "everything")
    follower = MetaStore.open(where, readonly=True)
    try:
        behind, near = FeedReader(follower), FeedReader(follower)
        for g in range(30):
            for i in range(5):
                writer.create(ROOT_INO, b"f%d.%d" % (g, i), REG, 0, 0, layout_for=pick)
            writer.commit()
            got = near.read()[0]  # (a follower keeping up is told each group)
            assert got.names == {(ROOT_INO, b"f%d.%d" % (g, i)) for i in range(5)}
        got, last = behind.read()
        assert got == Change(everything=True)  # not 150 names, nor any of them
        assert last == near.read()[1] == writer.engine.feed_mark()
        assert not behind.read()[0]  # nothing skipped is told again
        writer.create(ROOT_INO, b"next", REG, 0, 0, layout_for=pick)
        writer.commit()
        assert behind.read()[0].names == {(ROOT_INO, b"next")}
        # KV notes past the bound are "every KV key" alone: the kernel keeps its own
        writer.txn(lambda: [writer.note_kv(KV_STORED, "t", b"k%d" % i) for i in range(50)])
        writer.commit()
        kv = behind.read()[0]
        assert kv.kv_unknown and not kv.everything and kv.kv == []
    finally:
        follower.close()


def test_the_feed_is_bounded_by_rows_and_bytes(writer: MetaStore, where: str) -> None:
    """A writer committing in a loop adds a row each time: past the rows or bytes kept
    the oldest are pruned, however new, and a follower behind them is told
    "everything"; one that had read them reads on."""
    writer.create(ROOT_INO, b"first", REG, 0, 0, layout_for=pick)
    writer.commit()  # (a session's first group: "everything")
    follower = MetaStore.open(where, readonly=True)
    try:
        late = FeedReader(follower)
        for i in range(30):
            writer.create(ROOT_INO, b"n%d" % i + b"x" * 200, REG, 0, 0, layout_for=pick)
            writer.commit()
        current = FeedReader(follower)
        writer.create(ROOT_INO, b"after", REG, 0, 0, layout_for=pick)
        writer.commit()
        assert prune(writer, keep_rows=10) == 32 - 10  # (none is old)
        writer.commit()  # (the writer's group holds the prune's change)
        assert writer.engine.count("changes") == 10
        bodies = writer.engine.lengths("changes", "node", ("body",),
                                       per_row=change_feed.ROW_BYTES)
        assert prune(writer, keep_bytes=sum(bodies.values()) // 2) >= 5
        writer.commit()
        kept = writer.engine.lengths("changes", "node", ("body",),
                                     per_row=change_feed.ROW_BYTES)
        assert 0 < sum(kept.values()) <= sum(bodies.values()) // 2
        assert late.read()[0].everything
        assert current.read()[0].names == {(ROOT_INO, b"after")}
    finally:
        follower.close()


def test_a_flood_of_rows_makes_the_writer_prune_before_its_minute(
        writer: MetaStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer prunes every PRUNE_EVERY_S, and sooner once it published an eighth of
    the rows or bytes it keeps: a flood between two prunes is bounded too."""
    monkeypatch.setattr(change_feed, "KEEP_ROWS", 80)
    assert writer.feed is not None
    due = change_feed.PruneDue(writer.feed, now=0.0)
    for i in range(9):
        writer.create(ROOT_INO, b"r%d" % i, REG, 0, 0, layout_for=pick)
        writer.commit()
        assert not due(1.0 + i)
    writer.create(ROOT_INO, b"r9", REG, 0, 0, layout_for=pick)
    writer.commit()
    assert due(10.0) and not due(11.0)  # (10 rows: an eighth of 80; counted afresh)
    assert due(10.0 + change_feed.PRUNE_EVERY_S)
    monkeypatch.setattr(change_feed, "KEEP_ROWS", 10**6)
    monkeypatch.setattr(change_feed, "KEEP_BYTES", 8 * 4000)  # (an eighth: 4000)
    writer.create(ROOT_INO, b"y" * 255, REG, 0, 0, layout_for=pick)
    writer.commit()
    assert not due(71.0)
    for i in range(7):
        for j in range(3):
            writer.create(ROOT_INO, b"%d.%d" % (i, j) + b"w" * 250, REG, 0, 0,
                          layout_for=pick)
        writer.commit()
    assert due(72.0)  # (8 rows, past 4000 bytes)


def test_a_row_holds_so_many_bytes_of_names_at_most() -> None:
    """Past MAX_NAME_BYTES of names a row says "everything": a row's bytes are bounded
    (MAX_NOTED names of 255 bytes were 5 MB), and so a follower's batch of rows."""
    most = feed_notes.MAX_NAME_BYTES
    names = {(1, b"%06d" % i + b"n" * 249) for i in range(most // 255 + 1)}
    assert Change.decode(Change(names=names).encode()) == Change(everything=True)
    fits = set(list(names)[:1000])
    assert Change.decode(Change(names=fits).encode()).names == fits

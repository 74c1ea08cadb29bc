"""What only the embedded SQLite engine has: stores of older schemas migrated at open,
online copies, SQL dumps, and dumps of older versions restored."""

from __future__ import annotations

import json
import sqlite3
import stat
from pathlib import Path

import pytest

from mxfs.meta import ROOT_INO, MetaStore
from mxfs.meta import check as meta_check
from mxfs.meta.backup import backup, problem, recover
from mxfs.meta.dump import dump, restore
from mxfs.meta.schema import SCHEMA_VERSION
from mxfs.meta.sqlite_engine import DB_NAME

UUID = "00000000-0000-4000-8000-000000000015"

# The schema as versions 1-3 made it (AUTOINCREMENT numbering); 2 added `sealed`, 3 the
# KV tables.
_V1 = """
CREATE TABLE settings(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE inodes(
    ino INTEGER PRIMARY KEY AUTOINCREMENT,
    mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    nlink INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    rdev INTEGER NOT NULL DEFAULT 0, target BLOB,
    stripe_unit INTEGER, stripe_width INTEGER, first_member INTEGER,
    generation INTEGER NOT NULL DEFAULT 0);
CREATE TABLE dentries(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL,
    UNIQUE(parent, name));
CREATE INDEX dentries_by_ino ON dentries(ino);
CREATE INDEX dentries_by_parent ON dentries(parent, id);
CREATE TABLE xattrs(ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
                    PRIMARY KEY(ino, name)) WITHOUT ROWID;
CREATE TABLE orphans(ino INTEGER PRIMARY KEY);
CREATE TABLE dirty_data(ino INTEGER PRIMARY KEY);
"""
_V2 = "CREATE TABLE sealed(ino INTEGER PRIMARY KEY, sum_unit INTEGER NOT NULL, sums BLOB NOT NULL);"
_V3 = """
CREATE TABLE kv_ns(ns TEXT PRIMARY KEY, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
                   mode INTEGER NOT NULL, capacity INTEGER NOT NULL DEFAULT 0);
CREATE TABLE kv(ns TEXT NOT NULL, key BLOB NOT NULL, ino INTEGER NOT NULL,
                size INTEGER NOT NULL, atime INTEGER NOT NULL,
                PRIMARY KEY(ns, key)) WITHOUT ROWID;
CREATE INDEX kv_by_ino ON kv(ino);
"""
REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def old_store(folder: Path, version: int) -> None:
    """A store as version `version` wrote it: a folder, a file with two names and an
    xattr, an orphan, inode numbers handed out up to 40 (the last ones since removed),
    and (3) a KV chunk."""
    folder.mkdir()
    db = sqlite3.connect(folder / "mxfs.db", isolation_level=None)
    db.executescript(_V1 + (_V2 if version >= 2 else "") + (_V3 if version >= 3 else ""))
    db.executemany("INSERT INTO settings VALUES (?, ?)", [
        ("schema_version", str(version)), ("pool_uuid", UUID), ("clean", "1")])
    row = "INSERT INTO inodes(ino, mode, uid, gid, nlink, size, atime_ns, mtime_ns, " \
          "ctime_ns, stripe_unit, stripe_width, first_member) VALUES (?,?,0,0,?,?,1,1,1,?,?,?)"
    db.execute(row, (ROOT_INO, DIR, 3, 0, 1 << 20, None, None))
    db.execute(row, (2, DIR, 2, 0, 1 << 20, None, None))
    db.execute(row, (3, REG, 2, 5, 1 << 20, 4, 3))
    db.execute(row, (4, REG, 0, 0, 1 << 20, 4, 0))  # an orphan
    db.execute(row, (40, REG, 0, 0, 1 << 20, 4, 0))
    db.execute("DELETE FROM inodes WHERE ino=40")  # the counter stays at 40
    db.executemany("INSERT INTO dentries(id, parent, name, ino) VALUES (?,?,?,?)", [
        (1, ROOT_INO, b"d", 2), (2, 2, b"f", 3), (3, ROOT_INO, b"f2", 3), (30, 1, b"x", 2)])
    db.execute("DELETE FROM dentries WHERE id=30")
    db.execute("INSERT INTO xattrs VALUES (3, ?, ?)", (b"user.k", b"v"))
    db.execute("INSERT INTO orphans VALUES (4)")
    if version >= 3:
        db.execute(row, (5, REG, 1, 9, 1 << 20, 4, 1))
        db.execute("INSERT INTO sealed VALUES (5, 4096, ?)", (b"12345678",))
        db.execute("INSERT INTO kv_ns VALUES ('ns', 0, 0, 448, 0)")
        db.execute("INSERT INTO kv VALUES ('ns', ?, 5, 9, 1)", (b"key",))
    db.close()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_schemas_are_migrated_and_number_on_past_the_old_counters(
        tmp_path: Path, version: int) -> None:
    folder = tmp_path / "meta"
    old_store(folder, version)
    s = MetaStore.open(str(folder))
    try:
        assert s.setting("schema_version") == str(SCHEMA_VERSION)
        d = s.lookup(ROOT_INO, b"d")
        f = s.lookup(d.ino, b"f")
        assert (f.ino, f.nlink, f.size) == (3, 2, 5)
        assert s.getxattr(f.ino, b"user.k") == b"v" and s.orphans() == [4]
        assert [e.name for e in s.readdir(ROOT_INO, 0)] == [b"d", b"f2"]
        if version >= 3:
            assert [c[:5] for c in s.kv.chunks()] == [("ns", b"key", 5, 9, 1)]
        assert [p.text for p in meta_check.problems(s)] == []
        new = s.create(d.ino, b"new", REG, 0, 0, layout_for=lambda i, u, w: (1 << 20, 4, 0))
        assert new.ino == 41  # past the counter, not past the rows
        assert s.readdir(d.ino, 0)[-1].cookie == 31
        f_sealed = s.create_hidden(d.ino, 0o644, 0, 0, lambda i, u, w: (1 << 20, 4, 0))
        s.publish(f_sealed.ino, d.ino, b"sealed", replace=False, size=1, sum_unit=4096,
                  sums=b"")
        assert s.is_sealed(f_sealed.ino)
    finally:
        s.close()
    again = MetaStore.open(str(folder))  # migrated once: opens as it is now
    assert again.lookup(2, b"new").ino == 41
    again.close()


def test_a_schema_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    from mxfs.meta import Unusable
    folder = tmp_path / "meta"
    folder.mkdir()
    s = MetaStore.format(str(folder), UUID, 1 << 20)
    s.set_setting("schema_version", "99")
    s.close()
    with pytest.raises(Unusable, match="schema 99"):
        MetaStore.open(str(folder))


def _sample(folder: Path) -> MetaStore:
    folder.mkdir()
    s = MetaStore.format(str(folder), UUID, 1 << 20)
    d = s.create(ROOT_INO, b"d", DIR, 0, 0)
    f = s.create(d.ino, b"f\xff", REG, 0, 0, layout_for=lambda i, u, w: (1 << 20, 4, i % 4))
    s.setxattr(f, b"user.bin", b"\x00\xff")
    return s


def test_online_copies_are_sound_and_this_pools(tmp_path: Path) -> None:
    s = _sample(tmp_path / "meta")
    s.group_changes(3600)
    s.create(ROOT_INO, b"uncommitted", DIR, 0, 0)
    copy = backup(s, str(tmp_path / "copies"))
    assert problem(copy.path, UUID) is None
    assert problem(copy.path, "another") == "belongs to pool " + UUID
    c = sqlite3.connect(copy.path)
    names = {r[0] for r in c.execute("SELECT name FROM dentries")}
    c.close()
    assert names == {b"d", b"f\xff"}  # what was committed, nothing else
    s.close()


def test_a_store_closed_clean_is_not_read_page_by_page_at_mount(tmp_path: Path) -> None:
    """Every mount asks `backup.recover` whether the store is sound, and its `PRAGMA
    quick_check` read every page (a 378 MB store: 2 s cold, more as tenants store
    more).  It now runs on a store its daemon did not close clean: a damaged page the
    header, schema and settings do not reach is found after a crash (the newest good
    copy put in its place), and left after a clean close to the reads that meet it
    and to fsck."""
    s = _sample(tmp_path / "meta")
    s.engine.group(3600)
    for i in range(3000):  # (pages past the settings')
        s.create(ROOT_INO, b"d%d" % i, DIR, 0, 0)
    s.commit()
    copies = str(tmp_path / "copies")
    backup(s, copies)
    s.close()
    db = tmp_path / "meta" / DB_NAME
    with open(db, "r+b") as f:  # the last page, a name's or an inode's: garbage
        f.seek(db.stat().st_size - 4096)
        f.write(b"\xff" * 4096)
    assert recover(str(tmp_path / "meta"), UUID, [copies]) is None
    with sqlite3.connect(db) as c:  # (as a daemon killed while serving leaves it)
        c.execute("UPDATE settings SET value='0' WHERE key='clean'")
    c.close()
    said = recover(str(tmp_path / "meta"), UUID, [copies])
    assert said is not None and "malformed" in said
    assert problem(str(db), UUID) is None


@pytest.mark.parametrize("name", ["m.json", "m.json.zst", "m.sql", "m.sql.zst"])
def test_dumps_restore_every_row_and_the_sequences(tmp_path: Path, name: str) -> None:
    s = _sample(tmp_path / "meta")
    before = {t: sorted(map(repr, s.engine.scan(t, _cols(t)))) for t in _TABLES}
    top = s.engine.sequences()
    assert dump(s, str(tmp_path / name)) >= 3
    s.create(ROOT_INO, b"after", DIR, 0, 0)
    s.close()
    restore(str(tmp_path / name), str(tmp_path / "meta"), UUID)
    r = MetaStore.open(str(tmp_path / "meta"))
    try:
        assert {t: sorted(map(repr, r.engine.scan(t, _cols(t)))) for t in _TABLES} == before
        assert r.engine.sequences()["ino"] >= top["ino"]
        with pytest.raises(ValueError, match="belongs to pool"):
            restore(str(tmp_path / name), str(tmp_path / "meta"), "another")
    finally:
        r.close()


def test_a_dump_of_schema_3_restores(tmp_path: Path) -> None:
    """The JSON dumps version 3 wrote: every SQLite table, `sqlite_sequence` among them."""
    doc = {"format": "mxfs-meta", "schema_version": 3, "tables": {
        "settings": {"columns": ["key", "value"], "rows": [
            ["schema_version", "3"], ["pool_uuid", UUID], ["clean", "1"]]},
        "inodes": {"columns": ["ino", "mode", "uid", "gid", "nlink", "size", "atime_ns",
                               "mtime_ns", "ctime_ns", "rdev", "target", "stripe_unit",
                               "stripe_width", "first_member", "generation"],
                   "rows": [[1, DIR, 0, 0, 2, 0, 1, 1, 1, 0, None, 1 << 20, None, None, 0]]},
        "dentries": {"columns": ["id", "parent", "name", "ino"], "rows": []},
        "sqlite_sequence": {"columns": ["name", "seq"], "rows": [["inodes", 77],
                                                                 ["dentries", 12]]}}}
    (tmp_path / "old.json").write_text(json.dumps(doc))
    (tmp_path / "meta").mkdir()
    MetaStore.format(str(tmp_path / "meta"), UUID, 1 << 20).close()
    restore(str(tmp_path / "old.json"), str(tmp_path / "meta"), UUID)
    s = MetaStore.open(str(tmp_path / "meta"))
    assert s.setting("schema_version") == str(SCHEMA_VERSION)
    assert s.create(ROOT_INO, b"n", DIR, 0, 0).ino == 78
    assert s.readdir(ROOT_INO, 0)[0].cookie == 13
    s.close()


_TABLES = ("settings", "inodes", "dentries", "xattrs", "orphans", "sealed", "kv")


def _cols(t: str) -> tuple[str, ...]:
    from mxfs.meta.schema import TABLES
    return TABLES[t].names


def test_checkpoints_apart_copy_the_wal_before_a_commit_must(tmp_path: Path) -> None:
    """With checkpoints apart (the daemon's), the checkpoint call copies what the WAL
    holds into the database from a connection of its own, before a commit reaches
    SQLite's 1,000 pages (a copy and an fsync of the database on the daemon's one
    thread); a call with nothing written since does nothing; every change stays."""
    import os

    from mxfs.meta.sqlite_engine import DB_NAME

    s = _sample(tmp_path / "meta")
    checkpoint = s.engine.checkpoint_apart()
    assert checkpoint is not None
    db = tmp_path / "meta" / DB_NAME
    before = db.stat().st_size
    for i in range(20):  # (1.3 MiB: no commit checkpointed)
        s.setxattr(s.create(ROOT_INO, b"x%d" % i, REG, 0, 0, layout_for=lambda i, u, w:
                            (1 << 20, 4, 0)), b"user.v", os.urandom(64 << 10))
    assert db.stat().st_size == before
    checkpoint()
    copied = db.stat()
    assert copied.st_size > before + (20 * 64 << 10)  # (the pages copied over)
    checkpoint()  # (nothing new: the database untouched)
    assert db.stat().st_mtime_ns == copied.st_mtime_ns
    s.close()
    again = MetaStore.open(str(tmp_path / "meta"))
    assert again.getxattr(again.lookup(ROOT_INO, b"x19").ino, b"user.v") is not None
    again.close()


def test_growth_room_is_kept_past_the_wals_end_without_a_subprocess(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reserve's upkeep runs on the daemon's one thread ten times a second: the
    blocks for the WAL to grow into are allocated past its end, its size unchanged,
    and nothing is spawned for it (finding libc through ldconfig cost 1.5-5 ms)."""
    import subprocess

    from mxfs.meta.sqlite_space import GROWTH_ROOM, Reserve

    db = tmp_path / DB_NAME
    db.write_bytes(b"d" * 4096)
    wal = tmp_path / (DB_NAME + "-wal")
    wal.write_bytes(b"w" * 12288)

    def spawned(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the reserve's upkeep spawned {args[:1]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", spawned)
    assert Reserve(str(db)).keep()
    for path, size in ((wal, 12288), (db, 4096)):
        st = path.stat()
        assert st.st_size == size
        assert st.st_blocks * 512 >= size + GROWTH_ROOM // 2

"""The metadata interface, driven directly (no FUSE, no root), against every engine.

Every namespace rule and error of `MetaStore`, the invariants `meta/check.py`
finds, sequences, memory put back when a change fails, two connections conflicting
and running their changes again, and crash safety: a process SIGKILLed in the middle
of each kind of change leaves the old state or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import eventually

from mxfs.meta import ROOT_INO, MetaStore, Unusable
from mxfs.meta import check as meta_check
from mxfs.meta.engine import Engine
from mxfs.meta.schema import TABLES
from mxfs.meta.usage import BLOCK, NAME_ROW

UNIT = 1 << 20
UUID = "00000000-0000-4000-8000-000000000015"
REG, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def pick(ino: int, unit: int | None, width: int | None) -> tuple[int, int, int]:
    return unit or UNIT, width or 4, ino % 4


@pytest.fixture
def where(store_where: str) -> str:
    """Where a fresh store of the engine under test lives (`conftest.store_where`)."""
    return store_where


@pytest.fixture
def store(where: str) -> Iterator[MetaStore]:
    s = MetaStore.format(where, UUID, UNIT)
    s.sole_writer(True)  # as a daemon is: the rules must hold with names cached
    yield s
    s.close()


def impatient(where: str) -> Engine:
    """A second connection that reports a conflict at once instead of waiting."""
    if where.startswith("postgresql://"):
        from mxfs.meta.pg_engine import PgEngine
        return PgEngine.open(where, busy_ms=1)
    from mxfs.meta.sqlite_engine import SqliteEngine
    return SqliteEngine.open(where, busy_ms=0)


def errno_of(fn: Callable[[], object]) -> int:
    with pytest.raises(OSError) as e:
        fn()
    return e.value.errno


def fresh(where: str) -> MetaStore:
    """The rows as another connection sees them (nothing cached)."""
    return MetaStore.open(where, readonly=True)


def names(store: MetaStore, d: int) -> list[bytes]:
    out, after = [], 0
    while batch := store.readdir(d, after, limit=3):
        out += [e.name for e in batch]
        after = batch[-1].cookie
    return out


def assert_sound(store: MetaStore) -> None:
    assert [p.text for p in meta_check.problems(store)] == []


# ---- names ------------------------------------------------------------------------


@pytest.mark.parametrize("name, code", [
    (b"", errno.EINVAL), (b".", errno.EINVAL), (b"..", errno.EINVAL), (b"a/b", errno.EINVAL),
    (b"a\0b", errno.EINVAL), (b"x" * 256, errno.ENAMETOOLONG)])
def test_names_follow_the_kernels_rules_everywhere(store: MetaStore, name: bytes,
                                                   code: int) -> None:
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    h = store.create_hidden(ROOT_INO, 0o644, 0, 0, pick)
    assert errno_of(lambda: store.create(ROOT_INO, name, REG, 0, 0, layout_for=pick)) == code
    assert errno_of(lambda: store.link(f.ino, ROOT_INO, name)) == code
    assert errno_of(lambda: store.rename(ROOT_INO, b"f", ROOT_INO, name)) == code
    assert errno_of(lambda: store.publish(h.ino, ROOT_INO, name, replace=True, size=0,
                                          sum_unit=UNIT, sums=b"")) == code
    assert store.create(ROOT_INO, b"x" * 255, REG, 0, 0, layout_for=pick).nlink == 1
    assert_sound(store)


# ---- create, lookup, layouts ------------------------------------------------------


def test_create_makes_an_entry_and_counts_links(store: MetaStore, where: str) -> None:
    root = store.get(ROOT_INO)
    before = root.mtime_ns
    d = store.create(ROOT_INO, b"d", DIR, 7, 8)
    assert (d.nlink, d.uid, d.gid, root.nlink) == (2, 7, 8, 3)
    assert root.mtime_ns >= before and root.ctime_ns == root.mtime_ns
    f = store.create(d.ino, b"f", REG, 7, 8, layout_for=pick)
    s = store.create(d.ino, b"s", stat.S_IFLNK | 0o777, 7, 8, target=b"../f")
    n = store.create(d.ino, b"n", stat.S_IFCHR | 0o600, 0, 0, rdev=0x0103)
    assert (f.nlink, f.size, d.nlink) == (1, 0, 2)
    assert (s.target, s.size) == (b"../f", 4)
    assert n.rdev == 0x0103
    assert store.lookup(d.ino, b"f") is f
    assert store.lookup(d.ino, b".") is d and store.lookup(d.ino, b"..") is root
    assert store.lookup(ROOT_INO, b"..") is root
    assert errno_of(lambda: store.lookup(d.ino, b"missing")) == errno.ENOENT
    assert errno_of(lambda: store.create(d.ino, b"f", REG, 0, 0, layout_for=pick)) == \
        errno.EEXIST
    assert errno_of(lambda: store.create(f.ino, b"x", REG, 0, 0, layout_for=pick)) == \
        errno.ENOTDIR
    assert errno_of(lambda: store.get(999_999)) == errno.ENOENT
    other = fresh(where)
    assert other.lookup(d.ino, b"f") == f and other.get(ROOT_INO) == root
    assert sorted(names(other, d.ino)) == [b"f", b"n", b"s"]
    other.close()
    assert_sound(store)


def test_layouts_come_from_the_directory(store: MetaStore) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    store.set_layout(d, 4 * UNIT, 2)
    sub = store.create(d.ino, b"sub", DIR, 0, 0)
    assert (sub.stripe_unit, sub.stripe_width) == (4 * UNIT, 2)
    f = store.create(sub.ino, b"f", REG, 0, 0, layout_for=pick)
    assert (f.stripe_unit, f.stripe_width, f.first_member) == (4 * UNIT, 2, f.ino % 4)
    h = store.create_hidden(sub.ino, 0o600, 0, 0, pick)
    assert (h.stripe_unit, h.stripe_width) == (4 * UNIT, 2)
    store.set_layout(f, UNIT, 1)
    assert (store.get(f.ino).stripe_unit, store.get(f.ino).stripe_width) == (UNIT, 1)


def test_a_removed_directory_takes_no_new_entries(store: MetaStore) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    store.rmdir(ROOT_INO, b"d")
    assert d.nlink == 0
    assert errno_of(lambda: store.create(d.ino, b"f", REG, 0, 0, layout_for=pick)) == \
        errno.ENOENT
    assert errno_of(lambda: store.create_hidden(d.ino, 0o644, 0, 0, pick)) == errno.ENOENT


# ---- links, unlink, rmdir, orphans -------------------------------------------------


def test_link_and_unlink_count_links_and_make_orphans(store: MetaStore) -> None:
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    assert store.link(f.ino, d.ino, b"g").nlink == 2
    assert errno_of(lambda: store.link(f.ino, d.ino, b"g")) == errno.EEXIST
    assert errno_of(lambda: store.link(d.ino, ROOT_INO, b"d2")) == errno.EPERM
    assert errno_of(lambda: store.unlink(ROOT_INO, b"d")) == errno.EISDIR
    assert errno_of(lambda: store.unlink(ROOT_INO, b"nope")) == errno.ENOENT
    assert store.unlink(ROOT_INO, b"f").nlink == 1
    assert store.orphans() == []
    assert store.unlink(d.ino, b"g") is f and f.nlink == 0
    assert store.orphans() == [f.ino]
    assert errno_of(lambda: store.link(f.ino, ROOT_INO, b"back")) == errno.ENOENT
    assert_sound(store)
    store.drop_inodes([f.ino])
    assert store.orphans() == [] and errno_of(lambda: store.get(f.ino)) == errno.ENOENT
    assert_sound(store)


def test_rmdir_needs_an_empty_directory(store: MetaStore) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    f = store.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
    store.create(ROOT_INO, b"file", REG, 0, 0, layout_for=pick)
    assert errno_of(lambda: store.rmdir(ROOT_INO, b"d")) == errno.ENOTEMPTY
    assert errno_of(lambda: store.rmdir(ROOT_INO, b"file")) == errno.ENOTDIR
    assert errno_of(lambda: store.rmdir(ROOT_INO, b"nope")) == errno.ENOENT
    store.unlink(d.ino, b"f")
    assert store.get(ROOT_INO).nlink == 3
    assert store.rmdir(ROOT_INO, b"d").nlink == 0
    assert store.get(ROOT_INO).nlink == 2
    assert set(store.orphans()) == {f.ino, d.ino}
    assert_sound(store)


# ---- rename -----------------------------------------------------------------------


def test_rename_moves_and_replaces_by_posix_rules(store: MetaStore) -> None:
    a = store.create(ROOT_INO, b"a", DIR, 0, 0)
    b = store.create(ROOT_INO, b"b", DIR, 0, 0)
    f = store.create(a.ino, b"f", REG, 0, 0, layout_for=pick)
    g = store.create(b.ino, b"g", REG, 0, 0, layout_for=pick)
    sub = store.create(a.ino, b"sub", DIR, 0, 0)
    assert errno_of(lambda: store.rename(a.ino, b"nope", b.ino, b"x")) == errno.ENOENT
    assert errno_of(lambda: store.rename(a.ino, b"f", b.ino, b"g", noreplace=True)) == \
        errno.EEXIST
    assert errno_of(lambda: store.rename(a.ino, b"sub", b.ino, b"g")) == errno.ENOTDIR
    assert errno_of(lambda: store.rename(a.ino, b"f", ROOT_INO, b"b")) == errno.EISDIR
    assert errno_of(lambda: store.rename(ROOT_INO, b"a", sub.ino, b"a")) == errno.EINVAL
    assert errno_of(lambda: store.rename(ROOT_INO, b"a", ROOT_INO, b"b")) == errno.ENOTEMPTY
    gone = store.rename(a.ino, b"f", b.ino, b"g")  # replaces g: its last link
    assert gone is g and g.nlink == 0 and store.orphans() == [g.ino]
    assert store.lookup(b.ino, b"g") is f and names(store, a.ino) == [b"sub"]
    assert store.rename(a.ino, b"sub", b.ino, b"sub") is None  # a directory moves
    assert (a.nlink, b.nlink) == (2, 3)
    assert store.parent_of(sub.ino) == b.ino
    empty = store.create(ROOT_INO, b"empty", DIR, 0, 0)
    assert store.rename(b.ino, b"sub", ROOT_INO, b"empty") is empty  # over an empty dir
    assert empty.nlink == 0 and b.nlink == 2 and store.get(ROOT_INO).nlink == 5
    store.link(f.ino, b.ino, b"same")
    assert store.rename(b.ino, b"g", b.ino, b"same") is None  # one inode: nothing happens
    assert sorted(names(store, b.ino)) == [b"g", b"same"]
    assert_sound(store)


def test_rename_keeps_the_readdir_cookie(store: MetaStore) -> None:
    for n in (b"a", b"b", b"c"):
        store.create(ROOT_INO, n, REG, 0, 0, layout_for=pick)
    store.rename(ROOT_INO, b"a", ROOT_INO, b"z")
    assert names(store, ROOT_INO) == [b"z", b"b", b"c"]


def test_rename_exchange_swaps_two_entries(store: MetaStore) -> None:
    a = store.create(ROOT_INO, b"a", DIR, 0, 0)
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    sub = store.create(a.ino, b"sub", DIR, 0, 0)
    assert errno_of(lambda: store.rename(ROOT_INO, b"f", a.ino, b"none", exchange=True)) == \
        errno.ENOENT
    assert errno_of(lambda: store.rename(a.ino, b"sub", ROOT_INO, b"a", exchange=True)) == \
        errno.EINVAL
    assert store.rename(ROOT_INO, b"f", a.ino, b"sub", exchange=True) is None
    assert store.lookup(ROOT_INO, b"f") is sub and store.lookup(a.ino, b"sub") is f
    assert (store.get(ROOT_INO).nlink, a.nlink) == (4, 2)  # the directory moved up
    assert_sound(store)


# ---- readdir ----------------------------------------------------------------------


def test_readdir_is_stable_while_entries_change(store: MetaStore) -> None:
    for i in range(20):
        store.create(ROOT_INO, b"f%02d" % i, REG, 0, 0, layout_for=pick)
    first = store.readdir(ROOT_INO, 0, limit=7)
    assert [e.name for e in first] == [b"f%02d" % i for i in range(7)]
    store.unlink(ROOT_INO, b"f03")  # already listed
    store.unlink(ROOT_INO, b"f10")  # not yet listed
    store.create(ROOT_INO, b"new", REG, 0, 0, layout_for=pick)
    rest, after = [], first[-1].cookie
    while batch := store.readdir(ROOT_INO, after, limit=4):
        rest += [e.name for e in batch]
        after = batch[-1].cookie
    assert rest == [b"f%02d" % i for i in range(7, 20) if i != 10] + [b"new"]
    assert store.readdir(ROOT_INO, after) == []


# ---- xattrs -----------------------------------------------------------------------


def test_xattrs_are_set_listed_replaced_and_removed(store: MetaStore, where: str) -> None:
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    store.setxattr(f, b"user.b", b"\x00\xff")
    store.setxattr(f, b"user.a", b"1")
    store.setxattr(f, b"user.a", b"2")
    assert store.listxattr(f.ino) == [b"user.a", b"user.b"]
    assert store.getxattr(f.ino, b"user.a") == b"2"
    assert store.getxattr(f.ino, b"user.b") == b"\x00\xff"
    assert store.getxattr(f.ino, b"user.c") is None
    ctime = f.ctime_ns
    assert store.removexattr(f, b"user.a") and f.ctime_ns >= ctime
    assert not store.removexattr(f, b"user.a")
    other = fresh(where)
    assert other.listxattr(f.ino) == [b"user.b"]
    other.close()


# ---- attributes, data fields -----------------------------------------------------


def test_attributes_are_saved_by_typed_setters(store: MetaStore, where: str) -> None:
    f = store.create(ROOT_INO, b"f", REG, 1, 1, layout_for=pick)
    store.touch(f, size=5000, mtime_ns=10, atime_ns=11)
    assert f.dirty
    other = fresh(where)
    assert other.get(f.ino).size == 0  # held in memory until written back
    other.close()
    store.set_attrs(f, mode=stat.S_IFREG | 0o600, uid=5, gid=6, ctime_ns=12)
    assert not f.dirty
    other = fresh(where)
    g = other.get(f.ino)
    assert (g.mode, g.uid, g.gid, g.size, g.mtime_ns, g.atime_ns, g.ctime_ns) == \
        (stat.S_IFREG | 0o600, 5, 6, 5000, 10, 11, 12)
    other.close()
    with pytest.raises(TypeError):
        store.set_attrs(f, nlinks=3)  # type: ignore[call-arg]
    store.touch(f, size=7000)
    store.flush_all()
    other = fresh(where)
    assert other.get(f.ino).size == 7000
    other.close()


def test_writes_and_truncates_mark_dirty_data(store: MetaStore) -> None:
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    store.begin_write(f)
    assert f.generation == 1 and store.dirty_data() == [f.ino]
    store.clear_dirty_data(f.ino)
    store.touch(f, size=100)
    assert not store.resize(f, 200) and store.dirty_data() == []  # growing: nothing to cut
    assert store.resize(f, 50) and store.dirty_data() == [f.ino] and f.generation == 3


# ---- direct writes: hidden files, publish, seals ----------------------------------


def test_hidden_files_are_orphans_until_published_and_sealed(store: MetaStore) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    h = store.create_hidden(d.ino, 0o640, 3, 4, pick)
    assert (h.nlink, h.mode, h.uid) == (0, stat.S_IFREG | 0o640, 3)
    assert store.orphans() == [h.ino]
    assert_sound(store)
    assert store.publish(h.ino, d.ino, b"ckpt", replace=False, size=4096, sum_unit=UNIT,
                         sums=b"12345678") is None
    assert (h.nlink, h.size) == (1, 4096) and store.orphans() == []
    assert store.seal_of(h.ino) == (UNIT, b"12345678") and store.is_sealed(h.ino)
    assert errno_of(lambda: store.publish(h.ino, d.ino, b"again", replace=True, size=1,
                                          sum_unit=UNIT, sums=b"")) == errno.EINVAL
    second = store.create_hidden(d.ino, 0o640, 3, 4, pick)
    assert errno_of(lambda: store.publish(second.ino, d.ino, b"ckpt", replace=False, size=1,
                                          sum_unit=UNIT, sums=b"")) == errno.EEXIST
    assert second.nlink == 0 and not store.is_sealed(second.ino)  # nothing of it kept
    assert store.publish(second.ino, d.ino, b"ckpt", replace=True, size=1, sum_unit=UNIT,
                         sums=b"") is h
    assert h.nlink == 0 and set(store.orphans()) == {h.ino}
    store.create(d.ino, b"sub", DIR, 0, 0)
    third = store.create_hidden(d.ino, 0o640, 3, 4, pick)
    assert errno_of(lambda: store.publish(third.ino, d.ino, b"sub", replace=True, size=1,
                                          sum_unit=UNIT, sums=b"")) == errno.EISDIR
    assert_sound(store)
    store.drop_inodes([h.ino])
    assert store.seal_of(h.ino) is None


# ---- the KV index -----------------------------------------------------------------


def test_kv_rows_first_writer_wins_and_removal_makes_orphans(store: MetaStore) -> None:
    store.kv.set_namespace("ns", 5, 6, 0o700, 1 << 30)
    store.kv.set_namespace("ns", 5, 6, 0o750, 1 << 31)
    assert store.kv.namespaces() == [("ns", 5, 6, 0o750, 1 << 31)]
    a = store.create_hidden(ROOT_INO, 0o600, 0, 0, pick)
    b = store.create_hidden(ROOT_INO, 0o600, 0, 0, pick)
    store.kv.publish(a.ino, "ns", b"k1", 100, 2, UNIT, b"sumsumsu")
    assert errno_of(lambda: store.kv.publish(b.ino, "ns", b"k1", 100, 3, UNIT, b"")) == \
        errno.EEXIST
    assert b.nlink == 0 and store.orphans() == [b.ino]
    store.kv.publish(b.ino, "ns", b"k2", 200, 1, UNIT, b"")
    assert [c[:5] for c in store.kv.chunks()] == [("ns", b"k2", b.ino, 200, 1),
                                                  ("ns", b"k1", a.ino, 100, 2)]
    store.kv.touch([(9, "ns", b"k2")])
    assert [c[1] for c in store.kv.chunks()] == [b"k1", b"k2"]
    assert store.kv.key_of(a.ino) == ("ns", b"k1")
    assert_sound(store)
    assert store.kv.remove([("ns", b"k1", a.ino)]) == [a]
    assert a.nlink == 0 and store.orphans() == [a.ino]
    store.kv.drop_namespace("ns")
    assert store.kv.namespaces() == []
    assert_sound(store)


# ---- sequences ----------------------------------------------------------------------


def test_inode_numbers_and_cookies_are_never_reused(store: MetaStore, where: str) -> None:
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    first_cookie = store.readdir(ROOT_INO, 0)[0].cookie
    store.unlink(ROOT_INO, b"f")
    store.drop_inodes([f.ino])
    store.close()
    again = MetaStore.open(where)
    g = again.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    assert g.ino > f.ino and again.readdir(ROOT_INO, 0)[0].cookie > first_cookie
    seen = [again.engine.txn(lambda: again.engine.next_id("ino")) for _ in range(5)]
    assert seen == sorted(set(seen)) and seen[0] > g.ino
    again.close()


# ---- failed changes ---------------------------------------------------------------


def test_a_failed_change_is_undone_in_the_rows_and_in_memory(store: MetaStore,
                                                             where: str) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    f = store.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
    before = (store.get(ROOT_INO).nlink, d.nlink, d.mtime_ns, f.nlink, store.count_inodes())

    def broken() -> None:
        store.unlink(d.ino, b"f")
        store.create(ROOT_INO, b"e", DIR, 0, 0)
        raise RuntimeError("the change fails after some of its writes")

    with pytest.raises(RuntimeError):
        store.txn(broken)
    assert (store.get(ROOT_INO).nlink, d.nlink, d.mtime_ns, f.nlink,
            store.count_inodes()) == before
    assert store.lookup(d.ino, b"f") is f and store.orphans() == []
    assert errno_of(lambda: store.lookup(ROOT_INO, b"e")) == errno.ENOENT

    def bad_layout(ino: int, unit: int | None, width: int | None) -> tuple[int, int, int]:
        raise OSError(errno.EINVAL, "no layout")

    assert errno_of(lambda: store.create(d.ino, b"g", REG, 0, 0, layout_for=bad_layout)) == \
        errno.EINVAL
    assert d.nlink == 2 and names(store, d.ino) == [b"f"]
    other = fresh(where)
    assert other.get(d.ino) == d and other.count_inodes() == before[4]
    other.close()
    assert_sound(store)


def test_writes_without_an_answer_fail_their_change_by_its_end(store: MetaStore,
                                                               where: str) -> None:
    """put, patch, remove and upsert may be sent without waiting (PostgreSQL pipelines
    them); an error among them still fails their own change, undone whole, and leaves
    the group's earlier changes be (while other writers may change the rows)."""
    store.sole_writer(False)
    store.group_changes(3600)
    a = store.create(ROOT_INO, b"a", REG, 0, 0, layout_for=pick)
    e = store.engine

    def change() -> None:
        e.patch("inodes", {"ino": a.ino}, {"uid": 7})
        e.remove("orphans", {"ino": a.ino})
        e.upsert("orphans", {"ino": a.ino})
        e.put("dentries", {"id": e.next_id("dentry"), "parent": ROOT_INO, "name": b"a",
                           "ino": a.ino})  # (parent, name) is taken
        e.patch("inodes", {"ino": a.ino}, {"gid": 7})

    assert errno_of(lambda: e.txn(change)) == errno.EEXIST
    assert e.get("inodes", {"ino": a.ino}, ("uid", "gid")) == (0, 0)
    assert e.get("orphans", {"ino": a.ino}, ("ino",)) is None
    assert names(store, ROOT_INO) == [b"a"]
    e.txn(lambda: (e.patch("inodes", {"ino": a.ino}, {"uid": 5}),
                   e.upsert("orphans", {"ino": a.ino}), e.upsert("orphans", {"ino": a.ino}),
                   e.remove("orphans", {"ino": a.ino}), e.remove("orphans", {"ino": 999})))
    store.durable()
    other = fresh(where)
    assert other.lookup(ROOT_INO, b"a").uid == 5 and other.orphans() == []
    other.close()
    assert errno_of(lambda: store.create(ROOT_INO, b"a", REG, 0, 0, layout_for=pick)) == \
        errno.EEXIST
    assert_sound(store)


def test_an_expect_write_that_finds_no_row_runs_its_change_again(store: MetaStore) -> None:
    """`expect`: the change read the row, maybe from a cache; a row gone meanwhile is a
    conflict, so the change is undone and run again on fresh reads."""
    a = store.create(ROOT_INO, b"a", REG, 0, 0, layout_for=pick)
    e = store.engine
    tries = []

    def change() -> None:
        tries.append(1)
        e.patch("inodes", {"ino": a.ino}, {"uid": len(tries)})
        gone = {"ino": 10**9} if len(tries) == 1 else {"ino": a.ino}
        e.patch("inodes", gone, {"gid": 3}, expect=True)
        e.remove("xattrs", {"ino": a.ino, "name": b"x"})  # (no row: no expect, fine)

    e.txn(change)
    assert len(tries) == 2
    assert e.get("inodes", {"ino": a.ino}, ("uid", "gid")) == (2, 3)
    assert errno_of(lambda: e.txn(lambda: e.remove("orphans", {"ino": 10**9},
                                                   expect=True))) == errno.EBUSY
    assert_sound(store)


def test_remove_many_removes_rows_by_key(store: MetaStore, where: str) -> None:
    e = store.engine
    store.group_changes(3600)
    e.txn(lambda: [e.upsert("orphans", {"ino": i}) for i in range(10, 1300)])
    e.txn(lambda: e.remove_many("orphans", "ino", [*range(10, 1200), 11, 10**12]))
    e.txn(lambda: e.remove_many("orphans", "ino", []))
    store.durable()
    other = fresh(where)
    assert sorted(other.orphans()) == list(range(1200, 1300))
    assert other.orphans_among([5, 1200, 1299, 1300]) == [1200, 1299]
    other.close()


def test_names_another_writer_made_stale_are_read_again(store: MetaStore,
                                                        where: str) -> None:
    """A daemon caches names; another writer's change (of a daemon that ran out of its
    lease, say) makes them stale.  An unlink,
    rename or create that went by a stale name conflicts or fails in the rows and is
    run again on fresh reads: it never drops the link of an inode the name no longer
    names, and never fails where the rows say it should not."""
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    f = store.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
    other = MetaStore.open(where)
    other.sole_writer(True)
    try:
        for name in (b"f", b"g", b"h", b"n"):
            other.entry_ino(d.ino, name)  # cached: f -> its inode; g, h, n: none
        store.rename(d.ino, b"f", d.ino, b"g")
        h = store.create(d.ino, b"h", REG, 0, 0, layout_for=pick)
        assert errno_of(lambda: other.unlink(d.ino, b"f")) == errno.ENOENT
        assert errno_of(lambda: other.create(d.ino, b"h", REG, 0, 0, layout_for=pick)) \
            == errno.EEXIST
        n = other.create(d.ino, b"n", REG, 0, 0, layout_for=pick)
        assert other.rename(d.ino, b"n", d.ino, b"h") == other.get(h.ino)  # replaced
        assert other.unlink(d.ino, b"g").ino == f.ino
        # a directory `other` made has every name cached, until `store` adds one
        e = other.create(d.ino, b"e", DIR, 0, 0)
        x = store.create(e.ino, b"x", REG, 0, 0, layout_for=pick)
        assert errno_of(lambda: other.create(e.ino, b"x", REG, 0, 0, layout_for=pick)) \
            == errno.EEXIST
        assert other.unlink(e.ino, b"x").ino == x.ino
        assert other.rmdir(d.ino, b"e").ino == e.ino
    finally:
        other.close()
    again = fresh(where)
    assert names(again, d.ino) == [b"h"] and again.lookup(d.ino, b"h").ino == n.ino
    assert sorted(again.orphans()) == sorted([f.ino, h.ino, x.ino, e.ino])
    assert_sound(again)
    again.close()


def test_parents_another_writer_made_stale_are_read_again(store: MetaStore,
                                                          where: str) -> None:
    """A daemon caches directories' parents for a rename's ancestry walk; another
    writer's move makes them stale.  A rename the stale chain refused (EINVAL: "into
    its own subtree") is run again on fresh reads, and made."""
    store.sole_writer(True)
    a = store.create(ROOT_INO, b"a", DIR, 0, 0)
    b = store.create(a.ino, b"b", DIR, 0, 0)  # (cached: b's parent is a)
    other = MetaStore.open(where)
    try:
        other.rename(a.ino, b"b", ROOT_INO, b"b")  # b back at the top
    finally:
        other.close()
    store.rename(ROOT_INO, b"a", b.ino, b"a")  # a into b: no loop, in the rows
    assert store.lookup(b.ino, b"a").ino == a.ino
    store.sole_writer(False)


def test_a_groups_directory_times_are_written_once_as_it_commits(store: MetaStore,
                                                                  where: str) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    store.durable()
    before = store.get(d.ino).mtime_ns
    store.group_changes(3600)
    for i in range(5):
        store.create(d.ino, b"f%d" % i, REG, 0, 0, layout_for=pick)
    store.unlink(d.ino, b"f0")
    assert errno_of(lambda: store.create(d.ino, b"f1", REG, 0, 0, layout_for=pick)) == \
        errno.EEXIST
    held = store.get(d.ino)
    assert held.mtime_ns > before and held.ctime_ns == held.mtime_ns
    assert store.groups_lost == 0
    store.durable()
    other = fresh(where)
    assert (other.get(d.ino).mtime_ns, other.get(d.ino).ctime_ns) == (held.mtime_ns,
                                                                      held.ctime_ns)
    assert names(other, d.ino) == [b"f%d" % i for i in range(1, 5)]
    other.close()
    assert_sound(store)


def test_a_sole_writers_change_that_fails_after_writing_leaves_no_part(store: MetaStore,
                                                                       where: str) -> None:
    """A sole writer's engine may take no savepoint (PostgreSQL): a change that fails
    after its writes then loses its group, memory put back with it; one that fails
    before it wrote (a rule) leaves the group be."""
    store.group_changes(3600)
    a = store.create(ROOT_INO, b"a", REG, 0, 0, layout_for=pick)
    assert errno_of(lambda: store.create(ROOT_INO, b"a", REG, 0, 0, layout_for=pick)) == \
        errno.EEXIST
    assert store.groups_lost == 0
    e = store.engine

    def change() -> None:
        store.write_fields(store.get(a.ino), {"uid": 7})
        e.put("dentries", {"id": e.next_id("dentry"), "parent": ROOT_INO, "name": b"a",
                           "ino": a.ino})  # (parent, name) is taken: a bug, say

    assert errno_of(lambda: store.txn(change)) == errno.EEXIST
    store.durable()
    rows = fresh(where)
    assert store.groups_lost == (e.kind == "postgresql")  # (SQLite keeps savepoints)
    if store.groups_lost:  # the group went: a's create with it, in memory too
        assert errno_of(lambda: store.lookup(ROOT_INO, b"a")) == errno.ENOENT
        assert names(rows, ROOT_INO) == []
    else:
        assert store.lookup(ROOT_INO, b"a").uid == 0 and rows.lookup(ROOT_INO, b"a").uid == 0
    rows.close()
    assert_sound(store)


def test_a_sole_writer_keeps_count_of_its_inodes(store: MetaStore, where: str) -> None:
    """statfs asks for the inode count, and a count is a scan of every row: a sole
    writer counts once and keeps count through changes, failed ones included."""
    store.group_changes(3600)
    start = store.count_inodes()
    files = [store.create(ROOT_INO, b"f%d" % i, REG, 0, 0, layout_for=pick)
             for i in range(5)]
    store.create(ROOT_INO, b"d", DIR, 0, 0)
    assert errno_of(lambda: store.create(ROOT_INO, b"f0", REG, 0, 0, layout_for=pick)) == \
        errno.EEXIST

    def made_then_failed() -> None:
        store.create(ROOT_INO, b"gone", REG, 0, 0, layout_for=pick)
        raise OSError(errno.EIO, "the change fails after making an inode")

    store.durable()  # (without savepoints the failure takes its group with it)
    assert errno_of(lambda: store.txn(made_then_failed)) == errno.EIO
    store.unlink(ROOT_INO, b"f0")
    store.unlink(ROOT_INO, b"f1")
    store.drop_inodes([files[0].ino, files[1].ino, files[0].ino])
    h = store.create_hidden(ROOT_INO, REG, 0, 0, pick)
    assert store.count_inodes() == start + 5
    store.durable()
    other = fresh(where)
    assert other.count_inodes() == start + 5 and other.inode_exists(h.ino)
    other.close()


def _tally(store: MetaStore) -> tuple[dict[int, int], ...]:
    usage = store.count_usage()
    return ({u: n for u, n in usage.bytes.items() if n},
            {u: n for u, n in usage.inodes.items() if n},
            {u: n for u, n in usage.xattrs.items() if n},
            {u: n for u, n in usage.names.items() if n})


def test_a_sole_writers_tally_of_bytes_and_inodes_by_uid_follows_every_change(
        store: MetaStore, where: str) -> None:
    """Quotas charge what a uid owns: the tally, counted once, is moved by each change
    (sizes held in memory, chowns, failed changes put back, reclaims, publishes, KV
    chunks stored and removed) and always equals a count of the rows made afresh by
    another connection.  A file holding any byte is charged a BLOCK at least, and a KV
    chunk's key its writer."""
    store.group_changes(3600)
    store.count_usage()

    def pair(uid: int) -> int:
        return uid // 2

    first = store.count_usage().grouped(pair, 1)  # (kept by group as it moves: quotas)

    def agrees() -> None:
        store.flush_all()
        store.durable()
        other = fresh(where)
        assert _tally(other) == _tally(store)
        other.close()
        usage = store.count_usage()
        groups = usage.grouped(pair, 1)
        assert groups is first or store.groups_lost  # (moved, never grouped again)
        want: dict[int, tuple[int, int, int, int]] = {}
        for uid in usage.uids():
            b, i, x, n = want.get(pair(uid), (0, 0, 0, 0))
            want[pair(uid)] = (b + usage.bytes[uid], i + usage.inodes[uid],
                               x + usage.xattrs[uid], n + usage.names[uid])
        got = {k: (g.bytes, g.inodes, g.xattrs, g.names) for k, g in groups.items()
               if (g.bytes, g.inodes, g.xattrs, g.names) != (0, 0, 0, 0)}
        assert got == {k: v for k, v in want.items() if v != (0, 0, 0, 0)}

    a = store.create(ROOT_INO, b"a", REG, 7, 7, layout_for=pick)
    b = store.create(ROOT_INO, b"b", REG, 8, 8, layout_for=pick)
    d = store.create(ROOT_INO, b"d", DIR, 7, 7)
    store.touch(a, size=5000)  # a write past the end: memory first
    assert store.usage.bytes[7] == 5000 and store.usage.inodes[7] == 2
    # A name costs its directory's owner, whoever's file it names (hard links too);
    # a link's target is its owner's bytes.
    assert store.usage.names[0] == 3 * (1 + NAME_ROW) and store.usage.names[7] == 0
    store.link(b.ino, d.ino, b"b-too")  # (8's file, named in 7's folder: 7's cost)
    store.rename(d.ino, b"b-too", d.ino, b"b-also")
    assert store.usage.names[7] == len(b"b-also") + NAME_ROW and store.usage.names[8] == 0
    store.rename(d.ino, b"b-also", ROOT_INO, b"b-moved")  # (out of it: root's now)
    assert store.usage.names[7] == 0
    assert store.usage.names[0] == 3 * (1 + NAME_ROW) + len(b"b-moved") + NAME_ROW
    store.rename(ROOT_INO, b"b-moved", d.ino, b"b-also")
    store.link(a.ino, d.ino, b"a-too")
    in_d = len(b"b-also") + len(b"a-too") + 2 * NAME_ROW
    store.create(ROOT_INO, b"ln", stat.S_IFLNK | 0o777, 10, 10, target=b"t" * 100)
    assert store.usage.bytes[10] == 100 and store.usage.owned_bytes(10) == 100
    store.resize(b, 300)  # (charged a BLOCK: what its chunk file takes of a member)
    assert store.usage.bytes[8] == BLOCK
    store.setxattr(a, b"user.x", b"v" * 100)
    store.setxattr(a, b"user.x", b"v" * 40)  # replaced: charged the difference
    store.setxattr(a, b"user.y", b"w" * 10)
    assert store.removexattr(a, b"user.y") and not store.removexattr(a, b"user.y")
    assert store.usage.xattrs[7] == len(b"user.x") + 40 + NAME_ROW  # (a row each)
    agrees()
    store.set_attrs(a, uid=8)  # chown moves the file's bytes, inode and xattrs
    assert store.usage.bytes[7] == 0 and store.usage.bytes[8] == 5000 + BLOCK
    assert store.usage.xattrs[7] == 0 and store.usage.xattrs[8] == 46 + NAME_ROW
    assert store.usage.names[7] == in_d and store.usage.names[8] == 0  # (not names)
    store.set_attrs(d, uid=9)  # a folder's chown moves the names in it
    assert store.usage.names[7] == 0 and store.usage.names[9] == in_d
    agrees()
    store.unlink(d.ino, b"a-too")  # (a name removed: its folder's owner credited)
    store.unlink(d.ino, b"b-also")
    assert store.usage.names[9] == 0
    assert errno_of(lambda: store.create(ROOT_INO, b"a", REG, 7, 7, layout_for=pick)) == \
        errno.EEXIST

    def grew_then_failed() -> None:
        store.write_fields(store.get(b.ino), {"size": 1 << 30})
        store.setxattr(store.get(b.ino), b"user.big", b"z" * 1000)
        store.create(ROOT_INO, b"gone", REG, 9, 9, layout_for=pick)
        raise OSError(errno.EIO, "the change fails after growing a file and making one")

    store.durable()
    assert errno_of(lambda: store.txn(grew_then_failed)) == errno.EIO
    assert _tally(store)[0].get(9) is None and store.usage.bytes[8] == 5000 + BLOCK
    agrees()
    h = store.create_hidden(ROOT_INO, REG, 9, 9, pick)
    store.publish(h.ino, ROOT_INO, b"h", replace=False, size=777, sum_unit=4096,
                  sums=b"\0" * 8)
    k = store.create_hidden(ROOT_INO, REG, 7, 7, pick)
    store.kv.publish(k.ino, "ns", b"key" * 300, 1, 0, 4096, b"\0" * 8)
    key = len("ns") + 900 + NAME_ROW  # (its writer's, as a name is its folder's owner's)
    assert store.usage.bytes[9] == BLOCK and store.usage.bytes[7] == BLOCK
    assert store.usage.names[7] == key
    agrees()
    store.set_attrs(k, uid=10)  # (a chown moves the key with the chunk)
    assert store.usage.names[7] == 0 and store.usage.names[10] == key
    agrees()

    def stored_then_failed() -> None:
        store.kv.remove([("ns", b"key" * 300, k.ino)])
        raise OSError(errno.EIO, "the change fails after removing a chunk")

    store.durable()
    assert errno_of(lambda: store.txn(stored_then_failed)) == errno.EIO
    assert _tally(store)[3][10] == key
    store.kv.remove([("ns", b"key" * 300, k.ino)])  # (an orphan's bytes count till freed)
    assert store.usage.names[10] == 0 and store.usage.bytes[10] == 100 + BLOCK
    agrees()
    store.drop_inodes([k.ino])
    assert store.usage.bytes[10] == 100
    store.unlink(ROOT_INO, b"a")  # an orphan still counts until it is reclaimed
    assert store.usage.bytes[8] == 5000 + BLOCK
    store.drop_inodes([a.ino])
    store.unlink(ROOT_INO, b"b")
    store.forget(b.ino)  # (the rows answer for an inode memory no longer holds)
    assert b.ino not in store._cache
    store.drop_inodes([b.ino])
    assert 8 not in store.usage.bytes and 8 not in store.usage.inodes
    assert 8 not in store.usage.xattrs  # (a's went with it)
    agrees()
    assert store.usage.counted or store.groups_lost  # kept, not counted again


def test_a_store_made_readonly_still_ends_its_group(store: MetaStore, where: str) -> None:
    """A daemon whose lease another host took refuses changes from then on (the engine
    made read-only); the directory times its group held are not written then, and the
    group still ends (at unmount, say) instead of failing with EROFS."""
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    store.durable()
    store.group_changes(3600)
    store.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
    store.engine.readonly = True
    store.commit()
    assert errno_of(lambda: store.create(d.ino, b"g", REG, 0, 0, layout_for=pick)) == \
        errno.EROFS
    store.engine.readonly = False
    other = fresh(where)
    assert names(other, d.ino) == [b"f"]
    other.close()


def test_get_many_reads_rows_by_key_in_few_statements(store: MetaStore, where: str) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    store.group_changes(3600)
    files = [store.create(d.ino, b"f%d" % i, REG, 0, 0, layout_for=pick) for i in range(1100)]
    store.durable()
    e = store.engine
    inos = [f.ino for f in files]
    want = {f.ino: e.get("inodes", {"ino": f.ino}, ("ino", "mode", "nlink")) for f in files}
    got = e.get_many("inodes", "ino", [*inos, inos[3], 10**12], ("ino", "mode", "nlink"))
    assert sorted(got) == sorted(want.values())
    assert e.get_many("inodes", "ino", [], ("ino",)) == []
    assert e.get_many("dentries", "ino", [files[5].ino], ("name",)) == [(b"f5",)]
    assert e.get_many("inodes", "ino", [10**12], ("ino",)) == []
    # ... and only rows matching `where` besides (the keys bind before it)
    names = [b"f%d" % i for i in range(1100)] + [b"nope"]
    assert len(e.get_many("dentries", "name", names, ("ino",), {"parent": d.ino})) == 1100
    assert e.get_many("dentries", "name", names, ("ino",), {"parent": ROOT_INO}) == []
    if where.startswith("postgresql://"):
        assert_keys_are_index_probes(where)
    # readdir of a store that caches nothing reads the inodes that way
    other = fresh(where)
    listed = []
    after = 0
    while entries := other.readdir(d.ino, after):
        listed += [(x.name, x.inode) for x in entries]
        after = entries[-1].cookie
    assert listed == [(b"f%d" % i, files[i]) for i in range(1100)]
    other.close()


def test_lengths_are_added_up_by_the_store(store: MetaStore) -> None:
    """An xattr's bytes are counted where it is stored: a removed file's 256 KiB of
    them was read into the daemon's memory to be counted."""
    a = store.create(ROOT_INO, b"a", REG, 0, 0, layout_for=pick)
    b = store.create(ROOT_INO, b"b", REG, 0, 0, layout_for=pick)
    c = store.create(ROOT_INO, b"c", REG, 0, 0, layout_for=pick)
    store.setxattr(a, b"user.x", b"v" * 1000)
    store.setxattr(a, b"user.yy", b"\0" * 10)
    store.setxattr(b, b"user.z", b"")
    store.durable()
    e = store.engine
    measured = ("name", "value")
    assert e.lengths("xattrs", "ino", measured, [a.ino, b.ino, c.ino, a.ino]) == {
        a.ino: 6 + 1000 + 7 + 10, b.ino: 6}
    assert e.lengths("xattrs", "ino", measured, []) == {}
    assert e.lengths("xattrs", "ino", measured) == {a.ino: 1023, b.ino: 6}


def assert_keys_are_index_probes(url: str) -> None:
    """A lookup of 128 keys (a bite) in a KV namespace of 20,000 rows, before any statistics
    were gathered (a namespace that grew since): each key one probe of the index, not
    every row of the namespace read and filtered."""
    import psycopg

    from mxfs.meta import sql
    text = sql.statement(sql.POSTGRES, ("get_many", "kv", "key", ("key", "ino"), 0, ("ns",)))
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("INSERT INTO kv(ns, key, ino, size, atime) SELECT 'big', "
                   "decode(md5(i::text), 'hex'), i, 1, 0 FROM generate_series(1, 20000) i")
        keys = [os.urandom(16) for _ in range(127)] + [bytes.fromhex(hashlib.md5(b"7").hexdigest())]
        assert db.execute(text, (keys, "big")).fetchall() == [(keys[-1], 7)]
        plan = "\n".join(r[0] for r in db.execute("EXPLAIN ANALYZE " + text, (keys, "big")))
        db.execute("DELETE FROM kv WHERE ns = 'big'")
    assert "Index" in plan and "Seq Scan" not in plan and "Removed by Filter" not in plan, \
        plan[:200]


def test_values_an_engine_cannot_hold_are_eoverflow(store: MetaStore) -> None:
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    store.group_changes(3600)
    g = store.create(ROOT_INO, b"g", REG, 0, 0, layout_for=pick)
    assert errno_of(lambda: store.set_attrs(f, uid=1 << 64)) == errno.EOVERFLOW
    assert errno_of(lambda: store.set_attrs(f, mtime_ns=-(1 << 63) - 1)) == errno.EOVERFLOW
    assert store.get(f.ino).uid == 0
    assert store.groups_lost == 0 and store.lookup(ROOT_INO, b"g") is g  # (refused early)


def test_a_readonly_store_refuses_changes(store: MetaStore, where: str) -> None:
    ro = fresh(where)
    assert errno_of(lambda: ro.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)) == \
        errno.EROFS
    ro.close()


def test_what_is_not_a_store_is_unusable(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Unusable):
        MetaStore.open(str(empty))
    (empty / "mxfs.db").write_bytes(b"not a database" * 100)
    with pytest.raises(Unusable):
        MetaStore.open(str(empty))


# ---- grouped changes ----------------------------------------------------------------


def test_grouped_changes_are_seen_by_others_only_once_committed(store: MetaStore,
                                                                where: str) -> None:
    store.group_changes(3600)
    store.create(ROOT_INO, b"g", REG, 0, 0, layout_for=pick)
    assert store.lookup(ROOT_INO, b"g").nlink == 1  # its own change, seen at once
    other = fresh(where)
    assert errno_of(lambda: other.lookup(ROOT_INO, b"g")) == errno.ENOENT
    store.commit_if_due()  # not due yet
    assert errno_of(lambda: other.lookup(ROOT_INO, b"g")) == errno.ENOENT
    store.durable()
    assert other.lookup(ROOT_INO, b"g").nlink == 1
    other.close()


# ---- two connections ---------------------------------------------------------------


def _counter(engine: Engine) -> int:
    row = engine.get("settings", {"key": "counter"}, ("value",))
    return int(row[0]) if row else 0


def _bump(engine: Engine) -> None:
    engine.upsert("settings", {"key": "counter", "value": str(_counter(engine) + 1)})


def test_two_connections_conflict_and_run_their_changes_again(store: MetaStore,
                                                              where: str) -> None:
    engines = [impatient(where), impatient(where)]
    tries = [0, 0]

    def work(i: int) -> None:
        def change() -> None:
            tries[i] += 1
            _bump(engines[i])
            time.sleep(0.001)  # hold the change open a moment: the other one waits
        for _ in range(100):
            engines[i].txn(change)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _counter(store.engine) == 200  # no update was lost
    assert sum(tries) >= 200
    for e in engines:
        e.close()


def test_a_change_waits_for_another_writers_group(store: MetaStore, where: str) -> None:
    store.group_changes(3600)
    store.txn(lambda: _bump(store.engine))  # an open group holds the store
    second = impatient(where)
    done = threading.Event()

    def later() -> None:
        second.txn(lambda: _bump(second))
        done.set()

    t = threading.Thread(target=later)
    t.start()
    time.sleep(0.3)
    assert not done.is_set()  # conflicting: it runs again until the group ends
    store.commit()
    t.join(10)
    assert done.is_set() and _counter(second) == 2
    second.close()


def test_a_change_the_server_cancels_while_it_waits_runs_again(store: MetaStore,
                                                               where: str) -> None:
    """A change waiting for another writer's row lock is cancelled by the server (an
    operator's pg_cancel_backend here; PostgreSQL reports a lock_timeout that fires as
    the lock is granted the same way, 57014, seen in CI with a 1 ms timeout): it runs
    again once the other writer's group ends, where it failed EIO and its update was
    lost."""
    if not where.startswith("postgresql://"):
        pytest.skip("a server's cancel of a statement")
    import psycopg

    from mxfs.meta.pg_engine import PgEngine
    store.group_changes(3600)
    store.txn(lambda: _bump(store.engine))  # an open group holds the row
    second = PgEngine.open(where, busy_ms=30_000)
    pid = second.conn.info.backend_pid
    failed: list[int] = []
    done = threading.Event()

    def later() -> None:
        try:
            second.txn(lambda: _bump(second))
            done.set()
        except OSError as e:
            failed.append(e.errno or 0)

    t = threading.Thread(target=later)
    t.start()
    with psycopg.connect(where, autocommit=True) as admin:
        def waiting() -> bool:
            row = admin.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                [pid]).fetchone()
            return row is not None and row[0] == "Lock"
        assert eventually(waiting, 10)
        admin.execute("SELECT pg_cancel_backend(%s)", [pid])
        assert eventually(waiting, 10)  # (waiting again: run again, not failed)
    assert not failed and not done.is_set()
    store.commit()
    t.join(10)
    assert done.is_set() and _counter(second) == 2
    second.close()


def test_a_read_outside_a_change_that_waits_out_a_lock_is_eagain(store: MetaStore,
                                                                 where: str) -> None:
    """A statement alone (no change, no group) that waits past busy_ms for a lock (a
    DBA's LOCK TABLE here) is EAGAIN, try again: it was a Conflict, which only a change
    runs again (anywhere else an internal error), and it marked the engine's next
    group as spent."""
    if not where.startswith("postgresql://"):
        pytest.skip("a server's table lock")
    import psycopg
    second = impatient(where)
    with psycopg.connect(where) as dba:
        dba.execute("LOCK TABLE settings IN ACCESS EXCLUSIVE MODE")
        assert errno_of(lambda: _counter(second)) == errno.EAGAIN
        dba.rollback()
    second.txn(lambda: _bump(second))
    assert _counter(second) == 1
    second.close()


def test_a_change_that_always_conflicts_gives_up_with_ebusy(store: MetaStore,
                                                            where: str) -> None:
    store.group_changes(3600)
    store.txn(lambda: _bump(store.engine))
    second = impatient(where)
    assert errno_of(lambda: second.txn(lambda: _bump(second))) == errno.EBUSY
    store.commit()
    second.close()


# ---- crash safety ---------------------------------------------------------------------

# A child process sets a store up (durably), then runs one change, SIGKILLed at the
# `cut`-th call of the change to a write primitive or to commit ("mid": the change
# must be gone), or at its sync ("committed": it must be whole); cut 0 runs it through.
_CHILD = r"""
import sys, time
from mxfs.meta import MetaStore, ROOT_INO
where, op, cut = sys.argv[1], sys.argv[2], int(sys.argv[3])
pick = lambda ino, u, w: (u or 1 << 20, w or 4, ino % 4)
s = MetaStore.open(where)
REG, DIR = 0o100644, 0o40755
d = s.create(ROOT_INO, b"d", DIR, 0, 0)
f = s.create(d.ino, b"f", REG, 0, 0, layout_for=pick)
s.create(ROOT_INO, b"e", DIR, 0, 0)
s.create(ROOT_INO, b"g", REG, 0, 0, layout_for=pick)
h = s.create_hidden(d.ino, 0o644, 0, 0, pick)
k = s.create_hidden(ROOT_INO, 0o600, 0, 0, pick)
s.kv.set_namespace("ns", 0, 0, 0o700, 0)
s.kv.publish(k.ino, "ns", b"old", 10, 1, 4096, b"12345678")
s.setxattr(f, b"user.x", b"1")
s.durable()
if op == "none":
    sys.exit(0)
calls = 0
eng = s.engine
def cutting(real, say):
    def call(*a, **kw):
        global calls
        if real.__name__ == "commit" and eng.group_age() is None:
            return real(*a, **kw)  # nothing open: nothing to cut
        calls += 1
        if calls == cut or (say == "committed" and cut):
            print(say, flush=True)
            time.sleep(60)
        return real(*a, **kw)
    return call
for name in ("insert", "upsert", "update", "update_many", "delete", "next_id", "commit"):
    setattr(eng, name, cutting(getattr(eng, name), "mid"))
eng.sync = cutting(eng.sync, "committed")
ops = {
    "create": lambda: s.create(d.ino, b"new", REG, 0, 0, layout_for=pick),
    "mkdir": lambda: s.create(d.ino, b"newdir", DIR, 0, 0),
    "link": lambda: s.link(f.ino, ROOT_INO, b"f2"),
    "unlink": lambda: s.unlink(d.ino, b"f"),
    "rmdir": lambda: s.rmdir(ROOT_INO, b"e"),
    "rename": lambda: s.rename(d.ino, b"f", ROOT_INO, b"g"),
    "rename_dir": lambda: s.rename(ROOT_INO, b"e", d.ino, b"e2"),
    "exchange": lambda: s.rename(ROOT_INO, b"e", d.ino, b"f", exchange=True),
    "publish": lambda: s.publish(h.ino, ROOT_INO, b"g", replace=True, size=3, sum_unit=4096,
                                 sums=b"abcdefgh"),
    "setxattr": lambda: s.setxattr(f, b"user.x", b"2"),
    "set_attrs": lambda: s.set_attrs(f, mode=0o100600, uid=9, gid=9),
    "kv_publish": lambda: s.kv.publish(h.ino, "ns", b"new", 5, 2, 4096, b"abcdefgh"),
    "kv_remove": lambda: s.kv.remove([("ns", b"old", k.ino)]),
    "drop_inodes": lambda: s.drop_inodes([h.ino]),
}
ops[op]()
s.durable()
print("done", flush=True)
time.sleep(60)
"""

_CRASH_OPS = ["create", "mkdir", "link", "unlink", "rmdir", "rename", "rename_dir",
              "exchange", "publish", "setxattr", "set_attrs", "kv_publish", "kv_remove",
              "drop_inodes"]


def _state(where: str) -> dict[str, list[str]]:
    """Every row, times aside (they differ from run to run)."""
    s = MetaStore.open(where, readonly=True)
    try:
        out = {}
        for t in TABLES.values():
            cols = [c for c in t.names if not c.endswith("time_ns")]
            out[t.name] = sorted(map(repr, s.engine.scan(t.name, cols)))
        assert_sound(s)
        return out
    finally:
        s.close()


def _run(where: str, op: str, cut: int) -> str:
    """A fresh store, the child run on it and killed; what it said when it was."""
    MetaStore.format(where, UUID, UNIT).close()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, where, op, str(cut)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    said = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return said


@pytest.mark.parametrize("op", _CRASH_OPS)
def test_a_change_killed_midway_leaves_the_old_state_or_the_new(where: str, op: str) -> None:
    _run(where, "none", 0)
    old = _state(where)
    assert _run(where, op, 0) == "done"
    new = _state(where)
    assert new != old
    for cut in range(1, 30):
        said = _run(where, op, cut)
        if said == "committed":
            assert _state(where) == new, f"{op}: committed, yet not whole"
            break
        assert said == "mid"
        assert _state(where) == old, f"{op}: killed at write {cut}, part of it was kept"
    else:
        raise AssertionError(f"{op}: more than 30 writes")


def test_grouped_changes_survive_a_crash_as_a_prefix(where: str) -> None:
    """Killed while grouping: the store holds the first k changes for some k, whole."""
    MetaStore.format(where, UUID, UNIT).close()
    child = r"""
import sys
from mxfs.meta import MetaStore, ROOT_INO
s = MetaStore.open(sys.argv[1])
s.group_changes(0.005)
pick = lambda ino, u, w: (u or 1 << 20, w or 4, ino % 4)
for i in range(100000):
    d = s.create(ROOT_INO, b"d%06d" % i, 0o40755, 0, 0)
    s.create(d.ino, b"f", 0o100644, 0, 0, layout_for=pick)
    s.commit_if_due()
    if i % 50 == 0:
        s.durable()
        print(i, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", child, where], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    for _ in range(6):
        durable = int(proc.stdout.readline())
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    s = MetaStore.open(where, readonly=True)
    try:
        got = names(s, ROOT_INO)
        assert got == [b"d%06d" % i for i in range(len(got))]  # a prefix, in order
        assert len(got) > durable  # everything made durable is there
        assert_sound(s)
    finally:
        s.close()


# ---- every engine's rows hold what the rules wrote -----------------------------------


def test_the_invariant_check_finds_each_kind_of_damage(store: MetaStore) -> None:
    d = store.create(ROOT_INO, b"d", DIR, 0, 0)
    f = store.create(ROOT_INO, b"f", REG, 0, 0, layout_for=pick)
    g = store.create(ROOT_INO, b"g", REG, 0, 0, layout_for=pick)
    k = store.create_hidden(ROOT_INO, 0o600, 0, 0, pick)
    store.kv.publish(k.ino, "ns", b"key", 1, 1, UNIT, b"")
    assert_sound(store)
    e = store.engine

    def hurt() -> None:
        e.delete("dentries", {"parent": ROOT_INO, "name": b"f"})  # f unreachable
        e.update("inodes", {"ino": g.ino}, {"nlink": 3})  # a wrong link count
        e.update("inodes", {"ino": d.ino}, {"nlink": 7})  # a wrong directory link count
        e.insert("dentries", {"id": e.next_id("dentry"), "parent": ROOT_INO,
                              "name": b"ghost", "ino": 999_999})
        e.insert("dentries", {"id": e.next_id("dentry"), "parent": g.ino, "name": b"in",
                              "ino": d.ino})
        e.insert("kv", {"ns": "ns", "key": b"lost", "ino": 888_888, "size": 1, "atime": 1})
    store.txn(hurt)
    kinds = {(p.kind, p.ino) for p in meta_check.problems(store)}
    assert kinds >= {(meta_check.UNREACHABLE, f.ino), (meta_check.LINK_COUNT, g.ino),
                     (meta_check.DIR_LINK_COUNT, d.ino), (meta_check.DANGLING_ENTRY, 999_999),
                     (meta_check.PARENT_NOT_DIR, d.ino), (meta_check.DANGLING_KV, 888_888)}


def test_two_writers_one_after_another_keep_a_directorys_link_count(where: str) -> None:
    """Two stores writing the same rows in turn, never at once (so no conflict tells
    either): each change reads what it writes from the rows, not from what the store
    cached before the other's commit (a directory's link count was lost so, now and
    then, in the two-process storm of test_meta_pg_faults)."""
    a = MetaStore.format(where, UUID, UNIT)
    b = MetaStore.open(where)
    try:
        shared = a.create(ROOT_INO, b"shared", 0o040755, 0, 0).ino
        a.create(shared, b"a1", 0o040755, 0, 0)  # (a caches the directory: 3 links)
        b.create(shared, b"b1", 0o040755, 0, 0)
        a.create(shared, b"a2", 0o040755, 0, 0)
        b.rmdir(shared, b"b1")
        a.create(shared, b"f", 0o100644, 0, 0, layout_for=pick)
        with contextlib.closing(fresh(where)) as rows:
            assert rows.get(shared).nlink == 2 + 2  # a1 and a2
            assert sorted(names(rows, shared)) == [b"a1", b"a2", b"f"]
    finally:
        a.close()
        b.close()

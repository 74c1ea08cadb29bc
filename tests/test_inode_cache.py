"""The metadata store's memory and bounds (mxfs.meta.store, mxfs.meta.sole_cache) on a
real pool: what a handle holds open stays the store's own object however many inodes
are read, a file's links are bounded, and a full name cache keeps the inode count."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import make_members, mkfs

from mxfs.meta import ROOT_INO, inode_cache
from mxfs.meta import store as meta_store
from mxfs.vol.volume import Volume

ALICE = 1000


@contextmanager
def _volume(tmp_path: Path, sole: bool | None = None) -> Iterator[Volume]:
    """A fresh pool of two folder members, opened (its store the sole writer's, or not)."""
    members = make_members(tmp_path, 2)
    mkfs(members)
    v = Volume.open(members[0])
    if sole is not None:
        v.store.sole_writer(sole)
    try:
        yield v
    finally:
        v.store.close()


@pytest.fixture
def vol(tmp_path: Path) -> Iterator[Volume]:
    with _volume(tmp_path) as v:
        yield v


def test_an_inode_held_open_stays_one_object_past_the_cache_limit(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store forgets clean inodes when memory holds too many; one held open (its
    handle holds the object) must stay the store's own, or a truncate by name went to a
    copy while the handle wrote its old size back, and an unlink was never seen by the
    handle's last close (its space and its owner's quota kept until remount)."""
    monkeypatch.setattr(meta_store, "_CACHE_LIMIT", 50)
    store = vol.store
    held = store.create(ROOT_INO, b"held", stat.S_IFREG | 0o644, ALICE, ALICE,
                        layout_for=vol.pick_layout)
    entry = vol.acquire(held)
    others = [store.create(ROOT_INO, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0,
                           layout_for=vol.pick_layout).ino for i in range(200)]
    store.commit()
    for ino in others:
        store.forget(ino)
    for ino in others:  # (read again: past the limit, clean inodes forgotten)
        store.get(ino)
    assert store.get(held.ino) is entry.node
    store.unlink(ROOT_INO, b"held")
    assert entry.node.nlink == 0  # (the handle sees it: its last close reclaims it)
    vol.release(held.ino)


LIMIT, SLACK, BITE = 50, 8, 8  # (a test bound, what it may run past, frees at most a read)


def _files(vol: Volume, n: int, prefix: bytes = b"f") -> list[int]:
    store = vol.store
    inos = [store.create(ROOT_INO, prefix + b"%d" % i, stat.S_IFREG | 0o644, ALICE, ALICE,
                         layout_for=vol.pick_layout).ino for i in range(n)]
    store.commit()
    for ino in inos:
        store.forget(ino)
    return inos


@pytest.mark.parametrize("sole", [True, False])
def test_memory_past_its_limit_lets_inodes_go_a_few_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sole: bool) -> None:
    """Past its limit the store lets the least recently used clean inodes go a few for
    each one read in, never those held open or with unsaved changes: one pass over all
    of them at the limit held the daemon's one thread 160-240 ms for 200,000 inodes,
    and any user's walk of her tree (find, ls -l, a readdir) came back to it."""
    monkeypatch.setattr(meta_store, "_CACHE_LIMIT", LIMIT)
    with _volume(tmp_path, sole) as vol:
        store = vol.store
        held = store.create(ROOT_INO, b"held", stat.S_IFREG | 0o644, ALICE, ALICE,
                            layout_for=vol.pick_layout)
        entry = vol.acquire(held)
        dirty = store.create(ROOT_INO, b"dirty", stat.S_IFREG | 0o644, ALICE, ALICE,
                             layout_for=vol.pick_layout)
        store.commit()
        store.touch(dirty, size=12345)  # (in memory alone until flushed)
        inos = _files(vol, 4 * LIMIT)
        was = {ino: (store.get(ino).mode, store.get(ino).uid) for ino in inos[:3]}
        for ino in inos[:3]:
            store.forget(ino)
        for ino in inos:
            before = len(store._cache)
            store.get(ino)
            after = len(store._cache)
            assert after <= LIMIT + SLACK, "memory ran past its limit"
            assert before + 1 - after <= BITE, f"one read let {before + 1 - after} go"
        assert inos[0] not in store._cache  # (the least recently used went)
        assert store.get(held.ino) is entry.node and store.get(dirty.ino) is dirty
        assert dirty.size == 12345 and dirty.dirty
        for ino, (mode, uid) in was.items():  # (read again from the rows)
            node = store.get(ino)
            assert (node.ino, node.mode, node.uid) == (ino, mode, uid)
        for ino in inos:
            store.forget(ino)
        more = _files(vol, 2 * LIMIT, b"g")
        entries = store.readdir(ROOT_INO, 0)  # (read in one go: `_load`)
        assert {e.inode.ino for e in entries} >= set(more)
        assert len(store._cache) <= LIMIT + SLACK
        assert store.get(held.ino) is entry.node and store.get(dirty.ino) is dirty
        store.unlink(ROOT_INO, b"held")
        assert entry.node.nlink == 0
        vol.release(held.ino)
        store.flush(dirty)


def _targets_held(store: Any) -> int:
    return _targets_held_in(store._cache)


@pytest.mark.parametrize("sole", [True, False])
def test_symlink_targets_in_memory_are_bounded_by_their_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sole: bool) -> None:
    """A symlink's target is up to 4 KiB: a tenant's 200,000 of them, each read once,
    held 800 MiB of the daemon everyone shares while memory counted inodes alone.  Past
    its bytes the least recently used go as past its count; what went reads back from
    the rows, and the count of bytes held stays that of the targets held."""
    monkeypatch.setattr(inode_cache, "TARGET_BYTES", 64 * 4000)
    with _volume(tmp_path, sole) as vol:
        store = vol.store
        targets = {}
        for i in range(300):
            target = (b"t%03d/" % i) * 800  # (4,000 bytes)
            node = store.create(ROOT_INO, b"s%d" % i, stat.S_IFLNK | 0o777, ALICE, ALICE,
                                target=target)
            targets[node.ino] = target
            assert _targets_held(store) <= 64 * 4000, "memory ran past its bytes"
        store.commit()
        plain = _files(vol, 20)
        for ino in list(targets) + plain:
            store.forget(ino)
        for ino, target in targets.items():
            assert store.get(ino).target == target
            assert _targets_held(store) <= 64 * 4000
            assert store._cache.target_bytes == _targets_held(store)
        assert len(store._cache) < 100  # (their count alone let all 300 stay)
        assert next(iter(targets)) not in store._cache  # (the least recently used went)
        for ino in targets:
            store.forget(ino)
        entries = store.readdir(ROOT_INO, 0)  # (read in one go: `_load`)
        assert {e.inode.ino: e.inode.target for e in entries if e.inode.target} == targets
        assert _targets_held(store) <= 64 * 4000
        assert store._cache.target_bytes == _targets_held(store)
        store.unlink(ROOT_INO, b"s0")
        store.commit()


def test_an_inode_let_go_of_in_a_failed_change_is_put_back(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """An inode a change wrote, let go of from memory during the change and read
    again from the rows the change wrote, is put back with the change: the copy read
    again answered (the sole writer answers from memory) what the rows no longer hold."""
    import errno

    store = vol.store
    store.sole_writer(True)
    monkeypatch.setattr(meta_store, "_CACHE_LIMIT", LIMIT)
    target = store.create(ROOT_INO, b"t", stat.S_IFREG | 0o644, ALICE, ALICE,
                          layout_for=vol.pick_layout).ino
    inos = _files(vol, 2 * LIMIT)
    store.forget(target)
    again = []

    def change() -> None:
        node = store.get(target)
        store.write_fields(node, {"mode": stat.S_IFREG | 0o600})
        for ino in inos:
            store.get(ino)
        copy = store.get(target)
        again.append((copy is node, copy.mode))
        raise OSError(errno.EIO, "failed on purpose")

    with pytest.raises(OSError):
        store.txn(change)
    # (let go of, and read again from the change's rows: another object)
    assert again[-1] == (False, stat.S_IFREG | 0o600)
    assert store.get(target).mode == stat.S_IFREG | 0o644


def test_a_file_takes_at_most_link_max_names(vol: Volume,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Hard links cost no quota (as on ext4), so they are bounded per file as ext4
    bounds them: EMLINK past LINK_MAX (100,000 links of one file filled the store)."""
    import errno

    monkeypatch.setattr(meta_store, "LINK_MAX", 3)
    store = vol.store
    f = store.create(ROOT_INO, b"f", stat.S_IFREG | 0o644, ALICE, ALICE,
                     layout_for=vol.pick_layout)
    store.link(f.ino, ROOT_INO, b"g")
    store.link(f.ino, ROOT_INO, b"h")
    with pytest.raises(OSError) as e:
        store.link(f.ino, ROOT_INO, b"i")
    assert e.value.errno == errno.EMLINK and f.nlink == 3


def test_a_full_name_cache_keeps_the_inode_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Looking up names past the cache's limit drops the names, not the inode count
    (whose recount scans every row, at the next statfs or scrape)."""
    from mxfs.meta import sole_cache

    monkeypatch.setattr(sole_cache, "LIMIT", 10)
    cache = sole_cache.SoleCache()
    cache.on = True
    cache.inodes = 1234
    for i in range(25):
        cache.set_name((1, b"n%d" % i), None, in_change=False)
    assert cache.inodes == 1234 and len(cache.names) <= 10


def test_the_sole_writers_tables_let_the_least_recently_used_go_one_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Names, parents and seals past the limit: the least recently used goes, one for
    each learnt (each table was cleared whole at the limit, 18 ms of the daemon's one
    thread for 200,000 names, which 200,000 lookups of absent names brought back); a
    directory one of whose names went is no longer taken as complete."""
    from mxfs.meta import sole_cache

    monkeypatch.setattr(sole_cache, "LIMIT", 10)
    cache = sole_cache.SoleCache()
    cache.on = True
    cache.made_dir(7, ROOT_INO)  # (complete: a name it lacks is absent)
    cache.set_name((7, b"kept"), 70, in_change=False)
    cache.set_name((7, b"old"), 71, in_change=False)
    for table, learn in ((cache.names, lambda i: cache.set_name((1, b"n%d" % i), None,
                                                                in_change=False)),
                         (cache.parents, lambda i: cache.learn_parent(100 + i, 1)),
                         (cache.parents, lambda i: cache.set_parent(200 + i, 1)),
                         (cache.sealed, lambda i: cache.set_sealed(300 + i, True,
                                                                   in_change=False))):
        for i in range(25):
            before = len(table)
            learn(i)
            assert len(table) <= 10 and before + 1 - len(table) <= 1
            assert cache.name((7, b"kept"), in_change=False) == (True, 70)  # (used: kept)
            cache.parent(7, in_change=False)
    assert cache.parents.get(7) == ROOT_INO and (7, b"old") not in cache.names
    assert cache.name((7, b"old"), in_change=False) == (False, None)  # (not "absent")
    assert cache.name((1, b"n24"), in_change=False) == (True, None)


@pytest.mark.parametrize("sole", [True, False])
def test_a_renames_ancestry_walk_is_right_and_bounded(
        vol: Volume, monkeypatch: pytest.MonkeyPatch, sole: bool) -> None:
    """A directory moved into its own subtree is refused (EINVAL), as the kernel
    refuses it, with the sole writer's parents read from memory as they change (made,
    moved, swapped, removed); a walk past MAX_DEPTH levels is refused (ELOOP: a
    million-level chain held the thread at each rename into its deepest)."""
    import errno

    store = vol.store
    store.sole_writer(sole)

    def mkdir(parent: int, name: bytes) -> int:
        return store.create(parent, name, stat.S_IFDIR | 0o755, 0, 0).ino

    a = mkdir(ROOT_INO, b"a")
    b = mkdir(a, b"b")
    c = mkdir(b, b"c")
    with pytest.raises(OSError) as e:
        store.rename(ROOT_INO, b"a", c, b"a")
    assert e.value.errno == errno.EINVAL
    store.rename(b, b"c", ROOT_INO, b"c")  # (c now beside a: a may go into it)
    store.rename(ROOT_INO, b"a", c, b"a")
    with pytest.raises(OSError) as e:  # (c is a's parent now, b below a)
        store.rename(ROOT_INO, b"c", b, b"c")
    assert e.value.errno == errno.EINVAL
    x = mkdir(ROOT_INO, b"x")
    # Swapped: the top's "x" names b now, and a's "b" names x; then x goes into b.
    store.rename(ROOT_INO, b"x", a, b"b", exchange=True)
    with pytest.raises(OSError) as e:  # (a into x, which is below a now: a loop)
        store.rename(c, b"a", x, b"a")
    assert e.value.errno == errno.EINVAL
    store.rename(ROOT_INO, b"c", b, b"c")  # (b is at the top: c, holding a, goes in)
    store.rename(a, b"b", b, b"x")
    with pytest.raises(OSError) as e:  # (b into x, which is below b)
        store.rename(ROOT_INO, b"x", x, b"b")
    assert e.value.errno == errno.EINVAL
    store.rmdir(b, b"x")
    q, d = mkdir(ROOT_INO, b"q"), mkdir(ROOT_INO, b"d")
    store.rename(ROOT_INO, b"d", q, b"d")
    with pytest.raises(OSError) as e:  # (q into d, which is below q now)
        store.rename(ROOT_INO, b"q", d, b"q")
    assert e.value.errno == errno.EINVAL
    monkeypatch.setattr(meta_store, "MAX_DEPTH", 5)
    deep = ROOT_INO
    for i in range(8):
        deep = mkdir(deep, b"d%d" % i)
    asked = []  # (the rows of parents read)
    get = store.engine.get
    monkeypatch.setattr(store.engine, "get", lambda table, where, cols: asked.append(
        cols == ("parent",)) or get(table, where, cols))
    with pytest.raises(OSError) as e:
        store.rename(ROOT_INO, b"x", deep, b"b")
    assert e.value.errno == errno.ELOOP
    # The sole writer's walk ran once, from memory, and a failed change drops only the
    # parents it touched: each such rename walked twice, the second reading every level.
    assert sum(asked) == (0 if sole else 5)


def test_the_sole_writer_forgets_the_directories_removed(vol: Volume) -> None:
    """A removed directory leaves nothing of itself in the sole writer's memory: its
    mark as complete (every name cached) stayed, a user's mkdir and rmdir in a loop
    grew the daemon without bound (quota counts no removed directory)."""
    store = vol.store
    store.sole_writer(True)
    for i in range(1000):
        store.create(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0)
        store.rmdir(ROOT_INO, b"d")
        if i % 100 == 0:
            vol.drop_inodes(vol.take_pending() or [])
    vol.drop_inodes(vol.take_pending() or [])
    kept = store._sole  # (the sole writer's tables)
    assert len(kept.complete) <= 1 and len(kept.parents) <= 1


def test_removed_files_xattrs_are_freed_a_bite_a_round(vol: Volume,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A reclaim round's rows are deleted, and committed, on the daemon's one thread:
    removed files holding many xattr bytes are freed XATTR_BITE a round (one file at
    least), the rest in the rounds after, every one in the end."""
    from mxfs.vol import volume

    monkeypatch.setattr(volume, "XATTR_BITE", 250 << 10)
    store = vol.store
    inos = []
    for i in range(5):
        node = store.create(ROOT_INO, b"x%d" % i, stat.S_IFREG | 0o644, 0, 0,
                            layout_for=vol.pick_layout)
        store.setxattr(node, b"user.v", b"v" * (100 << 10))
        inos.append(node.ino)
        vol.unlinked(store.unlink(ROOT_INO, b"x%d" % i))
    rounds = []
    while taken := vol.take_pending():
        rounds.append(taken)
        vol.remove_chunks(taken)
        vol.drop_inodes(taken)
    assert [len(r) for r in rounds] == [2, 2, 1] and sum(rounds, []) == inos
    assert all(store.getxattr(ino, b"user.v") is None for ino in inos)


def test_removed_files_xattrs_are_summed_a_few_files_at_a_time(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round sums the xattr bytes of the removed files it may free, a few files past
    its bite at most: it summed every one of its 512 where a bite held a few, and the
    rest went back to be summed again the next round, and the next."""
    from mxfs.vol import volume

    monkeypatch.setattr(volume, "XATTR_BITE", 25 << 10)
    store = vol.store
    for i in range(100):
        node = store.create(ROOT_INO, b"x%d" % i, stat.S_IFREG | 0o644, 0, 0,
                            layout_for=vol.pick_layout)
        store.setxattr(node, b"user.v", b"v" * (10 << 10))
        vol.unlinked(store.unlink(ROOT_INO, b"x%d" % i))
    summed: list[int] = []
    lengths = store.engine.lengths

    def counted(table: str, key: str, columns: Any, keys: list[int], *more: Any) -> Any:
        if table == "xattrs":
            summed.append(len(keys))
        return lengths(table, key, columns, keys, *more)
    monkeypatch.setattr(store.engine, "lengths", counted)
    freed = 0
    while taken := vol.take_pending(512):
        freed += len(taken)
        vol.remove_chunks(taken)
        vol.drop_inodes(taken)
    assert freed == 100 and not store.orphans()
    assert max(summed) <= volume.LENGTHS_BITE, summed
    assert sum(summed) <= 100 + 50 * volume.LENGTHS_BITE  # (at most one part a round)


def test_removed_files_are_freed_by_owner_in_turn(vol: Volume) -> None:
    """One user's mass removal does not hold another's removed files behind it: alice's
    1,500 removed files and then bob's one, and bob's is freed in the first round (of
    512) with hers spread over the rounds (first come, first served: the third)."""
    store, bob = vol.store, ALICE + 1
    for i in range(1500):
        store.create(ROOT_INO, b"a%d" % i, stat.S_IFREG | 0o644, ALICE, ALICE,
                     layout_for=vol.pick_layout)
        vol.unlinked(store.unlink(ROOT_INO, b"a%d" % i))
    bobs = store.create(ROOT_INO, b"b", stat.S_IFREG | 0o644, bob, bob,
                        layout_for=vol.pick_layout).ino
    vol.unlinked(store.unlink(ROOT_INO, b"b"))
    rounds = []
    while taken := vol.take_pending(512):
        rounds.append(taken)
        vol.remove_chunks(taken)
        vol.drop_inodes(taken)
    assert bobs in rounds[0], [bobs in r for r in rounds]
    assert sum(map(len, rounds)) == 1501 and not store.orphans()


def test_a_failed_rename_into_a_deep_tree_keeps_the_ancestry_it_read(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sole writer's parents read from rows stand when the change reading them
    fails for a name (EEXIST): a tenant's failing renames into a 1,000-deep tree read
    every level's row, each (2 ms of the daemon's thread here, a round trip a level
    on a PostgreSQL writer), and so did the next rename of anyone's."""
    import errno

    store = vol.store
    store.sole_writer(True)
    deep = ROOT_INO
    for i in range(50):
        deep = store.create(deep, b"d%d" % i, stat.S_IFDIR | 0o755, 0, 0).ino
    store.create(deep, b"x", stat.S_IFREG | 0o644, 0, 0, layout_for=vol.pick_layout)
    store.create(ROOT_INO, b"a", stat.S_IFDIR | 0o755, 0, 0)
    store.sole_writer(True)  # (the cache starts again: the walk reads the rows once)
    asked = []  # (the rows of parents read)
    get = store.engine.get
    monkeypatch.setattr(store.engine, "get", lambda table, where, cols: asked.append(
        cols == ("parent",)) or get(table, where, cols))
    for _ in range(3):
        with pytest.raises(OSError) as e:
            store.rename(ROOT_INO, b"a", deep, b"x", noreplace=True)
        assert e.value.errno == errno.EEXIST
    store.rename(ROOT_INO, b"a", deep, b"y")
    assert sum(asked) == 50, sum(asked)  # (each level once, not once a rename)


def test_two_threads_loading_one_inode_get_one_object_and_one_count() -> None:
    """A follower's worker store reads into the daemon's cache beside its thread
    (`read_beside`): both loading one inode at once must hold one object, or a change
    went to a copy the other never saw; and its target is counted once."""
    import sys
    import threading

    from mxfs.meta.inode import Inode

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (a thread switch as often as the interpreter may)
    try:
        cache = inode_cache.InodeCache()
        got: list[list[Inode]] = [[], []]

        def load(t: int) -> None:
            for i in range(50_000):
                got[t].append(cache.setdefault(i, Inode(i, stat.S_IFLNK | 0o777, 0, 0, 1,
                                                        8, 0, 0, 0, 0, b"12345678")))
        threads = [threading.Thread(target=load, args=(t,)) for t in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(was)
    assert all(a is b for a, b in zip(got[0], got[1], strict=True))
    assert cache.target_bytes == 8 * 50_000 == _targets_held_in(cache)


def _targets_held_in(cache: Any) -> int:
    return sum(len(n.target or b"") for n in cache.values())

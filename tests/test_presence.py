"""A namespace's presence table (`proto/presence.py`, `vol/kv_presence.py`), read as a
client reads it: through a read-only descriptor, mapped."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from conftest import eventually

from mxfs.kv.key_view import KeyView, KeyViews
from mxfs.proto.presence import (
    GONE,
    HEADER_SIZE,
    LIVE,
    MAX_PROBE,
    MOVED,
    contains,
    read_header,
    slot_hash,
)
from mxfs.vol.kv_presence import CAP, FULL, MIN_SLOTS, PresenceTable, Successor

pytestmark = pytest.mark.unit


class Reader:
    """What `kv/key_view.py` holds: the table mapped from a reader's descriptor."""

    def __init__(self, table: PresenceTable) -> None:
        fd = table.reader_fd()
        try:
            self.map = mmap.mmap(fd, HEADER_SIZE + 8 * table.slots, mmap.MAP_SHARED,
                                 mmap.PROT_READ)
        finally:
            os.close(fd)

    def state(self) -> tuple[int, int, int, int]:
        return read_header(memoryview(self.map))

    def slots(self) -> memoryview:
        return memoryview(self.map)[HEADER_SIZE:HEADER_SIZE + 8 * self.state()[1]].cast("Q")

    def has(self, key: bytes) -> bool | None:
        return contains(self.slots(), slot_hash(self.state()[2], key))

    def reach(self, key: bytes) -> int:
        """How many slots past its home `key` lies (the whole table scanned, past any
        bound), or -1 if it is not in."""
        return reach(self.slots(), self.state()[2], key)


def reach(slots: memoryview, seed: int, key: bytes) -> int:
    """How many slots past its home `key` lies in the table of `seed` whose slots these
    are (scanned whole, past any bound: what a lookup of it walks), or -1."""
    mask, h = len(slots) - 1, slot_hash(seed, key)
    return next((d for d in range(len(slots)) if slots[(h + d) & mask] == h), -1)


def chain_keys(seed: int, slots: int, home: int, n: int, prefix: bytes = b"evil",
               width: int = 4) -> list[bytes]:
    """`n` keys whose home is one of the `width` slots from `home` in a table of `slots`
    under `seed`: what a writer who read the seed from her mapping computes (a few
    hundred hashes a key), to make one chain of them."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        key = b"%s%d" % (prefix, i)
        i += 1
        if (slot_hash(seed, key) - home) % slots < width:
            out.append(key)
    return out


def test_keys_come_and_go_and_removed_slots_keep_later_keys_found() -> None:
    keys = [b"k%d" % i for i in range(int(MIN_SLOTS * FULL) - 1)]
    table = PresenceTable()
    for k in keys[:100]:
        table.add(k)
    r = Reader(table)
    assert r.state()[0] == LIVE and r.state()[3] == 100
    for k in keys[100:]:
        table.add(k)
    assert not table.full()
    for k in keys[::2]:  # half go: their slots say so, and the chains past them hold
        table.remove(k)
    assert [r.has(k) for k in keys] == [i % 2 == 1 for i in range(len(keys))]
    assert r.state()[3] == len(keys) // 2
    for k in keys[1::2]:  # adding a key that is there changes nothing, removed slots
        table.add(k)      # before it in its chain or not
    assert r.state()[3] == len(keys) // 2
    for k in keys[::2]:  # back again, into removed slots, each once
        table.add(k)
        table.add(k)
    assert all(r.has(k) for k in keys) and r.state()[3] == len(keys)
    for k in keys:
        table.remove(k)
    assert not any(r.has(k) for k in keys) and r.state()[3] == 0
    table.retire(GONE)


def test_a_table_starts_sized_for_twice_its_keys_and_retired_shows_nothing() -> None:
    keys = [b"x%d" % i for i in range(MIN_SLOTS)]
    table = PresenceTable(room=len(keys))
    for k in keys:
        table.add(k)
    assert table.slots >= 2 * len(keys) / FULL and not table.full()
    r = Reader(table)
    assert all(r.has(k) for k in keys) and not r.has(b"absent")
    table.retire(MOVED)
    state, _, _, count = r.state()  # (said at once; wiped by a thread of its own, after)
    assert state == MOVED and count == 0
    assert eventually(lambda: not any(r.map[HEADER_SIZE:]))


def test_what_is_not_a_table_is_refused() -> None:
    with pytest.raises(ValueError):
        read_header(memoryview(bytearray(HEADER_SIZE + 8 * 1024)))


def test_a_successor_filled_in_bites_holds_the_keys_as_they_are_at_its_end() -> None:
    """While a larger table is filled a bite at a time (the daemon serves others
    between bites), keys come and go: the filled table holds exactly the keys there
    at the end, whichever side of its copy each change fell on."""
    keys = {b"k%04d" % i: None for i in range(5000)}
    growing = Successor(len(keys))
    r = Reader(growing.table)
    assert growing.table.slots * FULL >= 2 * len(keys)

    def rows() -> list[bytes]:  # (the namespace's rows now, past the last read)
        return [k for k in sorted(keys) if growing.after is None or k > growing.after][:700]
    bites, gone_later = 0, []
    while not growing.fill(keys, rows(), 700):
        bites += 1
        copied = growing.after
        assert copied is not None
        later = next(k for k in sorted(keys) if k > copied)
        for gone in (copied, later):  # between bites, one copied key goes, and one not
            del keys[gone]            # read yet; a new key comes (before the rows read
            growing.table.remove(gone)  # on), and the copied one comes back
        gone_later.append(later)
        for new in (b"a-new%d" % bites, copied):
            keys[new] = None
            growing.table.add(new)
    assert bites == 5000 // 700
    assert r.state()[3] == len(keys) == 5000
    assert all(r.has(k) for k in keys)
    assert not any(r.has(k) for k in gone_later)


def test_a_table_past_full_takes_keys_up_to_its_cap_while_its_successor_fills() -> None:
    """Up to CAP; a key with no free slot within MAX_PROBE of its home (chains grow
    long past FULL) is left out, and a reader asks the daemon of it (None)."""
    table = PresenceTable()
    n = 0
    while table.can_take():
        table.add(b"c%d" % n)
        n += 1
    assert table.full() and table.count == int(table.slots * CAP) <= n
    r = Reader(table)
    assert all(r.has(b"c%d" % i) is not False for i in range(n))
    assert r.has(b"absent") is not True


def test_a_writer_who_read_the_seed_cannot_build_a_chain_past_the_bound() -> None:
    """Readers need the seed, so a writer of the namespace can compute keys of one
    chain: before, 214k such keys made every lookup walk them (4.7 ms) and every
    insert on the daemon's thread (4 ms).  No key lies past MAX_PROBE slots of its
    home now: one that finds no room within is left out, a lookup that walks
    MAX_PROBE slots asks the daemon, and the table is due to be rebuilt."""
    table = PresenceTable(room=100)
    victims = [b"victim%d" % i for i in range(100)]
    for k in victims:
        table.add(k)
    view = KeyView(table.reader_fd(), HEADER_SIZE + 8 * table.slots)  # (a client's)
    evil = chain_keys(view.seed, table.slots, 100, 3 * MAX_PROBE)
    for k in evil:
        table.add(k)
    assert not table.full()  # (only the chain has it replaced)
    r = Reader(table)
    reached = {k: r.reach(k) for k in victims + evil}
    assert max(reached.values()) < MAX_PROBE  # no insert or lookup walks further
    assert all(reached[k] >= 0 for k in victims)
    left_out = [k for k in evil if reached[k] < 0]
    assert len(left_out) > MAX_PROBE and table.overflowed and table.due()
    # a left-out key, or an absent one of the chain, is asked of the daemon, not
    # answered absent; others as ever
    assert view.present(evil) == [None if k in left_out else True for k in evil]
    absent = [*chain_keys(view.seed, table.slots, 100, 1, prefix=b"new"),
              *chain_keys(view.seed, table.slots, 600, 1, prefix=b"far")]  # (no chain)
    assert view.present(absent + victims[:3]) == [None, False, True, True, True]


def test_a_run_of_keys_each_in_its_home_slot_is_walked_no_further_than_the_bound() -> None:
    """Keys of consecutive homes, one each, make a run no key is far from home in,
    yet a lookup of an absent key homed at its start walked all of it: it stops at
    MAX_PROBE slots and asks, and the run has the table due to be rebuilt."""
    table = PresenceTable(room=100)
    view = KeyView(table.reader_fd(), HEADER_SIZE + 8 * table.slots)
    run = [chain_keys(view.seed, table.slots, home, 1, b"run%d-" % home, width=1)[0]
           for home in range(300, 300 + 2 * MAX_PROBE)]
    for k in run:
        table.add(k)
    absent = chain_keys(view.seed, table.slots, 300, 1, prefix=b"new", width=1)
    assert view.present(absent + run[:2]) == [None, True, True]
    assert table.count == len(run) and table.overflowed and table.due()


def test_a_table_of_another_version_is_not_read_and_every_key_is_asked(tmp_path: Path
                                                                        ) -> None:
    """A client of one version with a daemon of another (a daemon upgraded under running
    engines): the table it is handed is not read, and each lookup goes to the daemon
    (before, the client's lookup failed with the table's ValueError)."""
    table = PresenceTable()
    table.add(b"k")
    path = tmp_path / "table"
    fd = table.reader_fd()
    size = HEADER_SIZE + 8 * table.slots
    data = bytearray(os.pread(fd, size, 0))
    os.close(fd)
    data[8:12] = (99).to_bytes(4, "little")  # (the version field)
    path.write_bytes(bytes(data))
    asked: list[int] = []

    def ask() -> tuple[int, int]:
        asked.append(1)
        return os.open(path, os.O_RDONLY), size
    views = KeyViews(ask)
    assert views.present([b"k"]) is None  # ask the daemon
    assert views.present([b"k"]) is None and asked == [1]  # (and no table asked again)

"""A namespace's presence table (`proto/presence.py`, `vol/kv_presence.py`), read as a
client reads it: through a read-only descriptor, mapped."""

from __future__ import annotations

import mmap
import os

import pytest
from conftest import eventually

from mxfs.proto.presence import GONE, HEADER_SIZE, LIVE, MOVED, contains, read_header, slot_hash
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

    def has(self, key: bytes) -> bool:
        _, slots, seed, _ = self.state()
        view = memoryview(self.map)[HEADER_SIZE:HEADER_SIZE + 8 * slots].cast("Q")
        return contains(view, slot_hash(seed, key))


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
    table = PresenceTable()
    n = 0
    while table.can_take():
        table.add(b"c%d" % n)
        n += 1
    assert table.full() and n == int(table.slots * CAP)
    r = Reader(table)
    assert all(r.has(b"c%d" % i) for i in range(n)) and not r.has(b"absent")

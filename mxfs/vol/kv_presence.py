"""The daemon's side of a namespace's presence table (`proto/presence.py`): a memfd it
writes as the namespace's chunks come and go, handed to readers read-only.

Made when a client first asks to see a namespace (`kv_view`), kept current by the KV
index (`vol/kv_index.py`: every insert and drop), and retired when it fills up (a
larger one replaces it, the old marked MOVED), when it holds a run of MAX_PROBE
taken slots (`proto/presence.py`: one under a fresh seed replaces it, the same way),
or when the namespace is removed (marked GONE): a retired table is wiped,
so a reader's mapping, which the daemon cannot take back, shows nothing it may no
longer see. The memfd is sealed against growing, shrinking and any new writable
mapping or write; readers get a read-only descriptor of it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import queue
import secrets
import threading
from collections import Counter, OrderedDict
from collections.abc import Container

from mxfs.proto.presence import (
    EMPTY,
    GONE,
    GONE_KEY,
    HEADER,
    HEADER_SIZE,
    LIVE,
    MAGIC,
    MAX_PROBE,
    MOVED,
    VERSION,
    find,
    slot_hash,
)

MIN_SLOTS = 1024
FULL = 0.6  # the share of slots in use (keys and gone keys) past which a table is replaced
CAP = 0.85  # ... and past which it takes no more keys (probes stay short; 15% stay empty)
RESEED_AFTER = 4  # a table takes 1/RESEED_AFTER of the keys it was made with, after them,
#                   before a run of MAX_PROBE taken slots has it rebuilt (`due`)
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


class PresenceTable:
    """One namespace's key hashes in a sealed memfd; written here only."""

    def __init__(self, room: int = 0) -> None:
        """An empty table sized for `room` keys to double before it is replaced."""
        slots = MIN_SLOTS
        while room * 2 > slots * FULL:
            slots *= 2
        self.slots, self.room = slots, room
        self.seed = secrets.randbits(64)  # (readers see it: see `proto/presence.py`)
        self.count = self.gone = 0
        self.adds = 0  # keys offered (`add`), those it was filled with among them
        self.overflowed = False  # a run of MAX_PROBE taken slots: lookups can't tell
        size = HEADER_SIZE + 8 * slots
        self.fd = os.memfd_create("mxfs-kv-view", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # (this mapping stays writable)
        except BaseException:
            os.close(self.fd)
            raise
        self._slots = memoryview(self.map)[HEADER_SIZE:].cast("Q")
        self._header(LIVE)

    def _header(self, state: int) -> None:
        HEADER.pack_into(self.map, 0, MAGIC, VERSION, state, self.slots, self.seed,
                         self.count)

    def _insert(self, h: int) -> bool:
        """Into the first free slot of its chain, unless the chain holds it already (a
        removed key's slot is reused only once the chain is known not to: up to an
        empty slot, or MAX_PROBE slots, past which no key is put).  False: no slot
        within MAX_PROBE, the key left out (readers of its chain ask the daemon)."""
        mask = self.slots - 1
        i = h & mask
        free = -1
        for _ in range(MAX_PROBE):
            if (v := self._slots[i]) == EMPTY:
                break
            if v == h:
                return True
            if v == GONE_KEY and free < 0:
                free = i
            i = (i + 1) & mask
        else:
            if free < 0:
                self.overflowed = True
                return False
        if free >= 0:
            i = free
            self.gone -= 1
        self._slots[i] = h  # (one aligned 8-byte store: readers see it whole)
        self.count += 1
        if free < 0:
            self.overflowed |= self._run(i) >= MAX_PROBE
        return True

    def _run(self, i: int) -> int:
        """How many taken slots in a row slot `i` is in, counted up to MAX_PROBE."""
        mask, n = self.slots - 1, 1
        for step in (-1, 1):
            j = (i + step) & mask
            while n < MAX_PROBE and self._slots[j] != EMPTY:
                n += 1
                j = (j + step) & mask
        return n

    def full(self) -> bool:
        """Would one more key take it past FULL (time to make a larger one)."""
        return (self.count + self.gone + 1) > self.slots * FULL

    def can_take(self) -> bool:
        """Whether one more key stays within CAP, while its successor is being filled
        (past it a key put meanwhile reads absent here until the successor is in)."""
        return (self.count + self.gone + 1) <= self.slots * CAP

    def due(self) -> bool:
        """Whether it is time to replace it: past FULL, or holding a run of MAX_PROBE
        taken slots (keys put of one run, by a writer who knows the seed), once it
        took a 1/RESEED_AFTER share of its keys more: a writer cannot have the daemon
        copy a namespace for each few keys she puts."""
        return self.full() or (self.overflowed and
                               self.adds >= self.room + self.room // RESEED_AFTER)

    def add(self, key: bytes) -> None:
        """Put `key` in, or leave it out where no slot within MAX_PROBE of its home is
        free: never a longer walk for readers or inserts (`overflowed`, either way,
        once a run of MAX_PROBE taken slots formed)."""
        self.adds += 1
        self._insert(slot_hash(self.seed, key))
        self._header(LIVE)  # (the count)

    def remove(self, key: bytes) -> None:
        i = find(self._slots, slot_hash(self.seed, key))
        if i >= 0:
            self._slots[i] = GONE_KEY  # (keeps the probe chains of later keys whole)
            self.count -= 1
            self.gone += 1
            self._header(LIVE)

    def reader_fd(self) -> int:
        """A new read-only descriptor of the table, for a reader (the caller sends and
        closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def retire(self, state: int) -> None:
        """Mark it MOVED (a new table took its place) or GONE (the namespace went), then
        wipe it: readers' mappings then say why, and show nothing.  Readers look at the
        state at every lookup, so the wipe (32 MiB for a million keys, 14 ms) is done
        by a thread of its own, not on the daemon's."""
        assert state in (MOVED, GONE)
        self.count = self.gone = 0
        self._header(state)  # (first: a reader that sees the state asks again)
        _wipe(self._slots, self.map, self.fd)


class KeptTables:
    """Which namespaces keep a presence table (a memfd and its mapping: two of the
    daemon's descriptors each), least recently asked for first, each counted against
    the user (tenant, `vol/tenants.py`) whose view made it: past `most` in all, or
    `per_user` of one user's (root: the total only), the least recently asked of that
    user's, or of all, are the ones to retire.  A user who viewed a thousand namespaces
    held two descriptors each, for good, and ran the daemon out of them."""

    def __init__(self, most: int, per_user: int) -> None:
        self.most, self.per_user = most, per_user
        self._made_by: OrderedDict[str, int] = OrderedDict()
        self.by_tenant: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._made_by)

    def asked(self, name: str) -> bool:
        """Whether `name` keeps one (then the most recently asked for)."""
        if name in self._made_by:
            self._made_by.move_to_end(name)
            return True
        return False

    def add(self, name: str, tenant: int) -> list[str]:
        """`name` keeps one now, made by `tenant`'s view; the names whose tables are to
        be retired for it (no longer kept here)."""
        self._made_by[name] = tenant
        self.by_tenant[tenant] += 1
        out = []
        if tenant != 0 and self.by_tenant[tenant] > self.per_user:
            out.append(next(n for n, t in self._made_by.items() if t == tenant))
            self.drop(out[-1])
        while len(self._made_by) > self.most:
            out.append(next(iter(self._made_by)))
            self.drop(out[-1])
        return out

    def drop(self, name: str) -> None:
        """`name` keeps none now (retired, or its namespace gone); none kept: nothing."""
        tenant = self._made_by.pop(name, None)
        if tenant is not None:
            self.by_tenant[tenant] -= 1
            if self.by_tenant[tenant] <= 0:
                del self.by_tenant[tenant]


_wipes: queue.SimpleQueue[tuple[memoryview, mmap.mmap, int]] = queue.SimpleQueue()
_wiper: threading.Thread | None = None
_wiper_lock = threading.Lock()


def _wipe(slots: memoryview, mapped: mmap.mmap, fd: int) -> None:
    """Zero a retired table's slots and let its memory go, on the wiper thread."""
    global _wiper
    _wipes.put((slots, mapped, fd))
    with _wiper_lock:
        if _wiper is None:
            _wiper = threading.Thread(target=_wiping, daemon=True, name="mxfs-kv-wipe")
            _wiper.start()


def _wiping() -> None:
    while True:
        slots, mapped, fd = _wipes.get()
        try:
            slots[:] = memoryview(bytes(len(slots) * 8)).cast("Q")
        finally:
            slots.release()
            mapped.close()
            os.close(fd)


class Successor:
    """A table being filled from the namespace's rows a bite at a time, in key order,
    while the namespace changes: its changes go into the table at once (`table.add`,
    `table.remove`), and a key read from the rows only if it is still there.  (A copy
    of the keys in memory, taken at once, held the thread 0.1 s a million keys.)"""

    def __init__(self, room: int) -> None:
        self.table = PresenceTable(room=room)
        self.after: bytes | None = None  # the last key read from the rows

    def fill(self, now: Container[bytes], keys: list[bytes], bite: int) -> bool:
        """Take the next `keys` read from the rows (up to `bite`, past `after`), those
        still in `now`, the namespace's; whether they were the last."""
        for key in keys:
            if key in now:
                self.table.add(key)
        if keys:
            self.after = keys[-1]
        return len(keys) < bite

"""A KV namespace's keys as a hash set in shared memory: the format daemon and clients share.

`kv_exists` is a round trip to the daemon for every batch, and an engine asks it for
every request it schedules (SGLang's `batch_exists`), where a file store answers with a
stat a key from the dentry cache. So the daemon keeps, for each namespace a client asked
to see (`kv_view`), the hashes of its keys in a memfd it writes as chunks are put,
deleted and evicted, and hands the client a read-only descriptor of it: the client
answers exists from its own mapping, as current as a `kv_exists` would be.

Layout: a header of HEADER_SIZE bytes (magic, version, state, slots, seed, count), then
`slots` 8-byte slots in the machine's byte order (daemon and clients share the machine),
open addressing with linear probing. A slot holds
0 (empty), 1 (a key that went) or a key's xxh3-64 under the table's seed (2 added to
values below 2). The daemon changes one slot with one aligned 8-byte store, so a reader
sees a key present or not, never half of one; it never rearranges slots in place (a
table too full is replaced by a new one, the old marked MOVED). A hash is not the key:
two keys of one hash (one in 2**64 a pair) make a false "present", and the get that
follows finds no chunk, as for a chunk evicted between the two.

Probes are bounded: a key lies within MAX_PROBE slots of its home slot or is not in
the table. The daemon puts no key further (one that finds no free slot so is left
out), and a reader that walks MAX_PROBE slots finding neither the key nor an empty
slot cannot tell, and asks the daemon (`kv_exists`). Either needs a run of MAX_PROBE
taken slots, and such a run has the daemon rebuild the table under a fresh seed
(`vol/kv_presence.py`). The seed does not keep slots secret: a reader needs it to
look up, so anyone who may read the namespace can compute keys of consecutive slots
and, if she may write it too, put them. Before the bound, such keys built one run
filling the table to FULL: every lookup and insert walked it (4.7 ms a lookup, 4 ms
an insert at 100k keys, on the daemon's one thread). The bound caps what she can
make a lookup or insert walk; the fresh seed undoes her arrangement.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

MAGIC = b"MXKVSET1"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")  # magic, version, state, slots, seed, count
_STATE = struct.Struct("<I")  # the header's state alone, at STATE_AT
STATE_AT = 12
HEADER_SIZE = 64  # slots start here (a cache line: the header's writes touch no slot)
EMPTY, GONE_KEY = 0, 1
LIVE, MOVED, GONE = 0, 1, 2  # table states: in use; replaced (ask again); namespace gone
MAX_PROBE = 128  # slots a lookup walks at most (random keys at FULL: runs of 70-90 at
#                  most in 1-4M slots)
ABSENT, UNKNOWN = -1, -2  # what `find` answers when no slot holds the hash


def slot_hash(seed: int, key: bytes) -> int:
    """What a key's slot holds (never EMPTY or GONE_KEY)."""
    h = xxhash.xxh3_64_intdigest(key, seed)
    return h + 2 if h < 2 else h


def read_header(buf: memoryview) -> tuple[int, int, int, int]:
    """(state, slots, seed, count) of a table; ValueError if it is not one."""
    magic, version, state, slots, seed, count = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or slots & (slots - 1) or \
            len(buf) < HEADER_SIZE + 8 * slots:
        raise ValueError("not a KV presence table of this version")
    return state, slots, seed, count


def state_of(buf: ReadableBuffer) -> int:
    """A table's state (LIVE, MOVED, GONE), read alone: readers ask it at every lookup."""
    return int(_STATE.unpack_from(buf, STATE_AT)[0])


def find(slots: memoryview, h: int) -> int:
    """The slot holding hash `h` in the table whose slots (a memoryview of format "Q")
    these are; ABSENT; or UNKNOWN, when MAX_PROBE slots hold neither it nor an empty
    slot (the daemon may have left the key out: ask it)."""
    mask = len(slots) - 1
    i = h & mask
    for _ in range(min(MAX_PROBE, len(slots))):
        v = slots[i]
        if v == h:
            return i
        if v == EMPTY:
            return ABSENT
        i = (i + 1) & mask
    return UNKNOWN


def contains(slots: memoryview, h: int) -> bool | None:
    """Whether hash `h` is in the table whose slots these are; None: the table cannot
    tell (past MAX_PROBE slots), ask the daemon."""
    i = find(slots, h)
    return None if i == UNKNOWN else i >= 0

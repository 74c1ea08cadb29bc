"""Exists answered in the caller: a namespace's presence table mapped read-only.

The daemon keeps a table of a namespace's key hashes current in shared memory once a
client asks for it (`kv_view`, `proto/presence.py`); `KVStore.exists_many` and
`batch_exists` (which engines ask for every request they schedule) read it instead of
asking the daemon. A table the daemon replaced (it filled up) or retired (its
namespace went) says so, and the next ask gets the current one. A reading node keeps
tables by the writer's change feed (`fs/kv_views.py`), and while it cannot read the
feed answers EAGAIN: the store asks the daemon meanwhile and for a view again a
second later. Where there is no table to have (a daemon that predates views, a
namespace not the caller's to read) the store asks the daemon, as before. A key whose
lookup walks MAX_PROBE slots without an answer (a run a writer built of keys she
computed from the seed, which every reader sees) is asked of the daemon too: no lookup
walks further (`proto/presence.py`).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence

from mxfs.client.control import ControlError
from mxfs.proto.presence import HEADER_SIZE, LIVE, contains, read_header, slot_hash, state_of

RETRY_S = 1.0  # a namespace that does not exist yet: asked for again at most this often


class KeyView:
    """One table, mapped read-only."""

    def __init__(self, fd: int, size: int) -> None:
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        _, slots, self.seed, _ = read_header(memoryview(self._map))
        self._slots = memoryview(self._map)[HEADER_SIZE:HEADER_SIZE + 8 * slots].cast("Q")

    def live(self) -> bool:
        return state_of(self._map) == LIVE

    def present(self, keys: Sequence[bytes]) -> list[bool | None] | None:
        """Whether each key is stored (None for a key the table cannot tell: ask the
        daemon); None once the daemon retired this table."""
        if not self.live():
            return None
        found = [contains(self._slots, slot_hash(self.seed, k)) for k in keys]
        return found if self.live() else None


class KeyViews:
    """The view a store holds of its namespace, asked for when it has none."""

    def __init__(self, ask: Callable[[], tuple[int, int]]) -> None:
        self._ask = ask  # the daemon's table: (descriptor, bytes), or ControlError
        self._view: KeyView | None = None
        self._never = False  # nothing to have here
        self._retry_at = 0.0
        self._lock = threading.Lock()  # (one ask at a time: threads share a store)

    def present(self, keys: Sequence[bytes]) -> list[bool | None] | None:
        """Whether each key is stored, from the table; None: ask the daemon instead (of
        every key, or of each key it is for)."""
        view = self._view
        if view is not None:
            found = view.present(keys)
            if found is not None:
                return found
        with self._lock:
            if self._view is view:  # (no other thread got a new one meanwhile)
                self._view = None if self._never else self._fresh()
            view = self._view
        return view.present(keys) if view is not None else None

    def _fresh(self) -> KeyView | None:
        if time.monotonic() < self._retry_at:
            return None
        try:
            fd, size = self._ask()
        except ControlError as e:
            if e.errno in (errno.ENOENT, errno.EAGAIN):  # no namespace yet (every key is
                # absent), or a reading node that cannot follow its feed now: ask later
                self._retry_at = time.monotonic() + RETRY_S
            else:  # (a reading node, an older daemon, a namespace not ours to read)
                self._never = True
            return None
        try:
            return KeyView(fd, size)
        except ValueError:  # (a daemon of another version: its tables are not read here)
            self._never = True
            return None

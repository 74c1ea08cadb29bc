"""The pool's daemon lease: a row in the store naming who serves the pool, renewed.

The file lock on the metadata member keeps two processes of one node apart; the
metadata of a pool on a server can be reached from every node, so a daemon also
holds a lease row (`settings` key "daemon_lease": host, pid, mount point, a token
and an expiry), renews it every RENEW_S and drops it at a clean unmount.  A mount
that finds another holder's lease unexpired is refused, naming the holder; a lease
that ran out (its node died, or lost the server for TTL_S) is taken over.  A daemon
that finds its lease taken refuses changes from then on (the new holder's are the
ones that count).  Expiries are wall-clock times: the nodes' clocks must agree to
well within TTL_S (NTP), as they must for any lease.

Only engine primitives are used, in `engine.txn` (rerun on a conflict), with a
compare-and-swap update, so two nodes racing for a free lease get one winner.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from mxfs.meta.store import MetaStore

KEY = "daemon_lease"
TTL_S = 30.0
RENEW_S = 5.0


@dataclass
class Lease:
    """What a holder wrote: who it is, and until when the pool is its own."""

    host: str
    pid: int
    mountpoint: str
    token: str
    expires: float

    def encode(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> Lease:
        d: dict[str, Any] = json.loads(text)
        return cls(str(d["host"]), int(d["pid"]), str(d["mountpoint"]), str(d["token"]),
                   float(d["expires"]))

    def describe(self) -> str:
        return f"{self.host} (pid {self.pid}, mounted on {self.mountpoint})"


class LeaseHeld(Exception):
    """Another holder's lease has not run out."""

    def __init__(self, holder: Lease) -> None:
        super().__init__(f"the pool is served by {holder.describe()}; its lease runs "
                         f"{max(0.0, holder.expires - time.time()):.0f} s more")
        self.holder = holder


def _current(store: MetaStore) -> tuple[str, Lease] | None:
    row = store.engine.get("settings", {"key": KEY}, ("value",))
    if row is None:
        return None
    try:
        return row[0], Lease.decode(row[0])
    except (ValueError, KeyError, TypeError):  # unreadable: treat as run out
        return row[0], Lease("?", 0, "?", "", 0.0)


def holder(store: MetaStore) -> Lease | None:
    """The live lease of someone serving the pool, if any."""
    cur = _current(store)
    return cur[1] if cur is not None and cur[1].expires > time.time() else None


def live_elsewhere(store: MetaStore) -> Lease | None:
    """The live lease of a daemon on another host, if any.  The caller holds the pool's
    file lock, so a lease naming this host is a dead daemon's (SIGKILLed, crashed)."""
    lease = holder(store)
    return lease if lease is not None and lease.host != socket.gethostname() else None


def take(store: MetaStore, mountpoint: str, ttl: float = TTL_S) -> Lease:
    """Hold the pool for this process (which holds the pool's file lock); `LeaseHeld`
    if a daemon on another host holds a live lease."""
    mine = Lease(socket.gethostname(), os.getpid(), mountpoint, uuid.uuid4().hex,
                 time.time() + ttl)

    def change() -> bool:
        cur = _current(store)
        if cur is None:
            return store.engine.insert("settings", {"key": KEY, "value": mine.encode()})
        text, lease = cur
        if lease.expires > time.time() and lease.host != mine.host:
            raise LeaseHeld(lease)
        return store.engine.update("settings", {"key": KEY, "value": text},
                                   {"value": mine.encode()}) == 1

    while not store.engine.txn(change):  # another node took it first: look again
        pass
    store.commit()
    return mine


def renew(store: MetaStore, lease: Lease, ttl: float = TTL_S) -> bool:
    """Extend `lease` (updated in place); False if another holder has taken the pool.
    OSError when the store cannot be reached (the lease then runs on until TTL)."""
    new = Lease(lease.host, lease.pid, lease.mountpoint, lease.token, time.time() + ttl)

    def change() -> bool:
        cur = _current(store)
        if cur is None or cur[1].token != lease.token:
            return False
        return store.engine.update("settings", {"key": KEY, "value": cur[0]},
                                   {"value": new.encode()}) == 1

    if not store.engine.txn(change):
        return False
    store.commit()
    lease.expires = new.expires
    return True


def drop(store: MetaStore, lease: Lease) -> None:
    """Give the pool up (a clean unmount), if the lease is still ours."""
    def change() -> None:
        cur = _current(store)
        if cur is not None and cur[1].token == lease.token:
            store.engine.delete("settings", {"key": KEY, "value": cur[0]})

    store.engine.txn(change)
    store.commit()

"""The pool's daemon lease: a row in the store naming who serves the pool, renewed,
and the epoch that fences a holder who lost it.

The file lock on the metadata member keeps two processes of one node apart; the
metadata of a pool on a server can be reached from every node, so a daemon also
holds a lease row (`settings` key "daemon_lease": host, pid, mount point, a token,
an epoch and an expiry) and drops it at a clean unmount.  A mount that finds another
holder's lease unexpired is refused, naming the holder; a lease that ran out (its
node died, or lost the server for its TTL) is taken over.

Liveness and fencing (3FS's rule; SCALE-OUT step 2):
- Expiries are times of the store's clock (`Engine.clock`: the server's `now()`), so
  nodes need not agree on theirs.
- `Keeper` renews from a thread and a connection of its own: a busy trio loop or a
  slow request cannot starve it.  A holder that could not renew for half its TTL
  stops taking changes (`Engine.fenced`) until a renewal gets through, so it has
  stopped before anyone may take the pool over.
- Every take draws a new epoch (`settings` key "daemon_epoch"); a store on a server
  commits a group only while that row still holds the holder's epoch
  (`Engine.set_fence`).  A holder declared dead that wakes up (SIGSTOP, a partition)
  cannot commit one more change, even before its keeper hears of the takeover.

Nodes that read the pool (`mxfs node add`: no members, a read-only mount) hold a lease
row of their own ("node:NAME", epochs from "node_epoch", no fence: they change
nothing), renewed the same way; `nodes` lists every node and whether it is alive.
The writer's lease names its node, its chunk service's address and its members, so
a reading node knows whom to ask for each member's ranges (`pool/remote.py`).

Only engine primitives are used, in `engine.txn` (rerun on a conflict), with a
compare-and-swap update, so two nodes racing for a free lease get one winner.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mxfs.meta.engine import Engine, Unusable
from mxfs.meta.store import MetaStore
from mxfs.proto.messages import LeaseStatus, NodeStatus

log = logging.getLogger("mxfs.lease")

KEY = "daemon_lease"
EPOCH_KEY = "daemon_epoch"
NODE_PREFIX = "node:"  # a reading node's lease: "node:NAME"
NODE_EPOCH_KEY = "node_epoch"  # (not the writer's fence: a reader must not move it)
TTL_S = 30.0
STARTING = "starting"  # addr of a node whose chunk service is not up yet (announced)
RENEWALS = 6  # a keeper renews this many times a TTL


@dataclass
class Lease:
    """What a holder wrote: who it is, and until when the pool is its own."""

    host: str
    pid: int
    mountpoint: str
    token: str
    expires: float  # by the store's clock
    epoch: int = 0  # drawn at take: the fence of the holder's commits
    node: str = ""  # the node's name (its host name unless named)
    addr: str = ""  # its chunk service, "IP:PORT" ("": it serves none; STARTING)
    members: int = 0  # how many members it owns (the writer: every member)
    ttl: float = 0.0  # how long each renewal holds it, seconds
    # The writer's: the reading nodes it knows alive, and so commits every close for
    # (a reading node's mount waits to be named here: `await_writer`).
    readers: list[str] = field(default_factory=list)

    def encode(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> Lease:
        d: dict[str, Any] = json.loads(text)
        return cls(str(d["host"]), int(d["pid"]), str(d["mountpoint"]), str(d["token"]),
                   float(d["expires"]), int(d.get("epoch", 0)), str(d.get("node", "")),
                   str(d.get("addr", "")), int(d.get("members", 0)), float(d.get("ttl", 0)),
                   [str(r) for r in d.get("readers", [])])

    @property
    def name(self) -> str:
        return self.node or self.host

    def describe(self) -> str:
        return f"{self.name} (pid {self.pid}, mounted on {self.mountpoint}, epoch {self.epoch})"


class LeaseHeld(Exception):
    """Another holder's lease has not run out."""

    def __init__(self, holder: Lease, now: float) -> None:
        super().__init__(f"the pool is served by {holder.describe()}; its lease runs "
                         f"{max(0.0, holder.expires - now):.0f} s more")
        self.holder, self.now = holder, now


def _current(store: MetaStore, key: str = KEY) -> tuple[str, Lease] | None:
    row = store.engine.get("settings", {"key": key}, ("value",))
    if row is None:
        return None
    try:
        return row[0], Lease.decode(row[0])
    except (ValueError, KeyError, TypeError):  # unreadable: treat as run out
        return row[0], Lease("?", 0, "?", "", 0.0)


def holder(store: MetaStore) -> Lease | None:
    """The live lease of someone serving the pool, if any."""
    cur = _current(store)
    return cur[1] if cur is not None and cur[1].expires > store.engine.clock() else None


def live_elsewhere(store: MetaStore) -> Lease | None:
    """The live lease of a daemon on another host, if any.  The caller holds the pool's
    file lock, so a lease naming this host is a dead daemon's (SIGKILLed, crashed)."""
    lease = holder(store)
    return lease if lease is not None and lease.host != socket.gethostname() else None


def node_key(name: str) -> str:
    """The settings key of a reading node's lease."""
    return NODE_PREFIX + name


def take(store: MetaStore, mountpoint: str, ttl: float = TTL_S,
         host: str | None = None, node: str = "", addr: str = "", members: int = 0,
         key: str = KEY) -> Lease:
    """Hold the pool for this process (which holds the pool's file lock) under a new
    epoch, and fence the store's commits with it; `LeaseHeld` if a daemon on another
    host holds a live lease.  (`host`: another node's name, for tests of takeovers.)

    With `key` a reading node's (`node_key`), the lease is that node's alone: its
    epoch comes from its own counter and fences nothing."""
    mine = Lease(host or socket.gethostname(), os.getpid(), mountpoint, uuid.uuid4().hex, 0.0,
                 node=node, addr=addr, members=members, ttl=ttl)
    epoch_key = EPOCH_KEY if key == KEY else NODE_EPOCH_KEY

    def change() -> bool:
        cur = _current(store, key)
        now = store.engine.clock()
        if cur is not None and cur[1].expires > now and cur[1].host != mine.host:
            raise LeaseHeld(cur[1], now)
        row = store.engine.get("settings", {"key": epoch_key}, ("value",))
        text = str(row[0]) if row is not None else ""
        last = int(text) if text.isascii() and text.isdecimal() else 0
        mine.epoch = max(last, cur[1].epoch if cur is not None else 0) + 1
        mine.expires = now + ttl
        if cur is None:
            if not store.engine.insert("settings", {"key": key, "value": mine.encode()}):
                return False  # (another took it first: look again)
        elif store.engine.update("settings", {"key": key, "value": cur[0]},
                                 {"value": mine.encode()}) != 1:
            return False  # (nothing written: look again)
        if row is None:
            store.engine.insert("settings", {"key": epoch_key, "value": str(mine.epoch)})
        else:
            store.engine.update("settings", {"key": epoch_key}, {"value": str(mine.epoch)})
        if key == KEY:
            store.engine.set_fence(EPOCH_KEY, str(mine.epoch))  # (this very commit passes)
        return True

    while not store.engine.txn(change):  # another node took it first: look again
        pass
    store.commit()
    return mine


def renew(store: MetaStore, lease: Lease, ttl: float = TTL_S, key: str = KEY) -> bool:
    """Extend `lease` (updated in place); False if another holder has taken the pool.
    OSError when the store cannot be reached (the lease then runs on until TTL)."""
    new = Lease(**{**lease.__dict__, "readers": list(lease.readers)})

    def change() -> bool:
        cur = _current(store, key)
        if cur is None or cur[1].token != lease.token:
            return False
        new.expires = store.engine.clock() + ttl
        return store.engine.update("settings", {"key": key, "value": cur[0]},
                                   {"value": new.encode()}) == 1

    if not store.engine.txn(change):
        return False
    store.commit()
    lease.expires = new.expires
    return True


def drop(store: MetaStore, lease: Lease, key: str = KEY) -> None:
    """Give the pool up (a clean unmount), if the lease is still ours."""
    def change() -> None:
        cur = _current(store, key)
        if cur is not None and cur[1].token == lease.token:
            store.engine.delete("settings", {"key": key, "value": cur[0]})

    store.engine.txn(change)
    store.commit()


def writer(store: MetaStore) -> tuple[Lease, bool] | None:
    """The writer node's lease as last written (its node, chunk service and members),
    and whether it is alive; None if no writer ever held the pool (or gave it back)."""
    cur = _current(store)
    return None if cur is None else (cur[1], cur[1].expires > store.engine.clock())


def alive_readers(store: MetaStore) -> dict[str, int]:
    """The reading nodes whose leases are live, each with its epoch."""
    return {n["name"]: n["epoch"] for n in nodes(store)
            if n["role"] == "reader" and n["state"] == "alive"}


def await_writer(store: MetaStore, name: str) -> bool:
    """Wait until the writer's lease names the reading node `name` among the readers it
    knows (it then commits every close: close-to-open holds from the moment this
    node's mount is ready), or no live writer holds the pool; False if the writer did
    not within two of its renewals and a second."""
    held = writer(store)
    ttl = held[0].ttl if held is not None and held[0].ttl > 0 else TTL_S
    limit = time.monotonic() + 1.0 + 2 * ttl / RENEWALS
    while True:
        if held is None or not held[1] or name in held[0].readers:
            return True
        if time.monotonic() >= limit:
            return False
        time.sleep(0.05)
        held = writer(store)


def nodes(store: MetaStore) -> list[NodeStatus]:
    """Every node that holds (or held, and did not give back) a lease on the pool: the
    writer first, then the reading nodes by name, each alive or dead by the store's
    clock."""
    now = store.engine.clock()
    found: list[tuple[str, Lease]] = []
    cur = _current(store)
    if cur is not None:
        found.append(("writer", cur[1]))
    for key, text in sorted(store.settings(NODE_PREFIX)):
        try:
            found.append(("reader", Lease.decode(text)))
        except (ValueError, KeyError, TypeError):
            found.append(("reader", Lease("?", 0, "?", "", 0.0, node=key[len(NODE_PREFIX):])))
    return [{"name": held.name, "role": role, "host": held.host, "pid": held.pid,
             "mountpoint": held.mountpoint, "addr": held.addr, "members": held.members,
             "epoch": held.epoch, "state": "alive" if held.expires > now else "dead",
             "expires_in": round(held.expires - now, 1)} for role, held in found]


class Keeper:
    """Renews `lease` every TTL / RENEWALS seconds (`every`) from a thread of its own, on a
    connection of its own to the store at `where`, and fences `engine` (the holder's
    own connection) when the lease is lost: for good once another holder took it, for
    a while when no renewal got through for half the TTL (it may be taken at the TTL).

    `state` tells the daemon what happened: "held", "stale" (renewals failing; changes
    refused meanwhile), "taken".
    """

    def __init__(self, where: str, lease: Lease, engine: Engine, ttl: float = TTL_S,
                 key: str = KEY, watch: Callable[[MetaStore], None] | None = None) -> None:
        """`key`: the lease's row (a reading node's: `node_key`); `watch`: called after
        each renewal with the keeper's store (a reading node reads the writer's lease)."""
        self.where, self.lease, self.engine, self.ttl = where, lease, engine, ttl
        self.key, self.watch = key, watch
        self.every = ttl / RENEWALS  # (less with -o renew_s: a writer sees nodes join sooner)
        self.state = "held"
        self.error: str = ""  # why renewals fail, while they do
        self.renewed = time.monotonic()  # the last renewal that got through
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mxfs-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.ttl)

    def status(self) -> LeaseStatus:
        """What `mxfs status` shows of the lease."""
        late = time.monotonic() - self.renewed
        return {"host": self.lease.host, "pid": self.lease.pid, "epoch": self.lease.epoch,
                "ttl": self.ttl, "expires_in": round(self.ttl - late, 1),
                "state": self.state, "error": self.error}

    def _run(self) -> None:
        store: MetaStore | None = None
        try:
            while not self._stop.wait(self.every) and self.state != "taken":
                try:
                    if store is None:
                        store = MetaStore.open(self.where)
                    if renew(store, self.lease, self.ttl, self.key):
                        self._renewed()
                        if self.watch is not None:
                            self.watch(store)
                    else:
                        self._taken(store)
                except (OSError, Unusable) as e:  # the store is away (Unusable: could not
                    self._failed(e if isinstance(e, OSError)  # connect again): the lease
                                 else OSError(errno.EIO, str(e)))  # runs on until TTL
                except Exception as e:  # a bug must not end renewals unnoticed
                    log.exception("renewing the pool's lease failed")
                    self._failed(OSError(errno.EIO, f"{type(e).__name__}: {e}"))
        finally:
            if store is not None:
                try:
                    store.close()
                except OSError:
                    pass

    def _renewed(self) -> None:
        self.renewed, self.error = time.monotonic(), ""
        if self.state == "stale":
            self.state, self.engine.fenced = "held", None
            log.warning("the pool's lease is renewed again: changes are taken again")

    def _taken(self, store: MetaStore) -> None:
        other = holder(store)
        self.engine.fenced = (f"the pool's lease was taken by "
                              f"{other.describe() if other else 'another node'}: this "
                              "mount refuses changes from now on; unmount it")
        self.state = "taken"

    def _failed(self, e: OSError) -> None:
        self.error = str(e)
        late = time.monotonic() - self.renewed
        if self.state == "held" and late > self.ttl / 2:
            self.state = "stale"
            self.engine.fenced = (f"the pool's lease could not be renewed for {late:.0f} s "
                                  f"({e}): changes are refused until it is")
            log.error("%s", self.engine.fenced)

"""The rows of the KV chunk index: namespaces, and chunks keyed by (namespace, key).

A KV chunk is a sealed regular inode with nlink 1 whose one reference is its row
in `kv` (not a directory entry), so the link-count rules of the namespace hold for
it too.  The daemon's `vol/kv_index.py` keeps the index in memory (LRU order, capacity)
and writes through these.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from mxfs.meta.engine import Engine, fail
from mxfs.meta.feed_notes import KV_GONE, KV_REMOVED, KV_RESET, KV_STORED
from mxfs.meta.inode import Inode
from mxfs.meta.usage import key_cost

T = TypeVar("T")
SEALS_BITE = 4096  # chunks whose seals `chunks` reads in one go (their sums, in memory)


class Rules(Protocol):
    """What the KV rows take from the namespace rules (`MetaStore`), which own them."""

    engine: Engine

    def txn(self, fn: Callable[[], T]) -> T: ...
    def get(self, ino: int) -> Inode: ...
    def write_fields(self, node: Inode, values: dict[str, object]) -> None: ...
    def seal(self, ino: int, sum_unit: int, sums: bytes) -> None: ...
    def drop_link(self, node: Inode, now: int) -> None: ...
    def charge_key(self, node: Inode, nbytes: int) -> None: ...
    def note_kv(self, what: int, ns: str, key: bytes = b"") -> None: ...


class KVRows:
    def __init__(self, store: Rules) -> None:
        self.store = store
        self.engine = store.engine

    def namespaces(self) -> list[tuple[str, int, int, int, int]]:
        """(ns, uid, gid, mode, capacity) of every namespace."""
        return list(self.engine.scan("kv_ns", ("ns", "uid", "gid", "mode", "capacity")))

    def set_namespace(self, ns: str, uid: int, gid: int, mode: int, capacity: int) -> None:
        self.store.txn(lambda: self.engine.upsert(
            "kv_ns", {"ns": ns, "uid": uid, "gid": gid, "mode": mode, "capacity": capacity}))

    def set_access(self, ns: str, uid: int, gid: int, mode: int, capacity: int) -> None:
        """The namespace's row with an owner, group or mode that may let someone in no
        more, noted for reading nodes: their presence tables of it end (KV_RESET: their
        readers ask again, judged anew)."""
        def change() -> None:
            self.engine.upsert("kv_ns", {"ns": ns, "uid": uid, "gid": gid, "mode": mode,
                                         "capacity": capacity})
            self.store.note_kv(KV_RESET, ns)
        self.store.txn(change)

    def drop_namespace(self, ns: str) -> None:
        def change() -> None:
            self.engine.delete("kv_ns", {"ns": ns})
            self.store.note_kv(KV_GONE, ns)
        self.store.txn(change)

    def chunks(self) -> Iterator[tuple[str, bytes, int, int, int, int, bytes, int]]:
        """(ns, key, ino, size, atime, sum_unit, sums, uid) of every chunk, least
        recently used first; `uid` its inode's owner, its writer (a chunk without its
        seal is left out: fsck names it; one without its inode, which fsck drops, is
        root's)."""
        rows = list(self.engine.scan("kv", ("ns", "key", "ino", "size", "atime"),
                                     order="atime"))
        owners = {ino: uid for ino, uid in self.engine.get_many(
            "inodes", "ino", (r[2] for r in rows), ("ino", "uid"))}
        # Seals read SEALS_BITE rows at a time: one per row was a round trip each to a
        # metadata server on every writer mount (20,000 chunks: 1.5 s against 0.05 s).
        for start in range(0, len(rows), SEALS_BITE):
            part = rows[start:start + SEALS_BITE]
            seals = {r[0]: (r[1], bytes(r[2])) for r in self.engine.get_many(
                "sealed", "ino", (r[2] for r in part), ("ino", "sum_unit", "sums"))}
            for ns, key, ino, size, atime in part:
                seal = seals.get(ino)
                if seal is not None:
                    yield (ns, bytes(key), ino, size, atime, seal[0], seal[1],
                           owners.get(ino, 0))

    def key_of(self, ino: int) -> tuple[str, bytes] | None:
        """The (namespace, key) whose chunk `ino` is, if it is one."""
        row = self.engine.get("kv", {"ino": ino}, ("ns", "key"))
        return (row[0], bytes(row[1])) if row else None

    def publish(self, ino: int, ns: str, key: bytes, size: int, atime: int, sum_unit: int,
                sums: bytes) -> None:
        """Give a hidden file its index entry and its seal in one change (EEXIST if the
        key is taken: the first writer wins)."""
        store = self.store

        def change() -> None:
            node = store.get(ino)
            if node.nlink != 0:
                raise fail(errno.EINVAL, f"inode {ino} is already published")
            if not self.engine.insert("kv", {"ns": ns, "key": key, "ino": ino, "size": size,
                                             "atime": atime}):
                raise fail(errno.EEXIST)
            self.engine.remove("orphans", {"ino": ino})
            now = time.time_ns()
            store.write_fields(node, {"nlink": 1, "size": size, "mtime_ns": now, "ctime_ns": now})
            store.seal(ino, sum_unit, sums)
            store.charge_key(node, key_cost(ns, key))
            store.note_kv(KV_STORED, ns, key)
        store.txn(change)

    def remove(self, entries: list[tuple[str, bytes, int]]) -> list[Inode]:
        """Drop (ns, key, ino) entries in one change; their inodes become orphans."""
        store = self.store

        def change() -> list[Inode]:
            nodes = []
            now = time.time_ns()
            for ns, key, ino in entries:
                had = self.engine.delete("kv", {"ns": ns, "key": key})
                store.note_kv(KV_REMOVED, ns, key)
                node = store.get(ino)
                if had:
                    store.charge_key(node, -key_cost(ns, key))
                store.drop_link(node, now)
                nodes.append(node)
            return nodes
        return store.txn(change)

    def drop_entry(self, ns: str, key: bytes) -> None:
        """Remove an index row alone (fsck: it points to a missing inode)."""
        def change() -> None:
            self.engine.delete("kv", {"ns": ns, "key": key})
            self.store.note_kv(KV_REMOVED, ns, key)
        self.store.txn(change)

    def keys_after(self, ns: str, after: bytes | None, limit: int) -> list[bytes]:
        """Up to `limit` keys of namespace `ns` past `after`, in order (a reading node
        filling a presence table a bite at a time)."""
        return [bytes(k) for (k,) in self.engine.scan("kv", ("key",), {"ns": ns}, order="key",
                                                       after=after, limit=limit)]

    def touch(self, rows: list[tuple[int, str, bytes]]) -> None:
        """Write back access times: (atime, ns, key)."""
        self.store.txn(lambda: self.engine.update_many("kv", ("ns", "key"), ("atime",), rows))

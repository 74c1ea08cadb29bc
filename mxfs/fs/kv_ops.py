"""The KV operations of the control socket: chunks put, got, pinned, evicted.

A put is the direct write path without a name: `kv_create` makes a hidden file
and hands out write descriptors, `kv_commit` publishes it under its key (the
first writer wins; later ones are told the key is stored and their copy is
dropped).  KV chunks are a cache: they are not fsynced; a chunk whose bytes
were lost in a crash fails its checksum on read and is dropped as a miss.
"""

from __future__ import annotations

import base64
import errno
import os
from typing import Any

from mxfs.fs.kv import KVIndex, Namespace, check_key
from mxfs.fs.session import (
    Pending,
    Session,
    int_field,
    open_hidden,
    read_fds,
    refuse_if_degraded,
    sums_field,
)
from mxfs.fs.volume import Volume
from mxfs.io.checksum import block_sums, pack_sums
from mxfs.meta import ROOT_INO, Inode
from mxfs.pool import ChunkFiles
from mxfs.proto import MAX_FDS, OPS, ProtocolError

KV_OPS = tuple(op for op in OPS if op.startswith("kv_"))
INLINE_REPLY = 512 << 10  # chunk bytes one kv_get reply may carry inline


def _keys(msg: dict[str, Any]) -> list[bytes]:
    raw = msg.get("keys")
    if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
        raise ProtocolError(f"{msg.get('op')} needs 'keys': a list of base64 strings")
    try:
        return [check_key(base64.b64decode(k, validate=True)) for k in raw]
    except ValueError:
        raise ProtocolError(f"{msg.get('op')}: a key is not base64") from None


def _key(msg: dict[str, Any]) -> bytes:
    key = msg.get("key")
    if not isinstance(key, str):
        raise ProtocolError(f"{msg.get('op')} needs a base64 'key'")
    try:
        return check_key(base64.b64decode(key, validate=True))
    except ValueError:
        raise ProtocolError(f"{msg.get('op')}: the key is not base64") from None


class KVOps:
    def __init__(self, vol: Volume, index: KVIndex) -> None:
        self.vol = vol
        self.index = index

    def handle(self, op: str, msg: dict[str, Any], session: Session
               ) -> tuple[dict[str, Any], list[int]]:
        caller = session.caller
        if op == "kv_stats":
            ns = msg.get("namespace")
            spaces = [self.index.space(ns, caller, create=False)] if ns is not None else [
                s for s in self.index.spaces.values() if s.may(caller)]
            return {"ok": True, "namespaces": [s.stats() for s in spaces]}, []
        # Any use makes a namespace (owned by its first user); only stats asks first.
        space = self.index.space(msg.get("namespace"), caller)
        if op == "kv_put":
            return self._put(msg, session, space), []
        if op == "kv_create":
            return self._create(msg, session, space)
        if op == "kv_commit":
            return self._commit(msg, session, space), []
        if op == "kv_get":
            return self._get(msg, session, space)
        if op == "kv_unpin":
            self._unpin(session, space, _keys(msg))
            return {"ok": True}, []
        if op == "kv_exists":
            return {"ok": True, "present": [k in space.chunks for k in _keys(msg)]}, []
        if op == "kv_delete":
            return {"ok": True, "deleted": self.index.remove(space, _keys(msg))}, []
        if op == "kv_list":
            limit, skip = int_field(msg, "limit", 1000), int_field(msg, "skip", 0)
            items = list(space.chunks.items())[skip:skip + limit]
            return {"ok": True, "chunks": [[base64.b64encode(k).decode(), c.size, c.pins]
                                           for k, c in items]}, []
        if op == "kv_config":
            self.index.configure(space, caller, int_field(msg, "capacity"))
            return {"ok": True, "evicted": self.index.enforce(space), **space.stats()}, []
        if op == "kv_evict":
            return {"ok": True, "evicted": self.index.evict(space, int_field(msg, "keep", 0))}, []
        raise ProtocolError(f"unknown op {op!r}")

    def _room(self, size: int) -> Inode:
        """Fail fast (ENOSPC) when the pool is short of space; returns the layout parent."""
        root = self.vol.store.get(ROOT_INO)
        layout = self.vol.pool.layout_for(0, root.stripe_unit, root.stripe_width)
        members = list(range(len(self.vol.pool.members)))[:max(1, layout.width)]
        if not self.index.make_room(members, -(-size // layout.width)):
            raise OSError(errno.ENOSPC, "the pool is short of space for KV chunks; "
                          "least recently used chunks are being evicted")
        return root

    def _put(self, msg: dict[str, Any], session: Session, space: Namespace) -> dict[str, Any]:
        """Small chunks in one request: the daemon writes them (no descriptors passed)."""
        keys, data = _keys(msg), msg.get("data")
        if not isinstance(data, list) or len(data) != len(keys):
            raise ProtocolError("kv_put needs 'data': one base64 string per key")
        refuse_if_degraded(self.vol)
        stored = []
        for key, b64 in zip(keys, data, strict=True):
            if key in space.chunks:
                stored.append(False)
                continue
            try:
                raw = base64.b64decode(b64, validate=True)
            except (ValueError, TypeError):
                raise ProtocolError("kv_put: data is not base64") from None
            self._room(len(raw))
            entry = self.vol.take_spare(session.caller.uid, session.caller.gid)
            try:
                assert entry.chunks is not None
                entry.chunks.write(0, memoryview(raw))
                unit = self.vol.layout(entry.node).unit
                self.index.insert(space, key, entry.node.ino, len(raw), unit,
                                  pack_sums(block_sums(raw, unit)))
            finally:
                self.vol.release(entry.node.ino)
            stored.append(True)
        return {"ok": True, "stored": stored, "evicted": self.index.enforce(space)}

    def _create(self, msg: dict[str, Any], session: Session, space: Namespace
                ) -> tuple[dict[str, Any], list[int]]:
        key, size = _key(msg), int_field(msg, "size")
        if key in space.chunks:
            return {"ok": True, "exists": True}, []  # the cheap answer to a repeated put
        root = self._room(size)
        entry, members, fds = open_hidden(self.vol, root, 0o600, session.caller.uid,
                                          session.caller.gid)
        session.pending[entry.node.ino] = Pending(entry, "")
        return {"ok": True, "exists": False, "ino": entry.node.ino,
                "layout": self.vol.layout(entry.node).describe(), "members": members}, fds

    def _commit(self, msg: dict[str, Any], session: Session, space: Namespace
                ) -> dict[str, Any]:
        pending = session.pending.get(int_field(msg, "ino"))
        if pending is None or pending.path:
            raise OSError(errno.EBADF, f"inode {msg.get('ino')} is not a KV chunk written here")
        entry = pending.entry
        key, size = _key(msg), int_field(msg, "size")
        sum_unit, sums = sums_field(msg, self.vol.layout(entry.node).unit, size)
        self.vol.settle_hidden(entry, size, sync=False)
        stored = True
        try:
            self.index.insert(space, key, entry.node.ino, size, sum_unit, sums)
        except FileExistsError:
            stored = False  # another writer won; this copy is dropped below
        del session.pending[entry.node.ino]
        self.vol.release(entry.node.ino)
        evicted = self.index.enforce(space) if stored else 0
        return {"ok": True, "stored": stored, "evicted": evicted}

    def _get(self, msg: dict[str, Any], session: Session, space: Namespace
             ) -> tuple[dict[str, Any], list[int]]:
        """Layout, checksums and read descriptors of each present key (None: a miss)."""
        pin = bool(msg.get("pin", False))
        inline_max = int_field(msg, "inline_max", 0)
        budget = INLINE_REPLY  # base64 of what rides inline must stay under MAX_PAYLOAD
        out: list[dict[str, Any] | None] = []
        fds: list[int] = []
        try:
            for key in _keys(msg):
                chunk = self.index.lookup(space, key)
                if chunk is None:
                    out.append(None)
                    continue
                node = self.vol.store.get(chunk.ino)
                sums = {"size": chunk.size, "sum_unit": chunk.sum_unit,
                        "sums": base64.b64encode(chunk.sums).decode()}
                if chunk.size <= min(inline_max, budget):  # small: the bytes ride in the reply
                    budget -= chunk.size
                    out.append({**sums, "data": base64.b64encode(self._read(node)).decode()})
                    continue
                which, got = read_fds(self.vol, node)
                fds += got
                if len(fds) > MAX_FDS:
                    raise OSError(errno.E2BIG, f"ask for fewer keys at once (over {MAX_FDS} "
                                  "descriptors)")
                if pin:
                    chunk.pins += 1
                    session.pins[(space.name, key)] += 1
                out.append({**sums, "layout": self.vol.layout(node).describe(),
                            "members": which["members"]})
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return {"ok": True, "chunks": out}, fds

    def _read(self, node: Inode) -> bytes:
        chunks = ChunkFiles(self.vol.pool, node.ino, self.vol.layout(node))
        try:
            buf = bytearray(node.size)
            chunks.read(0, memoryview(buf))
            return bytes(buf)
        finally:
            chunks.close()

    def _unpin(self, session: Session, space: Namespace, keys: list[bytes]) -> None:
        for key in keys:
            if session.pins[(space.name, key)] > 0:
                session.pins[(space.name, key)] -= 1
                chunk = space.chunks.get(key)
                if chunk is not None and chunk.pins:
                    chunk.pins -= 1

    def release(self, session: Session) -> None:
        """The connection closed: its read leases end."""
        for (ns, key), n in session.pins.items():
            chunk = self.index.spaces[ns].chunks.get(key) if ns in self.index.spaces else None
            if chunk is not None:
                chunk.pins = max(0, chunk.pins - n)
        session.pins.clear()

    def flush(self) -> None:
        self.index.flush()

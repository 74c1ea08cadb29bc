"""KV puts on a reading node: sent on to the writer, whose KV tier holds the pool's chunks.

A reading node keeps no KV index and no members, so what its users put goes to the
writer node's chunk service (KPUT, `proto/chunk_wire.py`), which judges each chunk as
a put of that user there (the namespace and its mode, quotas, room): a prefix an
instance on this node computed is a hit on every node of the pool.  Small chunks come
in `kv_put` and are sent on from a worker thread.  Larger ones are written by the
caller as on the writer, through `kv_create` and `kv_commit`, but into a memfd of this
daemon's, sealed against growing and shrinking (the caller's own descriptor writes
it); at commit its bytes go to the writer with sendfile.  The control socket takes no
descriptors, so nothing a caller holds is ever sent on.

A memfd's pages are memory this node holds for the caller, so one uid has at most
`max_kv_lent_per_user` bytes of them at once (the limit of KV copies lent to it,
`fs/kv_follow.py`), and each goes once its commit is answered or its connection
closes.  Claims, deletes and evictions stay the writer node's.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import itertools
import os
from collections import Counter
from dataclasses import dataclass

import trio

from mxfs.fs.fields import BadField, Msg, b64_field, bool_field, int_field
from mxfs.fs.kv_fields import keys_field
from mxfs.fs.limits import Limits
from mxfs.fs.session import Answer, Session
from mxfs.io.layout import Layout
from mxfs.pool.remote import RemoteMembers
from mxfs.proto.chunk_wire import MAX_KPUT, MAX_KPUT_GROUPS
from mxfs.proto.messages import KVCommitReply, KVCreateReply, KVPutReply
from mxfs.vol.access import Caller
from mxfs.vol.kv_index import check_key, check_namespace

SENDERS = 4  # chunks sent on to the writer at once (worker threads), all callers together
_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_MEMFD_UNIT = 1 << 30  # the one-member layout a caller writes its memfd through


@dataclass
class _Pending:
    """A chunk a caller is writing into a memfd of ours."""

    fd: int
    size: int
    uid: int


class ForwardedPuts:
    """`kv_put`, `kv_create` and `kv_commit` of a reading node."""

    def __init__(self, remote: RemoteMembers | None, limits: Limits) -> None:
        self.remote = remote
        self.limits = limits
        self._senders = trio.CapacityLimiter(SENDERS)
        self._handles = itertools.count(1)
        self._pending: dict[int, dict[int, _Pending]] = {}  # by id(session)
        self.held_by_uid: Counter[int] = Counter()  # bytes of memfds, by caller

    async def put(self, msg: Msg, session: Session) -> Answer[KVPutReply]:
        keys, data = keys_field(msg), msg.get("data")
        if not isinstance(data, list) or len(data) != len(keys):
            raise BadField(msg, "needs 'data': one base64 string per key")
        chunks = []
        for b64 in data:
            if not isinstance(b64, str):
                raise BadField(msg, "'data' holds base64 strings")
            try:
                chunks.append(base64.b64decode(b64, validate=True))
            except ValueError:
                raise BadField(msg, "'data' is not base64") from None
        stored = [await self._send(msg, session.caller, key, raw)
                  for key, raw in zip(keys, chunks, strict=True)]
        return {"stored": stored, "evicted": 0}, []

    async def create(self, msg: Msg, session: Session) -> Answer[KVCreateReply]:
        check_key(b64_field(msg, "key"))
        size = int_field(msg, "size")
        if size > MAX_KPUT:
            raise OSError(errno.EFBIG, f"a KV chunk put on a reading node is at most "
                          f"{MAX_KPUT} bytes")
        uid = session.caller.uid
        if self.held_by_uid[uid] + size > self.limits.max_kv_lent_per_user:
            raise OSError(errno.ENOSPC, f"uid {uid} is writing {self.held_by_uid[uid]} bytes "
                          "of KV chunks on this node, the limit (max_kv_lent_per_user): "
                          "commit those first")
        fd = os.memfd_create("mxfs-kv-put", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            # The caller's own open of it: its flags (a failed O_DIRECT) are not ours.
            theirs = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        handle = next(self._handles)
        self._pending.setdefault(id(session), {})[handle] = _Pending(fd, size, uid)
        self.held_by_uid[uid] += size
        layout = Layout(_MEMFD_UNIT, 1, 0, 1)
        return {"exists": False, "ino": handle, "layout": layout.describe(),
                "members": [0]}, [theirs]

    async def commit(self, msg: Msg, session: Session) -> Answer[KVCommitReply]:
        handle = int_field(msg, "ino")
        pending = self._pending.get(id(session), {}).get(handle)
        if pending is None:
            raise OSError(errno.EBADF, f"{handle} is not a KV chunk written here")
        key, size = check_key(b64_field(msg, "key")), int_field(msg, "size")
        try:
            if size > pending.size:
                raise OSError(errno.EFBIG, f"a commit of {size} bytes for {pending.size} "
                              "declared at kv_create")
            stored = await self._send(msg, session.caller, key, (pending.fd, size))
        finally:
            self._drop(session, handle)
        return {"stored": stored, "evicted": 0}, []

    async def _send(self, msg: Msg, caller: Caller, key: bytes,
                    chunk: bytes | tuple[int, int]) -> bool:
        """One chunk to the writer as `caller`'s put: stored, or there already."""
        if self.remote is None:
            raise OSError(errno.EIO, "this node reaches no writer node")
        namespace = check_namespace(msg.get("namespace"))
        mode = int_field(msg, "mode", 0) if msg.get("mode") is not None else 0
        if mode > 0o777:
            raise BadField(msg, "'mode' is a permission mode from 0 to 0777")
        groups = sorted(caller.gids - {caller.gid})[:MAX_KPUT_GROUPS]
        remote = self.remote
        return await trio.to_thread.run_sync(
            lambda: remote.kv_put((caller.uid, caller.gid, groups), namespace, mode,
                                  bool_field(msg, "shared"), check_key(key), chunk),
            limiter=self._senders)

    def _drop(self, session: Session, handle: int) -> None:
        pending = self._pending.get(id(session), {}).pop(handle, None)
        if pending is None:
            return
        os.close(pending.fd)
        self.held_by_uid[pending.uid] -= pending.size
        if self.held_by_uid[pending.uid] <= 0:
            del self.held_by_uid[pending.uid]
        if not self._pending.get(id(session), True):
            del self._pending[id(session)]

    def release(self, session: Session) -> None:
        """The connection closed: the chunks it did not commit go."""
        for handle in list(self._pending.get(id(session), {})):
            self._drop(session, handle)

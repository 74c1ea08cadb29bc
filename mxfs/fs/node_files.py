"""Direct writes on a node that holds members: its bytes on its own members, its
names through the pool's writer.

A checkpoint rank (or any direct writer: `mxfs.client.writer`) on node b writes where
it runs, as the reference design's ranks write their own node's drives.  b's daemon
asks the writer node for a hidden file placed on b's members (`node_create`, a KREQ
of the chunk protocol, as the caller: the writer checks the caller may create the
path, its limits and quotas, and holds the file for node b under b's epoch), opens
the chunk files on its own members and hands their descriptors to the caller.  At
commit b checks the writer kept to its declared size and closed every descriptor,
cuts and syncs the chunk files, and asks the writer to name and seal the file
(`node_commit`); an abort, or the caller's connection ending, drops it
(`node_abort`), and the writer removes the chunk files through b's chunk service as
for any orphan.  A node that dies leaves its unpublished files to the writer, which
drops them once the node's lease under that epoch ran out.

`NodeFiles` is the writer's side; `ForwardedFiles` the node's (`fs/file_ops.py` calls
it on a node that holds members).
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from mxfs.fs.fields import Msg, bool_field, int_field, path_field
from mxfs.fs.limits import Limits
from mxfs.fs.session import Pending, Session, check_pending_room, refuse_if_degraded
from mxfs.meta import Inode
from mxfs.pool.remote import RemoteMembers
from mxfs.proto.chunk_wire import MAX_KPUT_GROUPS
from mxfs.proto.messages import FileReply
from mxfs.vol.access import Caller, owner_for, resolve_parent_for
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.control")

# Publishes a held file as FileOps.commit does: (pending, its session, size, replace,
# the msg with its sums) -> its description.
Publish = Callable[[Pending, Session, int, bool, Msg], Awaitable[FileReply]]


@dataclass
class NodeFile:
    """An unpublished file the writer holds for a node's caller."""

    session: Session  # (the caller's, on the writer: its limits and quotas)
    node: str
    epoch: int


class NodeFiles:
    """The writer's side: hidden files placed on other nodes' members, held for their
    callers until those nodes commit or drop them (or die)."""

    def __init__(self, vol: Volume, mountpoint: str, limits: Limits,
                 pending_by_uid: Counter[int], publish: Publish) -> None:
        self.vol, self.mountpoint, self.limits = vol, mountpoint, limits
        self.pending_by_uid = pending_by_uid
        self.publish = publish
        self.files: dict[int, NodeFile] = {}

    async def request(self, caller: Caller, op: str, msg: dict[str, Any]
                      ) -> dict[str, Any]:
        """One of NODE_FILE_OPS a node asked for `caller`."""
        name, epoch = _node(msg)
        if self.vol.reader_epochs.get(name) != epoch:
            raise OSError(errno.ESTALE, f"node {name} is not alive under epoch {epoch}")
        if op == "node_create":
            return dict(self._create(caller, msg, name, epoch))
        held = self._held(caller, msg, name)
        ino = int_field(msg, "ino")
        if op == "node_commit":
            size = int_field(msg, "size")
            pending = held.session.pending[ino]
            del self.files[ino]  # (not the sweep's while it is published)
            if size > pending.declared:
                self._drop(held, ino)
                raise OSError(errno.EFBIG, f"wrote past the {pending.declared} bytes "
                              "declared at create: refused, and the file dropped")
            try:
                return dict(await self.publish(pending, held.session, size,
                                               bool_field(msg, "replace", True), msg))
            except BaseException:
                if ino in held.session.pending:  # still unpublished: held as before
                    self.files[ino] = held
                raise
        if op == "node_abort":
            del self.files[ino]
            self._drop(held, ino)
            return {}
        raise OSError(errno.EPERM, f"{op[:32]} is not asked of another node")

    def _create(self, caller: Caller, msg: Msg, node: str, epoch: int) -> FileReply:
        """A hidden file on `node`'s members to be published at the path, as `create`
        makes one on the writer's own."""
        path, size = path_field(msg), int_field(msg, "size", 0)
        mode = int_field(msg, "mode", 0o644) & 0o7777
        session = Session(caller, self.pending_by_uid, quotas=self.vol.quotas)
        check_pending_room(session, self.limits)  # (the uid's: the session is new)
        self.vol.quotas.room(caller.uid, size, 1)
        if not self.vol.pool.held_by(node):
            raise OSError(errno.EROFS, f"node {node} holds no members of the pool")
        store = self.vol.store
        parent, name = resolve_parent_for(store, path, caller, self.mountpoint)
        if bool_field(msg, "exclusive") and store.entry_ino(parent.ino, name) is not None:
            raise OSError(errno.EEXIST, f"{path} exists")
        mode, gid = owner_for(parent, mode, caller.uid, caller.gid, caller.gids.__contains__)
        refuse_if_degraded(self.vol)
        entry = self.vol.create_hidden(parent, mode, caller.uid, gid, node=node)
        session.hold(Pending(entry, path, size))
        self.files[entry.node.ino] = NodeFile(session, node, epoch)
        return describe(self.vol, entry.node)

    def _held(self, caller: Caller, msg: Msg, node: str) -> NodeFile:
        held = self.files.get(int_field(msg, "ino"))
        if held is None or held.node != node or held.session.caller.uid != caller.uid:
            raise OSError(errno.EBADF, f"inode {msg.get('ino')} is not being written for "
                          f"uid {caller.uid} on node {node}")
        return held

    def _drop(self, held: NodeFile, ino: int) -> None:
        """Forget an unpublished file: an orphan, its chunk files removed through its
        node after the next commit."""
        held.session.let_go(ino)
        self.vol.release(ino)

    def sweep(self) -> None:
        """(Once a second.)  Drop the files of nodes whose lease ran out, or that joined
        again since: a node that died never says it let them go."""
        alive = self.vol.reader_epochs
        for ino, held in list(self.files.items()):
            if alive.get(held.node, held.epoch + 1) > held.epoch:
                log.info("unpublished file %d of node %s (epoch %d) dropped: its lease "
                         "ran out", ino, held.node, held.epoch)
                del self.files[ino]
                self._drop(held, ino)


class ForwardedFiles:
    """A node's side: creates, commits and aborts of files on its own members, asked
    of the writer as the caller, on the writer's connection's threads."""

    def __init__(self, vol: Volume) -> None:
        self.vol = vol

    def _remote(self) -> RemoteMembers:
        remote = self.vol.pool.remote
        assert remote is not None  # (a node's pool reaches its writer)
        return remote

    def _node(self) -> list[Any]:
        held = self.vol.lease
        return [self.vol.pool.node, held.epoch if held is not None else 0]

    async def ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """`op` asked of the writer for `caller` (blocking round trips, off this thread)."""
        remote, who = self._remote(), _who(caller)
        body = {**body, "node": self._node()}
        return await trio.to_thread.run_sync(
            lambda: remote.submit(remote.kv_request, who, op, body).result())

    def abort_later(self, caller: Caller, ino: int) -> None:
        """Ask the writer to drop `ino` without waiting (a connection that ended); if
        it is not told, it drops the file when this node's lease ends."""
        remote = self._remote()
        body = {"ino": ino, "node": self._node()}

        def abort() -> None:
            try:
                remote.kv_request(_who(caller), "node_abort", body)
            except OSError as e:
                log.info("the writer was not told to drop unpublished file %d (%s): it "
                         "drops it when this node's lease ends", ino, e)
        remote.submit(abort)

    def check_writable(self) -> None:
        if not self.vol.pool.local_members():
            raise OSError(errno.EROFS, f"node {self.vol.pool.node} holds no members: write "
                          "on the writer node, or on a node that holds members")


def describe(vol: Volume, node: Inode, sealed: bool = False) -> FileReply:
    out: FileReply = {"ino": node.ino, "size": node.apparent_size,
                      "generation": node.generation, "mode": node.mode, "sealed": sealed}
    if node.is_reg:
        out["layout"] = vol.layout(node).describe()
    return out


def _node(msg: Msg) -> tuple[str, int]:
    node = msg.get("node")
    if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)
            and node[0] and isinstance(node[1], int)):
        raise OSError(errno.EINVAL, "a node's file request names the node: [name, epoch]")
    return node[0], node[1]


def _who(caller: Caller) -> tuple[int, int, list[int]]:
    """A caller as the writer is told it: uid, gid and (some of) its other groups."""
    return caller.uid, caller.gid, sorted(caller.gids - {caller.gid})[:MAX_KPUT_GROUPS]

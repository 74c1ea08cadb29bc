"""Direct reads on a reading node: connections to the owner's chunk service, each
narrowed to one file, handed to the reader.

On the owner node the direct path hands a reader the file's chunk files.  A reading
node holds none: its daemon would otherwise have to carry every byte of a model
through its own process (the mount reads at a quarter of what the link carries, six
copies a byte on two CPUs).  So `open_read` there, once the caller may read the
file, opens connections to the owner's chunk service itself (the pool key proved
both ways), narrows each for good to this inode and generation (SCOPE,
`proto/chunk_wire.py`), and sends them to the caller; the caller (`client/remote_file.py`)
asks for its member ranges and receives the bytes straight into its buffers.  It
holds no key, and the owner serves such a connection that inode only, while it is
that file, for SCOPE_S at most.

The connections cost the owner's service and this daemon descriptors, so they are a
right that ends: the daemon keeps its own copy of each (a `Grant`) and shuts it down
(for the reader too: a shutdown acts on the socket, not the descriptor) when the
reader closes the file (`close_read`), when its control connection ends, after
GRANT_S, and at unmount.  One uid holds at most `max_remote_reads_per_user`
connections and all users `max_remote_reads`; past either, the open answers EREMOTE
and the reader reads through the mount, as before.

An open waits on the owner (its handshakes, on the owner's threads), which a slow or
stopped owner makes long, so it waits on OPENERS threads of its own, handed out by
tenant in turn (`fair.RoundRobin`, one holding 3 in 4): on trio's default threads,
three users' opens held all 40 of them, and every other call of the daemon that
takes one (tenants, checkpoints, `mxfs df`) waited on that owner.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import trio

from mxfs.fs.fair import RoundRobin
from mxfs.fs.fields import Msg, int_field
from mxfs.fs.limits import Limits
from mxfs.fs.session import Answer, Handler, Session
from mxfs.io.chunk_client import ChunkClient
from mxfs.meta import Inode
from mxfs.proto.chunk_wire import SCOPE_S, WireError
from mxfs.proto.messages import Empty, RemoteGrant, RemoteReadsStatus
from mxfs.vol.volume import Volume

CONNS = 8  # connections one open gets at most (a member each, up to this)
GRANT_S = SCOPE_S  # the daemon shuts a grant down after this, as the owner would
OPENERS = 8  # opens waiting on the owner at once (as many as its threads here serve)


@dataclass
class Grant:
    """Connections one open handed to one reader."""

    id: int
    session: Session
    socks: list[socket.socket]
    until: float  # trio's clock

    @property
    def uid(self) -> int:
        return self.session.caller.uid


class RemoteReads:
    def __init__(self, vol: Volume, limits: Limits) -> None:
        self.vol, self.limits = vol, limits
        self.grants: dict[int, Grant] = {}
        self.by_uid: Counter[int] = Counter()  # connections held (and being opened), by
        #                                      tenant (a user's subordinate uids with her)
        self.held = 0
        self.refused = 0  # opens sent to the mount: a limit was reached
        self._ids = itertools.count(1)
        self._openers = RoundRobin(OPENERS, OPENERS * 3 // 4)
        self._threads = trio.CapacityLimiter(OPENERS)  # (a slot of _openers holds one)

    def handlers(self) -> dict[str, Handler]:
        return {"close_read": self.close_read}

    def status(self) -> RemoteReadsStatus:
        return {"grants": len(self.grants), "connections": self.held,
                "refused": self.refused}

    async def open(self, files: list[Inode], members: int, session: Session
                   ) -> tuple[RemoteGrant, list[int]]:
        """Connections to the owner scoped to `files` (a connection a member holding
        their bytes, up to CONNS) and their descriptors for the caller; EREMOTE past
        the limits (the caller reads through the mount, or has the bytes copied)."""
        self.sweep()
        uid, tenant, lim = session.caller.uid, session.tenant, self.limits
        n = min(members, CONNS, lim.max_remote_reads - self.held,
                lim.max_remote_reads_per_user - self.by_uid[tenant])
        if n < 1:
            self.refused += 1
            raise OSError(errno.EREMOTE, "this node's direct reads of other nodes are all "
                          "in use (max_remote_reads, max_remote_reads_per_user): read "
                          "through the mount")
        self._count(tenant, n)  # before the wait: opens meanwhile see them taken
        try:
            async with self._openers.slot(tenant):
                socks, owner = await trio.to_thread.run_sync(
                    self._connect, [(f.ino, f.generation) for f in files], n, uid,
                    limiter=self._threads)
        except BaseException:
            self._count(tenant, -n)
            raise
        grant = Grant(next(self._ids), session, socks, trio.current_time() + GRANT_S)
        self.grants[grant.id] = grant
        return ({"grant": grant.id, "node": owner.node, "addr": owner.addr,
                 "epoch": owner.epoch},
                [os.dup(s.fileno()) for s in socks])

    def _connect(self, files: list[tuple[int, int]], n: int, uid: int
                 ) -> tuple[list[socket.socket], Any]:
        """(Blocking.)  `n` proved connections to the owner, each scoped to `files`
        (inode, generation) for a reader of `uid`, made at once (a few round trips
        each)."""
        remote = self.vol.pool.remote
        assert remote is not None  # (a reading node's pool)

        def one() -> ChunkClient:
            kept, client = remote.connect(idle=True, wait=False)  # (busy: the mount)
            while True:
                try:
                    client.scope(files, uid)
                    return client
                except BaseException as e:
                    remote.let_go(client.sock)
                    client.close()
                    if not (kept and isinstance(e, (OSError, WireError))):
                        raise
                kept, client = remote.connect(wait=False)  # the owner closed a kept one

        futures = [remote.submit(one) for _ in range(n)]  # (the owner's threads)
        concurrent.futures.wait(futures)
        clients = [f.result() for f in futures if f.exception() is None]
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        owner = remote.owner
        if failed is None and owner is None:  # (no writer since: its lease gone)
            failed = OSError(errno.EIO, "the writer node gave the pool back")
        if failed is not None:
            for c in clients:
                remote.let_go(c.sock)
                c.close()
            if isinstance(failed, OSError) and failed.errno in (errno.EMFILE, errno.EBUSY):
                raise OSError(errno.EREMOTE, f"the owner serves as many direct readers as "
                              f"it may ({failed.strerror}): read through the mount") from None
            if isinstance(failed, (OSError, WireError)):
                raise OSError(errno.EIO, str(failed)) from None
            raise failed
        assert owner is not None  # (a failure otherwise, above)
        # The next grant takes proved connections, not a handshake each (1-2 ms).
        with contextlib.suppress(RuntimeError):  # (its threads ended: unmounting)
            remote.submit(remote.top_up, n)
        return [c.sock for c in clients], owner

    async def close_read(self, msg: Msg, session: Session) -> Answer[Empty]:
        """A reader is done with a grant of this connection's; one that ended already
        (its time ran out, the mount went) or is not the connection's is left alone."""
        grant = self.grants.get(int_field(msg, "grant"))
        if grant is not None and grant.session is session:
            self._end(grant)
        return {}, []

    def release(self, session: Session) -> None:
        """A connection closed: the reads it was handed end."""
        for grant in [g for g in self.grants.values() if g.session is session]:
            self._end(grant)

    def sweep(self) -> None:
        """End the grants whose time is up."""
        now = trio.current_time()
        for grant in [g for g in self.grants.values() if g.until < now]:
            self._end(grant)

    def close_all(self) -> None:
        for grant in list(self.grants.values()):
            self._end(grant)

    def _end(self, grant: Grant) -> None:
        del self.grants[grant.id]
        self._count(grant.session.tenant, -len(grant.socks))
        remote = self.vol.pool.remote
        for s in grant.socks:
            if remote is not None:
                remote.let_go(s)
            try:
                s.shutdown(socket.SHUT_RDWR)  # the reader's copy too
            except OSError:
                pass  # the owner closed it already
            s.close()

    def _count(self, uid: int, n: int) -> None:
        self.held += n
        self.by_uid[uid] += n
        if not self.by_uid[uid]:
            del self.by_uid[uid]

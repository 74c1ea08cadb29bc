"""The daemon's control socket: a Unix socket for direct clients.

Each connection is served in its own trio task; a malformed, oversized or
unknown message gets an error reply and the connection is closed, while the
daemon goes on serving others.  The caller's identity comes from SO_PEERCRED
and every path is resolved with the caller's permissions.
"""

from __future__ import annotations

import array
import errno
import logging
import math
import os
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from mxfs import __version__
from mxfs.fs import quota
from mxfs.fs.access import (
    R_OK,
    Caller,
    may,
    may_replace,
    owner_for,
    resolve_for,
    resolve_parent_for,
    supplementary_groups,
)
from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import Turns
from mxfs.fs.fields import bool_field, check_request, int_field, path_field, sums_field
from mxfs.fs.foreign_fds import Closer, refuse_rights
from mxfs.fs.inflight import park, unread_bytes
from mxfs.fs.kv import KVIndex
from mxfs.fs.kv_ops import KV_OPS, KVOps
from mxfs.fs.limits import Limits, fd_limit, open_fds
from mxfs.fs.metrics import Metrics
from mxfs.fs.mounts import ensure_runtime_dir
from mxfs.fs.session import (
    Pending,
    Session,
    check_pending_room,
    cut_back,
    drop_pending,
    open_hidden,
    overdrew,
    read_fds,
    refuse_if_writers,
)
from mxfs.fs.surveys import Surveys
from mxfs.fs.volume import Volume
from mxfs.fs.wake import WakeLatency
from mxfs.io.batch import ENGINE, native_engine, taken_back
from mxfs.meta import Inode
from mxfs.meta.survey import bytes_by_use
from mxfs.proto import (
    HEADER,
    MAX_FDS,
    MAX_VALUES,
    OPS,
    VERSION,
    ProtocolError,
    decode_payload,
    encode,
    parse_header,
)
from mxfs.proto.framing import ancillary_space, fds_from_ancdata

log = logging.getLogger("mxfs.control")
# Refused connections answered at once (each holds a descriptor until its reply is taken).
MAX_REFUSING = 64


def runtime_dir() -> str:
    """Where sockets and logs of running daemons live."""
    if os.geteuid() == 0:
        return "/run/mxfs"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/mxfs-{os.getuid()}"
    return os.path.join(base, "mxfs") if "XDG_RUNTIME_DIR" in os.environ else base


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13


def peer_caller(sock: Any) -> Caller:
    """Who is at the other end, as of connect: SO_PEERCRED and SO_PEERGROUPS (taken by
    the kernel then, so a pid that exited and was reused cannot lend its groups)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 65536)
        groups = set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:  # an older kernel: the groups from /proc
        groups = supplementary_groups(pid)
    return Caller(pid, uid, gid, frozenset(groups | {gid}))


class ControlServer:
    def __init__(self, volume: Volume, path: str, mountpoint: str,
                 writeback_cache: bool = False,
                 entry_changed: Callable[[int, bytes], Awaitable[None]] | None = None,
                 metrics: Metrics | None = None, limits: Limits | None = None,
                 only_uid: int | None = None,
                 settle: Callable[[int], Awaitable[None]] | None = None,
                 wake: WakeLatency | None = None) -> None:
        self.writeback_cache = writeback_cache
        self.wake = wake  # the CPU latency limit held while busy (-o wake_latency_us)
        # Waits until the mount's answered writes of an inode are on its members, so a
        # direct reader sees them (the mount lands writes behind their answers).
        self.settle = settle
        # A mount without allow_other serves its owner alone; so does this socket.
        self.only_uid = only_uid
        self.vol = volume
        self.path = path
        self.mountpoint = mountpoint
        # Told about names that commits create or replace, so the kernel's cached
        # entries (including "no such name") are dropped.
        self.entry_changed = entry_changed
        self.metrics = metrics or Metrics()
        self.limits = limits or Limits()
        self.kv = KVOps(volume, KVIndex(volume, self.limits.max_namespaces_per_user),
                        self.limits)
        self.surveys = Surveys(volume.pool.meta_location, volume.store.commit)
        self.conns: Counter[int] = Counter()  # open connections by uid
        self.sessions: dict[int, Session] = {}
        self.pending_by_uid: Counter[int] = Counter()  # unpublished files, all connections
        self.refusing = 0  # refused connections being answered
        self.failures = FailureLog(log)
        self.turns = Turns(self.limits.max_active_per_user)  # requests in service by uid
        self.closer = Closer()  # descriptors clients sent anyway (kernels before 6.16)

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ensure_runtime_dir(os.path.dirname(self.path))
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not refuse_rights(listener):
            log.info("this kernel cannot refuse sent descriptors: they are closed off "
                     "the daemon's thread")
        await listener.bind(self.path)
        os.chmod(self.path, 0o666)  # anyone may connect; each request is checked
        listener.listen(512)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as e:  # out of descriptors: refuse by waiting, go on
                        self.failures.note("accept", None, e)
                        await trio.sleep(0.05)
                        continue
                    nursery.start_soon(self._connection, conn)
        finally:
            listener.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    async def _recv_exact(self, conn: Any, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            chunk = await conn.recv(min(n - got, 1 << 16))
            if not chunk:
                raise ConnectionError("peer closed mid-message")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _admit(self, caller: Caller) -> OSError | None:
        """Why a new connection of `caller` is refused (a limit is reached), or None."""
        lim = self.limits
        total = sum(self.conns.values())
        if total >= lim.max_conns or total + lim.fd_reserve >= fd_limit():
            return OSError(errno.ENFILE, f"the daemon holds {total} control connections, its "
                           "limit (mount option max_conns); try again later")
        if caller.uid != 0 and self.conns[caller.uid] >= lim.max_conns_per_user:
            return OSError(errno.EMFILE, f"uid {caller.uid} holds {self.conns[caller.uid]} "
                           "control connections, the limit (mount option "
                           "max_conns_per_user); close some")
        return None

    async def _connection(self, conn: Any) -> None:
        """One connection, inside a boundary: nothing it does ends the server."""
        try:
            await self._connected(conn)
        except Exception as e:
            self.failures.note("connection", None, e)

    async def _connected(self, conn: Any) -> None:
        with conn:
            try:
                caller = peer_caller(conn)
            except OSError:
                return
            refusal = self._admit(caller)
            if refusal is not None:
                self.failures.note("connect", caller, refusal, trace=False)
                if self.refusing < MAX_REFUSING:  # past it, a flood is closed unanswered
                    self.refusing += 1
                    try:
                        await self._close_with(conn, None, refusal.errno or errno.EAGAIN,
                                               refusal.strerror or "refused")
                    finally:
                        self.refusing -= 1
                return
            session = Session(caller, self.pending_by_uid, conn=conn,
                              quotas=self.vol.quotas)
            self.conns[caller.uid] += 1
            self.sessions[id(session)] = session
            try:
                await self._serve(conn, session)
            except Exception as e:
                self.failures.note("connection", caller, e)
            finally:
                self._end_session(session)
                if session.sent_fds and unread_bytes(conn):
                    await park(conn)  # its descriptors in flight: still counted
                del self.sessions[id(session)]
                self.conns[caller.uid] -= 1
                if not self.conns[caller.uid]:
                    del self.conns[caller.uid]

    def _all_pending(self) -> list[Pending]:
        return [p for s in self.sessions.values() for p in s.pending.values()]

    def trim_overdrafts(self) -> int:
        """Now, on this thread: cut every unpublished file's chunk files back to what its
        writer declared (the metadata member runs short).  How many were cut."""
        cut = cut_back(self.vol, self._all_pending())
        if cut:
            log.warning("metadata member short of space: cut %d chunk files of unpublished "
                        "files back to their declared sizes", cut)
        return cut

    async def revoke(self) -> None:
        """Once a second (a task of the daemon): unpublished files cut back to their
        declared sizes, held chunk files of dropped ones cut or removed (pool/revoke.py);
        in a worker thread, as both stat and truncate files."""
        cut = await trio.to_thread.run_sync(cut_back, self.vol, self._all_pending())
        if cut:
            log.warning("cut %d chunk files of unpublished files back to the sizes their "
                        "writers declared", cut)
        if self.vol.held.files:
            await trio.to_thread.run_sync(self.vol.held.sweep)

    def _end_session(self, session: Session) -> None:
        for ino in list(session.pending):
            try:
                self._drop(session, ino)
            except Exception as e:
                self.failures.note("release", session.caller, e)
        try:
            self.kv.release(session)
        except Exception as e:
            self.failures.note("release", session.caller, e)

    async def _read_request(self, conn: Any, session: Session) -> dict[str, Any] | None:
        """The next request, or None when the connection is over (closed, idle, too slow).

        A connection holding nothing is closed after `idle_timeout`; once a message
        has begun it must arrive whole within `frame_timeout`.
        """
        lim = self.limits
        head = None
        holds = session.pending or session.pinned
        with trio.move_on_after(math.inf if holds else lim.idle_timeout):
            try:
                head, anc, _, _ = await conn.recvmsg(HEADER.size, ancillary_space())
            except OSError:
                return None
            # No request carries descriptors; never closed here (see foreign_fds).
            self.closer.close_all(fds_from_ancdata(anc))
        if not head:
            return None  # closed, or idle too long
        try:
            with trio.fail_after(lim.frame_timeout):
                if len(head) < HEADER.size:
                    head += await self._recv_exact(conn, HEADER.size - len(head))
                _, _, length = parse_header(head)
                msg = decode_payload(await self._recv_exact(conn, length), MAX_VALUES)
            check_request(msg)
            return msg
        except trio.TooSlowError:
            self.failures.note("slow", session.caller,
                               TimeoutError("a request not sent whole in time"), trace=False)
        except ProtocolError as e:
            await self._refuse(conn, session.caller, None, e)
        except OSError:
            pass  # the peer went away mid-message
        return None

    async def _serve(self, conn: Any, session: Session) -> None:
        while True:
            msg = await self._read_request(conn, session)
            if msg is None:
                return
            op = msg["op"]
            fds: list[int] = []
            try:
                async with self.turns.turn(session.caller.uid):
                    with self.metrics.timed("control", op if op in OPS else "unknown"):
                        reply, fds = await self._dispatch(msg, session)
            except ProtocolError as e:
                await self._refuse(conn, session.caller, msg.get("id"), e)
                return
            except OSError as e:
                code = e.errno or errno.EIO
                reply = {"ok": False, "errno": code, "error": e.strerror or os.strerror(code)}
            except Exception as e:  # a bug or an unforeseen value: this request alone fails
                self.failures.note(op, session.caller, e)
                reply = {"ok": False, "errno": errno.EIO,
                         "error": f"internal error serving {op} (logged by the daemon)"}
            if fds:
                reply, fds = self._admit_fds(session, reply, fds)
            reply["id"] = msg.get("id")
            del msg  # not held while the connection waits for its next request
            try:
                with trio.move_on_after(self.limits.frame_timeout) as scope:
                    try:
                        sent = await self._send(conn, reply, fds)
                    except ProtocolError as e:  # a reply over the limits: say so, stay up
                        sent = await self._send(conn, {"id": reply["id"], "ok": False,
                                                       "errno": errno.E2BIG, "error": str(e)})
                session.sent_fds += len(fds)
                if not sent or scope.cancelled_caught:
                    return  # the peer went away or does not read its replies
            finally:
                for fd in fds:
                    os.close(fd)  # the peer holds its own copies now
            del reply

    def fds_in_flight(self, uid: int) -> int:
        """Descriptors sent to `uid`'s connections that they have not read yet (a
        connection with nothing unread has taken all it was sent)."""
        total = 0
        for s in self.sessions.values():
            if s.caller.uid == uid and s.sent_fds:
                if not unread_bytes(s.conn):
                    s.sent_fds = 0
                total += s.sent_fds
        return total

    def _admit_fds(self, session: Session, reply: dict[str, Any], fds: list[int]
                   ) -> tuple[dict[str, Any], list[int]]:
        """The reply as it may go: with its descriptors, or, past the caller's bound of
        descriptors in flight (root: none), an EMFILE without them."""
        uid, lim = session.caller.uid, self.limits.max_fds_in_flight_per_user
        if uid == 0:
            return reply, fds
        held = self.fds_in_flight(uid)
        if held + len(fds) <= lim:
            return reply, fds
        for fd in fds:
            os.close(fd)
        return {"ok": False, "errno": errno.EMFILE,
                "error": f"uid {uid} has {held} descriptors sent to it and not yet received "
                         f"(replies left unread), the limit (mount option "
                         "max_fds_in_flight_per_user): read your replies"}, []

    async def _refuse(self, conn: Any, caller: Caller, msg_id: Any, err: ProtocolError) -> None:
        self.failures.note("protocol", caller, err, trace=False)
        await self._close_with(conn, msg_id, errno.EPROTO, str(err))

    async def _close_with(self, conn: Any, msg_id: Any, code: int, error: str) -> None:
        """Send one refusal, then close gracefully: unread input would turn our close
        into a reset that destroys the reply before the peer reads it."""
        with trio.move_on_after(self.limits.frame_timeout):
            if not await self._send(conn, {"id": msg_id, "ok": False, "errno": code,
                                           "error": error}):
                return
            try:
                conn.shutdown(socket.SHUT_WR)
                with trio.move_on_after(1):
                    while await conn.recv(1 << 16):
                        pass
            except OSError:
                pass

    async def _send(self, conn: Any, reply: dict[str, Any], fds: Sequence[int] = ()) -> bool:
        data = memoryview(encode(reply, len(fds)))
        try:
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                data = data[await conn.sendmsg([data], anc):]
            while data:
                data = data[await conn.send(data):]
        except OSError:
            return False
        return True

    async def _dispatch(self, msg: dict[str, Any], session: Session
                        ) -> tuple[dict[str, Any], list[int]]:
        """Serve one request: (reply fields, descriptors to pass with it)."""
        caller = session.caller
        op = msg["op"]
        if op != "hello" and self.only_uid is not None and caller.uid != self.only_uid:
            raise OSError(errno.EACCES, f"the pool is mounted without allow_other: only uid "
                          f"{self.only_uid} may use it")
        if op == "hello":
            return {"ok": True, "version": VERSION, "server": f"mxfs {__version__}",
                    "pid": os.getpid(), "pool_uuid": self.vol.pool.uuid, "ops": list(OPS),
                    "uid": caller.uid}, []
        if op == "stat":
            status = await self.status()
            if caller.uid != 0:  # names of lost files may sit under others' 0700 folders
                status["lost_examples"] = []
                status["limits"]["by_user"] = {}  # (nor who else uses the daemon)
                status["quotas"] = self.vol.quotas.report(caller.uid) \
                    if self.vol.quotas.limits else None
            return {"ok": True, **status}, []
        if op == "layout":
            node = resolve_for(self.vol.store, path_field(msg), caller,
                               mountpoint=self.mountpoint)
            return self._describe(node), []
        if op == "open_read":
            return await self._open_read(msg, caller)
        if op == "create":
            return self._create(msg, session)
        if op == "commit":
            return await self._commit(msg, session), []
        if op == "kv_get":
            return await self.kv.get(msg, session)
        if op in KV_OPS:
            return await self.kv.handle(op, msg, session)
        if op == "metrics":
            return {"ok": True, **self.metrics.snapshot(), "members": self.vol.pool.usage()}, []
        if op == "df":
            return {"ok": True, "members": self.vol.pool.usage(),
                    "by_use": await self.surveys.get("by_use", bytes_by_use)}, []
        if op == "meta_backup":
            if caller.uid != 0:
                raise OSError(errno.EPERM, "only root backs up the metadata store")
            return {"ok": True, "path": await self.backup_meta()}, []
        if op == "meta_sync":
            if caller.uid != 0:
                raise OSError(errno.EPERM, "only root syncs the metadata store")
            await self.sync_meta()
            return {"ok": True}, []
        if op == "abort":
            self._drop(session, self._pending(msg, session).entry.node.ino)
            return {"ok": True}, []
        if op == "quota":
            return quota.serve(self.vol.quotas, msg, caller.uid), []
        raise ProtocolError(f"unknown op {op!r} (this daemon serves {', '.join(OPS)})")

    def _describe(self, node: Inode) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True, "ino": node.ino, "size": node.apparent_size,
                               "generation": node.generation, "mode": node.mode,
                               "sealed": self.vol.store.is_sealed(node.ino)}
        if node.is_reg:
            out["layout"] = self.vol.layout(node).describe()
        return out

    async def _open_read(self, msg: dict[str, Any], caller: Caller
                         ) -> tuple[dict[str, Any], list[int]]:
        """Read-only descriptors of a file's chunk files, if the caller may read it
        (with "odirect": O_DIRECT ones too, for reads that bypass the page cache)."""
        path = path_field(msg)
        node = resolve_for(self.vol.store, path, caller, mountpoint=self.mountpoint)
        if node.is_dir:
            raise OSError(errno.EISDIR, f"{path} is a directory")
        if not node.is_reg:
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if not may(node, caller, R_OK):
            raise OSError(errno.EACCES, f"{path}: read permission denied")
        entry = self.vol.open_inodes.get(node.ino)
        if self.writeback_cache and entry is not None and entry.wrote:
            # Its newest bytes may still sit in the kernel's writeback cache.
            raise OSError(errno.EBUSY, f"{path} is open for writing through the mount")
        if self.settle is not None and entry is not None:
            await self.settle(node.ino)
        # Two descriptors a member with O_DIRECT: only while one message can carry them.
        members = len(self.vol.layout(node).used_members())
        odirect = bool_field(msg, "odirect") and 2 * members <= MAX_FDS
        which, fds = read_fds(self.vol, node, odirect=odirect)
        return {**self._describe(node), **which}, fds

    # ---- direct writes -------------------------------------------------------

    def _create(self, msg: dict[str, Any], session: Session) -> tuple[dict[str, Any], list[int]]:
        """A hidden file to be published at `path`, and write descriptors of its chunk files.

        The caller must be allowed to create `path` (as the mount would), and the
        declared `size` must fit without eating the metadata store's reserve: it is
        also the most the commit will accept.
        """
        path, caller = path_field(msg), session.caller
        size = int_field(msg, "size", 0)
        mode = int_field(msg, "mode", 0o644) & 0o7777
        exclusive = bool_field(msg, "exclusive")
        check_pending_room(session, self.limits)
        self.vol.quotas.room(caller.uid, size, 1)
        parent, name = resolve_parent_for(self.vol.store, path, caller, self.mountpoint)
        if exclusive and self.vol.store.entry_ino(parent.ino, name) is not None:
            raise OSError(errno.EEXIST, f"{path} exists")
        layout = self.vol.pool.layout_for(0, parent.stripe_unit, parent.stripe_width)
        for m in layout.used_members():
            self.vol.pool.check_space(m, -(-size // layout.width))
        mode, gid = owner_for(parent, mode, caller.uid, caller.gid,
                              caller.gids.__contains__)
        entry, members, fds = open_hidden(self.vol, parent, mode, caller.uid, gid)
        session.hold(Pending(entry, path, size))
        reply = self._describe(entry.node)
        reply["members"] = members
        return reply, fds

    def _pending(self, msg: dict[str, Any], session: Session) -> Pending:
        pending = session.pending.get(int_field(msg, "ino"))
        if pending is None:
            raise OSError(errno.EBADF, f"inode {msg.get('ino')} is not being written here")
        return pending

    async def _commit(self, msg: dict[str, Any], session: Session) -> dict[str, Any]:
        """Publish a hidden file: settle its bytes, name it, seal it, make it durable.

        A writer that wrote past the size it declared at create is refused and its
        file reclaimed (its descriptors cannot be taken back, but its space can).
        """
        pending = self._pending(msg, session)
        entry, node = pending.entry, pending.entry.node
        size = int_field(msg, "size")
        replace = bool_field(msg, "replace", True)
        sum_unit, sums = sums_field(msg, self.vol.layout(node).unit, size)
        overdrawn = await trio.to_thread.run_sync(overdrew, self.vol, pending)
        if size > pending.declared or overdrawn:
            self._drop(session, node.ino)
            raise OSError(errno.EFBIG, f"wrote past the {pending.declared} bytes declared at "
                          "create: refused, and the file's space reclaimed")
        await trio.to_thread.run_sync(refuse_if_writers, self.vol, pending)
        # No other request of this connection runs meanwhile (one at a time), so the
        # file is still this session's after the awaits.
        await trio.to_thread.run_sync(self.vol.settle_hidden, entry, size)
        parent, name = resolve_parent_for(self.vol.store, pending.path, session.caller,
                                          self.mountpoint)
        old = self.vol.store.entry_ino(parent.ino, name)
        if old is not None and replace:
            may_replace(parent, self.vol.store.get(old), session.caller)
        self.vol.publish(entry, parent.ino, name, size, replace, sum_unit, sums)
        session.let_go(node.ino)
        self.vol.release(node.ino)
        lost = self.vol.store.groups_lost
        try:
            await self._durable()
        except OSError as e:
            if self.vol.store.groups_lost != lost:  # its group went: it was never named
                raise
            # Named in memory and in the open group (SQLite keeps it past a full member)
            raise OSError(e.errno, f"the file is published but not yet durable ({e.strerror}"
                          "); it is kept if the daemon lives until its next commit") from None
        finally:  # the mount shows what the daemon holds, durable or not
            if self.entry_changed is not None:
                await self.entry_changed(parent.ino, name)
        return self._describe(node)

    def _drop(self, session: Session, ino: int) -> None:
        drop_pending(self.vol, session, ino)

    async def sync_meta(self) -> None:
        """Write back what memory holds (sizes and times of open files), commit, fsync."""
        self.vol.store.flush_all()
        await self._durable()

    async def _durable(self) -> None:
        """Every change so far committed and on stable storage (the sync in a worker)."""
        self.vol.store.commit()
        await trio.to_thread.run_sync(self.vol.store.sync)

    async def backup_meta(self) -> str:
        """Sync, then copy the metadata store online to the next member."""
        await self.sync_meta()
        path = await trio.to_thread.run_sync(self.vol.backup_meta)
        log.info("metadata backed up to %s", path)
        return path

    async def status(self) -> dict[str, Any]:
        """The pool as `mxfs status` shows it."""
        pool = self.vol.pool
        lost, names = 0, []
        if pool.failed:
            lost, names = await self.surveys.get(
                "lost", lambda store: self.vol.lost_files(limit=100, store=store))
        health = {"degraded": bool(pool.failed), "lost_files": lost, "lost_examples": names}
        return {**health, "pool_uuid": pool.uuid, "label": pool.label,
                "stripe_unit": pool.stripe_unit,
                "mountpoint": self.mountpoint, "pid": os.getpid(), "socket": self.path,
                "members": pool.usage(), "inodes": self.vol.store.count_inodes(),
                "open_files": len(self.vol.open_inodes), "io_engine": ENGINE,
                "native_engine": native_engine()[1], "io_taken_back": taken_back(),
                "limits": self.usage_of_limits(),
                "quotas": self.vol.quotas.report() if self.vol.quotas.limits else None,
                "wake_latency": self.wake.state() if self.wake else None}

    def usage_of_limits(self) -> dict[str, Any]:
        """How close the daemon is to each limit (what `mxfs status` shows)."""
        busiest = self.conns.most_common(1)
        return {**{k: getattr(self.limits, k) for k in Limits.options()},
                "connections": sum(self.conns.values()), "users": len(self.conns),
                "fds_in_flight": sum(s.sent_fds for s in self.sessions.values()),
                "busiest_user": list(busiest[0]) if busiest else None,
                "fds_open": open_fds(), "fds_max": fd_limit(), "by_user": self.by_user()}

    def by_user(self, most: int = 20) -> dict[str, dict[str, int]]:
        """What each uid holds against its limits (the `most` busiest, by connections
        then KV chunks): for `mxfs status`, root's view."""
        held: dict[int, dict[str, int]] = {}

        def of(uid: int) -> dict[str, int]:
            return held.setdefault(uid, {"connections": 0, "pending": 0, "pins": 0,
                                         "fds_in_flight": 0, "kv_chunks": 0})
        for uid, n in self.conns.items():
            of(uid)["connections"] = n
        for uid, n in self.pending_by_uid.items():
            of(uid)["pending"] = n
        for uid, n in self.kv.pinned_by_uid.items():
            of(uid)["pins"] = n
        for uid, n in self.kv.index.chunks_by_uid.items():
            if n:
                of(uid)["kv_chunks"] = n
        for s in self.sessions.values():
            if s.sent_fds:
                of(s.caller.uid)["fds_in_flight"] += s.sent_fds
        top = sorted(held.items(), key=lambda kv: (-kv[1]["connections"],
                                                   -kv[1]["kv_chunks"]))[:most]
        return {str(uid): counts for uid, counts in top}

"""The control socket's listener: connections, their limits, frames and replies.

A Unix socket beside the mount.  Each connection is served in its own trio task; the
caller's identity comes from SO_PEERCRED (taken at connect).  This module knows no
op: it admits connections against the limits, reads one framed request at a time
within the timeouts, hands it to `dispatch` (`fs/control.py`), and sends the reply
with its descriptors, counted against the receiver until read (`fs/inflight.py`).  A
malformed, oversized or unknown message gets an error reply and the connection is
closed, while the daemon goes on serving others.
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
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from mxfs.fs.failures import FailureLog
from mxfs.fs.fields import Msg, check_request
from mxfs.fs.foreign_fds import Dropper, carries_rights, refuse_rights, take
from mxfs.fs.inflight import park, unread_bytes
from mxfs.fs.limits import Limits, fd_limit
from mxfs.fs.session import Session
from mxfs.proto import HEADER, MAX_VALUES, ProtocolError, decode_payload, encode, parse_header
from mxfs.vol.access import Caller, supplementary_groups
from mxfs.vol.mounts import ensure_runtime_dir
from mxfs.vol.tenants import tenant_of

log = logging.getLogger("mxfs.control")
# Refused connections answered at once (each holds a descriptor until its reply is taken).
MAX_REFUSING = 64
# Bytes one read of a connection takes: the requests a client sent without waiting.
READ_AHEAD = 64 << 10


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


class Listener:
    """Accepts, admits and frames; `dispatch` serves each request, `end` what a
    connection held when it closes."""

    def __init__(self, path: str, limits: Limits,
                 dispatch: Callable[[Msg, Session], Awaitable[tuple[dict[str, Any], list[int]]]],
                 new_session: Callable[[Caller, Any], Session],
                 end: Callable[[Session], Awaitable[None]],
                 turn: Callable[[int], AbstractAsyncContextManager[None]]) -> None:
        self.path = path
        self.limits = limits
        self.dispatch = dispatch
        self.turn = turn  # a uid's turn (`fair.Turns`): its requests are parsed in it
        self.new_session = new_session
        self._end = end
        self.conns: Counter[int] = Counter()  # open connections by uid
        self.other_fds: Callable[[], int] = lambda: 0  # held by other services (chunks)
        self.sessions: dict[int, Session] = {}
        # Sessions sent descriptors their peer may not have read, by uid (a reply with
        # descriptors asks only these: not every connection of the daemon).
        self.sending: dict[int, dict[int, Session]] = {}
        self.refusing = 0  # refused connections being answered
        self.failures = FailureLog(log)
        self.dropper = Dropper()  # connections sent descriptors (kernels before 6.16)
        self.rights_refused = False  # ... or none can be sent (SO_PASSRIGHTS off)

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ensure_runtime_dir(os.path.dirname(self.path))
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.rights_refused = refuse_rights(listener)
        if not self.rights_refused:
            log.info("this kernel cannot refuse sent descriptors: they are closed off "
                     "the daemon's thread")
        await listener.bind(self.path)
        os.chmod(self.path, 0o666)  # anyone may connect; each request is checked
        listener.listen(512)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                if not self.rights_refused:
                    nursery.start_soon(self.dropper.run)
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

    async def _recv(self, conn: Any, n: int) -> bytes:
        """Up to `n` bytes of a request; ProtocolError if descriptors came with them
        (left where they are: see foreign_fds)."""
        if self.rights_refused:
            return bytes(await conn.recv(n))
        data, sent_fds = await take(conn, n)
        if sent_fds:
            raise ProtocolError("requests carry no descriptors")
        return data

    def connections(self) -> int:
        return sum(self.conns.values())

    def _admit(self, caller: Caller, tenant: int) -> OSError | None:
        """Why a new connection of `caller` (counted as `tenant`'s) is refused (a limit
        is reached), or None."""
        lim = self.limits
        total = self.connections()
        if total >= lim.max_conns:
            return OSError(errno.ENFILE, f"the daemon holds {total} control connections, its "
                           "limit (mount option max_conns); try again later")
        if total + self.other_fds() + lim.fd_reserve >= fd_limit():
            return OSError(errno.ENFILE, f"the daemon holds {total} control connections and "
                           f"{self.other_fds()} other descriptors, near its limit of "
                           f"{fd_limit()} (raise its LimitNOFILE); try again later")
        if tenant != 0 and self.conns[tenant] >= lim.max_conns_per_user:
            return OSError(errno.EMFILE, f"uid {tenant} holds {self.conns[tenant]} "
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
            try:
                await self._admitted(conn, caller)
            finally:
                self._let_go(conn)

    def _let_go(self, conn: Any) -> None:
        """Before a connection closes, on a kernel that passes descriptors: if some it
        sent wait unread, its socket goes to the dropper, not closed here (see
        foreign_fds).  Shut for reading first: nothing more can come."""
        if self.rights_refused:
            return
        try:
            conn.shutdown(socket.SHUT_RD)
            if carries_rights(conn.fileno()):
                self.dropper.drop(conn.detach())
        except OSError:
            return

    async def _admitted(self, conn: Any, caller: Caller) -> None:
        """Admit a connection (or answer why not) and serve it."""
        tenant = tenant_of(caller.uid)
        refusal = self._admit(caller, tenant)
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
        session = self.new_session(caller, conn)
        tenant = session.tenant
        self.conns[tenant] += 1
        self.sessions[id(session)] = session
        try:
            await self._serve(conn, session)
        except Exception as e:
            self.failures.note("connection", caller, e)
        finally:
            with trio.CancelScope(shield=True):  # (what it held goes, even at the end)
                await self._end(session)
            if session.sent_fds and unread_bytes(conn):
                await park(conn)  # its descriptors in flight: still counted
            del self.sessions[id(session)]
            sending = self.sending.get(tenant, {})
            if sending.pop(id(session), None) is not None and not sending:
                del self.sending[tenant]
            self.conns[tenant] -= 1
            if not self.conns[tenant]:
                del self.conns[tenant]

    async def _read_request(self, conn: Any, session: Session, inbox: bytearray
                            ) -> dict[str, Any] | None:
        """The next request, or None when the connection is over (closed, idle, too slow).

        A connection holding nothing is closed after `idle_timeout`; once a message
        has begun it must arrive whole within `frame_timeout`.  Bytes are read up to
        READ_AHEAD at a time into `inbox`, the connection's bytes read and not yet
        served: a client that sends requests without waiting for replies (a stream
        of small KV puts) costs one read for several of them, not two each.
        """
        lim = self.limits
        holds = session.pending or session.pinned
        tenant = session.tenant
        try:
            if not inbox:
                data = None
                with trio.move_on_after(math.inf if holds else lim.idle_timeout):
                    try:
                        data = await self._recv(conn, READ_AHEAD)
                    except OSError:
                        return None
                if not data:
                    return None  # closed, or idle too long
                inbox += data
            with trio.fail_after(lim.frame_timeout):
                await self._fill(conn, inbox, HEADER.size)
                _, _, length = parse_header(bytes(inbox[:HEADER.size]))
                await self._fill(conn, inbox, HEADER.size + length)
            raw = bytes(inbox[HEADER.size:HEADER.size + length])
            del inbox[:HEADER.size + length]
            # Parsed in the sender's turn: one user's connections, each sending a costly
            # payload at once, take turns among themselves, not everyone's.
            async with self.turn(tenant):
                msg = decode_payload(raw, MAX_VALUES)
            del raw
            check_request(msg)
            return msg
        except trio.TooSlowError:
            self.failures.note("slow", session.caller,
                               TimeoutError("a request not sent whole in time"), trace=False)
        except ProtocolError as e:  # (its traceback would hold what was parsed meanwhile)
            await self._refuse(conn, session.caller, None, e.with_traceback(None))
        except OSError:
            pass  # the peer went away mid-message
        return None

    async def _fill(self, conn: Any, inbox: bytearray, want: int) -> None:
        """Read until `inbox` holds `want` bytes (ConnectionError if the peer closes)."""
        while len(inbox) < want:
            data = await self._recv(conn, READ_AHEAD)
            if not data:
                raise ConnectionError("peer closed mid-message")
            inbox += data

    async def _serve(self, conn: Any, session: Session) -> None:
        inbox = bytearray()  # (bytes read ahead of the request being served)
        while True:
            msg = await self._read_request(conn, session, inbox)
            if msg is None:
                return
            op = msg["op"]
            fds: list[int] = []
            try:
                reply, fds = await self.dispatch(msg, session)
            except ProtocolError as e:
                await self._refuse(conn, session.caller, msg.get("id"), e.with_traceback(None))
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
            sent = False
            try:
                with trio.move_on_after(self.limits.frame_timeout) as scope:
                    try:
                        sent = await self._send(conn, reply, fds)
                    except ProtocolError as e:  # a reply over the limits: say so, stay up
                        sent = await self._send(conn, {"id": reply["id"], "ok": False,
                                                       "errno": errno.E2BIG, "error": str(e)})
                if fds:
                    session.sent_fds += len(fds)
                    self.sending.setdefault(session.tenant, {})[id(session)] = session
                if not sent or scope.cancelled_caught:
                    return  # the peer went away or does not read its replies
            finally:
                for fd in fds:
                    os.close(fd)  # the peer holds its own copies now
            del reply

    def fds_in_flight(self, uid: int) -> int:
        """Descriptors sent to `uid`'s connections that they have not read yet (a
        connection with nothing unread has taken all it was sent)."""
        total, sending = 0, self.sending.get(uid, {})
        for key, s in list(sending.items()):
            if not unread_bytes(s.conn):
                s.sent_fds = 0
                del sending[key]
            total += s.sent_fds
        if not sending:
            self.sending.pop(uid, None)
        return total

    def _admit_fds(self, session: Session, reply: dict[str, Any], fds: list[int]
                   ) -> tuple[dict[str, Any], list[int]]:
        """The reply as it may go: with its descriptors, or, past the caller's bound of
        descriptors in flight (root: none), an EMFILE without them."""
        uid, lim = session.tenant, self.limits.max_fds_in_flight_per_user
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
        """Send one refusal, then close gracefully: what the peer sends meanwhile is read
        and dropped for a second (its send would fail, EPIPE, before it read why), up
        to descriptors, which are never taken (see foreign_fds: the connection ends,
        and they are dropped with it)."""
        with trio.move_on_after(self.limits.frame_timeout):
            if not await self._send(conn, {"id": msg_id, "ok": False, "errno": code,
                                           "error": error}):
                return
            try:
                conn.shutdown(socket.SHUT_WR)
                with trio.move_on_after(1):
                    while await self._recv(conn, 1 << 16):
                        pass
            except (OSError, ProtocolError):
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


"""The control socket's listener: connections, their limits, frames and replies.

A Unix socket beside the mount.  Each connection is served in its own trio task; the
caller's identity comes from SO_PEERCRED (taken at connect).  This module knows no
op: it admits connections against the limits, reads one framed request at a time
within the timeouts, hands it to `dispatch` (`fs/control.py`), and sends the reply
with its descriptors, counted against the receiver until read (`fs/inflight.py`).  What
a connection holds of requests arriving and replies unsent counts against its tenant's
budget (`fs/buffered.py`): a frame is read once it has room.  A
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
from typing import Any

import trio

from mxfs.fs.buffered import Buffered, Hold
from mxfs.fs.descriptors import Descriptors
from mxfs.fs.failures import FailureLog
from mxfs.fs.fair import Turns
from mxfs.fs.fields import Msg, check_request
from mxfs.fs.foreign_fds import Dropper, carries_rights, refuse_rights, take
from mxfs.fs.inflight import park, readable_now, unread_bytes
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
# Connections of one user (but root) read and parsed at once (`Listener.reading`).
READERS_PER_USER = 2


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13


class NoRoom(Exception):
    """A frame that its tenant's budget of bytes buffered had no room for in time."""


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
                 fds: Descriptors,
                 close_fds: Callable[[list[int]], None],
                 reach: Callable[[Caller], Awaitable[bool]] | None = None) -> None:
        self.path = path
        # Whether a caller could reach the mount point through the kernel (`fs/reach.py`)
        self.reach = reach
        self.limits = limits
        self.dispatch = dispatch
        # A user's turns to read (`fair.Turns`): trio runs every task ready in turn, so
        # a user's 64 connections each with bytes to read took 64 steps for another's one
        self.reading = Turns(READERS_PER_USER)
        self.new_session = new_session
        self._end = end
        self.conns: Counter[int] = Counter()  # open connections by uid
        # The daemon's descriptors held for tenants, its connections among them.
        self.fds = fds
        # What closes a reply's descriptors once sent: members' files, whose close can
        # wait on a member that stopped answering (`pool/closer.py`), never on the loop.
        self.close_fds = close_fds
        self.sessions: dict[int, Session] = {}
        # Sessions sent descriptors their peer may not have read, by uid (a reply with
        # descriptors asks only these: not every connection of the daemon).
        self.sending: dict[int, dict[int, Session]] = {}
        self.refusing = 0  # refused connections being answered
        self.failures = FailureLog(log)
        self.dropper = Dropper()  # connections sent descriptors (kernels before 6.16)
        self.rights_refused = False  # ... or none can be sent (SO_PASSRIGHTS off)
        # Bytes of requests arriving and replies unsent, by tenant (max_buffered_per_user).
        self.buffered = Buffered(limits.max_buffered_per_user)

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
        if not self.fds.room(1):
            return OSError(errno.ENFILE, f"the daemon holds {total} control connections and "
                           f"{self.fds.held() - total} other descriptors for its users, "
                           f"near its limit of {fd_limit()} less the {self.fds.reserve()} it "
                           "keeps for itself (raise its LimitNOFILE); try again later")
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
        if refusal is None and self.reach is not None and not await self.reach(caller):
            refusal = OSError(errno.EACCES, f"uid {caller.uid} cannot reach this pool's "
                              "mount point (a folder above it denies search), so neither "
                              "can it ask its daemon: ask the admin for that folder")
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

    async def _read_request(self, conn: Any, session: Session, inbox: bytearray, hold: Hold
                            ) -> dict[str, Any] | None:
        """The next request, or None when the connection is over (closed, idle, too slow,
        or its tenant's budget had no room for it).

        A connection holding nothing is closed after `idle_timeout`; once a message
        has begun it must arrive whole within `frame_timeout`.  Bytes are read up to
        READ_AHEAD at a time into `inbox`, the connection's bytes read and not yet
        served: a client that sends requests without waiting for replies (a stream
        of small KV puts) costs one read for several of them, not two each.  `hold`
        is the room in its tenant's budget taken for them (`_fill`), and for the
        request returned until it is served.
        """
        lim = self.limits
        holds = session.pending or session.pinned or session.far or \
            session.far_claims_until > trio.current_time()
        try:
            if not inbox:
                with trio.move_on_after(math.inf if holds else lim.idle_timeout) as idle:
                    await trio.lowlevel.wait_readable(conn)
                if idle.cancelled_caught:
                    return None  # idle too long
            deadline = trio.current_time() + lim.frame_timeout
            # Read and parsed in the sender's reading turns (`reading`): one user's
            # connections, each sending at once (64 of them, 1 MiB requests), take turns
            # among themselves, READERS_PER_USER at a time, not a step each of every
            # user's time.  A turn is taken only once bytes wait: a slow sender holds none.
            await self._fill(conn, inbox, hold, HEADER.size, deadline)
            _, _, length = parse_header(bytes(inbox[:HEADER.size]))
            size = HEADER.size + length
            await self._fill(conn, inbox, hold, size, deadline)
            with memoryview(inbox) as view:
                raw = bytes(view[HEADER.size:size])
            del inbox[:size]
            # Counted until served (`_serve_one`): parsed, it waits for its turn as memory.
            self.buffered.keep(hold, len(inbox) + length)
            async with self.reading.turn(session.tenant, at_once=True):
                msg = decode_payload(raw, MAX_VALUES)
            del raw
            check_request(msg)
            return msg
        except trio.TooSlowError:
            self.failures.note("slow", session.caller,
                               TimeoutError("a request not sent whole in time"), trace=False)
        except NoRoom as e:
            self.failures.note("buffered", session.caller, e, trace=False)
            await self._close_with(conn, None, errno.ENOBUFS, str(e))
        except ProtocolError as e:  # (its traceback would hold what was parsed meanwhile)
            await self._refuse(conn, session.caller, None, e.with_traceback(None))
        except OSError:
            pass  # the peer went away mid-message
        return None

    async def _fill(self, conn: Any, inbox: bytearray, hold: Hold, want: int,
                    deadline: float) -> None:
        """Read until `inbox` holds `want` bytes: ConnectionError if the peer closes,
        TooSlowError past `deadline`.  Room in the tenant's budget is taken for all of
        them before any is read (NoRoom if none came by `deadline`: a frame half read
        would hold its bytes with none to finish it), and for up to READ_AHEAD more,
        the requests sent after them, only where the tenant has room to spare."""
        if len(inbox) >= want:
            return
        room = self.buffered.room(hold.tenant)
        ahead = len(inbox) + min(READ_AHEAD, room)
        asked = int(max(want, ahead))
        waits = asked - hold.inbox > room  # (in the tenant's line for room)
        got = await self.buffered.take(hold, asked, deadline)
        if not got or waits and trio.current_time() >= deadline:
            # (room handed over as the deadline passed, by a busy daemon that ran the
            # waiter late, is room that came too late: refused, with the reason, as a
            # frame with none in time is, not closed without a word as a slow sender)
            self.buffered.keep(hold, len(inbox))
            raise NoRoom(self._over(hold.tenant, f"a message of {want} bytes"))
        try:
            for late in (False, True):
                try:
                    with trio.fail_at(deadline):
                        while len(inbox) < want:
                            if not readable_now(conn):  # (waited for in no turn: a
                                await trio.lowlevel.wait_readable(conn)  # slow sender's)
                            async with self.reading.turn(hold.tenant, at_once=True):
                                data = await self._recv(conn, min(READ_AHEAD,
                                                                  hold.inbox - len(inbox)))
                            if not data:
                                raise ConnectionError("peer closed mid-message")
                            inbox += data
                    return
                except trio.TooSlowError:
                    # (bytes or a close waiting unread: the daemon was the late one,
                    # stopped or its thread held past the deadline, and blamed the
                    # sender, CI's stopped daemon one that had closed; read on, a
                    # frame's time more, once)
                    if late or not readable_now(conn):
                        raise
                    deadline = trio.current_time() + self.limits.frame_timeout
        finally:
            self.buffered.keep(hold, len(inbox))  # (what was not read ahead goes back)

    def _over(self, tenant: int, what: str) -> str:
        """Why `what` of `tenant`'s has no room in its budget of bytes buffered."""
        return (f"uid {tenant} has {self.buffered.held[tenant]} bytes of control messages "
                f"buffered in the daemon (requests arriving, replies not yet read) and {what}"
                f" would take it past {self.limits.max_buffered_per_user}, the limit (mount "
                "option max_buffered_per_user): read your replies, send fewer large "
                "requests at once")

    async def reply_room(self, session: Session) -> None:
        """Wait, in the caller's turn and for `frame_timeout` at most, until its tenant's
        replies not yet read are under its budget; ENOBUFS if they stay over it.  A reply
        is memory once made: it is not made until it has room."""
        deadline = trio.current_time() + self.limits.frame_timeout
        if not await self.buffered.reply_room(session.tenant, deadline):
            raise OSError(errno.ENOBUFS, self._over(session.tenant, "another reply"))

    async def _serve(self, conn: Any, session: Session) -> None:
        inbox = bytearray()  # (bytes read ahead of the request being served)
        hold = Hold(session.tenant)  # (what the connection holds of the tenant's budget)
        try:
            while await self._serve_one(conn, session, inbox, hold):
                pass
        finally:
            self.buffered.drop(hold)

    async def _serve_one(self, conn: Any, session: Session, inbox: bytearray, hold: Hold
                         ) -> bool:
        """Read one request, serve it and send its reply; False when the connection is
        over."""
        msg = await self._read_request(conn, session, inbox, hold)
        if msg is None:
            return False
        op = msg["op"]
        fds: list[int] = []
        session.undo.clear()
        try:
            reply, fds = await self.dispatch(msg, session)
        except ProtocolError as e:
            await self._refuse(conn, session.caller, msg.get("id"), e.with_traceback(None))
            return False
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
        self.buffered.keep(hold, len(inbox))  # (the request served: its bytes go back)
        try:
            data, sending = self._encoded(reply, fds, session)
            del reply  # (its bytes alone are held while its peer takes them)
            self.buffered.reply(hold, len(data))
            sent = False
            with trio.move_on_after(self.limits.frame_timeout) as scope:
                sent = await self._send(conn, data, sending)
            if sending:
                session.sent_fds += len(sending)
                self.sending.setdefault(session.tenant, {})[id(session)] = session
            return sent and not scope.cancelled_caught  # (else gone, or not reading)
        finally:
            self.buffered.reply(hold, 0)
            self.close_fds(fds)  # the peer holds its own copies now

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
        self.close_fds(fds)
        session.refused()
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
            if not await self._send(conn, encode({"id": msg_id, "ok": False, "errno": code,
                                                  "error": error})):
                return
            try:
                conn.shutdown(socket.SHUT_WR)
                with trio.move_on_after(1):
                    while await self._recv(conn, 1 << 16):
                        pass
            except (OSError, ProtocolError):
                pass

    @staticmethod
    def _encoded(reply: dict[str, Any], fds: list[int], session: Session
                 ) -> tuple[bytes, list[int]]:
        """The reply's bytes and the descriptors that go with them; a reply over the
        limits is an E2BIG error instead, without them (say so, stay up)."""
        try:
            return encode(reply, len(fds)), fds
        except ProtocolError as e:
            session.refused()
            return encode({"id": reply["id"], "ok": False, "errno": errno.E2BIG,
                           "error": str(e)}), []

    async def _send(self, conn: Any, raw: bytes, fds: Sequence[int] = ()) -> bool:
        """Send `raw` (with `fds` on its first byte); False if the peer went away."""
        data = memoryview(raw)
        try:
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                data = data[await conn.sendmsg([data], anc):]
            while data:
                data = data[await conn.send(data):]
        except OSError:
            return False
        return True


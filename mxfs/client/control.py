"""A blocking client of the daemon's control socket (whose server side is
`fs/control.py`: the same protocol, two layers).

The socket is found from the mount itself (the `user.mxfs.control` xattr of
its root), so a client needs nothing but the mount point; it is trusted only on the
root of a `fuse.mxfs` mount, and only when root or the caller serves it.
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from mxfs.proto import VERSION, ProtocolError, recv_message, send_message
from mxfs.proto.constants import CONTROL_XATTR, FSTYPE
from mxfs.proto.messages import LAYOUT, STAT, FileReply, Rep, Request, StatReply
from mxfs.proto.mountinfo import mount_of


class ControlError(OSError):
    """The daemon refused a request; errno and message are the daemon's."""


class Untrusted(ControlError):
    """A control xattr off an mxfs mount, or a socket neither root nor the caller
    serves: refused before a byte is sent (EPERM)."""


def mount_root(path: str) -> str | None:
    """The root of the mxfs mount holding `path`, or None if it is on no mxfs mount.

    Walks up to the mount boundary (where st_dev changes) asking for the control
    xattr, which only an mxfs root carries.
    """
    d = os.path.realpath(path)
    _refuse_unreachable(d)
    # A file's folder; one not there (or not seen on this node yet: another node made
    # it a moment ago) is asked of the mount above it.
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    while True:
        try:
            os.getxattr(d, CONTROL_XATTR)
            return d
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EPERM):
                _refuse_unreachable(d, e)
                raise
        parent = os.path.dirname(d)
        if parent == d or os.stat(parent).st_dev != os.stat(d).st_dev:
            return None
        d = parent


def _refuse_unreachable(path: str, e: OSError | None = None) -> None:
    """A path on an mxfs mount whose daemon died (ENOTCONN), or that another user
    mounted without allow_other (EACCES), said as such: walked past, it was reported
    as on no mxfs mount at all.  `e`: what asking it failed with, else it is looked at
    (its attributes may be the kernel's, cached: a dead mount's stat may answer)."""
    if e is None:
        try:
            os.stat(path)
            return
        except OSError as failed:
            e = failed
    if e.errno not in (errno.ENOTCONN, errno.EACCES):
        return
    point, fstype = mount_of(path)
    if fstype != FSTYPE:
        return
    if e.errno == errno.ENOTCONN:
        raise ControlError(errno.ENOTCONN, f"the daemon of the mxfs mount at {point} "
                           f"died: run mxfs umount {point}, then mount the pool "
                           "again") from None
    if point == path and os.access(os.path.dirname(path), os.X_OK):
        raise ControlError(errno.EACCES, f"the mxfs mount at {point} is another "
                           "user's, mounted without allow_other: ask its owner (or "
                           "root) to mount it with -o allow_other") from None


def find_socket(mountpoint: str) -> str:
    """The control socket `mountpoint` names, once it is found to be the root of an
    mxfs mount: any user may set `user.mxfs.control` on a folder of her own (a plain
    one, a tmpfs), and root asking her socket for the pool's config would open a
    superblock and a store of hers."""
    try:
        path = os.getxattr(mountpoint, CONTROL_XATTR).decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            raise ControlError(e.errno, f"{mountpoint} is not an mxfs mount") from None
        _refuse_unreachable(os.path.realpath(mountpoint), e)
        raise
    point, fstype = mount_of(mountpoint)
    if fstype != FSTYPE or point != os.path.realpath(mountpoint):
        where = f"a {fstype} mount is there" if point == os.path.realpath(mountpoint) \
            else f"it is a folder of the {fstype} mount at {point}"
        raise Untrusted(errno.EPERM, f"{mountpoint} carries {CONTROL_XATTR} but is not "
                           f"an mxfs mount ({where}): its socket is not trusted")
    return path


def check_daemon(sock: socket.socket, mountpoint: str) -> None:
    """Refuse a control socket served by anyone but root or this user (SO_PEERCRED):
    root's daemon serves every user, a user's own mount (without allow_other) serves
    her alone, and a socket another user serves is a daemon of hers.  In a user
    namespace that does not map root (a rootless container) root's daemon shows as the
    overflow uid, as any other unmapped user's would: there it is taken, and what
    stands between the container and another user's socket is the mount's type (a FUSE
    mount that others may reach takes root, or user_allow_other)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", raw)
    if trusted_uid(uid):
        return
    raise Untrusted(errno.EPERM, f"the control socket of {mountpoint} is served by uid "
                       f"{uid}, not by root or you: not trusted")


def trusted_uid(uid: int) -> bool:
    """Whether a daemon (or a mount) of `uid` is one this process may ask: root's, its
    own, or root's seen as the overflow uid where this namespace does not map root."""
    return uid in (0, os.geteuid()) or (uid == _overflow_uid() and not _root_mapped())


def _overflow_uid() -> int:
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65534


def _root_mapped() -> bool:
    """Whether this process's user namespace maps uid 0 of the one above it."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except (OSError, ValueError):
        return True
    return any(outside <= 0 < outside + count for _, outside, count in ranges)


def _fields(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply without its envelope: what its op declares."""
    reply.pop("ok", None)
    reply.pop("id", None)
    return reply


# A posted request's outcome, given to its callback when a later call reads its reply.
Posted = Callable[[dict[str, Any] | ControlError], None]
POST_WINDOW = 64  # posted requests unanswered at most: the posting call reads the oldest


class ControlClient:
    """One connection to the daemon, made again when it is lost.

    What a connection holds in the daemon (unpublished files, read leases) ends with
    it; `connections` counts the connections made, so a holder of such state can tell
    that it went.  A request that fails mid-way (the connection broke while it was sent
    or answered) raises to its caller and is never sent again, since the daemon may
    have applied it; the broken connection is dropped and the next call makes a new one.
    """

    def __init__(self, mountpoint: str, timeout: float = 30.0) -> None:
        self.mountpoint = os.path.realpath(mountpoint)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # one request at a time: threads may share a client
        self.broken = False  # the last connection failed mid-request: the next call makes one
        self.closed = False
        self.connections = 0
        self.server: dict[str, Any] = {}
        # Requests sent without waiting (`post`): their ids and callbacks, in send order.
        self._posted: deque[tuple[int, Posted]] = deque()
        # Called (under the lock) before each request that waits for its reply: a
        # holder of requests gathered to post sends them first, keeping their order.
        self.before_request: Callable[[], None] | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.close()  # no connection yet: _connect makes the first
        self._connect()

    def _connect(self) -> None:
        """A new connection, greeted; it replaces the old one only once it answered."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(find_socket(self.mountpoint))
            check_daemon(sock, self.mountpoint)
            server, fds = self._exchange(sock, "hello", {"version": VERSION})
        except BaseException:
            sock.close()
            raise
        for fd in fds:
            os.close(fd)
        if self.closed:  # closed by another thread meanwhile
            sock.close()
            raise self._closed_error()
        self.sock.close()
        self.sock, self.server, self.broken = sock, server, False
        self.connections += 1

    def _closed_error(self) -> ControlError:
        return ControlError(errno.EBADF, f"the control client of {self.mountpoint} was closed")

    def _exchange(self, sock: socket.socket, op: str, fields: dict[str, Any]
                  ) -> tuple[dict[str, Any], list[int]]:
        """One request and its reply on `sock`: ControlError if the daemon refused it.

        Anything that leaves the stream in doubt (a send or receive that failed, a
        reply to another request, the daemon refusing the connection itself) marks the
        connection broken before raising."""
        msg_id = next(self._ids)
        try:
            send_message(sock, {"op": op, "id": msg_id, **fields})
            reply, fds = recv_message(sock)
        except BaseException:  # an interrupt mid-frame desynchronises the stream too
            self.broken = True
            raise
        if reply.get("id") != msg_id or not reply.get("ok"):
            for fd in fds:
                os.close(fd)
        if reply.get("id") != msg_id:
            self.broken = True
            refused = reply.get("id") is None and reply.get("ok") is False
            if not refused:  # (refused: the daemon turned the connection away, a limit)
                raise ControlError(errno.EPROTO, f"reply {reply.get('id')} to request {msg_id}")
        if not reply.get("ok"):
            raise ControlError(int(reply.get("errno") or errno.EIO),
                               str(reply.get("error", "refused")))
        return reply, fds

    def _usable(self) -> bool:
        """Whether the connection can take a request: not broken, not closed, and not hung
        up by the daemon (it closes connections idle for long, and all when it stops)."""
        if self.broken or self.sock.fileno() < 0:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        if not readable:
            return True
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK))  # b"": the daemon hung up
        except OSError:  # reset by the daemon (it went away)
            return False

    def close(self) -> None:
        """End the connection (and what it holds); later calls raise EBADF."""
        self.closed = True  # not under the lock: a request in flight may hold it for long
        self.sock.close()

    def alive(self) -> bool:
        """Is the connection still up?  (A daemon that went away leaves it readable: EOF.)"""
        with self._lock:
            try:
                self._settle()  # (posted replies would leave it readable too)
            except (OSError, ProtocolError):
                return False
        if self.broken:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- typed requests: what the library sends (proto/messages.py declares each op) ----

    def request(self, req: Request[Any, Rep]) -> Rep:
        """Send one request (`OP(fields)`) and wait for its reply; ControlError on
        refusal."""
        reply, fds = self.request_with_fds(req)
        for fd in fds:
            os.close(fd)
        return reply

    def request_with_fds(self, req: Request[Any, Rep]) -> tuple[Rep, list[int]]:
        """Like `request`, keeping the descriptors that came with the reply (caller
        closes)."""
        reply, fds = self.call_with_fds(req.op.name, **req.fields)
        return cast(Rep, _fields(reply)), fds

    def request_many(self, requests: Sequence[Request[Any, Rep]], window: int = 16
                     ) -> list[tuple[Rep, list[int]] | ControlError]:
        """`call_many` of typed requests (of one op: their replies share a type)."""
        out = self.call_many([(r.op.name, r.fields) for r in requests], window)
        return [got if isinstance(got, ControlError) else (cast(Rep, _fields(got[0])), got[1])
                for got in out]

    # ---- raw requests: any op and fields (the typed ones' base; tests send anything) ----

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises ControlError on refusal."""
        reply, fds = self.call_with_fds(op, **fields)
        for fd in fds:
            os.close(fd)
        return reply

    def call_with_fds(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """Like `call`, keeping the descriptors that came with the reply (caller closes).

        A connection found lost before the request is sent is made again first (nothing
        of this request reached the daemon); one lost while it is sent or answered is
        dropped and the OSError raised: the next call connects again."""
        with self._lock:
            if self.closed:
                raise self._closed_error()
            if self.before_request is not None:
                self.before_request()
            self._settle()
            if not self._usable():
                self.sock.close()  # what it held in the daemon is gone already
                self._connect()
            try:
                return self._exchange(self.sock, op, fields)
            finally:
                if self.broken:
                    self.sock.close()

    def call_many(self, requests: Sequence[tuple[str, Mapping[str, Any]]], window: int = 16
                  ) -> list[tuple[dict[str, Any], list[int]] | ControlError]:
        """Send `requests` back to back, at most `window` ahead of their replies, and give
        each one's reply and descriptors (the caller closes them), or the ControlError it
        was refused with, in order.

        The daemon answers a connection's requests one after another, in order, so a
        batch of small requests (a group of KV commits) costs about one round trip
        instead of one each.  A stream broken mid-way raises, as `call` does: what was
        sent may have been applied, and nothing is sent again."""
        out: list[tuple[dict[str, Any], list[int]] | ControlError] = []
        with self._lock:
            if self.closed:
                raise self._closed_error()
            if self.before_request is not None:
                self.before_request()
            self._settle()
            if not self._usable():
                self.sock.close()
                self._connect()
            ids = [next(self._ids) for _ in requests]
            sent = 0
            try:
                while len(out) < len(requests):
                    while sent < len(requests) and sent - len(out) < max(1, window):
                        op, fields = requests[sent]
                        send_message(self.sock, {"op": op, "id": ids[sent], **fields})
                        sent += 1
                    reply, fds = recv_message(self.sock)
                    out.append(self._answer(reply, fds, ids[len(out)]))
            except BaseException:
                self.broken = True
                for r in out:
                    if not isinstance(r, ControlError):
                        for fd in r[1]:
                            os.close(fd)
                raise
            finally:
                if self.broken:
                    self.sock.close()
        return out

    def post(self, req: Request[Any, Any], done: Posted, window: int = POST_WINDOW) -> None:
        """Send `req` and go on without its reply: `done` gets the reply's fields (or
        the ControlError it was refused with) when a later call on this client reads it
        (any request, `settle`, or a post past `window` unanswered).

        The daemon answers a connection's requests in order, so a later request sees
        what the posted ones did.  A connection lost with posts unanswered gives each
        of them ECONNRESET (the daemon may have applied them) and raises."""
        with self._lock:
            if self.closed:
                raise self._closed_error()
            # Posts answered are read first: a daemon that closed the connection as
            # idle since is then found so, and a new one made, before this is sent.
            if self._posted and self._readable():
                self._settle()
            if not self._posted and not self._usable():
                self.sock.close()
                self._connect()
            msg_id = next(self._ids)
            try:
                send_message(self.sock, {"op": req.op.name, "id": msg_id, **req.fields})
            except BaseException:
                self._lost(done)
                raise
            self._posted.append((msg_id, done))
            while len(self._posted) > max(0, window):
                self._read_posted()

    @property
    def lock(self) -> threading.RLock:
        """Held for each request (re-entrant): a caller that must post and settle in
        one piece, against other threads' requests, holds it around them."""
        return self._lock

    def settle(self) -> None:
        """Read the replies of every posted request (each to its callback)."""
        with self._lock:
            self._settle()

    def _readable(self) -> bool:
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def _settle(self) -> None:
        while self._posted:
            self._read_posted()

    def _read_posted(self) -> None:
        msg_id, done = self._posted[0]
        try:
            reply, fds = recv_message(self.sock)
            got = self._answer(reply, fds, msg_id)
        except BaseException:
            self._lost()
            raise
        self._posted.popleft()
        if isinstance(got, ControlError):
            done(got)
            return
        for fd in got[1]:
            os.close(fd)
        done(_fields(got[0]))

    def _lost(self, *more: Posted) -> None:
        """The stream broke with posts unanswered: each is told, the connection dropped."""
        self.broken = True
        self.sock.close()
        told = [done for _, done in self._posted] + list(more)
        self._posted.clear()
        for done in told:
            done(ControlError(errno.ECONNRESET, "the connection to the daemon was lost "
                              "before it answered (the request may have been applied)"))

    def _answer(self, reply: dict[str, Any], fds: list[int], msg_id: int
                ) -> tuple[dict[str, Any], list[int]] | ControlError:
        """One reply of a pipelined batch: kept, or the refusal; a reply out of order
        leaves the stream in doubt (raised)."""
        if reply.get("id") != msg_id:
            for fd in fds:
                os.close(fd)
            raise ControlError(errno.EPROTO, f"reply {reply.get('id')} to request {msg_id}")
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            return ControlError(int(reply.get("errno") or errno.EIO),
                                str(reply.get("error", "refused")))
        return reply, fds

    def pool_path(self, path: str) -> str:
        """A path inside the mount as the daemon names it (relative to the pool root)."""
        for full in (os.path.abspath(path), os.path.realpath(path)):  # reached by a link?
            rel = os.path.relpath(full, self.mountpoint)
            if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
                break
        else:
            raise ControlError(errno.EXDEV, f"{path} is not inside {self.mountpoint}")
        return "/" if rel == "." else "/" + rel

    def stat(self) -> StatReply:
        return self.request(STAT())

    def layout(self, path: str) -> FileReply:
        return self.request(LAYOUT({"path": self.pool_path(path)}))

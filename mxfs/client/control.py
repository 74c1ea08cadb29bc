"""A blocking client of the daemon's control socket.

The socket is found from the mount itself (the `user.mxfs.control` xattr of
its root), so a client needs nothing but the mount point.
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import socket
import threading
from typing import Any

from mxfs.proto import VERSION, recv_message, send_message

CONTROL_XATTR = "user.mxfs.control"


class ControlError(OSError):
    """The daemon refused a request; errno and message are the daemon's."""


def mount_root(path: str) -> str | None:
    """The root of the mxfs mount holding `path`, or None if it is on no mxfs mount.

    Walks up to the mount boundary (where st_dev changes) asking for the control
    xattr, which only an mxfs root carries.
    """
    d = os.path.realpath(path)
    if not os.path.isdir(d):
        d = os.path.dirname(d)
    while True:
        try:
            os.getxattr(d, CONTROL_XATTR)
            return d
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EPERM):
                raise
        parent = os.path.dirname(d)
        if parent == d or os.stat(parent).st_dev != os.stat(d).st_dev:
            return None
        d = parent


def find_socket(mountpoint: str) -> str:
    try:
        return os.getxattr(mountpoint, CONTROL_XATTR).decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            raise ControlError(e.errno, f"{mountpoint} is not an mxfs mount") from None
        raise


class ControlClient:
    def __init__(self, mountpoint: str, timeout: float = 30.0) -> None:
        self.mountpoint = os.path.realpath(mountpoint)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # one request at a time: threads may share a client
        self.broken = False  # the connection failed mid-request; make a new client
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(find_socket(self.mountpoint))
        self.server = self.call("hello", version=VERSION)

    def _reconnect_if_closed(self) -> None:
        """The daemon closes connections idle for long (and all of them when it
        restarts): between requests, a closed one is made again, so a long-lived
        client (a serving engine's KV store) goes on.  What the old connection held
        (unpublished files, leases) is gone with it, as the daemon dropped it."""
        if self.broken or self.sock.fileno() < 0:
            return
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return
        try:
            closed = readable and not self.sock.recv(1, socket.MSG_PEEK)
        except OSError:  # reset by the daemon (it went away)
            closed = True
        if closed:
            self.sock.close()
            self._connect()

    def close(self) -> None:
        self.sock.close()

    def alive(self) -> bool:
        """Is the connection still up?  (A daemon that went away leaves it readable: EOF.)"""
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

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises ControlError on refusal."""
        reply, fds = self.call_with_fds(op, **fields)
        for fd in fds:
            os.close(fd)
        return reply

    def call_with_fds(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """Like `call`, keeping the descriptors that came with the reply (caller closes)."""
        with self._lock:
            if op != "hello":
                self._reconnect_if_closed()
            msg_id = next(self._ids)
            try:
                send_message(self.sock, {"op": op, "id": msg_id, **fields})
                reply, fds = recv_message(self.sock)
            except OSError:
                self.broken = True
                raise
        if reply.get("id") != msg_id or not reply.get("ok"):
            for fd in fds:
                os.close(fd)
        if reply.get("id") is None and reply.get("ok") is False:
            self.broken = True  # the daemon refused the connection itself (a limit)
        elif reply.get("id") != msg_id:
            raise ControlError(errno.EPROTO, f"reply {reply.get('id')} to request {msg_id}")
        if not reply.get("ok"):
            raise ControlError(int(reply.get("errno") or errno.EIO),
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

    def stat(self) -> dict[str, Any]:
        return self.call("stat")

    def layout(self, path: str) -> dict[str, Any]:
        return self.call("layout", path=self.pool_path(path))

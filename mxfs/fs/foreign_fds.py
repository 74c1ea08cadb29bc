"""Descriptors a control client sends the daemon: refused, or closed off its thread.

No request carries descriptors, but a client may attach some anyway
(SCM_RIGHTS).  Closing one on the daemon's only thread is a trap: if it names a
file on this very mount, the kernel sends FLUSH for it back to the daemon, which
cannot answer while it waits in close(); the mount and the control socket hang
for every user, beyond SIGKILL.  A FUSE filesystem of the user's own that never
answers does the same.  So the listener refuses descriptors outright
(SO_PASSRIGHTS off, Linux 6.16: the sender's sendmsg fails with EPERM), and on
older kernels whatever arrives is handed to one closer thread of its own that
the daemon never waits for.  There every read of a connection takes the
descriptors that come with its bytes (room for the most one message may carry,
SCM_MAX_FD): any the kernel dropped for want of room, or that came with bytes read
by a plain recv, would be closed by the kernel on the daemon's thread, the trap
above.  A connection that sends some is closed, and while a close is stuck, the
uids whose descriptors wait behind it are refused new connections (each would
otherwise queue more open descriptors in the daemon).

MXFS_PASS_RIGHTS=1 in the daemon's environment leaves descriptors passable on a
kernel that could refuse them: the tests take the older kernels' path with it.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import Counter
from typing import Protocol

log = logging.getLogger("mxfs.control")

SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)  # Linux 6.16
SCM_MAX_FD = 253  # the most descriptors one message carries (the kernel's bound)
# Descriptors waiting for the closer past this: it is stuck in a close that will not end.
STUCK = 4096


class Settable(Protocol):
    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def refuse_rights(sock: Settable) -> bool:
    """Make the kernel refuse descriptors sent to `sock` (and, for a listener, to the
    connections it accepts); False on a kernel without SO_PASSRIGHTS."""
    if os.environ.get("MXFS_PASS_RIGHTS") == "1":
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
    except OSError:
        return False
    return True


class Closer:
    """Closes descriptors in a thread of its own, so a close that waits on this very
    daemon (or on a FUSE server that never answers) holds nobody."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._lock = threading.Lock()
        self._waiting: Counter[int] = Counter()  # descriptors not yet closed, by uid

    def stuck_for(self, uid: int) -> bool:
        """A close is stuck and descriptors `uid` sent wait behind it."""
        with self._lock:
            return self._queue.qsize() > STUCK and self._waiting[uid] > 0

    def close_all(self, fds: list[int], uid: int = 0) -> None:
        """Hand `fds` (sent by `uid`) over to be closed; returns at once."""
        if not fds:
            return
        with self._lock:
            self._waiting[uid] += len(fds)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mxfs-foreign-close",
                                            daemon=True)
            self._thread.start()
        for fd in fds:
            self._queue.put((fd, uid))
        if self._queue.qsize() > STUCK and not self._warned:
            self._warned = True
            log.warning("%d sent descriptors wait to be closed: a close is stuck (a file "
                        "on a FUSE mount that does not answer?)", self._queue.qsize())

    def _run(self) -> None:
        while True:
            fd, uid = self._queue.get()
            try:
                os.close(fd)
            except OSError:
                pass
            with self._lock:
                self._waiting[uid] -= 1
                if not self._waiting[uid]:
                    del self._waiting[uid]

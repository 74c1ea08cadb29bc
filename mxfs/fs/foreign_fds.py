"""Descriptors a control client sends the daemon: refused, or never taken in.

No request carries descriptors, but a client may attach some anyway
(SCM_RIGHTS).  Whatever thread of the daemon drops the last reference to one runs
what its file does at release, and a hostile sender picks that file: a TCP socket
with SO_LINGER and data its peer never takes waits in its release for as long as
the sender likes; a descriptor taken into the daemon's table and closed there sends
FLUSH to the filesystem it names (this very mount, or a FUSE server of the user's
own that never answers).  On the daemon's thread that holds every user; in a closer
thread it held the descriptors queued behind it, and a sender who kept sending
filled the daemon's table (524,288 descriptors in a second).

So the listener refuses descriptors outright (SO_PASSRIGHTS off, Linux 6.16: the
sender's sendmsg fails with EPERM).  On older kernels, the daemon never takes them:
each read of a connection peeks first, with no room for descriptors (`take`): a
peek that would have carried some says so (MSG_CTRUNC) and leaves them queued, and
the request is refused unread.  A connection that may still hold some when it ends
(`carries_rights`) is not closed here: its socket goes to a short-lived process of
its own (`Dropper`), whose exit drops them (a lingering socket does not linger in
an exiting process, and nothing is flushed by a purge), and whatever it meets there
holds only that process.

MXFS_PASS_RIGHTS=1 in the daemon's environment leaves descriptors passable on a
kernel that could refuse them: the tests take the older kernels' path with it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import subprocess
import sys
import termios
from typing import Any, Protocol

import trio

log = logging.getLogger("mxfs.control")

SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)  # Linux 6.16
BATCH_S = 0.05  # connections to drop gathered this long, then handed over at once
# The dropping process: it holds the sockets it inherited until its input closes
# (cat starts in a millisecond; Python, where there is no cat, in ten).
_HOLD = next(([p] for p in ("/bin/cat", "/usr/bin/cat") if os.access(p, os.X_OK)),
             [sys.executable, "-I", "-S", "-c", "import sys; sys.stdin.buffer.read()"])


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


async def take(conn: Any, n: int) -> tuple[bytes, bool]:
    """Up to `n` bytes of `conn` (a trio socket that may be sent descriptors), and
    whether descriptors came with them, in which case nothing is taken: peeked with
    no room for descriptors, the kernel reports them (MSG_CTRUNC) and leaves them
    queued; bytes that came without any are then read for good (the same bytes: a
    read takes the descriptors of the messages its bytes belong to, as a peek does)."""
    data, _, flags, _ = await conn.recvmsg(n, 0, socket.MSG_PEEK)
    if flags & socket.MSG_CTRUNC:
        return b"", True
    if not data:
        return b"", False
    got = await conn.recv(len(data))
    assert len(got) == len(data), "a connection's bytes were read by two tasks"
    return got, False


def unread(sock: Any) -> int:
    """Bytes sent to `sock` and not yet read."""
    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4)
    return int(struct.unpack("i", raw)[0])


def carries_rights(fd: int) -> bool:
    """Whether descriptors wait, unread, in socket `fd` (shut for reading first: none
    can come after): a peek over all its unread bytes stops at the first that came
    with some, and says so."""
    sock = socket.socket(fileno=fd)  # (a view of it: detached, never closed, below)
    try:
        n = unread(sock)
        if not n:
            return False
        _, _, flags, _ = sock.recvmsg(n, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    finally:
        sock.detach()
    return bool(flags & socket.MSG_CTRUNC)


class Dropper:
    """Sockets that may hold descriptors sent to the daemon, closed in a short-lived
    process: gathered for BATCH_S, then inherited by one process (`_HOLD`) that holds
    them while the daemon closes its copies (no longer the last), and drops them as
    it exits when its input closes.  The daemon never waits for it."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._due = trio.Event()
        self._procs: list[subprocess.Popen[bytes]] = []
        self.dropped = 0  # sockets handed over (for tests and status)

    def __len__(self) -> int:
        return len(self._fds)

    def drop(self, fd: int) -> None:
        """(The loop.)  Hand over socket `fd`, detached from its trio socket."""
        self._fds.append(fd)
        self._due.set()

    async def run(self) -> None:
        """(A task of the listener.)  Hand over what `drop` gathered, a batch at a time."""
        while True:
            await self._due.wait()
            await trio.sleep(BATCH_S)
            self._due = trio.Event()
            fds, self._fds = self._fds, []
            try:
                await trio.to_thread.run_sync(self._hand_over, fds)
            except OSError as e:  # (no process could start: tried again with the next)
                log.warning("could not start a process to close %d connections that were "
                            "sent descriptors (%s); trying again", len(fds), e)
                self._fds[:0] = fds
                await trio.sleep(1)
                self._due.set()

    def _hand_over(self, fds: list[int]) -> None:
        """(Worker thread.)  `fds` inherited by a new process, then closed here."""
        self._procs = [p for p in self._procs if p.poll() is None]  # (the exited reaped)
        proc = subprocess.Popen(_HOLD, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=fds, env={})
        if proc.poll() is not None:  # (gone already: ours would be the last copies)
            raise OSError(f"the process exited at once ({proc.returncode})")
        for fd in fds:
            os.close(fd)
        assert proc.stdin is not None
        proc.stdin.close()  # (it exits, dropping them)
        self._procs.append(proc)
        self.dropped += len(fds)

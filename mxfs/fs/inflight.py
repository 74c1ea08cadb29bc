"""Descriptors the daemon sent that their receiver has not taken yet.

The kernel bounds the descriptors a user has in flight in Unix sockets by that
user's open-file limit, but it charges the sender, and the daemon (root) is
exempt: a client that never reads its replies could have the daemon pin any
number of open files in its socket queue (133,900 for a user limited to 1,024),
until the whole system ran out.  So the daemon counts them itself: a reply's
descriptors are in flight while the connection has unread bytes (SIOCOUTQ), each
uid may have `max_fds_in_flight_per_user` in flight, and a connection that closes
with some unread is parked, still counted, until its peer reads or closes it.
"""

from __future__ import annotations

import array
import fcntl
import select
import termios
from typing import Any

import trio

PARK_POLL_S = 0.5


def unread_bytes(sock: Any) -> int:
    """Bytes this end sent that the peer has not read yet (SIOCOUTQ), 0 if unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf, True)
    except OSError:
        return 0
    return buf[0]


def readable_now(sock: Any) -> bool:
    """Whether the peer's bytes, or its close, wait to be read now (no waiting).  (poll,
    not select: select refuses a descriptor past 1,023, and a daemon serving hundreds
    of connections holds thousands.)"""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


async def park(sock: Any) -> None:
    """Wait until the peer has read what was sent, or closed (the kernel then drops
    what it held): the descriptors in flight stay counted against its uid until then.
    A hang-up is not enough: a peer that shut its socket down without closing it
    still holds what was sent, for it to read (8,000 descriptors past a bound of
    4,096, by a review)."""
    while unread_bytes(sock):
        await trio.sleep(PARK_POLL_S)

"""Which local user opened a loopback TCP connection (the kernel's sock_diag).

Every local user connects to a loopback listener from the same addresses, so limits
counted by address put a tenant and the host's monitoring in one bucket: a user who
spent it shut the monitoring out.  The other end of a loopback connection is a socket
of this host, and the kernel tells its owner's uid (`ss -e` reads it the same way):
one SOCK_DIAG_BY_FAMILY request for that socket, by its four-tuple.
"""

from __future__ import annotations

import contextlib
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
_NO_COOKIE = struct.pack("=II", 0xFFFFFFFF, 0xFFFFFFFF)
_UID_AT = 16 + 4 + 48 + 12  # nlmsghdr, inet_diag_msg's four bytes, its sockid, 3 u32s


class SocketOwners:
    """One netlink socket, asked in turn (by one thread: the /metrics server's)."""

    def __init__(self) -> None:
        self._nl: socket.socket | None = None
        self._seq = 0

    def uid(self, conn: socket.socket) -> int | None:
        """The uid owning the far end of loopback connection `conn` (None: unknown)."""
        try:
            here, there = conn.getsockname(), conn.getpeername()
            return self._ask(conn.family, there[0], there[1], here[0], here[1])
        except (OSError, ValueError, struct.error):
            self.close()  # (a fresh netlink socket next time: no stale reply read)
            return None

    def _ask(self, family: int, src: str, sport: int, dst: str, dport: int) -> int | None:
        def addr(a: str) -> bytes:
            return socket.inet_pton(family, a).ljust(16, b"\0")
        sockid = struct.pack("!HH", sport, dport) + addr(src) + addr(dst) + \
            struct.pack("=I", 0) + _NO_COOKIE
        body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
        self._seq += 1
        if self._nl is None:
            self._nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
            self._nl.settimeout(0.1)
        self._nl.send(struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY,
                                  NLM_F_REQUEST, self._seq, 0) + body)
        while True:
            reply = self._nl.recv(4096)
            kind, seq = struct.unpack_from("=4xH2xI", reply)
            if seq == self._seq:
                break
        if kind != SOCK_DIAG_BY_FAMILY:
            return None  # (NLMSG_ERROR: no such socket, closed already)
        return int(struct.unpack_from("=I", reply, _UID_AT)[0])

    def close(self) -> None:
        if self._nl is not None:
            with contextlib.suppress(OSError):
                self._nl.close()
            self._nl = None

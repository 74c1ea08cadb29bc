"""Which local user opened a loopback TCP connection (the kernel's sock_diag).

Every local user connects to a loopback listener from the same addresses, so limits
counted by address put a tenant and the host's monitoring in one bucket: a user who
spent it shut the monitoring out.  The other end of a loopback connection is a socket
of this host, and the kernel tells its owner's uid (`ss -e` reads it the same way):
one SOCK_DIAG_BY_FAMILY request for that socket, by its four-tuple.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import Iterator

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


NLM_F_DUMP = 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
TCP_LISTEN = 10
_DIAG_ADDR = slice(16 + 8, 16 + 24)  # the socket's own address, in the message
_DIAG_PORT = 16 + 4


def listener_uids(host: str, port: int) -> list[int]:
    """The uids owning the TCP listeners that keep `host`:`port` from being bound (on
    that port, at that address or every address; any address when `host` is every one),
    as `ss -ltne` reads them: one sock_diag dump of each family's listeners, made only
    when a bind failed.  Empty when none is found (a socket bound but not listening)."""
    uids: list[int] = []
    try:
        want = ipaddress.ip_address(host)
    except ValueError:  # (a host name: not looked up here)
        return uids
    with contextlib.suppress(OSError, struct.error), socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(0.5)
        for family in (socket.AF_INET, socket.AF_INET6):
            body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN) \
                + bytes(48)
            nl.send(struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY,
                                NLM_F_REQUEST | NLM_F_DUMP, family, 0) + body)
            for msg in _messages(nl):
                if struct.unpack_from("!H", msg, _DIAG_PORT)[0] != port:
                    continue
                raw = msg[_DIAG_ADDR][:4 if family == socket.AF_INET else 16]
                addr = ipaddress.ip_address(raw)
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                    addr = addr.ipv4_mapped
                if addr.is_unspecified or want.is_unspecified or addr == want:
                    uids.append(int(struct.unpack_from("=I", msg, _UID_AT)[0]))
    return uids


def _messages(nl: socket.socket) -> Iterator[bytes]:
    """The messages of one dump's replies, until its end."""
    while True:
        reply, at = nl.recv(1 << 16), 0
        while at + 16 <= len(reply):
            length, kind = struct.unpack_from("=IH", reply, at)
            if kind in (NLMSG_DONE, NLMSG_ERROR) or length < 16:
                return
            yield reply[at:at + length]
            at += (length + 3) & ~3

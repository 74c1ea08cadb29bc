"""The /metrics endpoint's HTTP server: one thread, a page of stored bytes, few slots.

Anyone on the host may connect, and the server runs in the daemon's process, so every
Python step it takes competes for the GIL with the daemon's one trio thread.  wsgiref
parsed up to 100 headers of 64 KiB a request (about 47 ms of Python each), took a
thread a connection, and closed the newcomer once SCRAPERS were held: a user scraping
in a loop cut every tenant's FUSE rate 3-15 times, and eight half-sent requests shut
Prometheus out.  So this one thread reads each request itself, REQUEST_BYTES at most,
whole within REQUEST_S, and answers with `page()` (bytes the caller stores and rebuilds
at most once a PAGE_S, metrics.py); each peer (`_peer`: a local user by tenant, her
subordinate uids with her, vol/tenants.py; any other host by address) opens
ACCEPT_BURST connections at once and ACCEPT_PER_S a second after (fs/accept_rate.py),
the rest closed as they come, and holds PER_PEER at once: past that, or past CONNS in
all, the oldest connection still held goes, not the newcomer.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mxfs.fs.accept_rate import AcceptRate
from mxfs.fs.chunk_service import peer_of
from mxfs.fs.socket_owner import SocketOwners
from mxfs.vol.tenants import tenant_of

REQUEST_BYTES = 8192  # a request line and headers, at most (more: 431, closed)
REQUEST_S = 0.5  # ... all of them sent within this of the connection's accept
SEND_S = 2.0  # the answer taken within this (a reader that stops reading goes)
PER_PEER = 4  # connections one peer holds at once (its oldest goes past them)
CONNS = 64  # ... and all peers together (the oldest goes past them)
ACCEPT_BURST, ACCEPT_PER_S = 16, 8  # each peer's connections (fs/accept_rate.py)
ACCEPTS = 64  # accepted at most at one wake-up, before the held connections' turn

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("mxfs.metrics")


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float
    got: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the answer, once the request is whole


class Server:
    """Serves `page()` on `listener` from `serve_forever`, its one thread."""

    def __init__(self, listener: socket.socket, page: Callable[[], bytes]) -> None:
        self.listener, self.page = listener, page
        listener.setblocking(False)
        self.rate = AcceptRate(ACCEPT_BURST, ACCEPT_PER_S)
        self.owners = SocketOwners()
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.conns: dict[socket.socket, _Conn] = {}  # oldest first

    def serve_forever(self) -> None:
        while True:
            now = time.monotonic()
            wait = min((c.deadline for c in self.conns.values()), default=now + 60) - now
            for key, _ in self.sel.select(max(0.0, wait)):
                if key.data is None:
                    self._accept()
                elif key.fileobj in self.conns:  # (not dropped by this round's accepts)
                    self._step(key.data)
            now = time.monotonic()
            for c in [c for c in self.conns.values() if c.deadline <= now]:
                self._drop(c)

    def _accept(self) -> None:
        for _ in range(ACCEPTS):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (out of descriptors: those held end within SEND_S;
                time.sleep(0.1)  # the listener stays readable, so not a spin meanwhile)
                return
            sock.setblocking(False)
            now = time.monotonic()
            peer = self._peer(sock, addr)
            if not self.rate.take(peer, now):
                sock.close()
                continue
            mine = [c for c in self.conns.values() if c.peer == peer]
            if len(mine) >= PER_PEER:
                self._drop(mine[0])
            elif len(self.conns) >= CONNS:
                self._drop(next(iter(self.conns.values())))
            c = _Conn(sock, peer, now + REQUEST_S)
            self.conns[sock] = c
            self.sel.register(sock, selectors.EVENT_READ, c)

    def _peer(self, sock: socket.socket, addr: tuple[str, int]) -> str:
        """Whom a connection counts to: on loopback its owner's tenant (any local user
        connects from every loopback address and port; counted by uid, each of her
        subordinate uids had buckets of its own, and churned past CONNS), else as the
        chunk service counts hosts (an address; an IPv6 /64)."""
        try:
            ip = ipaddress.ip_address(addr[0].split("%")[0])
        except ValueError:
            return "?"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # (a dual-stack listener's IPv4 peers)
        if ip.is_loopback:
            uid = self.owners.uid(sock)
            if uid is not None:
                return f"uid {tenant_of(uid)}"
        return peer_of(ip, 1024)

    def _step(self, c: _Conn) -> None:
        try:
            if c.out is None:
                data = c.sock.recv(REQUEST_BYTES + 1 - len(c.got))
                if not data:
                    self._drop(c)
                    return
                c.got += data
                if b"\r\n\r\n" in c.got or b"\n\n" in c.got or len(c.got) > REQUEST_BYTES:
                    self._answer(c)
            if c.out is not None:
                c.out = c.out[c.sock.send(c.out):]
                if not c.out:
                    self._drop(c)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(c)

    def _answer(self, c: _Conn) -> None:
        """The page (GET or HEAD of / or /metrics), else the error; then close."""
        parts = bytes(c.got.split(b"\n", 1)[0]).split()
        body = b""
        if len(c.got) > REQUEST_BYTES:
            status = b"431 Request Header Fields Too Large"
        elif len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            status = b"400 Bad Request"
        elif parts[0] not in (b"GET", b"HEAD"):
            status = b"405 Method Not Allowed"
        elif parts[1].split(b"?")[0] not in (b"/", b"/metrics"):
            status = b"404 Not Found"
        else:
            try:
                status, body = b"200 OK", self.page()
            except Exception:  # (this thread serves every later scrape: it goes on)
                log.exception("the /metrics page could not be built")
                status = b"500 Internal Server Error"
        head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" \
               b"Connection: close\r\n\r\n" % (status, CONTENT_TYPE, len(body))
        c.out = memoryview(head + (b"" if parts[:1] == [b"HEAD"] else body))
        c.deadline = time.monotonic() + SEND_S
        self.sel.modify(c.sock, selectors.EVENT_WRITE, c)

    def _drop(self, c: _Conn) -> None:
        self.conns.pop(c.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(c.sock)
        c.sock.close()


def serve(addr: str, port: int, page: Callable[[], bytes]) -> None:
    """Listen on `addr`:`port` and serve there from a thread of its own (OSError if it
    cannot bind)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    server = Server(listener, page)
    threading.Thread(target=server.serve_forever, daemon=True, name="mxfs-metrics").start()

"""The daemon's counters: requests, latencies, bytes per member, errors; and their exports.

One `Metrics` per daemon.  FUSE handlers and control requests record a count and a
latency per operation (and the errno when they fail); chunk I/O records bytes and
operations per member.  `snapshot()` is what `mxfs top` polls over the control
socket; `serve_prometheus(port)` exposes the same, plus pool and KV gauges, at
http://host:port/metrics for Prometheus.

Anyone on the host may scrape, as often as they like, from prometheus_client's thread;
the gauges read the store and the KV index, which are the daemon's trio thread's alone
(a scrape beside a write storm once broke the store's connection: EIO on the mount).
So `Gauges` gathers them on that thread (`trio.from_thread`), at most once every
GAUGES_S, and every scrape in between gets the last gathering.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

from mxfs.io.batch import taken_back
from mxfs.proto.messages import MetricsSnapshot

GAUGES_S = 1.0  # the pool gauges are gathered at most this often, whatever the scrapes
SCRAPE_S = 2.0  # a scrape's connection is served this long at most
SCRAPERS = 8  # ... and so many at once

# Latency buckets (seconds) of the request histograms.
BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class Metrics:
    """Thread-safe counters (worker threads record chunk I/O)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (kind, op)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.buckets: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * len(BUCKETS))
        self.errors: dict[tuple[str, str, int], int] = defaultdict(int)  # (kind, op, errno)
        self.io_bytes: dict[tuple[int, str], int] = defaultdict(int)  # (member, read|write)
        self.io_ops: dict[tuple[int, str], int] = defaultdict(int)
        self.total = 0  # requests of every kind (what wake_latency_us watches)

    def request(self, kind: str, op: str, seconds: float, err: int | None = None) -> None:
        with self._lock:
            key = (kind, op)
            self.total += 1
            self.requests[key] += 1
            self.seconds[key] += seconds
            counts = self.buckets[key]
            for i, edge in enumerate(BUCKETS):
                if seconds <= edge:
                    counts[i] += 1
            if err is not None:
                self.errors[(kind, op, err)] += 1

    def io(self, member: int, what: str, nbytes: int) -> None:
        with self._lock:
            self.io_bytes[(member, what)] += nbytes
            self.io_ops[(member, what)] += 1

    def snapshot(self) -> MetricsSnapshot:
        """Every counter, JSON-ready (what `mxfs top` and `mxfs status --json` read)."""
        with self._lock:
            return {
                "time": time.time(), "uptime": time.time() - self.started,
                "requests": [[k, o, n, self.seconds[(k, o)]] for (k, o), n in
                             sorted(self.requests.items())],
                "errors": [[k, o, e, n] for (k, o, e), n in sorted(self.errors.items())],
                "io": [[m, w, self.io_bytes[(m, w)], n] for (m, w), n in
                       sorted(self.io_ops.items())],
            }

    def timed(self, kind: str, op: str) -> _Timer:
        return _Timer(self, kind, op)


class _Timer:
    """`with metrics.timed(kind, op):` counts the request, its latency and its errno."""

    def __init__(self, metrics: Metrics, kind: str, op: str) -> None:
        self.metrics, self.kind, self.op = metrics, kind, op

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        err = None
        if exc is not None:
            err = getattr(exc, "errno", None) or 5  # EIO when it carries none
        self.metrics.request(self.kind, self.op, time.perf_counter() - self.start, err)


class Gauges:
    """The pool gauges for /metrics, gathered by `gather()` on the daemon's trio thread
    (once `token` is set: until then, none) at most once every GAUGES_S."""

    def __init__(self, gather: Callable[[], Awaitable[list[Any]]]) -> None:
        self.gather = gather
        self.token: trio.lowlevel.TrioToken | None = None  # the daemon's loop, once it runs
        self._lock = threading.Lock()
        self._at = -GAUGES_S
        self._last: list[Any] = []

    def __call__(self) -> Iterator[Any]:
        with self._lock:
            if self.token is not None and time.monotonic() - self._at >= GAUGES_S:
                try:
                    self._last = trio.from_thread.run(self.gather, trio_token=self.token)
                except (trio.RunFinishedError, trio.Cancelled):  # (unmounting)
                    self._last = []
                self._at = time.monotonic()
            yield from self._last


def serve_prometheus(metrics: Metrics, addr: str, port: int,
                     gauges: Callable[[], Iterator[Any]]) -> None:
    """Serve /metrics on `addr`:`port`, collected at scrape time: SCRAPERS connections
    at once (a thread each; more are closed at once), each served SCRAPE_S at most:
    prometheus_client's own server took a thread for each connection, for as long as
    it stayed silent, and any user on the host could open thousands.

    `gauges()` yields extra metric families (pool capacity, members, KV namespaces).
    """
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self) -> Iterator[Any]:
            snap = metrics.snapshot()
            req = CounterMetricFamily("mxfs_requests", "Requests served", labels=["kind", "op"])
            err = CounterMetricFamily("mxfs_errors", "Requests that failed",
                                      labels=["kind", "op", "errno"])
            by = CounterMetricFamily("mxfs_member_bytes", "Bytes moved by the daemon",
                                     labels=["member", "direction"])
            ops = CounterMetricFamily("mxfs_member_ops", "I/O operations by the daemon",
                                      labels=["member", "direction"])
            lat = HistogramMetricFamily("mxfs_request_seconds", "Request latency",
                                        labels=["kind", "op"])
            with metrics._lock:
                for (k, o), n in metrics.requests.items():
                    req.add_metric([k, o], n)
                    cum = list(zip((str(b) for b in BUCKETS), metrics.buckets[(k, o)],
                                   strict=True))
                    lat.add_metric([k, o], cum + [("+Inf", n)], metrics.seconds[(k, o)])
            for k, o, e, n in snap["errors"]:
                err.add_metric([k, o, str(e)], n)
            for m, w, nbytes, n in snap["io"]:
                by.add_metric([str(m), w], nbytes)
                ops.add_metric([str(m), w], n)
            back = CounterMetricFamily("mxfs_io_requests_taken_back", "I/O requests the "
                                       "kernel did not complete in time, redone on a thread")
            back.add_metric([], taken_back())
            yield from (req, err, by, ops, lat, back)
            yield from gauges()

    REGISTRY.register(Collector())
    _serve(addr, port)


def _serve(addr: str, port: int) -> None:
    """The /metrics endpoint's server and its one thread (OSError if it cannot bind)."""
    import socket
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import REGISTRY, make_wsgi_app

    class Handler(WSGIRequestHandler):
        timeout = SCRAPE_S  # (a connection that sends nothing, or takes nothing, goes)

        def setup(self) -> None:
            """SCRAPE_S for the whole request, not each read: a client sending a byte
            a second held a scraper's slot for hours (the socket shut at the end of it
            ends whatever read or write waits)."""
            super().setup()
            self._deadline = threading.Timer(SCRAPE_S, self._cut)
            self._deadline.daemon = True
            self._deadline.start()

        def _cut(self) -> None:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def finish(self) -> None:
            self._deadline.cancel()
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # (not a line a scrape on the daemon's log)

    class Server(ThreadingMixIn, WSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        daemon_threads = True
        request_queue_size = 128  # (connections waiting to be accepted, or closed)
        slots = threading.BoundedSemaphore(SCRAPERS)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)  # (SCRAPERS are being served)
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    server = make_server(addr, port, make_wsgi_app(REGISTRY), Server, Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="mxfs-metrics").start()

"""The daemon's counters: requests, latencies, bytes per member, errors; and their exports.

One `Metrics` per daemon.  FUSE handlers and control requests record a count and a
latency per operation (and the errno when they fail); chunk I/O records bytes and
operations per member.  `snapshot()` is what `mxfs top` polls over the control
socket; `serve_prometheus(port)` exposes the same, plus pool and KV gauges, at
http://host:port/metrics for Prometheus.

Anyone on the host may scrape, as often as they like, from the endpoint's thread (in
this process: its Python steps take the GIL from the daemon's trio thread); so the page
is built at most once every PAGE_S (`Page`) and every scrape in between gets the same
bytes.  The gauges read the store and the KV index, which are the daemon's trio thread's
alone (a scrape beside a write storm once broke the store's connection: EIO on the
mount), so `Gauges` gathers them on that thread (`trio.from_thread`) for each build.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio

from mxfs.io.batch import taken_back
from mxfs.proto.messages import MetricsSnapshot

PAGE_S = 1.0  # the /metrics page is built at most this often, whatever the scrapes

# Latency buckets (seconds) of the request histograms.
BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass(frozen=True, slots=True)
class Counts:
    """`Metrics`' counters at one moment, copied (see `Metrics.counts`)."""

    requests: dict[tuple[str, str], int]
    seconds: dict[tuple[str, str], float]
    buckets: dict[tuple[str, str], list[int]]
    errors: dict[tuple[str, str, int], int]
    io_bytes: dict[tuple[int, str], int]
    io_ops: dict[tuple[int, str], int]


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

    def counts(self) -> Counts:
        """A copy of every counter: the lock held only to copy them."""
        with self._lock:
            return Counts(dict(self.requests), dict(self.seconds),
                          {k: list(v) for k, v in self.buckets.items()}, dict(self.errors),
                          dict(self.io_bytes), dict(self.io_ops))

    def snapshot(self) -> MetricsSnapshot:
        """Every counter, JSON-ready (what `mxfs top` and `mxfs status --json` read)."""
        c = self.counts()
        return {
            "time": time.time(), "uptime": time.time() - self.started,
            "requests": [[k, o, n, c.seconds[(k, o)]] for (k, o), n in
                         sorted(c.requests.items())],
            "errors": [[k, o, e, n] for (k, o, e), n in sorted(c.errors.items())],
            "io": [[m, w, c.io_bytes[(m, w)], n] for (m, w), n in sorted(c.io_ops.items())],
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
    (once `token` is set: until then, none) as each page is built (once a PAGE_S)."""

    def __init__(self, gather: Callable[[], Awaitable[list[Any]]]) -> None:
        self.gather = gather
        self.token: trio.lowlevel.TrioToken | None = None  # the daemon's loop, once it runs

    def __call__(self) -> Iterator[Any]:
        if self.token is None:
            return
        try:
            yield from trio.from_thread.run(self.gather, trio_token=self.token)
        except (trio.RunFinishedError, trio.Cancelled):  # (unmounting)
            pass


class Page:
    """The /metrics page: built by `build()` at most once a PAGE_S, and the same bytes
    served to every scrape in between (a scrape in a loop rebuilt it each time, its
    Python steps holding the GIL from the daemon's trio thread)."""

    def __init__(self, build: Callable[[], bytes]) -> None:
        self.build = build
        self.builds = 0
        self._at = 0.0
        self._page: bytes | None = None

    def __call__(self) -> bytes:
        now = time.monotonic()
        if self._page is None or now - self._at >= PAGE_S:
            self._page, self._at = self.build(), now
            self.builds += 1
        return self._page


def serve_prometheus(metrics: Metrics, addr: str, port: int,
                     gauges: Callable[[], Iterator[Any]]) -> None:
    """Serve /metrics on `addr`:`port` (fs/metrics_http.py), the page built at most
    once a PAGE_S from a copy of the counters (the trio thread takes their lock on
    every request: the page's text is made outside it).

    `gauges()` yields extra metric families (pool capacity, members, KV namespaces).
    """
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    from mxfs.fs.metrics_http import serve

    class Collector:
        def collect(self) -> Iterator[Any]:
            c = metrics.counts()
            req = CounterMetricFamily("mxfs_requests", "Requests served", labels=["kind", "op"])
            err = CounterMetricFamily("mxfs_errors", "Requests that failed",
                                      labels=["kind", "op", "errno"])
            by = CounterMetricFamily("mxfs_member_bytes", "Bytes moved by the daemon",
                                     labels=["member", "direction"])
            ops = CounterMetricFamily("mxfs_member_ops", "I/O operations by the daemon",
                                      labels=["member", "direction"])
            lat = HistogramMetricFamily("mxfs_request_seconds", "Request latency",
                                        labels=["kind", "op"])
            for (k, o), n in c.requests.items():
                req.add_metric([k, o], n)
                cum = list(zip((str(b) for b in BUCKETS), c.buckets[(k, o)], strict=True))
                lat.add_metric([k, o], cum + [("+Inf", n)], c.seconds[(k, o)])
            for (k, o, e), n in c.errors.items():
                err.add_metric([k, o, str(e)], n)
            for (m, w), n in c.io_ops.items():
                by.add_metric([str(m), w], c.io_bytes[(m, w)])
                ops.add_metric([str(m), w], n)
            back = CounterMetricFamily("mxfs_io_requests_taken_back", "I/O requests the "
                                       "kernel did not complete in time, redone on a thread")
            back.add_metric([], taken_back())
            yield from (req, err, by, ops, lat, back)
            yield from gauges()

    REGISTRY.register(Collector())
    serve(addr, port, Page(lambda: generate_latest(REGISTRY)))

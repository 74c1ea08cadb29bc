"""How fast one peer may open connections: a token bucket per peer address.  (The
same buckets pace a tenant's xattr bytes, `fs/ops.py`: `wait` takes into debt and says
how long to wait, where `take` refuses.)

The chunk service's handshake limits bound how many connections a peer holds unproved,
not how often it opens them: a host that opened and closed connections as fast as it
could cost the daemon's one trio thread an accept, a task and a handshake start each,
every one of them let in.  `AcceptRate` lets each peer `burst` connections at once and
`per_s` a second after that; the rest are closed as they are accepted.

Peers are whatever the caller counts as one (the chunk service: an address, loopback
as one, an IPv6 /64, its unreserved ports apart).  The table is bounded: a peer whose
bucket has filled again is dropped (it would start full anyway), and past `peers`
the least recently seen goes, so a scan from many addresses costs a bounded table.
Each peer's refusals are reported once a `report_s` at most (`due`), counted, so a
flood costs a line a minute an address, not one a connection.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PEERS = 4096  # buckets kept at most (the least recently seen dropped past it)
REPORT_S = 60.0  # a peer's refused connections are reported this often at most


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float  # when `tokens` was counted
    refused: int = 0  # connections refused since the last report
    reported: float | None = None  # when that was


class AcceptRate:
    """Token buckets by peer; `now` is any monotonic clock in seconds (trio's)."""

    def __init__(self, burst: int, per_s: int, peers: int = PEERS,
                 report_s: float = REPORT_S) -> None:
        self.burst, self.per_s, self.peers, self.report_s = burst, per_s, peers, report_s
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently seen first

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, peer: str, now: float) -> _Bucket:
        """`peer`'s bucket, filled up to `now`, as the most recently seen."""
        b = self._buckets.pop(peer, None)
        self._forget(now)
        if b is None:
            b = _Bucket(float(self.burst), now)
        else:
            b.tokens, b.at = self._refilled(b, now), now
        self._buckets[peer] = b  # (the most recently seen, last)
        return b

    def take(self, peer: str, now: float) -> bool:
        """Whether `peer` may open one more connection now (counted if not)."""
        b = self._bucket(peer, now)
        if b.tokens >= 1:
            b.tokens -= 1
            return True
        b.refused += 1
        return False

    def wait(self, peer: str, n: float, now: float) -> float:
        """Take `n` tokens from `peer`'s bucket, into debt where it holds fewer: how many
        seconds `peer` should wait before it goes on (0: at once), so that what it does
        runs at `per_s` once its burst is spent."""
        b = self._bucket(peer, now)
        b.tokens -= n
        return max(0.0, -b.tokens / self.per_s)

    def due(self, peer: str, now: float) -> int:
        """`peer`'s connections refused since its last report when one is due now
        (none in the last `report_s`), else 0; a report due is taken as made."""
        b = self._buckets.get(peer)
        if b is None or not b.refused or \
                (b.reported is not None and now - b.reported < self.report_s):
            return 0
        n, b.refused, b.reported = b.refused, 0, now
        return n

    def _refilled(self, b: _Bucket, now: float) -> float:
        return min(float(self.burst), b.tokens + max(0.0, now - b.at) * self.per_s)

    def _forget(self, now: float) -> None:
        """Drop the least recently seen buckets while they are full again (a peer
        quiet that long starts afresh) or the table leaves no room for one more."""
        while self._buckets:
            b = next(iter(self._buckets.values()))
            if len(self._buckets) < self.peers and self._refilled(b, now) < self.burst:
                return
            self._buckets.popitem(last=False)

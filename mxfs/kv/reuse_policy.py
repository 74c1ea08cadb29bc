"""How much of a cached prefix to read: never more than computing it would cost.

A KV hit is only worth reading while the pool delivers it faster than the instance
can compute it.  On a slow pool (one disk, a throttled or busy member, a remote node)
a long prefix read at the pool's rate can take longer than prefilling it, and a
client that reads every hit serves that request slower than one with no pool at all.

For a prompt of n tokens whose first `found` chunks (of `chunk_tokens`) are in the
pool, reading the first c of them costs

    read(c)    = latency + c x chunk_bytes / read bandwidth        (0 for c = 0)
    compute(c) = overhead + prefill_flops(n, c x chunk_tokens) x seconds per FLOP

(the prefill of the other tokens against the c read: `mxfs.kv.ttft.Model.prefill_flops`)
and `plan` picks the c in 0..found with the least read(c) + compute(c); a tie reads
more (it spares the accelerator).  Both rates are measured as requests run (`observe_read`
after each get: a moving average; `observe_prefill` after each prefill: a line fitted
through the prefills seen, recent ones weighing more, so that a short prefill's fixed
costs are not taken for a slow accelerator), or set where they are known (`read_bps`,
`seconds_per_flop`).  Until a read was measured the
policy reads every hit (that read measures the pool); until a prefill was measured it
reads too (nothing to weigh it against).  A policy that stopped reading would never see
the pool get faster, so every PROBE_EVERY-th plan that reads nothing reads one chunk.
Engine adapters that are given only the instance's prefill rate (tokens a second:
SGLang, vLLM and LMCache report no prefill times to a storage backend) take
`per_token_policy`: each token costs the same to compute, which underestimates a long
context's attention, so such a policy leans to recomputing, never to a read that loses.
Stdlib only, like `mxfs.kv.ttft`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SMOOTHING = 0.3  # weight of the newest read in the read rate's moving average
FORGET = 0.9  # each prefill seen weighs this much less with every newer one
PROBE_EVERY = 16  # plans reading nothing in a row before one reads a chunk to measure


@dataclass(frozen=True)
class Plan:
    """What `ReusePolicy.plan` decided, and the costs it weighed (seconds; None: not
    known yet, so every hit is read)."""

    read_chunks: int
    found_chunks: int
    expected_s: float | None
    read_all_s: float | None
    compute_all_s: float | None
    read_bps: float | None = None  # the rates it weighed them by
    seconds_per_flop: float | None = None
    overhead_s: float = 0.0


class ReusePolicy:
    def __init__(self, chunk_tokens: int, chunk_bytes: int,
                 prefill_flops: Callable[[int, int], float], *,
                 read_bps: float | None = None, seconds_per_flop: float | None = None,
                 latency_s: float = 0.0) -> None:
        """`prefill_flops(n, cached)`: FLOPs to prefill a prompt of n tokens whose first
        `cached` tokens' KV is at hand.  `read_bps`, `seconds_per_flop`: rates known
        ahead (else measured); `latency_s`: what a read costs before its first byte."""
        if chunk_tokens <= 0 or chunk_bytes <= 0:
            raise ValueError("chunk_tokens and chunk_bytes must be positive")
        self.chunk_tokens, self.chunk_bytes = chunk_tokens, chunk_bytes
        self.prefill_flops = prefill_flops
        self.read_bps, self.given_spf = read_bps, seconds_per_flop
        self.latency_s = latency_s
        self._prefills = _Line()
        self._unread = 0  # plans in a row that read nothing
        self.fixed_read = read_bps is not None  # measurements do not move a given rate

    @property
    def seconds_per_flop(self) -> float | None:
        return self.given_spf if self.given_spf is not None else self._prefills.fit()[0]

    @property
    def overhead_s(self) -> float:
        """What every prefill costs besides its FLOPs (launches, the first token's step)."""
        return 0.0 if self.given_spf is not None else self._prefills.fit()[1]

    def pin_read_rate(self, read_bps: float | None) -> None:
        """Take the pool's read rate as given (a throttled pool, a known link), or, with
        None, measure it again from the next read."""
        self.read_bps, self.fixed_read = read_bps, read_bps is not None

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A get of `nbytes` took `seconds` (wall time, as the request waited for it)."""
        if self.fixed_read or nbytes <= 0 or seconds <= 0:
            return
        self.read_bps = _smooth(self.read_bps, nbytes / seconds)

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A prefill of `prompt_tokens` with the first `cached_tokens` at hand took
        `seconds`."""
        flops = self.prefill_flops(prompt_tokens, cached_tokens)
        if flops > 0 and seconds > 0:
            self._prefills.add(flops, seconds)

    def read_s(self, chunks: int) -> float | None:
        if chunks == 0:
            return 0.0
        if not self.read_bps:
            return None
        return self.latency_s + chunks * self.chunk_bytes / self.read_bps

    def compute_s(self, prompt_tokens: int, cached_tokens: int) -> float | None:
        spf = self.seconds_per_flop
        if spf is None:
            return None
        return self.overhead_s + self.prefill_flops(prompt_tokens, cached_tokens) * spf

    def plan(self, prompt_tokens: int, found_chunks: int, have_tokens: int = 0) -> Plan:
        """How many of the `found_chunks` chunks the pool holds after the prompt's first
        `have_tokens` (already at hand: the instance's own memory) to read."""
        found = max(0, min(found_chunks, (prompt_tokens - have_tokens) // self.chunk_tokens))
        read_all = self.read_s(found)
        compute_all = self.compute_s(prompt_tokens, have_tokens)
        rates = (self.read_bps, self.seconds_per_flop, self.overhead_s)
        if read_all is None or compute_all is None:
            return Plan(found, found, None, read_all, compute_all, *rates)
        best, best_s = 0, compute_all
        for c in range(1, found + 1):
            read = self.read_s(c)
            compute = self.compute_s(prompt_tokens, have_tokens + c * self.chunk_tokens)
            assert read is not None and compute is not None
            if read + compute <= best_s:
                best, best_s = c, read + compute
        if found and not best:
            self._unread += 1
            if self._unread >= PROBE_EVERY:  # look at the pool's rate again
                self._unread, best = 0, 1
                best_s = self.read_s(1) + self.compute_s(prompt_tokens,  # type: ignore[operator]
                                                         have_tokens + self.chunk_tokens)
        elif best:
            self._unread = 0
        return Plan(best, found, best_s, read_all, compute_all, *rates)


def prefill_rate(value: Any, who: str) -> float | None:
    """An engine config's "prefill_tokens_per_s": absent (None), or a positive rate;
    anything else refused naming the key (`who`: the adapter, for the message)."""
    if value is None:
        return None
    try:
        rate = float(value)
    except (TypeError, ValueError):
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"{who}: \"prefill_tokens_per_s\" is {value!r}: give the "
                         "instance's prefill rate in tokens a second, e.g. 20000")
    return rate


def per_token_policy(chunk_tokens: int, chunk_bytes: int, tokens_per_s: float
                     ) -> ReusePolicy:
    """A policy for an instance known only by its prefill rate: every token's compute
    costs the same (see the module's docstring), the pool's rate measured by gets."""
    return ReusePolicy(chunk_tokens, chunk_bytes,
                       lambda prompt, cached: float(prompt - cached),  # (tokens to compute)
                       seconds_per_flop=1.0 / tokens_per_s)


class _Line:
    """seconds = overhead + FLOPs x slope, least squares over the prefills seen, each
    weighing FORGET less with every newer one.  With one size seen (or a fit that
    noise made slope the wrong way) the line goes through the origin instead, fitted
    to the same points (the largest prefills weigh most, as for the decisions that
    matter: whether to read a long prefix)."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        f = FORGET
        self.w, self.x, self.y = f * self.w + 1, f * self.x + x, f * self.y + y
        self.xx, self.xy = f * self.xx + x * x, f * self.xy + x * y

    def fit(self) -> tuple[float | None, float]:
        """(slope, overhead); (None, 0) before any prefill."""
        if not self.x:
            return None, 0.0
        spread = self.w * self.xx - self.x * self.x
        if spread > 1e-6 * self.w * self.xx:
            slope = (self.w * self.xy - self.x * self.y) / spread
            overhead = (self.y - slope * self.x) / self.w
            if slope > 0 and overhead >= 0:
                return slope, overhead
        return self.xy / self.xx, 0.0


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

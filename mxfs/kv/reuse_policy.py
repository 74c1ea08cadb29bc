"""How much of a cached prefix to read: never more than computing it would cost.

A KV hit is only worth reading while the pool delivers it faster than the instance
can compute it.  On a slow pool (one disk, a throttled or busy member, a remote node)
a long prefix read at the pool's rate can take longer than prefilling it, and a
client that reads every hit serves that request slower than one with no pool at all.

For a prompt of n tokens whose first `found` chunks (of `chunk_tokens`) are in the
pool, reading the first c of them costs

    read(c)    = latency + c x chunk_bytes / read bandwidth        (0 for c = 0)
    compute(c) = prefill_flops(n, c x chunk_tokens) x seconds per FLOP

(the prefill of the other tokens against the c read: `mxfs.kv.ttft.Model.prefill_flops`)
and `plan` picks the c in 0..found with the least read(c) + compute(c); a tie reads
more (it spares the accelerator).  Both rates are measured as requests run (`observe_read`
after each get, `observe_prefill` after each prefill; a moving average each), or set
where they are known (`read_bps`, `seconds_per_flop`).  Until a read was measured the
policy reads every hit (that read measures the pool); until a prefill was measured it
reads too (nothing to weigh it against).  Stdlib only, like `mxfs.kv.ttft`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest measurement in the moving averages


@dataclass(frozen=True)
class Plan:
    """What `ReusePolicy.plan` decided, and the costs it weighed (seconds; None: not
    known yet, so every hit is read)."""

    read_chunks: int
    found_chunks: int
    expected_s: float | None
    read_all_s: float | None
    compute_all_s: float | None


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
        self.read_bps, self.seconds_per_flop = read_bps, seconds_per_flop
        self.latency_s = latency_s
        self.fixed_read = read_bps is not None  # measurements do not move a given rate
        self.fixed_compute = seconds_per_flop is not None

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
        if self.fixed_compute or flops <= 0 or seconds <= 0:
            return
        self.seconds_per_flop = _smooth(self.seconds_per_flop, seconds / flops)

    def read_s(self, chunks: int) -> float | None:
        if chunks == 0:
            return 0.0
        if not self.read_bps:
            return None
        return self.latency_s + chunks * self.chunk_bytes / self.read_bps

    def compute_s(self, prompt_tokens: int, cached_tokens: int) -> float | None:
        if self.seconds_per_flop is None:
            return None
        return self.prefill_flops(prompt_tokens, cached_tokens) * self.seconds_per_flop

    def plan(self, prompt_tokens: int, found_chunks: int, have_tokens: int = 0) -> Plan:
        """How many of the `found_chunks` chunks the pool holds after the prompt's first
        `have_tokens` (already at hand: the instance's own memory) to read."""
        found = max(0, min(found_chunks, (prompt_tokens - have_tokens) // self.chunk_tokens))
        read_all = self.read_s(found)
        compute_all = self.compute_s(prompt_tokens, have_tokens)
        if read_all is None or compute_all is None:
            return Plan(found, found, None, read_all, compute_all)
        best, best_s = 0, compute_all
        for c in range(1, found + 1):
            read = self.read_s(c)
            compute = self.compute_s(prompt_tokens, have_tokens + c * self.chunk_tokens)
            assert read is not None and compute is not None
            if read + compute <= best_s:
                best, best_s = c, read + compute
        return Plan(best, found, best_s, read_all, compute_all)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

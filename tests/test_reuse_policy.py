"""The reuse policy (mxfs.kv.reuse_policy): read a cached prefix only where reading it
beats computing it, by the rates measured or given."""

from __future__ import annotations

import pytest

from mxfs.kv.reuse_policy import ReusePolicy
from mxfs.kv.ttft import MODELS

QWEN = MODELS["qwen2.5-32b"]
CHUNK = 256
CHUNK_BYTES = QWEN.kv_bytes_per_token() * CHUNK  # 64 MiB
H200_HALF = 1 / (989e12 * 0.5)  # seconds per FLOP at half of an H200's dense BF16 rate


def policy(read_gbps: float | None = None, spf: float | None = H200_HALF) -> ReusePolicy:
    return ReusePolicy(CHUNK, CHUNK_BYTES, QWEN.prefill_flops,
                       read_bps=read_gbps * 1e9 if read_gbps else None, seconds_per_flop=spf)


def test_a_fast_pool_reads_every_hit_and_a_slow_one_none() -> None:
    n, found = 16384 + 64, 64  # a 16k-token prefix and a question
    fast, slow = policy(100.0).plan(n, found), policy(0.05).plan(n, found)
    assert fast.read_chunks == found and fast.expected_s is not None
    assert fast.expected_s < fast.compute_all_s  # type: ignore[operator]
    assert slow.read_chunks == 0
    assert slow.expected_s == slow.compute_all_s  # never slower than recomputing


def test_the_choice_is_the_cheapest_of_every_split() -> None:
    """At a rate near break-even, the plan's cost is the least of all c in 0..found, and
    never above recomputing (nor above reading everything)."""
    n, found = 8192, 32
    for gbps in (0.5, 1.0, 2.0, 4.0, 8.0):
        p = policy(gbps)
        plan = p.plan(n, found)
        costs = [p.read_s(c) + p.compute_s(n, c * CHUNK) for c in range(found + 1)]  # type: ignore[operator]
        assert plan.expected_s == pytest.approx(min(costs))
        assert costs[plan.read_chunks] == pytest.approx(min(costs))
        assert plan.expected_s <= plan.compute_all_s  # type: ignore[operator]


def test_chunks_at_hand_are_free_and_not_reread() -> None:
    """Tokens the instance holds already count as cached; the plan never reads past the
    prompt's whole chunks."""
    p = policy(100.0)
    plan = p.plan(4 * CHUNK + 10, 10, have_tokens=2 * CHUNK)
    assert plan.found_chunks == 2 and plan.read_chunks == 2
    assert p.compute_s(4 * CHUNK + 10, 2 * CHUNK) == plan.compute_all_s


def test_unknown_rates_read_every_hit_until_measured() -> None:
    p = ReusePolicy(CHUNK, CHUNK_BYTES, QWEN.prefill_flops)
    assert p.plan(8192, 32).read_chunks == 32  # nothing measured: read (that measures it)
    p.observe_read(CHUNK_BYTES, 2.0)  # 64 MiB in 2 s: 34 MB/s, a crawling pool
    assert p.plan(8192, 32).read_chunks == 32  # no prefill rate yet
    p.observe_prefill(8192, 0, 0.5)  # this instance prefills 8k tokens in 0.5 s
    assert p.plan(8192, 32).read_chunks == 0
    for _ in range(20):  # the pool got fast: the moving average follows
        p.observe_read(CHUNK_BYTES * 32, 0.01)
    assert p.plan(8192, 32).read_chunks == 32


def test_a_pinned_rate_is_not_moved_by_measurements() -> None:
    p = policy(0.05)
    p.observe_read(CHUNK_BYTES * 32, 0.001)
    assert p.plan(16384, 64).read_chunks == 0
    p.pin_read_rate(None)  # measure again
    p.observe_read(CHUNK_BYTES * 32, 0.01)
    assert p.plan(16384, 64).read_chunks == 64
    with pytest.raises(ValueError):
        ReusePolicy(0, CHUNK_BYTES, QWEN.prefill_flops)


def test_short_prefills_fixed_costs_are_not_taken_for_a_slow_accelerator() -> None:
    """Prefills of a few tokens are mostly fixed costs: fitted as a line through every
    prefill seen, they do not make a long one look slower than it is."""
    def flops(n: int, cached: int) -> float:
        return (n - cached) * 1e9

    def truth(n: int, cached: int) -> float:
        return 0.05 + flops(n, cached) * 1e-12  # 50 ms a prefill, 1 TFLOP/s

    p = ReusePolicy(CHUNK, CHUNK_BYTES, flops)
    p.observe_prefill(1024, 0, truth(1024, 0))
    for _ in range(3):  # three 64-token prefills after a cached prefix
        p.observe_prefill(4096 + 64, 4096, truth(4096 + 64, 4096))
    assert p.compute_s(4096, 0) == pytest.approx(truth(4096, 0), rel=1e-6)
    assert p.overhead_s == pytest.approx(0.05)


def test_a_policy_that_reads_nothing_probes_the_pool_now_and_then() -> None:
    """Reading nothing measures nothing: one plan in PROBE_EVERY reads a chunk, so a
    pool that got fast is seen and read again."""
    from mxfs.kv.reuse_policy import PROBE_EVERY

    p = policy()
    p.observe_read(CHUNK_BYTES, 10.0)  # a crawling pool
    plans = [p.plan(16384, 64).read_chunks for _ in range(PROBE_EVERY)]
    assert plans == [0] * (PROBE_EVERY - 1) + [1]
    for _ in range(10):
        p.observe_read(CHUNK_BYTES, 0.001)  # the probe found it fast
    assert p.plan(16384, 64).read_chunks == 64

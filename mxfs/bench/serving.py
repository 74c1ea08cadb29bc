"""Concurrency: K instances serving requests that share prefixes, with the pool and without.

The workload mixes the two ways prompts share prefixes in serving: a few long system
prompts, each followed by many short user queries; and multi-turn conversations, each
turn's prompt the previous one plus the answer and a new message (a turn is sent only
once the one before it was answered).  Each request goes to an instance drawn at random
(seeded: the same in every run), with no prefix-aware routing, so consecutive turns
often land on different instances, as behind a plain load balancer.  Each instance
keeps the chunks it computed in its own memory, bounded in tokens like an
accelerator's (`local_tokens`); without the pool that is all it can reuse, with the
pool it also finds what every other instance computed, and what its own memory has
since dropped.

At each concurrency (requests in flight at once, queued at their instance beyond one
each), the driver measures requests/s and tokens/s over the run and each request's
TTFT from its submission (so queueing counts, as a user sees it), and checks that every
request got the same greedy tokens in every run.
"""

from __future__ import annotations

import functools
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mxfs.bench.instances import Instance
from mxfs.bench.tier import merge_failures
from mxfs.kv.keys import lmcache_hashes


@dataclass(frozen=True)
class Request:
    rid: int
    kind: str  # "system" or "turn"
    tokens: list[int]
    after: int | None = None  # the request that must be answered first
    route: int = 0  # which instance serves it: route % instances (a balancer's choice)


@dataclass(frozen=True)
class Mix:
    """The workload's shape; the defaults fit the bench's default model and machine."""

    systems: int = 4
    queries_per_system: int = 6
    system_tokens: int = 2048
    conversations: int = 4
    turns: int = 6
    document_tokens: int = 1024
    turn_tokens: int = 256
    query_tokens: int = 64

    def longest(self) -> int:
        return max(self.system_tokens, self.document_tokens
                   + self.turn_tokens * (self.turns - 1)) + self.query_tokens


def workload(mix: Mix, vocab: int, seed: int = 0) -> list[Request]:
    """The requests in submission order: system-prompt queries and turns interleaved."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [toks(mix.system_tokens) for _ in range(mix.systems)]
    queries = [(s, toks(mix.query_tokens)) for _ in range(mix.queries_per_system)
               for s in range(mix.systems)]
    convs = []
    for _ in range(mix.conversations):
        doc, turns = toks(mix.document_tokens), [toks(mix.turn_tokens) for _ in range(mix.turns)]
        convs.append([doc + sum(turns[:t], []) + turns[t][:mix.query_tokens]
                      for t in range(mix.turns)])
    order: list[tuple[str, list[int], int | None]] = []
    last_turn: dict[int, int] = {}
    turns_flat = [(c, t) for t in range(mix.turns) for c in range(mix.conversations)]
    while queries or turns_flat:
        if queries:
            s, q = queries.pop(0)
            order.append(("system", systems[s] + q, None))
        if turns_flat:
            c, t = turns_flat.pop(0)
            order.append(("turn", convs[c][t], last_turn.get(c)))
            last_turn[c] = len(order) - 1
    return [Request(i, kind, tokens, after, rng.randrange(1 << 30))
            for i, (kind, tokens, after) in enumerate(order)]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_load(instances: list[Instance], requests: list[Request], concurrency: int, pool: bool,
             new_tokens: int) -> dict[str, Any]:
    """Serve every request with at most `concurrency` in flight; the figures of the run."""
    cond = threading.Condition()
    pending = list(requests)
    done: dict[int, dict[str, Any]] = {}
    inflight = 0
    errors: list[str] = []

    def finished(req: Request, submitted: float, fut: Any) -> None:
        nonlocal inflight
        try:
            reply = fut.result()
            if "error" in reply:
                raise RuntimeError(reply["error"])
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            reply = {"failed": f"{type(e).__name__}: {e}"}
        with cond:
            reply["submitted_at"] = submitted
            done[req.rid] = reply
            if "failed" in reply:
                errors.append(reply["failed"])
            inflight -= 1
            cond.notify_all()

    start = time.monotonic()
    while True:
        with cond:
            while True:
                nxt = next((r for r in pending if r.after is None or r.after in done), None)
                if not pending and inflight == 0:
                    break
                if nxt is not None and inflight < concurrency:
                    break
                cond.wait()
            if not pending and inflight == 0:
                break
            assert nxt is not None
            pending.remove(nxt)
            inflight += 1
        inst = instances[nxt.route % len(instances)]
        submitted = time.monotonic()
        fut = inst.submit("serve", tokens=nxt.tokens, new_tokens=new_tokens, read=pool,
                          put=pool, local=True)
        fut.add_done_callback(functools.partial(finished, nxt, submitted))
    return _figures(requests, done, start, concurrency, pool, errors)


def _figures(requests: list[Request], done: dict[int, dict[str, Any]], start: float,
             concurrency: int, pool: bool, errors: list[str]) -> dict[str, Any]:
    ok = [done[r.rid] for r in requests if "failed" not in done[r.rid]]
    end = max((d["done_at"] for d in ok), default=start)
    wall = max(end - start, 1e-9)
    prompt = sum(d["prompt_tokens"] for d in ok) or 1
    ttft = [d["first_at"] - d["submitted_at"] for d in ok]
    return {
        "concurrency": concurrency, "pool": pool, "requests": len(requests),
        "served": len(ok), "errors": errors[:5], "seconds": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(len(d["tokens"]) for d in ok) / wall,
        "prompt_tokens_per_s": sum(d["prompt_tokens"] for d in ok) / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "pool_hit_rate": sum(d["pool_tokens"] for d in ok) / prompt,
        "local_hit_rate": sum(d["local_tokens"] for d in ok) / prompt,
        "computed_tokens": sum(d["computed_tokens"] for d in ok),
        "read_bytes": sum(d["read_bytes"] for d in ok),
        "put_bytes": sum(d["put_bytes"] for d in ok),
        "put_refused": sum(d["put_refused"] for d in ok),
        "pool_failures": merge_failures(d["pool_failures"] for d in ok),
        "outputs": {r.rid: done[r.rid].get("tokens") for r in requests},
        "ttfts": ttft,
    }


def working_set(requests: list[Request], chunk_tokens: int) -> int:
    """Tokens of distinct complete chunks the requests hold: what all caches together
    would need to hold for nothing to be computed twice."""
    return chunk_tokens * len({h for r in requests
                               for h in lmcache_hashes(r.tokens, chunk_tokens)})


RATES = ("requests_per_s", "output_tokens_per_s", "prompt_tokens_per_s", "seconds")
SUMS = ("served", "computed_tokens", "read_bytes", "put_bytes", "put_refused")


def combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one setting as one: rates their medians, TTFT percentiles over every
    request of every round, counts per round (their means), failures added up."""
    ttft = [t for r in rounds for t in r["ttfts"]]
    prompt = sum(r["prompt_tokens_per_s"] * r["seconds"] for r in rounds) or 1
    out = {"concurrency": rounds[0]["concurrency"], "pool": rounds[0]["pool"],
           "requests": rounds[0]["requests"], "rounds": len(rounds),
           "errors": [e for r in rounds for e in r["errors"]][:5],
           "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
           "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
           "pool_failures": merge_failures(r["pool_failures"] for r in rounds)}
    out.update({k: statistics.median(r[k] for r in rounds) for k in RATES})
    out.update({k: sum(r[k] for r in rounds) / len(rounds) for k in SUMS})
    for k in ("pool_hit_rate", "local_hit_rate"):
        out[k] = sum(r[k] * r["prompt_tokens_per_s"] * r["seconds"] for r in rounds) / prompt
    return out


def run(instances: list[Instance], requests: list[Request], levels: list[int], new_tokens: int,
        clear_pool: Callable[[], None], say: Callable[[str], None], repeat: int = 1
        ) -> dict[str, Any]:
    """Every concurrency level without the pool and with it, each round from empty caches;
    the two settings alternate, so a machine's load drifting hits both alike."""
    rounds: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for c in levels:
        for rnd in range(repeat):
            for pool in (False, True):
                for inst in instances:
                    inst.call("reset")
                if pool:
                    clear_pool()
                say(f"serving: {len(requests)} requests at concurrency {c}, "
                    f"{'with' if pool else 'without'} the pool (round {rnd + 1}/{repeat})")
                rounds.setdefault((c, pool), []).append(
                    run_load(instances, requests, c, pool, new_tokens))
    flat = [r for rs in rounds.values() for r in rs]
    ref = flat[0]["outputs"]
    equal = all(r["outputs"] == ref for r in flat) and all(not r["errors"] for r in flat)
    runs = [combined(rs) for rs in rounds.values()]
    for r in flat:
        del r["outputs"], r["ttfts"]
    return {"runs": runs, "rounds": flat, "repeat": repeat, "tokens_equal": equal,
            "instances": len(instances),
            "kinds": {k: sum(1 for r in requests if r.kind == k) for k in ("system", "turn")}}

"""Reuse across instances: one instance's prefill, another's first token.

For each context length: instance 1 serves a long prompt (a document and a question)
by recomputing it, `repeat` times, and puts its complete chunks in the pool the last
time.  Instance 2, another process that never saw the prompt, serves the same prompt
from the pool: cold (page cache dropped before each request), cold with the reuse
policy (`mxfs.kv.reuse_policy`: only the chunks faster to read than to compute), and
warm (after one buffered read put the chunks in the page cache), prefilling only the
question.  Then a partial hit: a prompt sharing only the first half of the document,
whose second half instance 2 computes, reading every hit and with the policy.  Every
answer's greedy tokens are compared with a full recompute of the same prompt.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

from mxfs.bench.instances import Instance
from mxfs.bench.tier import merge_failures

QUESTION = 64  # tokens after the document: what a reusing instance prefills


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _gbps(r: dict[str, Any]) -> float:
    return r["read_bytes"] / r["read_s"] / 1e9 if r["read_s"] > 0 and r["read_bytes"] else 0.0


def _serve(inst: Instance, tokens: list[int], new_tokens: int, **flags: Any) -> dict[str, Any]:
    return inst.call("serve", tokens=tokens, new_tokens=new_tokens, **flags)


def one_length(first: Instance, second: Instance, n: int, repeat: int, new_tokens: int,
               drop: Callable[[], bool], seed: int, partial: bool) -> dict[str, Any]:
    vocab = first.hello.result()["vocab"]
    tokens = prompt(seed * 1_000_003 + n, n + QUESTION, vocab)
    row: dict[str, Any] = {"context": n, "prompt_tokens": len(tokens)}
    recompute = [_serve(first, tokens, new_tokens, read=False, local=False,
                        put=r == repeat - 1) for r in range(repeat)]
    ref = recompute[0]["tokens"]
    equal = all(r["tokens"] == ref for r in recompute)
    put = recompute[-1]
    row.update(recompute_s=[r["ttft_s"] for r in recompute], put_bytes=put["put_bytes"],
               put_s=put["put_s"], put_refused=put["put_refused"])
    cold, policy, dropped = [], [], True
    for _ in range(repeat):
        dropped = drop() and dropped
        cold.append(_serve(second, tokens, new_tokens, read=True, local=False, put=False))
    for _ in range(repeat):  # (before the warm reads: its measured rate is the cold one)
        dropped = drop() and dropped
        policy.append(_serve(second, tokens, new_tokens, read=True, local=False, put=False,
                             policy=True))
    second.call("warm", tokens=tokens)
    warm = [_serve(second, tokens, new_tokens, read=True, local=False, put=False)
            for _ in range(repeat)]
    equal = equal and all(r["tokens"] == ref for r in cold + policy + warm)
    row.update(reuse_cold_s=[r["ttft_s"] for r in cold], reuse_warm_s=[r["ttft_s"] for r in warm],
               policy_cold_s=[r["ttft_s"] for r in policy],
               policy_pool_tokens=policy[-1]["pool_tokens"],
               cold_gbps=[_gbps(r) for r in cold], warm_gbps=[_gbps(r) for r in warm],
               cold_parts={k: [r[k] for r in cold] for k in ("read_s", "build_s", "prefill_s")},
               read_bytes=cold[-1]["read_bytes"], pool_tokens=cold[-1]["pool_tokens"],
               computed_tokens=cold[-1]["computed_tokens"], dropped=dropped,
               pool_failures=merge_failures(r["pool_failures"] for r in recompute + cold + warm))
    if partial:
        row["partial"] = _partial(second, tokens, n, new_tokens, drop, seed, vocab)
        equal = equal and row["partial"]["tokens_equal"]
    row["tokens_equal"] = equal
    return row


def _partial(inst: Instance, tokens: list[int], n: int, new_tokens: int,
             drop: Callable[[], bool], seed: int, vocab: int) -> dict[str, Any]:
    """A prompt sharing the first half of the document: half from the pool, half computed;
    then again with the reuse policy deciding how much of the half to read."""
    half = n // 2
    other = tokens[:half] + prompt(seed * 7 + n, len(tokens) - half, vocab)
    ref = _serve(inst, other, new_tokens, read=False, local=False, put=False)
    drop()
    got = _serve(inst, other, new_tokens, read=True, local=False, put=False)
    drop()
    pol = _serve(inst, other, new_tokens, read=True, local=False, put=False, policy=True)
    return {"shared_tokens": half, "pool_tokens": got["pool_tokens"],
            "computed_tokens": got["computed_tokens"], "recompute_s": ref["ttft_s"],
            "reuse_cold_s": got["ttft_s"], "policy_pool_tokens": pol["pool_tokens"],
            "policy_s": pol["ttft_s"],
            "tokens_equal": got["tokens"] == ref["tokens"] == pol["tokens"]}


def run(first: Instance, second: Instance, lengths: list[int], repeat: int, new_tokens: int,
        drop: Callable[[], bool], say: Callable[[str], None], seed: int = 0,
        partial: bool = True) -> dict[str, Any]:
    # The reusing instance's reuse policy gets its first prefill rates, short and long.
    second.call("calibrate", lengths=sorted({min(lengths), max(lengths)}))
    rows = []
    for n in lengths:
        say(f"reuse: {n} tokens of context, {repeat} rounds each way")
        rows.append(one_length(first, second, n, repeat, new_tokens, drop, seed, partial))
    return {"rows": rows, "repeat": repeat, "question_tokens": QUESTION,
            "new_tokens": new_tokens, "tokens_equal": all(r["tokens_equal"] for r in rows)}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")

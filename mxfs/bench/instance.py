"""A serving instance: one process, one model, requests as JSON lines on stdin.

`python -P -m mxfs.bench.instance --mount M ...` builds the model (`lm.build`), warms
it up, answers `hello` on stdout, then serves one request at a time, replying with one
JSON line each.  Serving a prompt, as an engine with an external KV tier does:

1. the complete chunks of the prompt are keyed (`tier.chunk_keys`); at most all but the
   last token can come from a cache, so at least one token is always computed;
2. chunks found in this instance's own memory are used first (`local`, an LRU bounded
   in tokens, like HBM), then the pool is asked for the rest of the prefix (`read`) and
   the hits are read straight into a reused, page-aligned buffer; with `policy`, only
   as many of them as are faster to read than to compute (`mxfs.kv.reuse_policy`,
   from the read bandwidth and prefill rate this instance measured);
3. transformers' `DynamicCache` is built from those chunks and only the rest of the
   prompt is prefilled; the first greedy token ends the TTFT clock, then the rest are
   decoded;
4. chunks it computed go to its own memory and (`put`) to the pool: after the reply's
   timestamps, but before the next request, as the instance is busy meanwhile.

stdout carries nothing but replies (stray prints go to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

from mxfs.bench.lm import LAYOUT, LM, build
from mxfs.bench.tier import PoolTier, chunk_keys
from mxfs.kv.reuse_policy import ReusePolicy


class Engine:
    """The serving logic of one instance, without its process plumbing."""

    def __init__(self, lm: LM, tier: PoolTier | None, chunk_tokens: int, local_tokens: int,
                 max_tokens: int) -> None:
        import torch

        self.torch = torch
        self.lm, self.tier, self.chunk = lm, tier, chunk_tokens
        self.local: OrderedDict[bytes, Any] = OrderedDict()
        self.local_chunks = local_tokens // chunk_tokens
        self.shape = lm.chunk_shape(chunk_tokens)
        self.chunk_bytes = lm.kv_bytes_per_token() * chunk_tokens
        self._buf: Any = None
        self._reserve(max_tokens // chunk_tokens)
        self.policy = ReusePolicy(chunk_tokens, self.chunk_bytes,
                                  lm.ttft_model().prefill_flops)

    def _reserve(self, chunks: int) -> Any:
        """The reused read buffer: page-aligned, touched once, so gets go O_DIRECT into it
        and no request pays for first-touch page faults."""
        if self._buf is None or self._buf.shape[0] < chunks:
            nbytes = max(1, chunks) * self.chunk_bytes
            raw = mmap.mmap(-1, nbytes)
            raw.write(bytes(nbytes))  # touched outside any clock
            dtype = getattr(self.torch, self.lm.dtype)
            self._buf = self.torch.frombuffer(raw, dtype=dtype).view(max(1, chunks), *self.shape)
        return self._buf

    def keys(self, tokens: list[int]) -> list[bytes]:
        return chunk_keys(tokens, self.lm.model_id, self.lm.dtype, LAYOUT, self.chunk)

    def serve(self, tokens: list[int], new_tokens: int, read: bool, put: bool,
              local: bool, policy: bool = False) -> dict[str, Any]:
        if not tokens or not all(isinstance(t, int) and 0 <= t < self.lm.size.vocab
                                 for t in tokens):
            raise ValueError(f"tokens must be a non-empty list of ids below {self.lm.size.vocab}")
        t_in = time.monotonic()
        failed_before = dict(self.tier.failures) if self.tier else {}
        keys = self.keys(tokens)
        usable = min(len(keys), (len(tokens) - 1) // self.chunk)
        parts: list[Any] = []
        n_local = 0
        while local and n_local < usable and keys[n_local] in self.local:
            self.local.move_to_end(keys[n_local])
            parts.append(self.local[keys[n_local]])
            n_local += 1
        n_pool, read_s, found, waited_s = 0, 0.0, 0, 0.0
        planned: dict[str, Any] = {}
        if read and self.tier is not None and n_local < usable:
            t0 = time.monotonic()
            want = keys[n_local:usable]
            found = self.tier.prefix(want)
            # What another instance is computing right now is waited for, not computed
            # again; what this one computes, the others wait for (`kv_claims`).
            if put and found < len(want) and self.tier.wait_for_others(want[found:]):
                found = self.tier.prefix(want)
            waited_s = time.monotonic() - t0
            if found and policy:
                plan = self.policy.plan(len(tokens), found, n_local * self.chunk)
                found, planned = plan.read_chunks, asdict(plan)
            if found:
                buf = self._reserve(found)
                n_pool = self.tier.get(want[:found], [buf[i] for i in range(found)])
                parts += [buf[i] for i in range(n_pool)]
            read_s = time.monotonic() - t0
            self.policy.observe_read(n_pool * self.chunk_bytes, read_s)
        done = n_local + n_pool
        t_build = time.monotonic()
        cache = self.lm.cache_from_chunks(parts)
        t_prefill = time.monotonic()
        first = self.lm.step(tokens[done * self.chunk:], cache)
        t_first = time.monotonic()
        self.policy.observe_prefill(len(tokens), done * self.chunk, t_first - t_prefill)
        # The prompt's new chunks are put before decoding: instances waiting on this
        # one's claim go on as soon as its prefill is done.
        fresh = self.lm.chunks_of(cache, done, len(keys), self.chunk) \
            if (put or local) and len(keys) > done else []
        stored = refused = 0
        put_s = 0.0
        if put and self.tier is not None and fresh:
            t0 = time.monotonic()
            stored, refused = self.tier.put(keys[done:], fresh)
            put_s = time.monotonic() - t0
        out = self.lm.decode(first, cache, new_tokens)
        t_done = time.monotonic()
        if local and self.local_chunks:
            got = [(keys[n_local + i], parts[n_local + i].clone()) for i in range(n_pool)]
            for k, t in got + list(zip(keys[done:], fresh, strict=True)):
                self.local[k] = t
                self.local.move_to_end(k)
            while len(self.local) > self.local_chunks:
                self.local.popitem(last=False)
        return {"tokens": out, "received_at": t_in, "first_at": t_first, "done_at": t_done,
                "ttft_s": t_first - t_in, "prompt_tokens": len(tokens),
                "local_tokens": n_local * self.chunk, "pool_tokens": n_pool * self.chunk,
                "computed_tokens": len(tokens) - done * self.chunk,
                "looked_up": len(keys[n_local:usable]) if read else 0,
                "lookup_s": waited_s,
                "read_chunks_planned": found, "plan": planned,
                "read_bytes": n_pool * self.chunk_bytes, "read_s": read_s,
                "build_s": t_prefill - t_build, "prefill_s": t_first - t_prefill,
                "put_chunks": stored, "put_refused": refused,
                "put_bytes": stored * self.chunk_bytes, "put_s": put_s,
                "pool_failures": self._failed_since(failed_before)}

    def _failed_since(self, before: dict[str, int]) -> dict[str, Any]:
        """What of the pool failed during this request, and the first reason of each."""
        if self.tier is None:
            return {}
        return {k: {"count": n - before.get(k, 0), "first": self.tier.first_failure[k]}
                for k, n in self.tier.failures.items() if n > before.get(k, 0)}

    def warm(self, tokens: list[int]) -> dict[str, Any]:
        keys = self.keys(tokens)
        n = self.tier.warm(keys, [self.chunk_bytes] * len(keys)) if self.tier else 0
        return {"warmed_bytes": n}

    def calibrate(self, lengths: list[int]) -> dict[str, Any]:
        """Prefill prompts of these lengths, timed, for the reuse policy's first rates
        (asked while nothing else runs: instances warming up side by side would time
        each other)."""
        torch = self.torch
        g = torch.Generator().manual_seed(54321)
        for n in sorted(lengths):
            ids = torch.randint(0, self.lm.size.vocab, (n,), generator=g).tolist()
            t0 = time.monotonic()
            self.lm.step(ids, self.lm.new_cache())
            self.policy.observe_prefill(n, 0, time.monotonic() - t0)
        return {"seconds_per_flop": self.policy.seconds_per_flop,
                "overhead_s": self.policy.overhead_s}

    def flops(self) -> dict[str, Any]:
        """This device's matrix-multiply FLOP/s at the model's shapes, in its dtype: the
        `flops` the TTFT model divides by."""
        torch, s = self.torch, self.lm.size
        dtype = getattr(torch, self.lm.dtype)
        a = torch.randn(4096, s.hidden, dtype=dtype, device=self.lm.device)
        b = torch.randn(s.hidden, s.intermediate, dtype=dtype, device=self.lm.device)
        best = float("inf")
        for _ in range(20):  # the best round: on a shared machine, the least disturbed
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            if self.lm.device.startswith("cuda"):
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / 4)
        return {"flops": 2 * 4096 * s.hidden * s.intermediate / best}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="an mxfs bench serving instance")
    ap.add_argument("--mount", help="the pool's mount point (none: no pool at all)")
    ap.add_argument("--namespace", default="mxfs-bench-ttft")
    ap.add_argument("--shared", action="store_true")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--size", default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--local-tokens", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=4096)
    return ap.parse_args(argv)


def _reply(out: Any, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"instance {os.getpid()}: %(message)s")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # stray prints of libraries never corrupt the replies
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = build(args.arch, args.size, args.seed, args.dtype, args.device,
               max_tokens=max(args.max_tokens * 2, 4096))
    tier = PoolTier(args.mount, args.namespace, args.shared) if args.mount else None
    engine = Engine(lm, tier, args.chunk_tokens, args.local_tokens, args.max_tokens)
    g = torch.Generator().manual_seed(12345)
    warmup = torch.randint(0, lm.size.vocab, (min(args.max_tokens, 1024),), generator=g)
    cache = lm.new_cache()
    lm.decode(lm.step(warmup.tolist(), cache), cache, 4)  # first-call costs, outside clocks
    _reply(out, {"op": "hello", "pid": os.getpid(), "model_id": lm.model_id,
                 "params": lm.params, "vocab": lm.size.vocab, "layer_params": lm.layer_params,
                 "kv_bytes_per_token": lm.kv_bytes_per_token(),
                 "chunk_bytes": engine.chunk_bytes, "threads": torch.get_num_threads(),
                 "device": lm.device, "dtype": lm.dtype,
                 "ttft_model": asdict(lm.ttft_model())})
    requests: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read_requests() -> None:  # drained at once, so a writer never blocks on the pipe
        for line in sys.stdin:
            try:
                requests.put(json.loads(line))
            except ValueError:
                requests.put({"op": "bad", "line": line[:80]})
        requests.put(None)

    threading.Thread(target=read_requests, daemon=True).start()
    while (req := requests.get()) is not None:
        op, rid = req.get("op"), req.get("id")
        try:
            if op == "quit":
                _reply(out, {"id": rid})
                break
            if op == "serve":
                res = engine.serve(list(req["tokens"]), int(req.get("new_tokens", 8)),
                                   bool(req.get("read", True)), bool(req.get("put", True)),
                                   bool(req.get("local", False)),
                                   bool(req.get("policy", False)))
            elif op == "warm":
                res = engine.warm(list(req["tokens"]))
            elif op == "reset":
                engine.local.clear()
                res = {}
            elif op == "configure":  # one set of processes serves both scenarios
                torch.set_num_threads(int(req["threads"]))
                engine.local.clear()
                engine.local_chunks = int(req["local_tokens"]) // engine.chunk
                res = {"threads": torch.get_num_threads()}
            elif op == "flops":
                res = engine.flops()
            elif op == "calibrate":
                res = engine.calibrate([int(n) for n in req["lengths"]])
            elif op == "pool_rate":  # a pool of a known read rate (a throttled one)
                engine.policy.pin_read_rate(float(req["read_bps"]) or None)
                res = {"read_bps": engine.policy.read_bps}
            else:
                raise ValueError(f"unknown op {op!r}")
        except (ValueError, KeyError, TypeError) as e:
            res = {"error": f"{type(e).__name__}: {e}"}
        _reply(out, {"id": rid, **res})
    if tier is not None:
        tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

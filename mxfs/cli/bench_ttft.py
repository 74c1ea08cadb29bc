"""`mxfs bench ttft`: TTFT and throughput of a real model with KV reused through the pool.

Checks the options, finds the pool (a mount, or a scratch pool of four folder members),
starts the instance processes once for both scenarios (`mxfs.bench.reuse`, then
`mxfs.bench.serving`), and writes the report (`mxfs.bench.report`).  The namespace is
emptied before and after, so one run never finds another's chunks.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mxfs.errors import MxfsError, UsageError


def add_options(v: argparse.ArgumentParser) -> None:
    """The options of the measurement, shared by `bench ttft` and `bench gates`."""
    v.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    v.add_argument("--model-size", default="small",
                   choices=("tiny", "small", "base", "large"),
                   help="tiny (tests), small (default: minutes on two cores), base ~60M, "
                        "large ~350M parameters")
    v.add_argument("--device", default="cpu", help="cpu, or cuda where there is one")
    v.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 (auto: float32 on cpu, bfloat16 on cuda)")
    v.add_argument("--seed", type=int, default=0, help="the weights' seed")
    v.add_argument("--lengths", default="1024,4096,16384", help="context lengths (tokens)")
    v.add_argument("--ttft-repeat", type=int, default=3, help="rounds per TTFT; medians")
    v.add_argument("--chunk-tokens", type=int, default=256)
    v.add_argument("--instances", type=int, default=2, help="instance processes (>= 2)")
    v.add_argument("--concurrency", default="1,8,16", help="levels of the serving scenario")
    v.add_argument("--requests", type=int, default=64,
                   help="requests per serving round (many against the concurrency: a "
                        "run is mostly steady state, not the first burst of misses)")
    v.add_argument("--serving-repeat", type=int, default=3,
                   help="rounds per concurrency and setting; medians")
    v.add_argument("--local-tokens", type=int, default=8192,
                   help="KV tokens each instance holds in its own memory")
    v.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per request")
    v.add_argument("--no-serving", action="store_true", help="skip the concurrency scenario")
    v.add_argument("--namespace", default="mxfs-bench-ttft")


def _ints(text: str, what: str, least: int) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a list of integers",
                         "give them comma-separated, e.g. 1024,4096") from None
    if not xs or min(xs) < least:
        raise UsageError(f"{what} {text!r}: each must be at least {least}")
    return xs


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The options as the measurement takes them; a UsageError for anything wrong."""
    from mxfs.bench.serving import Mix

    if args.chunk_tokens < 16:
        raise UsageError(f"--chunk-tokens {args.chunk_tokens}: at least 16")
    lengths = _ints(args.lengths, "--lengths", args.chunk_tokens)
    levels = _ints(args.concurrency, "--concurrency", 1)
    for name in ("instances", "ttft_repeat", "requests", "new_tokens", "serving_repeat"):
        least = 2 if name == "instances" else 1
        if getattr(args, name) < least:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: "
                             f"at least {least}")
    if args.local_tokens < 0:
        raise UsageError(f"--local-tokens {args.local_tokens}: cannot be negative")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype {dtype}: choose float32, bfloat16 or float16")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise UsageError(f"--device {args.device}: choose cpu or cuda")
    if args.device.startswith("cuda"):
        try:
            import torch
        except ImportError:
            raise MxfsError("--device cuda needs torch", "pip install torch") from None
        if not torch.cuda.is_available():
            raise MxfsError(f"--device {args.device}: torch sees no CUDA device here",
                            "use --device cpu")
    per = -(-args.requests // 2)
    mix = Mix(queries_per_system=-(-per // 4), turns=-(-per // 4))
    return {"lengths": lengths, "levels": levels, "dtype": dtype, "mix": mix}


@contextmanager
def pool_at(target: str | None, say: Callable[[str], None]) -> Iterator[tuple[str, str, list[str]]]:
    """(mount root, description, member paths) of the pool to measure: `target`'s, or a
    scratch pool made for the run."""
    from mxfs.cli.demo import scratch_pool
    from mxfs.client.control import ControlClient, mount_root

    if target is None:
        if os.geteuid() != 0:
            raise MxfsError("without a mount point the bench makes a scratch pool, which "
                            "needs root", "run it as root, or give a mounted pool")
        with scratch_pool("mxfs-bench-ttft-") as pool:
            say(f"scratch pool of 4 folder members in {pool.base}")
            yield (pool.mnt, f"a scratch pool of 4 folder members in {pool.base} "
                   f"(one filesystem)", pool.members)
        return
    root = mount_root(target)
    if root is None:
        raise MxfsError(f"{target} is not an mxfs mount", "mount the pool first: mxfs mount")
    with ControlClient(root) as c:
        members = [m["path"] for m in c.stat()["members"]]
    yield root, f"{root}, {len(members)} members", members


def clear_namespace(mount: str, namespace: str) -> None:
    """Evict every chunk of the bench's namespace (none there yet is fine)."""
    import errno

    from mxfs.bench.tier import FAILURES
    from mxfs.kv import KVStore

    try:
        with KVStore(mount, namespace) as kv:
            kv.clear()
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
    except FAILURES:
        pass  # the pool is gone: the instances will find out and serve on without it


def measure(mount: str, pool_text: str, args: argparse.Namespace, opts: dict[str, Any],
            logs: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Both scenarios on the pool at `mount`; the result the report is written from."""
    from mxfs.bench import instances, reuse, serving
    from mxfs.cli.measure import drop_caches

    spec = instances.Spec(args.arch, args.model_size, args.seed, opts["dtype"], args.device,
                          args.chunk_tokens, args.namespace)
    mix = opts["mix"]
    cores = len(os.sched_getaffinity(0))
    k = args.instances
    longest = max(max(opts["lengths"]) + reuse.QUESTION, mix.longest())
    clear_namespace(mount, args.namespace)
    say(f"starting {k} instances ({args.arch}-{args.model_size}, {opts['dtype']} on "
        f"{args.device}); their logs go to {logs}")
    insts = instances.start(spec, k, mount, logs, threads=cores, max_tokens=longest)
    try:
        hello = insts[0].hello.result()
        flops = insts[0].call("flops")["flops"]
        result: dict[str, Any] = {
            "time": time.time(), "command": shlex.join(["mxfs", *sys.argv[1:]]),
            "pool": pool_text, "namespace": args.namespace, "flops": flops,
            "threads": {"reuse": cores, "serving": max(1, cores // k)},
            "model": {**{f: hello[f] for f in ("model_id", "params", "layer_params",
                                               "kv_bytes_per_token", "chunk_bytes",
                                               "ttft_model", "device", "dtype")},
                      "arch": args.arch, "size": args.model_size, "seed": args.seed,
                      "chunk_tokens": args.chunk_tokens}}
        result["reuse"] = reuse.run(insts[0], insts[1], opts["lengths"], args.ttft_repeat,
                                    args.new_tokens, drop_caches, say, seed=args.seed)
        if not args.no_serving:
            for inst in insts:
                inst.call("configure", threads=max(1, cores // k),
                          local_tokens=args.local_tokens)
            reqs = serving.workload(mix, hello["vocab"], args.seed)
            sv = serving.run(insts, reqs, opts["levels"], args.new_tokens,
                             lambda: clear_namespace(mount, args.namespace), say,
                             args.serving_repeat)
            sv.update(mix=vars(mix), local_tokens=args.local_tokens,
                      new_tokens=args.new_tokens,
                      working_set_tokens=serving.working_set(reqs, args.chunk_tokens))
            result["serving"] = sv
    finally:
        for inst in insts:
            inst.close()
        clear_namespace(mount, args.namespace)
    from mxfs.bench.report import predict

    predict(result)
    return result


def run_ttft(target: str | None, out: str, args: argparse.Namespace,
             say: Callable[[str], None]) -> dict[str, Any]:
    from mxfs.bench import report

    opts = check(args)
    with pool_at(target, say) as (mount, text, _members):
        os.makedirs(out, exist_ok=True)
        logs = tempfile.mkdtemp(prefix="instances-", dir=out)
        result = measure(mount, text, args, opts, logs, say)
    report.write(out, result)
    return result


def cmd_bench_ttft(args: argparse.Namespace) -> int:
    import json

    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    result = run_ttft(args.target, args.out, args, say)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"report written to {os.path.join(args.out, 'report.md')}")
    ok = result["reuse"]["tokens_equal"] and result.get("serving", {}).get("tokens_equal", True)
    if not ok:
        print("mxfs: tokens served from the pool differed from recompute (see the report)",
              file=sys.stderr)
    return 0 if ok else 3

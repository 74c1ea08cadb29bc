"""`mxfs df`, `top` and `bench`: where the space goes, what the daemon is doing now,
and what the pool delivers against its baselines."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from mxfs.errors import MxfsError
from mxfs.proto.messages import DF, METRICS, MetricsReply
from mxfs.units import BENCH_MIN_SIZE, count_arg, finite_arg, format_size, size_arg

# The longest wait between two samples of `mxfs top` (an hour): a longer one is a typo.
MAX_INTERVAL_S = 3600.0


def _client(mount: str) -> Any:
    from mxfs.client.control import ControlClient, mount_root

    root = mount_root(mount)
    if root is None:
        raise MxfsError(f"{mount} is not on an mxfs mount", "give a mount point (mxfs status)")
    return ControlClient(root, timeout=30)


def shown_use(use: dict[str, int], used: int) -> tuple[dict[str, int], bool]:
    """By-use bytes (apparent sizes) scaled down to the pool's used total when they add
    up to more (sparse files, or space not yet allocated); and whether they were."""
    total = sum(use.values())
    if total <= used:
        return dict(use), False
    return {k: v * used // total for k, v in use.items()}, True


def cmd_df(args: argparse.Namespace) -> int:
    with _client(args.mount) as c:
        info = c.request(DF())
    from mxfs.pool.pool import pool_totals

    members, use = info["members"], info["by_use"]
    pool = pool_totals(members)
    shown, scaled = shown_use(use, pool["used"])
    if args.json:
        print(json.dumps({"members": members, "pool": pool, "by_use": use,
                          "by_use_shown": shown, "by_use_scaled": scaled}, indent=2))
        return 0
    far = sorted({m["node"] for m in members if m.get("node")})
    if far:
        print(f"the members are node {', '.join(far)}'s: their space as it last published "
              "it (every 10 s)")
    print(f"{'member':>6}  {'size':>10}  {'used':>10}  {'free':>10}  path")
    for m in members:
        state = f"  FAILED: {m['failed']}" if m.get("failed") else ""
        where = f"(node {m['node']})" if m.get("node") else m["path"]
        print(f"{m['index']:>6}  {format_size(m['size']):>10}  {format_size(m['used']):>10}  "
              f"{format_size(m['free']):>10}  {where}{state}")
    shared = (f"  ({len(members)} members on {pool['filesystems']} filesystem"
              f"{'s' if pool['filesystems'] != 1 else ''}, each counted once)"
              if pool["filesystems"] < len(members) else "")
    print(f"{'pool':>6}  {format_size(pool['size']):>10}  {format_size(pool['used']):>10}  "
          f"{format_size(pool['free']):>10}{shared}")
    print(f"by use: files {format_size(shown['files'])}, checkpoints and models (sealed) "
          f"{format_size(shown['sealed'])}, KV cache {format_size(shown['kv'])}")
    if scaled:
        print(f"  (scaled to the pool's used space: the files' apparent sizes add up to "
              f"{format_size(sum(use.values()))}, more than is allocated)")
    return 0


def rates(a: MetricsReply, b: MetricsReply) -> dict[str, Any]:
    """Per-second rates between two `metrics` snapshots."""
    dt = max(b["time"] - a["time"], 1e-6)
    before_io = {(m, w): (n, ops) for m, w, n, ops in a["io"]}
    members = []
    for m, w, n, ops in b["io"]:
        n0, ops0 = before_io.get((m, w), (0, 0))
        members.append({"member": m, "direction": w, "bytes_per_s": (n - n0) / dt,
                        "ops_per_s": (ops - ops0) / dt})
    before_req = {(k, o): (n, s) for k, o, n, s in a["requests"]}
    requests = []
    for k, o, n, s in b["requests"]:
        n0, s0 = before_req.get((k, o), (0, 0.0))
        if n > n0:
            requests.append({"kind": k, "op": o, "per_s": (n - n0) / dt,
                             "mean_ms": 1000 * (s - s0) / (n - n0)})
    requests.sort(key=lambda r: -r["per_s"])
    return {"seconds": dt, "members": members, "requests": requests}


def _render(r: dict[str, Any]) -> str:
    lines = [f"over {r['seconds']:.1f} s:", "  member  direction        MB/s      IOPS"]
    for m in r["members"]:
        lines.append(f"  {m['member']:>6}  {m['direction']:<9}  {m['bytes_per_s'] / 1e6:>9.1f}  "
                     f"{m['ops_per_s']:>8.0f}")
    lines.append("  requests        per s   mean ms")
    for q in r["requests"][:15]:
        lines.append(f"  {q['kind']}:{q['op']:<14} {q['per_s']:>7.0f}  {q['mean_ms']:>8.3f}")
    return "\n".join(lines)


def cmd_top(args: argparse.Namespace) -> int:
    with _client(args.mount) as c:
        prev = c.request(METRICS())
        n = 0
        while args.count == 0 or n < args.count:
            time.sleep(args.interval)
            now = c.request(METRICS())
            r = rates(prev, now)
            try:
                print(json.dumps(r) if args.json else _render(r), flush=True)
            except BrokenPipeError:
                return _reader_gone()
            prev, n = now, n + 1
    return 0


def _reader_gone() -> int:
    """The reader of a stream of samples has gone (`mxfs top | head`): that ends the
    stream, as it ends any filter's, quietly.  Standard output now points at nothing,
    so the interpreter's last flush of what is buffered for the pipe fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("df", help="space per member and by use (files, checkpoints, KV)")
    s.add_argument("mount")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_df)
    s = sub.add_parser("top", help="live throughput and IOPS per member, requests per op")
    s.add_argument("mount")
    s.add_argument("--interval", type=finite_arg(MAX_INTERVAL_S), default=1.0,
                   help="seconds between samples (above 0, at most an hour)")
    s.add_argument("--count", type=count_arg(0, 10**9), default=0,
                   help="samples to show (0: until ^C)")
    s.add_argument("--json", action="store_true", help="one JSON object per sample")
    s.set_defaults(func=cmd_top)


def cmd_bench_run(args: argparse.Namespace) -> int:
    from mxfs.cli.bench import run_bench

    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    results = run_bench(args.target, args.out, args.size, args.repeat, say)
    if args.json:
        print(json.dumps(results["median"], indent=2))
    else:
        print(f"report written to {os.path.join(args.out, 'report.md')}")
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from mxfs.cli.bench import compare

    print(compare(args.a, args.b))
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("bench", help="a validation run with a report, or two runs compared")
    verbs = s.add_subparsers(dest="verb", required=True, parser_class=type(s))
    v = verbs.add_parser("run", help="measure a mounted pool (default: a scratch demo pool)")
    v.add_argument("target", nargs="?", help="a mount point")
    v.add_argument("--out", required=True, help="folder for report.md, results.json, PNGs")
    v.add_argument("--size", type=size_arg(BENCH_MIN_SIZE), default=1 << 30,
                   help="bytes per step (default 1GiB, at least 1MiB)")
    v.add_argument("--repeat", type=count_arg(1, 1000), default=3,
                   help="rounds; medians are reported (default 3)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_bench_run)
    v = verbs.add_parser("compare", help="two runs side by side: B against A")
    v.add_argument("a")
    v.add_argument("b")
    v.set_defaults(func=cmd_bench_compare)
    add_ttft_verbs(verbs)


def add_ttft_verbs(verbs: argparse._SubParsersAction) -> None:
    """`mxfs bench ttft` and `mxfs bench gates`, beside `run` and `compare`."""
    from mxfs.cli import bench_ttft, gates_cmd

    v = verbs.add_parser("ttft", help="TTFT and throughput of a real model (transformers) "
                         "with KV reused through the pool, against recomputing")
    v.add_argument("target", nargs="?", help="a mount point (default: a scratch pool)")
    v.add_argument("--out", required=True, help="folder for report.md, ttft.json, PNGs")
    bench_ttft.add_options(v)
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=bench_ttft.cmd_bench_ttft)
    v = verbs.add_parser("gates", help="the reference design's gates G2, G3 and a G4 smoke, "
                         "pass or fail each, in one report")
    v.add_argument("target", nargs="?", help="a mount point (default: a scratch pool)")
    v.add_argument("--out", required=True, help="folder for report.md, gates.json, g2/, g3/")
    gates_cmd.add_options(v)
    bench_ttft.add_options(v)
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=gates_cmd.cmd_bench_gates)


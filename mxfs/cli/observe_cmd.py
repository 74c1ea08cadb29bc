"""`mxfs df` and `mxfs top`: where the space goes, and what the daemon is doing now."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from mxfs.errors import MxfsError
from mxfs.units import format_size


def _client(mount: str) -> Any:
    from mxfs.client.control import ControlClient, mount_root

    root = mount_root(mount)
    if root is None:
        raise MxfsError(f"{mount} is not on an mxfs mount", "give a mount point (mxfs status)")
    return ControlClient(root, timeout=30)


def cmd_df(args: argparse.Namespace) -> int:
    with _client(args.mount) as c:
        info = c.call("df")
    members, use = info["members"], info["by_use"]
    if args.json:
        print(json.dumps({"members": members, "by_use": use}, indent=2))
        return 0
    print(f"{'member':>6}  {'size':>10}  {'used':>10}  {'free':>10}  path")
    for m in members:
        state = f"  FAILED: {m['failed']}" if m.get("failed") else ""
        print(f"{m['index']:>6}  {format_size(m['size']):>10}  {format_size(m['used']):>10}  "
              f"{format_size(m['free']):>10}  {m['path']}{state}")
    total = sum(m["size"] for m in members)
    free = sum(m["free"] for m in members)
    print(f"{'pool':>6}  {format_size(total):>10}  {format_size(total - free):>10}  "
          f"{format_size(free):>10}")
    print(f"by use: files {format_size(use['files'])}, checkpoints and models (sealed) "
          f"{format_size(use['sealed'])}, KV cache {format_size(use['kv'])}")
    return 0


def rates(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
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
        prev = c.call("metrics")
        n = 0
        while args.count == 0 or n < args.count:
            time.sleep(args.interval)
            now = c.call("metrics")
            r = rates(prev, now)
            print(json.dumps(r) if args.json else _render(r), flush=True)
            prev, n = now, n + 1
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("df", help="space per member and by use (files, checkpoints, KV)")
    s.add_argument("mount")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_df)
    s = sub.add_parser("top", help="live throughput and IOPS per member, requests per op")
    s.add_argument("mount")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    s.add_argument("--count", type=int, default=0, help="samples to show (0: until ^C)")
    s.add_argument("--json", action="store_true", help="one JSON object per sample")
    s.set_defaults(func=cmd_top)

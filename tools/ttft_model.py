#!/usr/bin/env python3
"""When does loading KV cache beat recomputing it?  An analytical TTFT model.

For a prompt whose first n tokens are a cached prefix:
  KV bytes          = n x 2 (K and V) x layers x kv_heads x head_dim x dtype bytes
  recompute TTFT    = prefill FLOPs / (accelerator FLOP/s x utilisation)
      prefill FLOPs = 2 x active params x n  +  2 x layers x n^2 x (heads x head_dim)
                      (weights, plus causal attention scores and values)
  load TTFT         = KV bytes / storage bandwidth  +  fixed latency
  break-even        = the bandwidth at which both are equal: KV bytes / recompute time
Loading wins above the break-even bandwidth; the attention term grows as n^2 while
the KV bytes grow as n, so long contexts favour loading.

    python tools/ttft_model.py --pool-gbps 1.6 --plot docs/ttft_model.png
    python tools/ttft_model.py --model-json OUT/model.json --flops 2.4e11 --util 1 \
        --tail 64 --pool-gbps 0.8 --lengths 1024,4096,16384

`--model-json` models one other model instead (a JSON object of `Model`'s fields, as
`mxfs bench ttft` writes it for the model it measured), so its predictions can be
reproduced beside the measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from mxfs.kv.ttft import (  # the model itself; this is its command line and plots
    H200_FLOPS,
    MODELS,
    Model,
    break_even_gbps,
    load_s,
    recompute_s,
    reuse_s,
)

__all__ = ["H200_FLOPS", "MODELS", "Model", "break_even_gbps", "load_s", "recompute_s",
           "reuse_s", "table", "plot", "main"]


def table(m: Model, lengths: list[int], flops: float, util: float, bandwidths: list[float],
          latency: float, tail: int = 0) -> list[dict[str, float]]:
    """A row per cached prefix of n tokens; with `tail`, the prompt has that many more,
    prefilled after the load (reuse), or with the prefix (recompute)."""
    rows = []
    for n in lengths:
        row = {"tokens": n, "kv_gb": m.kv_bytes_per_token() * n / 1e9,
               "recompute_s": recompute_s(m, n + tail, flops, util),
               "break_even_gbps": break_even_gbps(m, n, flops, util)}
        for bw in bandwidths:
            row[f"load_s@{bw:g}GB/s"] = load_s(m, n, bw, latency)
            if tail:
                row[f"reuse_s@{bw:g}GB/s"] = reuse_s(m, n + tail, n, bw, flops, util, latency)
        rows.append(row)
    return rows


def plot(path: str, lengths: list[int], flops: float, util: float, bandwidths: list[float],
         latency: float, pool_gbps: float | None, models: dict[str, Model] | None = None
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = models or MODELS
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models.values(), strict=True):
        ax.plot(lengths, [recompute_s(m, n, flops, util) for n in lengths], "k-", lw=2,
                label=f"recompute ({flops / 1e12:.0f} TFLOP/s x {util:.0%})")
        for bw in bandwidths:
            ax.plot(lengths, [load_s(m, n, bw, latency) for n in lengths], "--",
                    label=f"load at {bw:g} GB/s")
        if pool_gbps:
            ax.plot(lengths, [load_s(m, n, pool_gbps, latency) for n in lengths], "r-",
                    label=f"load at {pool_gbps:.2f} GB/s (this pool, measured)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cached prefix (tokens)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{m.name}: {m.kv_bytes_per_token() // 1024} KiB of KV per token")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flops", type=float, default=H200_FLOPS, help="accelerator FLOP/s")
    ap.add_argument("--util", type=float, default=0.4, help="prefill utilisation (0-1)")
    ap.add_argument("--latency", type=float, default=0.005, help="fixed load latency (s)")
    ap.add_argument("--bandwidths", default="1,5,25", help="storage GB/s to compare")
    ap.add_argument("--pool-gbps", type=float, help="this pool's measured KV read GB/s")
    ap.add_argument("--lengths", default="1024,4096,16384,32768,65536,131072")
    ap.add_argument("--plot", help="write a PNG of TTFT against context length here")
    ap.add_argument("--tail", type=int, default=0,
                    help="tokens after the cached prefix, prefilled either way (reuse_s)")
    ap.add_argument("--model-json", help="model this one model instead (Model's fields)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    models = MODELS
    if args.model_json:
        try:
            with open(args.model_json) as f:
                m = Model(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            print(f"ttft_model: {args.model_json}: not a model description ({e})",
                  file=sys.stderr)
            return 2
        models = {m.name: m}
    lengths = [int(x) for x in args.lengths.split(",")]
    bws = [float(x) for x in args.bandwidths.split(",")] + (
        [args.pool_gbps] if args.pool_gbps else [])
    out: dict[str, dict[str, Any]] = {
        name: {"model": asdict(m), "kv_bytes_per_token": m.kv_bytes_per_token(),
               "rows": table(m, lengths, args.flops, args.util, bws, args.latency, args.tail)}
        for name, m in models.items()}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name, o in out.items():
            m = models[name]
            print(f"\n{m.name}: {o['kv_bytes_per_token']} bytes of KV per token "
                  f"({m.source})\n")
            cols = list(o["rows"][0])
            print("| " + " | ".join(cols) + " |")
            print("|" + "---:|" * len(cols))
            for row in o["rows"]:
                print("| " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |")
    if args.plot:
        plot(args.plot, [2 ** k for k in range(9, 18)], args.flops, args.util,
             [float(x) for x in args.bandwidths.split(",")], args.latency, args.pool_gbps,
             models)
    return 0


if __name__ == "__main__":
    sys.exit(main())

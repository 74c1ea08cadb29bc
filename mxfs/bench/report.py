"""What `mxfs bench ttft` measured, with the TTFT model's prediction beside each figure.

The prediction takes the model's shape from its config, the FLOP/s this device
multiplies matrices at (measured by an instance, utilisation 1), and the read
bandwidth the instance measured for that very get: so measurement and prediction
differ only by what the model leaves out (attention kernels slower than a GEMM,
norms, rotary embeddings, the cache built from chunks, per-request overheads).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from mxfs.kv.ttft import Model, recompute_s, reuse_s

LATENCY = 0.005  # the TTFT model's fixed load latency, as tools/ttft_model.py defaults


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def predict(result: dict[str, Any]) -> None:
    """Add the TTFT model's predictions to each reuse row, at the bandwidths measured."""
    m = Model(**result["model"]["ttft_model"])
    flops = result["flops"]
    for row in result["reuse"]["rows"]:
        n = row["prompt_tokens"]
        row["predicted_recompute_s"] = recompute_s(m, n, flops, 1.0)
        for kind in ("cold", "warm"):
            gbps = med(row[f"{kind}_gbps"])
            row[f"predicted_{kind}_s"] = reuse_s(m, n, row["pool_tokens"], gbps, flops, 1.0,
                                                 LATENCY) if gbps > 0 else float("nan")


def ttft_cut(row: dict[str, Any], kind: str = "cold") -> float:
    """How much less TTFT reuse took than recompute (0.25: a quarter less)."""
    return 1 - med(row[f"reuse_{kind}_s"]) / med(row["recompute_s"])


def serving_gains(serving: dict[str, Any]) -> list[dict[str, Any]]:
    """Per concurrency: the pool's run against the run without it."""
    by = {(r["concurrency"], r["pool"]): r for r in serving["runs"]}
    out = []
    for c in sorted({c for c, _ in by}):
        a, b = by.get((c, False)), by.get((c, True))
        if a and b and a["requests_per_s"] > 0:
            out.append({"concurrency": c,
                        "throughput_gain": b["requests_per_s"] / a["requests_per_s"] - 1,
                        "ttft_p50_cut": 1 - b["ttft_p50_s"] / a["ttft_p50_s"]})
    return out


def _s(x: float) -> str:
    return "n/a" if x != x else f"{x:.3f}" if x < 10 else f"{x:.1f}"


NAN = float("nan")


def markdown(result: dict[str, Any]) -> list[str]:
    """The report's body (without a title), as Markdown lines."""
    m, rs = result["model"], result["reuse"]
    lines = [f"Command: `{result['command']}`", "",
             f"Model: {m['arch']} `{m['size']}` built from a config (random weights, seed "
             f"{m['seed']}, no hub): {m['params'] / 1e6:.1f} M parameters "
             f"({m['layer_params'] / 1e6:.1f} M in the decoder layers), "
             f"{m['ttft_model']['layers']} layers, {m['ttft_model']['heads']} heads / "
             f"{m['ttft_model']['kv_heads']} KV heads of {m['ttft_model']['head_dim']}, "
             f"{m['dtype']} on {m['device']}; {m['kv_bytes_per_token']} bytes of KV per "
             f"token, chunks of {m['chunk_tokens']} tokens ({m['chunk_bytes'] >> 10} KiB). "
             f"Weights id `{m['model_id']}`.", "",
             f"Pool: {result['pool']}; namespace `{result['namespace']}`. Matrix multiplies "
             f"here: {result['flops'] / 1e9:.0f} GFLOP/s ({result['threads']['reuse']} "
             f"threads): the TTFT model's `flops`, at utilisation 1, with the read bandwidth "
             f"measured for each get and a {LATENCY * 1e3:.0f} ms fixed latency.", ""]
    lines += ["## Reuse across instances", "",
              f"Instance 1 recomputes a prompt (context + a {rs['question_tokens']}-token "
              f"question) and puts its chunks; instance 2, another process, serves the same "
              f"prompt from the pool. Medians of {rs['repeat']}; TTFT in seconds, the "
              f"model's prediction in brackets; policy cold: with the reuse policy, the "
              f"tokens it read in square brackets. Cold: page cache dropped before each "
              f"request{'' if all(r['dropped'] for r in rs['rows']) else ' (could not: not root)'}"
              f"; warm: after one buffered read of the chunks.", "",
              "| context | recompute | reuse cold | policy cold | reuse warm | TTFT cut (cold) "
              "| KV read | cold GB/s | warm GB/s | from pool / computed | tokens = recompute |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rs["rows"]:
        lines.append(
            f"| {r['context']:,} | {_s(med(r['recompute_s']))} "
            f"({_s(r['predicted_recompute_s'])}) | {_s(med(r['reuse_cold_s']))} "
            f"({_s(r['predicted_cold_s'])}) | {_s(med(r.get('policy_cold_s', [])))} "
            f"[{r.get('policy_pool_tokens', 0):,} read] | {_s(med(r['reuse_warm_s']))} "
            f"({_s(r['predicted_warm_s'])}) | {ttft_cut(r):.0%} | "
            f"{r['read_bytes'] / 1e6:.0f} MB | {med(r['cold_gbps']):.2f} | "
            f"{med(r['warm_gbps']):.2f} | {r['pool_tokens']:,} / {r['computed_tokens']:,} | "
            f"{'yes' if r['tokens_equal'] else '**no**'} |")
    lines += ["", "Where a cold reuse's TTFT goes (medians, seconds): the lookup and the "
              "read, the DynamicCache built from the chunks, the prefill of the rest.", "",
              "| context | lookup + read | cache built | prefill | TTFT |",
              "|---:|---:|---:|---:|---:|"]
    for r in rs["rows"]:
        p = r["cold_parts"]
        lines.append(f"| {r['context']:,} | {_s(med(p['read_s']))} | {_s(med(p['build_s']))} "
                     f"| {_s(med(p['prefill_s']))} | {_s(med(r['reuse_cold_s']))} |")
    parts = [r for r in rs["rows"] if "partial" in r]
    if parts:
        lines += ["", "Partial hits: a prompt sharing only the first half of the context "
                  "(cold, one request each), reading every hit, then with the reuse "
                  "policy (`mxfs.kv.reuse_policy`: it reads only what is faster to read "
                  "than to compute, by the rates this instance measured).", "",
                  "| context | shared | from pool / computed | recompute | reuse | "
                  "policy: from pool | policy: TTFT | tokens = recompute |",
                  "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in parts:
            p = r["partial"]
            lines.append(f"| {r['context']:,} | {p['shared_tokens']:,} | "
                         f"{p['pool_tokens']:,} / {p['computed_tokens']:,} | "
                         f"{_s(p['recompute_s'])} | {_s(p['reuse_cold_s'])} | "
                         f"{p.get('policy_pool_tokens', 0):,} | {_s(p.get('policy_s', NAN))} | "
                         f"{'yes' if p['tokens_equal'] else '**no**'} |")
    lines += ["", "![TTFT against context length](ttft.png)", ""]
    sv = result.get("serving")
    if sv:
        lines += _serving_lines(sv, result)
    lines += _fault_lines(result)
    return lines


def _serving_lines(sv: dict[str, Any], result: dict[str, Any]) -> list[str]:
    mix, threads = sv["mix"], result["threads"]["serving"]
    lines = ["## Concurrency", "",
             f"{sv['instances']} instance processes ({threads} thread"
             f"{'s' if threads != 1 else ''} each), "
             f"{sv['kinds']['system'] + sv['kinds']['turn']} requests: "
             f"{sv['kinds']['system']} queries of {mix['query_tokens']} tokens after one of "
             f"{mix['systems']} system prompts of {mix['system_tokens']:,} tokens, and "
             f"{sv['kinds']['turn']} turns of {mix['conversations']} conversations "
             f"({mix['document_tokens']:,} tokens, then {mix['turn_tokens']} a turn). Each "
             f"instance keeps {sv['local_tokens']:,} tokens of KV in its own memory; the "
             f"requests hold {sv['working_set_tokens']:,} tokens of distinct chunks. "
             f"{sv['new_tokens']} tokens generated per request; TTFT from submission "
             f"(queueing included). {sv['repeat']} rounds of each setting, the two "
             f"alternating: rates are medians, TTFT percentiles over every request of "
             f"every round.", "",
             "| concurrency | pool | requests/s | output tokens/s | prompt tokens/s | "
             "TTFT p50 | TTFT p90 | pool hits | own-memory hits | computed tokens |",
             "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sv["runs"]:
        lines.append(f"| {r['concurrency']} | {'with' if r['pool'] else 'without'} | "
                     f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['prompt_tokens_per_s']:,.0f} | {_s(r['ttft_p50_s'])} | "
                     f"{_s(r['ttft_p90_s'])} | {r['pool_hit_rate']:.0%} | "
                     f"{r['local_hit_rate']:.0%} | {r['computed_tokens']:,.0f} |")
    lines += ["", "| concurrency | throughput with the pool | TTFT p50 with the pool |",
              "|---:|---:|---:|"]
    for g in serving_gains(sv):
        lines.append(f"| {g['concurrency']} | {g['throughput_gain']:+.0%} | "
                     f"{-g['ttft_p50_cut']:+.0%} |")
    lines += ["", f"Greedy tokens of every request equal in every run: "
              f"{'yes' if sv['tokens_equal'] else '**no**'}.", "",
              "![throughput against concurrency](throughput.png)", ""]
    return lines


def _fault_lines(result: dict[str, Any]) -> list[str]:
    seen: dict[str, dict[str, Any]] = {}
    for r in result["reuse"]["rows"]:
        for k, v in r["pool_failures"].items():
            seen.setdefault(k, v)
    for r in (result.get("serving") or {}).get("runs", []):
        for k, v in r["pool_failures"].items():
            seen.setdefault(k, v)
    refused = sum(r["put_refused"] for r in result["reuse"]["rows"]) + sum(
        r["put_refused"] for r in (result.get("serving") or {}).get("runs", []))
    if not seen and not refused:
        return ["The pool answered every lookup, get and put.", ""]
    lines = ["## What went wrong with the pool", "",
             "Instances served on, recomputing what the pool could not give:", ""]
    lines += [f"- {k}: failed (first: {v['first']})" for k, v in seen.items()]
    if refused:
        lines.append(f"- {refused} chunk puts refused (the engine went on without caching "
                     f"them)")
    return lines + [""]


def plots(result: dict[str, Any], out: str) -> list[str]:
    """ttft.png and throughput.png; the names written (none without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["reuse"]["rows"]
    xs = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, pkey, color, label in (("recompute_s", "predicted_recompute_s", "k", "recompute"),
                                    ("reuse_cold_s", "predicted_cold_s", "tab:blue",
                                     "reuse, cold"),
                                    ("reuse_warm_s", "predicted_warm_s", "tab:green",
                                     "reuse, warm")):
        ax.plot(xs, [med(r[key]) for r in rows], "o-", color=color, label=f"{label}, measured")
        ax.plot(xs, [r[pkey] for r in rows], "--", color=color, alpha=0.7,
                label=f"{label}, TTFT model")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{result['model']['arch']}-{result['model']['size']} on "
                 f"{result['model']['device']}: TTFT, measured and predicted")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ttft.png"), dpi=100)
    plt.close(fig)
    names = ["ttft.png"]
    sv = result.get("serving")
    if sv:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for pool, color in ((False, "tab:gray"), (True, "tab:blue")):
            runs = [r for r in sv["runs"] if r["pool"] == pool]
            cs = [r["concurrency"] for r in runs]
            label = "with the pool" if pool else "without"
            a1.plot(cs, [r["requests_per_s"] for r in runs], "o-", color=color, label=label)
            a2.plot(cs, [r["ttft_p50_s"] for r in runs], "o-", color=color,
                    label=f"p50, {label}")
            a2.plot(cs, [r["ttft_p90_s"] for r in runs], "^:", color=color,
                    label=f"p90, {label}")
        a1.set_xlabel("concurrency")
        a1.set_ylabel("requests/s")
        a1.set_ylim(bottom=0)
        a2.set_xlabel("concurrency")
        a2.set_ylabel("TTFT (s)")
        for a in (a1, a2):
            a.grid(True, alpha=0.3)
            a.legend(fontsize=8)
        fig.suptitle(f"{sv['instances']} instances: throughput and TTFT")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "throughput.png"), dpi=100)
        plt.close(fig)
        names.append("throughput.png")
    return names


def write(out: str, result: dict[str, Any]) -> str:
    """report.md, ttft.json, model.json (for tools/ttft_model.py) and plots; the report."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ttft.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump(result["model"]["ttft_model"], f, indent=1)
    drawn = plots(result, out)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(result["time"]))
    lines = [f"# TTFT and throughput with KV reused through the pool, {when}", "",
             *markdown(result), *reproduce(result, out)]
    if not drawn:
        lines += ["(plots skipped: matplotlib is not installed: pip install matplotlib)", ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def reproduce(result: dict[str, Any], out: str) -> list[str]:
    """The tools/ttft_model.py command that prints the same predictions."""
    rows = result["reuse"]["rows"]
    gbps = med([med(r["cold_gbps"]) for r in rows])
    return ["The predictions again, from the model alone (cold bandwidth, median over "
            "lengths):", "",
            f"    python tools/ttft_model.py --model-json {os.path.join(out, 'model.json')} "
            f"--flops {result['flops']:.3g} --util 1 --tail {result['reuse']['question_tokens']}"
            f" --pool-gbps {gbps:.2f} --lengths {','.join(str(r['context']) for r in rows)}",
            ""]

"""The reference design's gates, judged from what the benches measured.

- G2, the single-node baseline: `mxfs bench run`'s figures, every one measured; with a
  baseline run given, none more than `tolerance` below it.
- G3, KV pooling: reuse from the pool cuts TTFT by at least 25% against recompute (at
  the longest context measured, cold), and the pool raises throughput by at least 29%
  at concurrency 8 and 16 (at the highest concurrency measured when neither was), with
  greedy tokens equal to recompute in every run.
- G4, stability: `tools/soak.py` ends with nothing lost and no invariant broken (a
  smoke of minutes here; `--soak-hours 72` for the real one).

Each verdict is {"gate", "pass", "reasons", "figures"}: reasons say why it failed (or
what it passed on), in words a site can act on.
"""

from __future__ import annotations

from typing import Any

from mxfs.bench.report import med, serving_gains, ttft_cut

TTFT_CUT = 0.25
THROUGHPUT_GAIN = 0.29
GAIN_AT = (8, 16)


def verdict(gate: str, ok: bool, reasons: list[str], **figures: Any) -> dict[str, Any]:
    return {"gate": gate, "pass": ok, "reasons": reasons, "figures": figures}


def not_run(gate: str, why: str) -> dict[str, Any]:
    """A gate that was not run: not passed, and said so rather than failed."""
    return {**verdict(gate, False, [why]), "run": False}


def word(v: dict[str, Any]) -> str:
    if v.get("run") is False:
        return "not run"
    return ("pass (smoke)" if v.get("smoke") else "pass") if v["pass"] else "FAIL"


def g2(results: dict[str, Any], baseline: dict[str, Any] | None = None,
       tolerance: float = 0.15) -> dict[str, Any]:
    med_ = results["median"]
    bad = [k for k, v in med_.items() if not v > 0]
    reasons = [f"{k} measured nothing" for k in bad]
    if baseline is not None:
        for k, v in baseline["median"].items():
            if k in med_ and med_[k] < (1 - tolerance) * v:
                reasons.append(f"{k}: {med_[k]:.2f} GB/s, {1 - med_[k] / v:.0%} below the "
                               f"baseline's {v:.2f} (tolerance {tolerance:.0%})")
    ok = not reasons
    if ok:
        reasons = [f"{len(med_)} figures measured, medians of {results['repeat']}"
                   + (f", none more than {tolerance:.0%} below the baseline"
                      if baseline is not None else "")]
    return verdict("G2", ok, reasons, **med_)


def g3(ttft: dict[str, Any], cut: float = TTFT_CUT, gain: float = THROUGHPUT_GAIN
       ) -> dict[str, Any]:
    reasons: list[str] = []
    ok = True
    figures: dict[str, Any] = {}
    rows = ttft["reuse"]["rows"]
    if rows:
        row = max(rows, key=lambda r: r["context"])
        got = ttft_cut(row)
        figures.update(context=row["context"], recompute_s=med(row["recompute_s"]),
                       reuse_cold_s=med(row["reuse_cold_s"]), ttft_cut=got)
        passed = got >= cut
        ok &= passed
        reasons.append(f"TTFT at {row['context']:,} tokens: {med(row['reuse_cold_s']):.3f} s "
                       f"reusing (cold) against {med(row['recompute_s']):.3f} s recomputing, "
                       f"{got:.0%} less ({'at least' if passed else 'below'} the {cut:.0%} "
                       f"asked)")
    else:
        ok = False
        reasons.append("no context length was measured")
    if not ttft["reuse"]["tokens_equal"]:
        ok = False
        reasons.append("tokens served from the pool differed from recompute")
    sv: dict[str, Any] = ttft.get("serving") or {}
    gains = serving_gains(sv) if sv else []
    if not gains:
        ok = False
        reasons.append("throughput not measured (the concurrency scenario did not run)")
    else:
        at = [g for g in gains if g["concurrency"] in GAIN_AT] or [gains[-1]]
        for g in at:
            passed = g["throughput_gain"] >= gain
            ok &= passed
            figures[f"throughput_gain_c{g['concurrency']}"] = g["throughput_gain"]
            reasons.append(f"throughput at concurrency {g['concurrency']}: "
                           f"{g['throughput_gain']:+.0%} with the pool "
                           f"({'at least' if passed else 'below'} the +{gain:.0%} asked)")
        if not sv["tokens_equal"]:
            ok = False
            reasons.append("requests got different tokens with the pool and without")
        if any(r["errors"] for r in sv["runs"]):
            ok = False
            reasons.append("some requests failed: " + "; ".join(
                e for r in sv["runs"] for e in r["errors"])[:300])
    return verdict("G3", ok, reasons, **figures)


def g4(report: dict[str, Any] | None, rc: int, minutes: float, last_words: str = ""
       ) -> dict[str, Any]:
    if report is None:
        return verdict("G4", False, [f"tools/soak.py ended ({rc}) without a report"
                                     + (f": {last_words}" if last_words else "")])
    lost, problems = report.get("lost", 0), report.get("problems", 0)
    wrong = [k for k in ("kv_wrong", "load_wrong") if report.get(k)]
    reasons = []
    if lost:
        reasons.append(f"{lost} fsynced files or checkpoints lost")
    if problems:
        reasons.append(f"{problems} metadata invariants broken")
    reasons += [f"{k}: {report[k]}" for k in wrong]
    if rc and not reasons:
        reasons.append(f"tools/soak.py exited {rc}: {report.get('errors', [])[:3]}")
    ok = rc == 0 and not reasons
    if ok:
        reasons = [f"{minutes:g} minutes, {report.get('cycles', 0)} crash cycles, "
                   f"{report.get('file_checks', 0)} file checks: nothing lost"]
    return verdict("G4", ok, reasons, **{k: v for k, v in report.items()
                                          if isinstance(v, int | float)})

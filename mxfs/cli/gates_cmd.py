"""`mxfs bench gates --out DIR`: G2, G3 and a G4 smoke in one report, pass or fail each.

G2 is `mxfs bench run` and G3 `mxfs bench ttft`, both on the same pool (a mount, or
one scratch pool); G4 runs `tools/soak.py` on a scratch pool of its own.  The verdicts
come from `mxfs.bench.gates`; DIR gets report.md, gates.json and the two benches'
folders (g2/, g3/) with their reports, data and plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from mxfs.errors import MxfsError, UsageError
from mxfs.units import BENCH_MIN_SIZE, count_arg, finite_arg, fraction_arg, size_arg

SOAK = Path(__file__).resolve().parents[2] / "tools" / "soak.py"


def add_options(v: argparse.ArgumentParser) -> None:
    v.add_argument("--g2-size", type=size_arg(BENCH_MIN_SIZE), default=256 << 20,
                   help="bytes per step of the G2 run (default 256MiB, at least 1MiB)")
    v.add_argument("--g2-repeat", type=count_arg(1, 1000), default=3)
    v.add_argument("--baseline", help="an earlier G2 folder (mxfs bench run --out) to hold to")
    v.add_argument("--tolerance", type=fraction_arg, default=0.15,
                   help="how far below the baseline a G2 figure may fall (0 to below 1)")
    v.add_argument("--soak-minutes", type=finite_arg(7 * 24 * 60), default=0.5,
                   help="the G4 smoke: minutes of tools/soak.py with crashes")
    v.add_argument("--soak-hours", type=finite_arg(24 * 365, zero=True), default=0.0,
                   help="the real G4 (72): a plain soak of this many hours (0: the smoke)")
    v.add_argument("--crash-every", type=finite_arg(24 * 3600), default=10.0,
                   help="seconds between crashes in the smoke (above 0)")
    v.add_argument("--skip", default="", help="gates not to run, e.g. g2,g4")


def _baseline(path: str | None) -> dict[str, Any] | None:
    """The G2 baseline's results, checked before any gate runs (`read_results`)."""
    from mxfs.cli.bench import read_results

    return None if path is None else read_results(path, f"--baseline {path}")


def soak(out: str, minutes: float, hours: float, crash_every: float
         ) -> tuple[dict[str, Any] | None, int, float, str]:
    """Run tools/soak.py; (its report, exit code, minutes it was asked for, the last line
    it printed)."""
    report = os.path.join(out, "soak.json")
    args = ["--hours", f"{hours:g}"] if hours else \
        ["--minutes", f"{minutes:g}", "--crash-every", f"{crash_every:g}"]
    scratch = tempfile.mkdtemp(prefix="g4-", dir=out)
    with open(os.path.join(out, "soak.log"), "w") as log:
        rc = subprocess.run([sys.executable, "-P", str(SOAK), *args, "--dir", scratch,
                             "--json", report], stdout=log, stderr=subprocess.STDOUT).returncode
    shutil.rmtree(scratch, ignore_errors=True)  # the soak's journals
    with open(os.path.join(out, "soak.log"), errors="replace") as log:
        lines = [line.strip() for line in log if line.strip()]
    last = lines[-1][:300] if lines else ""
    try:
        with open(report) as f:
            return json.load(f), rc, hours * 60 or minutes, last
    except (OSError, ValueError):
        return None, rc, hours * 60 or minutes, last


def run_gates(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    from mxfs.bench import gates
    from mxfs.bench import report as ttft_report
    from mxfs.cli.bench import Run, check_out, need_modules, write_report
    from mxfs.cli.bench_ttft import check, measure, pool_at

    skip = {s.strip().lower() for s in args.skip.split(",") if s.strip()}
    if skip - {"g2", "g3", "g4"}:
        raise UsageError(f"--skip {args.skip}: gates are g2, g3 and g4")
    opts = check(args)
    size = args.g2_size
    baseline = _baseline(args.baseline)
    check_out(args.out)
    if "g2" not in skip:
        need_modules("G2 (mxfs bench run)")
    if not SOAK.is_file() and "g4" not in skip:
        raise MxfsError(f"G4 runs {SOAK}, which is not there",
                        "run from a checkout of mxfs, or --skip g4")
    root = os.geteuid() == 0
    out = args.out
    os.makedirs(out, exist_ok=True)
    verdicts: dict[str, dict[str, Any]] = {}
    ttft: dict[str, Any] | None = None
    if not root and target_needs_root(args, skip):
        raise MxfsError("the gates drop the page cache, write the member folders and make "
                        "scratch pools", "run them as root")
    text = "none (G2 and G3 not run)"
    scene: AbstractContextManager[tuple[str, str, list[str]]] = (
        pool_at(args.target, say) if {"g2", "g3"} - skip else nullcontext(("", text, [])))
    with scene as (mount, text, members):
        if "g2" in skip:
            verdicts["G2"] = gates.not_run("G2", "skipped (--skip)")
        else:
            say("G2: mxfs bench run")
            g2 = Run(mount, members, size, args.g2_repeat).go(say)
            write_report(os.path.join(out, "g2"), g2)
            verdicts["G2"] = gates.g2(g2, baseline, args.tolerance)
        if "g3" in skip:
            verdicts["G3"] = gates.not_run("G3", "skipped (--skip)")
        else:
            say("G3: mxfs bench ttft")
            g3_dir = os.path.join(out, "g3")
            os.makedirs(g3_dir, exist_ok=True)
            ttft = measure(mount, text, args, opts, tempfile.mkdtemp(prefix="instances-",
                                                                      dir=g3_dir), say)
            ttft_report.write(g3_dir, ttft)
            verdicts["G3"] = gates.g3(ttft)
    if "g4" in skip:
        verdicts["G4"] = gates.not_run("G4", "skipped (--skip)")
    else:
        say(f"G4: tools/soak.py ({args.soak_hours:g} hours)" if args.soak_hours else
            f"G4 smoke: tools/soak.py, {args.soak_minutes:g} minutes with crashes")
        rep, rc, minutes, last = soak(out, args.soak_minutes, args.soak_hours,
                                      args.crash_every)
        verdicts["G4"] = gates.g4(rep, rc, minutes, last)
        if not args.soak_hours:
            verdicts["G4"]["reasons"].append("a smoke only: the gate itself is "
                                             "--soak-hours 72")
            verdicts["G4"]["smoke"] = True
    result = {"time": time.time(), "pool": text, "verdicts": verdicts,
              "pass": all(v["pass"] for v in verdicts.values())}
    with open(os.path.join(out, "gates.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(markdown(result, ttft)))
    return result


def target_needs_root(args: argparse.Namespace, skip: set[str]) -> bool:
    return args.target is None or "g2" not in skip or "g4" not in skip


def markdown(result: dict[str, Any], ttft: dict[str, Any] | None) -> list[str]:
    from mxfs.bench.gates import word
    from mxfs.bench.report import markdown as ttft_markdown

    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(result["time"]))
    lines = [f"# mxfs gates, {when}", "", f"Pool: {result['pool']}.", "",
             "| gate | verdict | why |", "|---|---|---|"]
    for name, v in result["verdicts"].items():
        lines.append(f"| {name} | **{word(v)}** | {'; '.join(v['reasons'])} |")
    lines += ["", "G2: `mxfs bench run` (report in [g2/report.md](g2/report.md)). "
              "G3: TTFT cut at least 25% (cold reuse against recompute, longest context) and "
              "throughput at least +29% with the pool at concurrency 8 and 16, tokens equal "
              "to recompute (report in [g3/report.md](g3/report.md)). G4: `tools/soak.py` "
              "(log in soak.log).", ""]
    if ttft is not None:
        body = ttft_markdown(ttft)
        lines += ["## G3 in detail", ""] + [
            line.replace("](ttft.png)", "](g3/ttft.png)").replace(
                "](throughput.png)", "](g3/throughput.png)") for line in body]
    return lines


def cmd_bench_gates(args: argparse.Namespace) -> int:
    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    result = run_gates(args, say)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        from mxfs.bench.gates import word

        for name, v in result["verdicts"].items():
            print(f"{name}: {word(v)}: {'; '.join(v['reasons'])}")
        print(f"report written to {os.path.join(args.out, 'report.md')}")
    return 0 if result["pass"] else 1

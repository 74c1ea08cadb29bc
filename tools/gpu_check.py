#!/usr/bin/env python3
"""Ready for a GPU: model loads, checkpoints and KV gets on a CUDA device, and what the machine has.

One prepared run for a CUDA machine that cannot reach the internet (and may lack
FUSE and io_uring, as under gVisor); tools/gpu_check.sh runs it.  It probes the
environment (sandbox, FUSE with a real mount, io_uring, O_DIRECT on the pool's disk,
torch and CUDA, cuFile through kvikio), makes a 4-member pool of folders and mounts it
where FUSE works, then runs each part in a child process of its own under a time limit:
  loads       mxfs.load (pinned staging, GDS) against raw reads and safetensors
              (gpu_check_load.py: an unmounted pool of its own, as without FUSE)
  checkpoint  mxfs.ckpt of a state dict on the device against torch.save + fsync
              (gpu_check_ckpt.py: on the mount, else a plain folder)
  kv          KVStore gets into device buffers against raw reads and plain files
              (gpu_check_kv.py: on the mount, else the unmounted pool's direct reader)
A part that cannot run says why; one that fails or runs out of time is recorded and
the rest go on.  Every byte read back is compared.  Results: OUT/gpu_check.json and
OUT/gpu_check.md.  Exit 0 when every part gave figures or a reason and every byte
check passed.

    python tools/gpu_check.py --size 4GiB --repeat 3 --out /tmp/out
    python tools/gpu_check.py --device cpu --size 8MiB --repeat 1   (a dry run, no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, NoReturn

from gpu_check_report import markdown

from mxfs.cli.scratch import scratch_dir
from mxfs.errors import MxfsError, UsageError
from mxfs.proc import python_module
from mxfs.units import parse_size

PARTS = ("gpu", "loads", "checkpoint", "kv")
# Shares of --budget each part may take (the rest is the probes, mount and report).
SHARE = {"gpu": 0.08, "loads": 0.42, "checkpoint": 0.2, "kv": 0.2}
MOUNT_TIMEOUT = 45


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every mxfs tool says it
        raise UsageError(message, f"see {self.prog} --help")


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except (MxfsError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive size")
    return n


def _parts(text: str) -> list[str]:
    parts = [p for p in text.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS[1:]))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: name some of {', '.join(PARTS[1:])}")
    return [p for p in PARTS[1:] if p in parts]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=_size, default=parse_size("4GiB"), help="model bytes")
    ap.add_argument("--ckpt-size", type=_size, help="checkpoint bytes (default: size / 2)")
    ap.add_argument("--kv-size", type=_size, help="KV bytes (default: size / 4)")
    ap.add_argument("--kv-chunk", type=_size, help="bytes of one KV chunk (default 2MiB)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--dir", default="/var/tmp", help="where the scratch pool goes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="results folder")
    ap.add_argument("--device", default="cuda:0", help="cpu: a dry run of the script")
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    ap.add_argument("--no-fuse", action="store_true",
                    help="take the unmounted path even where FUSE works (as without it)")
    ap.add_argument("--parts", type=_parts, default=list(PARTS[1:]),
                    help="which of loads,checkpoint,kv to run (default all; a rerun of "
                         "one gets the whole budget)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--mount", default="", help=argparse.SUPPRESS)
    ap.add_argument("--unmounted-why", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.kv_chunk is not None and args.kv_chunk % 4096:
        ap.error("--kv-chunk must be a multiple of 4KiB")
    args.ckpt_size = args.ckpt_size or max(1 << 20, args.size // 2)
    args.kv_size = args.kv_size or max(1 << 20, args.size // 4)
    return args


# ---- the children ---------------------------------------------------------------------


def run_part(args: argparse.Namespace) -> int:
    """One part in this (child) process: its result as JSON in --result."""
    def emit(result: dict[str, Any]) -> None:
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.result)

    members = [os.path.join(args.work, "pool", f"member{i}") for i in range(4)]
    own = os.path.join(args.work, args.part)
    shutil.rmtree(own, ignore_errors=True)  # what a killed earlier try left
    os.makedirs(own)
    try:
        if args.part == "gpu":
            from gpu_check_env import gpu
            result = gpu(own, args.device)
        elif args.part == "loads":
            import gpu_check_load
            result = gpu_check_load.run(args, own, emit)
        elif args.part == "checkpoint":
            import gpu_check_ckpt
            result = gpu_check_ckpt.run(args, own, args.mount, args.unmounted_why)
        else:
            import gpu_check_kv
            result = gpu_check_kv.run(args, own, args.mount, args.unmounted_why, members)
    finally:
        shutil.rmtree(own, ignore_errors=True)
    emit(result)
    return 0


def child(args: argparse.Namespace, part: str, base: str, mount: str, why: str,
          limit: float) -> dict[str, Any]:
    """Run `part` in a child under `limit` seconds: its result, or what went wrong."""
    result = os.path.join(base, f"{part}.json")
    if os.path.exists(result):
        os.unlink(result)  # an earlier try's
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--part", part,
            "--work", base, "--mount", mount, "--unmounted-why", why, "--result", result]
    start = time.monotonic()
    err = ""
    try:
        res = subprocess.run(argv, stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
                             timeout=limit)
        err = res.stderr
        sys.stderr.write(err[-4000:])
        failed = f"exit code {res.returncode}" if res.returncode else ""
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) \
            else (e.stderr or "")
        sys.stderr.write(err[-4000:])
        failed = f"ran out of its {limit:.0f} s"
    out: dict[str, Any] = {}
    if os.path.exists(result):
        with open(result) as f:
            out = json.load(f)
    if failed:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        out["error"] = failed + (f": {lines[-1].strip()}" if lines else "")
        if out.keys() - {"error"}:
            out["error"] += " (the figures kept are those of the rounds done)"
    out["seconds"] = round(time.monotonic() - start, 1)
    return out


# ---- the parent ----------------------------------------------------------------------


def make_pool(base: str, no_fuse: bool, fuse: dict[str, Any]) -> tuple[str, str]:
    """A 4-member pool in base/pool, mounted where FUSE works: (mount point or "", why not)."""
    from mxfs.vol.format import format_pool

    members = [os.path.join(base, "pool", f"member{i}") for i in range(4)]
    for m in members:
        os.makedirs(m)
    format_pool(members, 1 << 20, label="gpu-check")
    if no_fuse:
        fuse["mount"] = "not tried (--no-fuse)"
        return "", "--no-fuse was given"
    if not fuse.get("dev_fuse"):
        fuse["mount"] = "not tried: no /dev/fuse"
        return "", "FUSE is missing (no /dev/fuse)"
    if fuse.get("pyfuse3_why"):
        fuse["mount"] = f"not tried: pyfuse3 {fuse['pyfuse3_why']}"
        return "", "FUSE cannot run here (pyfuse3 does not import)"
    mnt = os.path.join(base, "mnt")
    os.makedirs(mnt)
    try:
        res = subprocess.run(python_module("mxfs", "mount", members[0], mnt),
                             capture_output=True, text=True, timeout=MOUNT_TIMEOUT)
        said = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        res, said = None, f"no answer within {MOUNT_TIMEOUT} s"
    if res is None or res.returncode:
        unmount(mnt)  # whatever a slow start left behind
        fuse["mount"] = f"failed: {said}"
        return "", f"the FUSE mount failed ({said})"
    fuse["mount"] = "ok"
    return mnt, ""


def unmount(mnt: str) -> None:
    """Unmount (lazily if it is busy), never waiting long: the results come first."""
    for lazy in ((), ("--lazy",)):
        try:
            if subprocess.run(python_module("mxfs", "umount", *lazy, mnt),
                              capture_output=True, timeout=30).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass


def checks_passed(results: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether every part gave figures or a reason, and every byte check that ran passed."""
    problems = []
    for part in PARTS[1:]:
        r = results.get(part, {})  # a part --parts left out has nothing to check
        for key in ("error", "mounted_run_error"):
            if key in r:
                problems.append(f"{part}: {r[key]}")
        for key, value in r.items():
            checks = value if key == "equal" else {key: value} if key.startswith("equal") \
                else {}
            problems += [f"{part}: {name} bytes differ" for name, ok in checks.items()
                         if ok is False]
    return not problems, problems


def main() -> int:
    args = parse_args()
    if args.part:
        return run_part(args)
    started = time.monotonic()
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: this torch sees no CUDA device (--device cpu dry-runs it)",
                  file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    base = scratch_dir("mxfs-gpu-check-", args.dir)
    mnt = ""
    try:
        from gpu_check_env import host

        env = host(args.dir)
        try:
            mnt, why = make_pool(base, args.no_fuse, env["fuse"])
        except (MxfsError, OSError) as e:  # the parts that need the pool say so in turn
            env["pool_error"] = why = f"the scratch pool could not be made ({e})"
        env["pool_mounted"] = bool(mnt)
        results: dict[str, Any] = {"environment": env}
        parts = ["gpu", *args.parts]
        for i, part in enumerate(parts):
            # What earlier parts left unused goes to this one; later ones keep their shares.
            later = args.budget * sum(SHARE[p] for p in parts[i + 1:])
            limit = max(10.0, args.budget - (time.monotonic() - started) - later - 5)
            print(f"gpu_check: {part} (at most {limit:.0f} s)", file=sys.stderr, flush=True)
            results[part] = child(args, part, base, mnt, why, limit)
            left = args.budget - (time.monotonic() - started) - later - 5
            if mnt and part in ("checkpoint", "kv") and "error" in results[part] and \
                    left > args.budget * SHARE[part] / 2:
                # The mount misbehaves here: the unmounted path still gives figures (the
                # KV part's reads the pool itself, so it is unmounted first).
                failed = results[part]["error"]
                if part == "kv":
                    unmount(mnt)
                    mnt = ""
                results[part] = child(args, part, base, "", f"the run on the mount failed "
                                      f"({failed})", left)
                results[part]["mounted_run_error"] = failed
        env["gpu"] = results.pop("gpu")
        return write_results(args, results, started)  # before the clean-up, which may hang
    finally:
        if mnt:
            unmount(mnt)
        shutil.rmtree(base, ignore_errors=True)


def write_results(args: argparse.Namespace, results: dict[str, Any], started: float) -> int:
    ok, problems = checks_passed(results)
    results.update(ok=ok, problems=problems, seconds=round(time.monotonic() - started, 1),
                   args={k: v for k, v in vars(args).items() if k in (
                       "size", "ckpt_size", "kv_size", "kv_chunk", "repeat", "dir", "device",
                       "no_fuse", "budget")})
    text = markdown(results)
    print(text)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MxfsError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        sys.exit(e.exit_code)

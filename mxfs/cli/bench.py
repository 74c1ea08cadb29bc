"""`mxfs bench`: a site's validation run, and the comparison of two runs.

One run measures, on one mounted pool, each member alone and all of them striped
(raw O_DIRECT files in the member folders: the hardware's ceiling), then what mxfs
makes of it against the usual way of doing each job on the same pool: sequential
I/O through the mount, model loading (`mxfs.load` against `safetensors`), checkpoint
saving (`mxfs.ckpt` against `torch.save`) and KV gets (`KVStore` against one file per
chunk).  Medians of repeats.  It writes `report.md`, `results.json` and PNG plots to a
folder; `mxfs bench compare A B` sets two such folders side by side (a baseline and a
candidate: the gate figures).  The benches with a real model, `mxfs bench ttft`
(`cli/bench_ttft.py`) and `mxfs bench gates` (`cli/gates_cmd.py`), are registered beside
these in `cli/observe_cmd.py`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from mxfs.cli.measure import drop_caches, read_file, write_file
from mxfs.errors import MxfsError, UsageError
from mxfs.io import ReadOp, WriteOp, read_batch, write_batch
from mxfs.units import BENCH_MIN_SIZE, format_size

SEGMENT = 16 << 20
BLOCK = 8 << 20
# The least bytes per step: each member's share must hold something, or its figure is
# 0 GB/s and the ratios divide by it.


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_io(paths: list[str], size: int, buf: mmap.mmap, write: bool) -> None:
    """`size` bytes split over `paths` (one file per member), O_DIRECT, all at once, each
    file's share from the start of `buf` (a member's share long); writes end in fsync.
    The hardware's ceiling, which the benchmarks compare mxfs with."""
    share = -(-size // len(paths) // 4096) * 4096
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_DIRECT
    fds = [os.open(p, flags, 0o600) for p in paths]
    view = memoryview(buf)
    try:
        ops = [(WriteOp if write else ReadOp)(fd, o, [view[o:o + min(SEGMENT, share - o)]])
               for fd in fds for o in range(0, share, SEGMENT)]
        (write_batch if write else read_batch)(ops)  # type: ignore[arg-type]
        if write:
            for fd in fds:
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


class Run:
    """One validation run on the pool mounted at `mnt`."""

    def __init__(self, mnt: str, members: list[str], size: int, repeat: int) -> None:
        if repeat < 1 or size < BENCH_MIN_SIZE:  # (the parsers refuse them: for callers)
            raise UsageError(f"a bench run of {repeat} rounds of {size} bytes measures nothing",
                             f"give at least 1 round of at least {format_size(BENCH_MIN_SIZE)}")
        self.mnt, self.members, self.size, self.repeat = mnt, members, size, repeat
        self.work = os.path.join(mnt, f".mxfs-bench-{os.getpid()}")
        self.rounds: list[dict[str, float]] = []

    def go(self, say: Callable[[str], None]) -> dict[str, Any]:
        os.makedirs(self.work)
        buf = mmap.mmap(-1, -(-self.size // 4096) * 4096 + 4096)
        pattern = os.urandom(1 << 20)
        for off in range(0, len(buf), len(pattern)):  # touched once, outside the clock
            buf[off:off + len(pattern)] = pattern[:len(buf) - off]
        try:
            for r in range(self.repeat):
                say(f"round {r + 1}/{self.repeat}")
                self.rounds.append(self._round(buf))
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
            for m in self.members:
                for n in os.listdir(m):
                    if n.startswith(".mxfs-bench-raw"):
                        os.unlink(os.path.join(m, n))
        med = {k: statistics.median(r[k] for r in self.rounds) for k in self.rounds[0]}
        return {"bytes": self.size, "members": len(self.members), "repeat": self.repeat,
                "median": med, "rounds": self.rounds, "time": time.time()}

    def _gbps(self, seconds: float, nbytes: int | None = None) -> float:
        return (nbytes or self.size) / seconds / 1e9

    def _round(self, buf: mmap.mmap) -> dict[str, float]:
        res: dict[str, float] = {}
        raws = [os.path.join(m, f".mxfs-bench-raw-{os.getpid()}") for m in self.members]
        one = self.size // len(self.members)
        for i, path in enumerate(raws):  # each member alone
            res[f"member{i}_write"] = self._gbps(_timed(partial(raw_io, [path], one, buf, True)),
                                                 one)
            drop_caches()
            res[f"member{i}_read"] = self._gbps(_timed(partial(raw_io, [path], one, buf, False)),
                                                one)
        res["striped_write"] = self._gbps(_timed(lambda: raw_io(raws, self.size, buf, True)))
        drop_caches()
        res["striped_read"] = self._gbps(_timed(lambda: raw_io(raws, self.size, buf, False)))
        block = memoryview(bytearray(os.urandom(BLOCK)))
        seq = os.path.join(self.work, "seq.bin")
        res["mount_write"] = self._gbps(write_file(seq, self.size, block)[0])
        drop_caches()
        res["mount_read"] = self._gbps(read_file(seq, bytearray(BLOCK))[0])
        os.unlink(seq)
        res.update(self._load())
        res.update(self._ckpt())
        res.update(self._kv())
        return res

    def _tensors(self) -> dict[str, Any]:
        import torch

        n = max(1, self.size // (64 << 20))
        g = torch.Generator().manual_seed(0)
        return {f"layer.{i}.weight": torch.randn(4096, 8192, generator=g).bfloat16()
                for i in range(n)}

    def _load(self) -> dict[str, float]:
        from safetensors.torch import load_file as st_load
        from safetensors.torch import save_file

        from mxfs.load import load_file
        from mxfs.load.tensors import touch_pages

        tensors = self._tensors()
        path = os.path.join(self.work, "model.safetensors")
        save_file(tensors, path)
        nbytes = os.path.getsize(path)
        del tensors
        drop_caches()
        mx = _timed(lambda: touch_pages(load_file(path)))
        drop_caches()
        st = _timed(lambda: touch_pages(st_load(path)))
        os.unlink(path)
        return {"load_mxfs": self._gbps(mx, nbytes), "load_safetensors": self._gbps(st, nbytes)}

    def _ckpt(self) -> dict[str, float]:
        import torch

        import mxfs.ckpt as ck

        state = self._tensors()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        saver = ck.Checkpointer()
        path = os.path.join(self.work, "ck")
        mx = _timed(lambda: saver.save(state, path).wait())

        def torch_save() -> None:
            p = os.path.join(self.work, "ck.pt")
            torch.save(state, p)
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        ts = _timed(torch_save)
        saver.staging.release()
        shutil.rmtree(path, ignore_errors=True)
        return {"ckpt_mxfs": self._gbps(mx, nbytes), "ckpt_torch_save": self._gbps(ts, nbytes)}

    def _kv(self) -> dict[str, float]:
        from mxfs.kv import KVStore

        chunk, count = 16 << 20, max(4, self.size // (16 << 20))
        data = os.urandom(chunk)
        files = os.path.join(self.work, "kvfiles")
        os.makedirs(files)
        with KVStore(self.mnt, f"bench-{os.getpid()}") as kv:
            keys = [f"c{i}" for i in range(count)]
            for i in range(0, count, 8):
                kv.batch_put(keys[i:i + 8], [data] * len(keys[i:i + 8]))
            for i in range(count):
                with open(os.path.join(files, str(i)), "wb") as f:
                    f.write(data)
            outs = [bytearray(chunk) for _ in range(8)]
            drop_caches()
            mx = _timed(lambda: [kv.batch_get(keys[i:i + 8], outs[:len(keys[i:i + 8])])
                                 for i in range(0, count, 8)])
            drop_caches()

            def read_files() -> None:
                for i in range(count):
                    with open(os.path.join(files, str(i)), "rb", buffering=0) as f:
                        f.readinto(outs[0])

            fl = _timed(read_files)
            kv.clear()
        shutil.rmtree(files)
        return {"kv_get_mxfs": self._gbps(mx, chunk * count),
                "kv_get_files": self._gbps(fl, chunk * count)}


RATIOS = [("striped read / best member read", "striped_read", "best_member_read"),
          ("mount read / striped read", "mount_read", "striped_read"),
          ("mount write / striped write", "mount_write", "striped_write"),
          ("mxfs.load / safetensors", "load_mxfs", "load_safetensors"),
          ("mxfs.ckpt / torch.save (to durable)", "ckpt_mxfs", "ckpt_torch_save"),
          ("KV get / file per chunk", "kv_get_mxfs", "kv_get_files")]


def _ratios(med: dict[str, float]) -> list[tuple[str, float]]:
    med = dict(med)
    med["best_member_read"] = max(v for k, v in med.items()
                                  if k.startswith("member") and k.endswith("_read"))
    return [(name, med[a] / med[b]) for name, a, b in RATIOS]


def check_out(out: str, flag: str = "--out") -> None:
    """Refuse a report folder that could not be written, before minutes of measuring: a
    file of that name, or a missing one whose first existing parent is not a folder one
    may write in."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"{flag} {out} exists and is not a folder",
                         "name a new folder, or one to write the report into")
    there = os.path.abspath(out)
    while not os.path.lexists(there):  # (the folders to make: their first existing parent)
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise UsageError(f"{flag} {out}: {there} is not a folder", "name a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out}: {there} may not be written",
                         "name a folder you may write in")


def write_report(out: str, results: dict[str, Any]) -> None:
    """report.md, results.json and two plots into `out`: made whole in a private folder
    there and moved into place last, so a failure leaves no half-written report (nor
    half of an earlier one's files replaced), and no folder it made."""
    ratios = _ratios(results["median"])  # (a figure that cannot be divided fails here)
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".report-", dir=out)
    try:
        _write_report(work, results, ratios)
        for name in sorted(os.listdir(work), key=lambda n: n == "results.json"):
            os.replace(os.path.join(work, name), os.path.join(out, name))  # (the data last)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
    os.rmdir(work)


def _write_report(out: str, results: dict[str, Any], ratios: list[tuple[str, float]]) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    med = results["median"]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(results["time"]))
    lines = [f"# mxfs validation run, {when}", "",
             f"{results['members']} members, {format_size(results['bytes'])} per step, "
             f"median of {results['repeat']} rounds; GB/s.", "",
             "| step | GB/s |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in med.items()]
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {name} | {v:.2f} |" for name, v in ratios]
    lines += ["", "![bandwidth](bandwidth.png)", "", "![ratios](ratios.png)", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    _plots(out, med, ratios)


def _plots(out: str, med: dict[str, float], ratios: list[tuple[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    keys = list(med)
    ax.bar(range(len(keys)), [med[k] for k in keys], color="tab:blue")
    ax.set_xticks(range(len(keys)), keys, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("bandwidth per step (median)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bandwidth.png"), dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([n for n, _ in ratios], [v for _, v in ratios], color="tab:green")
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlabel("ratio (above 1: mxfs is faster, or striping adds bandwidth)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ratios.png"), dpi=100)
    plt.close(fig)


def run_bench(target: str | None, out: str, size: int, repeat: int,
              say: Callable[[str], None]) -> dict[str, Any]:
    """Measure the pool mounted at `target` (or a scratch demo pool) and write the report."""
    from mxfs.cli.demo import scratch_pool
    from mxfs.client.control import ControlClient, mount_root

    if os.geteuid() != 0:
        raise MxfsError("mxfs bench writes into the member folders and drops caches",
                        "run it as root")
    check_out(out)
    need_modules("mxfs bench run")
    if target is None:
        with scratch_pool("mxfs-bench-run-") as pool:
            say(f"scratch pool of 4 folder members in {pool.base}")
            results = Run(pool.mnt, pool.members, size, repeat).go(say)
    else:
        root = mount_root(target)
        if root is None:
            raise MxfsError(f"{target} is not an mxfs mount", "mount the pool first")
        with ControlClient(root) as c:
            members = [m["path"] for m in c.stat()["members"]]
        results = Run(root, members, size, repeat).go(say)
    write_report(out, results)
    return results


def need_modules(what: str) -> None:
    """Refuse a run before it starts when a module its steps import is missing (the
    model and checkpoint steps, the plots), not after the first minutes of it."""
    import importlib.util

    missing = [m for m in ("torch", "safetensors", "matplotlib")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise MxfsError(f"{what} needs {', '.join(missing)}, which this Python lacks",
                        "pip install torch==2.13.0 safetensors matplotlib")


def read_results(folder: str, named: str = "") -> dict[str, Any]:
    """The results.json that `mxfs bench run --out` wrote in `folder` (`named`: how the
    user gave it, for messages), checked to be one: a positive figure under "median"
    for every step the ratios divide (a file of another tool would fail far from here,
    with KeyError, TypeError or a division by zero)."""
    path = os.path.join(folder, "results.json")
    where = f"{named}: {path}" if named else path  # (--baseline's, say)
    fix = "give a folder written by mxfs bench run --out"
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise MxfsError(f"{named or folder} holds no readable results.json ({e.strerror})",
                        fix) from None
    except ValueError as e:
        raise MxfsError(f"{where} is not JSON ({e})", fix) from None
    med = doc.get("median") if isinstance(doc, dict) else None
    need = {k for _, a, b in RATIOS for k in (a, b)} - {"best_member_read"}
    if not isinstance(med, dict) or not need <= med.keys() or not any(
            k.startswith("member") and k.endswith("_read") for k in med) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0 for v in med.values()):
        raise MxfsError(f"{where} is not a bench results file (no positive figure for "
                        "each step under \"median\")", fix)
    return doc


def compare(a: str, b: str) -> str:
    """A Markdown table of two runs' medians and ratios, B against A."""
    ma, mb = read_results(a)["median"], read_results(b)["median"]
    lines = [f"| step | {a} | {b} | B / A |", "|---|---:|---:|---:|"]
    for k in ma:
        if k in mb:
            lines.append(f"| {k} | {ma[k]:.2f} | {mb[k]:.2f} | {mb[k] / ma[k]:.2f} |")
    ra, rb = dict(_ratios(ma)), dict(_ratios(mb))
    lines += ["", "| ratio | A | B |", "|---|---:|---:|"]
    lines += [f"| {n} | {ra[n]:.2f} | {rb[n]:.2f} |" for n in ra]
    return "\n".join(lines)

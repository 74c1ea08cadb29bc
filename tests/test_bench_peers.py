"""The checkpoint and KV benchmarks run with their peers, at a tiny size, as a user runs
them: every arm reports a figure and read back the bytes it stored.  Nothing here looks
at how fast an arm is.

Under the engines' virtualenv (MXFS_REQUIRE_ENGINES set) every engine arm must run;
elsewhere an engine that is not installed is reported as skipped, with the reason.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REQUIRE_ENGINES, needs_fuse

TOOLS = Path(__file__).resolve().parent.parent / "tools"

CKPT_ARMS = {"copy", "raw", "mxfs", "mxfs_overlap", "mxfs_after_staging", "mxfs_dcp",
             "mxfs_dcp_async", "torch_save_mount", "torch_save", "safetensors", "dcp_t1",
             "dcp_t2", "dcp_t4", "dcp_async_thread", "dcp_async_process"}
KV_COLUMNS = {"raw_write", "raw_read", "kv_put", "kv_get", "kv_batch_put", "kv_batch_get",
              "kv_get_4proc", "files_put", "files_get"}


def bench(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / "results.json"
    res = subprocess.run([sys.executable, str(TOOLS / script), *args, "--repeat", "1",
                          "--dir", str(tmp_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{script} failed ({res.returncode}):\n{res.stderr[-4000:]}"
    assert "| ratio |" in res.stdout  # the tables were printed
    return json.loads(out.read_text())


def figure(v: object) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


@needs_fuse
def test_bench_ckpt_runs_every_peer_and_loads_each_back_equal(tmp_path: Path) -> None:
    got = bench(tmp_path, "bench_ckpt.py", "--size", "4MiB")
    assert set(got["median"]) == CKPT_ARMS
    for arm, m in got["median"].items():
        assert figure(m["blocked"]) and figure(m["durable"]), (arm, m)
    assert got["equal"] == {a: True for a in CKPT_ARMS - {"copy", "raw"}}, got["differences"]
    assert set(got["ratios"]) == CKPT_ARMS - {"copy", "raw", "mxfs"}


@needs_fuse
def test_bench_kv_runs_every_engine_arm_or_says_why_not(tmp_path: Path) -> None:
    got = bench(tmp_path, "bench_kv.py", "--total", "4MiB", "--sizes", "1MiB", "--batch", "2",
                "--small", "50")
    assert got["failed"] == {}
    [round_] = got["rounds"]["1MiB"]
    assert set(round_) == KV_COLUMNS and all(figure(v) for v in round_.values()), round_
    [ops] = got["ops"]
    assert all(figure(v) for v in ops.values()), ops
    ran = got["engines"]["1MiB"]
    for arm in got["labels"]:
        if arm in got["skipped"]:
            assert got["skipped"][arm], arm  # a reason
            assert not REQUIRE_ENGINES, f"{arm} skipped: {got['skipped'][arm]}"
            continue
        [r] = ran[arm]
        for k in ("put", "put_sync", "get", "get_warm"):
            assert figure(r[k]), (arm, r)
        assert r["lookups"] is None if arm.startswith("vllm") else figure(r["lookups"]), (arm, r)
    for key, ratio in got["ratios"].items():
        assert figure(ratio["get"]), key


def test_bench_kv_skips_an_engine_it_cannot_import(tmp_path: Path) -> None:
    sys.path.insert(0, str(TOOLS))
    try:
        import peers_kv
    finally:
        sys.path.remove(str(TOOLS))
    arm = peers_kv.Arm("x", "X", "nothing", False, ("no_such_engine_module",),
                       lambda ctx: pytest.fail("made"))
    assert "no_such_engine_module does not import" in (arm.missing() or "")

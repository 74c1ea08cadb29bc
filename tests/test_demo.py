"""`mxfs demo`, the README's first command: the three jobs against their baselines, then
the FUSE figures; everything verified, nothing left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, mxfs

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")


def test_demo_runs_the_three_jobs_and_cleans_up(tmp_path: Path) -> None:
    scratch = tmp_path / "demo"
    out = json.loads(mxfs("demo", "--size", "64MiB", "--dir", str(scratch), "--json",
                          timeout=600).stdout)
    assert out["verified"] and not out["kept"]
    jobs = out["jobs"]
    assert jobs["model"]["bytes"] > 16 << 20
    assert all(jobs["model"][k] > 0 for k in ("mxfs_s", "safetensors_mount_s",
                                               "safetensors_plain_s"))
    ck = jobs["checkpoint"]
    assert 0 < ck["blocked_s"] <= ck["durable_s"] and ck["torch_save_s"] > 0
    kv = jobs["kv"]
    assert kv["gbps"] > 0 and kv["recompute_s"] > 0 and kv["load_s"] > 0
    assert [s["step"] for s in out["steps"]][0] == "write"
    assert not os.path.exists(scratch) or os.listdir(scratch) == []


def test_demo_text_shows_both_tables(tmp_path: Path) -> None:
    text = mxfs("demo", "--size", "64MiB", "--dir", str(tmp_path / "d"), timeout=600).stdout
    assert "what mxfs is for" in text and "torch.save" in text and "TTFT" in text
    assert "mxfs vs a plain folder" in text and "verified" in text

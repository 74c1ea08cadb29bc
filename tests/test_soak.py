"""The crash harness, for a minute: daemon and clients SIGKILLed, nothing fsynced lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CRASH, needs_fuse

TOOL = Path(__file__).resolve().parent.parent / "tools" / "soak.py"


@needs_fuse
@pytest.mark.daemon_log(CRASH, r"cut \d+ chunk files of unpublished files back",
                        r"uid 65534 wrote past the size it declared")
def test_crash_cycles_lose_nothing_fsynced_or_committed(tmp_path: Path) -> None:
    """With a hostile user (nobody) flooding the daemon meanwhile: its pool lives where
    nobody can reach it, not in pytest's private folder."""
    report = tmp_path / "soak.json"
    where = tempfile.mkdtemp(prefix="mxfs-soak-test-")
    os.chmod(where, 0o755)
    try:
        res = subprocess.run([sys.executable, str(TOOL), "--minutes", "0.45", "--crash-every",
                              "8", "--hostile", "--dir", where, "--json", str(report)],
                             capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(report.read_text())
    assert out["cycles"] >= 2 and out["file_checks"] > 100 and out["checkpoints_verified"] > 0
    assert out["lost"] == 0 and out["problems"] == 0 and out["errors"] == []
    assert out["hostile_rounds"] > 0  # the flooder did flood

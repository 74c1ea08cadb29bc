"""The crash harness, for a minute: daemon and clients SIGKILLed, nothing fsynced lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import needs_fuse

TOOL = Path(__file__).resolve().parent.parent / "tools" / "soak.py"


@needs_fuse
def test_crash_cycles_lose_nothing_fsynced_or_committed(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, str(TOOL), "--minutes", "0.6", "--crash-every", "10",
                          "--dir", str(tmp_path), "--json", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(report.read_text())
    assert out["cycles"] >= 2 and out["file_checks"] > 100 and out["checkpoints_verified"] > 0
    assert out["lost"] == 0 and out["problems"] == 0 and out["errors"] == []

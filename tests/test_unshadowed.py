"""Processes mxfs starts are its own: a folder named `mxfs` where the user stands does not
replace the package, and a daemon that dies at start says why."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, force_unmount, is_mounted, make_members, mkfs, one_line_error

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")
MXFS = str(Path(sys.executable).with_name("mxfs"))  # the console script a user runs


def decoy(folder: Path, module: str, message: str) -> None:
    """A module named `module` in `folder` that fails loudly when imported."""
    pkg = folder / module
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise RuntimeError({message!r})\n")


def test_mount_from_a_folder_holding_an_mxfs_folder(tmp_path: Path) -> None:
    members = make_members(tmp_path / "pool")
    mkfs(members)
    here = tmp_path / "clone"
    here.mkdir()
    decoy(here, "mxfs", "the decoy mxfs was imported")
    mp = Path(tempfile.mkdtemp(prefix="mxfs-shadow-"))
    try:
        res = subprocess.run([MXFS, "mount", os.path.relpath(members[0], here),
                              os.path.relpath(mp, here)], cwd=here, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert is_mounted(str(mp))
        (mp / "f").write_bytes(b"x")
        # A trainer running here whose checkpoints are written by the worker process.
        trainer = (f"import torch; from mxfs.ckpt.snapshot import Checkpointer\n"
                   f"c = Checkpointer(writer='process')\n"
                   f"c.save({{'w': torch.ones(4)}}, {str(mp / 'ck')!r}).wait(); c.close()\n")
        res = subprocess.run([sys.executable, "-P", "-c", trainer], cwd=here,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        import mxfs.ckpt

        assert mxfs.ckpt.load(str(mp / "ck"))["w"].tolist() == [1.0] * 4
    finally:
        force_unmount(str(mp))
        os.rmdir(mp)


def test_a_daemon_that_dies_at_start_says_why(tmp_path: Path) -> None:
    members = make_members(tmp_path / "pool")
    mkfs(members)
    broken = tmp_path / "broken"
    broken.mkdir()
    decoy(broken, "pyfuse3", "pyfuse3 is broken on this node")  # only the daemon imports it
    mp = Path(tempfile.mkdtemp(prefix="mxfs-dies-"))
    try:
        res = subprocess.run([MXFS, "mount", members[0], str(mp)], capture_output=True,
                             text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(broken)})
        line = one_line_error(res)
        assert "the daemon exited with code" in line and "pyfuse3 is broken on this node" in line
        assert not is_mounted(str(mp))
    finally:
        force_unmount(str(mp))
        os.rmdir(mp)

"""Mode "auto" maps a CPU load only where nobody but the caller (or root) can change
or end the file: another user's write would show in the tensors, and a cut of its
chunk files (a truncate, a removal, a chmod taking reading away) raises SIGBUS at
the next touch, killing the loading process."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Mounted
from safetensors.torch import save_file
from users import ensure_users

from mxfs.client.writer import create_file
from mxfs.load import load_file
from mxfs.load.options import LoadReport

TENSORS = {"w": torch.arange(1 << 18, dtype=torch.int32)}  # 1 MiB: many stripes


def mode_of(path: Path, mode: str = "auto") -> str:
    """The mode a CPU load of `path` took (its tensors checked)."""
    report = LoadReport()
    got = load_file(str(path), mode=mode, report=report)
    assert torch.equal(got["w"], TENSORS["w"])
    return report.files[-1].mode


def sealed_copy(src: Path, dst: Path) -> None:
    """`src`'s bytes published at `dst` by a direct commit (sealed: no writes in place)."""
    data = src.read_bytes()
    buf = mmap.mmap(-1, -(-len(data) // 4096) * 4096)
    buf[:len(data)] = data
    with create_file(str(dst), len(data)) as w:
        w.write_at(0, memoryview(buf), valid=len(data))
        w.commit(len(data))


def test_auto_maps_only_a_file_no_one_else_can_change_or_end(mounted: Mounted,
                                                             plain: Path) -> None:
    alice = ensure_users()["alice"]
    os.chmod(mounted.path, 0o755)
    folder = mounted.path / "models"
    folder.mkdir(mode=0o755)
    mine = folder / "mine.safetensors"
    save_file(TENSORS, str(mine))
    os.chmod(mine, 0o644)
    sealed = folder / "sealed.safetensors"
    sealed_copy(mine, sealed)
    os.chmod(sealed, 0o666)  # (sealed: nobody writes it whatever its mode)
    theirs = folder / "theirs.safetensors"
    save_file(TENSORS, str(theirs))
    os.chown(theirs, alice.uid, alice.gid)
    open_to_all = folder / "open.safetensors"
    save_file(TENSORS, str(open_to_all))
    os.chmod(open_to_all, 0o666)
    assert mode_of(mine) == mode_of(sealed) == "map"
    assert mode_of(theirs) == mode_of(open_to_all) == "read"  # (chmod, rm; a write)
    cases: list[tuple[Callable[[], None], str]] = [
        (lambda: os.chmod(folder, 0o777), "read"),  # anyone may remove or replace it
        (lambda: os.chmod(folder, 0o1777), "map"),  # sticky: only its owner (or root)
        (lambda: os.chown(folder, alice.uid, -1), "read"),  # the folder's owner may
    ]
    for change, want in cases:
        change()
        assert mode_of(mine) == want
    assert mode_of(mine, "map") == "map"  # asked for: the caller's choice
    plain_file = plain / "m.safetensors"
    save_file(TENSORS, str(plain_file))
    assert mode_of(plain_file) == "map"
    os.chmod(plain, 0o777)
    assert mode_of(plain_file) == "read"


VICTIM = r"""
import sys
from mxfs.load import load_file
t = load_file(sys.argv[1])["w"]
print("loaded", flush=True)
sys.stdin.readline()
print(int(t.sum()), flush=True)
"""


@pytest.mark.parametrize("cut", ["truncate", "write"])
def test_a_load_from_a_shared_folder_survives_another_users_cut_or_write(
        mounted: Mounted, cut: str) -> None:
    """Loaded in "auto" from a folder anyone may write, the tensors keep their bytes
    after the file is cut or written in place (mapped, the truncate killed the
    loader with SIGBUS and the write showed in its tensors)."""
    os.chmod(mounted.path, 0o755)
    folder = mounted.path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    path = folder / "m.safetensors"
    save_file(TENSORS, str(path))
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert victim.stdin is not None and victim.stdout is not None
    try:
        assert victim.stdout.readline().strip() == "loaded"
        if cut == "truncate":
            os.truncate(path, 0)
        else:
            with path.open("r+b") as f:
                f.seek(os.path.getsize(path) - (1 << 19))
                f.write(b"\xff" * (1 << 19))
        victim.stdin.write("\n")
        victim.stdin.flush()
        out = victim.stdout.readline().strip()
    finally:
        victim.stdin.close()
        rc = victim.wait(timeout=60)
    assert rc == 0 and out == str(int(TENSORS["w"].sum()))

"""Offline writers hold the pool lock for their whole run, taken before they read anything.

Each tool runs as the real CLI in a subprocess that stops itself (SIGSTOP) the moment
it holds the lock, so the test sees it mid-run for certain, not by timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Mounted, eventually, is_mounted, mxfs, one_line_error

# The CLI, with take_pool_lock wrapped: once the lock is held, the process stops itself.
HELD = """
import os, signal, sys
import mxfs.vol.volume as v
import mxfs.pool.lock as lk
take = lk.take_pool_lock
def take_and_stop(*a, **k):
    fd = take(*a, **k)
    os.kill(os.getpid(), signal.SIGSTOP)
    return fd
lk.take_pool_lock = v.take_pool_lock = take_and_stop
from mxfs.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _start_held(*args: str) -> subprocess.Popen:
    """The CLI running `args`, stopped while it holds the pool lock."""
    proc = subprocess.Popen([sys.executable, "-c", HELD, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert eventually(lambda: proc.poll() is not None or _state(proc.pid) == "T")
    assert proc.poll() is None, proc.communicate()
    return proc


def _lock_info(member: str) -> dict:
    return json.loads((Path(member) / "meta" / "daemon.lock").read_text())


def _open_files(pid: int) -> set[str]:
    fds = f"/proc/{pid}/fd"
    return {os.readlink(os.path.join(fds, n)) for n in os.listdir(fds)}


@pytest.fixture
def unmounted(mounted: Mounted, tmp_path: Path) -> tuple[Mounted, Path, Path]:
    """A pool with /kept (in the dump) and /later (not), unmounted; the dump; a file to put."""
    (mounted.path / "kept").write_bytes(b"k" * 200_000)
    dump = tmp_path / "meta.sql"
    mxfs("meta", "dump", str(dump), str(mounted.path))
    (mounted.path / "later").write_bytes(b"l" * 200_000)
    mounted.umount()
    src = tmp_path / "put.bin"
    src.write_bytes(os.urandom(300_000))
    return mounted, dump, src


@pytest.mark.parametrize("tool", ["mxfs meta restore", "mxfs fsck --repair", "mxfs put"])
def test_a_mount_is_refused_while_an_offline_writer_runs(
        unmounted: tuple[Mounted, Path, Path], tool: str) -> None:
    m, dump, src = unmounted
    member = m.members[0]
    args = {"mxfs meta restore": ["meta", "restore", str(dump), member],
            "mxfs fsck --repair": ["fsck", "--repair", member],
            "mxfs put": ["put", member, str(src), "--to", "/"]}[tool]
    proc = _start_held(*args)
    try:
        assert _lock_info(member) == {"pid": proc.pid, "tool": tool, "mountpoint": None,
                                      "socket": None}
        # held before reading anything: neither the store nor the dump is open yet
        opened = _open_files(proc.pid)
        assert not any("mxfs.db" in p or p == str(dump) for p in opened), opened
        assert not (Path(member) / "meta" / "restore.db").exists()
        line = one_line_error(mxfs("mount", member, str(m.path), check=False))
        assert f"in use by {tool} (pid {proc.pid})" in line
        assert not is_mounted(str(m.path))
        line = one_line_error(mxfs("fsck", member, check=False))  # nor another tool
        assert f"in use by {tool} (pid {proc.pid})" in line
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert (Path(member) / "meta" / "daemon.lock").read_text().strip() == ""  # (blank: block kept)
    m.remount()
    assert (m.path / "kept").read_bytes() == b"k" * 200_000
    assert (m.path / "later").exists() == (tool != "mxfs meta restore")
    if tool == "mxfs put":
        assert (m.path / "put.bin").read_bytes() == src.read_bytes()
    m.umount()
    assert mxfs("fsck", member).stdout.strip() == "clean"


def test_restore_works_when_the_store_is_missing(
        unmounted: tuple[Mounted, Path, Path]) -> None:
    m, dump, _ = unmounted
    meta = Path(m.members[0]) / "meta"
    for name in ("mxfs.db", "mxfs.db-wal", "mxfs.db-shm"):
        (meta / name).unlink(missing_ok=True)
    mxfs("meta", "restore", str(dump), m.members[0])
    m.remount()
    assert sorted(os.listdir(m.path)) == ["kept"]


def test_a_tool_is_refused_naming_the_mount(mounted: Mounted, tmp_path: Path) -> None:
    src = tmp_path / "x.bin"
    src.write_bytes(b"x")
    pid = mounted.daemon_pid()
    for args in (["put", mounted.members[0], str(src), "--to", "/"],
                 ["fsck", "--repair", mounted.members[0]],
                 ["meta", "restore", str(src), mounted.members[0]]):
        line = one_line_error(mxfs(*args, check=False))
        assert f"is mounted at {mounted.path} (pid {pid})" in line and "umount" in line

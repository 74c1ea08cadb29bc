"""Fixtures: real pools of folder members, really mounted through FUSE."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

HAVE_FUSE = os.geteuid() == 0 and os.path.exists("/dev/fuse")
needs_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")
# Set by `make test-engines`: there an engine that does not import is a failure, not a skip.
REQUIRE_ENGINES = bool(os.environ.get("MXFS_REQUIRE_ENGINES"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if REQUIRE_ENGINES and report.skipped and call.excinfo is not None \
            and "could not import" in str(call.excinfo.value):
        report.outcome = "failed"
        report.longrepr = f"MXFS_REQUIRE_ENGINES is set, but {call.excinfo.value}"


def mxfs(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    res = subprocess.run([sys.executable, "-m", "mxfs", *args], capture_output=True, text=True,
                         timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"mxfs {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


def one_line_error(res: subprocess.CompletedProcess) -> str:
    """Assert a user error: non-zero exit, one line on stderr, no traceback."""
    assert res.returncode != 0, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def eventually(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll until `predicate` holds; FUSE sends RELEASE after close() has returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def make_members(root: Path, n: int = 4) -> list[str]:
    paths = []
    for i in range(n):
        p = root / f"member{i}"
        p.mkdir(parents=True)
        paths.append(str(p))
    return paths


def mkfs(members: list[str], unit: str = "64KiB", *extra: str) -> None:
    args = ["mkfs", "--stripe-unit", unit]
    for m in members:
        args += ["--member", m]
    mxfs(*args, *extra)


def is_mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@dataclass
class Mounted:
    path: Path
    members: list[str]
    pid: int = 0

    def daemon_pid(self) -> int:
        from mxfs.client import ControlClient

        with ControlClient(str(self.path)) as c:
            return int(c.server["pid"])

    def umount(self) -> None:
        mxfs("umount", str(self.path))

    def remount(self) -> None:
        mxfs("mount", "-o", "allow_other", self.members[0], str(self.path))


def raw_socket(m: Mounted, timeout: float = 30) -> socket.socket:
    """A bare connection to the mount's control socket, to send what no client would."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(os.getxattr(m.path, "user.mxfs.control").decode())
    return s


def force_unmount(path: str) -> None:
    if is_mounted(path):
        mxfs("umount", path, check=False)
    if is_mounted(path):
        subprocess.run(["umount", "-l", path], capture_output=True)


@contextmanager
def mounted_pool(members: list[str], *options: str) -> Iterator[Mounted]:
    """The pool on `members` mounted (allow_other, and `options`) on a fresh folder under
    /tmp itself, not pytest's private folder, so other users can reach it; unmounted
    after."""
    mp = Path(tempfile.mkdtemp(prefix="mxfs-mnt-"))
    os.chmod(mp, 0o755)
    mxfs("mount", "-o", ",".join(["allow_other", *options]), members[0], str(mp))
    try:
        yield Mounted(mp, members)
    finally:
        force_unmount(str(mp))
        os.rmdir(mp)


@contextmanager
def module_pool(factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """A pool of four folder members mounted (allow_other) for a module's tests."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    members = make_members(factory.mktemp("pool"))
    mkfs(members)
    with mounted_pool(members) as m:
        yield m


@pytest.fixture
def members(tmp_path: Path) -> list[str]:
    return make_members(tmp_path)


@pytest.fixture
def mounted(tmp_path: Path, members: list[str]) -> Iterator[Mounted]:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members)
    with mounted_pool(members) as m:
        yield m


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    p = tmp_path / "plain"
    p.mkdir()
    return p


@pytest.fixture
def loop_members(tmp_path: Path) -> Iterator[list[str]]:
    """Four members on small ext4 images, member 2 much smaller than the others."""
    if not HAVE_FUSE:
        pytest.skip("needs root")
    members, mounted = [], []
    try:
        for i, mib in enumerate([64, 64, 24, 64]):
            img = tmp_path / f"m{i}.img"
            with open(img, "wb") as f:
                f.truncate(mib << 20)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True,
                           capture_output=True)
            d = tmp_path / f"member{i}"
            d.mkdir()
            res = subprocess.run(["mount", "-o", "loop", str(img), str(d)], capture_output=True)
            if res.returncode:
                pytest.skip(f"loop mounts unavailable: {res.stderr.decode().strip()}")
            mounted.append(str(d))
            members.append(str(d))
        yield members
    finally:
        for d in reversed(mounted):
            subprocess.run(["umount", "-l", d], capture_output=True)


@pytest.fixture
def loop_pool(loop_members: list[str]) -> Iterator[Mounted]:
    """A pool of the loop-device members, mounted; unmounted and removed afterwards."""
    mkfs(loop_members)
    mp = Path(tempfile.mkdtemp(prefix="mxfs-loop-"))
    mxfs("mount", loop_members[0], str(mp))
    try:
        yield Mounted(mp, loop_members)
    finally:
        force_unmount(str(mp))
        os.rmdir(mp)

"""Random operation sequences give the same results on the mount as on a plain folder."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import HAVE_FUSE, force_unmount, make_members, mkfs, mxfs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

NAMES = st.sampled_from(["a", "b", "c", "d/a", "d/b", "d/e/x", "e", "d"])
UNIT = 64 * 1024
ROOTS: dict[str, Path] = {}


def outcome(fn: Callable[[Path], Any], root: Path) -> Any:
    try:
        return ("ok", fn(root))
    except OSError as e:
        return ("err", e.errno)


def snapshot(root: Path) -> dict[str, Any]:
    """Everything a user could observe, except times and block counts."""
    seen: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st_ = os.lstat(p)
            if stat.S_ISLNK(st_.st_mode):
                seen[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st_.st_mode):
                seen[rel] = ("dir", sorted(os.listdir(p)), st_.st_nlink,
                             stat.S_IMODE(st_.st_mode))
            else:
                seen[rel] = ("file", st_.st_size, st_.st_nlink, stat.S_IMODE(st_.st_mode),
                             p.read_bytes())
    return seen


class SameAsPlainFolder(RuleBasedStateMachine):
    @initialize()
    def clean(self) -> None:
        for root in ROOTS.values():
            for entry in os.listdir(root):
                p = root / entry
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()

    def both(self, fn: Callable[[Path], Any]) -> None:
        a, b = (outcome(fn, ROOTS[k]) for k in ("mxfs", "plain"))
        assert a == b

    @rule(name=NAMES, offset=st.integers(0, 3 * UNIT), size=st.integers(0, 2 * UNIT + 7),
          seed=st.integers(0, 255))
    def write(self, name: str, offset: int, size: int, seed: int) -> None:
        data = bytes((seed + i) % 251 for i in range(size))

        def op(root: Path) -> int:
            fd = os.open(root / name, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                return os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        self.both(op)

    @rule(name=NAMES, data=st.binary(max_size=300))
    def append(self, name: str, data: bytes) -> None:
        def op(root: Path) -> int:
            fd = os.open(root / name, os.O_WRONLY | os.O_APPEND)
            try:
                return os.write(fd, data)
            finally:
                os.close(fd)
        self.both(op)

    @rule(name=NAMES, size=st.integers(0, 4 * UNIT))
    def truncate(self, name: str, size: int) -> None:
        self.both(lambda r: os.truncate(r / name, size))

    @rule(name=NAMES)
    def open_trunc(self, name: str) -> None:
        self.both(lambda r: os.close(os.open(r / name, os.O_WRONLY | os.O_TRUNC)))

    @rule(name=NAMES)
    def create_excl(self, name: str) -> None:
        self.both(lambda r: os.close(os.open(r / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)))

    @rule(name=NAMES, offset=st.integers(0, 4 * UNIT), size=st.integers(0, 2 * UNIT))
    def read(self, name: str, offset: int, size: int) -> None:
        def op(root: Path) -> bytes:
            fd = os.open(root / name, os.O_RDONLY)
            try:
                return os.pread(fd, size, offset)
            finally:
                os.close(fd)
        self.both(op)

    @rule(name=NAMES)
    def mkdir(self, name: str) -> None:
        self.both(lambda r: os.mkdir(r / name))

    @rule(name=NAMES)
    def rmdir(self, name: str) -> None:
        self.both(lambda r: os.rmdir(r / name))

    @rule(name=NAMES)
    def unlink(self, name: str) -> None:
        self.both(lambda r: os.unlink(r / name))

    @rule(src=NAMES, dst=NAMES)
    def rename(self, src: str, dst: str) -> None:
        self.both(lambda r: os.rename(r / src, r / dst))

    @rule(src=NAMES, dst=NAMES)
    def link(self, src: str, dst: str) -> None:
        self.both(lambda r: os.link(r / src, r / dst))

    @rule(name=NAMES, dest=st.sampled_from(["a", "../b", "d/e", "nowhere"]))
    def symlink(self, name: str, dest: str) -> None:
        self.both(lambda r: os.symlink(dest, r / name))

    @rule(name=NAMES, mode=st.sampled_from([0o600, 0o644, 0o755, 0o700]))
    def chmod(self, name: str, mode: int) -> None:
        self.both(lambda r: os.chmod(r / name, mode, follow_symlinks=False)
                  if not (r / name).is_symlink() else None)

    @rule(name=NAMES)
    def listdir(self, name: str) -> None:
        self.both(lambda r: sorted(os.listdir(r / name)))

    @rule(name=NAMES)
    def stat_size(self, name: str) -> None:
        self.both(lambda r: os.stat(r / name).st_size)

    @invariant()
    def same_tree(self) -> None:
        if ROOTS:
            assert snapshot(ROOTS["mxfs"]) == snapshot(ROOTS["plain"])


@contextmanager
def _roots(*mkfs_args: str) -> Iterator[None]:
    """A pool mounted beside a plain folder: the roots the machine compares."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    base = Path(tempfile.mkdtemp(prefix="mxfs-diff-"))
    members = make_members(base)
    mkfs(members, "64KiB", *mkfs_args)
    mp = base / "mnt"
    mp.mkdir()
    (base / "plain").mkdir()
    mxfs("mount", members[0], str(mp))
    ROOTS.update(mxfs=mp, plain=base / "plain")
    try:
        yield
    finally:
        ROOTS.clear()
        force_unmount(str(mp))
        shutil.rmtree(base, ignore_errors=True)


SameAsPlainFolder.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def roots() -> Iterator[None]:
    with _roots():
        yield


@pytest.fixture(scope="module")
def roots_on_postgres(pg_cluster: Any) -> Iterator[None]:
    with _roots("--meta", pg_cluster.database()):
        yield


@pytest.mark.usefixtures("roots")
class TestDifferential(SameAsPlainFolder.TestCase):
    pass


@pytest.mark.pg
@pytest.mark.usefixtures("roots_on_postgres")
class TestDifferentialOnPostgres(SameAsPlainFolder.TestCase):
    """The same machine on a pool whose metadata is on a PostgreSQL server."""

    settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                        suppress_health_check=list(HealthCheck))

"""Real programs through the mount: cp -a, tar, rsync, git, tempfile, shutil, torch."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import Mounted


def make_tree(root: Path) -> None:
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "small.txt").write_text("hello\n")
    (root / "dir" / "sub" / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (root / "dir" / "empty").write_bytes(b"")
    os.symlink("small.txt", root / "dir" / "link")
    os.link(root / "dir" / "small.txt", root / "dir" / "hard")
    os.chmod(root / "dir" / "sub" / "big.bin", 0o640)
    os.setxattr(root / "dir" / "small.txt", "user.tag", b"v1")
    os.utime(root / "dir" / "small.txt", ns=(1_600_000_000_000_000_000,) * 2)


def same_trees(a: Path, b: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(a):
        rel = Path(dirpath).relative_to(a)
        other = b / rel
        assert sorted(os.listdir(other)) == sorted(dirnames + filenames)
        for name in filenames:
            pa, pb = Path(dirpath) / name, other / name
            if pa.is_symlink():
                assert os.readlink(pa) == os.readlink(pb)
            else:
                assert filecmp.cmp(pa, pb, shallow=False), pa


def run(*cmd: str, cwd: Path | None = None) -> str:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert res.returncode == 0, f"{cmd}: {res.stderr}"
    return res.stdout


def test_cp_a_preserves_modes_links_times_xattrs(mounted: Mounted, plain: Path) -> None:
    make_tree(plain)
    run("cp", "-a", str(plain / "dir"), str(mounted.path / "copy"))
    same_trees(plain / "dir", mounted.path / "copy")
    c = mounted.path / "copy"
    assert os.stat(c / "sub" / "big.bin").st_mode & 0o777 == 0o640
    assert os.stat(c / "small.txt").st_mtime_ns == 1_600_000_000_000_000_000
    assert os.stat(c / "small.txt").st_ino == os.stat(c / "hard").st_ino
    assert os.getxattr(c / "small.txt", "user.tag") == b"v1"
    # and back out again
    run("cp", "-a", str(c), str(plain / "back"))
    same_trees(c, plain / "back")


def test_tar_round_trip(mounted: Mounted, plain: Path) -> None:
    make_tree(plain)
    run("tar", "-cf", str(mounted.path / "a.tar"), "-C", str(plain), "dir")
    (mounted.path / "x").mkdir()
    run("tar", "-xf", str(mounted.path / "a.tar"), "-C", str(mounted.path / "x"))
    same_trees(plain / "dir", mounted.path / "x" / "dir")


def test_rsync_archive_and_update(mounted: Mounted, plain: Path) -> None:
    if not shutil.which("rsync"):
        pytest.skip("rsync is not installed")
    make_tree(plain)
    run("rsync", "-aHX", str(plain / "dir") + "/", str(mounted.path / "r") + "/")
    same_trees(plain / "dir", mounted.path / "r")
    (plain / "dir" / "small.txt").write_text("changed\n")
    run("rsync", "-aHX", "--delete", str(plain / "dir") + "/", str(mounted.path / "r") + "/")
    assert (mounted.path / "r" / "small.txt").read_text() == "changed\n"
    out = run("rsync", "-aHXn", "--itemize-changes", str(plain / "dir") + "/",
              str(mounted.path / "r") + "/")
    assert out.strip() == ""


def test_git_init_commit_log(mounted: Mounted) -> None:
    repo = mounted.path / "repo"
    repo.mkdir()
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "HOME": str(repo), "PATH": os.environ["PATH"]}

    def git(*args: str) -> str:
        res = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=env)
        assert res.returncode == 0, res.stderr
        return res.stdout

    git("init", "-q")
    for i in range(20):
        (repo / f"f{i}.py").write_text(f"x = {i}\n" * 100)
    git("add", ".")
    git("commit", "-qm", "first")
    (repo / "f3.py").write_text("changed\n")
    git("commit", "-qam", "second")
    assert git("log", "--oneline").count("\n") == 2
    git("gc", "-q")
    assert git("fsck", "--strict") == ""
    assert git("status", "--porcelain") == ""


def test_tempfile_and_shutil(mounted: Mounted) -> None:
    with tempfile.TemporaryDirectory(dir=mounted.path) as d:
        with tempfile.NamedTemporaryFile(dir=d, delete=False) as f:
            f.write(b"x" * 100_000)
        shutil.copy2(f.name, Path(d) / "copy")
        shutil.move(Path(d) / "copy", Path(d) / "moved")
        assert (Path(d) / "moved").read_bytes() == b"x" * 100_000
        shutil.copytree(d, mounted.path / "tree")
        with tempfile.SpooledTemporaryFile(max_size=10, dir=d) as s:
            s.write(b"y" * 100)
            s.seek(0)
            assert s.read() == b"y" * 100
    assert sorted(os.listdir(mounted.path)) == ["tree"]
    shutil.rmtree(mounted.path / "tree")
    assert os.listdir(mounted.path) == []


def test_torch_save_and_load(mounted: Mounted) -> None:
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(512, 1024), "b": torch.arange(1000, dtype=torch.bfloat16),
             "step": 7, "nested": {"m": torch.ones(3, 3, dtype=torch.int8)}}
    path = mounted.path / "ckpt.pt"
    torch.save(state, path)
    back = torch.load(path)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert back["step"] == 7 and torch.equal(back["nested"]["m"], state["nested"]["m"])
    mm = torch.load(path, mmap=True)
    assert torch.equal(mm["w"], state["w"])


def test_safetensors_round_trip(mounted: Mounted) -> None:
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    tensors = {f"layer{i}.weight": torch.randn(256, 256) for i in range(8)}
    path = str(mounted.path / "model.safetensors")
    st.save_file(tensors, path)
    back = st.load_file(path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())

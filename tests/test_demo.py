"""`mxfs demo`, the README's first command: the three jobs against their baselines, then
the FUSE figures; everything verified, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, mxfs, one_line_error
from users import ensure_users, run_as

from mxfs.cli.measure import read_file, write_file

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")


def test_demo_runs_the_three_jobs_and_cleans_up(tmp_path: Path) -> None:
    """--dir names where the scratch goes: a folder already there keeps what it held
    (it once was the scratch, all of it removed after)."""
    scratch = tmp_path / "demo"
    scratch.mkdir()
    (scratch / "theirs.txt").write_text("not the demo's\n")
    os.chown(scratch / "theirs.txt", ensure_users()["alice"].uid, -1)
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
    # The reuse policy reads only what is faster to read than to compute: never slower
    # than recomputing, and all of the prefix where reading it all wins.
    assert kv["policy_s"] <= kv["recompute_s"] * (1 + 1e-9)
    assert kv["policy_s"] <= kv["load_s"] * (1 + 1e-9) or kv["policy_chunks"] < kv["chunks"]
    assert [s["step"] for s in out["steps"]][0] == "write"
    assert os.listdir(scratch) == ["theirs.txt"]
    assert (scratch / "theirs.txt").read_text() == "not the demo's\n"
    assert os.path.dirname(out["scratch"]) == str(scratch)  # (made there, removed after)


def test_demo_refuses_a_dir_another_user_could_change() -> None:
    """A tenant's folder made in /tmp (sticky, so hers to rename in) let her swap what
    root's demo made there for links to root's files, which the demo then wrote; a
    folder anyone may write without the sticky bit is as bad."""
    shared = Path(tempfile.mkdtemp(prefix="mxfs-demo-shared-"))  # (reachable by alice)
    try:
        shared.chmod(0o1777)
        assert run_as(ensure_users()["alice"], "os.mkdir(sys.argv[1]); print('1')",
                      str(shared / "hers")) == 1
        loose = shared / "loose"
        loose.mkdir()
        loose.chmod(0o777)
        for where, owner in ((shared / "hers", shared / "hers"), (loose, loose)):
            line = one_line_error(mxfs("demo", "--size", "64MiB", "--dir", str(where),
                                       check=False, timeout=600))
            assert f"{owner} may be changed by another user" in line, line
            assert os.listdir(where) == []  # nothing made there
    finally:
        shutil.rmtree(shared)


def test_bench_files_are_never_written_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    (tmp_path / "file0.bin").symlink_to(victim)
    _, digest = write_file(str(tmp_path / "file0.bin"), 8192, memoryview(bytes(4096)))
    assert victim.read_text() == "root's own\n"
    assert not (tmp_path / "file0.bin").is_symlink()
    assert read_file(str(tmp_path / "file0.bin"), bytearray(4096))[1:] == (digest, 8192)


def test_demo_text_shows_both_tables(tmp_path: Path) -> None:
    text = mxfs("demo", "--size", "64MiB", "--dir", str(tmp_path / "d"), timeout=600).stdout
    assert "what mxfs is for" in text and "torch.save" in text and "TTFT" in text
    assert "mxfs vs a plain folder" in text and "verified" in text
    assert "as the reuse policy reads it" in text


def test_every_row_where_mxfs_is_behind_says_why() -> None:
    from mxfs.cli.demo import BEHIND_WHY
    from mxfs.cli.demo_jobs import behind_why

    model = {"mxfs_s": 1.0, "safetensors_mount_s": 0.9, "safetensors_plain_s": 1.2}
    ckpt = {"durable_s": 1.0, "torch_save_s": 0.8, "blocked_s": 0.1}
    kv = {"recompute_s": 3.0, "load_s": 4.0, "break_even_gbps": 1.4, "gbps": 1.1}
    said = behind_why(model, ckpt, kv)
    assert [line.split(":")[0] for line in said] == [
        "load, cold", "until durable", "reading the whole prefix"]
    assert "0.90x" in said[0] and "0.80x" in said[1] and "1.4 GB/s" in said[2]
    ahead = behind_why({**model, "safetensors_mount_s": 1.1}, {**ckpt, "torch_save_s": 2.0},
                       {**kv, "load_s": 2.0})
    assert ahead == []
    assert set(BEHIND_WHY) == {"write", "read (cold)", "re-read (warm)"}

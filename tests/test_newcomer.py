"""What a newcomer meets first: the CLI's edges, the install, the README's examples.

Each wrong step gets one line naming the problem and the fix, and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    HAVE_FUSE,
    Mounted,
    make_members,
    mkfs,
    mounted_pool,
    mxfs,
    one_line_error,
)

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")


def test_setstripe_refuses_a_unit_of_nothing(pool: Mounted) -> None:
    folder = pool.path / "striped"
    folder.mkdir()
    before = mxfs("getstripe", "--json", str(folder)).stdout
    for unit in ("0", "0KiB"):
        res = mxfs("setstripe", "--unit", unit, str(folder), check=False)
        assert res.returncode != 0 and "--unit" in one_line_error(res)
    with pytest.raises(OSError):  # the same through the xattr itself
        os.setxattr(folder, "user.mxfs.layout", b"stripe_unit=0")
    assert mxfs("getstripe", "--json", str(folder)).stdout == before


def test_ckpt_verify_and_load_of_a_file_say_it_is_no_checkpoint(pool: Mounted) -> None:
    import mxfs.ckpt as ck
    from mxfs.ckpt.catalog import CheckpointError

    plain = pool.path / "not-a-checkpoint"
    plain.write_bytes(b"x")
    res = mxfs("ckpt", "verify", str(plain), check=False)
    assert res.returncode != 0 and "is a file, not a checkpoint" in one_line_error(res)
    with pytest.raises(CheckpointError, match="is a file"):
        ck.load(str(plain))


def test_ckpt_json_before_the_verb_is_json(pool: Mounted) -> None:
    import torch

    import mxfs.ckpt as ck

    folder = pool.path / "ckpts"
    folder.mkdir()
    ck.save({"w": torch.ones(4)}, str(folder / "step-1")).wait()
    for args in (("ckpt", "--json", "ls", str(folder)), ("ckpt", "ls", "--json", str(folder))):
        out = json.loads(mxfs(*args).stdout)
        assert [c["name"] for c in out["checkpoints"]] == ["step-1"]


def test_put_into_a_folder_the_pool_does_not_have_yet_makes_it(tmp_path: Path) -> None:
    """The README's `mxfs put POOL FILE --to /llama` on a fresh pool."""
    members = make_members(tmp_path / "pool")
    mkfs(members)
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(100_000))
    mxfs("put", members[0], str(src), "--to", "/llama/v1")
    with mounted_pool(members) as m:
        assert (m.path / "llama" / "v1" / "model.bin").read_bytes() == src.read_bytes()
        assert (m.path / "llama").stat().st_mode & 0o777 == 0o755


def test_the_folder_holding_the_clone_does_not_shadow_the_package(tmp_path: Path) -> None:
    """`git clone` names the checkout mxfs; a script run beside it imports the package,
    not the checkout's root as a namespace package (install.sh puts it on the path)."""
    (tmp_path / "mxfs" / "docs").mkdir(parents=True)  # a clone's root: no __init__.py
    res = subprocess.run([sys.executable, "-c", "import mxfs; print(mxfs.__version__)"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_a_wrong_mount_option_is_named_with_its_fix(pool: Mounted, tmp_path: Path) -> None:
    (target := tmp_path / "mnt").mkdir()
    for opt, said in (("bogus_opt", "unknown mount option 'bogus_opt'"),
                      ("allow_otter", "did you mean allow_other?"),
                      ("io_threads=abc", "io_threads takes a whole number"),
                      ("readahead=", "readahead takes a whole number"),
                      ("max_conns=0", "max_conns takes a whole number from 1"),
                      ("wake_latency_us=-5", "wake_latency_us takes a whole number from 0"),
                      ("degraded=1", "takes no value")):
        res = mxfs("mount", "-o", opt, pool.members[0], str(target), check=False)
        assert res.returncode != 0 and said in one_line_error(res), (opt, res.stderr)
    assert not os.path.ismount(target)


def test_status_exit_code_says_whether_the_daemon_answers(tmp_path: Path) -> None:
    """0 when all is well; 2 when the daemon does not answer (here: killed), so a
    monitor or a script need not parse the text (1, degraded: test_faults.py)."""
    import signal

    members = make_members(tmp_path)
    mkfs(members)
    with mounted_pool(members) as m:
        assert mxfs("status", str(m.path), check=False).returncode == 0
        os.kill(m.daemon_pid(), signal.SIGKILL)
        res = mxfs("status", str(m.path), check=False)
        assert res.returncode == 2 and "daemon not answering" in res.stdout


def test_a_new_kv_namespace_name_is_a_plain_token(pool: Mounted) -> None:
    for bad in ("bad/name", ".dot", "sp ace", "é"):
        res = mxfs("kv", "create", str(pool.path), bad, check=False)
        assert res.returncode != 0 and "a new name is 1-128" in one_line_error(res), bad
    mxfs("kv", "create", str(pool.path), "Qwen2.5-32B:tp8@v1")

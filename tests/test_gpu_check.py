"""The GPU check's dry run on the CPU: every part gives figures or a reason, every byte
check passes, on the mount and on the unmounted path; and KVStore puts of tensors that
live off the host keep their host copies until written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Mounted, one_line_error

from mxfs.kv import KVStore

ROOT = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the unmounted pool needs root")


def dry_run(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device",
                          "cpu", "--size", "8MiB", "--repeat", "1", "--out", str(out),
                          "--dir", str(tmp_path), *extra],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not any(p.name.startswith("mxfs-gpu-check-") for p in tmp_path.iterdir())
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def check_common(r: dict, md: str) -> None:
    assert r["ok"] and r["problems"] == []
    env = r["environment"]
    for key in ("sandbox", "fuse", "io_uring", "o_direct", "gpu"):
        assert key in env and "error" not in env[key], key
    assert env["sandbox"]["runtime"] and env["sandbox"]["hints"]
    assert isinstance(env["o_direct"]["works"], bool)
    assert env["io_uring"]["kernel"] and env["io_uring"]["mxfs_engine"]
    assert env["gpu"]["torch"] == torch.__version__ and env["gpu"]["device"] == "cpu"
    assert env["gpu"]["cufile"]["kvikio"]  # a version, or why it does not import
    loads = r["loads"]
    assert set(loads["median"]) >= {"a_raw_chunks", "b_mxfs_stream", "c_safetensors"}
    assert all(v["cold"] > 0 and v["warm"] > 0 for v in loads["median"].values())
    assert loads["equal"]["b_mxfs_stream"] is True
    assert "CUDA" in loads["gds_unavailable"]  # GDS skipped with its reason
    # the peers: each loaded (the same bytes, and timed) or skipped with why
    for peer in ("f_fastsafetensors", "f_fastsafetensors_gds", "g_instanttensor"):
        assert loads["equal"].get(peer) is True or loads["skipped"].get(peer), peer
        assert (peer in loads["median"]) == (peer in loads["equal"]), peer
    assert "CUDA" in loads["skipped"]["f_fastsafetensors_gds"]
    assert "CUDA" in loads["skipped"]["g_instanttensor"]
    ck = r["checkpoint"]
    assert ck["equal_mxfs"] is True and ck["equal_torch_save"] is True
    assert all(ck[k] > 0 for k in ("blocked_s", "durable_s", "first_blocked_s", "torch_save_s"))
    kv = r["kv"]
    assert kv["chunks"] >= 4 and kv["chunk_bytes"] > 256 << 10  # above the inline bound
    assert kv["raw_files"] >= 1 and all(kv["equal"].values()) and len(kv["equal"]) == 2
    assert all(v["cold"] > 0 and v["warm"] > 0 for v in kv["median"].values())
    for title in ("## Environment", "## Model loads", "## Checkpoint from device tensors",
                  "## KV chunks into device buffers", "every byte check passed"):
        assert title in md


@needs_root
def test_dry_run_covers_every_part(tmp_path: Path) -> None:
    r, md = dry_run(tmp_path)
    check_common(r, md)
    fuse = r["environment"]["fuse"]
    if r["environment"]["pool_mounted"]:
        assert fuse["mount"] == "ok"
        assert r["checkpoint"]["target"].startswith("mxfs mount")
        assert set(r["kv"]["median"]) == {"a_raw_chunks", "b_mxfs_kvstore", "c_plain_files"}
    else:  # no FUSE here: the same run takes the unmounted path, and says why
        assert fuse["mount"].startswith(("not tried", "failed"))
        assert "skipped" in r["kv"]["b_mxfs_kvstore"]


@needs_root
def test_dry_run_without_fuse_takes_the_unmounted_path(tmp_path: Path) -> None:
    r, md = dry_run(tmp_path, "--no-fuse")
    check_common(r, md)
    assert r["environment"]["fuse"]["mount"] == "not tried (--no-fuse)"
    assert r["checkpoint"]["target"].startswith("plain folder: --no-fuse")
    assert set(r["kv"]["median"]) == {"a_raw_chunks", "b_mxfs_offline", "c_plain_files"}
    assert "needs a mounted pool" in r["kv"]["b_mxfs_kvstore"]["skipped"]
    assert "b_mxfs_kvstore skipped" in md


def test_bad_input_is_one_line() -> None:
    for args in (["--size", "banana"], ["--repeat", "0"], ["--kv-chunk", "1000"]):
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"),
                              "--device", "cpu", *args], capture_output=True, text=True,
                             timeout=60)
        assert one_line_error(res).startswith("gpu_check: ")


class OffHost(torch.Tensor):
    """A host tensor that says it lives on a device, as a CUDA one does: KVStore copies
    it to the host with `to`, which hands back a fresh copy, as a device tensor's does."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def to(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor).clone()


def test_kv_put_of_device_tensors_keeps_their_host_copies(mounted: Mounted) -> None:
    # The host copies were freed before the batch was written: wrong bytes, or a crash.
    src = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(8)]
    with KVStore(str(mounted.path), "dev") as kv:
        keys = [f"k{i}" for i in range(8)]
        assert kv.batch_put(keys, [t.as_subclass(OffHost) for t in src]) == [True] * 8
        for key, want in zip(keys, src, strict=True):
            back = torch.empty_like(want)
            assert kv.get(key, out=back) is True and torch.equal(back, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_get_into_a_device_tensor_lands_after_the_work_queued_before_it(
        mounted: Mounted) -> None:
    """The copy to the device ran on a side stream that did not wait for the caller's:
    a fill queued before the get (or a kernel whose freed memory became the tensor)
    landed after it, and the get said True over other bytes."""
    want = torch.full((1 << 20,), 3, dtype=torch.uint8)
    with KVStore(str(mounted.path), "dev") as kv:
        assert kv.put("k", want) is True
        out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(10**9)  # (the caller's stream busy a while)
        out.fill_(7)
        assert kv.get("k", out=out) is True
        assert torch.equal(out.cpu(), want)


def test_wheels_install_into_a_fresh_private_folder(tmp_path: Path) -> None:
    """gpu_check.sh runs as root: the folder its wheels go to (on PYTHONPATH) must be made
    fresh and be root's alone, or another user's sitecustomize.py placed there runs as
    root.  A stand-in python3 records where it was asked to install, and what was there."""
    copy = tmp_path / "repo"
    (copy / "tools").mkdir(parents=True)
    (copy / ".whl").mkdir()
    (copy / ".whl" / "x-1-py3-none-any.whl").write_bytes(b"")
    (copy / "tools" / "gpu_check.sh").write_bytes((ROOT / "tools" / "gpu_check.sh").read_bytes())
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    seen = tmp_path / "seen"
    (bin_ / "python3").write_text(
        "#!/bin/sh\n"
        f'if [ "$2" = pip ]; then t=$(echo "$@" | sed "s/.*--target \\([^ ]*\\).*/\\1/"); '
        f'stat -c "%n %a %u" "$t" > {seen}; ls -A "$t" >> {seen}; fi\n')
    (bin_ / "python3").chmod(0o755)
    for name in ("nvidia-smi", "timeout"):
        (bin_ / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    res = subprocess.run(["bash", str(copy / "tools" / "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    made, mode, uid = seen.read_text().splitlines()[0].split()
    assert made != "/tmp/mxfs-site" and mode == "700" and int(uid) == os.geteuid()
    assert seen.read_text().splitlines()[1:] == []  # empty: nobody else's files in it
    assert not os.path.exists(made)  # removed after the run

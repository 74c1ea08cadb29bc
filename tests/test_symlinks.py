"""Symbolic links on the direct path, followed as the kernel follows them: a Hugging Face
cache in the mount loads; loops, links out of the mount and closed folders behave as
through the mount."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from conftest import Mounted
from users import ensure_users, run_as

from mxfs.client import ControlClient, ControlError
from mxfs.client.direct import DirectFile, PlainFile, open_reader
from mxfs.load import load_file, load_model


def hf_cache(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """models--org--tiny as huggingface_hub lays it out: blobs named by hash, a snapshot
    folder of relative links to them, refs/main naming the revision."""
    repo = root / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    g = torch.Generator().manual_seed(5)
    full = {f"layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(4)}
    names = sorted(full)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        blob = blobs / f"sha{i}"
        st.save_file({n: full[n] for n in part}, str(blob))
        (snap / fname).symlink_to(f"../../blobs/sha{i}")
        weight_map.update({n: fname for n in part})
    (blobs / "shaidx").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (snap / "model.safetensors.index.json").symlink_to("../../blobs/shaidx")
    return snap, full


def test_a_hugging_face_cache_loads_through_its_snapshot_links(mounted: Mounted) -> None:
    snap, full = hf_cache(mounted.path / "hub")
    first = snap / "model-00001-of-00002.safetensors"
    with open_reader(str(first)) as f:
        assert isinstance(f, DirectFile)  # the daemon followed the link
    got = load_file(str(first))
    assert set(got) == {"layers.0.w", "layers.1.w"}
    assert all(torch.equal(got[k], full[k]) for k in got)
    loaded = dict(load_model(str(snap)))
    assert set(loaded) == set(full) and all(torch.equal(loaded[k], full[k]) for k in full)
    # An absolute link inside the mount is followed too.
    (mounted.path / "abs.safetensors").symlink_to(first)
    assert torch.equal(load_file(str(mounted.path / "abs.safetensors"))["layers.0.w"],
                       full["layers.0.w"])


def test_loops_and_links_out_of_the_mount(mounted: Mounted, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    st.save_file({"x": torch.arange(6.0)}, str(outside))
    (mounted.path / "out.safetensors").symlink_to(outside)
    (mounted.path / "up.safetensors").symlink_to(  # `..` above the mount's root
        os.path.join("..", os.path.relpath(outside, mounted.path.parent)))
    (mounted.path / "a").symlink_to("b")
    (mounted.path / "b").symlink_to("a")
    with ControlClient(str(mounted.path)) as c:
        for name in ("out.safetensors", "up.safetensors"):
            with pytest.raises(ControlError) as e:
                c.call("open_read", path="/" + name)
            assert e.value.errno == errno.EXDEV
        with pytest.raises(ControlError) as e:
            c.call("open_read", path="/a")
        assert e.value.errno == errno.ELOOP
    with pytest.raises(OSError) as err:
        (mounted.path / "a").read_bytes()
    assert err.value.errno == errno.ELOOP  # the same as through the mount
    # A link leading out of the mount is read through the kernel, as a plain file.
    with open_reader(str(mounted.path / "out.safetensors")) as f:
        assert isinstance(f, PlainFile)
    assert torch.equal(load_file(str(mounted.path / "out.safetensors"))["x"],
                       torch.arange(6.0))


FOLLOW = r"""
from mxfs.client import ControlClient
mount = sys.argv[1]
out = {}
with ControlClient(mount) as c:
    for name in sys.argv[2:]:
        out[name] = [attempt(lambda: open(os.path.join(mount, name), "rb").close()),
                     attempt(c.call, "open_read", path="/" + name)]
print(json.dumps(out))
"""


def test_links_grant_nothing_the_folders_they_pass_refuse(mounted: Mounted) -> None:
    alice = ensure_users()["alice"]
    os.chmod(mounted.path, 0o755)
    (mounted.path / "closed").mkdir(mode=0o700)
    (mounted.path / "closed" / "f").write_bytes(b"secret")
    (mounted.path / "open").mkdir(mode=0o755)
    (mounted.path / "open" / "g").write_bytes(b"public")
    (mounted.path / "into-closed").symlink_to("closed/f")
    (mounted.path / "into-open").symlink_to("open/g")
    (mounted.path / "via-link-dir").symlink_to("open")
    out = run_as(alice, FOLLOW, str(mounted.path), "into-closed", "into-open",
                 "via-link-dir/g")
    assert out["into-closed"] == [errno.EACCES, errno.EACCES]
    assert out["into-open"] == ["ok", "ok"]
    assert out["via-link-dir/g"] == ["ok", "ok"]

"""Small hardening: all-or-nothing mkfs, private chunk folders, reclaimed space that a
held descriptor cannot keep, stripe commands off mxfs, hostile safetensors headers,
st_blocks of sparse files, and df on members sharing one disk."""

from __future__ import annotations

import grp
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HAVE_FUSE,
    Mounted,
    eventually,
    ext4_image,
    make_members,
    mkfs,
    mxfs,
    one_line_error,
)
from users import TEAM, ensure_users

from mxfs.errors import MxfsError
from mxfs.load.header import HeaderError, parse_header
from mxfs.pool import Pool, read_superblock
from mxfs.pool.key import install_key, load_key
from mxfs.pool.node_config import NodeConfig, write_node_config
from mxfs.pool.pool import CHUNK_DIR
from mxfs.pool.superblock import write_superblock

needs_root = pytest.mark.skipif(not HAVE_FUSE, reason="needs root (mounts)")
ROOT = Path(__file__).resolve().parent.parent


def _entries(member: str) -> set[str]:
    return set(os.listdir(member)) - {"lost+found"}


def _mkfs_args(members: list[str], unit: str = "64KiB") -> list[str]:
    args = ["mkfs", "--stripe-unit", unit]
    for m in members:
        args += ["--member", m]
    return args


@pytest.fixture
def public_members() -> Iterator[list[str]]:
    """Members under a folder other users can search, so only mxfs's own modes stop them."""
    root = Path(tempfile.mkdtemp(prefix="mxfs-hard-"))
    os.chmod(root, 0o755)
    try:
        yield make_members(root, 2)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


# ---- 1. all-or-nothing mkfs -------------------------------------------------

@needs_root
def test_mkfs_with_a_read_only_member_writes_nothing_then_works_once_fixed(
        tmp_path: Path) -> None:
    members = make_members(tmp_path, 3)
    subprocess.run(["mount", "--bind", members[2], members[2]], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", members[2]], check=True)
        line = one_line_error(mxfs(*_mkfs_args(members), check=False))
        assert members[2] in line and "writable" in line
        assert all(_entries(m) == set() for m in members)
    finally:
        subprocess.run(["umount", members[2]], check=True)
    mxfs(*_mkfs_args(members))
    assert Pool.open(members[0]).stripe_unit == 64 << 10


@needs_root
def test_mkfs_that_fails_part_way_removes_what_it_wrote_on_every_member(
        tmp_path: Path) -> None:
    members = make_members(tmp_path, 2)
    # (16 inodes: room for the write probe, not for 256 chunk folders)
    with ext4_image(tmp_path, "tiny", 8, inodes=16) as tiny:
        line = one_line_error(mxfs(*_mkfs_args([*members, tiny]), check=False))
        assert "part-way" in line and "left as it was" in line
        assert all(_entries(m) == set() for m in [*members, tiny])
        # With --force over an existing pool, that pool is put back as it was.
        mxfs(*_mkfs_args(members))
        old = read_superblock(members[0]).pool_uuid
        (Path(members[1]) / CHUNK_DIR / "07" / "7").write_bytes(b"kept")
        line = one_line_error(mxfs(*_mkfs_args([*members, tiny]), "--force", check=False))
        assert "part-way" in line
        assert Pool.open(members[0]).uuid == old
        assert (Path(members[1]) / CHUNK_DIR / "07" / "7").read_bytes() == b"kept"
        assert _entries(tiny) == set()


@pytest.mark.parametrize("unit", ["1TiB", "3000", "2GiB"])
def test_mkfs_refuses_an_absurd_stripe_unit_and_leaves_members_empty(
        tmp_path: Path, unit: str) -> None:
    members = make_members(tmp_path, 2)
    line = one_line_error(mxfs(*_mkfs_args(members, unit), check=False))
    assert "stripe unit" in line
    assert all(_entries(m) == set() for m in members)


def test_mkfs_force_finishes_a_half_made_member(tmp_path: Path) -> None:
    members = make_members(tmp_path, 2)
    os.mkdir(os.path.join(members[1], CHUNK_DIR))  # what a killed mkfs leaves
    line = one_line_error(mxfs(*_mkfs_args(members), check=False))
    assert "unfinished mkfs" in line and "--force" in line
    mxfs(*_mkfs_args(members), "--force")
    assert len(Pool.open(members[0]).members) == 2
    assert _entries(members[1]) == {CHUNK_DIR, "mxfs.superblock"}


# ---- 2. chunk folders are private -------------------------------------------

def _as_nobody(code: str) -> subprocess.CompletedProcess:
    prog = f"import os; os.setgroups([]); os.setgid(65534); os.setuid(65534); {code}"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True)


@needs_root
def test_other_users_cannot_list_chunk_folders(public_members: list[str]) -> None:
    mkfs(public_members)
    chunks = os.path.join(public_members[0], CHUNK_DIR)
    assert stat.S_IMODE(os.stat(chunks).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(chunks, "a7")).st_mode) == 0o700
    assert _as_nobody(f"os.listdir({public_members[0]!r})").returncode == 0
    res = _as_nobody(f"os.listdir({chunks!r})")
    assert res.returncode != 0 and "PermissionError" in res.stderr
    # A pool made before this: opening it tightens the top chunk folder.
    os.chmod(chunks, 0o755)
    assert _as_nobody(f"os.listdir({chunks!r})").returncode == 0
    Pool.open(public_members[0])
    assert stat.S_IMODE(os.stat(chunks).st_mode) == 0o700
    assert _as_nobody(f"os.listdir({os.path.join(chunks, 'a7')!r})").returncode != 0


# ---- 3. reclaimed space is back even while a writer holds the file ----------

def test_cut_chunks_free_their_space_despite_a_held_descriptor(
        loop_members: list[str]) -> None:
    mkfs(loop_members)
    pool = Pool.open(loop_members[0])
    ino = 4242
    paths = [pool.chunk_path(m, ino) for m in (1, 3)]

    def free(member: int) -> int:
        st = os.statvfs(loop_members[member])
        return st.f_bavail * st.f_frsize

    before = {m: free(m) for m in (1, 3)}
    fds = []
    for p in paths:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, os.urandom(16 << 20))
        os.fsync(fd)
        fds.append(fd)  # a hostile direct writer keeps them
    try:
        assert all(before[m] - free(m) >= 16 << 20 for m in (1, 3))
        pool.cut_chunks(ino)  # what the daemon does to a dropped, never-published file
        pool.remove_chunks(ino)
        assert not any(os.path.exists(p) for p in paths)
        assert all(before[m] - free(m) < 1 << 20 for m in (1, 3))
    finally:
        for fd in fds:
            os.close(fd)


# ---- 4. stripe commands refuse paths off mxfs --------------------------------

@pytest.mark.parametrize("cmd", [["getstripe"], ["setstripe", "--unit", "1MiB"],
                                 ["setstripe", "--width", "2"]])
def test_stripe_commands_refuse_a_path_outside_mxfs(plain: Path, cmd: list[str]) -> None:
    target = plain / "f"
    target.write_bytes(b"x")
    for path in (plain, target):
        line = one_line_error(mxfs(cmd[0], *cmd[1:], str(path), check=False))
        assert str(path) in line and "not on an mxfs mount" in line
        assert os.listxattr(path) == []
    line = one_line_error(mxfs(cmd[0], *cmd[1:], str(plain / "nope" / "f"), check=False))
    assert "does not exist" in line


def test_stripe_commands_still_work_on_the_mount(mounted: Mounted) -> None:
    d = mounted.path / "d"
    d.mkdir()
    out = json.loads(mxfs("setstripe", "--width", "2", "--json", str(d)).stdout)
    assert out["stripe_width"] == 2
    assert json.loads(mxfs("getstripe", "--json", str(d)).stdout)["stripe_width"] == 2


# ---- 5. malformed safetensors headers are HeaderError only ------------------

def _good() -> dict[str, object]:
    return {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def _bad_headers() -> list[dict[str, object]]:
    cases: list[dict[str, object]] = []
    for field, values in {
        "dtype": [["F32"], {"F32": 1}, True, 1, 1.5, None, 2**70, {"nested": ["F32"]}],
        "shape": [[1.0, 4], ["2", 2], [True, 4], [2**70], [0, 2**70], [0, -(2**70)],
                  [-1, -16], [[2], [2]], {"0": 2}, 4, "2x2", None, [2**40, 2**40, 0]],
        "data_offsets": [[0.0, 16.0], ["0", "16"], [False, True], [0, 2**70], [-16, 0],
                         [2**70, 2**70 + 16], [0], [0, 16, 32], {"begin": 0}, 16, None,
                         [[0], [16]], [0, 12], [0, 20], [16, 0]],
    }.items():
        for v in values:
            cases.append({"t": {**_good(), field: v}})
    for meta in ([], "x", 1, True, {"k": 1}, {"k": ["v"]}, {"k": {"v": "w"}}, {"k": None}):
        cases.append({"__metadata__": meta, "t": _good()})
    cases += [{"t": [1, 2]}, {"t": "F32"}, {"t": 2**70}, {"t": None}, {"t": True},
              {"t": _good(), "u": {**_good(), "data_offsets": [8, 24]}},  # overlap
              {"t": {**_good(), "data_offsets": [0, 16 + 1000]}},  # past the data
              {"t": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}]
    return cases


@pytest.mark.unit
def test_every_malformed_header_is_a_header_error() -> None:
    good = json.dumps({"t": _good()}).encode()
    assert parse_header("f", good, 8 + len(good) + 16).tensors["t"].nbytes == 16
    for doc in _bad_headers():
        raw = json.dumps(doc).encode()
        with pytest.raises(HeaderError) as e:
            parse_header("f", raw, 8 + len(raw) + 16)
        assert str(e.value).startswith("f: ") and "\n" not in str(e.value), doc
        assert len(str(e.value)) < 400, doc


def test_typed_field_fuzzer_finds_only_header_errors() -> None:
    spec = importlib.util.spec_from_file_location("fuzz_header", ROOT / "tools/fuzz_header.py")
    assert spec and spec.loader
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    assert fuzz.run_typed(20_000, seed=7) == 20_000
    res = subprocess.run([sys.executable, str(ROOT / "tools/fuzz_header.py"), "--cases", "200",
                          "--typed", "2000", "--seed", "3"], capture_output=True, text=True)
    assert res.returncode == 0 and "2200 cases" in res.stdout, res.stderr


# ---- 6. st_blocks counts what the chunk files hold ---------------------------

def test_sparse_files_report_the_blocks_they_hold(mounted: Mounted) -> None:
    sparse, full = mounted.path / "sparse", mounted.path / "full"
    with open(sparse, "wb") as f:
        f.truncate(64 << 20)
        f.seek((64 << 20) - 1)
        f.write(b"x")
    full.write_bytes(os.urandom(8 << 20))
    st = os.stat(sparse)
    assert st.st_size == 64 << 20
    assert 0 < st.st_blocks * 512 <= 1 << 20
    du = subprocess.run(["du", "-k", str(sparse)], capture_output=True, text=True, check=True)
    assert int(du.stdout.split()[0]) <= 1024
    assert eventually(lambda: os.stat(full).st_blocks * 512 >= 8 << 20)
    (mounted.path / "empty").touch()
    assert os.stat(mounted.path / "empty").st_blocks == 0


# ---- 7. df counts a shared filesystem once -----------------------------------

def test_df_counts_members_on_one_disk_once(mounted: Mounted) -> None:
    out = json.loads(mxfs("df", "--json", str(mounted.path)).stdout)
    st = os.statvfs(mounted.members[0])
    assert out["pool"]["filesystems"] == 1
    assert out["pool"]["size"] == st.f_blocks * st.f_frsize
    assert sum(out["by_use_shown"].values()) <= out["pool"]["used"]
    text = mxfs("df", str(mounted.path)).stdout
    assert "4 members on 1 filesystem" in text


def test_df_by_use_never_exceeds_the_pool_used(loop_pool: Mounted) -> None:
    with open(loop_pool.path / "sparse", "wb") as f:
        f.truncate(4 << 30)  # 4 GiB apparent on 216 MiB of members
    out = json.loads(mxfs("df", "--json", str(loop_pool.path)).stdout)
    assert out["pool"]["filesystems"] == 4
    assert out["pool"]["size"] == sum(m["size"] for m in out["members"])
    assert out["by_use"]["files"] == 4 << 30  # the apparent bytes stay in the JSON
    assert out["by_use_scaled"] and sum(out["by_use_shown"].values()) <= out["pool"]["used"]
    assert "scaled to the pool's used space" in mxfs("df", str(loop_pool.path)).stdout


@needs_root
def test_secrets_are_refused_in_a_folder_others_may_write(tmp_path: Path) -> None:
    """A member of a group that may write the folder could make the temp's name first
    (her own file, held open) and receive the pool key: such a folder is refused."""
    ensure_users()
    team = grp.getgrnam(TEAM).gr_gid
    shared = tmp_path / "etc"
    shared.mkdir()
    os.chown(shared, 0, team)
    shared.chmod(0o775)
    conf = NodeConfig(str(shared / "node.toml"), "uuid", "b", "postgresql://db/x",
                      str(shared / "node.key"), str(tmp_path / "state"))
    for write in (lambda: install_key(b"k" * 32, conf.key), lambda: write_node_config(conf),
                  lambda: load_key(str(shared), create=True)):
        with pytest.raises(MxfsError) as e:
            write()
        assert f"chmod go-w {shared}" in str(e.value)
    assert os.listdir(shared) == []
    shared.chmod(0o755)
    install_key(b"k" * 32, conf.key)
    write_node_config(conf)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in shared.iterdir()} == \
        {"node.key": 0o600, "node.toml": 0o600}


def test_a_superblock_is_not_written_through_a_link_at_a_temp_name(tmp_path: Path) -> None:
    """The superblock's temp had a fixed name, opened O_TRUNC without O_NOFOLLOW: a link
    placed there sent root's write onto the file it names."""
    members = make_members(tmp_path)
    mkfs(members)
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    os.symlink(victim, os.path.join(members[0], "mxfs.superblock.tmp"))
    sb = read_superblock(members[0])
    write_superblock(members[0], sb)
    assert victim.read_text() == "root's own\n"
    assert read_superblock(members[0]) == sb

"""fsck finds and repairs what a crash or a hand can break; scrub names damaged data."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Mounted, check_pool, mxfs, one_line_error
from users import ensure_users, run_as

import mxfs.ckpt as ck
from mxfs.client import ControlClient
from mxfs.io import Layout
from mxfs.kv import KVStore
from mxfs.meta import MetaStore
from mxfs.meta.engine import Engine
from mxfs.pool import Pool


def damage(m: Mounted, fn: Callable[[Engine], object]) -> None:
    """Change rows of an unmounted pool's store behind the namespace rules' back."""
    store = MetaStore.open(Pool.open(m.members[0]).meta_location)
    try:
        store.txn(lambda: fn(store.engine))
    finally:
        store.close()


@pytest.mark.also_postgres
def test_fsck_reports_then_repairs_each_kind_of_damage(mounted: Mounted) -> None:
    (mounted.path / "d").mkdir()
    (mounted.path / "d" / "keep").write_bytes(b"k" * 300_000)
    (mounted.path / "lost").write_bytes(b"L" * 5000)
    (mounted.path / "tailed").write_bytes(b"t" * 100_000)
    (mounted.path / "hard").write_bytes(b"h")
    os.link(mounted.path / "hard", mounted.path / "hard2")
    inos = {n: os.stat(mounted.path / n).st_ino for n in ("lost", "tailed", "hard")}
    mounted.umount()
    assert json.loads(mxfs("fsck", "--json", mounted.members[0]).stdout)["findings"] == []
    pool = Pool.open(mounted.members[0])

    def hurt(e: Engine) -> None:
        e.delete("dentries", {"ino": inos["lost"]})  # an unreachable inode
        e.update("inodes", {"ino": inos["hard"]}, {"nlink": 5})  # a wrong link count
        e.insert("dentries", {"id": e.next_id("dentry"), "parent": 1, "name": b"ghost",
                              "ino": 999999})  # an entry pointing nowhere
    damage(mounted, hurt)
    stray = pool.chunk_path(1, 888888)  # a chunk file of no inode
    Path(stray).write_bytes(b"s" * 4096)
    lay = Layout(65536, 4, inos["tailed"] % 4, 4)
    member = lay.locate(0)[0]
    with open(pool.chunk_path(member, inos["tailed"]), "ab") as f:
        f.write(b"x" * 70_000)  # bytes past the file's size
    res = mxfs("fsck", mounted.members[0], check=False)
    assert res.returncode == 4
    for what in ("unreachable inode", "link count", "dangling entry", "stray chunk file",
                 "tail"):
        assert f"found: {what}" in res.stdout, res.stdout
    assert "run again with --repair" in res.stdout
    res = mxfs("fsck", "--repair", mounted.members[0], check=False)
    assert res.returncode == 1 and "repaired: unreachable inode" in res.stdout
    assert mxfs("fsck", mounted.members[0]).stdout.strip() == "clean"
    check_pool(mounted.members)
    assert not os.path.exists(stray)
    mounted.remount()
    assert (mounted.path / "lost+found" / str(inos["lost"])).read_bytes() == b"L" * 5000
    assert (mounted.path / "tailed").read_bytes() == b"t" * 100_000
    assert os.stat(mounted.path / "hard").st_nlink == 2
    assert not (mounted.path / "ghost").exists()
    assert (mounted.path / "d" / "keep").read_bytes() == b"k" * 300_000


def test_fsck_refuses_a_mounted_pool_and_bad_input(mounted: Mounted) -> None:
    line = one_line_error(mxfs("fsck", mounted.members[0], check=False))
    assert "is mounted at" in line and "umount" in line
    line = one_line_error(mxfs("fsck", "/nonexistent/member", check=False))
    assert "/nonexistent/member" in line


@pytest.mark.also_postgres
def test_scrub_names_the_damaged_sealed_files_and_members_online(mounted: Mounted) -> None:
    ck.save({"w": torch.randn(200_000)}, str(mounted.path / "ckpt")).wait()
    with KVStore(str(mounted.path), "s") as kv:
        kv.put("chunk-a", os.urandom(300_000))
        kv.put("chunk-b", os.urandom(5000))
    (mounted.path / "plain").write_bytes(os.urandom(100_000))  # not sealed: not scrubbed
    ok = json.loads(mxfs("scrub", "--json", str(mounted.path)).stdout)
    assert ok["checked"] == 5 and ok["damaged"] == []  # data, manifest, latest, 2 KV chunks
    data = mounted.path / "ckpt" / "data.safetensors"
    with ControlClient(str(mounted.path)) as c:
        info = c.layout(str(data))
    lay = Layout.from_description(info["layout"])
    member, off = lay.locate(150_000)
    chunk = Pool.open(mounted.members[0]).chunk_path(member, info["ino"])
    with open(chunk, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    res = mxfs("scrub", "--rate", "100MiB", str(mounted.path), check=False)
    assert res.returncode == 1
    assert f"DAMAGED /ckpt/data.safetensors: bytes [131072, 196608) on member {member}: " \
        "checksum" in res.stdout
    assert "1 damaged" in res.stdout
    mounted.umount()  # and offline, from a member path
    out = json.loads(mxfs("scrub", "--json", mounted.members[0], check=False).stdout)
    assert [d["path"] for d in out["damaged"]] == ["/ckpt/data.safetensors"]


def test_a_file_removed_while_scrub_reads_it_is_no_damage(mounted: Mounted) -> None:
    """A tenant removed her sealed file while a throttled scrub read it: its blocks
    read as missing and scrub reported them DAMAGED (exit 1, the operator paged).
    The file is judged again before its damage is told: removed, there is none."""
    # (256 KiB in blocks of the stripe unit, 64 KiB: each block on a member of its own,
    # each member's chunk file opened as its first block comes; a block a second)
    ck.save({"w": torch.randn(64 << 10)}, str(mounted.path / "ckpt")).wait()
    scrub = subprocess.Popen([sys.executable, "-m", "mxfs", "scrub", "--json", "--rate",
                              "64KiB", str(mounted.path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # (its first block read)
    shutil.rmtree(mounted.path / "ckpt")
    out, err = scrub.communicate(timeout=120)
    assert scrub.returncode == 0, (out, err)
    assert json.loads(out)["damaged"] == []


SEAL_AND_NAME = r"""
import mmap
from mxfs.client import ControlClient
from mxfs.client.writer import create_file
folder, name = sys.argv[1], bytes.fromhex(sys.argv[2])
data = os.urandom(200_000)
buf = mmap.mmap(-1, -(-len(data) // 4096) * 4096)
buf[:len(data)] = data
with create_file(os.path.join(folder, "model.bin"), len(data)) as w:
    w.write_at(0, memoryview(buf), valid=len(data))
    w.commit(len(data))
with ControlClient(os.path.dirname(folder)) as c:
    info = c.layout(os.path.join(folder, "model.bin"))
os.rename(os.path.join(folder, "model.bin").encode(), os.path.join(folder.encode(), name))
print(json.dumps(info))
"""


def test_a_tenants_name_reaches_roots_terminal_escaped(mounted: Mounted,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    alice = ensure_users()["alice"]
    folder = mounted.path / "alice"
    folder.mkdir()
    os.chown(folder, alice.uid, alice.gid)
    # a sealed file of hers named to clear root's screen and forge a clean report
    name = b"ok\x1b[2J\nchecked 0 sealed files; all blocks match \xff\xe2\x80\xae"
    info = run_as(alice, SEAL_AND_NAME, str(folder), name.hex())
    ino = info["ino"]
    member, off = Layout.from_description(info["layout"]).locate(70_000)
    with open(Pool.open(mounted.members[0]).chunk_path(member, ino), "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    mounted.umount()
    damage(mounted, lambda e: e.update("inodes", {"ino": ino}, {"nlink": 3}))
    shown = r"/alice/ok\x1b[2J\x0achecked 0 sealed files; all blocks match \xff\u202e"
    monkeypatch.setenv("PYTHONIOENCODING", "utf-8")  # (strict: what a UTF-8 terminal gets)
    scrub = mxfs("scrub", mounted.members[0], check=False)
    assert scrub.returncode == 1, scrub.stdout + scrub.stderr
    assert scrub.stdout.splitlines() == [
        f"DAMAGED {shown}: bytes [65536, 131072) on member {member}: checksum",
        "checked 1 sealed files; 1 damaged"], scrub.stdout
    fsck = mxfs("fsck", mounted.members[0], check=False)
    assert fsck.returncode == 4, fsck.stdout + fsck.stderr
    assert fsck.stdout.splitlines() == [
        f"found: link count: {shown} has nlink 3 but 1 names: set to 1",
        "0 repaired, 1 left (run again with --repair)"], fsck.stdout
    assert mxfs("fsck", "--repair", mounted.members[0], check=False).returncode == 1
    mounted.remount()


def test_fsck_links_lost_files_into_roots_own_lost_found_not_a_tenants(
        mounted: Mounted) -> None:
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    os.chmod(mounted.path, 0o1777)  # a root anyone may make a folder in
    (mounted.path / "private").mkdir(mode=0o700)  # bob's, with a file only he may read
    (mounted.path / "private" / "secret").write_bytes(b"bob's secret")
    for p in ("private", "private/secret"):
        os.chown(mounted.path / p, bob.uid, bob.gid)
    ino = os.stat(mounted.path / "private" / "secret").st_ino
    assert run_as(alice, "print(json.dumps(attempt(os.mkdir, sys.argv[1], 0o777)))",
                  str(mounted.path / "lost+found")) == "ok"  # hers, ready to catch
    os.chmod(mounted.path / "lost+found", 0o777)  # (past her umask)
    mounted.umount()
    damage(mounted, lambda e: e.delete("dentries", {"ino": ino}))  # unreachable now
    res = mxfs("fsck", "--repair", mounted.members[0], check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"repaired: lost+found: /lost+found was uid {alice.uid}'s folder (mode 0777), " \
        "not root's own: moved aside to /lost+found.1, and a root's 0700 one made" \
        in res.stdout, res.stdout
    assert f"repaired: unreachable inode: inode {ino}: linked as /lost+found/{ino}" \
        in res.stdout, res.stdout
    assert mxfs("fsck", mounted.members[0]).stdout.strip() == "clean"
    mounted.remount()
    st = os.stat(mounted.path / "lost+found")
    assert (st.st_uid, st.st_gid, st.st_mode) == (0, 0, stat.S_IFDIR | 0o700)
    assert (mounted.path / "lost+found" / str(ino)).read_bytes() == b"bob's secret"
    assert run_as(alice, "print(json.dumps(attempt(os.listdir, sys.argv[1])))",
                  str(mounted.path / "lost+found")) == errno.EACCES
    theirs = os.stat(mounted.path / "lost+found.1")  # hers, kept, and empty
    assert theirs.st_uid == alice.uid and os.listdir(mounted.path / "lost+found.1") == []


def test_scrub_reads_a_huge_checksum_block_in_pieces_and_a_malformed_seal_is_named(
        mounted: Mounted) -> None:
    """A seal whose block is the whole of a 1 TiB file (what commits accepted before
    their bound; a tenant's sparse file cost root's scrub twice its size in memory) is
    read a piece at a time, under a 4 GiB address-space cap; one whose checksums do not
    fit its size is named, not checked; the files after them are checked all the same."""
    import resource
    import subprocess
    import sys

    from mxfs.client.writer import create_file
    from mxfs.io.checksum import pack_sums

    inos = {}
    for name in ("huge", "odd", "after"):
        data = os.urandom(200_000)
        with create_file(str(mounted.path / name), len(data)) as w:
            w.write_at(0, memoryview(data))
            w.commit(len(data))
        inos[name] = os.stat(mounted.path / name).st_ino
    with ControlClient(str(mounted.path)) as c:
        first = Layout.from_description(c.layout(str(mounted.path / "huge"))["layout"]) \
            .locate(0)[0]
    mounted.umount()
    mounted.check = False  # (a 1 TiB file with 200 KB of data: broken on purpose)
    big = 1 << 40

    def plant(e: Engine) -> None:
        e.update("inodes", {"ino": inos["huge"]}, {"size": big})
        e.update("sealed", {"ino": inos["huge"]}, {"sum_unit": big, "sums": pack_sums([7])})
        e.update("sealed", {"ino": inos["odd"]}, {"sums": pack_sums([7] * 9)})
    damage(mounted, plant)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    res = subprocess.run([sys.executable, "-m", "mxfs", "scrub", "--json", mounted.members[0]],
                         capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert out["damaged"] == [{"path": "/huge", "begin": 0, "end": big, "member": first,
                               "why": "missing"}]
    assert out["unchecked"] == [{"path": "/odd", "why": "its seal is malformed: 9 checksums "
                                 "of 65536 bytes for 200000 bytes"}]
    assert out["checked"] == 2  # /huge (damaged) and /after (sound)

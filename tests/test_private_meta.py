"""The pool's metadata is root's alone: store, WAL, backups, dumps, lock and daemon log.

They hold every file name and xattr, so a local user who could read them would see
past the modes of the pool's directories.  The pool here lives in world-reachable
folders, so only mxfs's own modes keep an unprivileged user out.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, force_unmount, make_members, mkfs, mxfs

from mxfs.vol.mounts import runtime_dir

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")

# As uid/gid 65534 with no groups: which of the paths given can be opened for reading.
PROBE = """
import json, os, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = {}
for p in sys.argv[1:]:
    try:
        os.close(os.open(p, os.O_RDONLY))
        out[p] = "opened"
    except OSError as e:
        out[p] = e.strerror
print(json.dumps(out))
"""


def _nobody_opens(paths: list[str]) -> dict[str, str]:
    res = subprocess.run([sys.executable, "-c", PROBE, *paths], capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout)


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def public() -> Iterator[Path]:
    """A folder every user can reach (unlike pytest's own 0700 tmp folders)."""
    base = Path(tempfile.mkdtemp(prefix="mxfs-priv-"))
    os.chmod(base, 0o755)
    mp = base / "mnt"
    mp.mkdir(mode=0o755)
    try:
        yield base
    finally:
        force_unmount(str(mp))
        shutil.rmtree(base)


def _mount(members: list[str], mp: Path) -> str:
    mxfs("mount", "-o", "allow_other", members[0], str(mp))
    return json.loads(mxfs("status", "--json", str(mp)).stdout)["pool_uuid"]


def test_no_local_user_can_read_the_metadata(public: Path) -> None:
    members = make_members(public / "members")
    os.chmod(public / "members", 0o755)
    mkfs(members)
    meta = Path(members[0]) / "meta"
    assert _mode(meta) == 0o700 and _mode(meta / "mxfs.db") == 0o600
    mp = public / "mnt"
    uuid = _mount(members, mp)
    (mp / "hidden").mkdir(mode=0o700)
    (mp / "hidden" / "salaries.xlsx").write_bytes(b"s" * 100_000)
    os.setxattr(mp / "hidden" / "salaries.xlsx", "user.owner", b"finance")
    copy = json.loads(mxfs("meta", "backup", "--json", str(mp)).stdout)["backup"]
    dumps = [str(public / n) for n in ("meta.sql", "meta.json.zst")]
    for d in dumps:
        mxfs("meta", "dump", d, str(mp))
    log = f"{runtime_dir()}/{uuid}.log"
    files = [str(meta / n) for n in ("mxfs.db", "mxfs.db-wal", "mxfs.db-shm", "daemon.lock")]
    files += [copy, *dumps, log]
    for f in files:
        assert _mode(f) == 0o600, f
    for d in (meta, Path(copy).parent):
        assert _mode(d) == 0o700, d
    assert _mode(runtime_dir()) & 0o005 == 0o005  # the control sockets stay reachable
    control = public / "control.txt"  # proves the user reaches these folders at all
    control.write_text("anyone may read this")
    control.chmod(0o644)
    got = _nobody_opens([*files, str(control)])
    assert got.pop(str(control)) == "opened"
    assert all(v == "Permission denied" for v in got.values()), got
    mxfs("umount", str(mp))


def test_an_older_pools_loose_metadata_is_tightened_at_mount(public: Path) -> None:
    members = make_members(public / "members")
    mkfs(members)
    mp = public / "mnt"
    uuid = _mount(members, mp)
    copy = json.loads(mxfs("meta", "backup", "--json", str(mp)).stdout)["backup"]
    mxfs("umount", str(mp))
    meta = Path(members[0]) / "meta"
    log = f"{runtime_dir()}/{uuid}.log"
    loose = [meta / "mxfs.db", meta / "daemon.lock", Path(copy), Path(log)]
    for f in loose:  # as versions before this one left them
        f.chmod(0o644)
    for d in (meta, Path(copy).parent):
        d.chmod(0o755)
    _mount(members, mp)
    for f in [*loose, meta / "mxfs.db-wal", meta / "mxfs.db-shm"]:
        assert _mode(f) == 0o600, f
    for d in (meta, Path(copy).parent):
        assert _mode(d) == 0o700, d
    assert os.listdir(mp) == []
    mxfs("umount", str(mp))

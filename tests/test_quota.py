"""Per-user quotas on a real daemon, as real unprivileged users: bytes and inodes a uid
owns through the mount, direct writes and KV puts stop at its limits, others go on,
and limits and usage survive a remount."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import Mounted, eventually, mxfs, one_line_error
from users import User, ensure_users, run_as, subordinate_uids


def home(pool: Mounted, user: User) -> Path:
    d = pool.path / user.name
    if not d.exists():
        d.mkdir()
        os.chown(d, user.uid, user.gid)
    return d


def empty_home_with_quota(pool: Mounted, user: User, *limits: str) -> Path:
    """`user`'s folder on the pool, emptied, and `limits` set as its quota."""
    d = home(pool, user)
    for f in d.iterdir():
        f.unlink()
    quota(pool, "--user", user.name, *limits)
    return d


def line_of(report: dict, uid: int) -> dict:
    return next(r for r in report["users"] if r["uid"] == uid)


def files_bytes(line: dict) -> int:
    """What a quota line counts of files' sizes alone (names, xattrs aside)."""
    return int(line["bytes"] - line["name_bytes"] - line["xattr_bytes"])


def quota(pool: Mounted, *args: str) -> dict:
    return json.loads(mxfs("quota", str(pool.path), "--json", *args).stdout)


def test_a_users_files_stop_at_its_quota_and_others_go_on(pool: Mounted) -> None:
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    quota(pool, "--user", alice.name, "--bytes", "1MiB", "--inodes", "8")
    d, other = home(pool, alice), home(pool, bob)
    script = FILL + f"""
d = {str(d)!r}
first = fill(d + "/a", 4 << 20)
grow = attempt(os.truncate, d + "/a", 8 << 20)
made = 0
while True:
    try:
        os.close(os.open(d + f"/n{{made}}", os.O_WRONLY | os.O_CREAT, 0o644))
        made += 1
    except OSError as e:
        made_err = e.errno
        break
mine = mxfs.client.ControlClient({str(pool.path)!r}).call("quota")
os.unlink(d + "/a")
after = fill(d + "/n0", 512 << 10)
print(json.dumps([first, grow, made, made_err, mine, after]))
"""
    first, grow, made, made_err, mine, after = run_as(alice, script)
    assert first[1] == errno.EDQUOT and (1 << 20) - (64 << 10) <= first[0] <= 1 << 20
    assert grow == errno.EDQUOT  # a truncate past the end is growth too
    assert made_err == errno.EDQUOT and made == 8 - 2  # (its folder and "a" are its own)
    assert [r["uid"] for r in mine["users"]] == [alice.uid]  # a user sees its own line
    assert line_of(mine, alice.uid)["inodes"] == 8
    assert line_of(mine, alice.uid)["bytes_limit"] == 1 << 20
    assert after == [512 << 10, 0]  # its space came back with the unlink
    bob_wrote = run_as(bob, f"""
with open({str(other / "big")!r}, "wb") as f:
    f.write(b"b" * (3 << 20))
print(json.dumps(os.stat({str(other / "big")!r}).st_size))
""")
    assert bob_wrote == 3 << 20  # another user is not held by alice's quota
    report = quota(pool)  # root sees everyone
    assert files_bytes(line_of(report, alice.uid)) == 512 << 10
    assert files_bytes(line_of(report, bob.uid)) == 3 << 20
    quota(pool, "--user", alice.name, "--clear")
    assert line_of(quota(pool, "--user", str(alice.uid)), alice.uid)["bytes_limit"] == 0


def test_direct_writes_and_kv_puts_are_charged_what_they_declare(pool: Mounted) -> None:
    """A direct writer is charged its declared size from create to commit or abort (its
    descriptors cannot take it past the quota: the chunk files are cut back to what it
    declared), and a KV chunk its size, against the writer's uid."""
    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice, "--bytes", "1MiB")
    script = f"""
import base64
from mxfs.client.writer import create_file
c = mxfs.client.ControlClient({str(pool.path)!r})
too_big = attempt(create_file, {str(d / "big")!r}, size=2 << 20)
w = create_file({str(d / "x")!r}, size=600 << 10)
second = attempt(create_file, {str(d / "y")!r}, size=600 << 10)
reserved = c.call("quota")["users"][0]["reserved"]
w.abort()
w = create_file({str(d / "x")!r}, size=600 << 10)
w.write_at(0, memoryview(b"x" * (600 << 10)))
w.commit(600 << 10)
b = lambda n: base64.b64encode(b"k" * n).decode()
kv_big = attempt(c.call, "kv_put", namespace="q", keys=[b(1)], data=[b(500 << 10)])
kv_small = attempt(c.call, "kv_put", namespace="q", keys=[b(2)], data=[b(100 << 10)])
print(json.dumps([too_big, second, reserved, kv_big, kv_small, c.call("quota")]))
"""
    too_big, second, reserved, kv_big, kv_small, mine = run_as(alice, script)
    assert too_big == errno.EDQUOT and second == errno.EDQUOT
    assert reserved == 600 << 10
    assert kv_big == errno.EDQUOT and kv_small == "ok"
    line = line_of(mine, alice.uid)
    assert files_bytes(line) == (600 << 10) + (100 << 10) and line["reserved"] == 0
    assert (d / "x").stat().st_size == 600 << 10
    quota(pool, "--user", alice.name, "--clear")


def test_one_byte_files_and_kv_chunks_cost_a_block_and_their_keys(pool: Mounted) -> None:
    """A byte quota charged a file's size alone and a KV key nothing: alice, at 1 MiB,
    put 5,000 one-byte chunks with 1 KiB keys (22 MB of members, 44 MB of the metadata
    store) and was charged 4.9 KiB.  A file or chunk holding any byte costs a block now
    and a chunk's key its bytes and a row, as a name: her puts stop within a quota's
    worth, `mxfs quota` shows both, and removing the namespace gives them back."""
    from mxfs.meta.usage import BLOCK, NAME_ROW

    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice, "--bytes", "1MiB")
    before = line_of(quota(pool, "--user", alice.name), alice.uid)
    ns = "tiny-keys"
    made, code = run_as(alice, f"""
import base64
c = mxfs.client.ControlClient({str(pool.path)!r})
for i in range(3):
    with open({str(d)!r} + f"/one{{i}}", "wb") as f:
        f.write(b"1")
b = lambda x: base64.b64encode(x).decode()
made, code = 0, 0
while made < 1000:
    try:
        c.call("kv_put", namespace={ns!r}, keys=[b(b"%04d" % made + b"k" * 1020)],
               data=[b(b"x")])
        made += 1
    except OSError as e:
        code = e.errno
        break
print(json.dumps([made, code]))
""")
    files = 3 * (BLOCK + len("one0") + NAME_ROW)
    key = len(ns) + 1024 + NAME_ROW
    assert code == errno.EDQUOT
    assert made == ((1 << 20) - before["bytes"] - files) // (BLOCK + key)  # (~190)
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert files_bytes(line) - files_bytes(before) == (3 + made) * BLOCK
    assert line["name_bytes"] - before["name_bytes"] == 3 * (4 + NAME_ROW) + made * key
    assert line["inodes"] - before["inodes"] == 3 + made
    run_as(alice, f"""
mxfs.client.ControlClient({str(pool.path)!r}).call("kv_ns_remove", namespace={ns!r})
print(1)
""")
    for f in d.iterdir():
        f.unlink()
    assert eventually(lambda: line_of(quota(pool, "--user", alice.name), alice.uid)
                      ["bytes"] == before["bytes"])  # (the keys at once, the rest freed)
    quota(pool, "--user", alice.name, "--clear")


def test_chunks_written_at_once_count_each_others_keys(pool: Mounted) -> None:
    """A kv_create booked its chunk's block against the writer's quota, not its key,
    which its commit charges: alice, at 512 KiB, held 127 chunks with 1 KiB keys
    uncommitted at once, each judged with the others' keys left out, and committed
    them all: 668 KiB charged.  Each now books its key too: what she commits stays
    within her quota."""
    from mxfs.meta.usage import BLOCK, NAME_ROW

    alice = ensure_users()["alice"]
    empty_home_with_quota(pool, alice, "--bytes", "512KiB")
    before = line_of(quota(pool, "--user", alice.name), alice.uid)
    ns = "held-keys"
    made, code, stored = run_as(alice, f"""
import base64
from mxfs.io.checksum import block_sums, pack_sums
c = mxfs.client.ControlClient({str(pool.path)!r})
b = lambda x: base64.b64encode(x).decode()
c.call("kv_ns_create", namespace={ns!r}, capacity=1 << 30)
held, code = [], 0
while len(held) < 250:
    key = b(b"%04d" % len(held) + b"k" * 1020)
    try:
        made, fds = c.call_with_fds("kv_create", namespace={ns!r}, key=key, size=1)
    except OSError as e:
        code = e.errno
        break
    os.pwrite(fds[0], b"x", 0)
    for fd in fds:
        os.close(fd)
    held.append((made, key))
stored = 0
for made, key in held:
    unit = made["layout"]["stripe_unit"]
    stored += c.call("kv_commit", namespace={ns!r}, ino=made["ino"], key=key, size=1,
                     sum_unit=unit, sums=b(pack_sums(block_sums(b"x", unit))))["stored"]
print(json.dumps([len(held), code, stored]))
""")
    key = len(ns) + 1024 + NAME_ROW
    assert code == errno.EDQUOT and stored == made
    assert made == ((512 << 10) - before["bytes"]) // (BLOCK + key)  # (~100; 127 before)
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert line["bytes"] <= 512 << 10 and line["reserved"] == 0, line
    run_as(alice, f"""
mxfs.client.ControlClient({str(pool.path)!r}).call("kv_ns_remove", namespace={ns!r})
print(1)
""")
    quota(pool, "--user", alice.name, "--clear")


def _xattrs_until_refused(user: Any, folder: Path, each: int, size: int) -> tuple[int, int]:
    """As `user`: 64 files made in `folder`, `each` xattrs of `size` bytes set on each
    (named user.000, user.001, ...), until one is refused; (how many were set, the errno)."""
    script = f"""
set_ = 0
for i in range(64):
    f = {str(folder)!r} + f"/x{{i}}"
    open(f, "wb").close()
    try:
        for j in range({each}):
            os.setxattr(f, b"user.%03d" % j, b"v" * {size})
            set_ += 1
    except OSError as e:
        print(json.dumps([set_, e.errno]))
        break
"""
    made, code = run_as(user, script)
    return made, code


def test_extended_attributes_count_against_the_owners_byte_quota(pool: Mounted) -> None:
    """xattrs live in the metadata store: a tenant setting 64 KiB values on file after
    file is stopped by its byte quota (EDQUOT), not only by the per-inode bound, and
    what it set is shown as its own."""
    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice, "--bytes", "1MiB")
    made, code = _xattrs_until_refused(alice, d, 3, 65536)
    assert code == errno.EDQUOT and 12 <= made <= 16  # 1 MiB of 64 KiB values
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert line["xattr_bytes"] >= made * 65536 and line["bytes"] <= 1 << 20
    for f in d.iterdir():
        f.unlink()
    quota(pool, "--user", alice.name, "--clear")


def test_tiny_extended_attributes_are_charged_their_rows(pool: Mounted) -> None:
    """An xattr is a row of the store: charged its name and value alone, a user's
    empty ones cost her quota 7 bytes and the store over 100 each, 256 on every file
    she owns.  Each is charged its row (NAME_ROW) too: she stops at her quota, her
    line shows what she set, and removing them gives it all back."""
    from mxfs.meta.usage import NAME_ROW

    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice, "--bytes", "256KiB")
    made, code = _xattrs_until_refused(alice, d, 256, 0)
    each = NAME_ROW + len(b"user.000")
    assert code == errno.EDQUOT and made <= (256 << 10) // each, made
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert line["xattr_bytes"] == made * each, line
    for f in d.iterdir():
        for name in os.listxattr(f):
            os.removexattr(f, name)
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert line["xattr_bytes"] == 0, line
    for f in d.iterdir():
        f.unlink()
    quota(pool, "--user", alice.name, "--clear")


def test_names_and_link_targets_count_against_the_owners_byte_quota(pool: Mounted) -> None:
    """Names live in the metadata store: a user with a quota of a few inodes made
    20,000 hard links with long names (12 MB of the store) and symbolic links with
    4 KiB targets, charged nothing.  Each name is its folder's owner's now, each target
    its link's: the links stop at her byte quota, and the names are shown as hers."""
    from mxfs.meta.usage import NAME_ROW

    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice, "--bytes", "256KiB", "--inodes", "10")
    room = (256 << 10) - line_of(quota(pool, "--user", alice.name), alice.uid)["bytes"]
    script = f"""
d = {str(d)!r}
open(d + "/f", "wb").close()
made = 0
try:
    for i in range(5000):
        os.link(d + "/f", d + "/" + f"{{i:05d}}" + "n" * 200)
        made += 1
    print(json.dumps([made, 0, 0]))
except OSError as e:
    try:
        os.symlink("t" * 4000, d + "/ln")
        linked = 0
    except OSError as f:
        linked = f.errno
    print(json.dumps([made, e.errno, linked]))
"""
    made, code, linked = run_as(alice, script)
    per_link = 205 + NAME_ROW
    assert code == errno.EDQUOT and linked == errno.EDQUOT
    assert made == (room - 1 - NAME_ROW) // per_link  # ("f" and its name first)
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert line["name_bytes"] >= made * per_link and line["bytes"] <= 256 << 10
    for f in d.iterdir():
        f.unlink()
    after = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert after["bytes"] == (256 << 10) - room  # (given back with the names)
    quota(pool, "--user", alice.name, "--clear")


def test_a_longer_name_is_growth_its_folders_owner_is_charged(pool: Mounted) -> None:
    """A rename to a longer name costs its folder's owner the difference: refused past
    her quota, as a new name is; a shorter one is not growth."""
    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice)
    run_as(alice, f"open({str(d / 'f')!r}, 'wb').close(); print(1)")
    used = line_of(quota(pool, "--user", alice.name), alice.uid)["bytes"]
    quota(pool, "--user", alice.name, "--bytes", str(used))  # (at her quota now)
    got = run_as(alice, f"""
d = {str(d)!r}
print(json.dumps([attempt(os.rename, d + "/f", d + "/" + "g" * 40),
                  attempt(os.rename, d + "/f", d + "/h")]))
""")
    assert got == [errno.EDQUOT, "ok"]
    quota(pool, "--user", alice.name, "--clear")


def test_links_to_her_file_from_his_folder_are_his_cost(pool: Mounted) -> None:
    """A name was charged to its file's owner: bob, linking alice's 0666 file from his
    own folder 2,788 times with long names, spent her quota (her next write was EDQUOT)
    and she could not remove his links.  A name is its folder's owner's now: bob's
    links stop at his own quota, hers is as it was, and his unlinks give his back."""
    from mxfs.meta.usage import NAME_ROW

    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    hers = empty_home_with_quota(pool, alice, "--bytes", "1MiB")
    his = empty_home_with_quota(pool, bob, "--bytes", "128KiB")
    run_as(alice, f"""
with open({str(hers / "f")!r}, "wb") as f:
    f.write(b"a" * (512 << 10))
os.chmod({str(hers / "f")!r}, 0o666)
print(1)
""")
    before = quota(pool)
    alices = line_of(before, alice.uid)["bytes"]
    room = (128 << 10) - line_of(before, bob.uid)["bytes"]
    made, code = run_as(bob, f"""
made = 0
try:
    for i in range(4000):
        os.link({str(hers / "f")!r}, {str(his)!r} + "/" + f"{{i:05d}}" + "n" * 235)
        made += 1
    print(json.dumps([made, 0]))
except OSError as e:
    print(json.dumps([made, e.errno]))
""")
    assert code == errno.EDQUOT and made == room // (240 + NAME_ROW)
    after = quota(pool)
    assert line_of(after, alice.uid)["bytes"] == alices  # (not a byte of hers)
    assert line_of(after, bob.uid)["name_bytes"] >= made * (240 + NAME_ROW)
    os.link(hers / "f", his / "roots")  # (root is never refused, in anyone's folder)
    wrote = run_as(alice, f"""
with open({str(hers / "g")!r}, "wb") as f:
    f.write(b"a" * (256 << 10))
print(json.dumps(os.stat({str(hers / "g")!r}).st_size))
""")
    assert wrote == 256 << 10
    run_as(bob, f"""
for n in os.listdir({str(his)!r}):
    os.unlink({str(his)!r} + "/" + n)
print(1)
""")
    gone = quota(pool)
    assert line_of(gone, bob.uid)["bytes"] == (128 << 10) - room  # (given back to him)
    assert line_of(gone, alice.uid)["bytes"] == alices + (256 << 10) + 1 + NAME_ROW
    for d, user in ((hers, alice), (his, bob)):
        for f in d.iterdir():
            f.unlink()
        quota(pool, "--user", user.name, "--clear")


def test_creates_at_once_are_charged_before_their_files_are_made(pool: Mounted) -> None:
    """A direct create's chunk files are opened off the daemon's thread: one user's 16
    creates at once, each of 600 KiB under a 1 MiB quota, each passed the quota check
    before any had reserved its size.  Only one is made now."""
    alice = ensure_users()["alice"]
    d = empty_home_with_quota(pool, alice, "--bytes", "1MiB")
    made = run_as(alice, f"""
import threading
from mxfs.client import ControlClient
clients = [ControlClient({str(pool.path)!r}) for _ in range(16)]
out, start = [], threading.Barrier(16)
def create(i):
    start.wait()
    try:
        c = clients[i]
        reply, fds = c.call_with_fds("create", path=c.pool_path({str(d)!r} + f"/c{{i}}"),
                                     size=600 << 10)
        out.append("ok")
    except OSError as e:
        out.append(e.errno)
threads = [threading.Thread(target=create, args=(i,)) for i in range(16)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(sorted(out, key=str)))
""")
    assert made.count("ok") == 1 and made.count(errno.EDQUOT) == 15, made
    quota(pool, "--user", alice.name, "--clear")


FILL = """
def fill(path, most, piece=64 << 10):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    wrote = 0
    try:
        while wrote < most:
            wrote += os.write(fd, b"s" * piece)
    except OSError as e:
        return wrote, e.errno
    finally:
        os.close(fd)
    return wrote, 0
"""

CHOWN_AS = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Sets(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
libc.setfsuid(int(sys.argv[1]))  # (drops CAP_CHOWN from the effective set: raised again)
header, sets = Header(0x20080522, 0), (Sets * 2)()
assert libc.capget(ctypes.byref(header), sets) == 0
sets[0].effective |= 1  # CAP_CHOWN
assert libc.capset(ctypes.byref(header), sets) == 0
try:
    os.chown(sys.argv[2], int(sys.argv[3]), -1)
    print(json.dumps("ok"))
except OSError as e:
    print(json.dumps(e.errno))
"""


def chown_as(uid: int, path: Path, owner: int) -> object:
    """chown `path` to `owner` as `uid` with CAP_CHOWN (as a user namespace's root is,
    over the uids it maps): "ok" or the errno."""
    res = subprocess.run([sys.executable, "-c", CHOWN_AS, str(uid), str(path), str(owner)],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(res.stdout)


def test_a_users_subordinate_uids_share_her_quota(pool: Mounted) -> None:
    """A user's subordinate uids (/etc/subuid: her rootless containers run as them) own
    what she owns for her quota: counted apart, each of her 65,536 had the whole of it.
    A chown that gives a file to another user (a namespace's root may, over the uids it
    maps) is growth of his, checked against his quota; one among her uids is not."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    subs = subordinate_uids(alice)
    d = empty_home_with_quota(pool, alice, "--bytes", "8MiB")
    box = pool.path / "alice-container"  # (her container's root: her first subordinate uid)
    shutil.rmtree(box, ignore_errors=True)
    box.mkdir()
    os.chown(box, subs[0], alice.gid)
    box.chmod(0o777)
    # (the daemon reads /etc/subuid again within a second of its change)
    assert eventually(lambda: [r["uid"] for r in quota(pool, "--user", str(subs[1]))["users"]]
                      == [alice.uid])
    mine = run_as(alice, FILL + f"print(json.dumps(fill({str(d / 'a')!r}, 5 << 20)))")
    assert mine == [5 << 20, 0]
    container = User("sub", subs[0], alice.gid, (alice.gid,))
    theirs = run_as(container, FILL + f"print(json.dumps(fill({str(box / 'b')!r}, 8 << 20)))")
    assert theirs[1] == errno.EDQUOT and (2 << 20) <= theirs[0] <= 3 << 20
    another = User("sub1", subs[1], alice.gid, (alice.gid,))
    more = run_as(another, f"""
def put():
    with open({str(box / 'c')!r}, "wb") as f:
        f.write(b"c" * 65536)
print(json.dumps(attempt(put)))
""")
    assert more == errno.EDQUOT
    line = line_of(quota(pool, "--user", alice.name), alice.uid)
    assert (8 << 20) - (64 << 10) <= line["bytes"] <= 8 << 20
    assert line_of(quota(pool, "--user", str(subs[0])), alice.uid) == line  # (hers)
    assert not any(r["uid"] in subs for r in quota(pool)["users"])
    quota(pool, "--user", bob.name, "--bytes", "1MiB")
    assert chown_as(alice.uid, box / "b", bob.uid) == errno.EDQUOT  # (past bob's quota)
    assert (box / "b").stat().st_uid == subs[0]
    assert chown_as(alice.uid, box / "b", subs[7]) == "ok"  # (hers still)
    assert line_of(quota(pool, "--user", alice.name), alice.uid)["bytes"] == line["bytes"]
    os.chown(box / "b", bob.uid, -1)  # (root is never refused)
    refused = mxfs("quota", str(pool.path), "--user", str(subs[3]), "--bytes", "1GiB",
                   check=False)
    assert f"uid {alice.uid}" in one_line_error(refused)  # (hers holds for it)
    shutil.rmtree(box)
    quota(pool, "--user", alice.name, "--clear")
    quota(pool, "--user", bob.name, "--clear")


def test_quotas_and_usage_survive_a_remount_and_show_in_status(pool: Mounted) -> None:
    """The tally counted afresh at mount (`MetaStore.count_usage`) is the one the changes
    moved: a file's block at least, a KV chunk's key included."""
    from mxfs.meta.usage import BLOCK, NAME_ROW

    bob = ensure_users()["bob"]
    d = home(pool, bob)
    quota(pool, "--default", "--bytes", "64MiB", "--inodes", "1000")
    start = line_of(quota(pool), bob.uid)
    (d / "kept").write_bytes(b"k" * 12345)
    (d / "one").write_bytes(b"1")
    for f in ("kept", "one"):
        os.chown(d / f, bob.uid, bob.gid)
    run_as(bob, f"""
import base64
c = mxfs.client.ControlClient({str(pool.path)!r})
c.call("kv_put", namespace="kept", keys=[base64.b64encode(b"k" * 1000).decode()],
       data=[base64.b64encode(b"1").decode()])
print(1)
""")
    before = line_of(quota(pool), bob.uid)
    assert files_bytes(before) - files_bytes(start) == 12345 + 2 * BLOCK
    assert before["name_bytes"] - start["name_bytes"] == \
        len(b"keptone") + len("kept") + 1000 + 3 * NAME_ROW
    pool.umount()
    pool.remount()
    after = quota(pool)
    assert line_of(after, bob.uid) == before
    assert before["bytes_limit"] == 64 << 20 and not before["own"]
    assert after["default"] == {"bytes_limit": 64 << 20, "inodes_limit": 1000}
    text = mxfs("status", str(pool.path)).stdout
    assert f"uid {bob.uid}: " in text and "of 64.0 MiB" in text
    denied = run_as(bob, f"""
print(json.dumps(attempt(os.truncate, {str(d / "kept")!r}, 65 << 20)))
""")
    assert denied == errno.EDQUOT  # enforced from the remount on, counted afresh
    quota(pool, "--default", "--clear")
    assert quota(pool)["default"] == {"bytes_limit": 0, "inodes_limit": 0}


def test_quota_refusals_are_one_line(pool: Mounted) -> None:
    alice = ensure_users()["alice"]
    for args, says in ((("--bytes", "1G"), "needs --user or --default"),
                       (("--user", "no-such-user-here", "--bytes", "1G"), "no user named"),
                       (("--user", "0", "--bytes", "1G"), "root has no quota"),
                       (("--user", "1", "--clear", "--bytes", "1G"), "--clear"),
                       (("--user", "1", "--inodes", "-3"), "bad inode count"),
                       (("--default",), "--default only goes with")):
        res = mxfs("quota", str(pool.path), *args, check=False)
        assert res.returncode != 0 and says in one_line_error(res), (args, res.stderr)
    refused = run_as(alice, f"""
c = mxfs.client.ControlClient({str(pool.path)!r})
try:
    c.call("quota", set=True, uid={alice.uid}, bytes=1 << 40)
    print(json.dumps(None))
except OSError as e:
    print(json.dumps([e.errno, str(e)]))
""")
    assert refused[0] == errno.EPERM and "only root sets quotas" in refused[1]


def test_a_commit_whose_path_now_leads_to_anothers_folder_is_charged_there_or_refused(
        pool: Mounted) -> None:
    """A direct file's name is charged to the owner of the folder it is committed into,
    judged at the create for the folder its path led to then.  Alice made hers through
    a link to her own folder and moved the link to bob's (open to all) before the
    commit: the name landed in his, past his quota, unjudged.  The commit judges it."""
    users = ensure_users()
    alice, bob = users["alice"], users["bob"]
    hers = empty_home_with_quota(pool, alice)
    his = empty_home_with_quota(pool, bob)
    his.chmod(0o777)
    used = line_of(quota(pool), bob.uid)["bytes"]
    name = "n" * 200  # (charged NAME_ROW and its bytes: more than the room he has)
    quota(pool, "--user", bob.name, "--bytes", str(used + 100))
    got = run_as(alice, f"""
from mxfs.client.writer import create_file
hers, his = {str(hers)!r}, {str(his)!r}
os.mkdir(hers + "/sub")
os.symlink(hers + "/sub", hers + "/l")
w = create_file(hers + "/l/{name}", 16)
w.write_at(0, memoryview(bytearray(b"x" * 16)))
os.unlink(hers + "/l")
os.symlink(his, hers + "/l")
print(json.dumps(attempt(w.commit, 16)))
""")
    assert got == errno.EDQUOT, got
    assert not (his / name).exists()
    assert line_of(quota(pool), bob.uid)["bytes"] == used
    quota(pool, "--user", bob.name, "--clear")
    his.chmod(0o755)

"""Real unprivileged users for permission tests, and a way to run code as one of them."""

from __future__ import annotations

import fcntl
import grp
import json
import pwd
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

TEAM = "mxfs-team"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def ensure_users() -> dict[str, User]:
    """mxfs-alice and mxfs-bob (bob in group mxfs-team), made with useradd if missing
    (under a lock: test processes running side by side would race to add them)."""
    with open("/run/lock/mxfs-test-users", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_users()


def _ensure_users() -> dict[str, User]:
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", TEAM], check=True, capture_output=True)
    out = {}
    for name, extra in (("mxfs-alice", []), ("mxfs-bob", ["-G", TEAM])):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *extra, name],
                           check=True, capture_output=True)
        pw = pwd.getpwnam(name)
        groups = tuple(sorted(set(__import__("os").getgrouplist(name, pw.pw_gid))))
        out[name.removeprefix("mxfs-")] = User(name, pw.pw_uid, pw.pw_gid, groups)
    return out


PRELUDE = """
import json, os, sys, errno
import mxfs.client, mxfs.client.writer, mxfs.kv  # before dropping root
{load}uid, gid, groups = {uid}, {gid}, {groups}
os.setgroups(list(groups)); os.setgid(gid); os.setuid(uid)
def attempt(fn, *a, **kw):
    try:
        r = fn(*a, **kw)
        return "ok" if r is None or r is True or not isinstance(r, (int, str)) else r
    except OSError as e:
        return e.errno
"""


def as_user(user: User | None, script: str, *args: str) -> list[str]:
    """The command that runs `script` (after PRELUDE) as `user` (None: nobody, 65534)."""
    uid, gid, groups = (user.uid, user.gid, user.groups) if user else (65534, 65534, ())
    # mxfs.load imports torch: 1.5 s of CPU a script, paid only by the scripts using it.
    load = "import mxfs.load\n" if "mxfs.load" in script or "torch" in script else ""
    code = PRELUDE.format(uid=uid, gid=gid, groups=tuple(groups), load=load) + script
    return [sys.executable, "-c", code, *args]


def run_as(user: User | None, script: str, *args: str) -> Any:
    """Run `script` (after PRELUDE) as `user` (None: nobody, 65534); its stdout as JSON."""
    res = subprocess.run(as_user(user, script, *args), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def subordinate_uids(user: User) -> range:
    """`user`'s subordinate uids (/etc/subuid, as rootless containers use them), given
    her with usermod where useradd gave none: after the last range the file holds."""
    def ranges() -> list[tuple[str, int, int]]:
        try:
            with open("/etc/subuid") as f:
                rows = [line.strip().split(":") for line in f if line.count(":") == 2]
        except FileNotFoundError:
            return []
        return [(name, int(start), int(count)) for name, start, count in rows]
    with open("/run/lock/mxfs-test-users", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mine = [(s, c) for name, s, c in ranges() if name in (user.name, str(user.uid))]
        if not mine:
            start = max([100_000] + [s + c for _, s, c in ranges()])
            subprocess.run(["usermod", "--add-subuids", f"{start}-{start + 65535}", user.name],
                           check=True, capture_output=True)
            mine = [(start, 65536)]
    return range(mine[0][0], mine[0][0] + mine[0][1])

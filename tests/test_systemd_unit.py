"""The systemd unit's sandbox, applied by hand (its bounding set and no_new_privs by
setpriv, its umask): the daemon still serves every user, and keeps the guards its
capabilities give.  (systemd is not PID 1 here: the unit itself is never started.)"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import shutil
import socket
import tempfile
from pathlib import Path

from conftest import mkfs, mount_with, needs_fuse
from test_direct_write import _keeps_immutable
from users import ensure_users, run_as

from mxfs.client.writer import create_file
from mxfs.fs.startup import EXTEND_S

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "mxfs@.service"


def service_settings() -> dict[str, str]:
    """The unit's [Service] settings (the last of a repeated key)."""
    section, out = "", {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def unit_nofile(settings: dict[str, str]) -> int:
    """The unit's descriptor limit as set here: systemd sets the closest it can (the
    hard limit it may raise to: a container's may be lower)."""
    return min(int(settings["LimitNOFILE"]), resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def sandboxed(settings: dict[str, str], runtime: str) -> list[str]:
    """A command prefix that starts the daemon as the unit would confine it."""
    caps = ",".join("+" + c.lower().removeprefix("cap_")
                    for c in settings["CapabilityBoundingSet"].split())
    nofile = unit_nofile(settings)
    return ["env", f"MXFS_RUNTIME_DIR={runtime}", "prlimit", f"--nofile={nofile}:{nofile}",
            "setpriv", f"--bounding-set=-all,{caps}",
            *(["--no-new-privs"] if settings.get("NoNewPrivileges") == "yes" else []),
            "sh", "-c", f'umask {settings["UMask"]} && exec "$@"', "sh"]


ASK = """
from mxfs.client import ControlClient
with ControlClient(sys.argv[1]) as c:
    print(json.dumps(c.stat()["pid"]))
"""


@needs_fuse
def test_the_daemon_serves_within_the_units_sandbox(members: list[str]) -> None:
    """Under the unit's bounding set, no_new_privs and umask 0077 the daemon mounts, a
    user reaches its control socket (the runtime folder it makes is 0755 whatever the
    umask), and a dropped file's kept descriptors are refused more blocks (the
    immutable flag: CAP_LINUX_IMMUTABLE); its descriptor limit is the unit's."""
    settings = service_settings()
    assert settings.get("UMask") == "0077" and settings.get("NoNewPrivileges") == "yes"
    alice = ensure_users()["alice"]
    base = tempfile.mkdtemp(prefix="mxfs-unit-")
    os.chmod(base, 0o755)
    mkfs(members)
    try:
        with mount_with(members, prefix=sandboxed(settings, f"{base}/mxfs")) as m:
            assert run_as(alice, ASK, str(m.path)) == m.daemon_pid()
            nofile = unit_nofile(settings)  # (its tenants' descriptors: a share each)
            assert resource.prlimit(m.daemon_pid(), resource.RLIMIT_NOFILE)[0] == nofile
            libc = ctypes.CDLL(None, use_errno=True)
            libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long,
                                       ctypes.c_long]
            w = create_file(str(m.path / "dropped.bin"), 4096)
            kept = [os.dup(fd) for fd in w.fds.values()]
            w.abort()
            try:
                if _keeps_immutable(members[0]):
                    assert all(libc.fallocate(fd, 1, 0, 1 << 20) != 0
                               and ctypes.get_errno() == errno.EPERM for fd in kept)
            finally:
                for fd in kept:
                    os.close(fd)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_fuse
def test_a_starting_daemon_asks_systemd_for_time_before_it_says_ready(
        members: list[str], tmp_path: Path) -> None:
    """A mount's work before it serves grows with the pool, past systemd's start
    timeout (a killed start begins again from scratch, for ever): the daemon asks for
    EXTEND_S more as it goes (EXTEND_TIMEOUT_USEC), then says READY=1; the unit's
    TimeoutStartSec leaves room for a first step longer than that."""
    timeout = service_settings()["TimeoutStartSec"]
    assert timeout.endswith("min") and int(timeout[:-3]) * 60 > EXTEND_S
    mkfs(members)
    where = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listen:
        listen.bind(where)
        listen.settimeout(30)
        with mount_with(members, prefix=["env", f"NOTIFY_SOCKET={where}"]):
            said = []
            while "READY=1" not in said:
                said.append(listen.recv(4096).decode())
    assert said[0] == f"EXTEND_TIMEOUT_USEC={EXTEND_S * 1_000_000}"

"""The daemon's TCP ports: none a tenant can hold while it is down (fs/ports.py)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import mkfs, mount_with, mxfs, needs_fuse, node_net, one_line_error
from users import as_user, ensure_users

from mxfs.client import ControlClient

pytestmark = needs_fuse

CHUNK_PORT, METRICS_PORT = 570, 590  # (docs/operations.md's)

# Listen on argv[1]:argv[2] (port 0: one the kernel picks) and say so, or the errno;
# then hold the port until stdin closes.
HOLD = """
import socket
s = socket.socket()
try:
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen()
except OSError as e:
    print(json.dumps(e.errno), flush=True)
    sys.exit(0)
print(json.dumps(s.getsockname()[1]), flush=True)
sys.stdin.read()
"""


@contextmanager
def _holding(argv: list[str]) -> Iterator[int]:
    """Run a HOLD command; its answer (the port held, or the errno it got) while it runs."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield json.loads(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_a_tenant_cannot_hold_the_daemons_ports_while_it_is_down(
        members: list[str], tmp_path: Path) -> None:
    """A tenant who binds the chunk or metrics port while the daemon is down (a crash,
    systemd's RestartSec, boot) kept every later start failing with EADDRINUSE, until
    systemd gave up: the pool gone for everyone.  A port any user may bind is refused
    at mount, naming the fix; one below ip_unprivileged_port_start she cannot bind at
    all, and the daemon comes up on it."""
    alice = ensure_users()["alice"]
    mkfs(members)
    mp = tmp_path / "mnt"
    mp.mkdir()
    start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    with _holding(as_user(alice, HOLD, "127.0.0.1", "0")) as port:
        assert port >= start
        for option in (f"chunk_port={port}", f"metrics_port={port}"):
            line = one_line_error(mxfs("mount", "-o", option, members[0], str(mp),
                                       check=False))
            assert option in line and "any user may bind" in line, line
            assert f"choose a port below {start}" in line, line
    for option in ("chunk_port=700", "metrics_port=1023"):  # (nodes connect out from
        line = one_line_error(mxfs("mount", "-o", option, members[0], str(mp),  # these)
                                   check=False))
        assert option in line and "choose a port below 600" in line, line
    with node_net() as net:  # (a network of its own: every privileged port free there)
        for port in (CHUNK_PORT, METRICS_PORT):
            with _holding([*net.enter, *as_user(alice, HOLD, "0.0.0.0", str(port))]) as got:
                assert got == errno.EACCES
        with mount_with(members, f"chunk_port={CHUNK_PORT}", f"metrics_port={METRICS_PORT}",
                        prefix=net.enter) as m:
            with ControlClient(str(m.path)) as c:
                assert c.stat()["chunk_service"]["port"] == CHUNK_PORT
            with open(f"/proc/{m.daemon_pid()}/net/tcp") as f:  # (the daemon's network's)
                listening = [line.split()[1] for line in f if line.split()[3] == "0A"]
            assert f"0100007F:{METRICS_PORT:04X}" in listening


# (a mount that fails once its volume is open leaves it to be recovered by the next)
@pytest.mark.daemon_log(r"recovered pool .*unclean=True")
def test_a_port_in_use_is_one_line_naming_who_holds_it(members: list[str],
                                                       tmp_path: Path) -> None:
    """A privileged port held by another service (or a daemon not yet gone): the mount
    says whose it is, not only EADDRINUSE."""
    mkfs(members)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with node_net() as net:
        for option, port in (("chunk_port", CHUNK_PORT), ("metrics_port", METRICS_PORT)):
            with _holding([*net.enter, sys.executable, "-c", "import json, sys\n" + HOLD,
                           "0.0.0.0", str(port)]) as held:
                assert held == port
                res = subprocess.run([*net.enter, sys.executable, "-m", "mxfs", "mount", "-o",
                                      f"{option}={port}", members[0], str(mp)],
                                     capture_output=True, text=True, timeout=120)
                line = one_line_error(res)
                assert f"127.0.0.1:{port} (Address already in use): held by root (uid 0)" \
                    in line, line
                assert f"ss -ltnp 'sport = :{port}'" in line, line

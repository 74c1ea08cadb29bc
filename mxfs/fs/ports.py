"""The daemon's TCP ports (`chunk_port`, `metrics_port`): only ones no tenant can hold.

Any user may bind a port at or above the network namespace's
`net.ipv4.ip_unprivileged_port_start` (1024 by default).  While the daemon is down (a
crash, the 5 s between systemd's restarts, boot) a tenant could take a fixed one, and
every start after would fail with EADDRINUSE until systemd gave the unit up: the pool
gone for every tenant.  So mount refuses a fixed port a user may bind, with the fix (a
port below that start, which the daemon binds as root or with CAP_NET_BIND_SERVICE;
the documented ones are below 600, where nodes' outgoing connections, from reserved
ports of [600, 1024), never take it: `io/chunk_client.py`).  `chunk_port=0` stays: the
kernel picks a free ephemeral port at each start and the other nodes read it from the
daemon's lease row (`Volume.announce`, made once bound), so no one can hold it in
advance (one who takes the port of the start before gets the connections of nodes not
yet told the new one, and cannot answer them: the key is proved both ways).

Not systemd socket activation (.socket units holding the listeners across restarts):
that closes the hole under systemd only (a mount by hand has it again), writes each
port twice (the unit and the pool's options, free to disagree), and the port is
anyone's again whenever the socket unit itself stops (an upgrade, a port changed).  A
privileged port closes it wherever the daemon runs, with the capability the unit
grants already.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from mxfs.errors import MxfsError
from mxfs.fs.socket_owner import listener_uids
from mxfs.io.chunk_client import RESERVED_LOW
from mxfs.text import user_name

UNPRIVILEGED_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
PORTS = ("chunk_port", "metrics_port")


def unprivileged_start() -> int:
    """The first port any user may bind here (this network namespace's; 1024 on kernels
    before 4.11, which have no such setting)."""
    try:
        with open(UNPRIVILEGED_START) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1024


def check_ports(own: Mapping[str, str]) -> None:
    """MxfsError for a fixed `chunk_port` or `metrics_port` that any user may bind, or
    that a node's outgoing connection may hold (from RESERVED_LOW up)."""
    start = unprivileged_start()
    for option in PORTS:
        port = int(own.get(option) or 0)  # (chunk_port=0: a fresh one each start)
        if port and RESERVED_LOW <= port < min(start, 1024):
            raise MxfsError(
                f"mount option {option}={port}: nodes connect to each other from ports "
                f"{RESERVED_LOW} to 1023, and one such connection holding it while the "
                "daemon restarts keeps it from starting", f"choose a port below {RESERVED_LOW}")
        if port and port >= start:
            ephemeral = ", or chunk_port=0 (a free port each start, which the nodes read " \
                "from its lease)" if option == "chunk_port" else ""
            below = f"choose a port below {start}" if start > 1 else \
                "set net.ipv4.ip_unprivileged_port_start back to 1024 (every port is " \
                "anyone's here) and choose a port below it"
            raise MxfsError(
                f"mount option {option}={port}: any user may bind that port (ports from "
                f"{start} up: net.ipv4.ip_unprivileged_port_start), and one who holds it "
                "while the daemon restarts keeps it from ever starting again",
                below + ephemeral)


def listen_error(what: str, option: str, addr_option: str, host: str, port: int,
                 e: OSError) -> MxfsError:
    """The one line for a listener that could not be opened: who holds a port in use
    (`listener_uids`), or that binding a privileged one needs root."""
    # (the errno's own words: socket.create_server's strerror names the address again)
    problem = f"{what} cannot listen on {host}:{port} " \
        f"({os.strerror(e.errno) if e.errno else e})"
    fix = f"choose a free port (-o {option}=N) and an address of this host " \
        f"(-o {addr_option}=IP)"
    if e.errno == errno.EADDRINUSE:
        uids = sorted(set(listener_uids(host, port)))
        who = ", ".join(user_name(u, with_uid=True) for u in uids)
        problem += f": held by {who}" if uids else ": held by a socket whose owner was not found"
        fix = f"stop what holds it (ss -ltnp 'sport = :{port}' names it) or {fix}"
    elif e.errno == errno.EACCES:
        fix = f"mount as root (or with CAP_NET_BIND_SERVICE) to listen on port {port}, " \
            f"or {fix}"
    return MxfsError(problem, fix)



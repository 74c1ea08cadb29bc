"""Another node on this machine: a network namespace joined to the host by a veth pair.

The tests (`conftest.node_net`) and the multi-node benchmark (`tools/bench_nodes.py`)
run a pool's other nodes this way: a daemon started under `nsenter --net` (the `enter`
prefix) has the node's network and this machine's files and mounts, so its FUSE mount
is visible here.  Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The runner's loop: a JSON argv (and timeout) a line in, [returncode, stdout, stderr] out.
_RUNNER = """
import json, subprocess, sys
for line in sys.stdin:
    argv, timeout = json.loads(line)
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        out = [r.returncode, r.stdout, r.stderr]
    except subprocess.TimeoutExpired:
        out = [-9, "", f"{argv[0]} ran past {timeout} s"]
    print(json.dumps(out), flush=True)
"""


class Runner:
    """Runs a node's commands (ip, tc) from a process started with the node, before
    any file on a mount is open.  A process forked later, while files on a throttled
    node are open for writing, would wait in its exec for their flushes (every close
    flushes, as on NFS, and a child closes the descriptors it inherited at exec), and
    the throttle it was to lift holds those: `tc` could not start for minutes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _RUNNER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def run(self, argv: list[str], check: bool = False,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps([argv, timeout]) + "\n")
            self.proc.stdin.flush()
            rc, out, err = json.loads(self.proc.stdout.readline())
        done = subprocess.CompletedProcess(argv, rc, out, err)
        if check:
            done.check_returncode()
        return done

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@dataclass
class NodeNet:
    """The node's namespace `ns`, the host side of its link `link` at `host_ip`, the
    node at `node_ip`."""

    ns: str
    link: str
    host_ip: str
    node_ip: str
    peer: str = ""  # the node's side of the link, inside `ns`
    runner: Runner = field(default_factory=Runner, repr=False)

    @property
    def enter(self) -> list[str]:
        """A command prefix that runs a process in the node's network only."""
        return ["nsenter", f"--net=/var/run/netns/{self.ns}"]

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a command as a process of that node (`ip netns exec`: its own network;
        the files are this machine's)."""
        return self.runner.run(["ip", "netns", "exec", self.ns, *argv], timeout=timeout)

    def cut(self, down: bool = True) -> None:
        """Partition the node from the host (or heal it).  Healing also forgets the
        neighbours each side failed to resolve while cut: the kernel would answer
        EHOSTUNREACH for a few seconds more, which is no partition any longer."""
        self.runner.run(["ip", "link", "set", self.link, "down" if down else "up"],
                        check=True)
        if not down:
            self.runner.run(["ip", "neigh", "flush", "dev", self.link])
            self.runner.run(["ip", "-n", self.ns, "neigh", "flush", "dev", self.peer])

    def slow(self, rate: str | None, sends: bool = False) -> None:
        """Limit what the host sends the node (or, `sends`, what the node sends the
        host) to `rate` (tc's tbf: "4mbit"), as a slow or distant node's link; None
        lifts the limit."""
        where = ["ip", "netns", "exec", self.ns] if sends else []
        dev = self.peer if sends else self.link
        if rate is None:
            self.runner.run([*where, "tc", "qdisc", "del", "dev", dev, "root"])
            return
        self.runner.run([*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                         rate, "burst", "32kbit", "latency", "500ms"], check=True)


@contextmanager
def node_net(tag: str, subnet: str) -> Iterator[NodeNet]:
    """A node in a namespace of its own (named by `tag`, at `subnet`.2, the host at
    `subnet`.1, e.g. "10.231.0"), removed afterwards."""
    peer = f"mxn{tag}"
    net = NodeNet(f"mxfs-node-{tag}", f"mxh{tag}", f"{subnet}.1", f"{subnet}.2", peer)
    steps = [["ip", "netns", "add", net.ns],
             ["ip", "link", "add", net.link, "type", "veth", "peer", "name", peer],
             ["ip", "link", "set", peer, "netns", net.ns],
             ["ip", "addr", "add", f"{net.host_ip}/24", "dev", net.link],
             ["ip", "link", "set", net.link, "up"],
             ["ip", "netns", "exec", net.ns, "ip", "addr", "add", f"{net.node_ip}/24", "dev",
              peer],
             ["ip", "netns", "exec", net.ns, "ip", "link", "set", peer, "up"],
             ["ip", "netns", "exec", net.ns, "ip", "link", "set", "lo", "up"],
             # Other nodes' subnets through the host (which forwards while `forwarding`).
             ["ip", "netns", "exec", net.ns, "ip", "route", "add", "default", "via",
              net.host_ip]]
    try:
        for step in steps:
            net.runner.run(step, check=True)
        yield net
    finally:
        net.runner.run(["ip", "link", "del", net.link])
        net.runner.run(["ip", "netns", "del", net.ns])
        net.runner.close()


@contextmanager
def forwarding() -> Iterator[None]:
    """The host forwards between its links while inside: nodes in two namespaces reach
    each other (each routes through the host), as nodes on one network do."""
    path = "/proc/sys/net/ipv4/ip_forward"
    with open(path) as f:
        before = f.read().strip()
    with open(path, "w") as f:
        f.write("1")
    try:
        yield
    finally:
        with open(path, "w") as f:
            f.write(before)


def usable() -> bool:
    """Can this process make namespaces (root, with iproute2)?"""
    from shutil import which

    return os.geteuid() == 0 and which("ip") is not None and which("nsenter") is not None

"""A real PostgreSQL server for the tests: a cluster made with initdb in a temporary
folder, run as an unprivileged user on a Unix socket only (no TCP), started once per
test session and stopped at its end; one fresh database per test.  A test that stops
or fills the server takes a cluster of its own (`private`), so the shared one is never
disturbed.

Skipped with the reason when the server's binaries are missing (`apt-get install
postgresql`, or tools/install.sh), except under CI, where that is a failure.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

_count = itertools.count(1)


def bindir() -> str | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(d, "initdb")):
            return d
    found = shutil.which("initdb")
    return os.path.dirname(found) if found else None


class Server:
    def __init__(self, folder: str, user: str | None, bin_dir: str) -> None:
        self.folder, self.user, self.bin_dir = folder, user, bin_dir
        self.data = os.path.join(folder, "data")
        self.sock = folder
        self.log = os.path.join(folder, "log")

    def url(self, db: str) -> str:
        return f"postgresql:///{db}?host={self.sock}&user=postgres"

    def run(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    def ctl(self, *args: str) -> None:
        self.run(os.path.join(self.bin_dir, "pg_ctl"), "-D", self.data, *args)

    def start(self) -> None:
        """Start the cluster (again) and wait until it takes connections."""
        self.ctl("-w", "-l", self.log, "-o",
                 f"-k {self.sock} -c listen_addresses='' -c fsync=off -c max_connections=50",
                 "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the cluster: "fast" ends every session, "immediate" is a crash."""
        self.ctl("-m", mode, "-w", "stop")

    def processes(self) -> list[int]:
        """The postmaster and every process it started."""
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            master = int(f.readline())
        children = subprocess.run(["pgrep", "-P", str(master)], capture_output=True,
                                  text=True).stdout.split()
        return [master, *map(int, children)]

    def database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg
        name = f"t{os.getpid()}_{next(_count)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def start(bin_dir: str) -> Iterator[Server]:
    folder = tempfile.mkdtemp(prefix="mxfs-pg-")
    user = None
    if os.geteuid() == 0:  # the server refuses to run as root
        user = "postgres"
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            pytest.skip("no postgres user to run the server as (apt-get install postgresql)")
        os.chown(folder, pw.pw_uid, pw.pw_gid)
    s = Server(folder, user, bin_dir)
    try:
        s.run(os.path.join(bin_dir, "initdb"), "-D", s.data, "-U", "postgres",
              "--auth=trust", "--no-sync", "-E", "UTF8")
        s.start()
        yield s
    finally:
        if os.path.exists(os.path.join(s.data, "postmaster.pid")):
            s.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


def server_or_skip() -> Iterator[Server]:
    """The binaries found, a cluster started and stopped after (or the test skipped)."""
    d = bindir()
    if d is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL's binaries are missing in CI (tools/install.sh installs them)")
        pytest.skip("PostgreSQL's binaries are missing: apt-get install postgresql")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed")
    yield from start(d)


private = server_or_skip  # a cluster of the caller's own, to stop, restart or fill

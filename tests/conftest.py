"""Fixtures: real pools of folder members, really mounted through FUSE."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import netns
import pytest
from netns import NodeNet

from mxfs.pool.revoke import HELD_DIR, set_immutable

# A test fails on a WARNING or ERROR its daemons log that it does not expect.
pytest_plugins = ["daemon_log"]

# The session's daemons keep their sockets and logs in a folder of its own, so the
# logs a test is checked against are its session's alone (not another suite's running
# beside it), and nothing piles up where real mounts keep theirs.
# (pytest-xdist's workers inherit the controller's environment: each takes its own.)
if os.geteuid() == 0 and (os.environ.get("PYTEST_XDIST_WORKER")
                          or not os.environ.get("MXFS_RUNTIME_DIR")):
    os.environ["MXFS_RUNTIME_DIR"] = f"/run/mxfs/tests-{os.getpid()}"

# What a daemon logs after a crash it recovered from: tests that kill one expect it.
CRASH = r"recovered pool \S+: unclean=True"

HAVE_FUSE = os.geteuid() == 0 and os.path.exists("/dev/fuse")
needs_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")
# Set by `make test-engines`: there an engine that does not import is a failure, not a skip.
REQUIRE_ENGINES = bool(os.environ.get("MXFS_REQUIRE_ENGINES"))


# The suite's layers (pytest -m LAYER; docs in CONTRIBUTING.md).  A module's layer is
# named here, or `mount` (the default: it mounts real pools); a test of another module
# that needs nothing may say `@pytest.mark.unit` itself; `pg` is added to tests that
# need PostgreSQL.  `unit` modules need no root, no mount and no server, and run in
# under a minute: `make test-fast` runs them with the `smoke` mount tests.
LAYERS = {
    "unit": {"test_header_fuzz", "test_io_engine", "test_xattr_pace", "test_kv_keys", "test_layout",
             "test_meta_conformance", "test_meta_sqlite", "test_ttft_model", "test_reuse_policy",
             "test_ckpt_partials", "test_read_ahead", "test_node_holds",
             "test_node_grants", "test_inode_cache", "test_tenants",
             "test_member_calls", "test_invalidations", "test_lanes", "test_closer",
             "test_lease_probe", "test_kernel_cache", "test_gc_keeper", "test_loop_watch"},
    "faults": {"test_faults", "test_hostile", "test_shared_node", "test_soak", "test_quota",
               "test_tenancy", "test_meta_pg_faults", "test_offline_lock"},
    "pg": {"test_meta_pg_mount", "test_lease"},
    "engines": {"test_vllm", "test_kv_adapters", "test_kv_lmcache", "test_kv_vllm",
                "test_bench_peers"},
}
_LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "also_postgres: run again with the pool's metadata "
                            "on a PostgreSQL server (the test's pool is `mounted`)")
    for layer, what in (("unit", "no root, no mount, no server; seconds"),
                        ("mount", "mounts real pools through FUSE (root, /dev/fuse)"),
                        ("faults", "faults, hostile users, crashes and soaks"),
                        ("pg", "needs a PostgreSQL server of ours"),
                        ("engines", "vLLM, SGLang, LMCache (make test-engines)"),
                        ("smoke", "a few mount tests that make test-fast adds to the units"),
                        ("nodes", "several nodes: network namespaces on this machine")):
        config.addinivalue_line("markers", f"{layer}: {what}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
        if item.get_closest_marker("unit") is None:  # (a pure test in a mount module)
            item.add_marker(_LAYER_OF.get(module, "mount"))
        params = getattr(item, "callspec", None)
        on_pg = "[postgresql" in item.nodeid or params is not None and \
            params.params.get("meta_engine") == "postgresql"
        if module in LAYERS["pg"] or on_pg:
            item.add_marker("pg")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked `also_postgres` runs twice: its pool's metadata in SQLite on member
    0, then on a PostgreSQL server (the `pg` layer)."""
    if metafunc.definition.get_closest_marker("also_postgres") is not None and \
            "meta_engine" in metafunc.fixturenames:
        metafunc.parametrize("meta_engine", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture(autouse=True)
def _layer(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tell `mxfs` which layer runs: a unit test that mounts fails (move it, or its
    module, out of `unit`)."""
    unit = request.node.get_closest_marker("unit") is not None
    os.environ["MXFS_TEST_UNIT"] = "1" if unit else ""
    yield
    os.environ.pop("MXFS_TEST_UNIT", None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Chunk files the daemons held aside for writers that kept descriptors are left
    immutable (`pool/revoke.py`): pytest could not remove this session's folders
    later (a later run with the same --basetemp stopped at once, an internal error),
    and /tmp grew on a developer's machine.  Their flags are cleared now."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None)
    if base is None:
        return
    for folder, _, files in os.walk(base):
        if folder.endswith(os.path.join("chunks", HELD_DIR)):
            for name in files:
                set_immutable(os.path.join(folder, name), False)


# Seconds each module took (setup, call and teardown of its tests), summed where the
# reports arrive (xdist's controller sees every worker's): the heaviest are printed at
# the end, so that a suite nearing CI's 20 minutes shows where its time went.
_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    heavy = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    if len(heavy) > 1:
        terminalreporter.write_sep("=", "heaviest modules (seconds, all workers)")
        for module, secs in heavy:
            terminalreporter.write_line(f"{secs:8.1f}  {module}")
        terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.1f}  in all")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if REQUIRE_ENGINES and report.skipped and call.excinfo is not None \
            and "could not import" in str(call.excinfo.value):
        report.outcome = "failed"
        report.longrepr = f"MXFS_REQUIRE_ENGINES is set, but {call.excinfo.value}"


def mxfs(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    if args[:1] == ("mount",):
        _not_in_a_unit()
    res = subprocess.run([sys.executable, "-m", "mxfs", *args], capture_output=True, text=True,
                         timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"mxfs {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


def cli(*args: str) -> tuple[int, str]:
    """The CLI's own code (`mxfs.cli.main`) run in this process: (exit code, what it
    printed to stderr).  For fixtures that make and unmount a pool some hundreds of
    times a run, where a Python process started for each (its imports) was a tenth of
    the suite's CPU.  Tests of the CLI itself run it as a user does (`mxfs`)."""
    from mxfs.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def _not_in_a_unit() -> None:
    assert not os.environ.get("MXFS_TEST_UNIT"), \
        "a unit test mounts a pool: its module belongs in another layer (conftest.LAYERS)"


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Two saved states are the same: tensors bit for bit (dtype and shape too), the
    containers and plain values equal and of one type."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.itemsize == 1
                           else a, b.view(torch.uint8) if b.dtype.is_floating_point
                           and b.itemsize == 1 else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b and type(a) is type(b), where


def one_line_error(res: subprocess.CompletedProcess) -> str:
    """Assert a user error: non-zero exit, one line on stderr, no traceback."""
    assert res.returncode != 0, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def eventually(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll until `predicate` holds; FUSE sends RELEASE after close() has returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def make_members(root: Path, n: int = 4) -> list[str]:
    paths = []
    for i in range(n):
        p = root / f"member{i}"
        p.mkdir(parents=True)
        paths.append(str(p))
    return paths


def mkfs(members: list[str], unit: str = "64KiB", *extra: str) -> None:
    args = ["mkfs", "--stripe-unit", unit]
    for m in members:
        args += ["--member", m]
    code, err = cli(*args, *extra)
    assert code == 0, f"mxfs {' '.join(args + list(extra))} failed ({code}): {err}"


def is_mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@dataclass
class Mounted:
    path: Path
    members: list[str]
    pid: int = 0
    check: bool = True  # checked for soundness after its last unmount (`unmount_and_check`)

    def daemon_pid(self) -> int:
        from mxfs.client import ControlClient

        with ControlClient(str(self.path)) as c:
            return int(c.server["pid"])

    def umount(self) -> None:
        mxfs("umount", str(self.path))

    def remount(self) -> None:
        mxfs("mount", "-o", "allow_other", self.members[0], str(self.path))


def raw_socket(m: Mounted, timeout: float = 30) -> socket.socket:
    """A bare connection to the mount's control socket, to send what no client would."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(os.getxattr(m.path, "user.mxfs.control").decode())
    return s


def force_unmount(path: str) -> None:
    if is_mounted(path):
        mxfs("umount", path, check=False)
    if is_mounted(path):
        subprocess.run(["umount", "-l", path], capture_output=True)


def chunk_files(members: list[str]) -> list[str]:
    return [os.path.join(dp, f) for m in members for dp, _, fs in os.walk(os.path.join(m, "chunks"))
            for f in fs]


def check_pool(members: list[str]) -> None:
    """The metadata passes SQLite's check and ours: no dangling entries, no leaked chunks."""
    from mxfs.vol.volume import Volume

    vol = Volume.open(members[0])
    try:
        assert vol.problems() == []
    finally:
        vol.store.close()


# A writer of files it fsyncs and renames into place, printing "synced NAME SHA256" for
# each (and "gone NAME" for each it removed): what a crash must never lose.
STORM = r"""
import hashlib, os, sys
root, worker = sys.argv[1], int(sys.argv[2])
i = 0
while True:
    i += 1
    name = f"w{worker}-{i}"
    data = hashlib.shake_256(name.encode()).digest(1000 + (i * 7919 + worker * 104729) % 400_000)
    try:
        with open(os.path.join(root, name + ".tmp"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(os.path.join(root, name + ".tmp"), os.path.join(root, name))
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        if i % 5 == 0:
            os.unlink(os.path.join(root, f"w{worker}-{i - 1}"))
            print("gone", f"w{worker}-{i - 1}", flush=True)
        print("synced", name, hashlib.sha256(data).hexdigest(), flush=True)
        # unsynced tail: may be lost, must never corrupt anything
        with open(os.path.join(root, name + ".scratch"), "wb") as f:
            f.write(data[:5000])
    except OSError:
        sys.exit(0)
"""


@contextmanager
def node_net() -> Iterator[NodeNet]:
    """A second node in a network namespace of its own, removed afterwards."""
    if not netns.usable():
        pytest.skip("needs root, ip (iproute2) and nsenter")
    tag = f"{os.getpid() % 10000}{len(_NETS)}"
    # A subnet of this session's own: xdist workers make theirs at the same time, and
    # another test run on this machine may hold one (two links with one address would
    # route a node's packets to the other run's).
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    _NETS.append(tag)
    subnet = next(s for s in (f"10.{231 + worker % 20}.{(len(_NETS) + k) % 250}"
                              for k in range(250))
                  if not subprocess.run(["ip", "-4", "-o", "addr", "show", "to", f"{s}.0/24"],
                                        capture_output=True, text=True).stdout.strip())
    with netns.node_net(tag, subnet) as net:
        yield net


_NETS: list[str] = []  # namespaces made this session (their names stay unique)


def kill_daemon(m: Mounted) -> None:
    from mxfs.proc import running

    pid = m.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    assert eventually(lambda: not running(pid))
    # the dead mount answers ENOTCONN until it is detached
    mxfs("umount", str(m.path))


def unmount_and_check(m: Mounted) -> None:
    """Unmount; a pool that unmounted cleanly must then be sound (`check_pool`): every
    mount test ends checked, so a test that leaves damage behind fails where it made it."""
    clean = is_mounted(str(m.path)) and cli("umount", str(m.path))[0] == 0
    force_unmount(str(m.path))
    if clean and m.check:
        check_pool(m.members)


@contextmanager
def mount_with(members: list[str], *options: str, prefix: list[str] | None = None,
               allow_other: bool = True, check: bool = True) -> Iterator[Mounted]:
    """The pool on `members` mounted with `options` (and a command prefix such as
    prlimit) on a fresh folder under /tmp itself, not pytest's private folder, so other
    users can reach it; unmounted and checked after (`check=False`: a test that breaks
    the pool on purpose)."""
    _not_in_a_unit()
    mp = Path(tempfile.mkdtemp(prefix="mxfs-mnt-"))
    os.chmod(mp, 0o755)
    opts = ",".join((["allow_other"] if allow_other else []) + list(options)) or "rw"
    args = ["mount", "-o", opts, members[0], str(mp)]
    if prefix:
        res = subprocess.run([*prefix, sys.executable, "-m", "mxfs", *args],
                             capture_output=True, text=True, timeout=120)
        code, err = res.returncode, res.stderr
    else:  # (the daemon is this worker's child: one that exited is reaped by the next
        code, err = cli(*args)  # Popen, and `mxfs.proc.running` calls a zombie gone)
    assert code == 0, err
    m = Mounted(mp, members, check=check)
    try:
        yield m
    finally:
        try:
            unmount_and_check(m)
        finally:
            force_unmount(str(mp))
            os.rmdir(mp)


def mounted_pool(members: list[str], *options: str, check: bool = True
                 ) -> contextlib.AbstractContextManager[Mounted]:
    """The pool on `members` mounted (allow_other, and `options`); see `mount_with`."""
    return mount_with(members, *options, check=check)


@contextmanager
def module_pool(factory: pytest.TempPathFactory, *options: str) -> Iterator[Mounted]:
    """A pool of four folder members mounted (allow_other, and `options`) for a module's
    tests."""
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    members = make_members(factory.mktemp("pool"))
    mkfs(members)
    with mounted_pool(members, *options) as m:
        yield m


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """A `module_pool` its module's tests share (a module may define its own)."""
    with module_pool(tmp_path_factory) as m:
        yield m


@pytest.fixture
def members(tmp_path: Path) -> list[str]:
    return make_members(tmp_path)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Any]:
    """A PostgreSQL server of the session's own (each pool gets a database of it)."""
    from pg_server import server_or_skip

    yield from server_or_skip()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a fresh metadata store of each engine lives: a folder, or a database of the
    session's PostgreSQL server (the tests that drive `MetaStore` without FUSE)."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_cluster").database())
    folder = tmp_path / "meta"
    folder.mkdir()
    return str(folder)


@pytest.fixture
def meta_engine(request: pytest.FixtureRequest) -> str:
    """Where the test's pool keeps its metadata: "sqlite" (member 0), or "postgresql"
    for the second run of a test marked `also_postgres`."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def meta_args(request: pytest.FixtureRequest, meta_engine: str) -> list[str]:
    """The mkfs arguments that put the pool's metadata where `meta_engine` says."""
    if meta_engine == "sqlite":
        return []
    return ["--meta", request.getfixturevalue("pg_cluster").database()]


@pytest.fixture
def mounted(tmp_path: Path, members: list[str], meta_args: list[str]) -> Iterator[Mounted]:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    mkfs(members, "64KiB", *meta_args)
    with mounted_pool(members) as m:
        yield m


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    p = tmp_path / "plain"
    p.mkdir()
    return p


@pytest.fixture
def loop_members(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Four members on small ext4 images, member 2 much smaller than the others (their
    sizes in MiB another list where a test parametrizes this fixture indirectly)."""
    if not HAVE_FUSE:
        pytest.skip("needs root")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(ext4_image(tmp_path, f"member{i}", mib))
               for i, mib in enumerate(getattr(request, "param", [64, 64, 24, 64]))]


@contextmanager
def ext4_image(tmp_path: Path, name: str, mib: int, options: str = "",
               inodes: int = 0) -> Iterator[str]:
    """A folder `name` that is a fresh ext4 image of `mib` MiB on a loop device (a real
    block device: it fills up, it can be made slow), mounted with `options` ("sync": a
    member slower to write than the mount is to answer), with only `inodes` inodes if
    given; unmounted afterwards."""
    with _loop_image(tmp_path, name, mib, ["mkfs.ext4", "-q", "-F", "-m", "0",
                                           *(["-N", str(inodes)] if inodes else [])],
                     options) as folder:
        yield folder


@contextmanager
def slow_member(tmp_path: Path, bps: int
                ) -> Iterator[tuple[str, Callable[[int], None], Callable[[int], None]]]:
    """A member on an ext4 image on a loop device, a call that holds a process's reads
    of that device to `bps` bytes a second (a v1 block-I/O cgroup): a slow drive; and
    a call that sets another pace."""
    cgroups = Path("/sys/fs/cgroup/blkio")
    if not (cgroups / "blkio.throttle.read_bps_device").exists():
        pytest.skip("needs the v1 block-I/O cgroup")
    cg = cgroups / f"mxfs-test-slow-{os.getpid()}-{time.monotonic_ns()}"
    with ext4_image(tmp_path, "slow", 128) as folder:
        try:
            source = subprocess.run(["findmnt", "-no", "SOURCE", folder], check=True,
                                    capture_output=True, text=True).stdout.strip()
            dev = os.stat(source).st_rdev

            def pace(bps: int) -> None:
                (cg / "blkio.throttle.read_bps_device").write_text(
                    f"{os.major(dev)}:{os.minor(dev)} {bps}")
            cg.mkdir()
            pace(bps)
            yield folder, lambda pid: (cg / "cgroup.procs").write_text(str(pid)), pace
        finally:
            if cg.exists():
                for pid in (cg / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (cgroups / "cgroup.procs").write_text(pid)
                cg.rmdir()


@contextmanager
def xfs_image(tmp_path: Path, name: str, mib: int = 512) -> Iterator[str]:
    """A folder `name` that is a fresh XFS image of `mib` MiB on a loop device (the
    file system production members use: its own preallocation, reflinks)."""
    with _loop_image(tmp_path, name, mib, ["mkfs.xfs", "-q", "-f"]) as folder:
        yield folder


@contextmanager
def _loop_image(tmp_path: Path, name: str, mib: int, mkfs_cmd: list[str],
                options: str = "") -> Iterator[str]:
    img, folder = tmp_path / f"{name}.img", tmp_path / name
    with open(img, "wb") as f:
        f.truncate(mib << 20)
    subprocess.run([*mkfs_cmd, str(img)], check=True, capture_output=True)
    folder.mkdir()
    res = subprocess.run(["mount", "-o", ",".join(filter(None, ["loop", options])), str(img),
                          str(folder)], capture_output=True)
    if res.returncode:
        pytest.skip(f"loop mounts unavailable: {res.stderr.decode().strip()}")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def loop_pool(loop_members: list[str]) -> Iterator[Mounted]:
    """A pool of the loop-device members, mounted; unmounted and removed afterwards."""
    mkfs(loop_members)
    with mount_with(loop_members, allow_other=False) as m:
        yield m


@contextmanager
def steady_page_cache(*held: Path) -> Iterator[None]:
    """No drop of the page cache (mxfs.cli.measure.drop_caches, in any test process or
    benchmark) while this is held: for a test checking what a read left cached, beside
    other workers that drop it.  Never drop caches inside it.  The files `held` are
    read in and their pages locked in memory meanwhile (mapped, mlock): the kernel's
    reclaim, which other workers' I/O drives when memory is full of cache, evicted a
    few pages of a file a test had just read (32 KiB of 4 MiB read from the owner)."""
    import ctypes
    import fcntl
    import mmap

    from mxfs.cli.measure import page_cache_lock

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lock = page_cache_lock()
    maps: list[tuple[int, int]] = []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in held:
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
            maps.append((addr, size))
            assert libc.mlock(addr, size) == 0, os.strerror(ctypes.get_errno())
        yield
    finally:
        for addr, size in maps:
            libc.munmap(addr, size)  # (unlocks its pages)
        os.close(lock)


def requests_served(mount: Path, op: str) -> int:
    """How many `op` requests the daemon of `mount` has served."""
    from mxfs.client.control import ControlClient

    with ControlClient(str(mount)) as c:
        return sum(n for _, o, n, _ in c.call("metrics")["requests"] if o == op)

"""Observability: df by member and use, live rates, the Prometheus endpoint, systemd."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from conftest import Mounted, eventually, mkfs, mounted_pool, mxfs, one_line_error

import mxfs.ckpt as ck
from mxfs.cli.measure import drop_caches
from mxfs.fs.wake import WakeLatency
from mxfs.kv import KVStore


def test_df_splits_space_by_member_and_use(mounted: Mounted) -> None:
    (mounted.path / "plain").write_bytes(os.urandom(3 << 20))
    ck.save({"w": torch.zeros(1 << 20)}, str(mounted.path / "ck")).wait()
    with KVStore(str(mounted.path), "df") as kv:
        kv.batch_put(["a", "b"], [b"x" * 300_000, b"y" * 5000])
    out = json.loads(mxfs("df", "--json", str(mounted.path)).stdout)
    assert [m["index"] for m in out["members"]] == [0, 1, 2, 3]
    assert out["by_use"]["kv"] == 305_000
    assert out["by_use"]["sealed"] >= 4 << 20  # the checkpoint's data file and manifest
    assert out["by_use"]["files"] == 3 << 20
    assert "KV cache" in mxfs("df", str(mounted.path)).stdout


def test_top_shows_member_bytes_and_requests(mounted: Mounted) -> None:
    from mxfs.cli.observe_cmd import rates
    from mxfs.client import ControlClient

    (mounted.path / "f").write_bytes(os.urandom(8 << 20))
    with ControlClient(str(mounted.path)) as c:
        before = c.call("metrics")
        drop_caches()  # so the reads reach the daemon
        (mounted.path / "f").read_bytes()
        after = c.call("metrics")
    sample = rates(before, after)
    read = {m["member"]: m["bytes_per_s"] for m in sample["members"]
            if m["direction"] == "read"}
    assert sorted(read) == [0, 1, 2, 3] and all(v > 0 for v in read.values())
    assert any(r["op"] == "read" and r["kind"] == "fuse" for r in sample["requests"])
    out = mxfs("top", "--json", "--interval", "0.2", "--count", "2", str(mounted.path)).stdout
    samples = [json.loads(line) for line in out.splitlines()]
    assert len(samples) == 2 and all({"seconds", "members", "requests"} <= set(x)
                                     for x in samples)


def _free_port() -> int:
    """A free port below 600 (mount refuses one any user may bind, fs/ports.py; nodes'
    outgoing connections take theirs from 600 up), picked at random: other runs on
    this machine look for one too."""
    for port in random.sample(range(300, 600), 300):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below 600")


def test_prometheus_endpoint(mounted: Mounted) -> None:
    mounted.umount()
    port = _free_port()
    mxfs("mount", "-o", f"allow_other,metrics_port={port}", mounted.members[0],
         str(mounted.path))
    (mounted.path / "x").write_bytes(b"1" * 100_000)
    (mounted.path / "x").read_bytes()
    with KVStore(str(mounted.path), "prom") as kv:
        kv.put("k", b"v" * 1000)
        kv.get("k")
    assert eventually(lambda: _scrape(port) is not None)
    text = _scrape(port) or ""
    assert re.search(r'mxfs_requests_total\{kind="fuse",op="write"\} [1-9]', text)
    assert re.search(r'mxfs_request_seconds_bucket\{kind="fuse",le="\+Inf",op="create"\} 1', text)
    assert re.search(r'mxfs_member_bytes_total\{direction="write",member="\d"\} [1-9]', text)
    assert re.search(r'mxfs_member_free_bytes\{member="3"\} [1-9]', text)
    assert re.search(r'^mxfs_kv_hits 1\.0$', text, re.M)  # the pool's: no owner, no name
    assert "prom" not in text
    # /metrics has no authentication: it listens on loopback unless told otherwise.
    with open("/proc/net/tcp") as f:
        listening = [line.split()[1] for line in f if line.split()[3] == "0A"]
    assert f"0100007F:{port:04X}" in listening
    assert re.search(r'mxfs_requests_total\{kind="control",op="kv_get"\} [1-9]', text)
    assert re.search(r'^mxfs_io_requests_taken_back_total 0\.0$', text, re.M)  # none lost


KV_AS_ALICE = """
kv = mxfs.kv.KVStore(sys.argv[1], "alices")
kv.put("a", b"a" * 1000)
print(json.dumps([bytes(kv.get("a") or b"") == b"a" * 1000, kv.get("nope") is None]))
"""


def test_kv_gauges_are_the_pools_totals_unless_root_asks_for_them_by_user(
        members: list[str]) -> None:
    """Anyone on the host may scrape /metrics: KV gauges by owner uid told every local
    user how much KV each other user holds and how often it hits (her workload, seen
    from outside).  They are the pool's totals, with no uid; by owner only when root
    mounts with metrics_by_user."""
    from users import ensure_users, run_as

    alice = ensure_users()["alice"]
    mkfs(members, "64KiB")
    port = _free_port()
    with mounted_pool(members, f"metrics_port={port}") as m:
        with KVStore(str(m.path), "roots") as kv:
            kv.put("r", b"r" * 500)
            assert kv.get("r") == b"r" * 500
        assert run_as(alice, KV_AS_ALICE, str(m.path)) == [True, True]
        assert eventually(lambda: _scrape(port) is not None)
        text = _scrape(port) or ""
        # (500 and 1000 bytes: each chunk counts a page at least, kv_index.CHUNK_FLOOR)
        for gauge, n in (("chunks", 2), ("bytes", 8192), ("hits", 2), ("misses", 1),
                         ("puts", 2)):
            assert re.search(rf"^mxfs_kv_{gauge} {n}\.0$", text, re.M), gauge
        assert "uid=" not in text
    port = _free_port()
    with mounted_pool(members, f"metrics_port={port}", "metrics_by_user"):
        assert eventually(lambda: _scrape(port) is not None)
        text = _scrape(port) or ""
        assert re.search(r'^mxfs_kv_chunks\{uid="0"\} 1\.0$', text, re.M)
        assert re.search(rf'^mxfs_kv_bytes\{{uid="{alice.uid}"\}} 4096\.0$', text, re.M)
        assert not re.search(r"^mxfs_kv_chunks ", text, re.M)


def test_scrapes_never_touch_the_store_beside_the_daemon(members: list[str], pg_cluster: Any
                                                         ) -> None:
    """Anyone on the host may scrape /metrics, as often as they like: the pool gauges
    (nodes, inodes, KV) are gathered on the daemon's own thread, not the scraper's, so a
    scrape storm beside a write storm on a pool on PostgreSQL breaks nothing (the store's
    connection is the daemon thread's alone) and every fsynced file reads back."""
    mkfs(members, "64KiB", "--meta", pg_cluster.database())
    port = _free_port()
    with mounted_pool(members, f"metrics_port={port}") as m:
        assert eventually(lambda: _scrape(port) is not None)
        stop = threading.Event()
        scraped: list[str] = []

        def scrape() -> None:
            while not stop.is_set():
                text = _scrape(port)
                if text is not None:
                    scraped.append(text)
        scrapers = [threading.Thread(target=scrape) for _ in range(3)]
        for t in scrapers:
            t.start()
        written = {}
        try:
            for i in range(300):
                data = os.urandom(100 + i)
                with open(m.path / f"f{i}", "wb") as f:
                    f.write(data)
                    os.fsync(f.fileno())
                written[f"f{i}"] = data
        finally:
            stop.set()
            for t in scrapers:
                t.join(30)
        assert len(scraped) > 20, "too few scrapes to test anything"
        assert all(re.search(r'^mxfs_node_alive\{node="[^"]+",role="writer"\} 1\.0$', t, re.M)
                   for t in scraped[-3:])
        m.umount()
        m.remount()
        assert all((m.path / n).read_bytes() == d for n, d in written.items())


def test_silent_scrapers_hold_a_few_threads_of_the_daemon(members: list[str]) -> None:
    """Anyone on the host may connect to /metrics: prometheus_client's server took a
    thread of the daemon for each connection, for as long as it stayed silent (a user
    opening thousands ran the daemon out of threads).  One thread serves them all, a
    few at a time, each for a moment at most (a whole request: a byte now and then does
    not keep it), the rest closed at once; scrapes go on after."""
    from mxfs.fs.metrics_http import PER_PEER, REQUEST_S

    mkfs(members)
    port = _free_port()
    with mounted_pool(members, f"metrics_port={port}") as m:
        assert eventually(lambda: _scrape(port) is not None)
        tasks = f"/proc/{m.daemon_pid()}/task"
        before = len(os.listdir(tasks))
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        try:
            time.sleep(0.2)  # (the daemon's other threads come and go: a few more)
            assert len(os.listdir(tasks)) - before <= 8
            assert sum(_closed(s) for s in silent) >= 300 - PER_PEER  # (past the few)
            time.sleep(REQUEST_S + 0.5)
            assert all(_closed(s) for s in silent)  # (the few, after their time)
        finally:
            for s in silent:
                s.close()
        # A byte now and then kept a connection served (the limit was a read's, not a
        # request's): as many as are served at once held every slot for hours.
        assert eventually(lambda: _scrape(port) is not None)
        drippers = [socket.create_connection(("127.0.0.1", port)) for _ in range(PER_PEER)]
        try:
            until, cut = time.monotonic() + 3 * REQUEST_S + 1, set()
            while time.monotonic() < until:
                for i, s in enumerate(drippers):
                    try:
                        s.send(b"G")
                    except OSError:
                        cut.add(i)
                    if _closed(s):
                        cut.add(i)
                time.sleep(0.1)
            assert len(cut) == PER_PEER, f"{PER_PEER - len(cut)} dripping scrapes held on"
        finally:
            for s in drippers:
                s.close()
        assert eventually(lambda: _scrape(port) is not None)
        assert (m.path / "f").write_bytes(b"x") == 1  # (the mount served throughout)


HOLD_HALF_SENT = """
import socket, time
port, ready, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def half() -> socket.socket:
    s = socket.socket()
    s.connect(("127.0.0.1", port))
    s.send(b"GET /metrics HTTP/1.1\\r\\n")
    return s
held = [half() for _ in range(20)]
open(ready, "w").close()
opened = 20
while True:
    last = os.path.exists(stop)  # (then one pass more: closes made as the scrapes ran)
    for i, s in enumerate(held):
        try:
            gone = s.recv(1, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            s.close()
            held[i] = half()
            opened += 1
    if last:
        break
    time.sleep(0.05)
print(json.dumps(opened))
"""


def test_half_sent_requests_of_one_user_never_shut_the_scrapes_out(
        members: list[str]) -> None:
    """Eight connections sending half a request line, opened again as they were closed,
    held every slot of /metrics, and every other scrape was closed at once.  A user
    holds a few at most, her oldest going for her newest, and the scrape of another
    (root's Prometheus, say, from the same loopback address) is served."""
    from users import ensure_users, run_as

    bob = ensure_users()["bob"]
    mkfs(members)
    port = _free_port()
    shared = Path(tempfile.mkdtemp())  # (bob's to write in: pytest's tmp_path is root's)
    shared.chmod(0o777)
    ready, stop = shared / "ready", shared / "stop"
    with mounted_pool(members, f"metrics_port={port}"):
        assert eventually(lambda: _scrape(port) is not None)
        opened: list[int] = []
        holder = threading.Thread(target=lambda: opened.append(
            run_as(bob, HOLD_HALF_SENT, str(port), str(ready), str(stop))))
        holder.start()
        try:
            assert eventually(ready.exists)
            pages = [_scrape(port) for _ in range(3)]
        finally:
            stop.touch()
            holder.join(60)
        shutil.rmtree(shared)
        assert all(p is not None and "mxfs_requests_total" in p for p in pages)
        assert opened and opened[0] > 20  # (bob's were closed, and he opened more)


def test_a_users_subordinate_uids_share_her_connections_to_metrics() -> None:
    """Counted by uid, each subordinate uid of a user (a rootless container's) had
    PER_PEER connections and an accept rate of its own, and hers churned past CONNS
    to drop Prometheus's.  Connections from five of hers hold PER_PEER of hers in all,
    the oldest dropped.  (The server's accepts are run here, one round: the held
    connections' deadlines play no part.)"""
    from users import ensure_users, subordinate_uids

    from mxfs.fs.metrics_http import PER_PEER, Server
    from mxfs.vol.tenants import TENANTS

    alice = ensure_users()["alice"]
    subs = subordinate_uids(alice)
    TENANTS.refresh()  # (as the daemon reads /etc/subuid)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = Server(listener, lambda: b"")
        conns = []
        try:
            for uid in list(subs[:PER_PEER]) + [alice.uid]:
                os.seteuid(uid)  # (the socket's owner, as of its making: sock_diag's uid)
                try:
                    conns.append(socket.socket())
                finally:
                    os.seteuid(0)
                conns[-1].connect(listener.getsockname())
            server._accept()
            assert [c.peer for c in server.conns.values()] == [f"uid {alice.uid}"] * PER_PEER
            assert _closed(conns[0]) and not any(_closed(s) for s in conns[1:])
        finally:
            for s in conns:
                s.close()
            for c in list(server.conns.values()):
                server._drop(c)


def test_a_request_with_huge_headers_is_refused_unread(members: list[str]) -> None:
    """wsgiref read 100 headers of 64 KiB each (tens of ms of Python each request, the
    GIL held from the daemon's trio thread): a request is read to 8 KiB at most, and one
    longer is answered 431 and closed, the rest unread."""
    mkfs(members)
    port = _free_port()
    with mounted_pool(members, f"metrics_port={port}"):
        assert eventually(lambda: _scrape(port) is not None)
        line = b"X-A: " + b"a" * 65000 + b"\r\n"
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(20)
            with contextlib.suppress(OSError):  # (closed with the rest unread: reset)
                s.sendall(b"GET /metrics HTTP/1.1\r\n" + line * 99 + b"\r\n")
            try:
                answer = s.recv(4096)
            except ConnectionResetError:
                answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        with socket.create_connection(("127.0.0.1", port)) as s:  # (bad ones: 4xx)
            s.sendall(b"BREW /metrics HTTP/1.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 405 ")
        assert eventually(lambda: _scrape(port) is not None)


def test_scrapes_in_between_get_the_stored_page(members: list[str]) -> None:
    """A scrape in a loop rebuilt the whole page each time, the counters' lock and the
    GIL taken from the daemon's trio thread: the page is built once a PAGE_S at most,
    the same bytes served in between, though requests were counted meanwhile."""
    mkfs(members)
    port = _free_port()
    with mounted_pool(members, f"metrics_port={port}") as m:
        assert eventually(lambda: _scrape(port) is not None)
        same = False
        for i in range(5):
            first = _scrape(port)
            (m.path / f"f{i}").write_bytes(b"x")  # (requests counted: create, write, ...)
            second = _scrape(port)
            assert first is not None and second is not None
            if first == second:
                same = True
                break
        assert same, "every scrape built a page of its own"
        later: list[str] = []

        def rebuilt() -> bool:
            text = _scrape(port)
            later.extend([text] if text not in (None, first) else [])
            return bool(later)
        assert eventually(rebuilt)  # (built again after its time)
        text = later[0]
        assert re.search(r'mxfs_requests_total\{kind="fuse",op="create"\} [1-9]', text)


def _closed(s: socket.socket) -> bool:
    """Whether the peer closed `s` (read without waiting)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _cpu_latency_limit() -> int:
    """The machine's CPU latency limit in us, as the kernel holds it now."""
    with open("/dev/cpu_dma_latency", "rb") as f:
        return int(struct.unpack("=i", f.read(4))[0])


@pytest.mark.skipif(not os.access("/dev/cpu_dma_latency", os.R_OK), reason="no PM QoS device")
def test_wake_latency_is_held_while_requests_flow(mounted: Mounted, tmp_path: Path) -> None:
    before = _cpu_latency_limit()
    if before <= 7:
        pytest.skip(f"something else holds the CPU latency limit at {before} us")
    mounted.umount()
    mxfs("mount", "-o", "allow_other,wake_latency_us=7", mounted.members[0], str(mounted.path))
    link = mounted.path / "ln"
    os.symlink("target", link)
    busy = threading.Event()

    def requests() -> None:  # each readlink is a round trip to the daemon
        while not busy.is_set():
            os.readlink(link)

    worker = threading.Thread(target=requests)
    worker.start()
    try:
        assert eventually(lambda: _cpu_latency_limit() == 7, timeout=10)
        status = mxfs("status", str(mounted.path)).stdout
        assert "wake latency limit 7 us while busy: held now" in status
    finally:
        busy.set()
        worker.join()
    assert eventually(lambda: _cpu_latency_limit() == before, timeout=10)  # let go when idle
    # Taken at least once (again after any pause long enough for it to be let go: the
    # count depends on how the machine schedules the requests).  Let go is what the
    # kernel said above: status's own round trips are requests, which may take it again.
    taken = re.search(r"held now, taken (\d+) times", mxfs("status", str(mounted.path)).stdout)
    assert taken is not None and int(taken.group(1)) >= 1
    (empty := tmp_path / "elsewhere").mkdir()
    for bad in ("-1", str(1 << 31)):  # the kernel takes a signed 32-bit count
        line = one_line_error(mxfs("mount", "-o", f"wake_latency_us={bad}", mounted.members[0],
                                   str(empty), check=False))
        assert "wake_latency_us" in line


def test_wake_latency_holds_while_counting_and_never_raises(tmp_path: Path) -> None:
    """The holder against stand-ins for the kernel's device: it writes the limit while
    the count moves, lets go when it stops, and a device it cannot open ends nothing."""
    with pytest.raises(ValueError):
        WakeLatency(1 << 31, lambda: 0)
    gone = WakeLatency(5, lambda: 0, path=str(tmp_path / "missing"))
    gone.hold()
    assert not gone.held and "No such file" in (gone.broken or "")
    trio.run(gone.run)  # returns at once: nothing to hold, no exception
    device = tmp_path / "qos"
    device.write_bytes(b"")
    ticks = iter(range(1_000_000))
    moving = True
    w = WakeLatency(5, lambda: next(ticks) if moving else 0, path=str(device))
    seen = []

    async def watch() -> None:
        nonlocal moving
        async with trio.open_nursery() as n:
            n.start_soon(w.run)
            await trio.sleep(0.3)
            seen.append(w.held)
            moving = False
            await trio.sleep(0.6)
            seen.append(w.held)
            n.cancel_scope.cancel()

    trio.run(watch)
    assert seen == [True, False] and w.holds == 1 and not w.held
    assert struct.unpack("=i", device.read_bytes()[:4]) == (5,)


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def test_bad_flags_and_paths_are_one_line(mounted: Mounted, tmp_path: Path) -> None:
    for args in (("df", str(tmp_path)), ("top", str(tmp_path)), ("scrub", "/nope"),
                 ("meta", "ls", "/nope"), ("kv", "stats", str(tmp_path)),
                 ("mount", "-o", "metrics_port=x", mounted.members[0], str(tmp_path)),
                 ("mount", "-o", "wake_latency_us=x", mounted.members[0], str(tmp_path)),
                 ("ckpt", "ls", str(tmp_path / "missing"))):
        one_line_error(mxfs(*args, check=False))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (Path(__file__).parent.parent / "systemd" / "mxfs@.service").read_text()
    mxfs_bin = shutil.which("mxfs") or os.path.join(os.path.dirname(sys.executable), "mxfs")
    unit = unit.replace("/usr/local/bin/mxfs", mxfs_bin)  # where this checkout installed it
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    (d / "mxfs@.service").write_text(unit)
    os.symlink(d / "mxfs@.service", d / "mxfs@demo.service")
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(d / "mxfs@demo.service")],
                         capture_output=True, text=True)
    problems = [line for line in res.stderr.splitlines() if "mxfs@" in line]
    assert res.returncode == 0 and not problems, res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_bench_writes_a_report_and_compares_two_runs(tmp_path: Path) -> None:
    for name in ("a", "b"):
        mxfs("bench", "run", "--out", str(tmp_path / name), "--size", "64MiB", "--repeat",
             "2" if name == "a" else "1", timeout=600)
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    for key in ("member0_read", "striped_write", "mount_read", "load_mxfs", "load_safetensors",
                "ckpt_mxfs", "ckpt_torch_save", "kv_get_mxfs", "kv_get_files"):
        assert results["median"][key] > 0, key
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| mxfs.ckpt / torch.save (to durable) |" in report
    for png in ("bandwidth.png", "ratios.png"):
        assert (tmp_path / "a" / png).read_bytes()[:4] == b"\x89PNG"
    table = mxfs("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")).stdout
    assert "| striped_read |" in table and "B / A" in table
    line = one_line_error(mxfs("bench", "compare", str(tmp_path / "a"), str(tmp_path / "x"),
                               check=False))
    assert "results.json" in line


def test_log_json_writes_one_object_a_line(mounted: Mounted) -> None:
    mounted.umount()
    res = mxfs("mount", "-o", "allow_other,log_json", mounted.members[0], str(mounted.path))
    log_path = res.stdout.split("log ")[-1].rstrip(")\n")
    (mounted.path / "x").write_bytes(b"x")
    lines = [json.loads(line) for line in Path(log_path).read_text().splitlines()
             if line.startswith("{")]
    assert any("mounted on" in e["message"] and e["level"] == "INFO" for e in lines)
    assert all({"time", "level", "logger", "message", "pid"} <= set(e) for e in lines)


def test_systemd_notify_ready_once_the_mount_answers_and_stopping_on_sigterm(
        mounted: Mounted, tmp_path: Path) -> None:
    from conftest import is_mounted

    mounted.umount()
    sock_path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(60)
    proc = subprocess.Popen([sys.executable, "-m", "mxfs", "mount", "-f", "-o", "allow_other",
                             mounted.members[0], str(mounted.path)],
                            env={**os.environ, "NOTIFY_SOCKET": sock_path},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while (said := sock.recv(256)) != b"READY=1":  # (mount-time work asks for time)
            assert said.startswith(b"EXTEND_TIMEOUT_USEC="), said
        assert is_mounted(str(mounted.path)) and os.listdir(mounted.path) == []  # it answers
        proc.send_signal(signal.SIGTERM)  # what systemctl stop sends
        assert sock.recv(256) == b"STOPPING=1"
        assert proc.wait(timeout=60) == 0
        assert not is_mounted(str(mounted.path))  # the stop unmounted cleanly
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()

#!/usr/bin/env python3
"""Benchmark a pool across nodes (issue 27): a reading node in a network namespace of its
own reads a file that the writer node holds, side by side in one run with the transport's
own ceiling.

The writer node is this host, the reading node a namespace joined to it by a veth pair
(`tools/netns.py`), as the tests run them; the metadata is on PostgreSQL (`--meta`: an
empty database).  The writer's chunk files stay in its page cache (read once first):
what is measured is the path between the nodes.  Arms, in GB/s, medians of `--repeat`:

  sendfile  the ceiling: the file's chunk files sent whole with plain sendfile over TCP
            to a process in the reading node's namespace, a connection per member
  chunks    the same bytes through the writer's chunk service (`ChunkClient`, a
            connection and thread per member, each stripe unit received in its place)
  node      the file read through the reading node's mount (FUSE, its daemon, the chunk
            service), its page cache for the file dropped before each round
  direct    the direct path on the reading node (`open_reader`: connections to the chunk
            service its daemon scoped to the file, a member each), from its open
  local     the file read through the writer's own mount, for reference

and KV chunks put on the writer (`--kv-chunks` of 2 MiB), read back with `batch_get` into
buffers made beforehand, as an engine's host pool is:
  kv local  on the writer, from its page cache
  kv node   on the reading node: looked up in the store, copied over from the writer
and the same number of new chunks put (`batch_put`):
  kv put local  on the writer (its members)
  kv put node   on the reading node (sent on to the writer's chunk service)
and lookups (`exists_many` of those keys until 4,096 were asked, keys a second, a new
store each round: its first lookup maps the namespace's presence table):
  kv exists local  on the writer (the table its KV index keeps)
  kv exists node   on the reading node (the table its change feed keeps)
  kv exists asked  on the reading node, each call asking its daemon (`kv_exists`: the
                   store read), as every lookup there did before it kept tables
  kv lag   ms from a put on the writer to a reading node's store seeing the key

and a flood from a reading node's local readers (`--flood`, microseconds):
  open idle   open+close of a file through the writer's mount, p50 and p99 of 2000
  open flood  the same while 16 connections the reading node handed its readers
              (scoped to one file) send 1-byte READs as fast as they are answered

and the metadata (`--files` empty files in one folder, made on the writer):
  stat local  stats a second of every file through the writer's mount, a pass after
              a pass (the kernel's cache warm), then 1.5 s idle, then the pass timed
  stat node   the same through the reading node's mount: with the change feed its
              kernel keeps answers past the 1.5 s, without it it asks after 1 s
  open local  opens (and closes) a second of every file through the writer's mount,
              each file once, after the stat arm (names cached)
  open node   the same through the reading node's mount: each first open of a file
              there waits for the writer to hold it for the node (`fs/held_open.py`)
  lag         ms from the writer's close of a new file to the reading node seeing it,
              where its kernel held the name as absent (median of `--lags`)

Needs root, iproute2 and nsenter.

    python tools/bench_nodes.py --meta 'postgresql:///bench?host=/run/pg' --size 512MiB
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_chunks import PIECE, read_all, served_file, through_chunks  # noqa: E402
from netns import NodeNet, node_net, usable  # noqa: E402

from mxfs.cli.demo import (  # noqa: E402
    ScratchPool,
    bench_args,
    run_mxfs,
    save_results,
    scratch_pool,
)
from mxfs.client.control import ControlClient  # noqa: E402
from mxfs.client.direct import RemoteFile, open_reader  # noqa: E402
from mxfs.io import Layout  # noqa: E402
from mxfs.io.chunk_client import ChunkClient  # noqa: E402
from mxfs.kv import KVStore  # noqa: E402
from mxfs.pool.key import key_path, read_key  # noqa: E402
from mxfs.proc import python_module  # noqa: E402
from mxfs.proto.chunk_wire import ANSWER, READ  # noqa: E402
from mxfs.proto.messages import OPEN_READ  # noqa: E402
from mxfs.units import format_size, parse_size  # noqa: E402

ARMS = ("sendfile", "chunks", "direct", "node", "local", "kv local", "kv node", "kv put local",
        "kv put node", "kv exists local", "kv exists node", "kv exists asked",
        "kv lag", "stat local", "stat node", "open local", "open node", "lag",
        "open idle p50", "open idle p99", "open flood p50", "open flood p99", "flood reads")
KV_CHUNK = 2 << 20


class SendfileServer:
    """The ceiling's sender: each connection names a chunk file (its index, one line),
    which goes out whole with sendfile."""

    def __init__(self, host: str, paths: list[str]) -> None:
        self.paths = paths
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        with conn, open(self.paths[int(conn.makefile().readline())], "rb") as f:
            size = os.fstat(f.fileno()).st_size
            sent = 0
            while sent < size:
                sent += os.sendfile(conn.fileno(), f.fileno(), sent, size - sent)

    def close(self) -> None:
        self.sock.close()


def client_sendfile(host: str, port: int, sizes: list[int]) -> float:
    """In the reading node: receive every chunk file at once; seconds taken."""
    bufs = [memoryview(bytearray(n)) for n in sizes]  # (made before the clock, as the
                                                      # chunks arm's buffer is)
    def one(i: int) -> None:
        buf = bufs[i]
        with socket.create_connection((host, port)) as s:
            s.sendall(f"{i}\n".encode())
            got = 0
            while got < len(buf):  # (asked for all at once, a receive runs at a third:
                n = s.recv_into(buf[got:got + PIECE])  # the copy holds the socket)
                if not n:
                    raise OSError(f"connection {i} ended at {got} of {len(buf)} bytes")
                got += n

    start = time.perf_counter()
    with ThreadPoolExecutor(len(sizes)) as ex:
        list(ex.map(one, range(len(sizes))))
    return time.perf_counter() - start


def client_chunks(spec: dict[str, Any]) -> float:
    """In the reading node: the file through the chunk service; seconds taken."""
    buf = bytearray(spec["size"])
    layout = Layout.from_description(spec["layout"])
    start = time.perf_counter()
    through_chunks((spec["host"], spec["port"]), read_key(spec["key"]), spec["pool"],
                   spec["ino"], layout, spec["size"], buf)
    return time.perf_counter() - start


def in_node(enter: list[str], *args: str) -> float:
    """Run this script's client side in the reading node; the seconds it measured."""
    res = subprocess.run([*enter, sys.executable, os.path.abspath(__file__), "--client",
                          *args], capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise SystemExit(f"the reading node's client failed: {res.stderr.strip()}")
    return float(res.stdout)


def drop_cached(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def uncached_read(path: str, buf: bytearray) -> float:
    """Read `path` through a mount, its pages there dropped first; seconds taken."""
    drop_cached(path)
    start = time.perf_counter()
    read_all(path, buf)
    return time.perf_counter() - start


def direct_read(path: str, buf: bytearray) -> float:
    """Read `path` on a reading node's mount by the direct path (its pages in the mount
    dropped first, so none is read from there); seconds taken, from the open."""
    drop_cached(path)
    start = time.perf_counter()
    with open_reader(path) as f:
        if not isinstance(f, RemoteFile):
            raise SystemExit(f"{path} opened as {type(f).__name__}, not by the direct path")
        f.read_into(0, memoryview(buf))
    return time.perf_counter() - start


def stat_rate(folder: str, names: list[str]) -> float:
    """Stats a second of every name in `folder`, warm then after 1.5 s idle."""
    paths = [os.path.join(folder, n) for n in names]
    for p in paths:
        os.stat(p)
    time.sleep(1.5)
    start = time.perf_counter()
    for p in paths:
        os.stat(p)
    return len(paths) / (time.perf_counter() - start)


def open_rate(folder: str, names: list[str]) -> float:
    """Opens and closes a second of every name in `folder`, each once."""
    paths = [os.path.join(folder, n) for n in names]
    start = time.perf_counter()
    for p in paths:
        os.close(os.open(p, os.O_RDONLY))
    return len(paths) / (time.perf_counter() - start)


def visible_after(writer_dir: str, node_dir: str, name: str) -> float:
    """Seconds from the writer's close of a new file to the reading node seeing it
    (whose kernel was just told the name is absent)."""
    seen = os.path.join(node_dir, name)
    if os.path.exists(seen):
        raise SystemExit(f"{seen} exists before it was made")
    start = time.perf_counter()
    with open(os.path.join(writer_dir, name), "wb") as f:
        f.write(b"x")
    while not os.path.exists(seen):
        if time.perf_counter() - start > 10:
            raise SystemExit(f"{seen} did not show on the reading node in 10 s")
        time.sleep(0.0005)
    return time.perf_counter() - start


def exists_rate(mount: str, keys: list[bytes], ask: bool = False, asked: int = 4096
                ) -> float:
    """Keys a second `exists_many` answers on `mount`, `keys` a call until `asked`
    (with `ask`, each call asks the daemon: the store holds no table)."""
    kv = KVStore(mount, namespace="bench")
    if ask:
        kv.views._never = True  # (as a daemon that keeps no table is answered)
    start, n = time.perf_counter(), 0
    while n < asked:
        if not all(kv.exists_many(keys)):
            raise SystemExit(f"a lookup on {mount} missed keys that are stored")
        n += len(keys)
    took = time.perf_counter() - start
    kv.close()
    return n / took


def kv_seen_after(writer: str, node: str, key: bytes) -> float:
    """Seconds from a put on the writer to a store on the reading node seeing the key
    (the store already holds the namespace's table)."""
    on_node = KVStore(node, namespace="bench")
    if on_node.exists_many([key])[0]:
        raise SystemExit(f"KV key {key!r} is there before it was put")
    on_writer = KVStore(writer, namespace="bench")
    start = time.perf_counter()
    on_writer.put(key, b"v" * 100)
    while not on_node.exists_many([key])[0]:
        if time.perf_counter() - start > 10:
            raise SystemExit(f"KV key {key!r} did not show on the reading node in 10 s")
        time.sleep(0.0005)
    took = time.perf_counter() - start
    on_node.close()
    on_writer.close()
    return took


def open_latency(path: str, n: int = 2000) -> tuple[float, float]:
    """p50 and p99 of open+close of `path`, microseconds."""
    took = []
    for _ in range(n):
        start = time.perf_counter()
        os.close(os.open(path, os.O_RDONLY))
        took.append(time.perf_counter() - start)
    took.sort()
    return took[n // 2] * 1e6, took[n * 99 // 100] * 1e6


def flooded(node_mnt: str, name: str, conns: int, measure: Any) -> tuple[Any, float]:
    """`measure()` while `conns` scoped connections from the reading node's daemon (a
    local reader's, as `open_read` hands them) send 1-byte READs back to back; its
    result and the READs answered a second."""
    client = ControlClient(node_mnt)
    socks: list[tuple[ChunkClient, int]] = []
    while len(socks) < conns:
        reply, fds = client.request_with_fds(OPEN_READ({"path": "/" + name, "remote": True}))
        grant = reply["remote"]
        socks += [(ChunkClient.adopt(fd, grant["addr"], grant["epoch"]), reply["ino"])
                  for fd in fds]
    stop = threading.Event()
    answered = [0]

    def flood(conn: ChunkClient, ino: int) -> None:
        while not stop.is_set():
            conn.sock.sendall(READ.pack(b"READ", ino, 0, 0, 1) * 64)
            for _ in range(64):
                conn._recv(ANSWER.size + 1)
            answered[0] += 64

    threads = [threading.Thread(target=flood, args=pair, daemon=True) for pair in socks]
    for t in threads:
        t.start()
    time.sleep(0.5)
    before, start = answered[0], time.perf_counter()
    try:
        got = measure()
    finally:
        rate = (answered[0] - before) / (time.perf_counter() - start)
        stop.set()
        for t in threads:
            t.join()
        client.close()
    return got, rate


@contextlib.contextmanager
def two_nodes(meta: str, where: str, stripe_unit: str
              ) -> Iterator[tuple[NodeNet, ScratchPool, str]]:
    """A scratch pool with its metadata at `meta` (an empty PostgreSQL database) mounted
    here as writer node a, and reading node b joined and mounted in a network namespace
    of its own: (b's network, the pool, b's mount point)."""
    with node_net(f"b{os.getpid() % 10000}", "10.239.0") as net, \
            scratch_pool("mxfs-bench-nodes-", where,
                         mkfs=("--stripe-unit", stripe_unit, "--meta", meta),
                         mount=("-o", f"allow_other,chunk_port=0,chunk_addr={net.host_ip},"
                                "node=a")) as pool:
        config = os.path.join(pool.base, "node-b", "node.toml")
        run_mxfs("node", "add", "--meta", meta, "--key", key_path(pool.members[0]),
                 "--name", "b", "--config", config)
        node_mnt = tempfile.mkdtemp(prefix="mnt-b-", dir=pool.base)
        subprocess.run([*net.enter, *python_module("mxfs", "mount", "-o", "allow_other",
                                                   config, node_mnt)],
                       check=True, capture_output=True)
        try:
            yield net, pool, node_mnt
        finally:
            subprocess.run(python_module("mxfs", "umount", node_mnt), capture_output=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        mode, rest = sys.argv[2], sys.argv[3:]
        if mode == "sendfile":
            print(client_sendfile(rest[0], int(rest[1]), [int(n) for n in rest[2:]]))
        else:
            print(client_chunks(json.loads(rest[0])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_args(ap)
    ap.add_argument("--meta", required=True, help="an empty PostgreSQL database's URL")
    ap.add_argument("--size", default="512MiB")
    ap.add_argument("--kv-chunks", type=int, default=64)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--lags", type=int, default=20)
    ap.add_argument("--flood", type=int, default=16,
                    help="scoped connections that flood the writer (0: no flood arm)")
    args = ap.parse_args()
    if not usable():
        raise SystemExit("bench_nodes needs root, iproute2 and nsenter")
    size = parse_size(args.size)
    rounds: dict[str, list[float]] = {k: [] for k in ARMS}
    with two_nodes(args.meta, args.dir, args.stripe_unit) as (net, pool, node_mnt):
        path = os.path.join(pool.mnt, "model.bin")
        served = served_file(pool, path, size)
        size, data, st, lay, chunk_paths = (
            served.size, served.data, served.stat, served.layout_reply, served.chunk_paths)
        svc = st["chunk_service"]
        assert svc is not None
        sizes = [os.path.getsize(p) for p in chunk_paths]
        server = SendfileServer(net.host_ip, chunk_paths)
        spec = json.dumps({"host": svc["addr"], "port": svc["port"], "pool": st["pool_uuid"],
                           "key": key_path(pool.members[0]), "ino": lay["ino"],
                           "layout": lay["layout"], "size": size})
        buf = bytearray(size)
        keys = [f"bench-{i:08d}".encode().ljust(32, b".") for i in range(args.kv_chunks)]
        values = [os.urandom(KV_CHUNK) for _ in keys]
        KVStore(pool.mnt, namespace="bench", mode=0o755).batch_put(keys, values)
        kv_bytes = len(keys) * KV_CHUNK
        names = [f"f{i:06d}" for i in range(args.files)]
        os.mkdir(os.path.join(pool.mnt, "meta"))
        for n in names:
            with open(os.path.join(pool.mnt, "meta", n), "wb"):
                pass
        os.mkdir(os.path.join(pool.mnt, "lag"))
        try:
            for p in chunk_paths:  # the writer's chunk files into its page cache
                read_all(p, bytearray(os.path.getsize(p)))
            # The engines' own buffers (host pool pages), made and touched once.
            outs = [bytearray(KV_CHUNK) for _ in keys]
            for i in range(args.repeat):
                for arm, mount in (("kv local", pool.mnt), ("kv node", node_mnt)):
                    for out in outs:
                        out[:] = bytes(KV_CHUNK)
                    kv = KVStore(mount, namespace="bench")
                    start = time.perf_counter()
                    got = kv.batch_get(keys, outs)
                    rounds[arm].append(kv_bytes / (time.perf_counter() - start) / 1e9)
                    if not all(got) or outs != values:
                        raise SystemExit(f"{arm}: KV chunks read back differ")
                    kv.close()
                for arm, mount in (("kv put local", pool.mnt), ("kv put node", node_mnt)):
                    kv = KVStore(mount, namespace="bench")
                    fresh = [f"{arm}-{i}-{k}".encode().ljust(32, b".") for k in range(len(keys))]
                    start = time.perf_counter()
                    if not all(kv.batch_put(fresh, values)):
                        raise SystemExit(f"{arm}: KV chunks not stored")
                    rounds[arm].append(kv_bytes / (time.perf_counter() - start) / 1e9)
                    kv.close()
                for arm, mount in (("kv exists local", pool.mnt), ("kv exists node", node_mnt),
                                   ("kv exists asked", node_mnt)):
                    rounds[arm].append(exists_rate(mount, keys, ask=arm.endswith("asked")))
                rounds["kv lag"].append(1000 * statistics.median(
                    kv_seen_after(pool.mnt, node_mnt, f"lag-{i}-{k}".encode())
                    for k in range(args.lags)))
                times = {"sendfile": in_node(net.enter, "sendfile", net.host_ip,
                                             str(server.port), *map(str, sizes)),
                         "chunks": in_node(net.enter, "chunks", spec),
                         "direct": direct_read(os.path.join(node_mnt, "model.bin"), buf)}
                if i == 0:
                    assert buf == data, "the reading node's direct path read other bytes"
                times["node"] = uncached_read(os.path.join(node_mnt, "model.bin"), buf)
                if i == 0:
                    assert buf == data, "the reading node read other bytes"
                times["local"] = uncached_read(path, buf)
                for k, t in times.items():
                    rounds[k].append(size / t / 1e9)
                for arm, mount in (("stat local", pool.mnt), ("stat node", node_mnt)):
                    rounds[arm].append(stat_rate(os.path.join(mount, "meta"), names))
                for arm, mount in (("open local", pool.mnt), ("open node", node_mnt)):
                    rounds[arm].append(open_rate(os.path.join(mount, "meta"), names))
                if args.flood:
                    idle = open_latency(path)
                    (busy, rate) = flooded(node_mnt, "model.bin", args.flood,
                                           lambda: open_latency(path))
                    for arm, v in zip(("open idle p50", "open idle p99", "open flood p50",
                                       "open flood p99", "flood reads"), (*idle, *busy, rate),
                                      strict=True):
                        rounds[arm].append(v)
                rounds["lag"].append(1000 * statistics.median(
                    visible_after(os.path.join(pool.mnt, "lag"), os.path.join(node_mnt, "lag"),
                                  f"r{i}-{k}") for k in range(args.lags)))
        finally:
            server.close()
    medians = {k: statistics.median(v) for k, v in rounds.items() if v}
    print(f"{format_size(size)} held by the writer node, read by a node in a network "
          f"namespace (veth), median of {args.repeat}:")
    for k in ("sendfile", "chunks", "direct", "node", "local"):
        gbps = medians[k]
        print(f"  {k:9s} {gbps:6.2f} GB/s  {gbps / medians['sendfile']:.2f} of sendfile")
    print(f"{args.kv_chunks} KV chunks of {format_size(KV_CHUNK)} put on the writer, "
          f"batch_get: on the writer {medians['kv local']:.2f} GB/s, on the reading node "
          f"{medians['kv node']:.2f} GB/s ({medians['kv node'] / medians['sendfile']:.2f} "
          "of sendfile)")
    print(f"{args.kv_chunks} new KV chunks, batch_put: on the writer "
          f"{medians['kv put local']:.2f} GB/s, on the reading node "
          f"{medians['kv put node']:.2f} GB/s ({medians['kv put node'] / medians['sendfile']:.2f}"
          " of sendfile)")
    print(f"KV lookups (exists_many of {len(keys)} keys): on the writer "
          f"{medians['kv exists local']:,.0f} keys/s, on the reading node "
          f"{medians['kv exists node']:,.0f} keys/s from its table, "
          f"{medians['kv exists asked']:,.0f} keys/s asking its daemon; a key put on the "
          "writer seen on the "
          f"reading node {medians['kv lag']:.1f} ms after (median)")
    print(f"{args.files} files stat'ed after 1.5 s idle: on the writer "
          f"{medians['stat local']:.0f}/s, on the reading node {medians['stat node']:.0f}/s "
          f"({medians['stat node'] / medians['stat local']:.2f} of the writer), opened and "
          f"closed each once: on the writer {medians['open local']:.0f}/s, on the reading "
          f"node {medians['open node']:.0f}/s "
          f"({medians['open node'] / medians['open local']:.2f} of the writer); a new file "
          f"seen on the reading node {medians['lag']:.1f} ms after its close (median)")
    if args.flood:
        print(f"open+close on the writer's mount, p50/p99: idle {medians['open idle p50']:.0f}/"
              f"{medians['open idle p99']:.0f} us, while {args.flood} of the reading node's "
              f"scoped connections flood it ({medians['flood reads']:.0f} READs/s answered) "
              f"{medians['open flood p50']:.0f}/{medians['open flood p99']:.0f} us")
    save_results(args, rounds=rounds, medians=medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())

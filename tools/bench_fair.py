#!/usr/bin/env python3
"""How long one user's requests wait while another user floods the daemon.

A victim (uid 65533) looks up one KV key over and over and records each lookup's
latency (`--victim xattr`: sets a 64 KB xattr every 100 ms, a tenant well within her
share of the pool's xattr pace), while a hog (uid 65534) does one thing, side by side
in one run:

  none       nothing (the victim's baseline)
  ns_remove  removes a namespace of --chunks chunks in one request
  puts       back-to-back kv_put of 4,096 one-byte chunks a request
  list       back-to-back kv_list asking for 100,000 names
  deletes    back-to-back kv_delete of 4,096 keys a request (half of them present)
  walks      back-to-back `layout` of a path through 40 symbolic links of long paths
  waits      8 connections waiting (kv_wait, 20 s) on a key its own claim holds
  misses     8 threads stat'ing names that do not exist (each a lookup the daemon answers)
  lookups    8 connections asking kv_exists of 4,096 absent keys a request
  parses     64 connections sending 1 MiB requests of 350,000 empty lists (refused)
  bigints    64 connections sending 1 MiB requests of 243 integers of 4,299 digits
  floats     64 connections sending 1 MiB requests of 1,360 numbers of 760 digits, each
             halfway between two doubles (2**-1075 written out: the slowest to round)
  claims     4 connections each claiming 4,096 new keys for 1 ms, over and over (the
             claims run out by the thousand, ended by the next claim and the sweep)
  truncates  8 threads each writing 4 KiB into a file of its own and cutting it to 0
  readdir    8 threads each listing a folder of 40,000 empty files, one getdents64 of
             1 MiB a call (since Linux 6.16 a FUSE readdir takes what getdents asks:
             thousands of entries a request), a name made and removed before each
             listing (the kernel's cached listing dropped)
  xattrs     4 threads each making files with four user xattrs of 64,000 bytes (the
             store's WAL grows 256 KiB a file), the files kept
  xattr_frees  the same, each file removed once tagged (its xattrs freed by reclaim)
  xattr_tenants  the xattrs arm as six tenants at once (uids 64001-64006), each within
             her own pace: together past what the checkpointer copies between its runs
  symlink_tenants  the symlinks arm as six tenants at once
  symlinks   4 threads each making symbolic links with 4,000-byte targets (the store's
             WAL grows a page or two a link), the links kept
  scrapes    4 threads asking the daemon's Prometheus endpoint (`-o metrics_port`) for
             /metrics over and over, two of them with 99 headers of 64 KiB a request

With `--meta URL` (an empty PostgreSQL database) both users work on a reading node (a
network namespace of its own, `tools/bench_nodes.py`), whose KV puts, claims and waits
go to the writer and whose lookups are the store's: arms none, puts, waits, misses,
lookups.

Reports the victim's median, p99 and worst latency in ms for each (medians over
--repeat rounds).  Run as root (it mounts a scratch pool and drops to the two uids).

    python tools/bench_fair.py --chunks 65536 --seconds 5 --repeat 3
    python tools/bench_fair.py --meta 'postgresql:///fair?host=/run/pg' --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_nodes import two_nodes  # noqa: E402

from mxfs.cli.demo import bench_args, save_results, scratch_pool  # noqa: E402

VICTIM, HOG = 65533, 65534
ARMS = ("none", "ns_remove", "puts", "list", "deletes", "walks", "waits", "misses", "lookups",
        "parses", "bigints", "floats", "claims", "truncates", "readdir", "xattrs", "symlinks",
        "xattr_frees", "xattr_tenants", "symlink_tenants", "scrapes")
TENANTS = tuple(range(64001, 64007))  # (`*_tenants`: six hogs, each a tenant)
AS_TENANTS = {"xattr_tenants": "xattrs", "symlink_tenants": "symlinks"}
NODE_ARMS = ("none", "puts", "waits", "misses", "lookups")

# Each runs as its uid in a process of its own: argv = mount, arm, seconds, chunks.
HOG_CODE = r"""
import base64, os, sys, time
from mxfs.client import ControlClient
mnt, arm, seconds, chunks = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
c = ControlClient(mnt)
key = lambda i: base64.b64encode(b"k%08d" % i).decode()
one = base64.b64encode(b"x").decode()
def put_range(ns, start, n):
    for s in range(start, start + n, 4096):
        m = min(4096, start + n - s)
        c.call("kv_put", namespace=ns, keys=[key(i) for i in range(s, s + m)], data=[one] * m)
if arm == "walks":  # 40 links, each 1,600 components long: 64,000 lookups a walk
    home = os.path.join(mnt, "hog")
    fd = os.open(home, os.O_RDONLY)
    for _ in range(800):
        try:
            os.mkdir("a", dir_fd=fd)
        except FileExistsError:
            pass
        fd, old = os.open("a", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    for i in range(40):
        link = os.path.join(home, f"l{i}")
        if not os.path.lexists(link):
            os.symlink("a/" * 800 + "../" * 800 + (f"l{i - 1}" if i else "."), link)
    walk = "/hog/l39"
if arm == "ns_remove":
    put_range("hog", 0, chunks)
if arm == "deletes":
    put_range("hog", 0, 2048)
if arm == "list":
    put_range("hog-list", 0, 16384)
if arm == "lookups":  # (its namespace made, with one key: lookups of others miss)
    put_range("hog", 0, 1)
if arm == "readdir":  # (made once a run: the rounds after list the same folder)
    listed = os.path.join(mnt, "hog", "listed")
    os.makedirs(listed, exist_ok=True)
    for i in range(len(os.listdir(listed)), 40_000):
        os.close(os.open(os.path.join(listed, "f%05d" % i), os.O_CREAT | os.O_WRONLY, 0o600))
def crowd(work, connect=lambda: ControlClient(mnt), n=8):
    # work(conn, k) over and over from n threads, a connection each, until the end
    import threading
    conns = [connect() for _ in range(n)]
    done = []
    def run(conn):
        k = 0
        while time.monotonic() < end:
            work(conn, k)
            k += 1
        done.append(k)
    threads = [threading.Thread(target=run, args=(conn,)) for conn in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)
if arm == "waits":  # a claim of its own, waited on from 8 other connections
    c.call("kv_claim", namespace="hog", keys=[key(0)], ms=60000)
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
n = 0
if arm == "waits":
    n = crowd(lambda w, k: w.call("kv_wait", namespace="hog", keys=[key(0)],
                                    ms=int(seconds * 1000)))
if arm == "misses":
    n = crowd(lambda w, k: os.path.exists(os.path.join(mnt, f"no-{os.urandom(8).hex()}")),
              connect=lambda: None)
if arm == "lookups":
    n = crowd(lambda w, k: w.call("kv_exists", namespace="hog", keys=[
        base64.b64encode(os.urandom(16)).decode() for _ in range(4096)]))
if arm == "claims":
    n = crowd(lambda w, k: w.call("kv_claim", namespace="hog", ms=1, keys=[
        base64.b64encode(os.urandom(16)).decode() for _ in range(4096)]), n=4)
if arm in ("parses", "bigints", "floats"):  # each a fresh connection: the daemon
    import socket, struct                   # closes what it refuses
    from decimal import Decimal, localcontext
    path = os.getxattr(mnt, "user.mxfs.control").decode()
    with localcontext() as exact:
        exact.prec = 2000
        half = str(Decimal(1) / Decimal(2) ** 1075).encode()  # (2**-1075, every digit)
    body = b'{"op":"hello","x":[' + (
        b"[]," * 349_000 + b"[]" if arm == "parses" else
        b",".join([b"9" * 4299] * 243) if arm == "bigints" else
        b",".join([half] * ((1 << 20) // (len(half) + 1) - 1))) + b"]}"
    frame = struct.pack("!4sHHI", b"MXFS", 1, 0, len(body)) + body
    def parse(_, k):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(frame)
            s.recv(1 << 16)
    n = crowd(parse, connect=lambda: None, n=64)
if arm == "truncates":
    def cut(f, k):
        os.pwrite(f, b"t" * 4096, 0)
        os.ftruncate(f, 0)
    n = crowd(cut, connect=lambda: os.open(os.path.join(mnt, "hog", os.urandom(8).hex()),
                                           os.O_RDWR | os.O_CREAT, 0o600))
if arm == "readdir":  # (ctypes imported before the uid changed: it is root's)
    libc = ctypes.CDLL(None, use_errno=True)
    def listing(buf, k):
        # (a name made and removed first: the kernel's cached listing goes, as any
        # change of the folder drops it, and the daemon lists it again)
        made = os.path.join(listed, "z%d" % threading.get_ident())
        os.close(os.open(made, os.O_CREAT | os.O_WRONLY, 0o600))
        os.unlink(made)
        fd = os.open(listed, os.O_RDONLY | os.O_DIRECTORY)
        try:  # (SYS_getdents64 on x86-64 is 217; aarch64 61)
            while libc.syscall(217 if os.uname().machine == "x86_64" else 61, fd, buf,
                               len(buf)) > 0:
                pass
        finally:
            os.close(fd)
    n = crowd(listing, connect=lambda: ctypes.create_string_buffer(1 << 20))
if arm == "scrapes":  # (argv's chunks is the metrics port here)
    big = b"".join(b"X-%d: %s\r\n" % (i, b"h" * 65000) for i in range(99))
    def scrape(i, k):  # (threads 1 and 3 send the big headers)
        head = big if i % 2 else b""
        try:
            with socket.create_connection(("127.0.0.1", chunks), timeout=5) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\n" + head + b"\r\n")
                while s.recv(1 << 16):
                    pass
        except OSError:
            pass
    n = crowd(scrape, connect=lambda it=iter(range(4)): next(it), n=4)
if arm in ("xattrs", "xattr_frees"):
    value = os.urandom(64000)
    def tag(home, k):
        path = os.path.join(home, "f%d" % k)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        for j in range(4):
            os.setxattr(path, "user.v%d" % j, value)
        if arm == "xattr_frees":
            os.unlink(path)
    n = crowd(tag, connect=lambda: tempfile.mkdtemp(dir=os.path.join(mnt, "hog")), n=4)
if arm == "symlinks":
    target = "t/" * 2000
    def link(home, k):
        os.symlink(target, os.path.join(home, "l%d" % k))
    n = crowd(link, connect=lambda: tempfile.mkdtemp(dir=os.path.join(mnt, "hog")), n=4)
if arm == "ns_remove":
    c.call("kv_ns_remove", namespace="hog"); n = 1
while arm in ("puts", "list", "deletes", "walks") and time.monotonic() < end:
    if arm == "puts":
        put_range("hog", n * 4096, 4096)
    elif arm == "list":
        c.call("kv_list", namespace="hog-list", limit=100000)
    elif arm == "deletes":
        c.call("kv_delete", namespace="hog", keys=[key(i) for i in range(4096)])
        put_range("hog", 0, 2048)
    elif arm == "walks":
        try:
            c.call("layout", path=walk)
        except OSError:
            pass
    n += 1
print(n, flush=True)
"""

VICTIM_CODE = r"""
import base64, errno, json, os, sys, time
from mxfs.client import ControlClient
mnt, seconds, mode, home = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
c = ControlClient(mnt)
k = base64.b64encode(b"victim").decode()
c.call("kv_put", namespace="victim", keys=[k], data=[base64.b64encode(b"v" * 100).decode()])
path = os.path.join(home, f"victim-{os.getpid()}")
if mode == "xattr":
    open(path, "w").close()
print("ready", flush=True)
sys.stdin.readline()
lat, refused, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
    t = time.perf_counter()
    if mode == "kv":
        c.call("kv_exists", namespace="victim", keys=[k])
    else:  # a tenant tagging a file with 64 KB now and then (640 KB/s)
        try:
            os.setxattr(path, "user.v", b"v" * 64000)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            refused += 1
    lat.append(time.perf_counter() - t)
    time.sleep(0.002 if mode == "kv" else 0.1)
if mode == "xattr":
    os.unlink(path)
print(json.dumps([lat, refused]), flush=True)
"""


def as_user(uid: int, code: str, *args: str) -> subprocess.Popen[str]:
    """`code` in a process that imports as root (the interpreter may sit in root's
    folders), then becomes `uid` before it touches the mount."""
    become = ("import base64, ctypes, decimal, encodings.idna, json, os, socket, sys, tempfile, "
              "threading, time\n"
              "import mxfs.client\n"
              f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n")
    return subprocess.Popen([sys.executable, "-c", become + code, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


METRICS_PORT = 590  # the scratch pool's Prometheus endpoint (the `scrapes` arm; a
# privileged port: mount refuses one any user may bind, fs/ports.py)


def one_round(mnt: str, arm: str, seconds: float, chunks: int, victim_op: str = "kv",
              home: str = "") -> dict[str, float]:
    uids, hog_arm = (TENANTS, AS_TENANTS[arm]) if arm in AS_TENANTS else ((HOG,), arm)
    hogs = [as_user(uid, HOG_CODE, mnt, hog_arm, str(seconds),
                    str(METRICS_PORT if arm == "scrapes" else chunks)) for uid in uids]
    victim = as_user(VICTIM, VICTIM_CODE, mnt, str(seconds), victim_op, home)
    assert victim.stdout and victim.stdin
    for hog in hogs:
        assert hog.stdout and hog.stdout.readline().strip() == "ready", f"hog ({arm}) failed"
    assert victim.stdout.readline().strip() == "ready", "victim failed"
    victim.stdin.write("\n")
    victim.stdin.flush()
    time.sleep(0.2)
    for hog in hogs:
        assert hog.stdin
        hog.stdin.write("\n")
        hog.stdin.flush()
    lat, refused = json.loads(victim.stdout.readline())
    lat.sort()
    # (how many requests the hogs made)
    done = sum(float(h.stdout.readline().strip() or 0) for h in hogs if h.stdout)
    for p in (*hogs, victim):
        p.wait()
    return {"median": statistics.median(lat) * 1e3, "p99": lat[int(len(lat) * 0.99)] * 1e3,
            "worst": lat[-1] * 1e3, "lookups": len(lat), "hog": done, "refused": refused}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_args(ap)
    ap.add_argument("--chunks", type=int, default=65536, help="chunks ns_remove removes")
    ap.add_argument("--seconds", type=float, default=5, help="how long the victim measures")
    ap.add_argument("--arms", help=f"default: {','.join(ARMS)}; with --meta: "
                    f"{','.join(NODE_ARMS)}")
    ap.add_argument("--victim", choices=("kv", "xattr"), default="kv",
                    help="the victim's request: a KV lookup every 2 ms, or a 64 KB "
                    "xattr set every 100 ms (EBUSY counted as refused)")
    ap.add_argument("--meta", help="an empty PostgreSQL database: both users on a "
                    "reading node of a pool whose metadata it holds")
    args = ap.parse_args()
    arms = (args.arms or ",".join(NODE_ARMS if args.meta else ARMS)).split(",")
    results: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    with contextlib.ExitStack() as stack:
        if args.meta:
            _, pool, mnt = stack.enter_context(two_nodes(args.meta, args.dir,
                                                         args.stripe_unit))
        else:
            pool = stack.enter_context(scratch_pool(
                "mxfs-fair-", args.dir,
                mount=["-o", f"allow_other,metrics_port={METRICS_PORT}"]))
            mnt = pool.mnt
        os.chmod(pool.base, 0o755)  # the two users reach the mount through it
        hog_home = os.path.join(pool.mnt, "hog")  # (made on the writer)
        os.makedirs(hog_home, exist_ok=True)
        os.chown(hog_home, HOG, HOG)
        os.chmod(hog_home, 0o1777)  # (`xattr_tenants`: six hogs' folders in it)
        for r in range(args.repeat):
            for arm in arms:
                # The victim waits at most as long as the hog's longest request.
                res = one_round(mnt, arm, args.seconds, args.chunks, args.victim,
                                hog_home)
                results[arm].append(res)
                print(f"round {r + 1} {arm:10s} median {res['median']:8.2f} ms  p99 "
                      f"{res['p99']:8.2f}  worst {res['worst']:8.2f}  ({res['lookups']:.0f} "
                      f"requests, {res['refused']:.0f} refused; the hog's requests "
                      f"{res['hog']:.0f})", flush=True)
    what = "kv_exists" if args.victim == "kv" else "64 KB setxattr"
    print(f"\nvictim's {what} latency, ms (median of rounds): median / p99 / worst "
          "(requests refused)")
    summary = {}
    for arm in arms:
        summary[arm] = {k: statistics.median(x[k] for x in results[arm])
                        for k in ("median", "p99", "worst", "refused")}
        s = summary[arm]
        print(f"  {arm:10s} {s['median']:8.2f} {s['p99']:8.2f} {s['worst']:8.2f} "
              f"({s['refused']:.0f})")
    save_results(args, rounds=results, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

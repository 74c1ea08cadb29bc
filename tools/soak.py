#!/usr/bin/env python3
"""Soak and crash harness: a mixed workload on a pool, with the daemon and clients killed.

Four kinds of client run as separate processes against a scratch pool (or --pool),
and with --hostile a fifth, as nobody:
  files   write files through the mount (content derived from the name), fsync them,
          rename them into place, delete some; each fsynced file is journaled outside
          the pool only after its fsync returned
  ckpt    mxfs.ckpt.save with keep_last=3, journaling each checkpoint after wait()
  kv      KVStore puts and gets of chunks whose bytes derive from their key; every hit
          must be exact
  load    mxfs.load.load_file of a model written at the start, compared tensor by tensor
  hostile (uid 65534) floods in turn: 4,096-chunk kv_puts and removals of its namespace,
          64 KiB xattrs file after file, direct files committed or aborted while it keeps
          writing through their descriptors, a descriptor of a file on the mount sent
          with a request, replies carrying descriptors left unread, a file written until
          its quota (HOSTILE_QUOTA) refuses; its own errors are its own, the others must
          lose nothing, and it never owns more than its quota
Every --crash-every seconds the daemon and a random client are SIGKILLed at once; the
pool is detached, checked offline (metadata invariants, no stray chunk files), mounted
again, and everything journaled is verified: every fsynced file reads back exactly,
every journaled checkpoint that retention kept loads and verifies, no partial
checkpoint is listed (the first crash waits for a checkpoint committed, PROGRESS_S at
most: on a loaded machine none was, and the cycles checked none).  Without
--crash-every it is a plain soak that checks the same at the end.  Exit 0 when nothing was lost.

    python tools/soak.py --minutes 30 --crash-every 20
    python tools/soak.py --hours 72              # the stability gate
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from mxfs.cli.demo import run_mxfs, scratch_pool
from mxfs.cli.scratch import scratch_dir
from mxfs.client import ControlClient
from mxfs.client import direct as direct_clients

FILES = r"""
import hashlib, os, random, sys
root, journal, me = sys.argv[1], sys.argv[2], sys.argv[3]
KEEP = 300  # files a writer keeps: older ones are deleted, so the pool does not fill up
rng = random.Random(os.getpid())
j = open(journal, "a", buffering=1)
i = 0
while True:
    i += 1
    name = f"{me}-{os.getpid()}-{i}"
    size = rng.choice([0, 100, 4096, 70_000, 1 << 20, 3 << 20])
    data = hashlib.shake_256(name.encode()).digest(size) if size else b""
    try:
        tmp = os.path.join(root, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(root, name))
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        j.write(f"synced {name} {size}\n")
        for victim_i in ([i - 3] if i % 7 == 0 else []) + ([i - KEEP] if i > KEEP else []):
            if victim_i % 7 == 4 and victim_i != i - 3:
                continue  # deleted already, as someone's i - 3
            victim = f"{me}-{os.getpid()}-{victim_i}"
            j.write(f"deleting {victim}\n")  # before: a kill between leaves it in doubt
            os.unlink(os.path.join(root, victim))
    except OSError:
        sys.exit(0)  # the daemon is gone: this client ends with it
"""

CKPT = r"""
import os, sys, time, torch
import mxfs.ckpt as ck
root, journal = sys.argv[1], sys.argv[2]
j = open(journal, "a", buffering=1)
saver = ck.Checkpointer(keep_last=3)
step = int(time.time() * 1000)
while True:
    step += 1
    state = {"w": torch.full((1 << 18,), float(step % 1000)), "step": step}
    try:
        saver.save(state, os.path.join(root, f"step-{step}")).wait()
    except Exception:
        sys.exit(0)
    j.write(f"ckpt step-{step} {step}\n")
"""

KV = r"""
import hashlib, os, random, sys
from mxfs.kv import KVStore
mount = sys.argv[1]
rng = random.Random(os.getpid())
def blob(k):
    return hashlib.shake_256(k.encode()).digest(rng.choice([1000, 70_000, 600_000]))
try:
    kv = KVStore(mount, "soak", capacity=64 << 20)
    while True:
        k = f"k{rng.randrange(2000)}"
        if rng.random() < 0.5:
            kv.put(k, hashlib.shake_256(k.encode()).digest(4096 + hash(k) % 7 * 50_000))
        else:
            got = kv.get(k)
            if got is not None:
                want = hashlib.shake_256(k.encode()).digest(len(got))
                if got != want:
                    print("KV WRONG BYTES", k, flush=True)
                    sys.exit(3)
except (OSError, ConnectionError):
    sys.exit(0)
"""

LOAD = r"""
import sys, torch
from mxfs.load import load_file
path = sys.argv[1]
want = {f"t{i}": torch.arange(i * 1000, dtype=torch.float32) for i in range(1, 40)}
try:
    while True:
        got = load_file(path)
        for k, v in want.items():
            if not torch.equal(got[k], v):
                print("LOAD WRONG", k, flush=True)
                sys.exit(3)
except (OSError, ConnectionError):
    sys.exit(0)
except Exception as e:
    if "daemon" in str(e) or "not running" in str(e):
        sys.exit(0)
    raise
"""

NOBODY = 65534
PROGRESS_S = 120.0  # the first crash waits this long at most for a checkpoint committed
HOSTILE_QUOTA = 64 << 20  # bytes the hostile client may own (mxfs quota)

HOSTILE = r"""
import array, base64, errno, os, socket, sys, time
import mxfs.client
from mxfs.proto import encode
root, HOSTILE_QUOTA = sys.argv[1], int(sys.argv[2])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
b = lambda s: base64.b64encode(s).decode()
def attempt(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except OSError:
        return None
try:
    c = mxfs.client.ControlClient(os.path.dirname(root))
    unread = mxfs.client.ControlClient(os.path.dirname(root))
    unread.call("hello")
    kept = []
    for n in range(10**9):
        keys = [b(b"h%d-%d" % (n, i)) for i in range(4096)]
        attempt(c.call, "kv_put", namespace="hog", keys=keys, data=[b(b"x")] * 4096)
        if n % 3 == 2:
            attempt(c.call, "kv_ns_remove", namespace="hog")
        for i in range(50):  # xattrs until refused, then gone again
            f = os.path.join(root, f"x{i}")
            if attempt(lambda: open(f, "wb").close()) is None:
                break
            for j in range(3):
                attempt(os.setxattr, f, f"user.h{j}".encode(), b"v" * 65536)
        for i in range(50):
            attempt(os.unlink, os.path.join(root, f"x{i}"))
        r = attempt(c.call_with_fds, "create", path="/hostile/d%d" % n, size=4096)
        if r is not None:  # write on past its commit (refused) and its abort
            reply, fds = r
            os.pwrite(fds[0], b"z" * (1 << 20), 0)
            attempt(c.call, "commit", ino=reply["ino"], size=4096, sum_unit=65536,
                    sums=b(bytes(8)))
            attempt(c.call, "abort", ino=reply["ino"])
            attempt(os.pwrite, fds[0], b"z" * (1 << 20), 0)  # (EPERM where held files
            # are immutable)
            kept += fds
            while len(kept) > 64:
                os.close(kept.pop(0))
        fd = attempt(os.open, os.path.join(root, "sent"), os.O_RDWR | os.O_CREAT, 0o600)
        if fd is not None:  # its close in the daemon would send FLUSH back to it
            s = socket.socket(socket.AF_UNIX)
            s.connect(os.getxattr(os.path.dirname(root), "user.mxfs.control").decode())
            msg = encode({"op": "hello", "id": 1})
            try:
                s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", [fd]).tobytes())])
            except PermissionError:
                pass
            os.close(fd)
            s.close()
        for _ in range(8):  # replies with descriptors, never read
            unread.sock.sendall(encode({"op": "open_read", "path": "/hostile/sent", "id": 2}))
        big = os.path.join(root, "big")  # written until its quota refuses, then gone
        fd = attempt(os.open, big, os.O_WRONLY | os.O_CREAT, 0o600)
        if fd is not None:
            for _ in range(2 * HOSTILE_QUOTA >> 20):
                if attempt(os.write, fd, b"q" * (1 << 20)) is None:
                    break
            os.close(fd)
            attempt(os.unlink, big)
        print("hostile round", flush=True)
except (OSError, ConnectionError):
    sys.exit(0)
"""


class Harness:
    def __init__(self, members: list[str], mnt: str, journals: Path,
                 hostile: bool = False) -> None:
        self.members, self.mnt, self.journals = members, mnt, journals
        self.hostile = hostile
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.stats = {"cycles": 0, "file_checks": 0, "checkpoints_verified": 0,
                      "kv_wrong": 0, "load_wrong": 0, "lost": 0, "problems": 0,
                      "hostile_rounds": 0}
        self.errors: list[str] = []

    def start_clients(self) -> None:
        root = os.path.join(self.mnt, "files")
        os.makedirs(root, exist_ok=True)
        ck_root = os.path.join(self.mnt, "ckpt")
        os.makedirs(ck_root, exist_ok=True)
        specs = {"files-a": (FILES, root, str(self.journals / "files-a"), "a"),
                 "files-b": (FILES, root, str(self.journals / "files-b"), "b"),
                 "ckpt": (CKPT, ck_root, str(self.journals / "ckpt")),
                 "kv": (KV, self.mnt), "load": (LOAD, os.path.join(self.mnt, "model.st"))}
        if self.hostile:
            hostile = os.path.join(self.mnt, "hostile")
            os.makedirs(hostile, exist_ok=True)
            os.chmod(hostile, 0o1777)
            specs["hostile"] = (HOSTILE, hostile, str(HOSTILE_QUOTA))
        for name, (code, *argv) in specs.items():
            self.procs[name] = subprocess.Popen([sys.executable, "-c", code, *argv],
                                                stdout=subprocess.PIPE, text=True)

    def journaled(self) -> int:
        """Checkpoints journaled so far (each committed: `saver.save(...).wait()`)."""
        try:
            return len((self.journals / "ckpt").read_text().splitlines())
        except FileNotFoundError:
            return 0

    def stop_clients(self, kill_one: bool) -> None:
        if kill_one:
            victim = random.choice(list(self.procs))
            self.procs[victim].kill()  # a client killed mid-operation
        for p in self.procs.values():
            try:
                out, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            self.stats["hostile_rounds"] += (out or "").count("hostile round")
            if "WRONG" in (out or ""):
                self.errors.append(out.strip())
                self.stats["kv_wrong" if "KV" in out else "load_wrong"] += 1
        self.procs = {}

    def daemon_pid(self) -> int:
        with ControlClient(self.mnt) as c:
            return int(c.server["pid"])

    def crash(self) -> None:
        """SIGKILL the daemon with the clients running, then let the clients notice."""
        os.kill(self.daemon_pid(), signal.SIGKILL)
        time.sleep(0.2)
        self.stop_clients(kill_one=True)
        direct_clients._clients.clear()
        run_mxfs("umount", self.mnt)  # detaches the dead mount

    def check_offline(self) -> None:
        from mxfs.vol.volume import Volume

        vol = Volume.open(self.members[0])
        try:
            # Orphans and unsynced tails are the next mount's to recover and are not
            # problems; a dangling entry or a chunk file without an inode would be.
            problems = vol.problems()
        finally:
            vol.store.close()
        if problems:
            self.stats["problems"] += len(problems)
            self.errors += problems[:10]

    def verify(self) -> None:
        """Everything journaled is there, exactly; no partial checkpoint is listed."""
        import mxfs.ckpt as ck

        alive: dict[str, int] = {}
        for name in ("files-a", "files-b"):
            path = self.journals / name
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                parts = line.split()
                if parts[0] == "synced":
                    alive[parts[1]] = int(parts[2])
                elif parts[0] == "deleting":
                    alive.pop(parts[1], None)  # gone, or not yet: either is right
        for name, size in alive.items():
            p = Path(self.mnt) / "files" / name
            want = hashlib.shake_256(name.encode()).digest(size) if size else b""
            try:
                ok = p.read_bytes() == want
            except OSError:
                ok = False
            if not ok:
                self.stats["lost"] += 1
                self.errors.append(f"fsynced file {name} lost or wrong")
        self.stats["file_checks"] += len(alive)
        ck_root = os.path.join(self.mnt, "ckpt")
        listed = {e.name for e in ck.list_checkpoints(ck_root)}
        journaled = []
        if (self.journals / "ckpt").exists():
            journaled = [line.split()[1] for line in
                         (self.journals / "ckpt").read_text().splitlines()]
        def step(name: str) -> int:
            return int(name.split("-")[1])

        if journaled:
            # The newest committed checkpoint is listed, unless a newer one (whose writer
            # was killed before journaling it) is, and retention made room for it.
            newest = journaled[-1]
            if newest not in listed and not any(step(n) > step(newest) for n in listed):
                self.stats["lost"] += 1
                self.errors.append(f"committed checkpoint {newest} missing")
        latest = ck.catalog.latest_name(ck_root)
        if listed and latest not in listed:
            self.stats["lost"] += 1
            self.errors.append(f"latest names {latest}, which is not listed")
        for name in listed:  # every listed one is whole and holds what was saved
            state = ck.load(os.path.join(ck_root, name))
            if float(state["w"][0]) != float(state["step"] % 1000):
                self.stats["lost"] += 1
                self.errors.append(f"checkpoint {name} holds the wrong values")
        self.stats["checkpoints_verified"] += len(listed)
        if self.hostile:
            report = json.loads(run_mxfs("quota", self.mnt, "--json", "--user", str(NOBODY)))
            row = report["users"][0]  # (what the quota holds against it: orphans queued
            owned = row["bytes"] + row["reserved"] + row["held"] - row["freeing"]  # to go
            # are not)
            if owned > HOSTILE_QUOTA:
                self.stats["problems"] += 1
                self.errors.append(f"uid {NOBODY} owns {owned} bytes past its quota")


def write_model(path: str) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({f"t{i}": torch.arange(i * 1000, dtype=torch.float32) for i in range(1, 40)},
              path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=0.0)
    ap.add_argument("--hours", type=float, default=0.0)
    ap.add_argument("--crash-every", type=float, default=0.0,
                    help="seconds between crashes (0: none, a plain soak)")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--hostile", action="store_true",
                    help="a fifth client, as nobody, floods the daemon meanwhile")
    args = ap.parse_args(argv)
    seconds = args.minutes * 60 + args.hours * 3600 or 60
    journals = Path(scratch_dir("mxfs-soak-journal-", args.dir))
    start = time.monotonic()
    mount = ["-o", "allow_other"] if args.hostile else []
    with scratch_pool("mxfs-soak-", args.dir, mount=mount) as pool:
        if args.hostile:
            os.chmod(pool.base, 0o755)  # nobody reaches the mount through it
        h = Harness(pool.members, pool.mnt, journals, args.hostile)
        if args.hostile:
            run_mxfs("quota", pool.mnt, "--user", str(NOBODY), "--bytes", str(HOSTILE_QUOTA))
        write_model(os.path.join(pool.mnt, "model.st"))
        h.start_clients()
        while time.monotonic() - start < seconds:
            wait = args.crash_every or (seconds - (time.monotonic() - start))
            time.sleep(max(0.0, min(wait, seconds - (time.monotonic() - start))))
            if not args.crash_every:
                break
            if not h.journaled():  # (a loaded machine: the first crash waits for the first
                # checkpoint committed, PROGRESS_S at most, or the cycles check none)
                began = time.monotonic()
                while not h.journaled() and time.monotonic() - began < PROGRESS_S:
                    time.sleep(0.2)
                start += time.monotonic() - began  # (not counted in the soak's time)
            h.crash()
            h.check_offline()
            run_mxfs("mount", *mount, pool.members[0], pool.mnt)
            h.verify()
            h.stats["cycles"] += 1
            print(f"[{time.monotonic() - start:7.0f} s] cycle {h.stats['cycles']}: "
                  + json.dumps(h.stats), file=sys.stderr, flush=True)
            if time.monotonic() - start < seconds:
                h.start_clients()
        for p in h.procs.values():
            p.kill()  # clients run until stopped; a kill is as good a stop as any
        h.stop_clients(kill_one=False)
        h.verify()
        direct_clients._clients.clear()
    report = {**h.stats, "seconds": round(time.monotonic() - start), "errors": h.errors[:20]}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = report["lost"] == 0 and report["problems"] == 0 and not report["kv_wrong"] \
        and not report["load_wrong"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

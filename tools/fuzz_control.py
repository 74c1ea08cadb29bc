#!/usr/bin/env python3
"""Fuzz a live daemon's control socket as a hostile local user would.

Sends N requests over a few connections: random frames (bad magic, versions,
lengths, cut short), random JSON of random depth and type for every op, fields
drawn from plausible values (paths under a shared sticky folder, inodes seen in
replies, valid base64) mixed with hostile ones (surrogates, NUL, names over 255
bytes, 2^63 and 2^64, negatives, floats, NaN, deep lists, objects), and random
counts of descriptors passed along.  A refused or dropped connection is simply
made again.  Prints a JSON summary: requests, distinct ops, answers by errno,
seconds.  The daemon must be alive afterwards (the caller checks it, its
descriptors and RSS).

    python tools/fuzz_control.py MOUNT --cases 100000 [--seed 1] [--dir /fz] [--as-user 65534]
"""

from __future__ import annotations

import argparse
import array
import base64
import json
import os
import random
import socket
import struct
import sys
import time
from collections import Counter
from typing import Any

from mxfs.proto import HEADER, MAX_PAYLOAD, OPS, VERSION
from mxfs.proto.framing import MAGIC, ancillary_space

FIELDS = ("path", "size", "mode", "ino", "sum_unit", "sums", "replace", "exclusive",
          "odirect", "namespace", "key", "keys", "data", "capacity", "keep", "limit", "skip",
          "inline_max", "pin", "shared", "uid", "gid", "force", "version", "set", "clear",
          "default", "bytes", "inodes")
HUGE: list[object] = [2**63 - 1, 2**63, 2**64, 2**70, -1, -(2**63), -(2**70), 10**30]
STRANGE = ["\ud800", "a\udcffb", "\0", "a\0b", "x" * 300, "/" + "y" * 256, "", ".", "..",
           "/..", "//", "\u202e", "\x7f", "é" * 200, "/fz/\ud83d", "NaN"]


def real_descriptors(mount: str, folder: str) -> list[int]:
    """Descriptors to pass along with requests, of every kind a user has: a file and a
    folder on the mount itself (whose close the daemon must never wait for), a pipe,
    a socket, memory, /dev/null."""
    fds = [os.open(os.devnull, os.O_RDONLY)]
    on_mount = os.path.join(mount, folder.lstrip("/"), f"fuzz-fd-{os.getpid()}")
    try:
        fds.append(os.open(on_mount, os.O_RDWR | os.O_CREAT, 0o600))
        os.write(fds[-1], b"written: its close sends FLUSH to the daemon")
        fds.append(os.open(os.path.join(mount, folder.lstrip("/")), os.O_RDONLY))
    except OSError:
        pass
    fds += list(os.pipe())
    fds += [s.detach() for s in socket.socketpair()]
    fds.append(os.memfd_create("fuzz"))
    return fds


class Fuzzer:
    def __init__(self, mount: str, seed: int, folder: str) -> None:
        self.socket_path = os.getxattr(mount, "user.mxfs.control").decode()
        self.rng = random.Random(seed)
        self.folder = folder
        self.inos: list[int] = [1, 2, 3]
        self.conns: list[socket.socket | None] = [None] * 4
        self.answers: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        self.real_fds = real_descriptors(mount, folder)

    # ---- values ----------------------------------------------------------------

    def b64(self) -> str:
        return base64.b64encode(self.rng.randbytes(self.rng.choice([0, 1, 8, 64]))).decode()

    def deep(self, depth: int) -> Any:
        v: Any = self.rng.choice([0, "x", None, True])
        for _ in range(depth):
            v = [v] if self.rng.random() < 0.5 else {"k": v}
        return v

    def plausible(self, key: str) -> Any:
        r = self.rng
        if key == "path":
            return f"{self.folder}/{r.choice('abcdef')}{r.choice(['', '/g', '/../h'])}"
        if key in ("size", "capacity", "keep", "inline_max", "limit", "skip", "bytes", "inodes"):
            return r.choice([0, 1, 4096, 65536, 1 << 20, r.randrange(1 << 24)])
        if key == "mode":
            return r.choice([0o644, 0o600, 0o777, 0o4755, 0o1777])
        if key == "ino":
            return r.choice(self.inos)
        if key == "sum_unit":
            return r.choice([65536, 1 << 20, 4096])
        if key in ("sums", "key", "data"):
            return self.b64()
        if key == "keys":
            return [self.b64() for _ in range(r.choice([0, 1, 3, 40]))]
        if key == "namespace":
            return r.choice(["fz", "fz2", "default", "sglang-uid0", "roots"])
        if key in ("replace", "exclusive", "odirect", "pin", "shared", "force", "set", "clear",
                   "default"):
            return r.random() < 0.5
        if key in ("uid", "gid"):
            return r.choice([0, 65534, 1000])
        return VERSION

    def hostile(self) -> Any:
        r = self.rng
        kind = r.randrange(8)
        if kind == 0:
            return r.choice(HUGE)
        if kind == 1:
            return r.choice(STRANGE)
        if kind == 2:
            return self.deep(r.randrange(1, 40))
        if kind == 3:
            return r.choice([1.5, -0.0, float("nan"), float("inf"), 1e308])
        if kind == 4:
            return r.choice([None, True, False, [], {}])
        if kind == 5:
            return [r.choice(STRANGE + HUGE) for _ in range(r.randrange(1, 5))]
        if kind == 6:
            return "\\u" + "".join(r.choice("0123456789abcdef") for _ in range(4))
        return {"op": "hello"}

    def request(self) -> dict[str, Any]:
        r = self.rng
        op = r.choice(OPS) if r.random() < 0.95 else r.choice(["", "fly", None, 7, ["x"]])
        msg: dict[str, Any] = {"op": op, "id": r.choice([r.randrange(1 << 31), "s", None])}
        for key in r.sample(FIELDS, r.randrange(0, 8)):
            msg[key] = self.plausible(key) if r.random() < 0.7 else self.hostile()
        if op == "kv_put" and isinstance(msg.get("keys"), list) and r.random() < 0.7:
            msg["data"] = [self.b64() for _ in msg["keys"]]
        return msg

    # ---- the wire --------------------------------------------------------------

    def conn(self, i: int) -> socket.socket:
        s = self.conns[i]
        if s is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(self.socket_path)
            self.conns[i] = s
        return s

    def drop(self, i: int) -> None:
        s = self.conns[i]
        if s is not None:
            s.close()
        self.conns[i] = None

    def frame(self, payload: bytes) -> tuple[bytes, bool]:
        """A frame of `payload`, sometimes broken; and whether it is whole."""
        r = self.rng
        if r.random() < 0.97:
            return HEADER.pack(MAGIC, VERSION, 0, len(payload)) + payload, True
        kind = r.randrange(4)
        if kind == 0:
            return b"JUNK" + payload[:8], True
        if kind == 1:
            return HEADER.pack(MAGIC, r.choice([0, 2, 65535]), 0, len(payload)) + payload, True
        if kind == 2:
            return HEADER.pack(MAGIC, VERSION, r.choice([65, 1000]), MAX_PAYLOAD + 1), True
        return HEADER.pack(MAGIC, VERSION, 0, len(payload) + 5) + payload, False

    def one(self) -> None:
        r = self.rng
        i = r.randrange(len(self.conns))
        msg = self.request()
        self.ops[str(msg.get("op"))[:16]] += 1
        try:
            payload = json.dumps(msg).encode()
        except (ValueError, UnicodeEncodeError):
            payload = b'{"op": "hello"}'
        if r.random() < 0.02:  # a payload too deep to be anything but an attack
            payload = b"[" * r.randrange(100, 200_000) + b"]" * r.randrange(0, 3)
        data, whole = self.frame(payload)
        nfds = r.choice([0] * 20 + [1, 3, 64, 200])
        try:
            s = self.conn(i)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                    array.array("i", [r.choice(self.real_fds) for _ in range(nfds)]
                                ).tobytes())] if nfds else []
            try:
                s.sendmsg([data], anc)
            except PermissionError:  # Linux 6.16: the kernel refuses them for the daemon
                self.answers["descriptors refused"] += 1
                s.sendall(data)
            if not whole:  # half a message, then hang up
                self.answers["hung up"] += 1
                self.drop(i)
                return
            reply = self.reply(s)
        except (OSError, ValueError, struct.error):
            self.answers["dropped"] += 1
            self.drop(i)
            return
        if reply is None:
            self.answers["dropped"] += 1
            self.drop(i)
            return
        if reply.get("ok"):
            self.answers["ok"] += 1
            ino = reply.get("ino")
            if isinstance(ino, int):
                self.inos = (self.inos + [ino])[-64:]
        else:
            self.answers[f"errno {reply.get('errno')}"] += 1
            if reply.get("errno") == 71:  # EPROTO: the daemon hangs up after it
                self.drop(i)

    def reply(self, s: socket.socket) -> dict[str, Any] | None:
        head, anc, _, _ = s.recvmsg(HEADER.size, ancillary_space())
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                for fd in array.array("i", raw[: len(raw) - len(raw) % 4]):
                    os.close(fd)
        if not head:
            return None
        while len(head) < HEADER.size:
            more = s.recv(HEADER.size - len(head))
            if not more:
                return None
            head += more
        _, _, _, length = HEADER.unpack(head)
        body = b""
        while len(body) < length:
            more = s.recv(length - len(body))
            if not more:
                return None
            body += more
        return json.loads(body)

    def run(self, cases: int) -> dict[str, Any]:
        t0 = time.monotonic()
        for _ in range(cases):
            self.one()
        for i in range(len(self.conns)):
            self.drop(i)
        return {"requests": cases, "distinct_ops": len(self.ops),
                "seconds": round(time.monotonic() - t0, 1),
                "answers": dict(self.answers.most_common())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mount")
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default="/fz", help="a folder of the pool the fuzzer may write")
    ap.add_argument("--as-user", type=int, help="drop to this uid (and gid) first, as root")
    args = ap.parse_args()
    if args.as_user is not None:  # after the imports: Python itself may live under /root
        os.setgroups([])
        os.setgid(args.as_user)
        os.setuid(args.as_user)
    print(json.dumps(Fuzzer(args.mount, args.seed, args.dir).run(args.cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

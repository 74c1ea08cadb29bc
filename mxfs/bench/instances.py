"""Instance processes seen from the driver: start them, send requests, collect replies.

Each instance is a `python -P -m mxfs.bench.instance` process; requests go as JSON
lines to its stdin and replies come back on its stdout, matched by id, so the driver
can keep several requests queued at one instance (an engine's waiting queue) and
time them from submission.  Its stderr goes to a log file, quoted when it dies.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, Any

from mxfs.errors import MxfsError
from mxfs.proc import python_module


@dataclass(frozen=True)
class Spec:
    """What every instance of one run is built with."""

    arch: str = "llama"
    size: str = "small"
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    chunk_tokens: int = 256
    namespace: str = "mxfs-bench-ttft"

    def argv(self, mount: str | None, threads: int, local_tokens: int,
             max_tokens: int) -> list[str]:
        args = ["--arch", self.arch, "--size", self.size, "--seed", str(self.seed),
                "--dtype", self.dtype, "--device", self.device,
                "--chunk-tokens", str(self.chunk_tokens), "--namespace", self.namespace,
                "--threads", str(threads), "--local-tokens", str(local_tokens),
                "--max-tokens", str(max_tokens)]
        return args + (["--mount", mount] if mount else [])


class InstanceDied(MxfsError):
    pass


class Instance:
    """One instance process."""

    def __init__(self, cmd: list[str], log_path: str, name: str) -> None:
        self.name, self.log_path = name, log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - lives with the process
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True, bufsize=1)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[dict[str, Any]]] = {}
        self.hello: Future[dict[str, Any]] = Future()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not a reply (the instance keeps stdout for replies alone)
            if msg.get("op") == "hello":
                self.hello.set_result(msg)
                continue
            with self._lock:
                fut = self._waiting.pop(msg.get("id"), None)
            if fut is not None:
                fut.set_result(msg)
        err = InstanceDied(f"instance {self.name} (pid {self.proc.pid}) ended: "
                           f"{self.last_words()}", f"its log is {self.log_path}")
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for fut in waiting + ([self.hello] if not self.hello.done() else []):
            fut.set_exception(err)

    def last_words(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 400))
                tail = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            tail = []
        return tail[-1] if tail else "no message"

    def submit(self, op: str, **fields: Any) -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            rid = next(self._ids)
            self._waiting[rid] = fut
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "id": rid, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader reports the death to every waiting request
        return fut

    def call(self, op: str, timeout: float = 900, **fields: Any) -> dict[str, Any]:
        reply = self.submit(op, **fields).result(timeout)
        if "error" in reply:
            raise MxfsError(f"instance {self.name} refused {op}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.submit("quit").result(30)
            except Exception:  # noqa: BLE001 - it is going either way
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


def start(spec: Spec, count: int, mount: str | None, logs: str, threads: int = 0,
          local_tokens: int = 0, max_tokens: int = 4096, prefix: str = "i",
          cmd: list[str] | None = None) -> list[Instance]:
    """`count` instances started at once; returns when all have built their model."""
    os.makedirs(logs, exist_ok=True)
    argv = spec.argv(mount, threads, local_tokens, max_tokens)
    base = cmd or python_module("mxfs.bench.instance")
    out = [Instance(base + argv, os.path.join(logs, f"{prefix}{i}.log"), f"{prefix}{i}")
           for i in range(count)]
    try:
        for inst in out:
            inst.hello.result(600)
    except BaseException:
        for inst in out:
            inst.kill()
        raise
    return out

"""How long one step of a task holds the daemon's one thread, and which step held it.

Every request, FUSE call and background round shares one trio thread: a step that
runs long (a blocking call, a loop over a user's thousands of rows) makes every user
wait behind it, and nothing else shows it.  `LoopWatch` is a trio instrument that
times every task step; a step longer than `over_s` is counted and logged (INFO)
with its task, its CPU time (a step long in time and short in CPU blocked in a call,
or waited for a CPU or the GIL), the garbage collector's part of it, and where it
resumed and where it stopped (the two innermost frames of ours in its coroutine
stack at both ends: the code between them held the loop).  It costs a
few microseconds a step (the resume point is read before each one), so it runs only
where asked: `MXFS_LOOP_WATCH_MS` in the daemon's environment (tests, benchmarks, an
operator chasing stalls).  A step of a process stopped (SIGSTOP) while in it shows
the whole stop, with no CPU time: tests that stop a daemon show such steps.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import sysconfig
import threading
import time
from types import FrameType
from typing import Any

import trio

log = logging.getLogger("mxfs.fs")

ENV = "MXFS_LOOP_WATCH_MS"
_OURS = os.sep + "mxfs" + os.sep
_LIBRARIES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib")})


def where(coro: Any, depth: int = 2) -> str:
    """The `depth` innermost frames of ours (not trio's, nor any library's) in
    `coro`'s await chain, outermost first, each 'path:line function' (the path from
    mxfs/ on); '?' where none is."""
    ours: list[FrameType] = []
    while coro is not None:
        frame: FrameType | None = getattr(coro, "cr_frame", None) or getattr(
            coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        if not frame.f_code.co_filename.startswith(_LIBRARIES):
            ours.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or \
            getattr(coro, "gi_yieldfrom", None)
    return " > ".join(f"{f.f_code.co_filename.rsplit(_OURS, 1)[-1]}:{f.f_lineno} "
                      f"{f.f_code.co_name}" for f in ours[-depth:]) or "?"


class LoopWatch(trio.abc.Instrument):
    """Times each task step; steps over `over_s` are counted, the longest kept, and
    each logged (see the module's docstring).  A thread of its own looks every
    `over_s` / 2 at a step still running past `over_s` and keeps the loop thread's
    stack as it is then: the call it is in (a blocking one shows only there)."""

    def __init__(self, over_s: float) -> None:
        self.over_s = over_s
        self.long_steps = 0  # steps over over_s
        self.longest = (0.0, "")  # (seconds, what held it)
        self._started = self._cpu = 0.0
        self._step = 0  # steps begun (the sampler's way to tell one from the next)
        self._from = ""
        self._caught = ""  # the loop thread's stack, as the sampler saw it in this step
        self._gc_s = self._gc_start = 0.0  # collectors' time in this step; the last's start
        self._gc_gen = -1  # ... the oldest generation one of them collected (-1: none)
        self._loop_thread = 0
        self._stop = threading.Event()

    def before_run(self) -> None:
        self._loop_thread = threading.get_ident()
        gc.callbacks.append(self._collecting)
        threading.Thread(target=self._sample, name="mxfs-loop-watch", daemon=True).start()

    def after_run(self) -> None:
        self._stop.set()
        gc.callbacks.remove(self._collecting)

    def _collecting(self, phase: str, info: dict[str, Any]) -> None:
        # (any thread's: a collection holds the GIL, and with it the loop's thread)
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start
            self._gc_gen = max(self._gc_gen, int(info.get("generation", 0)))

    def _sample(self) -> None:
        seen = 0
        while not self._stop.wait(max(self.over_s / 2, 0.002)):
            step, started = self._step, self._started
            if step == seen or started == 0.0 or time.perf_counter() - started < self.over_s:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is not None and self._step == step:
                self._caught, seen = _stack(frame), step

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._from = where(task.coro)
        self._cpu = time.thread_time()
        self._gc_s, self._gc_gen = 0.0, -1
        self._caught = ""
        self._step += 1
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        held = time.perf_counter() - self._started
        self._started = 0.0
        if held <= self.over_s:
            return
        cpu = time.thread_time() - self._cpu
        self.long_steps += 1
        what = f"{task.name} from {self._from} to {where(task.coro)}"
        if self._caught:
            what += f"; in it: {self._caught}"
        if held > self.longest[0]:
            self.longest = (held, what)
        # (the thread's own CPU time beside it: a step long in time but short in CPU
        # blocked in a call, or waited for the CPU or the GIL that other threads held;
        # and the garbage collector's time in it, which any allocation may set off)
        gen = f" up to generation {self._gc_gen}" if self._gc_gen >= 0 else ""
        log.info("the loop was held %.1f ms (%.1f ms CPU, %.1f ms collecting%s) by %s",
                 held * 1e3, cpu * 1e3, self._gc_s * 1e3, gen, what)


def _stack(frame: FrameType | None, depth: int = 6) -> str:
    """The `depth` innermost frames from `frame` outwards, innermost last, as `where`
    names them (library frames too: the blocking call is often one)."""
    frames: list[str] = []
    while frame is not None and len(frames) < depth:
        name = frame.f_code.co_filename
        name = name.rsplit(_OURS, 1)[-1] if _OURS in name else os.path.basename(name)
        frames.append(f"{name}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " > ".join(reversed(frames))


def from_env() -> LoopWatch | None:
    """The watch `MXFS_LOOP_WATCH_MS` asks for (its threshold in milliseconds), or None."""
    ms = os.environ.get(ENV, "")
    try:
        return LoopWatch(float(ms) / 1e3) if ms else None
    except ValueError:
        log.warning("%s=%r is not a number of milliseconds: the loop is not watched",
                    ENV, ms)
        return None


"""How mxfs starts Python processes of its own (the daemon, the demo's commands, the
checkpoint writer), and tells whether a process still runs.

`-P` keeps the caller's working folder off the new interpreter's import path: run from
a folder that holds one named `mxfs` (a clone of this repository, for one), `python -m
mxfs` would import that instead of the installed package.
"""

from __future__ import annotations

import os
import sys

NEUTRAL_CWD = "/"  # a daemon must not keep a user's folder busy (or depend on it)


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs `module` with this interpreter, unshadowed."""
    return [sys.executable, "-P", "-m", module, *args]


def running(pid: int) -> bool:
    """Does process `pid` still run?  A zombie does not: it has exited, closed its files,
    dropped its locks and mounts, and only waits for its parent to reap it.  A daemon's
    parent is init, and some inits (a container's first process) reap a second or more
    late, so `os.kill(pid, 0)` would call it alive that long."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # /proc hidden from us: fall back on the signal check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    state = stat[stat.rfind(b")") + 2:][:1]  # the field after "(comm)"; comm may hold ")"
    return state not in (b"Z", b"X")

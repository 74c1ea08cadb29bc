"""How mxfs starts Python processes of its own (the daemon, the demo's commands, the
checkpoint writer).

`-P` keeps the caller's working folder off the new interpreter's import path: run from
a folder that holds one named `mxfs` (a clone of this repository, for one), `python -m
mxfs` would import that instead of the installed package.
"""

from __future__ import annotations

import sys

NEUTRAL_CWD = "/"  # a daemon must not keep a user's folder busy (or depend on it)


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs `module` with this interpreter, unshadowed."""
    return [sys.executable, "-P", "-m", module, *args]

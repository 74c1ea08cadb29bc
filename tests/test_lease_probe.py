"""The lease probe (`pool/revoke.py`: `anyone_holds`, `writers_remain`) beside opens of
the same file: a probe's lease, taken and given back at once, is broken by any open in
between, and the kernel tells its holder with a signal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Probes of argv[1] while a thread of the same process opens it, for argv[2] seconds;
# then how many probes said someone held it, and how many did not.
_RACE = r"""
import os, sys, threading, time
from mxfs.pool import revoke
path, stop = sys.argv[1], time.monotonic() + float(sys.argv[2])
def opener():
    while time.monotonic() < stop:
        os.close(os.open(path, os.O_RDONLY))
threading.Thread(target=opener, daemon=True).start()
said = {True: 0, False: 0}
while time.monotonic() < stop:
    said[revoke.anyone_holds(path)] += 1
print(said[True], said[False])
"""


def test_a_probe_beside_opens_of_its_file_leaves_its_process_alive(tmp_path: Path) -> None:
    """The kernel told the probe's lease breaking with SIGIO, whose default ends the
    process: a daemon probing a file (a chmod of a file lent, a drop, a commit) while
    its own threads opened it for a reader died, and every tenant's mount with it."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    res = subprocess.run([sys.executable, "-c", _RACE, str(path), "3"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (res.returncode, res.stderr[-500:])
    held, free = map(int, res.stdout.split())
    assert held + free > 0

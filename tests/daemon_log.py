"""A pytest plugin: a test fails when a daemon logs a WARNING or ERROR it did not expect.

A daemon's log is where a bug that no assertion sees shows first (an internal error
answered as EIO, a reply that strays from its declaration, a task that died).  Every
daemon of the session's pools logs to `runtime_dir()/UUID.log` (the session's own
folder: conftest sets MXFS_RUNTIME_DIR); the lines each test added
to any of them at WARNING or above must each match a pattern the test (or its module)
expects:

    @pytest.mark.daemon_log(r"protocol .* failed", r"member \\d+ .* failed")

MXFS_DAEMON_LOG=report writes what would fail to `daemon-log-report.txt` instead (to
find what a new test expects).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\S+) (WARNING|ERROR|CRITICAL) (.*)$")
_REPORT = os.environ.get("MXFS_DAEMON_LOG") == "report"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "daemon_log(*patterns): WARNING and ERROR lines the "
                            "daemons may log in this test (regular expressions, searched)")


def _log_dir() -> str:
    from mxfs.vol.mounts import runtime_dir

    return runtime_dir()


def _sizes(folder: str) -> dict[str, int]:
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return {}
    out = {}
    for e in entries:
        if e.name.endswith(".log"):
            try:
                out[e.path] = e.stat().st_size
            except FileNotFoundError:
                pass
    return out


def _warnings(path: str, start: int) -> Iterator[str]:
    """The WARNING-or-worse records written to `path` past `start`, one line each."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            yield f"{m.group(1)} {m.group(2)} {m.group(3)}"
        elif line.startswith("{"):  # -o log_json
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("level") in ("WARNING", "ERROR", "CRITICAL"):
                yield f"{rec.get('logger')} {rec['level']} {rec.get('message')}"


@pytest.fixture(autouse=True)
def _daemon_log(request: pytest.FixtureRequest) -> Iterator[None]:
    """Set up before the test's pools (autouse), so its check follows their unmount."""
    if request.node.get_closest_marker("unit") is not None:
        yield
        return
    folder = _log_dir()
    before = _sizes(folder)
    yield
    expected = [re.compile(p) for mark in request.node.iter_markers("daemon_log")
                for p in mark.args]
    unexpected = []
    for path, size in sorted(_sizes(folder).items()):
        if size != before.get(path, 0):
            unexpected += [line for line in _warnings(path, before.get(path, 0))
                           if not any(p.search(line) for p in expected)]
    if not unexpected:
        return
    if _REPORT:
        with open(Path(request.config.rootpath) / "daemon-log-report.txt", "a") as f:
            f.write("".join(f"{request.node.nodeid}\t{line}\n" for line in unexpected))
        return
    shown = "\n  ".join(line[:300] for line in unexpected[:10])
    pytest.fail(f"a daemon logged {len(unexpected)} WARNING/ERROR line(s) this test does "
                f"not expect (mark it @pytest.mark.daemon_log(PATTERN) if it should):\n  "
                f"{shown}", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A passed session's own runtime folder goes with it (a failed one's logs stay,
    and a passed one's too with MXFS_KEEP_LOGS=1: to read what its daemons logged at
    INFO, the loop watch's long steps among it)."""
    folder = os.environ.get("MXFS_RUNTIME_DIR", "")
    if exitstatus == 0 and os.path.basename(folder).startswith("tests-") and \
            os.environ.get("MXFS_KEEP_LOGS") != "1":
        import shutil

        shutil.rmtree(folder, ignore_errors=True)

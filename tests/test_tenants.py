"""Who a uid answers to (`vol/tenants.py`): a user's subordinate uids share her
per-user limits; everything else answers to itself."""

from __future__ import annotations

import errno
import logging
import pwd
import time
from pathlib import Path

from mxfs.fs import failures
from mxfs.fs.failures import FailureLog
from mxfs.vol.tenants import Tenants


def test_subordinate_ranges_answer_to_their_user(tmp_path: Path) -> None:
    users = [p for p in pwd.getpwall() if p.pw_uid != 0]
    me, other = users[0].pw_name, users[1]
    path = tmp_path / "subuid"
    path.write_text(f"{me}:200000:65536\n"
                    f"{other.pw_uid}:300000:10\n"
                    "no-such-user-here:400000:65536\n"
                    "root:500000:65536\n"  # (root's own: never a tenant's)
                    "broken line\n"
                    f"{me}:oops:5\n"
                    f"{me}:\u00b2:5\n")  # (a digit, to str.isdigit: int() refused it)
    t = Tenants(str(path))
    assert t.of(200000) == 200000  # (nothing read yet)
    t.refresh()
    owner = pwd.getpwnam(me).pw_uid
    assert [t.of(u) for u in (200000, 265535, 265536)] == [owner, owner, 265536]
    assert [t.of(u) for u in (300000, 300009, 300010)] == [other.pw_uid] * 2 + [300010]
    assert [t.of(u) for u in (400000, 500000, 1234, 0)] == [400000, 500000, 1234, 0]
    time.sleep(0.01)  # (a new mtime)
    path.write_text(f"{me}:600000:1\n")
    t.refresh()
    assert t.of(200000) == 200000 and t.of(600000) == owner  # read again once changed
    path.unlink()
    t.refresh()
    assert t.of(600000) == 600000  # no file: every uid its own


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _failure_log(name: str, tenant: Tenants) -> tuple[FailureLog, _Lines]:
    logger = logging.getLogger(f"mxfs.test.{name}")
    logger.propagate = False
    lines = _Lines()
    logger.handlers[:] = [lines]
    return FailureLog(logger, tenant.of), lines


class _Caller:
    def __init__(self, uid: int) -> None:
        self.pid, self.uid = 4242, uid


def test_failures_of_one_users_many_uids_are_logged_once(tmp_path: Path) -> None:
    """A user with 65,536 subordinate uids cycled through them: each was a caller of
    its own to the failure log, and each of her bad requests was logged afresh."""
    me = next(p for p in pwd.getpwall() if p.pw_uid != 0)
    path = tmp_path / "subuid"
    path.write_text(f"{me.pw_name}:200000:65536\n")
    tenants = Tenants(str(path))
    tenants.refresh()
    flog, lines = _failure_log("tenants", tenants)
    err = OSError(errno.EINVAL, "bad")
    for uid in range(200000, 200000 + 5000):
        flog.note("setxattr", _Caller(uid), err, trace=False)
    flog.note("setxattr", _Caller(me.pw_uid), err, trace=False)  # (her own uid too)
    assert len(lines.lines) == 6, lines.lines  # once, then every 1000th: the count
    assert "uid 200000 failed" in lines.lines[0]
    assert lines.lines[-1].endswith(f"5000 times so far (uid 204999 is user {me.pw_uid}'s)")
    flog.note("setxattr", _Caller(300000), err, trace=False)  # another caller: logged
    assert len(lines.lines) == 7 and "uid 300000 failed" in lines.lines[-1]


def test_a_full_failure_table_forgets_the_least_recently_seen(tmp_path: Path) -> None:
    """Past the table's size it was cleared whole: whoever filled it with kinds had
    every other caller's repeated failure logged again, each time."""
    flog, lines = _failure_log("table", Tenants(str(tmp_path / "none")))
    err = OSError(errno.EIO, "lost")
    flog.note("read", _Caller(1000), err, trace=False)  # (the victim's, seen often)
    for uid in range(2000, 2000 + failures.KEYS + 500):
        flog.note("read", _Caller(uid), err, trace=False)
        if uid % 100 == 0:
            flog.note("read", _Caller(1000), err, trace=False)  # (seen again: kept)
    assert len(flog.counts) == failures.KEYS
    logged = len(lines.lines)
    flog.note("read", _Caller(1000), err, trace=False)  # still counted: not logged
    flog.note("read", _Caller(2000 + failures.KEYS + 499), err, trace=False)
    assert len(lines.lines) == logged
    flog.note("read", _Caller(2000), err, trace=False)  # the oldest went: logged anew
    assert len(lines.lines) == logged + 1 and "uid 2000 failed" in lines.lines[-1]

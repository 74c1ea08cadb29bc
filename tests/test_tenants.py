"""Who a uid answers to (`vol/tenants.py`): a user's subordinate uids share her
per-user limits; everything else answers to itself."""

from __future__ import annotations

import pwd
import time
from pathlib import Path

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

"""A node holding members moves the chunk files of removed files its direct readers
(or writers) hold aside, into `chunks/held/` (`pool/revoke.Held`).  Only the writer
took over what a dead daemon left there (`Volume.recover` returned early on a node):
a node's daemon that died within the grace left its readers' files whole, outside
every quota, and its writers' immutable, for good."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import make_members, mkfs

from mxfs.pool.revoke import HELD_DIR
from mxfs.vol.volume import Volume


def _node_volume(member: str) -> Volume:
    vol = Volume.open(member)
    vol.pool.node = "b"  # (a reading node whose own members these are)
    return vol


def test_a_nodes_next_daemon_takes_over_what_its_members_held(tmp_path: Path) -> None:
    members = make_members(tmp_path, 2)
    mkfs(members)
    vol = _node_volume(members[0])
    read, written, still = (vol.pool.chunk_path(0, ino) for ino in (77, 78, 79))
    for path in (read, written, still):
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
    reader = os.open(read, os.O_RDONLY)
    writer = os.open(written, os.O_WRONLY)
    kept = os.open(still, os.O_RDONLY)
    try:
        assert vol.held.hold_read(77, 0, [0]) == 1  # (a reader's: kept whole, .r)
        assert vol.held.hold(78) == 1  # (a writer's: cut, immutable)
        assert vol.held.hold_read(79, 0, [0]) == 1
        folder = Path(members[0]) / "chunks" / HELD_DIR
        assert len(list(folder.iterdir())) == 3
        vol.store.close()  # (the daemon died within the grace)
        os.close(reader)
        os.close(writer)
        vol = _node_volume(members[0])  # (the next one)
        try:
            vol.recover()
            vol.held.sweep()  # (the daemon's task's first, within a second of the mount)
            held = list(folder.iterdir())  # (what nobody holds now is gone)
            assert [p.name.split(".")[0] for p in held] == ["79"], held
            assert set(vol.held.files) == {str(p) for p in held}  # (swept later)
        finally:
            vol.store.close()
    finally:
        os.close(kept)


def test_what_a_daemon_held_counts_as_its_owners_after_a_restart(tmp_path: Path) -> None:
    """Held files count as their owners' (`held_by`: `max_held_files_per_user`;
    `readable_by`: in her quota), and the next daemon adopted them as nobody's: every
    user's limits reset at a restart.  Their names say whose they are now; one held
    before names did counts as root's."""
    members = make_members(tmp_path, 2)
    mkfs(members)
    vol = Volume.open(members[0])
    read, written = (vol.pool.chunk_path(0, ino) for ino in (81, 82))
    for path in (read, written):
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
    reader = os.open(read, os.O_RDONLY)
    writer = os.open(written, os.O_WRONLY)
    try:
        assert vol.held.hold_read(81, 7002, [0]) == 1  # (a reader's: kept whole)
        assert vol.held.hold(82, 7002) == 1  # (a writer's: cut)
        (Path(members[0]) / "chunks" / HELD_DIR / f"83.{time.time_ns()}").touch()
        held_by, readable_by = dict(vol.held.held_by), dict(vol.held.readable_by)
        assert held_by == {7002: 1} and readable_by[7002] >= 1 << 20, readable_by
        vol.store.close()  # (the daemon died)
        vol = Volume.open(members[0])  # (the next one)
        try:
            vol.recover()
            assert dict(vol.held.held_by) == held_by | {0: 1}
            assert dict(vol.held.readable_by) == readable_by
        finally:
            vol.store.close()
    finally:
        os.close(reader)
        os.close(writer)

"""A reading node's memory held for its KV users, all of them together: copies lent
(`fs/kv_follow.py`) and chunks being put (`fs/kv_forward.py`) were each bounded by
`max_kv_lent_per_user` a user and by nothing in all, so N tenants on one node pinned
2 GiB each of it.  `max_kv_lent` bounds the two together."""

from __future__ import annotations

import base64
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from conftest import make_members, mkfs

from mxfs.fs.kv_ops import KVOps
from mxfs.fs.limits import Limits
from mxfs.fs.options import check_options
from mxfs.fs.session import Session
from mxfs.vol.access import Caller
from mxfs.vol.kv_index import KVIndex
from mxfs.vol.volume import Volume

ALICE, BOB, CAROL = 1000, 1001, 1002
MiB = 1 << 20


@pytest.fixture
def node_kv(tmp_path: Path) -> Iterator[KVOps]:
    """The KV tier of a reading node ("b"), within 3 MiB a user and 4 MiB in all."""
    members = make_members(tmp_path, 2)
    mkfs(members)
    vol = Volume.open(members[0])
    vol.pool.node = "b"
    check_options([f"max_kv_lent={4 * MiB}"])  # (a mount option, as the others)
    limits = Limits.from_options({"max_kv_lent_per_user": str(3 * MiB),
                                  "max_kv_lent": str(4 * MiB)})
    try:
        yield KVOps(vol, KVIndex(vol), limits)
    finally:
        vol.store.close()


def _session(uid: int) -> Session:
    return Session(Caller(1, uid, uid, frozenset({uid})))


def _create(kv: KVOps, session: Session, size: int) -> None:
    """A chunk of `size` bytes begun on the node (a memfd of its daemon's)."""
    assert kv.forward is not None
    key = base64.b64encode(os.urandom(8)).decode()
    _, fds = trio.run(kv.forward.create, {"op": "kv_create", "key": key, "size": size},
                      session)
    for fd in fds:
        os.close(fd)


def test_what_a_reading_node_holds_for_all_its_kv_users_is_bounded(node_kv: KVOps) -> None:
    follower, forward = node_kv.follower, node_kv.forward
    assert follower is not None and forward is not None
    alice, bob = _session(ALICE), _session(BOB)
    _create(node_kv, alice, 3 * MiB)  # (hers: within her 3 MiB)
    with pytest.raises(OSError) as e:  # bob's, within his own bound, past the node's
        _create(node_kv, bob, 2 * MiB)
    assert e.value.errno == errno.ENOMEM and "max_kv_lent" in str(e.value)
    # Copies lent count with the puts: past the node's bound a get copies nothing (a
    # miss, as past a user's own).
    assert not follower._may_lend(BOB, 2 * MiB, 1)
    assert follower._may_lend(BOB, MiB // 2, 1)
    forward.release(alice)  # (her connection closed: her chunk goes)
    _create(node_kv, bob, 2 * MiB)
    copy = os.memfd_create("copy")
    try:
        follower._lend(copy, CAROL, MiB)  # (a copy lent to carol)
    finally:
        os.close(copy)
    with pytest.raises(OSError) as e:
        _create(node_kv, bob, MiB)
    assert e.value.errno == errno.ENOMEM
    forward.release(bob)
    _create(node_kv, bob, MiB)
    forward.release(bob)
    for _, fd, _, _ in follower._lent:
        os.close(fd)


def test_a_put_buffer_that_goes_takes_its_memory_with_it(node_kv: KVOps) -> None:
    """A put's memfd was sealed against shrinking and its caller kept a descriptor of
    it: when its commit failed (sums that do not match) the node counted its bytes no
    more, yet they stayed allocated for as long as she held it, a user's 64 MiB a
    failed commit without bound.  The buffer is cut to nothing as it goes."""
    forward = node_kv.forward
    assert forward is not None
    alice = _session(ALICE)
    key = base64.b64encode(b"k").decode()
    made, fds = trio.run(forward.create, {"op": "kv_create", "key": key,
                                          "size": 2 * MiB}, alice)
    theirs = fds[0]
    try:
        os.pwrite(theirs, b"x" * (2 * MiB), 0)
        with pytest.raises(OSError) as e:
            trio.run(forward.commit, {"op": "kv_commit", "key": key, "ino": made["ino"],
                                      "size": 2 * MiB, "sum_unit": 1 << 30,
                                      "sums": base64.b64encode(bytes(8)).decode()}, alice)
        assert e.value.errno == errno.EINVAL
        assert forward.held.held == 0
        deadline = time.monotonic() + 10  # (freed by a thread of the daemon's)
        while (os.fstat(theirs).st_size or os.fstat(theirs).st_blocks) and \
                time.monotonic() < deadline:  # (the size goes first, then the pages)
            time.sleep(0.01)
        assert os.fstat(theirs).st_size == 0 and os.fstat(theirs).st_blocks == 0
    finally:
        os.close(theirs)

"""A reading node's KV requests sent on to the writer (`fs/kv_forward.py`): what a
closed connection leaves to give up there, and in what order, whatever one user does."""

from __future__ import annotations

import base64
import errno
import os
from typing import Any

import pytest
import trio

from mxfs.fs.kv_forward import GIVE_UP_PER_USER, MAX_KEYS, ForwardedKV, GiveUps
from mxfs.fs.limits import Limits
from mxfs.fs.session import Session
from mxfs.vol.access import Caller

pytestmark = pytest.mark.unit


def _session(uid: int) -> Session:
    return Session(Caller(1, uid, uid, frozenset({uid})))


def _give_up(tenant: int, n: int) -> Any:
    return (None, (tenant, tenant, []), b"%d" % n, 0, 0.0, tenant)


def test_one_users_closed_connections_leave_anothers_give_ups_their_turn() -> None:
    """In one line, a user who closed thousands of connections held every other
    user's give-ups behind hers, and past the queue's bound theirs were dropped (their
    pins held on the writer until the node's lease ran out)."""
    lines = GiveUps()
    for n in range(GIVE_UP_PER_USER):
        assert lines.put(_give_up(5, n))
    assert not lines.put(_give_up(5, -1))  # (past her share: hers run out by themselves)
    assert lines.put(_give_up(6, 0)) and lines.put(_give_up(6, 1))
    assert lines.put(_give_up(0, 0))  # (root: up to the total)
    taken = [lines.get()[-1] for _ in range(6)]
    assert taken == [5, 6, 0, 5, 6, 5]
    assert len(lines) == GIVE_UP_PER_USER - 3 and lines.count_of(5) == len(lines)


def test_a_claim_refused_before_it_is_sent_leaves_nothing_to_give_up() -> None:
    """A claim of too many keys was refused (E2BIG) after its connection had been given
    a name on the writer: each such connection closed queued a give-up, a round trip
    to the writer, for nothing it held there."""
    forward = ForwardedKV(None, Limits(), lambda: ("b", 1), lambda ns, key: None)
    alice = _session(1000)
    keys = [base64.b64encode(b"%d" % i).decode() for i in range(MAX_KEYS + 1)]
    for op in (forward.claim, forward.pin):
        with pytest.raises(OSError) as e:
            trio.run(op, {"op": "kv_claim", "namespace": "n", "keys": keys}, alice)
        assert e.value.errno == errno.E2BIG
    assert forward._holders == {}
    forward.release(alice)
    assert len(forward._given_up) == 0


def test_a_chunk_put_on_a_node_is_judged_by_its_callers_checksums() -> None:
    """A reading node sent a chunk's memfd to the writer without its caller's sums, and
    the writer summed what reached it: bytes changed, or never written, after the caller
    summed them were stored, vouched for, and a hit on every node.  Judged here first:
    refused (EINVAL); right, sent on (here to no writer: EIO)."""
    from mxfs.io.checksum import block_sums, pack_sums

    forward = ForwardedKV(None, Limits(), lambda: ("b", 1), lambda ns, key: None)
    alice = _session(1000)
    key = base64.b64encode(b"k").decode()
    for data, code in ((b"Y" * 5000, errno.EINVAL), (b"X" * 5000, errno.EIO)):
        made, fds = trio.run(forward.create, {"op": "kv_create", "key": key,
                                              "size": 5000}, alice)
        os.pwrite(fds[0], data, 0)
        os.close(fds[0])
        unit = 1 << 30
        sums = base64.b64encode(pack_sums(block_sums(b"X" * 5000, unit))).decode()
        with pytest.raises(OSError) as e:
            trio.run(forward.commit, {"op": "kv_commit", "namespace": "n", "key": key,
                                      "ino": made["ino"], "size": 5000, "sum_unit": unit,
                                      "sums": sums}, alice)
        assert e.value.errno == code, data[:1]

"""A reading node's KV requests sent on to the writer (`fs/kv_forward.py`): what a
closed connection leaves to give up there, and in what order, whatever one user does."""

from __future__ import annotations

import base64
import errno
import os
from typing import Any

import pytest
import trio
from conftest import eventually

from mxfs.fs.kv_forward import GIVE_UP_PER_USER, MAX_KEYS, ForwardedKV, GiveUps
from mxfs.fs.limits import Limits
from mxfs.fs.session import Session
from mxfs.vol.access import Caller

pytestmark = pytest.mark.unit


def _session(uid: int) -> Session:
    return Session(Caller(1, uid, uid, frozenset({uid})))


def _give_up(tenant: int, n: int) -> Any:
    return (None, (tenant, tenant, []), b"%d" % n, 0, 0.0, 1, tenant)


def test_one_users_closed_connections_leave_anothers_give_ups_their_turn() -> None:
    """In one line, a user who closed thousands of connections held every other
    user's give-ups behind hers; past the queue's bound theirs were dropped (their
    pins held on the writer until the node's lease ran out).  A holder is counted from
    its first claim or pin, so a give-up always has its place: a user at her bound is
    refused new holders instead."""
    lines = GiveUps()
    for n in range(GIVE_UP_PER_USER):
        lines.reserve(5)
        if n % 2:
            lines.put(_give_up(5, n))  # (half closed, half still open)
    with pytest.raises(OSError) as e:
        lines.reserve(5)
    assert e.value.errno == errno.EAGAIN
    lines.reserve(6), lines.reserve(6), lines.reserve(0)  # (root: up to the total)
    lines.put(_give_up(6, 0)), lines.put(_give_up(6, 1)), lines.put(_give_up(0, 0))
    taken = [lines.get()[-1] for _ in range(6)]
    assert taken == [5, 6, 0, 5, 6, 5]
    lines.reserve(5)  # (three of hers given up: room for three more)
    for n in range(GIVE_UP_PER_USER // 2 + 1):  # (every open one of hers closes)
        lines.put(_give_up(5, -n))
    assert lines.count_of(5) == len(lines) == GIVE_UP_PER_USER - 2


def _kv_claim(forward: ForwardedKV, session: Session) -> None:
    key = base64.b64encode(b"k" * 16).decode()
    with pytest.raises(OSError) as e:  # (no writer here: EIO, after its holder is named)
        trio.run(forward.claim, {"op": "kv_claim", "namespace": "n", "keys": [key]},
                 session)
    assert e.value.errno in (errno.EIO, errno.EAGAIN)
    if e.value.errno == errno.EAGAIN:
        raise e.value


def test_a_give_up_the_writer_does_not_answer_is_tried_until_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed connection's give-up was tried five times and then dropped: with the
    writer unreachable a few seconds (a restart), its pins held the writer's chunks
    until this node's lease ran out.  Now tried again, less often, until the writer
    answers, and dropped only once this node's epoch has ended (and its pins with it)."""
    from mxfs.fs import kv_forward
    from mxfs.pool.remote import RemoteMembers

    monkeypatch.setattr(kv_forward, "GIVE_UP_RETRY_S", 0.001)
    monkeypatch.setattr(kv_forward, "GIVE_UP_RETRY_MAX_S", 0.005)
    epoch = [1]
    tried = []
    writer = RemoteMembers(b"k" * 32, "pool", lambda: None)  # (no writer: EIO at once)
    asked = writer.kv_keys

    def kv_keys(*args: Any) -> bytes:
        tried.append(epoch[0])
        return asked(*args)
    monkeypatch.setattr(writer, "kv_keys", kv_keys)
    forward = ForwardedKV(writer, Limits(), lambda: ("b", epoch[0]), lambda ns, key: None)
    alice = _session(1000)
    _kv_claim(forward, alice)
    forward.release(alice)
    assert eventually(lambda: len(tried) >= 20, 10)  # (five tries and more)
    assert forward._given_up.count_of(1000) == 1  # (still to be given up)
    epoch[0] = 2
    assert eventually(lambda: forward._given_up.count_of(1000) == 0, 10)
    assert tried[-1] == 1  # (never asked in the new epoch)


def test_a_user_at_her_bound_of_holders_is_refused_new_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that claimed or pinned, open or closed and not yet given up, count
    against their user's bound: past it her next connection's first claim is refused
    (EAGAIN), another user's is not."""
    from mxfs.fs import kv_forward

    monkeypatch.setattr(kv_forward, "GIVE_UP_PER_USER", 3)
    forward = ForwardedKV(None, Limits(), lambda: ("b", 1), lambda ns, key: None)
    hers = [_session(1000) for _ in range(4)]
    for s in hers[:3]:
        _kv_claim(forward, s)
    with pytest.raises(OSError) as e:
        _kv_claim(forward, hers[3])
    assert e.value.errno == errno.EAGAIN
    _kv_claim(forward, _session(1001))
    forward.release(hers[0])  # (no writer: nothing to give up, her place back at once)
    _kv_claim(forward, hers[3])


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


def test_an_owner_looked_up_while_the_metadata_server_is_away_is_eio() -> None:
    """A reading node whose connection to the writer was gone looked the writer up again
    in the store; with the server away that raised the store's Unusable, not an
    OSError: a read met it as a bug, and the task telling the writer the node's open
    files ended the daemon with it.  It is EIO naming the lookup."""
    from mxfs.meta.engine import Unusable
    from mxfs.pool.remote import RemoteMembers

    def away() -> None:
        raise Unusable("the metadata server postgresql:///x cannot be reached")
    writer = RemoteMembers(b"k" * 32, "pool", away)  # type: ignore[arg-type]
    with pytest.raises(OSError) as e:
        writer.kv_keys(b"KCLM", (1, 1, []), "n", 0, [], 0, b"h" * 16)
    assert e.value.errno == errno.EIO and "cannot be looked up" in str(e.value)


def test_a_give_up_that_meets_anything_but_an_oserror_is_tried_again() -> None:
    """The writer's lookup in the store met a Conflict (a DBA's lock held past the
    store's wait), not an OSError: the one thread that gives up closed connections'
    claims and pins ended, and every give-up after it stayed queued for good (new
    holders refused once a user's were counted).  It is tried again as a failure."""
    from mxfs.meta.engine import Conflict
    from mxfs.pool.remote import RemoteMembers

    asked: list[int] = []

    def locked() -> None:
        asked.append(1)
        raise Conflict("canceling statement due to lock timeout")
    writer = RemoteMembers(b"k" * 32, "pool", locked)  # type: ignore[arg-type]
    forward = ForwardedKV(writer, Limits(), lambda: ("b", 1), lambda ns, key: None)
    alice = _session(1000)
    _kv_claim(forward, alice)
    forward.release(alice)
    assert eventually(lambda: len(asked) >= 2, 10)  # (the claim's, then the give-up's)
    assert forward._giver is not None and forward._giver.is_alive()
    assert forward._given_up.count_of(1000) == 1  # (queued again, to be tried later)

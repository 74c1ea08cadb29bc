"""The writer's grants of files to nodes writing through their mounts, and the shares
of owners' quotas reserved for them (mxfs.fs.node_writes), on a real pool's store: a
user's opens through one node are bounded without taking another's grant, a file
opened again keeps its grant and its share, and every answer names the share, so a
node never reads "no limit" into an answer that let a grant go."""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import make_members, mkfs

from mxfs.fs import node_files, node_writes
from mxfs.fs.limits import Limits
from mxfs.fs.mount_writes import MountWrites, Written
from mxfs.fs.node_files import NodeFiles
from mxfs.fs.node_writes import SHARE_MIN, Grants, Rooms
from mxfs.vol.access import Caller
from mxfs.vol.quota import Quota
from mxfs.vol.volume import Volume

ALICE, BOB = 1000, 1001


@pytest.fixture
def vol(tmp_path: Path) -> Iterator[Volume]:
    members = make_members(tmp_path, 2)
    mkfs(members)
    v = Volume.open(members[0])
    v.quotas.set(str(ALICE), Quota(bytes=100 << 20))
    try:
        yield v
    finally:
        v.store.close()


def test_a_file_granted_again_keeps_its_grant_and_share(vol: Volume) -> None:
    rooms = Rooms(vol)
    grants = Grants(rooms)
    share = ("b", 1, ALICE)
    grants.grant("b", 1, 5, ALICE, ALICE)
    said = rooms.top_up(share)
    assert said["room"] == SHARE_MIN and vol.quotas.reserved[ALICE] == SHARE_MIN
    grants.grant("b", 1, 5, ALICE, BOB)  # (opened again there, by another user)
    assert vol.quotas.reserved[ALICE] == SHARE_MIN  # (not given back and made anew)
    assert rooms.said(share) == said
    # Its let-go names the share: nothing left once the node holds none of her files,
    # at a version past every answer before it (a node keeps the newest it heard).
    assert grants.let_go("b", 5) == share
    after = rooms.said(share)
    assert after["room"] == 0 and after["room_v"] > said["room_v"]
    assert ALICE not in vol.quotas.reserved
    assert grants.let_go("b", 5) is None
    # A user without a byte limit: "room" is None, never a missing field.
    assert rooms.top_up(("b", 1, BOB))["room"] is None
    # A node that joined again is granted anew under its new epoch.
    grants.grant("b", 1, 6, ALICE, ALICE)
    rooms.top_up(share)
    grants.grant("b", 2, 6, ALICE, ALICE)
    assert ALICE not in vol.quotas.reserved
    with pytest.raises(OSError) as e:
        grants.check("b", 1, 6)
    assert e.value.errno == errno.ESTALE
    assert grants.check("b", 2, 6) == ("b", 2, ALICE)


def test_a_users_grants_are_bounded_and_never_take_anothers(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_writes, "GRANTS_PER_USER", 2)
    monkeypatch.setattr(node_writes, "GRANTS", 5)
    grants = Grants(Rooms(vol))
    grants.grant("b", 1, 20, BOB, BOB)  # (bob's, first)
    for ino in (1, 2):
        grants.room("b", 1, ino, ALICE)
        grants.grant("b", 1, ino, ALICE, ALICE)
    for ino in (3, None):  # (a third file of hers, or one to be made: refused)
        with pytest.raises(OSError) as e:
            grants.room("b", 1, ino, ALICE)
        assert e.value.errno == errno.EMFILE
    grants.room("b", 1, 2, ALICE)  # (one she holds already takes no more)
    with pytest.raises(OSError) as e:  # (through another node too: her count is the
        grants.room("c", 1, 3, ALICE)  # pool's, or a user on 16 nodes held them all)
    assert e.value.errno == errno.EMFILE
    assert grants.check("b", 1, 20) == ("b", 1, BOB)  # (bob's grant stays)
    for ino in (30, 31):  # root: past a user's bound, not past the writer's
        grants.room("b", 1, ino, 0)
        grants.grant("b", 1, ino, 0, 0)
    with pytest.raises(OSError) as e:
        grants.room("b", 1, 32, 0)
    assert e.value.errno == errno.ENFILE
    grants.let_go("b", 1)
    grants.room("b", 1, 3, ALICE)
    assert grants.check("b", 1, 20) == ("b", 1, BOB)


def test_a_grant_two_whole_words_leave_out_goes(vol: Volume) -> None:
    """A grant whose open failed on the node after the writer gave it (or whose answer
    was lost) was never let go: one that two whole words in a row leave out goes, with
    its share; one named again, or of another epoch, stays."""
    rooms = Rooms(vol)
    grants = Grants(rooms)
    for ino in (1, 2, 3):
        grants.grant("b", 1, ino, ALICE, ALICE)
    rooms.top_up(("b", 1, ALICE))
    grants.grant("c", 1, 4, ALICE, ALICE)
    grants.named("b", 1, {1})
    grants.named("b", 1, {1, 2})  # (2 named again: its first strike forgotten)
    assert grants.check("b", 1, 1) and grants.check("b", 1, 2)
    with pytest.raises(OSError):
        grants.check("b", 1, 3)
    grants.named("b", 1, {1})
    grants.check("b", 1, 2)  # (one strike since it was named)
    grants.named("b", 1, set())
    with pytest.raises(OSError):
        grants.check("b", 1, 2)
    assert grants.check("b", 1, 1) and ALICE in vol.quotas.reserved
    grants.named("b", 1, set())
    with pytest.raises(OSError):
        grants.check("b", 1, 1)
    assert ALICE not in vol.quotas.reserved  # (b's last grant of hers: its share back)
    assert grants.check("c", 1, 4) == ("c", 1, ALICE)  # (another node's word)


def test_grants_of_a_node_that_joined_again_go_however_its_holds_went(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """b restarted (a new epoch) and its first word dropped its old holds before the
    writer's sweep ran: its old grants (bob's: no byte limit, so no share) still go
    at the sweep, and bob may open a file for writing through b again.  The sweep
    looked for the dead epoch in the holds and the shares alone: his grants stayed,
    each in his count, until the writer restarted (EMFILE past 4,096)."""
    monkeypatch.setattr(node_writes, "GRANTS_PER_USER", 1)
    tier = NodeFiles(vol, "/mnt", Limits(), Counter(), lambda *a: None)  # type: ignore
    vol.reader_epochs = {"b": 1}
    tier.grants.grant("b", 1, 5, BOB, BOB)
    vol.reader_epochs = {"b": 2}  # (b joined again; its holds under epoch 1 gone)
    tier.sweep(1.0)
    with pytest.raises(OSError) as e:
        tier.grants.check("b", 1, 5)
    assert e.value.errno == errno.ESTALE
    tier.grants.room("b", 2, 6, BOB)  # (his one grant is free again)
    assert tier.grants.nodes() == set()


def test_a_file_chowned_since_its_grant_grows_within_its_new_owners_quota(
        vol: Volume) -> None:
    """alice's file, granted to b with a share of her quota, is chowned to bob by root;
    b's close tells 8 MiB: judged against bob's 1 MiB, not taken out of her share (the
    old code: accepted, bob over his quota by what her share held)."""
    vol.quotas.set(str(BOB), Quota(bytes=1 << 20))
    for m in vol.pool.members:
        m.node = "b"
    rooms = Rooms(vol)
    row = vol.store.create(1, b"f", 0o100644, ALICE, ALICE, layout_for=vol.pick_layout)
    vol.store.commit()
    share = ("b", 1, ALICE)
    Grants(rooms).grant("b", 1, row.ino, ALICE, ALICE)
    assert rooms.top_up(share)["room"] == SHARE_MIN
    vol.store.set_attrs(row, uid=BOB)
    vol.store.commit()
    alice = Caller(0, ALICE, ALICE, frozenset([ALICE]))
    with pytest.raises(OSError) as e:
        node_writes.mount_written(vol, rooms, share, alice,
                                  {"ino": row.ino, "size": 8 << 20}, "b")
    assert e.value.errno == errno.EDQUOT
    assert vol.store.get(row.ino).size == 0 and rooms.said(share)["room"] == SHARE_MIN
    node_writes.mount_written(vol, rooms, share, alice,
                              {"ino": row.ino, "size": 512 << 10}, "b")  # (within his)
    assert vol.store.get(row.ino).size == 512 << 10


def test_one_users_flood_pushes_out_only_its_own_remembered_answers(
        vol: Volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer remembers its answers to nodes' changes, to answer a repeat (a node
    asks again on a new connection) instead of doing it twice: a user's flood through
    one node pushes out that user's answers only (4,096 were shared by all)."""
    monkeypatch.setattr(node_files, "NAMES_REMEMBERED_PER_USER", 4)
    monkeypatch.setattr(node_files, "NAMES_REMEMBERED", 10)
    files = NodeFiles(vol, "/mnt", Limits(), Counter(), lambda *a: None)  # type: ignore
    done = files.names_done
    done.keep(("b", "bob"), ("b", BOB), {"ok": "bob's"})
    done.keep(("c", "bob"), ("c", BOB), {"ok": "on c"})
    for i in range(100):
        done.keep(("b", f"a{i}"), ("b", ALICE), {})
    assert done.get(("b", "bob")) == {"ok": "bob's"}
    assert done.get(("c", "bob")) == {"ok": "on c"}
    assert [t for t in done._answers if t[1].startswith("a")] == \
        [("b", f"a{i}") for i in range(96, 100)]
    # The whole table's oldest go from their users' queues too (they stayed: memory
    # grew with every user and node, past the table's bound).
    for uid in range(1000, 1040):
        done.keep(("d", f"u{uid}"), ("d", uid), {})
    assert len(done) == 10
    assert sum(len(q) for q in done._by_owner.values()) == 10 and len(done._by_owner) <= 10
    # Commits' answers likewise: one user's burst of commits through a node pushed out
    # everyone's (a node that asked again got EBADF for a file that was named).
    monkeypatch.setattr(node_files, "REMEMBERED_PER_USER", 4)
    monkeypatch.setattr(node_files, "REMEMBERED", 10)
    files = NodeFiles(vol, "/mnt", Limits(), Counter(), lambda *a: None)  # type: ignore
    files._remember("b", 1, BOB, {"ino": 1})  # type: ignore[typeddict-item]
    for ino in range(2, 200):
        files._remember("b", ino, ALICE, {"ino": ino})  # type: ignore[typeddict-item]
    assert files.published.get(("b", 1)) == {"ino": 1}
    assert len(files.published) == 5



def test_one_users_slow_ask_for_an_owners_room_never_holds_anothers(vol: Volume) -> None:
    """On a reading node, bob writes alice's group-writable file and his ask for a
    larger share of her quota waits in his own (flooded) turn at the writer; alice's
    write to her own file needs a larger share too.  One ask at a time an owner: hers
    waited for his.  Now hers is asked at once, and the node's share is still what the
    writer reserved for it once both are answered."""
    rooms = Rooms(vol)
    share = ("b", 1, ALICE)
    bobs_turn = trio.Event()

    class Writer:  # the writer's answers, from its real shares; bob's in his slow turn
        async def ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
            assert op == "node_room"
            if caller.uid == BOB:
                await bobs_turn.wait()
            return rooms.top_up(share, int(body["need"]), grow=True)

    async def unused(*_: Any) -> Any:
        raise AssertionError("not asked for")

    node = MountWrites(vol, Writer(), unused, unused)  # type: ignore[arg-type]
    node.room[ALICE] = 0  # (her share here: spent)
    bob, alice = (Caller(1, u, u, frozenset({u})) for u in (BOB, ALICE))
    node.files[5] = Written(bob, ALICE, 0, 0, 0, {})  # type: ignore[typeddict-item]
    node.files[6] = Written(alice, ALICE, 0, 0, 0, {})  # type: ignore[typeddict-item]
    alices: list[bool] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.allow, 5, 1 << 20)
            await trio.testing.wait_all_tasks_blocked()
            try:
                with trio.move_on_after(10):  # (a bound, not a timing)
                    await node.allow(6, 1 << 20)
                    alices.append(True)
            finally:
                bobs_turn.set()

    trio.run(main)
    assert alices == [True], "alice's ask waited for bob's"
    assert node.files[5].writing == node.files[6].writing == 1  # (both writes allowed)
    assert node.room[ALICE] == rooms.said(share)["room"] == vol.quotas.reserved[ALICE]
    assert not node._asking  # (no lock kept once no one asks)


def test_writes_in_flight_hold_the_share_by_file_not_by_write(vol: Volume) -> None:
    """On a reading node, alice has a 10 MiB share of her quota.  Five 1 MiB writes of
    one file in flight at once (the writeback cache sends them so) hold 5 MiB of it,
    the furthest end in flight, and a sixth write to another file takes what is left;
    one more past the share is EDQUOT.  Held a write each from the file's size, five
    writes held 1+2+3+4+5 MiB and the fifth was refused with 5 MiB written."""
    rooms = Rooms(vol)
    share = ("b", 1, ALICE)
    vol.quotas.set(str(ALICE), Quota(bytes=10 << 20))

    class Writer:  # the writer's answers, from its real shares
        async def ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
            assert op == "node_room"
            return rooms.top_up(share, int(body["need"]), grow=True)

    async def unused(*_: Any) -> Any:
        raise AssertionError("not asked for")

    node = MountWrites(vol, Writer(), unused, unused)  # type: ignore[arg-type]
    node.room[ALICE] = 0
    alice = Caller(1, ALICE, ALICE, frozenset({ALICE}))
    node.files[5] = Written(alice, ALICE, 0, 0, 0, {})  # type: ignore[typeddict-item]
    node.files[6] = Written(alice, ALICE, 0, 0, 0, {})  # type: ignore[typeddict-item]
    mib = 1 << 20
    refused: list[int] = []

    async def main() -> None:
        for k in range(1, 6):  # (allowed, none done yet: all five in flight)
            await node.allow(5, k * mib)
        await node.allow(6, 4 * mib)
        try:
            await node.allow(6, 6 * mib)
        except OSError as e:
            refused.append(e.errno or 0)

    trio.run(main)
    assert refused == [errno.EDQUOT]
    for k in range(1, 6):
        node.wrote(5, k * mib, k * mib)
    node.wrote(6, 4 * mib, 4 * mib)
    assert (node.files[5].size, node.files[6].size) == (5 * mib, 4 * mib)
    assert not node._in_flight  # (nothing held once every write is done)


def test_a_writes_asks_go_as_its_writer_not_as_the_files_last_opener(vol: Volume) -> None:
    """On a reading node bob writes his file, which alice opened there last (it is
    group-writable); his write needs a larger share of his quota, asked of the writer
    as bob, in his own turn there.  Asked as the file's last opener, his writes waited
    in alice's line, behind whatever flood of asks she kept in it."""
    rooms = Rooms(vol)
    vol.quotas.set(str(BOB), Quota(bytes=100 << 20))
    share = ("b", 1, BOB)
    asked: list[int] = []

    class Writer:  # the writer's answers, from its real shares
        async def ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
            assert op == "node_room"
            asked.append(caller.uid)
            return rooms.top_up(share, int(body["need"]), grow=True)

    async def unused(*_: Any) -> Any:
        raise AssertionError("not asked for")

    node = MountWrites(vol, Writer(), unused, unused)  # type: ignore[arg-type]
    node.room[BOB] = 0
    alice, bob = (Caller(1, u, u, frozenset({u})) for u in (ALICE, BOB))
    node.files[5] = Written(alice, BOB, 0, 0, 0, {})  # type: ignore[typeddict-item]
    trio.run(node.allow, 5, 1 << 20, bob)
    assert asked == [BOB]
    node.wrote(5, 1 << 20, 1 << 20)

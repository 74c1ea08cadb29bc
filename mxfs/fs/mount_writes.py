"""Files written through a reading node's mount, on that node's own members.

A node that holds members writes its files where it runs, through its mount as
through a direct writer (`fs/node_files.py`).  Each step is judged by the writer
before this node does it (`fs/node_writes.py`): a `create` is made there at once,
named and empty, on this node's members; an open for writing (or a truncate by name)
asks the writer whether this caller may write that file, wholly on this node's
members, and is granted it with this node's share of its owner's quota (`room`,
reserved for this node on the writer; writes past it ask for a larger share, and are
refused, EDQUOT, when none is left).  The writer gives the file a new generation at
that open, and again before the first write after a direct reader here was told it.
Writes then land on this node's chunk files; the file's size and mtime are held here
(`Written`, shown by this node's getattrs) until a close (or fsync) tells the writer
(`node_written`: close-to-open, as NFS gives it; a size told only grows the file).  A
cut is told before it is made (the writer's size never stands over bytes this node
no longer holds), and writes wait while one runs; a cut on the writer (its TRUN of
this node's chunk files) sets the size held here to the writer's (`cut_elsewhere`).
A close the writer refuses (a quota) fails; a last close left untold is told again
each second (`run`, each user's apart) until the writer takes it, or refuses it, and
then the writer cuts this node's chunk files of it back to the size it holds
(`NodeFiles._cut_back`, in its own write order: that size may be one its mount holds,
not yet committed): bytes the writer never took are never read.  Files striped over
other nodes' members are the writer's (EROFS here).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from mxfs.fs.failures import FailureLog
from mxfs.fs.fields import b64
from mxfs.fs.node_files import ForwardedFiles
from mxfs.fs.node_writes import REFUSED
from mxfs.meta import Inode
from mxfs.meta.usage import growth
from mxfs.proto.messages import LayoutDesc
from mxfs.vol.access import Caller
from mxfs.vol.tenants import tenant_of
from mxfs.vol.volume import Volume

log = logging.getLogger("mxfs.fs")

CUT_AGAIN_S = 0.05  # a tell the writer asked again for (EAGAIN: a cut ran) waits this,
CUT_AGAIN = 20  # ... this many times at most (another user cutting the file in a loop
                # holds a close here a second at most, then it is told as it stands)


@dataclass
class Written:
    """A file open for writing on this node: what the writer has not been told yet."""

    caller: Caller  # who last opened it for writing here (its last close's, if untold)
    owner: int  # the file's owner: its growth is taken from that uid's quota
    size: int
    base: int  # the size the writer last took: growth past it is this node's, untold
    mtime_ns: int
    layout: LayoutDesc  # (as written here: told, so a layout changed meanwhile shows)
    changed: bool = False  # written or touched since the writer was last told
    telling: trio.Lock = field(default_factory=trio.Lock)  # one tell at a time
    cut: trio.Event | None = None  # set while a cut runs: writes wait for it
    writing: int = 0  # writes past `allow`, not yet landed or queued
    ends: list[int] = field(default_factory=list)  # ... the ends they were allowed to
    drained: trio.Event = field(default_factory=trio.Event)  # (writing went to 0)
    opening: int = 0  # opens granted, their handles not yet made
    renewing: trio.Event | None = None  # set while the writer gives it a new generation

    def reserving(self, end: int | None = None) -> int:
        """What its writes in flight (and one more up to `end`) may grow it by."""
        ends = self.ends if end is None else [*self.ends, end]
        return growth(self.size, max(ends)) if ends else 0


class MountWrites:
    """The files this node's mount has open for writing, by inode."""

    def __init__(self, vol: Volume, forwarded: ForwardedFiles,
                 read_row: Callable[[int], Awaitable[Inode]],
                 cut: Callable[[Inode, int, int], Awaitable[None]]) -> None:
        self.vol = vol
        self.forwarded = forwarded
        self.read_row = read_row  # the row as the store holds it now (a worker's read)
        # Told of each grant (the writer holds the file open for this node from then:
        # `fs/held_open.py` lets it go once nothing here has it open).
        self.granted: Callable[[int], None] = lambda ino: None
        self.cut = cut  # cut a file's chunk files here to a size (in a uid's turn)
        self.files: dict[int, Written] = {}
        # Last closes the writer was not told of (or whose grant is to be let go):
        # (the closer, what to tell), by inode.
        self.untold: dict[int, tuple[Caller, dict[str, Any], int]] = {}  # (and the owner)
        # Inodes whose first open here, retell or cut back is under way: another waits.
        self._busy: dict[int, trio.Event] = {}
        # By owner: this node's share of its quota as the writer last said, less what
        # was told since (absent: no byte limit), and the growth not yet told of its
        # files here.  A write past the first less the second asks the writer for a
        # larger share (one ask at a time an owner and asking user: `_ask_room`), and
        # fails, EDQUOT, if it is not given (the writes in flight counted: `_need`).
        self.room: dict[int, int] = {}
        self.grown: Counter[int] = Counter()
        # Files with writes allowed and not yet done, by owner: their growth to the
        # furthest end in flight is held (`_need`).  A write's check and the size it
        # sets are split by awaits, in which the owner's other writes passed the same
        # check, each up to the whole share (the second close then refused, its bytes
        # cut back).
        self._in_flight: dict[int, set[int]] = {}
        self._asking: dict[tuple[int, int], trio.Lock] = {}  # (owner, asker's tenant)
        self._room_v: dict[int, tuple[int, ...]] = {}  # (the writer's epoch, the version)
        self._retelling: set[int] = set()  # users whose untold closes are being told
        self._failures = FailureLog(log)

    async def _ask(self, caller: Caller, op: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.forwarded.ask(caller, op, {**body, "token": os.urandom(12).hex()})
        if op in ("node_open", "node_create"):  # (a grant holds the file open there)
            self.granted(int(reply["ino"]))
        return reply

    async def _granted_ask(self, caller: Caller, op: str, body: dict[str, Any],
                           owner: int) -> dict[str, Any]:
        """`op` of a granted file (`node_written`, `node_room`); where the writer holds
        no grant (it restarted, or let it go) the file is asked for again first, as
        `caller`, "again": its open here was judged, and as POSIX judges permission at
        open, a file made read-only since is still written (judged again, a writer's
        restart cut back the bytes of a close it had not been told).  The share of
        `owner`'s quota the answer names is kept."""
        try:
            reply = await self._ask(caller, op, body)
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
            self._room_from(owner, await self._ask(caller, "node_open",
                                                   {"ino": body["ino"], "again": True}))
            reply = await self._ask(caller, op, body)
        self._room_from(owner, reply)
        return reply

    async def create(self, caller: Caller, parent: int, name: bytes, mode: int,
                     exclusive: bool) -> Inode:
        """A file made at (`parent`, `name`) by the writer, on this node's members (or,
        where the name is already a file, that file opened for writing), granted to
        this node: its row.  Its handle is the caller's to make (`opened`)."""
        self.forwarded.check_writable()
        made = await self._ask(caller, "node_create", {
            "parent": parent, "name": b64(name), "mode": mode, "exclusive": exclusive})
        return await self._took(made, caller)

    async def open(self, node: Inode, caller: Caller) -> None:
        """An open for writing here, judged by the writer first; its handle is the
        caller's to make (`opened`)."""
        self.forwarded.check_writable()
        far = self.vol.pool.far(self.vol.layout(node).used_members())
        if far:
            raise OSError(errno.EROFS, f"this file stripes over node "
                          f"{self.vol.pool.members[far[0]].node}'s members: write it on "
                          "the writer node, or on the node that holds them")
        await self._took(await self._ask(caller, "node_open", {"ino": node.ino}), caller)

    async def _took(self, reply: dict[str, Any], caller: Caller) -> Inode:
        """Hold the granted file for writing here, at the size the writer holds: its
        last close here told first if it was not, else its chunk files cut to that
        size where this node is the first to open it (bytes past it were never taken,
        and an extension must read zeros there)."""
        ino, owner = int(reply["ino"]), int(reply["owner"])
        self._room_from(owner, reply)
        while (busy := self._busy.get(ino)) is not None:
            await busy.wait()
        held = self.files.get(ino)
        if held is not None:  # (open here already: this open joins it)
            held.caller = caller
            held.opening += 1
            try:
                return await self.read_row(ino)
            except BaseException:
                held.opening -= 1
                if ino not in self.vol.open_inodes:
                    self.closed(ino)
                raise
        done = self._busy[ino] = trio.Event()
        try:
            row = await self.read_row(ino)
            size = max(int(reply["size"]), row.size)
            untold = self.untold.pop(ino, None)
            told = False
            if untold is not None:
                closer, body, owner_then = untold
                # (told without "last": the grant this open was given holds it on)
                body = {k: v for k, v in body.items() if k != "last"}
                try:
                    told = "size" not in body or await self._retold(ino, closer, body,
                                                                   owner_then)
                except BaseException:
                    self.untold[ino] = untold  # (told again next round: not lost)
                    raise
                if told and "size" in body:
                    size = max(size, int(body["size"]))
            if not told:
                await self.cut(row, size, caller.uid)
            held = self.files[ino] = Written(caller, owner, size, size, time.time_ns(),
                                             self.vol.layout(row).describe())
            held.drained.set()
            held.opening += 1
            return row
        except BaseException:
            if ino not in self.files and ino not in self.untold:  # (its grant let go:
                self.untold[ino] = (caller, {"ino": ino, "last": True}, owner)  # `run`)
            raise
        finally:
            self._unbusy(ino, done)

    def _fits(self, held: Written, end: int) -> bool:
        left = self.room.get(held.owner)
        return left is None or self._need(held, end) <= left

    def _need(self, held: Written, end: int) -> int:
        """The owner's growth here with a write of `held` up to `end` in flight too:
        what was told of none, and what the writes in flight may add (each file's to
        the furthest end in flight: writes of one file overlap, not add up)."""
        flying = self._in_flight.get(held.owner, set())
        others = (self.files.get(ino) for ino in flying)
        return self.grown[held.owner] + held.reserving(end) + sum(
            w.reserving() for w in others if w is not None and w is not held)

    def _room_from(self, owner: int, reply: dict[str, Any]) -> None:
        """This node's share of `owner`'s quota as the writer answered it ("room": None
        where no byte limit holds), unless an answer of a later version came first.
        An answer that names no share (a grant let go) leaves it as it was."""
        if "room_v" not in reply:
            return
        version = tuple(reply["room_v"])
        if version < self._room_v.get(owner, version):
            return
        self._room_v[owner] = version
        if reply["room"] is None:
            self.room.pop(owner, None)
        else:
            self.room[owner] = int(reply["room"])

    def _unbusy(self, ino: int, done: trio.Event) -> None:
        if self._busy.get(ino) is done:
            del self._busy[ino]
        done.set()

    def opened(self, ino: int) -> None:
        """The handle of a granted open is made (or given up: then `closed` follows
        if no other holds the file)."""
        self.files[ino].opening -= 1

    def _account(self, held: Written, size: int | None = None, base: int | None = None
                 ) -> None:
        """Set a file's size or what the writer took, keeping its owner's untold growth."""
        before = growth(held.base, held.size)  # (charged a BLOCK at least: usage.py)
        if size is not None:
            held.size = size
        if base is not None:
            held.base = base
        self.grown[held.owner] += growth(held.base, held.size) - before
        if not self.grown[held.owner]:
            del self.grown[held.owner]

    def _took_growth(self, held: Written, told: int) -> None:
        """The writer took `told` bytes as the file's size: what grew is no longer
        untold (its answer said what is left of this node's share)."""
        self._account(held, base=told)

    async def uncut(self, ino: int) -> None:
        """Wait while a cut of the file runs (an append's offset is its size after)."""
        held = self.files[ino]
        while held.cut is not None:
            await held.cut.wait()

    async def allow(self, ino: int, end: int, caller: Caller | None = None) -> None:
        """Before `caller`'s write up to `end` (`wrote` after it, whatever came of it;
        its growth held from the check on): EDQUOT past what the owner's quota lets its
        files here grow to (this node's share of it, asked to grow first: `node_room`);
        waits while a cut of the file runs, and while the writer gives it a new
        generation (`_renew`).  What it asks of the writer is asked as `caller` (else
        the file's last opener here), in her turn: as the last opener, another user's
        flood of asks held every write of his file."""
        held = self.files[ino]
        caller = caller or held.caller
        asked = False
        while True:
            await self._renew(held, ino, caller)
            await self.uncut(ino)
            if self._fits(held, end):
                break
            if asked:
                raise OSError(errno.EDQUOT, f"inode {ino}: its owner's quota leaves no "
                              f"room for {end - held.size} more bytes (remove files, or "
                              "ask root to raise it)")
            await self._ask_room(held, ino, end, caller)
            asked = True  # (then a cut begun meanwhile is waited for again)
        held.ends.append(end)  # (held from the check on: no await between)
        self._in_flight.setdefault(held.owner, set()).add(ino)
        if not held.writing:
            held.drained = trio.Event()
        held.writing += 1

    async def _renew(self, held: Written, ino: int, caller: Caller) -> None:
        """Where a direct reader here was told the file's generation (`OpenInode.told`)
        since the writer last gave it one, the writer gives it another before this
        write lands (`node_room` with "renew"), so the reader sees its bytes changed:
        one ask per (told, then written), the file's other writes waiting for it."""
        while held.renewing is not None:
            await held.renewing.wait()
        entry = self.vol.open_inodes.get(ino)
        if entry is None or not entry.told:
            return
        held.renewing = done = trio.Event()
        entry.told = False
        try:
            reply = await self._granted_ask(caller, "node_room",
                                            {"ino": ino, "renew": True}, held.owner)
        except BaseException:
            entry.told = True  # (not renewed: the next write asks again)
            raise
        finally:
            held.renewing = None
            done.set()
        entry.node.generation = max(entry.node.generation, int(reply["generation"]))

    async def _ask_room(self, held: Written, ino: int, end: int, caller: Caller) -> None:
        """Ask the writer for a larger share of the file's owner's quota, as the user
        whose write needs it, one ask at a time an owner and that user: another user's
        ask for the same owner's files (slow in its own turn at the writer, or many)
        never holds this one.  Asks running at once only grow the share (`top_up`),
        each answer versioned: the newest heard is kept (`_room_from`)."""
        key = (held.owner, tenant_of(caller.uid))
        lock = self._asking.setdefault(key, trio.Lock())
        try:
            async with lock:
                if not self._fits(held, end):  # (another write's ask may have done)
                    need = self._need(held, end)
                    await self._granted_ask(caller, "node_room",
                                            {"ino": ino, "need": need}, held.owner)
        finally:
            if not lock.locked() and self._asking.get(key) is lock:
                del self._asking[key]  # (no one holds or waits for it: handed on if so)

    def wrote(self, ino: int, allowed: int, end: int | None) -> None:
        """A write `allow`ed up to `allowed` is done: landed or queued up to `end`, or
        failed (None)."""
        held = self.files[ino]
        held.ends.remove(allowed)
        if not held.ends:
            flying = self._in_flight[held.owner]
            flying.discard(ino)
            if not flying:
                del self._in_flight[held.owner]
        if end is not None:
            self._account(held, size=max(held.size, end))
            held.mtime_ns = time.time_ns()
            held.changed = True
        held.writing -= 1
        if not held.writing:
            held.drained.set()

    def touched(self, ino: int, mtime_ns: int) -> None:
        held = self.files[ino]
        held.mtime_ns = mtime_ns
        held.changed = True

    async def cut_to(self, ino: int, size: int, caller: Caller,
                     settle: Callable[[], Awaitable[None]]) -> None:
        """Cut the file to `size`: new writes wait, those under way land, the writer
        takes the size first (as `caller`: growing it is judged against the quota),
        then its chunk files here are cut."""
        held = self.files[ino]
        while held.cut is not None:
            await held.cut.wait()
        held.cut = cutting = trio.Event()
        try:
            await held.drained.wait()
            await settle()
            async with held.telling:
                now = time.time_ns()
                await self._granted_ask(caller, "node_written", {
                    "ino": ino, "size": size, "mtime_ns": now, "cut": True,
                    "layout": held.layout}, held.owner)
                await self.cut(await self.read_row(ino), size, caller.uid)
                self._took_growth(held, size)
                self._account(held, size=size)
                held.mtime_ns, held.changed = now, False
        finally:
            held.cut = None
            cutting.set()

    async def cut_elsewhere(self, ino: int) -> int | None:
        """The writer cut `ino` (a truncate there: its size committed first, then its
        chunk files here cut; this node's writes of it held meanwhile): what it holds
        of the file is the size the writer holds now (bytes this node wrote past it
        went with the cut).  The file's owner, or None where it is not open here."""
        if ino not in self.files:
            if ino in self.untold:
                self.cut_untold(ino, (await self.read_row(ino)).size)
            return None
        row = await self.read_row(ino)
        held = self.files.get(ino)
        if held is None:  # (closed meanwhile: its close told the writer)
            return None
        self._account(held, size=row.size, base=row.size)
        held.mtime_ns = max(held.mtime_ns, row.mtime_ns)
        return held.owner

    def cut_untold(self, ino: int, size: int) -> None:
        """A close left untold of a file the writer cut to `size`: it tells no more (its
        bytes past the cut went with it; told, the writer grew the file back)."""
        untold = self.untold.get(ino)
        if untold is not None and "size" in untold[1]:
            untold[1]["size"] = min(int(untold[1]["size"]), size)

    async def tell(self, ino: int, caller: Caller) -> None:
        """Tell the writer the file's size and mtime, if they changed since it was last
        told (as `caller`, whose close or fsync this is).  Its refusal (a quota) is the
        caller's close's error."""
        held = self.files[ino]
        async with held.telling:  # (a second close waits for the first's answer)
            if not held.changed:
                return

            def now() -> dict[str, Any]:
                held.changed = False  # (a write while the writer is asked: told next time)
                return self._said(ino, held)
            try:
                said = await self._told(caller, held.owner, now)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return  # (removed meanwhile, as a file unlinked while open: its
                held.changed = True  # bytes go with it)
                raise
            except BaseException:
                held.changed = True
                raise
            self._took_growth(held, int(said["size"]))

    async def _told(self, caller: Caller, owner: int, said: Callable[[], dict[str, Any]]
                    ) -> dict[str, Any]:
        """Ask the writer to take what `said()` says now (`node_written`); what it took.
        While a truncate of the file runs there it answers EAGAIN (it would have grown
        the file back to the size said): asked again, as said once the cut is followed
        here, CUT_AGAIN times at most; then told as it stands (another user cutting the
        file in a loop holds a close CUT_AGAIN_S * CUT_AGAIN at most)."""
        tries = 0
        while True:
            body = said() if tries < CUT_AGAIN else {**said(), "cutting": False}
            try:
                await self._granted_ask(caller, "node_written", body, owner)
                return body
            except OSError as e:
                if e.errno != errno.EAGAIN or tries >= CUT_AGAIN:
                    raise
            tries += 1
            await trio.sleep(CUT_AGAIN_S)

    @staticmethod
    def _said(ino: int, held: Written) -> dict[str, Any]:
        return {"ino": ino, "size": held.size, "mtime_ns": held.mtime_ns,
                "layout": held.layout}

    def closed(self, ino: int) -> None:
        """The last handle of `ino` here closed (or an open was given up): what it left
        untold, and the writer's grant to let go, are told from the next `retell`."""
        held = self.files.get(ino)
        if held is None or held.opening:
            return  # (an open of it is being made: it holds the file on)
        del self.files[ino]
        self._account(held, base=held.size)  # (its growth goes with the untold close)
        body: dict[str, Any] = {"ino": ino, "last": True}
        if held.changed:
            body.update(self._said(ino, held))
        self.untold[ino] = (held.caller, body, held.owner)

    async def run(self) -> None:
        """The daemon's task: each second, the untold last closes told (and the grants
        let go); one the writer refuses it cuts back here to the size it holds.  Each
        user's are told in their own task, in their own turn at the writer: one whose
        requests wait there holds up nobody else's."""
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(1)
                by_uid: dict[int, list[int]] = {}
                for ino, (caller, _, _) in self.untold.items():
                    by_uid.setdefault(caller.uid, []).append(ino)
                for uid, inos in by_uid.items():
                    if uid not in self._retelling:
                        self._retelling.add(uid)
                        nursery.start_soon(self._retell, uid, inos)

    async def _retell(self, uid: int, inos: list[int]) -> None:
        try:
            for ino in inos:
                try:
                    await self.retell(ino)
                except Exception as e:  # (anything unforeseen: logged, the rest go on)
                    self._failures.note("retell", None, e, trace=not isinstance(e, OSError))
        finally:
            self._retelling.discard(uid)

    async def retell(self, ino: int) -> None:
        """Tell one untold last close, as `run` does."""
        untold = self.untold.get(ino)
        if untold is None or ino in self._busy:
            return  # (opened here again meanwhile: that open tells it)
        caller, body, owner = untold
        done = self._busy[ino] = trio.Event()  # (an open here waits for this)
        try:
            await self._retold(ino, caller, body, owner)  # (refused: the writer cut
        except OSError as e:  # what it never took here, to the size it holds now)
            if e.errno not in REFUSED:
                return  # (again next round)
            # (the file is gone: the writer removes its chunk files)
        finally:
            self._unbusy(ino, done)
        if ino in self.untold and self.untold[ino][1] is body:
            del self.untold[ino]

    async def _retold(self, ino: int, caller: Caller, body: dict[str, Any], owner: int
                      ) -> bool:
        """Tell an untold close: True if the writer took it, False if it refused it
        (logged); anything else (not reached, a passing refusal) raises.  Its size is
        clamped meanwhile by a cut on the writer (`cut_untold`)."""
        try:
            await self._told(caller, owner, lambda: body)
            return True
        except OSError as e:
            if e.errno not in REFUSED:
                raise
            if "size" in body:
                log.warning("inode %d: the writer refused its size %d written here "
                            "(%s); its chunk files here are cut back to the writer's "
                            "size", ino, body["size"], e.strerror)
            return False

"""A reading node's kernel invalidations (`fs/invalidations.py`), with real threads and
stand-ins for the kernel's two calls: a directory whose call is held stalls only its
own, its thread set aside, a key's invalidations keep their order and never run two at
once, a request is told once what it changed is made, what waits is bounded at the cost
of the keys past it only, and the end of the mount waits for no held call.  (A real
directory held on a real reading node: `test_nodes.py`.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from conftest import eventually

from mxfs.fs import invalidations
from mxfs.fs.invalidations import Invalidations

pytestmark = pytest.mark.unit

HELD_DIR = 7


class Kernel:
    """The kernel's side: what each call was, and directory HELD_DIR's lock, held by a
    user's request until `gate` opens."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []
        self.gate = threading.Event()
        self.held = {HELD_DIR}  # directories whose lock is held
        self.running: set[int] = set()
        self.overlapped = False  # (two calls of one key at once)
        self._lock = threading.Lock()

    def entry(self, parent: int, name: bytes) -> None:
        self._enter(parent, ("entry", parent, name))
        try:
            if parent in self.held:
                self.gate.wait(60)
        finally:
            self.running.discard(parent)

    def inode(self, ino: int, attr_only: bool) -> None:
        self._enter(-ino, ("inode", ino, attr_only))
        self.running.discard(-ino)

    def _enter(self, key: int, call: tuple[str, int, object]) -> None:
        with self._lock:
            self.overlapped |= key in self.running
            self.running.add(key)
            self.calls.append(call)


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    k = Kernel()
    yield k
    k.gate.set()


def _calls(kernel: Kernel, stop: threading.Event,
           held: tuple[list[int], list[tuple[int, bytes]]] = ([], [])) -> Invalidations:
    return Invalidations(lambda: held, stop, kernel.entry, kernel.inode)


def test_a_held_directory_stalls_only_its_own(kernel: Kernel) -> None:
    """While HELD_DIR's lock is held, other directories' names and inodes are
    invalidated as they come; what comes for HELD_DIR meanwhile waits, once each, and
    is made after the held call, in order."""
    stop = threading.Event()
    calls = _calls(kernel, stop)
    calls.add([(HELD_DIR, b"a")], [], [])
    assert eventually(lambda: ("entry", HELD_DIR, b"a") in kernel.calls)
    calls.add([(HELD_DIR, b"b"), (HELD_DIR, b"a"), (3, b"x")], [5], [6])
    calls.add([(HELD_DIR, b"b")], [], [])
    assert eventually(lambda: {("entry", 3, b"x"), ("inode", 5, False),
                               ("inode", 6, True)} <= set(kernel.calls))
    assert eventually(lambda: calls.pending == 3)  # (HELD_DIR: a held; b, a again)
    assert kernel.calls.count(("entry", HELD_DIR, b"a")) == 1
    kernel.gate.set()
    assert eventually(lambda: calls.pending == 0 and len(kernel.calls) == 6)
    held = [c for c in kernel.calls if c[1] == HELD_DIR]
    assert held[0] == ("entry", HELD_DIR, b"a")
    assert sorted(held[1:]) == [("entry", HELD_DIR, b"a"), ("entry", HELD_DIR, b"b")]
    assert not kernel.overlapped and calls.made == 6
    stop.set()
    calls.close(5)


def test_past_the_bound_the_largest_key_is_dropped_for_what_is_held_of_it(
        kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A held directory whose names keep changing: past MAX_WAITING waiting, its batch
    is dropped and, in its place, the names of it the kernel may hold are invalidated
    (not what it holds of other keys)."""
    monkeypatch.setattr(invalidations, "MAX_WAITING", 100)
    stop = threading.Event()
    calls = _calls(kernel, stop, ([11, 12], [(3, b"x"), (HELD_DIR, b"kept")]))
    calls.add([(HELD_DIR, b"first")], [], [])
    assert eventually(lambda: len(kernel.calls) == 1)
    for i in range(30):
        calls.add([(HELD_DIR, b"n%d" % (i * 10 + j)) for j in range(10)], [], [])
        assert calls.pending <= 1 + 100 + 10 + 1  # (the held call, changes', held()'s)
    assert calls.overflows == 2 and calls.dropped == 110 + 111  # (111: "kept" too)
    kernel.gate.set()
    assert eventually(lambda: calls.pending == 0 and ("entry", HELD_DIR, b"kept")
                      in kernel.calls)
    assert len(kernel.calls) < 120  # (not the 300 names that came)
    assert not {("entry", 3, b"x"), ("inode", 11, False)} & set(kernel.calls)
    stop.set()
    calls.close(5)


def test_an_overflow_costs_only_the_keys_that_cause_it(
        kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the writer (nothing in `held()`): a user holds her directory's lock and keeps
    committing into it past MAX_WAITING; another directory's invalidation waiting
    meanwhile (its own call held too) is not dropped with hers: it is made once let
    go, and its request told only then."""
    monkeypatch.setattr(invalidations, "MAX_WAITING", 100)
    other = 8
    kernel.held.add(other)
    stop = threading.Event()
    calls = _calls(kernel, stop)
    calls.add([(HELD_DIR, b"first"), (other, b"first")], [], [])
    assert eventually(lambda: len(kernel.calls) == 2)
    told: list[str] = []
    calls.add([(other, b"q")], [], [], lambda: told.append("q"))
    for i in range(30):
        calls.add([(HELD_DIR, b"n%d" % (i * 10 + j)) for j in range(10)], [], [])
    assert calls.overflows >= 1
    assert not eventually(lambda: bool(told), 0.5)
    kernel.gate.set()
    assert eventually(lambda: told == ["q"] and calls.pending == 0)
    assert ("entry", other, b"q") in kernel.calls
    stop.set()
    calls.close(5)


def test_the_mounts_end_waits_for_no_held_call(kernel: Kernel) -> None:
    """The mount ends while a call is held in the kernel: `close` returns, and nothing
    waiting is invalidated after (FUSE's session may be gone)."""
    stop = threading.Event()
    calls = _calls(kernel, stop)
    calls.add([(HELD_DIR, b"a")], [], [])
    assert eventually(lambda: len(kernel.calls) == 1)
    calls.add([(HELD_DIR, b"b"), (3, b"x")], [], [])
    assert eventually(lambda: len(kernel.calls) == 2)
    stop.set()
    calls.close(0.5)
    calls.add([(4, b"y")], [], [])
    kernel.gate.set()
    assert not eventually(lambda: len(kernel.calls) > 2, 1)


def test_threads_held_are_set_aside_for_the_other_keys(
        kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """More directories held at once than MAX_THREADS (as one user may hold, one
    listing each): their threads are set aside and other keys get threads of their
    own; past MAX_HELD set aside, the rest wait their turn, then are made."""
    monkeypatch.setattr(invalidations, "MAX_THREADS", 2)
    monkeypatch.setattr(invalidations, "MAX_HELD", 2)
    monkeypatch.setattr(invalidations, "HELD_S", 0.2)
    kernel.held |= {100, 101, 102}
    stop = threading.Event()
    calls = _calls(kernel, stop)
    for held in (100, 101, 102):
        calls.add([(held, b"a")], [], [])
    calls.add([(3, b"x")], [], [])
    assert eventually(lambda: {("entry", 3, b"x"), ("entry", 102, b"a")}
                      <= set(kernel.calls))
    calls.add([(HELD_DIR, b"a")], [], [])
    assert eventually(lambda: ("entry", HELD_DIR, b"a") in kernel.calls)
    calls.add([(5, b"y")], [], [])  # (4 held: MAX_THREADS + MAX_HELD)
    assert not eventually(lambda: ("entry", 5, b"y") in kernel.calls, 1)
    kernel.gate.set()
    assert eventually(lambda: calls.pending == 0 and ("entry", 5, b"y") in kernel.calls)
    assert len(kernel.calls) == 6 and not kernel.overlapped
    stop.set()
    calls.close(5)


def test_a_request_is_told_once_what_it_changed_is_made(
        kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """`done` is called once, when every key an `add` touched was made (a held
    directory's: once it is let go), at once for nothing, and when what waited is
    dropped past MAX_WAITING (the request then waits no longer)."""
    monkeypatch.setattr(invalidations, "MAX_WAITING", 20)
    stop = threading.Event()
    calls = _calls(kernel, stop)
    told: list[str] = []
    calls.add([(HELD_DIR, b"a"), (3, b"x"), (3, b"y")], [5], [], lambda: told.append("a"))
    calls.add([(3, b"z")], [], [6], lambda: told.append("other"))
    calls.add([], [], [], lambda: told.append("nothing"))
    assert eventually(lambda: sorted(told) == ["nothing", "other"])
    calls.add([(HELD_DIR, b"b")], [], [], lambda: told.append("b"))
    calls.add([(HELD_DIR, b"c")], [], [], lambda: told.append("c"))
    assert not eventually(lambda: len(told) > 2, 0.5)
    calls.add([(HELD_DIR, b"n%d" % i) for i in range(20)], [], [])  # (past the bound)
    assert eventually(lambda: sorted(told) == ["b", "c", "nothing", "other"])
    kernel.gate.set()
    assert eventually(lambda: sorted(told) == ["a", "b", "c", "nothing", "other"])
    assert eventually(lambda: calls.pending == 0)
    assert sorted(told) == ["a", "b", "c", "nothing", "other"]
    stop.set()
    calls.close(5)


def test_one_users_held_directories_leave_others_their_threads(
        kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice holds the locks of the directories she commits into, more than every
    thread there is (set aside or not): past her share (MAX_THREADS // USER_PART), her
    keys wait for her threads, and bob's are made at once, as root's.  (Before, her
    keys took every thread and every set-aside place, and bob's waited for good.)"""
    monkeypatch.setattr(invalidations, "MAX_THREADS", 4)
    monkeypatch.setattr(invalidations, "MAX_HELD", 2)
    monkeypatch.setattr(invalidations, "HELD_S", 0.1)
    alice, bob = 5001, 5002
    hers = list(range(100, 110))
    kernel.held |= set(hers)
    stop = threading.Event()
    calls = _calls(kernel, stop)
    for d in hers:
        calls.add([(d, b"a")], [], [], uid=alice)
    assert eventually(lambda: len(kernel.calls) == 2)  # (her share: 4 // 2)
    calls.add([(3, b"x")], [], [], uid=bob)
    calls.add([(4, b"y")], [], [], uid=0)
    assert eventually(lambda: {("entry", 3, b"x"), ("entry", 4, b"y")} <= set(kernel.calls))
    assert not eventually(lambda: len(kernel.calls) > 4, 0.5)  # (hers wait for hers)
    kernel.gate.set()
    assert eventually(lambda: calls.pending == 0 and len(kernel.calls) == 12)
    assert not kernel.overlapped
    stop.set()
    calls.close(5)


@pytest.mark.parametrize("whose", ["bob's", "the feed's"])
def test_directories_another_holds_leave_a_tenant_his_live_share(
        kernel: Kernel, monkeypatch: pytest.MonkeyPatch, whose: str) -> None:
    """Alice holds the locks of three of bob's directories, and bob commits into them
    (or a reading node's feed changes them): past HELD_S those threads are set aside,
    and bob's next key, in a directory nobody holds, is made at once, as is carol's.
    Held threads counted as live ones: bob's share (MAX_THREADS // USER_PART) went to
    the directories alice held, and every other invalidation of his waited; the feed,
    adding as root, was held to no share, and filled every thread and place set aside."""
    monkeypatch.setattr(invalidations, "MAX_THREADS", 4)
    monkeypatch.setattr(invalidations, "MAX_HELD", 8)
    monkeypatch.setattr(invalidations, "HELD_S", 0.1)
    bob, carol = 5002, 5003
    tenant = bob if whose == "bob's" else invalidations.FEED
    his = [100, 101, 102]
    kernel.held |= set(his)
    stop = threading.Event()
    calls = _calls(kernel, stop)
    for d in his:
        calls.add([(d, b"a")], [], [], uid=tenant)
    assert eventually(lambda: len(kernel.calls) == 3)  # (the third once two were held)
    calls.add([(3, b"x")], [], [], uid=tenant)
    assert eventually(lambda: ("entry", 3, b"x") in kernel.calls)
    if whose == "the feed's":  # (held to a share: past MAX_HELD // USER_PART held,
        for d in (104, 105, 106):  # its keys wait)
            kernel.held.add(d)
            calls.add([(d, b"a")], [], [], uid=tenant)
        assert eventually(lambda: len(kernel.calls) == 5)
        assert not eventually(lambda: len(kernel.calls) > 5, 0.5)
    calls.add([(4, b"y")], [], [], uid=carol)
    assert eventually(lambda: ("entry", 4, b"y") in kernel.calls)
    kernel.gate.set()
    assert eventually(lambda: calls.pending == 0)
    stop.set()
    calls.close(5)

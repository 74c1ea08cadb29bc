"""The KV spill tier: chunks shared by processes, bounded, persistent, never wrong."""

from __future__ import annotations

import base64
import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    CRASH,
    Mounted,
    check_pool,
    chunk_files,
    eventually,
    kill_daemon,
    make_members,
    mkfs,
    mount_with,
    mxfs,
    one_line_error,
    requests_served,
    steady_page_cache,
)

from mxfs.cli.measure import drop_caches
from mxfs.client import ControlClient
from mxfs.fs.kv_ops import MAX_LIST_SKIP
from mxfs.io import memory
from mxfs.io.residency import Residency
from mxfs.kv import KVStore
from mxfs.kv.kvstore import INLINE


def blob(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


@pytest.mark.parametrize("size", [1000, INLINE + 1, 3 << 20])  # inline, direct, multi-member
@pytest.mark.also_postgres
def test_put_get_round_trip_first_writer_wins(mounted: Mounted, size: int) -> None:
    with KVStore(str(mounted.path), "m") as kv:
        assert kv.put("a", blob(1, size)) is True
        assert kv.put("a", blob(2, size)) is False  # the first writer wins, cheaply
        assert kv.get("a") == blob(1, size)
        out = bytearray(size)
        assert kv.get("a", out=out) is True and bytes(out) == blob(1, size)
        assert kv.get("nope") is None
        t = torch.arange(size // 2, dtype=torch.int16)
        kv.put("t", t)
        back = torch.empty_like(t)
        assert kv.get("t", out=back) is True and torch.equal(back, t)
        u = kv.usage()
        assert u["chunks"] == 2  # (each chunk's bytes counted as a page at least)
        assert u["bytes"] == max(size, 4096) + max(t.numel() * 2, 4096)
        assert u["hits"] >= 3 and u["misses"] >= 1
        assert kv.delete("a") and not kv.exists("a") and kv.get("a") is None


@pytest.mark.also_postgres
def test_puts_sent_without_waiting_are_seen_in_order_and_refused_at_flush(
        mounted: Mounted) -> None:
    """`put_nowait` gathers small puts and sends them without waiting for the daemon:
    the store's own next request sees them (sent first, served in order), other stores
    once sent, and `flush` waits for all, counts those stored and raises a refusal."""
    with KVStore(str(mounted.path), "nw") as kv, KVStore(str(mounted.path), "nw") as other:
        kv.put_nowait("a", blob(1, 4096))
        assert other.get("a") is None  # (gathered: not sent yet)
        assert kv.get("a") == blob(1, 4096)  # (sent before the get, which sees it)
        for i in range(300):  # (several requests, more than the client keeps unanswered)
            kv.put_nowait(f"k{i}", blob(i, 1000 + i))
        kv.put_nowait("a", blob(2, 4096))  # (stored already: the first writer wins)
        kv.put_nowait("big", blob(7, INLINE + 1))  # (through descriptors, at once)
        assert kv.flush() == 302
        assert other.batch_get([f"k{i}" for i in range(300)]) == \
            [blob(i, 1000 + i) for i in range(300)]
        assert other.get("a") == blob(1, 4096) and other.get("big") == blob(7, INLINE + 1)
        assert kv.flush() == 0
    with KVStore(str(mounted.path), "nw-small", capacity=8192) as kv:
        kv.put_nowait("fits", blob(3, 4096))
        kv.flush()
        kv.put_nowait("too-big", blob(4, 10_000))  # (over the namespace's capacity)
        with pytest.raises(OSError) as err:
            kv.flush()
        assert err.value.errno == errno.EFBIG and "KV put" in str(err.value)
        assert kv.get("fits") == blob(3, 4096) and kv.get("too-big") is None
        assert kv.flush() == 0  # (a refusal is told once)


def test_puts_sent_without_waiting_outlive_an_idle_connection(members: list[str]) -> None:
    """Posted puts the daemon answered, then closed the connection as idle: the next
    put reads their answers first and sends itself on a new connection (it raised
    EPIPE, and flush told the answered ones lost)."""
    mkfs(members)
    with mount_with(members, "idle_timeout=2") as m, KVStore(str(m.path), "idle") as kv:
        for i in range(64):  # (one request, posted, its answer not read)
            kv.put_nowait(f"a{i}", b"x" * 100)
        time.sleep(4)
        for i in range(64):
            kv.put_nowait(f"b{i}", b"y" * 100)
        assert kv.flush() == 128
        assert all(kv.get(f"{k}{i}") is not None for k in "ab" for i in range(64))


@pytest.mark.smoke
def test_the_indexs_chunks_are_left_out_of_later_full_collections(members: list[str]
                                                                 ) -> None:
    """Python's full collection walked every chunk of the index on the daemon's one
    thread (200 ms a million), each time the objects grew by a quarter.  What lived
    through one is frozen: the chunks put are among the objects the next ones leave
    alone."""
    mkfs(members)
    with mount_with(members, "gc_freeze_s=1") as mounted, \
            KVStore(str(mounted.path), "frozen") as kv, ControlClient(str(mounted.path)) as c:
        before = c.call("stat")["gc"]
        assert before["frozen"] > 0 and before["freezes"] >= 1  # (what the mount loaded)
        n = 20480
        for i in range(0, n, 256):
            assert kv.batch_put([b"%032d" % j for j in range(i, i + 256)],
                                [b"x" * 100] * 256) == [True] * 256

        def frozen() -> bool:
            now = c.call("stat")["gc"]
            return now["freezes"] > before["freezes"] and \
                now["frozen"] - before["frozen"] >= n
        assert eventually(frozen, 20)


def test_batches_prefix_exists_and_odd_keys(mounted: Mounted) -> None:
    with KVStore(str(mounted.path), "b") as kv:
        keys = [f"chunk-{i}" for i in range(40)]
        assert kv.batch_put(keys, [blob(i, 70_000 * (i % 5 + 1)) for i in range(40)]) == \
            [True] * 40
        assert kv.batch_get(keys) == [blob(i, 70_000 * (i % 5 + 1)) for i in range(40)]
        kv.delete("chunk-7")
        assert kv.batch_exists(keys) == 7  # a prefix of 7 consecutive hits
        # keys are opaque: path characters create no files, huge keys are hashed
        odd = ["../../etc/passwd", "/", "a/b/../c", "\x00x", "k" * 100_000, b"\xff\xfe"]
        before = set(os.listdir(mounted.path))
        assert kv.batch_put(odd, [b"o%d" % i for i in range(len(odd))]) == [True] * len(odd)
        assert kv.batch_get(odd) == [b"o%d" % i for i in range(len(odd))]
        assert kv.get("k" * 99_999) is None  # the hash of a different key
        assert set(os.listdir(mounted.path)) == before
        for bad in ("", b""):
            with pytest.raises(ValueError, match="empty"):
                kv.put(bad, b"x")


def test_a_buffer_not_of_its_chunks_size_is_a_miss_the_rest_served(mounted: Mounted) -> None:
    sizes = {"inline": 1000, "direct": INLINE + 5000}
    with KVStore(str(mounted.path), "sz") as kv:
        for name, n in sizes.items():
            kv.put(name, blob(1, n))
            kv.put(name + "2", blob(2, n))
        for name, n in sizes.items():
            # a chunk shorter than its buffer would leave the buffer's tail stale: a miss
            longer, shorter, exact = bytearray(b"\xee" * (n + 10)), bytearray(n - 10), \
                bytearray(n)
            got = kv.batch_get([name, name + "2", "absent", name], [longer, shorter,
                                                                    bytearray(n), exact])
            assert got == [None, None, None, True], name
            assert bytes(exact) == blob(1, n) and longer == b"\xee" * (n + 10)
            assert kv.get(name, out=bytearray(n + 1)) is None  # one key alone, too
        assert kv.misses == {"smaller": 4, "larger": 2, "absent": 2}
        assert kv.exists_many(list(sizes)) == [True, True]  # kept: valid chunks
        # The daemon counts them as the caller saw them: 2 hits (the exact buffers),
        # 8 misses (the absent keys and the misfits).
        stats = kv.client.call("kv_stats", namespace="sz")["namespaces"][0]
        assert (stats["hits"], stats["misses"]) == (2, 8)


def cached_chunk_bytes(members: list[str]) -> int:
    """Bytes of the members' chunk files that sit in the page cache."""
    total = 0
    for m in members:
        for folder, _, names in os.walk(Path(m, "chunks")):
            for name in names:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    total += round(Residency(fd, 0, size).cached_fraction(0, size) * size)
                finally:
                    os.close(fd)
    return total


# What the kernel's reclaim may take of pages a test just read, before it looks: other
# workers' I/O keeps memory full of cache (one page of 5 MiB went in a CI run). Reads
# through the cache leave megabytes cached, reads around it 64 KiB at most.
RECLAIMED = 1 << 20


def test_cold_gets_go_around_the_page_cache(mounted: Mounted,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without memory to spare (or asked to), a cold chunk goes from the members to the
    caller's buffer with O_DIRECT, whether the buffer is page-aligned or not (then
    through the store's staging buffer): it is held once, in the engine, not a second
    time in the page cache.  With memory to spare (or asked to), through the cache."""
    sizes = [3 << 20, (2 << 20) + 1000]  # over several members; a tail short of a block
    monkeypatch.setattr(memory, "SPARE", 2.0)  # no node has twice its memory available
    monkeypatch.setattr(memory, "_seen", (0.0, False))
    with KVStore(str(mounted.path), "cold") as kv:
        assert kv.batch_put(["a", "b"], [blob(1, sizes[0]), blob(2, sizes[1])]) == [True] * 2
        for outs in ([bytearray(n) for n in sizes], [mmap.mmap(-1, n) for n in sizes]):
            drop_caches()
            assert kv.batch_get(["a", "b"], outs) == [True, True]
            assert bytes(outs[0]) == blob(1, sizes[0]) and bytes(outs[1]) == blob(2, sizes[1])
            # only the block under the short tail is read through the cache
            assert cached_chunk_bytes(mounted.members) <= 64 << 10, type(outs[0])
        assert kv.batch_get(["a", "b"], [bytearray(n) for n in sizes]) == [True, True]
    with KVStore(str(mounted.path), "cold", page_cache=True) as kv, steady_page_cache():
        outs = [bytearray(n) for n in sizes]  # asked for: cached
        assert kv.batch_get(["a", "b"], outs) == [True, True]
        assert bytes(outs[0]) == blob(1, sizes[0]) and bytes(outs[1]) == blob(2, sizes[1])
        assert cached_chunk_bytes(mounted.members) >= sum(sizes) - RECLAIMED
    monkeypatch.setattr(memory, "SPARE", 0.0)  # every node has memory to spare
    monkeypatch.setattr(memory, "_seen", (0.0, False))
    drop_caches()
    with KVStore(str(mounted.path), "cold") as kv, steady_page_cache():
        outs = [bytearray(n) for n in sizes]
        assert kv.batch_get(["a", "b"], outs) == [True, True]
        assert bytes(outs[0]) == blob(1, sizes[0]) and bytes(outs[1]) == blob(2, sizes[1])
        assert cached_chunk_bytes(mounted.members) >= sum(sizes) - RECLAIMED


@pytest.mark.unit
def test_memory_to_spare_is_a_quarter_of_the_node() -> None:
    assert memory.spare(25, 100) and memory.spare(90, 100)
    assert not memory.spare(24, 100) and not memory.spare(0, 0)
    available, total = memory.meminfo()
    assert 0 < available <= total


def test_a_batch_opened_at_once_comes_back_whole_and_leaks_nothing(
        members: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk files of a batch whose first chunk opened slowly (inodes not cached) are
    opened at once in the daemon's worker threads; here every batch is (the threshold
    set to 0): bytes, misses and deletions are as ever, and no descriptor stays open."""
    monkeypatch.setenv("MXFS_KV_COLD_OPEN_US", "0")
    mkfs(members, "1MiB")
    sizes = [(3 << 20) + 4096 * i for i in range(10)]  # each over several members
    with mount_with(members) as m, KVStore(str(m.path), "par") as kv:
        keys = [f"k{i}" for i in range(10)]
        assert kv.batch_put(keys, [blob(i, n) for i, n in enumerate(sizes)]) == [True] * 10
        pid = m.daemon_pid()
        before = len(os.listdir(f"/proc/{pid}/fd"))
        for _ in range(3):
            outs = [bytearray(n) for n in sizes]
            assert kv.batch_get(keys + ["absent"], outs + [bytearray(1)]) == [True] * 10 + [None]
            assert [bytes(o) for o in outs] == [blob(i, n) for i, n in enumerate(sizes)]
            assert kv.batch_get(keys[::-1]) == [blob(i, sizes[i]) for i in range(9, -1, -1)]
        assert all(kv.delete(k) for k in keys[:5])
        got = kv.batch_get(keys)
        assert got[:5] == [None] * 5 and got[5:] == [blob(i, sizes[i]) for i in range(5, 10)]
        assert eventually(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= before)


def test_threads_sharing_a_store_get_their_own_bytes(mounted: Mounted) -> None:
    """Engines' adapters call one store from several threads: cold gets into buffers
    that are not aligned (each thread's own staging) return every thread its chunks."""
    import threading

    n = (1 << 20) + 4096
    keys = [f"t{i}" for i in range(16)]
    with KVStore(str(mounted.path), "threads") as kv:
        assert kv.batch_put(keys, [blob(i, n) for i in range(16)]) == [True] * 16
        drop_caches()
        wrong: list[str] = []

        def reader(first: int) -> None:
            for _ in range(8):
                mine = [keys[(first + j) % 16] for j in range(4)]
                outs = [bytearray(n) for _ in mine]
                if kv.batch_get(mine, outs) != [True] * 4:
                    wrong.append(f"misses for {mine}")
                for k, out in zip(mine, outs, strict=True):
                    if bytes(out) != blob(int(k[1:]), n):
                        wrong.append(f"{k}: other bytes")

        threads = [threading.Thread(target=reader, args=(4 * t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == [] and kv.misses["checksum"] == 0
        assert kv.exists_many(keys) == [True] * 16


def test_a_batch_put_of_any_length_stays_within_the_daemons_pending_limit(
        tmp_path: Path) -> None:
    members = make_members(tmp_path)
    mkfs(members)
    keys = [f"p{i}" for i in range(11)]
    data = [blob(i, INLINE + 1 + i) for i in range(11)]  # direct puts: unpublished files
    with mount_with(members, "max_pending=4") as m, KVStore(str(m.path), "pend") as kv:
        assert kv.batch_put(keys, data) == [True] * 11
        assert kv.batch_get(keys) == data
        assert kv.put_group == 4  # the limit the daemon reports, not the default


FEW_FDS = r"""
import resource, sys
from mxfs.client import ControlClient
from mxfs.kv import KVStore
from mxfs.kv.kvstore import INLINE
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
kv = KVStore(sys.argv[1], "fds")
data = [bytes([i]) * (INLINE + 1) for i in range(40)]  # each on all 4 members
assert kv.batch_put([f"f{i}" for i in range(40)], data) == [True] * 40
assert kv.batch_get([f"f{i}" for i in range(40)]) == data
print(kv.put_group, kv.batch)
"""


@pytest.mark.parametrize("limit", [80, 40])
def test_batches_hold_no_more_descriptors_than_the_process_may(mounted: Mounted,
                                                               limit: int) -> None:
    res = subprocess.run([sys.executable, "-c", FEW_FDS, str(mounted.path), str(limit)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    # a quarter of the limit: a descriptor a member for a put, two for a get
    assert res.stdout.split() == [str(limit // 4 // 4), str(max(1, limit // 4 // 8))]


AT_LIMIT = r"""
import os, sys
from mxfs.client import ControlClient
from mxfs.kv import KVStore
from mxfs.kv.kvstore import INLINE
kv = KVStore(sys.argv[1], "lim")
keys = [f"k{i}" for i in range(kv.batch)]
assert kv.batch_put(keys, [bytes([i]) * (INLINE + 1) for i in range(len(keys))])
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
for fd in held[-4:]:
    os.close(fd)
try:
    kv.batch_get(keys)
except OSError as e:
    print(e.strerror)
for fd in held[:-4]:
    os.close(fd)
assert kv.batch_get(keys) == [bytes([i]) * (INLINE + 1) for i in range(len(keys))]
"""


def test_descriptors_lost_at_the_open_file_limit_are_a_clear_error(mounted: Mounted) -> None:
    """A reply whose descriptors did not fit is refused in one line, not misread; the
    store works again once files are closed."""
    res = subprocess.run([sys.executable, "-c", AT_LIMIT, str(mounted.path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "descriptors the daemon sent were lost" in res.stdout
    assert "ulimit -n" in res.stdout


def test_lookups_in_a_namespace_nobody_made_are_misses(mounted: Mounted) -> None:
    with KVStore(str(mounted.path), "never-made") as kv:
        assert kv.exists("k") is False and kv.exists_many(["k", "l"]) == [False, False]
        assert kv.batch_exists(["k", "l"]) == 0
        assert kv.get("k") is None and kv.batch_get(["k"], [bytearray(10)]) == [None]
        assert kv.pin(["k", "l"]) == [False, False]
        assert kv.misses["absent"] == 2
        with pytest.raises(OSError) as e:  # not a lookup: the namespace's absence is said
            kv.usage()
        assert e.value.errno == errno.ENOENT


def test_pin_says_which_keys_it_leased(mounted: Mounted) -> None:
    with KVStore(str(mounted.path), "pin") as kv, KVStore(str(mounted.path), "pin") as other:
        keys = [f"k{i}" for i in range(70)]  # a descriptor each: more than one reply carries
        kv.batch_put(keys, [blob(i, 1000) for i in range(70)])
        assert other.pin(["k0", "gone", "k1"]) == [True, False, True]
        assert kv.usage()["pinned"] == 2
        assert other.pin(keys + ["gone"]) == [True] * 70 + [False]
        assert kv.usage()["pinned"] == 70
        other.unpin(keys)
        assert kv.usage()["pinned"] == 2  # k0 and k1 were leased twice
        other.unpin(["k0", "k1"])
        assert kv.usage()["pinned"] == 0


def test_a_lease_on_a_chunk_gone_since_ends_nobody_elses(mounted: Mounted) -> None:
    """A connection's lease on a chunk that was deleted and put again under its key is
    on the old chunk: ending it (unpinning, or closing the connection) leaves another
    connection's lease on the new chunk standing.  Both are by key, and the first
    connection's unpin ended the second's before."""
    with KVStore(str(mounted.path), "relet") as kv, KVStore(str(mounted.path), "relet") as a:
        kv.put("k", blob(1, 1000))
        kv.put("j", blob(2, 1000))
        assert a.pin(["k", "j"]) == [True, True]
        assert kv.delete("k") and kv.delete("j")
        kv.put("k", blob(3, 1000))
        kv.put("j", blob(4, 1000))
        with KVStore(str(mounted.path), "relet") as b:
            assert b.pin(["k", "j"]) == [True, True]
            assert kv.usage()["pinned"] == 2
            a.unpin(["k"])
            assert kv.usage()["pinned"] == 2  # b's leases on both stand
            a.close()
            assert kv.usage()["pinned"] == 2
            b.unpin(["k"])
            assert kv.usage()["pinned"] == 1
        assert eventually(lambda: kv.usage()["pinned"] == 0)


SHARER = r"""
import sys
import time
from mxfs.client import ControlClient
from mxfs.kv import KVStore
kv = KVStore(sys.argv[1], "shared")
me = int(sys.argv[2])
for i in range(50):
    kv.put(f"w{me}-{i}", bytes([me]) * (1000 + i))
for other in range(4):  # wait for every writer, then read what all wrote
    while not kv.exists(f"w{other}-49"):
        pass
for other in range(4):
    for i in range(50):
        assert kv.get(f"w{other}-{i}") == bytes([other]) * (1000 + i), (other, i)
print("ok")
"""


def test_processes_share_one_store(mounted: Mounted) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(mounted.path), str(w)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    with KVStore(str(mounted.path), "shared") as kv:
        assert kv.usage()["chunks"] == 200


@pytest.mark.also_postgres
def test_capacity_evicts_least_recently_used_but_never_pinned(mounted: Mounted) -> None:
    with KVStore(str(mounted.path), "cap", capacity=10 * 100_000) as kv, \
            KVStore(str(mounted.path), "cap") as reader:
        for i in range(10):
            kv.put(f"c{i}", blob(i, 100_000))
        kv.get("c0")  # now the most recently used
        reader.pin(["c1"])  # a read lease held by another process's store
        kv.put("c10", blob(10, 100_000))  # over capacity: evict down to 90%
        present = kv.exists_many([f"c{i}" for i in range(11)])
        assert present[0] and present[1] and present[10]
        assert present[2:4] == [False, False]  # the least recently used went
        assert kv.usage()["bytes"] <= 10 * 100_000 * 0.9
        assert kv.usage()["evictions"] == 2
        reader.unpin(["c1"])
        assert kv.set_capacity(100_000) > 0  # shrink: the lease is gone, c1 may go now
        assert kv.usage()["bytes"] <= 100_000


@pytest.mark.also_postgres
@pytest.mark.daemon_log(CRASH)
def test_index_persists_across_remount_and_daemon_crash(mounted: Mounted) -> None:
    with KVStore(str(mounted.path), "p") as kv:
        kv.batch_put([f"k{i}" for i in range(20)], [blob(i, 50_000) for i in range(20)])
        kv.get("k0")
    mounted.umount()
    mounted.remount()
    with KVStore(str(mounted.path), "p") as kv:
        assert kv.batch_exists([f"k{i}" for i in range(20)]) == 20
        assert kv.get("k5") == blob(5, 50_000)
        kv.put("late", b"z" * 10)
    kill_daemon(mounted)
    mounted.remount()
    with KVStore(str(mounted.path), "p") as kv:
        assert kv.get("k19") == blob(19, 50_000)
    mounted.umount()
    check_pool(mounted.members)


def test_damaged_chunk_is_a_miss_never_wrong_bytes(mounted: Mounted,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with KVStore(str(mounted.path), "d") as kv:
        kv.put("big", blob(3, 2 << 20))
        kv.put("small", blob(4, 5000))
        # (spares' chunk files, made ahead for later puts, are empty)
        before = {p for p in chunk_files(mounted.members) if os.path.getsize(p) > 100}
        for path in before:
            with open(path, "r+b") as f:  # flip a byte in every chunk file, truncate one
                f.seek(100)
                b = f.read(1)
                f.seek(100)
                f.write(bytes([b[0] ^ 1]))
        os.truncate(sorted(before)[0], 10)
        with caplog.at_level("WARNING", logger="mxfs.kv"):
            assert kv.get("big") is None and kv.get("small") is None
        assert "fails its checksum" in caplog.text
        assert not kv.exists("big") and not kv.exists("small")  # dropped from the index
        kv.put("big", blob(5, 2 << 20))  # and stored again cleanly
        assert kv.get("big") == blob(5, 2 << 20)


def test_a_readers_drop_of_a_damaged_chunk_spares_the_key_put_again_meanwhile(
        mounted: Mounted) -> None:
    """A get finds a chunk failing its checksum and drops it: only that chunk.  The key
    deleted and put again (the same bytes, as a prefix computed again gives) between
    the reader's check and its drop stays stored; before, the drop named the key
    alone and deleted the good chunk put meanwhile."""
    good = blob(6, 2 << 20)
    with KVStore(str(mounted.path), "d") as kv, KVStore(str(mounted.path), "d") as other:
        kv.put("k", good)
        for path in (p for p in chunk_files(mounted.members) if os.path.getsize(p) > 100):
            with open(path, "r+b") as f:  # (flip a byte: its chunk files fail their sums)
                b = f.read(1)
                f.seek(0)
                f.write(bytes([b[0] ^ 1]))
        asked = kv._ask
        dropped: list[dict] = []

        def ask(req: Any) -> Any:
            if req.op.name == "kv_delete":
                assert other.delete("k") and other.put("k", good)  # (meanwhile)
                dropped.append(req.fields)
            return asked(req)
        kv._ask = ask  # type: ignore[method-assign]
        assert kv.get("k") is None  # (its miss)
        assert dropped, "the damaged chunk was not dropped"
        kv._ask = asked  # type: ignore[method-assign]
        assert kv.get("k") == good  # the chunk put meanwhile, kept


PUTTER = r"""
import mmap, os, sys, time
from mxfs.client import writer
from mxfs.client import ControlClient
from mxfs.kv import KVStore
kv = KVStore(sys.argv[1], "w")
def stall(self, *a, **k):  # the bytes are written; the commit is about to go
    print("written", flush=True)
    time.sleep(600)
writer.DirectWriter.finish_request = stall
kv.put("half", os.urandom(8 << 20))
"""


def test_writer_killed_mid_put_leaves_nothing(mounted: Mounted) -> None:
    before = len(chunk_files(mounted.members))
    p = subprocess.Popen([sys.executable, "-c", PUTTER, str(mounted.path)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "written"
    assert len(chunk_files(mounted.members)) > before
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert eventually(lambda: len(chunk_files(mounted.members)) == before)
    with KVStore(str(mounted.path), "w") as kv:
        assert not kv.exists("half") and kv.usage()["chunks"] == 0
    mounted.umount()
    check_pool(mounted.members)


def test_full_pool_fails_puts_fast_and_eviction_makes_room(loop_pool: Mounted) -> None:
    mp, loop_members = loop_pool.path, loop_pool.members
    with KVStore(str(mp), "f") as kv:
        stored, failed = 0, 0
        for i in range(400):  # far more than the 24 MiB member holds
            try:
                kv.put(f"x{i}", blob(i, 1 << 20))
                stored += 1
            except OSError as e:
                assert e.errno == 28  # ENOSPC, at once
                failed += 1
                if failed > 3:
                    break
        assert stored > 10 and failed
        assert kv.usage()["evictions"] > 0  # the pool made room for later puts
        assert eventually(lambda: _put_ok(kv))
        assert kv.get(f"x{stored - 1}") in (None, blob(stored - 1, 1 << 20))
    loop_pool.umount()
    check_pool(loop_members)


def _put_ok(kv: KVStore) -> bool:
    try:
        kv.put(os.urandom(8).hex(), b"y" * (1 << 20))
        return True
    except OSError:
        return False


def test_kv_list_pages_by_a_cursor_and_skips_a_bounded_way(mounted: Mounted) -> None:
    """`mxfs kv ls` pages through a namespace past 1,000 chunks by a cursor (the last
    key of a page, in key order), each page read from the store's index; a page by
    position (`skip`) walks at most MAX_LIST_SKIP chunks, past that EINVAL naming the
    cursor."""
    keys = [b"p%05d" % i for i in range(2500)]
    with KVStore(str(mounted.path), "paged") as kv:
        for start in range(0, len(keys), 500):
            kv.batch_put(keys[start:start + 500], [b"v"] * 500)
        first = kv.list_chunks(after=b"")
        assert [k for k, _, _ in first] == keys[:1000]
        assert [k for k, _, _ in kv.list_chunks(after=keys[2400])] == keys[2401:]
        assert len(kv.list_chunks(skip=2000)) == 500
        with pytest.raises(OSError) as e:
            kv.list_chunks(skip=MAX_LIST_SKIP + 1)
        assert e.value.errno == errno.EINVAL and "after" in str(e.value)
    listed = json.loads(mxfs("kv", "ls", "--json", str(mounted.path), "paged").stdout)
    assert [c["key"] for c in listed["chunks"]] == [k.decode() for k in keys]


def test_kv_cli_stats_ls_evict_verify(mounted: Mounted) -> None:
    with KVStore(str(mounted.path), "cli") as kv:
        kv.batch_put([f"k{i}" for i in range(5)], [blob(i, 300_000) for i in range(5)])
    stats = json.loads(mxfs("kv", "stats", "--json", str(mounted.path)).stdout)
    row = next(s for s in stats["namespaces"] if s["namespace"] == "cli")
    assert row["chunks"] == 5 and row["bytes"] == 1_500_000
    listed = json.loads(mxfs("kv", "ls", "--json", str(mounted.path), "cli").stdout)
    assert [c["key"] for c in listed["chunks"]] == [f"k{i}" for i in range(5)]
    assert json.loads(mxfs("kv", "verify", "--json", str(mounted.path), "cli").stdout
                      )["damaged"] == []
    with ControlClient(str(mounted.path)) as c:  # (a byte of k2's chunk file flipped)
        info = c.call("kv_get", namespace="cli", keys=[base64.b64encode(b"k2").decode()],
                      sizes=[300_000])
    ino = info["chunks"][0]["chunk"]
    chunk = next(p for p in chunk_files(mounted.members) if p.endswith(f"/{ino}"))
    with open(chunk, "r+b") as f:
        f.seek(1000)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    drop_caches()
    res = mxfs("kv", "verify", "--json", str(mounted.path), "cli", check=False)
    assert res.returncode == 1
    assert json.loads(res.stdout) == {"checked": 5, "gone": 0, "damaged": ["k2"]}
    out = json.loads(mxfs("kv", "evict", "--json", str(mounted.path), "cli", "--keep",
                          "600000").stdout)
    assert out["evicted"] == 2  # (of the four left: k2 was dropped)
    assert "2 chunks" in mxfs("kv", "stats", str(mounted.path)).stdout
    line = one_line_error(mxfs("kv", "ls", str(mounted.path), "nosuch", check=False))
    assert "nosuch" in line


def test_a_store_with_a_reuse_policy_reads_a_prefix_only_where_it_pays(mounted: Mounted
                                                                       ) -> None:
    """Gets tell the policy the pool's read rate; `prefix_to_read` is the prefix hit,
    cut to nothing when the pool is (pinned as) too slow to beat computing it."""
    from mxfs.kv.reuse_policy import ReusePolicy

    chunk = 64 << 10

    def flops(n: int, cached: int) -> float:
        return (n - cached) * 1e9

    policy = ReusePolicy(256, chunk, flops, seconds_per_flop=1e-12)  # 1 ms a token
    with KVStore(str(mounted.path), "policy", policy=policy) as kv:
        keys = [f"p{i}" for i in range(4)]
        kv.batch_put(keys, [blob(i, chunk) for i in range(4)])
        assert kv.prefix_to_read([*keys, "absent"], 5 * 256) == 4  # not measured: all
        outs = [bytearray(chunk) for _ in keys]
        assert kv.batch_get(keys, outs) == [True] * 4
        assert policy.read_bps is not None and policy.read_bps > 0  # the get measured it
        policy.pin_read_rate(1.0)  # a byte a second: computing 1,280 tokens (1.3 s) wins
        assert kv.prefix_to_read(keys, 5 * 256) == 0
        policy.pin_read_rate(1e12)
        assert kv.prefix_to_read(keys, 5 * 256) == 4
        assert kv.prefix_to_read(keys, 5 * 256, have_tokens=2 * 256) == 3  # what fits after
    with KVStore(str(mounted.path), "policy") as plain:  # no policy: the prefix hit
        assert plain.prefix_to_read(keys, 5 * 256) == 4


def test_concurrent_misses_are_computed_once(mounted: Mounted) -> None:
    """Two clients miss the same keys at once: the first claims them, the second is
    told they are busy and waits for the first's puts, then gets them; a claim given
    up (its connection closed) or run out frees its keys at once."""
    import threading

    a = KVStore(str(mounted.path), "claims")
    b = KVStore(str(mounted.path), "claims")
    try:
        k1, k2, k3 = b"c1" * 16, b"c2" * 16, b"c3" * 16
        assert a.claim([k1, k2]) == ["yours", "yours"]
        assert a.claim([k1]) == ["yours"]  # (one's own claim: still its own)
        assert b.claim([k1, k3]) == ["busy", "yours"]
        waited: list[list[bool]] = []
        waiter = threading.Thread(target=lambda: waited.append(b.wait([k1], 30)))
        waiter.start()
        value = os.urandom(3 << 20)  # (a chunk put through descriptors: create, commit)
        a.put(k1, value)
        waiter.join(30)
        assert waited == [[True]]
        assert b.get(k1) == value
        assert b.claim([k1]) == ["stored"]
        # The claimer goes away without putting k2: the waiter goes on, nothing stored,
        # and the key is free to claim.
        waiter = threading.Thread(target=lambda: waited.append(b.wait([k2], 30)))
        waiter.start()
        a.close()
        waiter.join(30)
        assert waited[-1] == [False]
        assert b.claim([k2]) == ["yours"]
        # A claim runs out.
        c = KVStore(str(mounted.path), "claims")
        assert c.claim([b"c4" * 16], seconds=0.2) == ["yours"]
        time.sleep(0.5)
        assert b.claim([b"c4" * 16]) == ["yours"]
        c.close()
    finally:
        a.close()
        b.close()


def test_a_namespace_taken_over_keeps_none_of_the_old_ones_claims(mounted: Mounted) -> None:
    """Root's `kv create --force` makes a new namespace of the name: a claim made in the
    old one holds nobody back in the new."""
    m = str(mounted.path)
    with KVStore(m, "taken") as old, KVStore(m, "taken") as new:
        key = b"t1" * 16
        assert old.claim([key], seconds=60) == ["yours"]
        assert new.claim([key]) == ["busy"]
        mxfs("kv", "create", m, "taken", "--force")
        assert new.claim([key]) == ["yours"]


def test_exists_is_answered_from_the_namespaces_table_kept_current(mounted: Mounted) -> None:
    """After one `kv_view`, exists and batch_exists ask the daemon nothing, and see
    every put, delete and eviction of any process at once, through a table that
    fills up and is replaced, until the namespace goes."""
    keys = [f"k{i}" for i in range(800)]
    with KVStore(str(mounted.path), "viewed") as kv, \
            KVStore(str(mounted.path), "viewed") as other:
        assert kv.batch_put(keys[:10], [b"v"] * 10) == [True] * 10
        asked = requests_served(mounted.path, "kv_exists")
        assert kv.exists_many(keys[:12]) == [True] * 10 + [False] * 2
        assert other.put(keys[10], b"w")  # another store's put: seen at once
        assert kv.batch_exists(keys[:12]) == 11
        assert other.delete(keys[3])
        assert kv.exists_many(keys[:5]) == [True, True, True, False, True]
        # 790 more keys: past the first table's room (1,024 slots), a larger one
        assert other.batch_put(keys[11:], [b"x"] * 789) == [True] * 789
        assert kv.exists_many(keys) == [i != 3 for i in range(800)]
        assert kv.exists_many(["absent", keys[799]]) == [False, True]
        assert requests_served(mounted.path, "kv_exists") == asked  # none asked the daemon
        pins = requests_served(mounted.path, "kv_pin")
        assert kv.pin(["absent", "gone", keys[3]]) == [False] * 3  # (LMCache's lookups)
        assert requests_served(mounted.path, "kv_pin") == pins  # absent keys: not asked
        assert kv.pin(["absent", keys[4], keys[3], keys[5]]) == [False, True, False, True]
        kv.unpin([keys[4], keys[5]])
        kv.evict(0)
        assert kv.exists_many(keys[:3]) == [False] * 3
        other.client.call("kv_ns_remove", namespace="viewed")
        assert kv.exists_many(keys[:3]) == [False] * 3 and kv.batch_exists(keys) == 0
        kv.put("again", b"v")  # a new namespace of the name: its own table
        assert kv.exists_many(["again", keys[0]]) == [True, False]


def test_a_writer_who_read_the_seed_cannot_make_lookups_or_inserts_walk_a_run(
        mounted: Mounted) -> None:
    """A writer of a shared namespace reads its table's seed (every reader must) and
    puts keys of one run of slots: before, every lookup of the namespace's readers
    and every insert on the daemon's thread walked it (4.7 ms and 4 ms at 100k keys).
    A lookup walks MAX_PROBE slots at most now, then asks the daemon of that key; a
    run that long has the table rebuilt under a fresh seed once it took a quarter
    more keys than it was made with: her run is scattered, no key lies past the
    bound, and readers' answers are right throughout."""
    from test_presence import chain_keys, reach

    from mxfs.client.control import ControlClient
    from mxfs.proto.presence import HEADER_SIZE, LIVE, MAX_PROBE, MOVED, read_header

    def table() -> tuple[mmap.mmap, int, int]:  # (a reader's mapping, its slots, its seed)
        with ControlClient(str(mounted.path)) as c:
            reply, fds = c.call_with_fds("kv_view", namespace="shared")
        try:
            mapped = mmap.mmap(fds[0], reply["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fds[0])
        _, slots, seed, _ = read_header(memoryview(mapped))
        return mapped, slots, seed

    victims = [b"victim%d" % i for i in range(1000)]
    with KVStore(str(mounted.path), "shared") as victim, \
            KVStore(str(mounted.path), "shared") as writer:
        assert victim.batch_put(victims, [b"v"] * 1000) == [True] * 1000
        assert victim.exists_many(victims[:2]) == [True, True]  # (its table, made)
        old, slots, seed = table()
        run = [chain_keys(seed, slots, home, 1, b"run%d-" % home, width=1)[0]
               for home in range(100, 100 + MAX_PROBE + 8)]  # (each in its home slot)
        assert writer.batch_put(run, [b"r"] * len(run)) == [True] * len(run)
        assert read_header(memoryview(old))[0] == LIVE  # (not a quarter more keys yet)
        absent = chain_keys(seed, slots, 100, 1, prefix=b"new", width=1)
        asked = requests_served(mounted.path, "kv_exists")
        assert victim.exists_many(absent + run[:3] + victims[:2]) == [False] + [True] * 5
        assert requests_served(mounted.path, "kv_exists") == asked + 1  # (that key only)
        assert victim.pin(absent + run[:1]) == [False, True]
        victim.unpin(run[:1])
        evil = chain_keys(seed, slots, 100, 2 * MAX_PROBE)  # (1,000 + 392: not FULL)
        assert writer.batch_put(evil, [b"e"] * len(evil)) == [True] * len(evil)
        assert read_header(memoryview(old))[0] == MOVED  # replaced ...
        now, now_slots, now_seed = table()
        assert now_seed != seed  # ... under a fresh seed
        keys = memoryview(now)[HEADER_SIZE:HEADER_SIZE + 8 * now_slots].cast("Q")
        reached = [reach(keys, now_seed, k) for k in victims + run + evil]
        assert min(reached) >= 0 and max(reached) < MAX_PROBE
        asked = requests_served(mounted.path, "kv_exists")
        assert victim.exists_many([*victims, *run, *evil, *absent]) == \
            [True] * (len(victims) + len(run) + len(evil)) + [False]
        assert requests_served(mounted.path, "kv_exists") == asked  # (from its table)
        keys.release()
        for mapped in (old, now):
            mapped.close()


def test_a_views_descriptor_reads_and_nothing_more_and_is_wiped_with_its_namespace(
        mounted: Mounted) -> None:
    """The table a client is handed is read-only whatever it tries, and shows nothing
    once its namespace is removed (the daemon cannot take a mapping back)."""
    from mxfs.client.control import ControlClient
    from mxfs.proto.presence import GONE, HEADER_SIZE, read_header

    with KVStore(str(mounted.path), "sealed") as kv:
        kv.batch_put(["a", "b"], [b"1", b"2"])
        with ControlClient(str(mounted.path)) as c:
            reply, fds = c.call_with_fds("kv_view", namespace="sealed")
        fd = fds[0]
        try:
            with pytest.raises(OSError) as e:
                os.write(fd, b"x")
            assert e.value.errno == errno.EBADF  # a read-only descriptor
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # (root may reopen it)
            try:
                with pytest.raises(OSError) as e:
                    os.pwrite(again, b"x" * 8, HEADER_SIZE)
                assert e.value.errno == errno.EPERM  # sealed against writes
                with pytest.raises(OSError):
                    mmap.mmap(again, reply["size"], mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(OSError):
                    os.ftruncate(again, 0)
            finally:
                os.close(again)
            table = mmap.mmap(fd, reply["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        assert read_header(memoryview(table))[3] == 2  # its two keys
        assert any(table[HEADER_SIZE:])
        kv.client.call("kv_ns_remove", namespace="sealed")
        state, _, _, count = read_header(memoryview(table))
        assert state == GONE and count == 0  # (said at once; wiped by a thread, after)
        assert eventually(lambda: not any(table[HEADER_SIZE:]))
        table.close()


def test_a_chunk_up_to_4mib_is_one_file_and_a_batch_spreads_over_the_members(
        mounted: Mounted) -> None:
    """A KV chunk up to ONE_MEMBER_MAX lies whole on one member (one file to make and
    open, where striped over this pool's 64 KiB units it was four), members taken in
    turn so a batch still reads from all of them; a larger chunk stripes as files do."""
    from mxfs.vol.spares import ONE_MEMBER_MAX

    def holding() -> dict[str, int]:  # chunk files with bytes in them, by member
        found: dict[str, int] = {}
        for f in chunk_files(mounted.members):
            if os.path.getsize(f):
                member = next(m for m in mounted.members if f.startswith(m + os.sep))
                found[member] = found.get(member, 0) + 1
        return found

    small = [blob(i, 2 << 20) for i in range(8)]
    with KVStore(str(mounted.path), "placed") as kv:
        assert kv.batch_put([f"s{i}" for i in range(8)], small) == [True] * 8
        placed = holding()
        assert sum(placed.values()) == 8 and len(placed) == len(mounted.members)
        large = blob(9, ONE_MEMBER_MAX + (1 << 20))
        assert kv.put("large", large)
        after = holding()
        assert all(after[m] == placed[m] + 1 for m in mounted.members)
        drop_caches()
        got = kv.batch_get([f"s{i}" for i in range(8)] + ["large"])
        assert [bytes(g) for g in got] == small + [large]


def test_a_spares_file_is_made_once_so_no_writer_of_the_daemon_outlives_its_take(
        members: list[str]) -> None:
    """A spare's chunk file is made by whoever gets to it first: the spares' thread, or
    the put that took the spare before it. A maker reaching a taken spare later opens
    nothing (a descriptor for writing it, open when the put commits, refused the
    commit with EBUSY: seen once in CI)."""
    from mxfs.pool import ChunkFiles, Pool

    mkfs(members, "64KiB")
    pool = Pool.open(members[0])
    layout = pool.layout_for(7, None, 1)
    chunks = ChunkFiles(pool, 7, layout)
    path = pool.chunk_path(layout.first, 7)
    chunks.prepare()  # (the put's, on taking it)
    assert os.path.exists(path)
    os.unlink(path)
    chunks.prepare()  # (the maker's, late)
    assert not os.path.exists(path)
    chunks.close()


def test_a_chunk_is_committed_into_the_namespace_it_was_made_for(mounted: Mounted) -> None:
    """kv_create judges the room of one namespace's owner (its chunk count, its
    capacity): a commit into another namespace is refused, so a user cannot grow a
    namespace past its owner's bounds through one of their own."""
    import base64

    from mxfs.client import ControlClient
    from mxfs.client.control import ControlError
    from mxfs.io.checksum import block_sums, pack_sums

    key = base64.b64encode(b"k").decode()
    with ControlClient(str(mounted.path)) as c:
        for ns in ("made", "other"):
            c.call("kv_ns_create", namespace=ns, capacity=1 << 30)
        made, fds = c.call_with_fds("kv_create", namespace="made", key=key, size=3)
        os.pwrite(fds[0], b"abc", 0)
        for fd in fds:
            os.close(fd)
        unit = made["layout"]["stripe_unit"]
        commit = {"ino": made["ino"], "key": key, "size": 3, "sum_unit": unit,
                  "sums": base64.b64encode(pack_sums(block_sums(b"abc", unit))).decode()}
        with pytest.raises(ControlError) as e:
            c.call("kv_commit", namespace="other", **commit)
        assert e.value.errno == errno.EINVAL and "made" in e.value.strerror
        assert c.call("kv_commit", namespace="made", **commit)["stored"] is True
    with KVStore(str(mounted.path), "made") as kv:
        assert bytes(kv.get(b"k")) == b"abc"


def test_a_chunk_with_holes_is_refused_at_its_commit(mounted: Mounted) -> None:
    """A writer that sized its chunk files without writing them (holes: no disk, yet
    the size counted and its checksums held in the daemon's memory) is refused at
    kv_commit and nothing is stored; the same chunk written (zeros included) is."""
    import base64

    from mxfs.client import ControlClient
    from mxfs.client.control import ControlError
    from mxfs.io import Layout
    from mxfs.io.checksum import block_sums, pack_sums

    size = 3 << 20
    with ControlClient(str(mounted.path)) as c:
        c.call("kv_ns_create", namespace="holes", capacity=1 << 30)
        for key, write in ((b"sized", False), (b"written", True)):
            made, fds = c.call_with_fds("kv_create", namespace="holes",
                                        key=base64.b64encode(key).decode(), size=size)
            lay = Layout.from_description(made["layout"])
            assert len(fds) == len(lay.holding(size))
            for m, fd in zip(sorted(lay.holding(size)), fds, strict=True):
                if write:
                    os.pwrite(fd, bytes(lay.chunk_length(m, size)), 0)
                else:
                    os.ftruncate(fd, lay.chunk_length(m, size))
                os.close(fd)
            commit = {"namespace": "holes", "ino": made["ino"],
                      "key": base64.b64encode(key).decode(), "size": size,
                      "sum_unit": lay.unit, "sums": base64.b64encode(
                          pack_sums(block_sums(bytes(size), lay.unit))).decode()}
            if write:
                assert c.call("kv_commit", **commit)["stored"] is True
                continue
            with pytest.raises(ControlError) as e:
                c.call("kv_commit", **commit)
            assert e.value.errno == errno.EINVAL and "hold holes" in e.value.strerror
    with KVStore(str(mounted.path), "holes") as kv:
        assert not kv.exists(b"sized")
        assert bytes(kv.get(b"written")) == bytes(size)


def test_a_large_chunk_is_settled_at_its_commit_and_an_overdraft_refused(
        mounted: Mounted) -> None:
    """A chunk larger than a spare is settled at its commit in a worker thread (cutting
    back what its writer wrote held the daemon's one thread): it reads back whole, and
    one whose writer wrote past its declared size is refused and not stored."""
    import base64

    from mxfs.client import ControlClient
    from mxfs.client.control import ControlError

    data = os.urandom(6 << 20)
    with KVStore(str(mounted.path), "large") as kv:
        assert kv.put("six", data)
        assert bytes(kv.get("six")) == data
    key = base64.b64encode(b"over").decode()
    with ControlClient(str(mounted.path)) as c:
        made, fds = c.call_with_fds("kv_create", namespace="large", key=key, size=8 << 20)
        os.pwrite(fds[0], b"x" * (4 << 20), 0)  # (a member's share is 2 MiB of the 8)
        for fd in fds:
            os.close(fd)
        with pytest.raises(ControlError) as e:
            c.call("kv_commit", namespace="large", ino=made["ino"], key=key, size=1,
                   sum_unit=made["layout"]["stripe_unit"], sums="AAAAAAAAAAA=")
        assert e.value.errno == errno.EFBIG
    with KVStore(str(mounted.path), "large") as kv:
        assert not kv.exists("over") and bytes(kv.get("six")) == data

"""The LMCache L2 adapter on LMCache's real base classes, built the way LMCache builds it.

Skips without LMCache (not in the test extras); `make test` runs it
again in the engines' virtualenv (tools/install_engines.sh), where nothing may skip.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Mounted, eventually

from mxfs.kv import KVStore
from mxfs.kv.keys import lmcache_hashes, lmcache_kv_rank


@pytest.fixture(autouse=True)
def _lmcache() -> None:
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.base")


def adapter_for(mounted: Mounted, **params: Any) -> Any:
    """The adapter as `lmcache server --l2-adapter '{"type": "plugin", ...}'` makes it."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps({
        "type": "plugin", "module_path": "mxfs.kv.adapters.lmcache",
        "class_name": "MxfsL2Adapter",
        "adapter_params": {"mount": str(mounted.path), "namespace": "lmc", **params}})])
    return create_l2_adapter_from_registry(parse_args_to_l2_adapters_config(args).adapters[0])


def obj(t: torch.Tensor) -> Any:
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    return TensorMemoryObj(t, MemoryObjMetadata(t.shape, t.dtype, 0, t.numel() * 2, 1), None)


def object_keys(n: int, model: str = "Qwen/Qwen3-8B", rank: int = 0x01000100) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(h, model, rank) for h in lmcache_hashes(list(range(256 * n)))]


def done(query: Callable[[], Any]) -> Any:
    out: list[Any] = []
    assert eventually(lambda: out.append(query()) or out[-1] is not None)
    return out[-1]


def stored(adapter: Any, task: int) -> Any:
    results: dict[int, Any] = {}
    return done(lambda: results.update(adapter.pop_completed_store_tasks())
                or results.get(task))


def lookup(adapter: Any, keys: list[Any]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bits = done(lambda: adapter.query_lookup_and_lock_result(task))
    return [bits.test(i) for i in range(len(keys))]


def load(adapter: Any, keys: list[Any], outs: list[torch.Tensor]) -> list[bool]:
    task = adapter.submit_load_task(keys, [obj(t) for t in outs])
    bits = done(lambda: adapter.query_load_result(task))
    return [bits.test(i) for i in range(len(keys))]


def pinned(mounted: Mounted) -> int:
    with KVStore(str(mounted.path), "lmc") as kv:
        return int(kv.usage()["pinned"])


def test_lmcache_chunk_hashes_equal_its_token_hasher() -> None:
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    tokens = [(i * 7919) % 151000 for i in range(256 * 3 + 100)]
    assert lmcache_hashes(tokens) == TokenHasher(256, "blake3").compute_chunk_hashes(tokens)


def test_lmcache_keys_are_its_connectors_keys() -> None:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )

    from mxfs.kv.adapters.lmcache import object_key

    h = lmcache_hashes(list(range(512)))
    ranks = [ObjectKey.ComputeKVRank(w, g, lw, lr)
             for w, g, lw, lr in ((1, 0, 1, 0), (8, 5, 4, 1), (8, 1, 4, 1), (2, 1, 2, 1))]
    assert ranks == [lmcache_kv_rank(w, g, lw, lr)
                     for w, g, lw, lr in ((1, 0, 1, 0), (8, 5, 4, 1), (8, 1, 4, 1), (2, 1, 2, 1))]
    keys = [ObjectKey(h[0], "Qwen/Qwen3-8B", ranks[0]),
            ObjectKey(h[1], "Qwen/Qwen3-8B", ranks[0]),                  # chunk hash
            ObjectKey(h[0], "meta-llama/Llama-3.1-8B", ranks[0]),        # model
            *[ObjectKey(h[0], "Qwen/Qwen3-8B", r) for r in ranks[1:]],   # each kv rank
            ObjectKey(h[0], "Qwen/Qwen3-8B", ranks[0], 1),               # object group
            ObjectKey(h[0], "Qwen/Qwen3-8B", ranks[0], 0, "tenant-a"),   # cache salt
            ObjectKey(h[0], "Qwen/Qwen3-8B", ranks[0], 1, "tenant-a")]
    for k in keys:
        assert object_key(k) == _object_key_to_string(k).encode(), k
    assert len({object_key(k) for k in keys}) == len(keys)  # every field tells keys apart


def test_lmcache_l2_adapter_built_from_the_plugin_flag(mounted: Mounted) -> None:
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    from mxfs.kv.adapters.lmcache import MxfsL2Adapter

    class Seen(L2AdapterListener):  # what LMCache's eviction state and events hear
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
            self.calls.append(("stored", len(keys)))

        def on_l2_keys_accessed(self, keys: list[Any]) -> None:
            self.calls.append(("accessed", len(keys)))

        def on_l2_keys_deleted(self, keys: list[Any]) -> None:
            self.calls.append(("deleted", len(keys)))

    adapter = adapter_for(mounted)
    seen = Seen()
    adapter.register_listener(seen)
    assert isinstance(adapter, MxfsL2Adapter) and not adapter.supports_global_eviction
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(),
           adapter.get_load_event_fd()}
    assert len(fds) == 3
    keys = object_keys(3)
    assert lookup(adapter, keys) == [False] * 3  # nothing stored yet, no namespace either
    data = [torch.randn(2, 256, 64).bfloat16() for _ in keys]
    task = adapter.submit_store_task(keys[:2], [obj(t) for t in data[:2]])
    assert select.select([adapter.get_store_event_fd()], [], [], 30)[0], "no event"
    result = stored(adapter, task)
    assert result.is_successful() and result.bytes_transferred() == 2 * data[0].numel() * 2
    again = stored(adapter, adapter.submit_store_task(keys[:1], [obj(data[0])]))
    assert again.is_successful() and again.bytes_transferred() == 0  # the first writer won

    task = adapter.submit_lookup_and_lock_task(keys, {})
    bits = done(lambda: adapter.query_lookup_and_lock_result(task))
    assert adapter.query_lookup_and_lock_result(task) is None  # a result is taken once
    assert [bits.test(i) for i in range(3)] == [True, True, False]
    assert pinned(mounted) == 2  # locked: eviction must skip them
    outs = [torch.zeros(2, 256, 64, dtype=torch.bfloat16) for _ in keys]
    assert load(adapter, keys, outs) == [True, True, False]
    assert torch.equal(outs[0], data[0]) and torch.equal(outs[1], data[1])
    adapter.submit_unlock(keys[:2])
    assert eventually(lambda: pinned(mounted) == 0)
    assert seen.calls == [("stored", 2), ("accessed", 2)]
    adapter.delete(keys[:1])
    assert seen.calls[-1] == ("deleted", 1)
    assert adapter.get_usage().total_bytes_used == data[0].numel() * 2
    adapter.close()
    with KVStore(str(mounted.path), "lmc") as kv:
        assert kv.usage()["pinned"] == 0 and kv.usage()["chunks"] == 1


def test_lmcache_locks_balance_and_locked_chunks_stay(mounted: Mounted) -> None:
    adapter = adapter_for(mounted)
    n = 70  # more chunk descriptors than one reply carries (64)
    keys = object_keys(n)
    data = [torch.full((64, 64), i, dtype=torch.bfloat16) for i in range(n)]
    assert stored(adapter, adapter.submit_store_task(keys, [obj(t) for t in data])) \
        .is_successful()
    assert lookup(adapter, keys) == [True] * n and pinned(mounted) == n
    assert lookup(adapter, keys[:5]) == [True] * 5  # a second request locks them again
    adapter.submit_unlock(keys[:5] + object_keys(1, model="never-stored"))
    assert eventually(lambda: pinned(mounted) == n)  # the first request's locks stay

    adapter.delete(keys[:5] + keys[n - 10:])  # LMCache's eviction: locked chunks are spared
    adapter.submit_unlock(keys[n - 10:])
    assert eventually(lambda: pinned(mounted) == n - 10)
    with KVStore(str(mounted.path), "lmc") as kv:
        assert kv.usage()["chunks"] == n
        assert kv.set_capacity(data[0].numel() * 2 * 10) == 10  # mxfs evicts only unlocked
        assert kv.usage()["chunks"] == n - 10

    small = [torch.zeros(32, 64, dtype=torch.bfloat16) for _ in range(2)]  # other sizes
    big = [torch.zeros(128, 64, dtype=torch.bfloat16)]
    outs = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(3)]
    assert load(adapter, keys[:6], small + big + outs) == [False] * 3 + [True] * 3
    assert all(torch.equal(o, data[3 + i]) for i, o in enumerate(outs))
    adapter.submit_unlock(keys[:n - 10])
    assert eventually(lambda: pinned(mounted) == 0)
    adapter.close()


def test_lmcache_reports_only_the_hits_that_read_faster_than_they_compute(
        mounted: Mounted) -> None:
    """With the instance's prefill rate given, a lookup reports found the chunks that
    the pool, at the rate this adapter's loads measured, delivers faster than the
    instance computes them, and holds no lock on the others: all of them for a slow
    instance, none for one that computes faster than anything reads (but one in 16
    lookups, to see the pool again); every hit before a load measured the pool; rows
    (object groups) are cut at one chunk position; bad settings are refused."""
    from lmcache.v1.distributed.api import ObjectKey

    from mxfs.kv.reuse_policy import PROBE_EVERY

    keys = object_keys(4)
    rows = keys + [ObjectKey(k.chunk_hash, k.model_name, k.kv_rank, 1) for k in keys]
    data = [torch.full((64, 64), i, dtype=torch.bfloat16) for i in range(8)]
    writer = adapter_for(mounted)
    assert stored(writer, writer.submit_store_task(rows, [obj(t) for t in data])) \
        .is_successful()
    writer.close()
    seen = {}
    for name, rate in (("slow", 1e-3), ("fast", 1e15)):
        adapter = adapter_for(mounted, prefill_tokens_per_s=rate, chunk_tokens=256)
        assert lookup(adapter, rows) == [True] * 8  # the pool not measured yet
        adapter.submit_unlock(rows)
        outs = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(8)]
        assert load(adapter, rows, outs) == [True] * 8  # measures it
        seen[name] = []
        for _ in range(PROBE_EVERY):
            found = lookup(adapter, rows)
            seen[name].append(found[:4])
            assert found[4:] == found[:4]  # both object groups cut alike
            adapter.submit_unlock([k for k, f in zip(rows, found, strict=True) if f])
            assert eventually(lambda: pinned(mounted) == 0)  # the cut ones unlocked too
        adapter.close()
    assert seen["slow"] == [[True] * 4] * PROBE_EVERY
    assert seen["fast"] == [[False] * 4] * (PROBE_EVERY - 1) + [[True] + [False] * 3]
    for bad in ({"prefill_tokens_per_s": "fast"}, {"prefill_tokens_per_s": 0},
                {"prefill_tokens_per_s": 1e4, "chunk_tokens": -1}):
        with pytest.raises(ValueError, match="prefill_tokens_per_s|chunk_tokens"):
            adapter_for(mounted, **bad)


def test_lmcache_errors_are_failed_tasks(mounted: Mounted) -> None:
    full = adapter_for(mounted, namespace="tiny", capacity=4096)
    keys = object_keys(2)
    data = [torch.ones(64, 64, dtype=torch.bfloat16) for _ in keys]
    assert not stored(full, full.submit_store_task(keys, [obj(t) for t in data])).is_successful()
    full.close()

    adapter = adapter_for(mounted)
    kv = adapter.store
    assert stored(adapter, adapter.submit_store_task(keys, [obj(t) for t in data])) \
        .is_successful()
    assert lookup(adapter, keys) == [True, True]
    mounted.umount()  # the pool goes away under a running server
    assert not stored(adapter, adapter.submit_store_task(object_keys(3)[2:],
                                                         [obj(data[0])])).is_successful()
    assert lookup(adapter, keys) == [False, False]
    assert load(adapter, keys, [torch.zeros(64, 64, dtype=torch.bfloat16)] * 2) == [False] * 2
    adapter.submit_unlock(keys)
    assert adapter.get_usage().total_bytes_used == 0
    assert not adapter.report_status()["is_healthy"]
    mounted.remount()  # back: the adapter connects again (its old leases died with the daemon)
    assert lookup(adapter, keys) == [True, True]
    assert adapter.store is kv and kv.client.connections == 2  # the store's client did it
    assert adapter.report_status()["is_healthy"]
    assert pinned(mounted) == 2  # the new connection's leases, which one unlock each ends
    adapter.submit_unlock(keys)
    assert eventually(lambda: pinned(mounted) == 0)
    adapter.close()


def test_lmcache_leases_of_a_lost_connection_are_forgotten(mounted: Mounted) -> None:
    adapter = adapter_for(mounted)
    keys = object_keys(3)
    data = [torch.full((64, 64), i, dtype=torch.bfloat16) for i in range(3)]
    assert stored(adapter, adapter.submit_store_task(keys, [obj(t) for t in data])) \
        .is_successful()
    assert lookup(adapter, keys[:2]) == [True, True] and pinned(mounted) == 2
    adapter.store.client.sock.shutdown(socket.SHUT_RDWR)  # lost: its leases end with it
    assert eventually(lambda: pinned(mounted) == 0)
    assert lookup(adapter, keys[1:]) == [True, True] and pinned(mounted) == 2
    adapter.delete(keys[:1])  # locked on the lost connection only: nothing spares it now
    adapter.submit_unlock(keys[:1])  # nor does its unlock end a lease of the new one
    outs = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(3)]
    assert load(adapter, keys, outs) == [False, True, True]
    assert pinned(mounted) == 2
    adapter.submit_unlock(keys[1:])
    assert eventually(lambda: pinned(mounted) == 0)
    adapter.close()

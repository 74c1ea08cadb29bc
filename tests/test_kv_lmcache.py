"""The LMCache L2 adapter on LMCache's real base classes, built the way LMCache builds it.

Skips without LMCache (not in the test extras); how it was installed is in
tests/test_kv_adapters.py.
"""

from __future__ import annotations

import argparse
import json
import select

import pytest
import torch
from conftest import Mounted

from mxfs.kv import KVStore


def test_lmcache_l2_adapter_built_from_the_plugin_flag(mounted: Mounted) -> None:
    pytest.importorskip("lmcache.v1.distributed.l2_adapters.base")
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters import (
        create_l2_adapter_from_registry,
    )
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    from mxfs.kv.adapters.lmcache import MxfsL2Adapter
    from mxfs.kv.keys import lmcache_hashes

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps({
        "type": "plugin", "module_path": "mxfs.kv.adapters.lmcache",
        "class_name": "MxfsL2Adapter",
        "adapter_params": {"mount": str(mounted.path), "namespace": "lmc"}})])
    conf = parse_args_to_l2_adapters_config(args)
    adapter = create_l2_adapter_from_registry(conf.adapters[0])
    assert isinstance(adapter, MxfsL2Adapter)
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(),
           adapter.get_load_event_fd()}
    assert len(fds) == 3

    def obj(t: torch.Tensor) -> TensorMemoryObj:
        return TensorMemoryObj(t, MemoryObjMetadata(t.shape, t.dtype, 0, t.numel() * 2, 1),
                               None)

    def wait(fd: int) -> None:
        assert select.select([fd], [], [], 30)[0], "no event"

    hashes = lmcache_hashes(list(range(256 * 3)))
    keys = [ObjectKey(h, "qwen", 0x01000100) for h in hashes]
    data = [torch.randn(2, 256, 64).bfloat16() for _ in keys]
    task = adapter.submit_store_task(keys[:2], [obj(t) for t in data[:2]])
    wait(adapter.get_store_event_fd())
    done = adapter.pop_completed_store_tasks()
    assert done[task].is_successful()
    task = adapter.submit_lookup_and_lock_task(keys, {})
    wait(adapter.get_lookup_and_lock_event_fd())
    bits = adapter.query_lookup_and_lock_result(task)
    assert bits is not None and adapter.query_lookup_and_lock_result(task) is None  # once
    assert [bits.test(i) for i in range(3)] == [True, True, False]
    assert adapter.store.usage()["pinned"] == 2  # locked: eviction must skip them
    outs = [torch.zeros(2, 256, 64, dtype=torch.bfloat16) for _ in keys]
    task = adapter.submit_load_task(keys, [obj(t) for t in outs])
    wait(adapter.get_load_event_fd())
    loaded = adapter.query_load_result(task)
    assert [loaded.test(i) for i in range(3)] == [True, True, False]
    assert torch.equal(outs[0], data[0]) and torch.equal(outs[1], data[1])
    adapter.submit_unlock(keys[:2])
    adapter.close()
    with KVStore(str(mounted.path), "lmc") as kv:
        assert kv.usage()["pinned"] == 0 and kv.usage()["chunks"] == 2

"""The vLLM offloading tier, driven through vLLM's own spec factory and tiering manager.

Skips without vLLM (not in the test extras); `make test` runs it again in the engines'
virtualenv (tools/install_engines.sh), where nothing may skip.  vLLM's manager runs on
the CPU: its offload region is a real /dev/shm mmap, the rows a GPU worker would fill
are written by the test.
"""

from __future__ import annotations

import copy
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Mounted, eventually

try:  # each test skips without vLLM (see the fixture below)
    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from mxfs.kv.adapters.vllm import MxfsOffloadingSpec, MxfsTier, storage_run
except ImportError:
    pass

from mxfs.kv import KVStore
from mxfs.kv.keys import vllm_hashes


@pytest.fixture(autouse=True)
def _vllm() -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.base")


LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))


def offload_config(extra: dict[str, Any], *, chunks: int = 8, worker_bytes: int = 8192,
                   world: int = 2, tp: int = 2, pp: int = 1, pcp: int = 1, dcp: int = 1,
                   rank: int = 0, agnostic: bool = True, replicated: bool = False,
                   model: str = "Qwen/Qwen3-0.6B", dtype: str = "bfloat16",
                   groups: tuple[OffloadingGroupConfig, ...] | None = None,
                   tokens_per_hash: int = 16, blocks_per_chunk: int = 1,
                   canonical: bool = False, layout: str | None = None) -> OffloadingConfig:
    """What vLLM's build_offloading_config hands a spec, for a small CPU region."""
    row = -(-worker_bytes * (1 if replicated else world) * blocks_per_chunk // 4096) * 4096
    return OffloadingConfig(
        groups=groups or (OffloadingGroupConfig(16, LAYERS, 0),),
        worker_kv_bytes_per_block=worker_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": row * chunks, **extra},
        engine_id=f"mxfs-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(tokens_per_hash, blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank, world, tp, pp, pcp, dcp, 0, 1, None, agnostic),
        replicated_layout=replicated, canonical_layout=canonical, kv_cache_layout=layout)


def mxfs_extra(mounted: Mounted, **tier: Any) -> dict[str, Any]:
    return {"spec_name": "MxfsOffloadingSpec", "spec_module_path": "mxfs.kv.adapters.vllm",
            "mxfs": {"mount": str(mounted.path), "namespace": "vllm", **tier}}


class Engine:
    """One serving instance's scheduler side: vLLM's spec and tiering manager."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager: Any = self.spec.get_manager()
        self.region = self.spec._scheduler_mmap
        self.mmap = self.region.mmap_obj
        self.row = self.spec.kv_bytes_per_chunk
        [self.tier] = self.manager.secondary_tiers

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def idle(self) -> bool:
        self.step()
        return not self.manager.has_pending_work()

    def store(self, keys: list[bytes], rows: list[bytes]) -> None:
        """As a request that computed these chunks: GPU -> CPU rows, then vLLM cascades."""
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            for chunk, data in zip(out.store_spec.chunk_ids, rows, strict=True):
                flat[int(chunk) * self.row:int(chunk) * self.row + len(data)] = data
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        assert eventually(self.idle)

    def lookup(self, keys: list[bytes]) -> list[LookupResult]:
        """Each key's lookup once vLLM stops saying "retry" (promotions done)."""
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(ctx)
        found: list[LookupResult] = []

        def settled() -> bool:
            found[:] = [self.manager.lookup(k, ctx) for k in keys]
            self.step()
            return all(r in (LookupResult.HIT, LookupResult.MISS) for r in found)

        assert eventually(settled)
        self.manager.on_request_finished(ctx)
        return found

    def load(self, keys: list[bytes]) -> list[bytes]:
        """The rows of keys vLLM's manager holds (hits), as a GPU load would read them."""
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(ctx)
        spec = self.manager.prepare_load(keys, ctx)
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            rows = [bytes(flat[int(c) * self.row:(int(c) + 1) * self.row])
                    for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        self.manager.on_request_finished(ctx)
        return rows

    def shutdown(self) -> None:
        self.manager.shutdown()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        if not e.mmap.closed:
            e.shutdown()


def offload_keys(n: int, salt: int = 0) -> list[bytes]:
    return [make_offload_key(h, 0) for h in vllm_hashes(list(range(salt, salt + 16 * n)))]


def rows_of(n: int, size: int, seed: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)] if seed else [bytes(size)] * n


def test_vllm_block_hashes_equal_the_engines_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    for seed in (None, "0", ""):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        kv_cache_utils.init_none_hash(sha256)
        tokens = [(i * 31) % 50000 for i in range(16 * 5 + 7)]
        want, parent = [], None
        for i in range(0, len(tokens) - 15, 16):
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i:i + 16])
            want.append(bytes(parent))
        assert vllm_hashes(tokens) == want, seed


def test_vllm_chunk_names_are_the_fs_tiers_file_names() -> None:
    from vllm.v1.kv_offload.file_mapper import FileMapper

    two_groups = (OffloadingGroupConfig(16, LAYERS, 0),
                  OffloadingGroupConfig(32, ("model.layers.2.mamba",), 1))
    cases: list[dict[str, Any]] = [
        dict(),                                                   # TP=2, head-sharded
        dict(agnostic=False),                                     # per-topology bytes
        dict(agnostic=False, tp=4, world=4),
        dict(agnostic=False, tp=2, pp=2, world=4, rank=3),        # pipeline stages
        dict(agnostic=False, pcp=2, world=4),                     # prefill CP
        dict(agnostic=False, dcp=2, world=2, tp=2),               # decode CP
        dict(agnostic=False, replicated=True, tp=4, world=4),     # MLA, one copy
        dict(model="meta-llama/Llama-3.1-8B"),
        dict(dtype="float8_e4m3fn"),
        dict(blocks_per_chunk=4),
        dict(tokens_per_hash=32),
        dict(agnostic=False, groups=two_groups),
        dict(canonical=True, layout="LBNHC"),
        dict(canonical=True, layout="LBHNC"),
        dict(layout="NHD"),  # (the device's layout as it is: named, where FileMapper's
        dict(layout="HND"),  # names leave it out and two layouts shared chunks)
    ]
    key = make_offload_key(vllm_hashes(list(range(32)))[1], 3)
    names = set()
    for fields in cases:
        spec = MxfsOffloadingSpec(offload_config({"mxfs": {"mount": "/nowhere"}}, **fields))
        ref = FileMapper.from_offloading_spec("vllm", spec, blocks_per_file=spec.blocks_per_chunk,
                                              parallel_agnostic=True)
        run = storage_run(spec)
        if "layout" in fields and not fields.get("canonical"):
            assert run.fields() == {**ref.get_run_config(),
                                    "kv_cache_layout": fields["layout"]}, fields
        else:
            assert run.name(key) == ref.get_file_name(key), fields
            assert run.fields() == ref.get_run_config(), fields
        names.add(run.name(key))
    assert len(names) == len(cases)  # no two of these runs share a chunk


def test_vllm_spec_leaves_the_callers_config_as_it_was() -> None:
    extra: dict[str, Any] = {
        "mxfs": {"mount": "/nowhere", "namespace": "v"},
        "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
        "secondary_tiers": [{"type": "example", "backpressure": {}}]}
    config = offload_config(extra)  # its extra_config: vLLM's own dict, as given
    before = copy.deepcopy(config.extra_config)
    spec = MxfsOffloadingSpec(config)
    assert [t["type"] for t in spec.secondary_tier_configs] == ["example", "MxfsTier"]
    assert spec.secondary_tier_configs[1]["backpressure"] == extra["backpressure"]  # resolved
    MxfsOffloadingSpec.build_metric_definitions(config.extra_config)
    assert config.extra_config == before


def test_vllm_shutdown_closes_the_shared_offload_region(mounted: Mounted,
                                                        engines: list[Engine]) -> None:
    """vLLM closes the region's mmap after the tiers: a view the tier kept made that
    fail with "BufferError: cannot close exported pointers exist" (logged, mmap leaked)."""
    engine = Engine(offload_config(mxfs_extra(mounted)))
    engines.append(engine)
    keys = offload_keys(2)
    engine.store(keys, rows_of(2, engine.row, 1))
    with KVStore(str(mounted.path), "vllm") as kv:
        assert kv.usage()["chunks"] == 2
    engine.shutdown()
    assert engine.mmap.closed
    assert not os.path.exists(engine.region.mmap_path)


def test_vllm_chunks_move_between_engines_through_the_pool(mounted: Mounted,
                                                           engines: list[Engine]) -> None:
    from vllm.v1.kv_offload.file_mapper import FileMapper

    first = Engine(offload_config(mxfs_extra(mounted), worker_bytes=256 << 10))  # direct puts
    engines.append(first)
    keys = offload_keys(5)
    rows = rows_of(3, first.row, 1)
    first.store(keys[:3], rows)
    ref = FileMapper.from_offloading_spec("vllm", first.spec, blocks_per_file=1,
                                          parallel_agnostic=True)
    with KVStore(str(mounted.path), "vllm") as kv:  # stored under the fs tier's names
        assert kv.exists_many([ref.get_file_name(k) for k in keys]) == [True] * 3 + [False] * 2

    second = Engine(offload_config(mxfs_extra(mounted), worker_bytes=256 << 10))
    engines.append(second)
    assert second.lookup(keys) == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 2
    assert second.load(keys[:3]) == rows  # promoted from mxfs into its own CPU rows

    other = Engine(offload_config(mxfs_extra(mounted), worker_bytes=128 << 10, tp=4,
                                  world=4, agnostic=False))
    engines.append(other)
    assert other.lookup(keys[:1]) == [LookupResult.MISS]  # another topology's bytes
    for engine in engines:
        engine.shutdown()
        assert engine.mmap.closed


def test_vllm_reports_only_the_hits_that_read_faster_than_they_compute(
        mounted: Mounted, engines: list[Engine]) -> None:
    """With the instance's prefill rate given, a request's lookups report the hit chunks
    that the pool, at the rate this tier's loads measured, delivers faster than the
    instance computes them: all of them for a slow instance, none for one that computes
    faster than anything reads (but one in 16 lookups, to see the pool again); every hit
    before a load measured the pool; a key past the request's first miss is untouched;
    a rate that is not one is refused."""
    from mxfs.kv.reuse_policy import PROBE_EVERY

    keys = offload_keys(4, salt=900)
    writer = Engine(offload_config(mxfs_extra(mounted)))
    engines.append(writer)
    writer.store(keys, rows_of(4, writer.row, 1))
    lost, late = offload_keys(1, salt=999)[0], keys[3]  # a miss, then a hit after it

    def ask(tier: MxfsTier, asked: list[bytes], first_chunk: int) -> list[bool]:
        """The tier's verdicts on `asked`, the chunks of one request from `first_chunk`
        (the ones before it held by vLLM's own tiers)."""
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        for i, k in enumerate(asked):
            ctx.set_offload_key_position(k, (first_chunk + i + 1) * 16)
        return list(tier._lookups.batch_lookup(asked, ctx))

    seen = {}
    for name, rate in (("slow", 1e-3), ("fast", 1e15)):
        engine = Engine(offload_config(mxfs_extra(mounted, prefill_tokens_per_s=rate)))
        engines.append(engine)
        assert ask(engine.tier, keys[:3], 0) == [True] * 3  # the pool not measured yet
        assert engine.lookup(keys) == [LookupResult.HIT] * 4  # promoted: loads measure it
        seen[name] = [ask(engine.tier, keys[1:3] + [lost, late], 1)
                      for _ in range(PROBE_EVERY)]
    assert seen["slow"] == [[True, True, False, True]] * PROBE_EVERY
    assert seen["fast"] == [[False, False, False, True]] * (PROBE_EVERY - 1) + \
        [[True, False, False, True]]
    for bad in ("fast", 0, -5, float("inf")):
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            Engine(offload_config(mxfs_extra(mounted, prefill_tokens_per_s=bad)))


def test_vllm_errors_are_failed_jobs_and_misses(mounted: Mounted, engines: list[Engine],
                                                tmp_path: Any) -> None:
    with pytest.raises(OSError, match="not on an mxfs mount"):  # refused at start
        OffloadingSpecFactory.create_spec(offload_config(
            {**mxfs_extra(mounted), "mxfs": {"mount": str(tmp_path)}})).get_manager()

    full = Engine(offload_config(mxfs_extra(mounted, namespace="small", capacity=4096)))
    engines.append(full)
    tier: MxfsTier = full.tier
    ctx = ReqContext(req_id="r")
    keys = offload_keys(2)
    tier.submit_store(TransferJob(101, keys, [0, 1], False, ctx))  # chunks over the capacity
    tier.drain_jobs()
    [result] = tier.get_finished_jobs()
    assert (result.job_id, result.success, result.successful_keys) == (101, False, ())

    engine = Engine(offload_config(mxfs_extra(mounted)))
    engines.append(engine)
    engine.store(keys, rows_of(2, engine.row, 1))
    mounted.umount()  # the pool goes away under a running engine
    engine.tier.submit_load(TransferJob(102, keys, [4, 5], True, ctx))
    engine.tier.drain_jobs()
    [result] = engine.tier.get_finished_jobs()
    assert (result.success, result.successful_keys) == (False, ())
    assert engine.lookup(offload_keys(1, salt=7)) == [LookupResult.MISS]
    mounted.remount()  # back: the tier connects again
    engine.tier.submit_load(TransferJob(103, keys, [4, 5], True, ctx))
    engine.tier.drain_jobs()
    [result] = engine.tier.get_finished_jobs()
    assert result.success and result.successful_keys is None
    engine.shutdown()
    assert engine.mmap.closed

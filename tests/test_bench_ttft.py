"""mxfs bench ttft: a real model's KV reused across instance processes through the pool.

Tiny models and short contexts: each test checks behaviour (tokens equal recompute,
what came from the pool, what was never used), never durations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HAVE_FUSE,
    Mounted,
    eventually,
    force_unmount,
    make_members,
    mkfs,
    mxfs,
    one_line_error,
)

from mxfs.bench import gates, instances, reuse, serving
from mxfs.bench.lm import LAYOUT
from mxfs.bench.report import markdown, predict
from mxfs.bench.tier import chunk_keys
from mxfs.kv import KVStore
from mxfs.kv.ttft import MODELS, load_s, reuse_s
from mxfs.proc import python_module

pytest.importorskip("transformers")
needs_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="needs root and /dev/fuse")
TINY = instances.Spec(size="tiny", namespace="bench-test")
CHUNK = TINY.chunk_tokens


def noop(*_: object) -> bool:
    return True


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    if not HAVE_FUSE:
        pytest.skip("needs root and /dev/fuse")
    members = make_members(tmp_path_factory.mktemp("bench"))
    mkfs(members)
    mp = Path(tempfile.mkdtemp(prefix="mxfs-bench-mnt-"))
    mxfs("mount", members[0], str(mp))
    try:
        yield Mounted(mp, members)
    finally:
        force_unmount(str(mp))
        os.rmdir(mp)


@pytest.fixture(scope="module")
def pair(pool: Mounted, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[list[instances.Instance]]:
    """Two instance processes of the tiny model on the pool."""
    logs = str(tmp_path_factory.mktemp("logs"))
    insts = instances.start(TINY, 2, str(pool.path), logs, threads=1, max_tokens=2048)
    yield insts
    for i in insts:
        i.close()


def serve(inst: instances.Instance, tokens: list[int], **flags: object) -> dict:
    return inst.call("serve", tokens=tokens, new_tokens=6,
                     **{"read": False, "put": False, "local": False, **flags})


def keys_of(inst: instances.Instance, tokens: list[int], spec: instances.Spec = TINY
            ) -> list[bytes]:
    return chunk_keys(tokens, inst.hello.result()["model_id"], spec.dtype, LAYOUT,
                      spec.chunk_tokens)


# ---- the model, in this process ---------------------------------------------------------

def test_cache_rebuilt_from_chunks_gives_the_tokens_of_a_full_prefill() -> None:
    from mxfs.bench.lm import build

    lm = build("qwen2", "tiny", seed=3)
    tokens = reuse.prompt(1, 3 * CHUNK + 40, lm.size.vocab)
    full = lm.new_cache()
    want = lm.decode(lm.step(tokens, full), full, 5)
    chunks = lm.chunks_of(full, 0, 3, CHUNK)
    assert [tuple(c.shape) for c in chunks] == [lm.chunk_shape(CHUNK)] * 3
    assert all(c.numel() * c.element_size() == lm.kv_bytes_per_token() * CHUNK for c in chunks)
    again = lm.cache_from_chunks(chunks)
    assert lm.decode(lm.step(tokens[3 * CHUNK:], again), again, 5) == want
    assert build("qwen2", "tiny", seed=3).model_id == lm.model_id  # same weights, same id
    assert build("qwen2", "tiny", seed=4).model_id != lm.model_id


def test_keys_name_model_dtype_layout_and_chunk_size() -> None:
    tokens = list(range(1024))
    base = chunk_keys(tokens, "m", "float32", LAYOUT, 256)
    assert len(base) == 4 and base == chunk_keys(tokens, "m", "float32", LAYOUT, 256)
    for other in (chunk_keys(tokens, "m2", "float32", LAYOUT, 256),
                  chunk_keys(tokens, "m", "bfloat16", LAYOUT, 256),
                  chunk_keys(tokens, "m", "float32", "token-layer", 256),
                  chunk_keys(tokens, "m", "float32", LAYOUT, 128)):
        assert not set(other) & set(base)
    # chained: a different first token changes every later key
    assert not set(chunk_keys([1, *tokens[1:]], "m", "float32", LAYOUT, 256)) & set(base)


def test_ttft_model_prefix_then_rest_costs_what_all_at_once_does() -> None:
    m = MODELS["qwen2.5-32b"]
    for n, c in ((4096, 1024), (131072, 131000)):
        assert m.prefill_flops(c) + m.prefill_flops(n, c) == pytest.approx(m.prefill_flops(n))
        assert reuse_s(m, n, c, 5.0, 1e15, 0.5, 0.01) == pytest.approx(
            load_s(m, c, 5.0, 0.01) + m.prefill_flops(n, c) / 5e14)


def test_ttft_model_tool_models_the_benchs_model(tmp_path: Path) -> None:
    desc = tmp_path / "model.json"
    desc.write_text(json.dumps({"name": "tiny", "layers": 2, "heads": 2, "kv_heads": 2,
                                "head_dim": 64, "active_params": 4e5, "dtype_bytes": 4,
                                "source": "test"}))
    tool = Path(__file__).resolve().parent.parent / "tools" / "ttft_model.py"
    res = subprocess.run([sys.executable, str(tool), "--model-json", str(desc), "--json",
                          "--tail", "64", "--pool-gbps", "1", "--lengths", "1024"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(res.stdout)["tiny"]["rows"]
    assert len(rows) == 1 and "reuse_s@1GB/s" in rows[0]
    bad = subprocess.run([sys.executable, str(tool), "--model-json", str(tmp_path / "no")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


# ---- instances on a pool ----------------------------------------------------------------

@needs_fuse
def test_cold_instance_gets_the_prefix_and_tokens_equal_recompute(
        pair: list[instances.Instance]) -> None:
    res = reuse.run(pair[0], pair[1], [2 * CHUNK, 4 * CHUNK + 10], 1, 6, noop, noop, seed=1)
    assert res["tokens_equal"]
    for row in res["rows"]:
        whole = row["context"] // CHUNK * CHUNK
        assert row["pool_tokens"] == whole and row["put_refused"] == 0
        assert 0 <= row["policy_pool_tokens"] <= whole
        assert row["computed_tokens"] == row["prompt_tokens"] - whole
        assert row["read_bytes"] == whole * pair[0].hello.result()["kv_bytes_per_token"]
        part = row["partial"]
        assert part["tokens_equal"]  # reading every hit and with the policy alike
        assert part["pool_tokens"] == part["shared_tokens"] // CHUNK * CHUNK
        assert 0 <= part["policy_pool_tokens"] <= part["pool_tokens"]
        assert row["pool_failures"] == {}


@needs_fuse
def test_the_reuse_policy_reads_a_prefix_only_where_reading_beats_computing(
        pair: list[instances.Instance]) -> None:
    """With the policy on, an instance reads the pool's chunks of a prefix when the pool
    is fast and none when it is slow (its rate pinned, as for a throttled pool), and the
    tokens are a recompute's either way."""
    a, b = pair
    tokens = reuse.prompt(7, 4 * CHUNK + 30, a.hello.result()["vocab"])
    ref = serve(a, tokens, put=True)
    assert b.call("calibrate", lengths=[CHUNK, 4 * CHUNK])["seconds_per_flop"] > 0
    try:
        assert b.call("pool_rate", read_bps=1.0)["read_bps"] == 1.0  # 1 byte/s
        slow = serve(b, tokens, read=True, policy=True)
        assert slow["pool_tokens"] == 0 and slow["read_chunks_planned"] == 0
        assert slow["computed_tokens"] == len(tokens)
        b.call("pool_rate", read_bps=1e15)
        fast = serve(b, tokens, read=True, policy=True)
        assert fast["pool_tokens"] == 4 * CHUNK
        assert slow["tokens"] == fast["tokens"] == ref["tokens"]
    finally:
        b.call("pool_rate", read_bps=0)  # measured again, for the next test
    assert serve(b, tokens, read=True)["pool_tokens"] == 4 * CHUNK  # without it: every hit


@needs_fuse
def test_corrupted_chunk_is_recomputed_never_used(pool: Mounted,
                                                  pair: list[instances.Instance]) -> None:
    a, b = pair
    tokens = reuse.prompt(2, 4 * CHUNK + 30, a.hello.result()["vocab"])
    want = serve(a, tokens, put=True)
    assert want["put_chunks"] == 4
    keys = keys_of(a, tokens)
    with KVStore(str(pool.path), TINY.namespace) as kv:
        second = kv.get(keys[1])
    damaged = 0
    for dp, _, files in (w for m in pool.members for w in os.walk(os.path.join(m, "chunks"))):
        for name in files:
            with open(os.path.join(dp, name), "r+b") as f:
                if f.read(4096) == second[:4096]:
                    f.seek(100)
                    f.write(bytes([second[100] ^ 0xFF]))
                    os.fsync(f.fileno())
                    damaged += 1
    assert damaged == 1
    got = serve(b, tokens, read=True)
    assert got["pool_tokens"] == CHUNK  # chunk 0; chunk 1 failed its checksum
    assert got["computed_tokens"] == len(tokens) - CHUNK and got["tokens"] == want["tokens"]
    with KVStore(str(pool.path), TINY.namespace) as kv:
        assert kv.exists_many(keys) == [True, False, True, True]  # the bad one is dropped


@needs_fuse
def test_chunks_of_another_model_dtype_or_chunk_size_are_misses(
        pool: Mounted, pair: list[instances.Instance], tmp_path: Path) -> None:
    a = pair[0]
    tokens = reuse.prompt(3, 4 * CHUNK + 5, a.hello.result()["vocab"])
    assert serve(a, tokens, put=True)["put_chunks"] == 4
    others = [instances.Spec(size="tiny", seed=1, namespace=TINY.namespace),
              instances.Spec(size="tiny", dtype="bfloat16", namespace=TINY.namespace),
              instances.Spec(size="tiny", chunk_tokens=128, namespace=TINY.namespace)]
    started = [instances.Instance(python_module("mxfs.bench.instance")
                                  + s.argv(str(pool.path), 1, 0, 2048),
                                  str(tmp_path / f"o{i}.log"), f"o{i}")
               for i, s in enumerate(others)]  # all three build their models at once
    try:
        for inst in started:
            inst.hello.result(300)
        for inst in started:
            own = serve(inst, tokens)
            got = serve(inst, tokens, read=True)
            assert got["looked_up"] > 0 and got["pool_tokens"] == 0  # looked up, all misses
            assert got["tokens"] == own["tokens"]
    finally:
        for inst in started:
            inst.close()


STALL = r"""
import os, sys, time
from mxfs.client import control
real = control.ControlClient.call_many
def call_many(self, requests, *a, **k):
    if requests and requests[0][0] == "kv_commit":
        # two chunks published, the rest written and never committed
        done = real(self, requests[:2], *a, **k)
        open(os.environ["STALLED"], "w").close()
        time.sleep(600)
    return real(self, requests, *a, **k)
control.ControlClient.call_many = call_many
from mxfs.bench.instance import main
sys.exit(main(sys.argv[1:]))
"""


@needs_fuse
def test_instance_killed_while_putting_leaves_nothing_partial(
        pool: Mounted, pair: list[instances.Instance], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    tokens = reuse.prompt(4, 6 * CHUNK + 20, a.hello.result()["vocab"])
    want = serve(a, tokens)
    marker = tmp_path / "stalled"
    monkeypatch.setenv("STALLED", str(marker))
    [putter] = instances.start(TINY, 1, str(pool.path), str(tmp_path), threads=1,
                               max_tokens=2048, prefix="putter",
                               cmd=[sys.executable, "-P", "-c", STALL])
    putter.submit("serve", tokens=tokens, new_tokens=6, read=False, put=True, local=False)
    assert eventually(marker.exists, 120)
    putter.kill()  # SIGKILL, mid-put
    with KVStore(str(pool.path), TINY.namespace) as kv:
        assert kv.exists_many(keys_of(a, tokens)) == [True, True] + [False] * 4
    got = serve(b, tokens, read=True)
    assert got["pool_tokens"] == 2 * CHUNK and got["tokens"] == want["tokens"]


@needs_fuse
def test_serving_reuses_across_instances_and_tokens_equal_without_pool(
        pair: list[instances.Instance]) -> None:
    mix = serving.Mix(systems=2, queries_per_system=3, system_tokens=2 * CHUNK,
                      conversations=2, turns=3, document_tokens=CHUNK, turn_tokens=CHUNK,
                      query_tokens=20)
    reqs = serving.workload(mix, pair[0].hello.result()["vocab"], seed=5)
    assert {r.kind for r in reqs} == {"system", "turn"} and len(reqs) == 12
    for inst in pair:
        inst.call("configure", threads=1, local_tokens=CHUNK)
    try:
        res = serving.run(pair, reqs, [1, 3], 4, lambda: None, noop, repeat=2)
    finally:
        for inst in pair:
            inst.call("configure", threads=1, local_tokens=0)
    assert res["tokens_equal"] and len(res["rounds"]) == 8 and len(res["runs"]) == 4
    for run in res["runs"]:
        assert run["rounds"] == 2 and run["served"] == 12 and not run["errors"]
        assert (run["pool_hit_rate"] > 0) == run["pool"]
        assert run["put_refused"] == 0 and run["pool_failures"] == {}
    # turns wait for the turn before them: each turn's prompt extends the last one's
    by = {r.rid: r for r in reqs}
    assert all(by[r.after].tokens == r.tokens[:len(by[r.after].tokens)]
               for r in reqs if r.after is not None)


@needs_fuse
def test_instances_missing_one_prompt_at_once_compute_it_once(
        pair: list[instances.Instance]) -> None:
    """The same long prompt sent to both instances at once: one claims its chunks and
    computes them, the other waits for its puts and reads them (`kv_claims`), so the
    prompt's chunks are computed once between them, and both answer the same tokens."""
    import random
    rng = random.Random(11)
    vocab = pair[0].hello.result()["vocab"]
    tokens = [rng.randrange(vocab) for _ in range(12 * CHUNK + 5)]
    whole = 12 * CHUNK
    futures = [inst.submit("serve", tokens=tokens, new_tokens=6, read=True, put=True,
                           local=False) for inst in pair]
    got = [f.result(timeout=600) for f in futures]
    assert got[0]["tokens"] == got[1]["tokens"]
    computed = sorted(g["computed_tokens"] for g in got)
    assert computed == [len(tokens) - whole, len(tokens)], got
    assert sorted(g["pool_tokens"] for g in got) == [0, whole]
    assert sum(g["put_chunks"] for g in got) == whole // CHUNK


@needs_fuse
def test_pool_unmounted_mid_run_instances_recompute_and_go_on(
        mounted: Mounted, tmp_path: Path) -> None:
    [inst] = instances.start(TINY, 1, str(mounted.path), str(tmp_path), threads=1,
                             max_tokens=2048)
    try:
        vocab = inst.hello.result()["vocab"]
        prompts = [reuse.prompt(10 + i, 3 * CHUNK + 7, vocab) for i in range(3)]
        want = [serve(inst, p)["tokens"] for p in prompts]
        for p in prompts:
            serve(inst, p, put=True)
        before = serve(inst, prompts[0], read=True)
        assert before["pool_tokens"] == 3 * CHUNK
        mounted.umount()  # between two requests of a running instance
        replies = [serve(inst, p, read=True, put=True) for p in prompts]
        assert [r["tokens"] for r in replies] == want  # every request served, and right
        assert all(r["pool_failures"] and r["pool_tokens"] == 0 for r in replies)
        assert all(r["computed_tokens"] == len(p) for r, p in zip(replies, prompts,
                                                                   strict=True))
        lines = markdown(_result_with(replies))
        assert any("What went wrong with the pool" in line for line in lines)
    finally:
        inst.close()


@needs_fuse
def test_full_pool_refuses_puts_and_instances_serve_on(loop_pool: Mounted,
                                                       tmp_path: Path) -> None:
    try:  # files take the space KV would want (ENOSPC at a write, or at close)
        with open(loop_pool.path / "filler", "wb") as f:
            for _ in range(256):
                f.write(b"\0" * (1 << 20))
    except OSError as e:
        assert e.errno == 28
    [inst] = instances.start(TINY, 1, str(loop_pool.path), str(tmp_path), threads=1,
                             max_tokens=2048)
    try:
        tokens = reuse.prompt(20, 3 * CHUNK + 9, inst.hello.result()["vocab"])
        want = serve(inst, tokens)
        got = serve(inst, tokens, put=True)
        assert got["tokens"] == want["tokens"] and got["put_refused"] == 3
        assert "[Errno 28]" in got["pool_failures"]["put"]["first"]  # ENOSPC, said once
        again = serve(inst, tokens, read=True)  # nothing partial was stored either
        assert again["pool_tokens"] == 0 and again["tokens"] == want["tokens"]
        lines = markdown(_result_with([got, again]))
        assert any("3 chunk puts refused" in line for line in lines)
    finally:
        inst.close()


def _result_with(replies: list[dict]) -> dict:
    """A report's input holding these replies as one serving run."""
    run = serving._figures([serving.Request(i, "system", []) for i in range(len(replies))],
                           {i: {**r, "submitted_at": r["received_at"]}
                            for i, r in enumerate(replies)}, 0.0, 1, True, [])
    return {"command": "test", "pool": "test", "namespace": "n", "flops": 1e9,
            "threads": {"reuse": 1, "serving": 1}, "reuse": {"rows": [], "repeat": 1,
                                                            "question_tokens": 64},
            "model": {"arch": "llama", "size": "tiny", "seed": 0, "params": 1, "layer_params": 1,
                      "dtype": "float32", "device": "cpu", "kv_bytes_per_token": 1,
                      "chunk_tokens": 256, "chunk_bytes": 1 << 20, "model_id": "x",
                      "ttft_model": {"layers": 1, "heads": 1, "kv_heads": 1, "head_dim": 1}},
            "serving": {"runs": [run], "mix": vars(serving.Mix()), "instances": 1, "repeat": 1,
                        "kinds": {"system": len(replies), "turn": 0}, "local_tokens": 0,
                        "working_set_tokens": 0, "new_tokens": 6, "tokens_equal": True}}


# ---- the gates --------------------------------------------------------------------------

def _ttft(recompute: float, cold: float, rps: dict[tuple[int, bool], float],
          equal: bool = True) -> dict:
    row = {"context": 16384, "recompute_s": [recompute], "reuse_cold_s": [cold]}
    runs = [{"concurrency": c, "pool": p, "requests_per_s": v, "ttft_p50_s": 1.0,
             "errors": []} for (c, p), v in rps.items()]
    return {"reuse": {"rows": [row], "tokens_equal": equal},
            "serving": {"runs": runs, "tokens_equal": True}}


def test_g3_passes_on_the_thresholds_and_says_why_it_fails() -> None:
    good = {(8, False): 1.0, (8, True): 1.3, (16, False): 1.0, (16, True): 1.5}
    v = gates.g3(_ttft(10.0, 7.5, good))
    assert v["pass"], v["reasons"]
    v = gates.g3(_ttft(10.0, 8.0, good))
    assert not v["pass"] and "20% less (below the 25% asked)" in v["reasons"][0]
    v = gates.g3(_ttft(10.0, 1.0, {**good, (16, True): 1.2}))
    assert not v["pass"] and any("concurrency 16: +20%" in r for r in v["reasons"])
    v = gates.g3(_ttft(10.0, 1.0, good, equal=False))
    assert not v["pass"] and any("differed from recompute" in r for r in v["reasons"])
    only = gates.g3(_ttft(10.0, 1.0, {(1, False): 1.0, (1, True): 2.0}))
    assert only["pass"] and "concurrency 1" in only["reasons"][1]


def test_g2_against_a_baseline_and_g4_from_the_soak() -> None:
    run = {"median": {"striped_read": 1.0, "kv_get_mxfs": 0.8}, "repeat": 3}
    assert gates.g2(run)["pass"]
    v = gates.g2(run, {"median": {"striped_read": 1.0, "kv_get_mxfs": 1.0}}, 0.15)
    assert not v["pass"] and "kv_get_mxfs" in v["reasons"][0]
    assert not gates.g2({"median": {"striped_read": 0.0}, "repeat": 1})["pass"]
    assert gates.g4({"lost": 0, "problems": 0, "cycles": 2, "file_checks": 9}, 0, 0.5)["pass"]
    v = gates.g4({"lost": 1, "problems": 0}, 1, 0.5)
    assert not v["pass"] and "1 fsynced files" in v["reasons"][0]
    v = gates.g4(None, 1, 0.5, "mxfs mount failed: the daemon exited")
    assert not v["pass"] and v["reasons"] == [
        "tools/soak.py ended (1) without a report: mxfs mount failed: the daemon exited"]


# ---- the commands -----------------------------------------------------------------------

def test_bad_input_is_one_line(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    assert "unrecognized" in one_line_error(mxfs("bench", "ttft", "--out", out, "--bogus",
                                                 check=False))
    assert "not an mxfs mount" in one_line_error(
        mxfs("bench", "ttft", str(tmp_path), "--out", out, check=False))
    assert not os.path.exists(out)
    assert "--lengths" in one_line_error(
        mxfs("bench", "ttft", "--out", out, "--lengths", "1024,x", check=False))
    assert "--instances" in one_line_error(
        mxfs("bench", "ttft", "--out", out, "--instances", "1", check=False))
    assert "gates are g2, g3 and g4" in one_line_error(
        mxfs("bench", "gates", "--out", out, "--skip", "g5", check=False))


@needs_fuse
def test_bench_ttft_and_gates_write_their_reports(tmp_path: Path) -> None:
    small = ["--model-size", "tiny", "--lengths", "300,600", "--ttft-repeat", "1",
             "--requests", "8", "--concurrency", "1,2", "--local-tokens", "256",
             "--serving-repeat", "1"]
    out = tmp_path / "ttft"
    mxfs("bench", "ttft", "--out", str(out), *small, timeout=300)
    result = json.loads((out / "ttft.json").read_text())
    assert result["reuse"]["tokens_equal"] and result["serving"]["tokens_equal"]
    assert [r["pool_tokens"] for r in result["reuse"]["rows"]] == [256, 512]
    text = (out / "report.md").read_text()
    assert "## Reuse across instances" in text and "## Concurrency" in text
    assert "python tools/ttft_model.py --model-json" in text
    for png in ("ttft.png", "throughput.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    predict(result)  # predictions are there, and can be made again from the JSON
    assert all(r["predicted_recompute_s"] > 0 for r in result["reuse"]["rows"])

    gout = tmp_path / "gates"
    res = mxfs("bench", "gates", "--out", str(gout), "--skip", "g4", "--g2-size", "8MiB",
               "--g2-repeat", "1", *small, check=False, timeout=300)
    assert res.returncode == 1, res.stderr  # G4 was not run: the gates do not all pass
    verdicts = json.loads((gout / "gates.json").read_text())["verdicts"]
    assert verdicts["G2"]["pass"] and verdicts["G4"]["reasons"] == ["skipped (--skip)"]
    assert "TTFT at 600 tokens" in verdicts["G3"]["reasons"][0]
    report = (gout / "report.md").read_text()
    assert "| G3 |" in report and "(g3/ttft.png)" in report
    assert "| G4 | **not run** | skipped (--skip) |" in report
    assert (gout / "g2" / "report.md").exists() and (gout / "g3" / "ttft.png").exists()

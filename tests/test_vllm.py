"""vLLM's `--load-format mxfs`, in vLLM's CPU build: its options, its log line, and real
generation from a model in the mount equal to vLLM's default loader's.

Skips without vLLM (not in the test extras); `make test` runs this file again in the
engines' virtualenv (tools/install_engines.sh), where nothing here may skip.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch as st
import torch
from conftest import Mounted

from mxfs.errors import MxfsError
from mxfs.load.options import LoadOptions

GENERATE = r"""
import json, sys
from vllm import LLM, SamplingParams

def main() -> None:
    path, fmt, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=path, load_format=fmt, model_loader_extra_config=extra,
              skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              enforce_eager=True, max_num_seqs=2, gpu_memory_utilization=0.1)
    prompts = [{"prompt_token_ids": [1, 5, 9, 42, 7]}, {"prompt_token_ids": [3, 3, 100]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                detokenize=False))
    print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)

if __name__ == "__main__":
    main()
"""


def tiny_llama(folder: Path) -> None:
    """A random LLaMA (head_dim 64, as vLLM's CPU attention needs) in two shards with an
    index, as a hub checkpoint is laid out; made here, no hub."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    names = sorted(state)
    folder.mkdir(parents=True)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({n: state[n] for n in part}, str(folder / fname), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(str(folder))


def as_hf_cache(src: Path, root: Path) -> Path:
    """src's files as huggingface_hub caches them: blobs by hash, a snapshot of links."""
    repo = root / "models--org--tiny-llama"
    blobs, snap = repo / "blobs", repo / "snapshots" / "f00dcafe"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    return snap


def generate(path: Path, load_format: str, extra: dict[str, object]
             ) -> tuple[list[list[int]], str]:
    res = subprocess.run([sys.executable, "-c", GENERATE, str(path), load_format,
                          json.dumps(extra)], capture_output=True, text=True, timeout=600,
                         cwd="/", env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"})
    out = res.stdout + res.stderr
    tokens = [line for line in res.stdout.splitlines() if line.startswith("TOKENS ")]
    assert res.returncode == 0 and tokens, out[-4000:]
    return json.loads(tokens[-1][len("TOKENS "):]), out


def test_vllm_generates_the_same_tokens_from_the_mount(mounted: Mounted,
                                                       tmp_path: Path) -> None:
    pytest.importorskip("vllm.model_executor.model_loader")
    plain = tmp_path / "plain-model"
    tiny_llama(plain)
    snapshot = as_hf_cache(plain, mounted.path / "hub")
    want, _ = generate(plain, "auto", {})
    got, log = generate(snapshot, "mxfs", {"mode": "read"})
    assert got == want and all(len(t) == 12 for t in got)
    [line] = [x for x in log.splitlines() if "Loading weights through mxfs took" in x]
    size = sum(f.stat().st_size for f in plain.glob("*.safetensors"))
    assert "2 file(s), path read" in line and "GB/s" in line, line
    assert f"{size / 1e9:.2f} GB" in line, (line, size)  # the data bytes, within a header


def _loader(extra: object) -> object:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # finds mxfs through its vllm.general_plugins entry point
    return get_model_loader(LoadConfig(load_format="mxfs", model_loader_extra_config=extra))


def test_vllm_loader_options_from_extra_config_over_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm.model_executor.model_loader")
    monkeypatch.setenv("MXFS_ODIRECT", "never")
    monkeypatch.setenv("MXFS_LOAD_MODE", "stream")
    opts = _loader({"mode": "read", "staging": "1MiB"}).options  # type: ignore[attr-defined]
    assert opts == LoadOptions(mode="read", staging=1 << 20, odirect="never")
    assert _loader({}).options.mode == "stream"  # type: ignore[attr-defined]
    for bad, words in (({"modee": "read"}, "unknown mxfs load option(s) modee"),
                       ({"mode": "fast"}, "mode='fast' is not a choice"),
                       ({"staging": 12}, "is not a staging size")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            _loader(bad)


def test_vllm_load_format_mxfs_loads_a_model_folder(mounted: Mounted,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("vllm.model_executor.model_loader")
    folder = mounted.path / "tiny"
    folder.mkdir()
    weights = {"embed.weight": torch.randn(64, 32), "head.weight": torch.randn(32, 64)}
    st.save_file(weights, str(folder / "model.safetensors"))

    class Tiny(torch.nn.Module):  # what vLLM models offer its loaders: load_weights(iter)
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(32, 64, bias=False)
            self.head = torch.nn.Linear(64, 32, bias=False)

        def load_weights(self, named: object) -> set[str]:
            params = dict(self.named_parameters())
            done = set()
            for name, t in named:  # type: ignore[attr-defined]
                params[name].data.copy_(t)
                done.add(name)
            return done

    loader = _loader(None)
    vlog = logging.getLogger("vllm.model_executor.model_loader.mxfs")
    caplog.set_level(logging.INFO, logger=vlog.name)  # outside an engine vLLM sets none
    vlog.addHandler(caplog.handler)
    try:
        model = Tiny()
        loader.load_weights(model, SimpleNamespace(model=str(folder)))  # type: ignore[attr-defined]
    finally:
        vlog.removeHandler(caplog.handler)
    assert torch.equal(model.embed.weight, weights["embed.weight"])
    assert torch.equal(model.head.weight, weights["head.weight"])
    assert any("through mxfs took" in m and "path map" in m for m in caplog.messages), \
        caplog.messages
    with pytest.raises(RuntimeError, match="Cannot find any safetensors model weights"):
        loader.download_model(SimpleNamespace(model=str(mounted.path / "none")))  # type: ignore[attr-defined]
    os.unlink(folder / "model.safetensors")
    (folder / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}")  # a bad header
    with pytest.raises(RuntimeError, match="mxfs could not load the weights"):
        loader.load_weights(Tiny(), SimpleNamespace(model=str(folder)))  # type: ignore[attr-defined]


def test_load_options_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    assert LoadOptions.from_env({}) == LoadOptions()
    assert LoadOptions.from_env({"MXFS_STAGING": "8MiB", "MXFS_GDS": "off"}) == \
        LoadOptions(staging=8 << 20, gds="off")
    with pytest.raises(MxfsError, match="MXFS_LOAD_MODE='fast' is not a choice"):
        LoadOptions.from_env({"MXFS_LOAD_MODE": "fast"})
    with pytest.raises(MxfsError, match="MXFS_STAGING='lots' is not a staging size"):
        LoadOptions.from_env({"MXFS_STAGING": "lots"})

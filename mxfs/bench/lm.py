"""The model the bench serves: a transformers causal LM built from a config, no hub.

LLaMA or Qwen2 architecture with random weights from a fixed seed, so every process
(and every machine with the same torch and transformers) builds the same model
without downloading anything.  Its id names the weights themselves (an xxh3 of every
parameter as served): keys made from it can never hand one model's KV to another,
even if a library upgrade changed how weights are initialised.

Attention is transformers' SDPA, except for a prefill after a cached prefix on the CPU
(`prefix_attention`): SDPA's fast kernel takes only a square causal mask, so there
transformers builds an explicit mask and SDPA takes a path that made the prefill of
the second half of a 16k-token prompt cost more than the whole prompt; split into the
prefix (no mask) and the new tokens (square, causal), merged by their log-sum-exps, it
costs what the new tokens cost.

The KV cache is transformers' own `DynamicCache`.  A chunk of it, as the pool stores
it, is one contiguous tensor [layers, 2 (K, V), kv_heads, chunk_tokens, head_dim];
`LAYOUT` names that layout in the chunk keys.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from mxfs.errors import MxfsError
from mxfs.kv.ttft import Model

LAYOUT = "layer-kv-head-token-dim"
ARCHS = ("llama", "qwen2")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


# tiny: tests (a 512 KiB chunk of 256 tokens, so chunks take the direct path);
# small: the default here, sized so the whole bench runs in minutes on two CPU cores;
# base and large: ~60M and ~350M parameters, for a GPU or a patient CPU.
SIZES = {
    "tiny": Size(hidden=128, layers=2, heads=2, kv_heads=2, intermediate=256, vocab=512),
    "small": Size(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=8192),
    "base": Size(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, vocab=32000),
    "large": Size(hidden=1024, layers=24, heads=16, kv_heads=8, intermediate=2816,
                  vocab=32000),
}


def _torch() -> Any:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise MxfsError(f"mxfs bench ttft needs torch and transformers ({e.name} is missing)",
                        "pip install torch transformers") from None
    return torch


@dataclass
class LM:
    """A built model and what the chunk keys and the TTFT model need to know of it."""

    model: Any
    arch: str
    size_name: str
    size: Size
    dtype: str
    device: str
    model_id: str
    params: int
    layer_params: int  # parameters of the decoder layers: what each prompt token passes
    _cache_kw: str

    @property
    def head_dim(self) -> int:
        return self.size.hidden // self.size.heads

    def kv_bytes_per_token(self) -> int:
        return 2 * self.size.layers * self.size.kv_heads * self.head_dim * self.element_size()

    def element_size(self) -> int:
        return 2 if self.dtype in ("bfloat16", "float16") else 4

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, ...]:
        s = self.size
        return (s.layers, 2, s.kv_heads, chunk_tokens, self.head_dim)

    def ttft_model(self) -> Model:
        """This model as `mxfs.kv.ttft` describes one (its prediction of our TTFT)."""
        s = self.size
        return Model(f"{self.arch}-{self.size_name}", layers=s.layers, heads=s.heads,
                     kv_heads=s.kv_heads, head_dim=self.head_dim,
                     active_params=float(self.layer_params),
                     dtype_bytes=self.element_size(),
                     source=f"mxfs bench: {self.arch} built from a config, {asdict(s)}")

    # ---- running it ----------------------------------------------------------------

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def step(self, ids: list[int], cache: Any) -> int:
        """Feed `ids` after what `cache` holds; the greedy next token."""
        torch = _torch()
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: cache})
            return int(out.logits[0, -1].argmax())

    def decode(self, first: int, cache: Any, n: int) -> list[int]:
        """`first` and the n - 1 greedy tokens after it."""
        out = [first]
        while len(out) < n:
            out.append(self.step([out[-1]], cache))
        return out

    def cache_from_chunks(self, parts: list[Any]) -> Any:
        """A DynamicCache holding these chunks' KV in order (tensors of `chunk_shape`):
        one copy into each layer's K and V, on the model's device."""
        torch = _torch()
        cache = self.new_cache()
        if not parts:
            return cache
        layers, _, heads, t, d = parts[0].shape
        for layer in range(layers):
            k = torch.empty(1, heads, len(parts) * t, d, dtype=parts[0].dtype,
                            device=self.device)
            v = torch.empty_like(k)
            for i, p in enumerate(parts):
                k[0, :, i * t:(i + 1) * t].copy_(p[layer, 0])
                v[0, :, i * t:(i + 1) * t].copy_(p[layer, 1])
            cache.update(k, v, layer)
        return cache

    def chunks_of(self, cache: Any, first: int, last: int, chunk_tokens: int) -> list[Any]:
        """Chunks first..last-1 of the cache as contiguous CPU tensors of `chunk_shape`."""
        torch = _torch()
        if last <= first:
            return []
        lo, hi = first * chunk_tokens, last * chunk_tokens
        kv = torch.stack([torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]])
                          for k, v in _layers(cache)])  # [layers, 2, heads, hi - lo, d]
        kv = kv.cpu()
        return [kv[:, :, :, i:i + chunk_tokens].contiguous()
                for i in range(0, hi - lo, chunk_tokens)]


def _layers(cache: Any) -> list[tuple[Any, Any]]:
    """(keys, values) per layer: `layers` in transformers >= 4.56, the lists before."""
    if hasattr(cache, "layers"):
        return [(ly.keys, ly.values) for ly in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def fingerprint(model: Any) -> str:
    """xxh3-64 of every parameter and buffer, in name order, as the model serves them."""
    h = xxhash.xxh3_64()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(_torch().uint8).numpy().tobytes())
    return h.hexdigest()


ATTENTION = "mxfs_prefix_sdpa"


def prefix_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs: Any
                     ) -> tuple[Any, None]:
    """transformers' attention interface: SDPA, with a prefill after a cached prefix
    on the CPU done as two flash calls, the new tokens' queries against the prefix
    (nothing masked: it precedes them all) and against themselves (causal), merged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    prefix = kv_len - q_len
    if (query.device.type != "cpu" or query.shape[0] != 1 or q_len < 2 or prefix <= 0
            or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None
            or not _plain_causal(attention_mask, q_len, kv_len)):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    torch = _torch()
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old, old_lse = flash(query, key[:, :, :prefix], value[:, :, :prefix], 0.0, False,
                         scale=scaling)[:2]
    new, new_lse = flash(query, key[:, :, prefix:], value[:, :, prefix:], 0.0, True,
                         scale=scaling)[:2]
    top = torch.maximum(old_lse, new_lse)
    w_old = torch.exp(old_lse - top).unsqueeze(-1)
    w_new = torch.exp(new_lse - top).unsqueeze(-1)
    out = (old.float() * w_old + new.float() * w_new) / (w_old + w_new)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _plain_causal(mask: Any, q_len: int, kv_len: int) -> bool:
    """Is `mask` (boolean [1, 1, q, kv]) causal after a prefix, hiding nothing else (no
    padding)?  Its first and last rows say so for a mask transformers built for one
    unpadded sequence.  (None is not: with more keys than queries transformers means
    by it a static cache's empty tail, which SDPA's own path crops.)"""
    if mask is None:
        return False
    if mask.dtype != _torch().bool or tuple(mask.shape[-2:]) != (q_len, kv_len) \
            or mask.shape[0] != 1:
        return False
    first, last = mask[0, 0, 0], mask[0, 0, -1]
    prefix = kv_len - q_len
    return bool(last.all()) and bool(first[:prefix + 1].all()) \
        and not bool(first[prefix + 1:].any())


def build(arch: str = "llama", size: str = "small", seed: int = 0, dtype: str = "float32",
          device: str = "cpu", max_tokens: int = 65536) -> LM:
    """The model, its weights drawn from `seed` on the CPU, then moved and cast."""
    torch = _torch()
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise MxfsError(f"unknown architecture {arch!r}", f"choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise MxfsError(f"unknown model size {size!r}", f"choose one of {', '.join(SIZES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MxfsError(f"--device {device}: this torch sees no CUDA device", "use --device cpu")
    s = SIZES[size]
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    cfg = cls(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
              num_hidden_layers=s.layers, num_attention_heads=s.heads,
              num_key_value_heads=s.kv_heads, max_position_embeddings=max_tokens,
              tie_word_embeddings=False)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, prefix_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTENTION)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    return LM(model, arch, size, s, dtype, device, f"{arch}-{size}-{fingerprint(model)}",
              sum(p.numel() for p in model.parameters()), layer_params, kw)

"""When does loading KV cache beat recomputing it?  The analytical TTFT model.

For a prompt whose first n tokens are a cached prefix:
  KV bytes          = n x 2 (K and V) x layers x kv_heads x head_dim x dtype bytes
  recompute TTFT    = prefill FLOPs / (accelerator FLOP/s x utilisation)
      prefill FLOPs = 2 x active params x n  +  2 x layers x n^2 x (heads x head_dim)
  load TTFT         = KV bytes / storage bandwidth  +  fixed latency
and a prompt of n tokens whose first c are loaded costs the load of c plus the prefill
of the other n - c against them (`reuse_s`): 2 x active params x (n - c) + 2 x layers
x (n - c)(n + c) x heads x head_dim.  `tools/ttft_model.py` prints and plots it;
`mxfs demo` applies it to the bandwidth it measured; `mxfs bench ttft` sets it beside
TTFTs measured with a real model.  Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    active_params: float  # parameters used per token (all of them for a dense model)
    dtype_bytes: int
    source: str

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops(self, n: int, cached: int = 0) -> float:
        """FLOPs to prefill tokens `cached`..n-1 of a prompt whose first `cached` tokens'
        KV is at hand: the weights for each new token, and causal attention of each new
        token to every token before it (2 x 2 FLOPs per query-key pair and head dim)."""
        new = n - cached
        return 2 * self.active_params * new \
            + 2 * self.layers * new * (n + cached) * self.heads * self.head_dim


MODELS = {
    "qwen2.5-32b": Model(
        "Qwen2.5-32B", layers=64, heads=40, kv_heads=8, head_dim=128, active_params=32.5e9,
        dtype_bytes=2,
        source="huggingface.co/Qwen/Qwen2.5-32B-Instruct config.json: num_hidden_layers 64, "
               "num_attention_heads 40, num_key_value_heads 8, hidden_size 5120 (head_dim 128); "
               "32.5B parameters (model card)"),
    "qwen3-coder-480b": Model(
        "Qwen3-Coder-480B-A35B (MoE)", layers=62, heads=96, kv_heads=8, head_dim=128,
        active_params=35e9, dtype_bytes=2,
        source="huggingface.co/Qwen/Qwen3-Coder-480B-A35B-Instruct config.json: "
               "num_hidden_layers 62, num_attention_heads 96, num_key_value_heads 8, "
               "head_dim 128; 480B total, 35B activated per token (model card)"),
}

# H200 SXM dense BF16 tensor throughput (NVIDIA datasheet: 989 TFLOP/s without sparsity).
H200_FLOPS = 989e12


def recompute_s(m: Model, n: int, flops: float, util: float) -> float:
    return m.prefill_flops(n) / (flops * util)


def load_s(m: Model, n: int, gbps: float, latency: float) -> float:
    return m.kv_bytes_per_token() * n / (gbps * 1e9) + latency


def reuse_s(m: Model, n: int, cached: int, gbps: float, flops: float, util: float,
            latency: float) -> float:
    """TTFT of a prompt of n tokens whose first `cached` come from storage: load them,
    then prefill the rest against them."""
    return load_s(m, cached, gbps, latency) + m.prefill_flops(n, cached) / (flops * util)


def break_even_gbps(m: Model, n: int, flops: float, util: float) -> float:
    return m.kv_bytes_per_token() * n / recompute_s(m, n, flops, util) / 1e9

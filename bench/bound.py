"""The hardware bound of a decode step and of a prefill: bytes and FLOPs over GPU.md's ceilings.

Bytes per decode step at batch 1 (GPU.md "Bytes per decode step"): every weight a token touches
(qkvr, o_proj, router, shared experts in bf16; the routed experts it selects in NVFP4 at 0.5625 B
per weight, block scales included), the rows of the relative table E it reads, its KV, and lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

from inkling.config import InklingConfig

BANDWIDTH = 4.35e12  # B/s, GPU.md
TENSOR_FLOPS = 790e12  # bf16 FLOP/s, GPU.md
BF16 = 2
NVFP4 = 0.5625  # bytes per weight, block scales included


@dataclass(frozen=True)
class StepBytes:
    weights: float
    rel_embed: float
    kv: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.weights + self.rel_embed + self.kv + self.lm_head

    @property
    def seconds(self) -> float:
        return self.total / BANDWIDTH


def decode_step_bytes(
    c: InklingConfig, kv_len: int, distinct_experts: int | None = None, tp_size: int = 1
) -> StepBytes:
    """Bytes one decode step reads for one sequence with `kv_len` tokens of context, per GPU of `tp_size`
    (builder/sharding.py: heads, their KV and relative rows, every expert's I and lm_head's vocabulary
    rows split; the router replicated; KV heads replicated where there are fewer than ranks).

    distinct_experts: routed experts touched per layer (top-k for one token; more for a batch or an
    MTP verify step)."""
    H, I, n = c.hidden_size, c.moe_intermediate_size, tp_size
    experts = c.num_experts_per_tok if distinct_experts is None else distinct_experts
    attn = (c.qkvr_size * H + H * c.q_size) * BF16 / n
    router = c.num_router_outputs * H * BF16
    moe = (c.num_shared_experts * 3 * I * H * BF16 + experts * 3 * I * H * NVFP4) / n
    kv_split = min(n, c.num_key_value_heads)
    weights = rel = kv = 0.0
    for layer in range(c.num_hidden_layers):
        window = c.sliding_window if c.is_sliding(layer) else kv_len
        keys = min(kv_len, window)
        weights += attn + router + moe
        rel += c.num_attention_heads * min(keys, c.max_relative_distance) * c.rel_head_dim * BF16 / n
        kv += 2 * keys * c.kv_size * BF16 / kv_split
    return StepBytes(weights, rel, kv, -(-c.vocab_size // n) * H * BF16)


def expected_distinct_experts(c: InklingConfig, tokens: int) -> float:
    """Routed experts a layer touches for `tokens` tokens with distinct routing, if each picks its top-k
    uniformly: E · (1 − (1 − k/E)^tokens). Random synthetic routers come close to uniform; a trained router
    concentrates more, so this is an upper estimate."""
    E, k = c.num_routed_experts, c.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def decode_batch_seconds(c: InklingConfig, kv_len: int, batch: int) -> float:
    """The bound of one decode step of `batch` sequences with `kv_len` tokens of context each: the weights
    once (the routed experts of `expected_distinct_experts`), lm_head once, each sequence's KV and relative
    rows."""
    one = decode_step_bytes(c, kv_len, distinct_experts=round(expected_distinct_experts(c, batch)))
    return (one.weights + one.lm_head + batch * (one.rel_embed + one.kv)) / BANDWIDTH


def prefill_flops(c: InklingConfig, num_tokens: int) -> float:
    """Matrix FLOPs of a prefill of `num_tokens` (2 per multiply-add): the linears a token runs, the
    attention over its allowed keys, and its relative term r·E."""
    H, I, T = c.hidden_size, c.moe_intermediate_size, num_tokens
    per_token = 2 * (c.qkvr_size * H + H * c.q_size + c.num_router_outputs * H)
    per_token += 2 * 3 * I * H * (c.num_experts_per_tok + c.num_shared_experts)
    flops = c.num_hidden_layers * per_token * T
    for layer in range(c.num_hidden_layers):
        window = c.sliding_window if c.is_sliding(layer) else T
        pairs = sum(min(i + 1, window) for i in range(T)) if T <= 65536 else T * min(T, window)
        flops += pairs * c.num_attention_heads * (4 * c.head_dim + 2 * c.rel_head_dim)
    return flops + 2 * H * c.vocab_size  # lm_head for the last token

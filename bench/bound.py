"""The hardware bound of a decode step and of a prefill: bytes and FLOPs over GPU.md's ceilings.

Per layer a token reads its q/k/v/r and output projections, its layer's bank rows (X or the keys it sees,
at most), its KV (8 heads on full layers, 16 on sliding ones, at most 511 + 1 keys there), the router
(bf16 in the checkpoint) and the shared experts, its k routed experts (NVFP4 at 0.5625 B a weight, block
scales included, or BF16 in a layer the checkpoint keeps BF16) or the dense MLP; then the unembedding's
unpadded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inkling.published.config import InklingConfig

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
    """Bytes one decode step reads for one sequence with `kv_len` tokens of context, per
    GPU of `tp_size` (builder/tensor_parallel.py: query heads, every MLP's width and the unembedding's rows
    split; KV heads split, or replicated where there are fewer than ranks; the router and the relative
    banks whole). distinct_experts: routed experts touched per MoE layer (top-k for one token)."""
    t, n = c.text, tp_size
    H, I = t.hidden_size, t.moe_intermediate_size
    experts = t.num_experts_per_tok if distinct_experts is None else distinct_experts
    weights = rel = kv = 0.0
    for layer in range(t.num_hidden_layers):
        a = t.attention(layer)
        kv_split = min(n, a.num_kv_heads)
        keys = min(kv_len, a.window or kv_len)
        weights += ((a.q_size + a.r_size) * H + H * a.q_size) * BF16 / n + 2 * a.kv_size * H * BF16 / kv_split
        if t.is_dense(layer):
            weights += 3 * t.intermediate_size * H * BF16 / n
        else:
            routed = NVFP4 if c.experts_quantized(layer) else BF16
            weights += (t.n_routed_experts + t.n_shared_experts) * H * BF16  # the router
            weights += (t.n_shared_experts * 3 * I * H * BF16 + experts * 3 * I * H * routed) / n
        rel += a.d_rel * min(keys, a.rel_extent) * BF16
        kv += 2 * keys * a.kv_size * BF16 / kv_split
    return StepBytes(weights, rel, kv, -(-t.num_real_tokens // n) * H * BF16)


def expected_distinct_experts(c: InklingConfig, tokens: int) -> float:
    """Routed experts a MoE layer touches for `tokens` distinct tokens under uniform routing."""
    E, k = c.text.n_routed_experts, c.text.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def routed_distinct_experts(loads, top_k: int, tokens: int) -> float | None:
    """Routed experts a MoE layer is expected to touch for `tokens` tokens under a measured routing: loads
    [MoE layers, E], the tokens each expert received (runtime/expert_load.py). Each token picks expert e
    with probability top_k * e's share of the layer's picks, independently of the other tokens; the mean over
    the layers. Even loads give `expected_distinct_experts`. Shares pooled over many steps overstate a
    single step's spread where routing drifts between steps. None without loads."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or loads.sum() == 0:
        return None
    loads = loads[loads.sum(-1) > 0]
    pick = np.minimum(top_k * loads / loads.sum(-1, keepdims=True), 1.0)
    return float((1 - (1 - pick) ** tokens).sum(-1).mean())


def decode_batch_seconds(
    c: InklingConfig, kv_len: int, batch: int, distinct_experts: float | None = None
) -> float:
    """The bound of one decode step of `batch` sequences: the weights (the experts the batch touches: uniform
    routing's expectation, or `distinct_experts`) and the unembedding once, each sequence's KV and bank rows."""
    if distinct_experts is None:
        distinct_experts = expected_distinct_experts(c, batch)
    one = decode_step_bytes(c, kv_len, round(distinct_experts))
    return (one.weights + one.lm_head + batch * (one.rel_embed + one.kv)) / BANDWIDTH


def prefill_flops(c: InklingConfig, num_tokens: int) -> float:
    """Matrix FLOPs of a prefill of `num_tokens` (2 per multiply-add): its linears, the
    attention over each query's allowed keys (q·k and p·v per head) and its relative term (r·P over the
    keys within the extent), the unembedding of the last token."""
    t = c.text
    H, I, T = t.hidden_size, t.moe_intermediate_size, num_tokens
    flops = 0.0
    for layer in range(t.num_hidden_layers):
        a = t.attention(layer)
        per_token = 2 * ((a.q_size + 2 * a.kv_size + a.r_size) * H + H * a.q_size)
        if t.is_dense(layer):
            per_token += 2 * 3 * t.intermediate_size * H
        else:
            per_token += 2 * (t.n_routed_experts + t.n_shared_experts) * H
            per_token += 2 * 3 * I * H * (t.num_experts_per_tok + t.n_shared_experts)
        flops += per_token * T
        window = a.window or T
        pairs = T * (T + 1) // 2 if window >= T else window * (window + 1) // 2 + (T - window) * window
        near = min(a.rel_extent, T)
        rel_pairs = near * (near + 1) // 2 + (T - near) * near
        flops += a.num_heads * (pairs * 4 * a.head_dim + rel_pairs * 2 * a.d_rel)
    return flops + 2 * H * t.num_real_tokens

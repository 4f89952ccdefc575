"""The spec's model over a batch of equal-length sequences, differentiable, for training.

The reference (`inkling.model`) runs one sequence at a time and routes tokens expert by expert: the
numerical truth, but slow to train. This module computes the same math (INKLING_SPEC §3–§5) over
[B, T] with the reference's own parameters (an `InklingReference`, so the names are the checkpoint's),
computing every routed expert densely and weighting the unselected ones by zero: the same function,
and the same gradients, as the sparse form. `tests/unit/test_train.py` checks it against the
reference, logits and heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inkling import ops
from inkling.config import InklingConfig
from inkling.layers import Attention, DecoderLayer, ExpertSinkMoE, MTPHead, SwiGLU
from inkling.model import InklingReference
from inkling.synth import residual_scale


def new_model(config: InklingConfig, seed: int = 0, device: str | torch.device = "cpu") -> InklingReference:
    """A float32 model to train: embeddings N(0, 1), linears N(0, 1/in) with residual-branch outputs
    (o_proj, down_proj) scaled by 1/sqrt(2L) as in the synthetic checkpoints, norms 1, sconvs the identity
    plus a little history, the relative table small."""
    gen = torch.Generator().manual_seed(seed)
    model = InklingReference(config)
    residual = residual_scale(config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("rel_embed"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "sconv" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
                p[:, -1] = 1.0
            else:
                std = p.shape[-1] ** -0.5
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= residual
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(device).train()


def sconv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """§3.2 over [B, T, C] with a zero state."""
    K = weight.shape[1]
    T = x.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0))
    y = weight[:, 0] * xp[:, 0:T]
    for k in range(1, K):
        y = y + weight[:, k] * xp[:, k : k + T]
    return y


def attention(attn: Attention, x: torch.Tensor, window: int) -> torch.Tensor:
    """§3.1 over [B, T, H]: GQA with the relative term gathered by clipped distance."""
    B, T, _ = x.shape
    Hq, Hkv, D, Dr = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rel_head_dim
    q, k, v, r = (x @ attn.qkvr_proj.weight.T).split(attn.sizes, dim=-1)
    k = sconv(k, attn.sconv_k.weight)
    v = sconv(v, attn.sconv_v.weight)
    q = q.view(B, T, Hq, D).transpose(1, 2)  # [B, Hq, T, D]
    group = Hq // Hkv
    k = k.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(group, dim=1)
    r = r.view(B, T, Hq, Dr).transpose(1, 2)  # [B, Hq, T, Dr]
    R = attn.rel_embed.shape[1]
    pos = torch.arange(T, device=x.device)
    dist = (pos[:, None] - pos[None, :]).clamp(0, R - 1)  # [T, T]
    table = (r.float() @ attn.rel_embed.float().transpose(1, 2)[None]).float()  # [B, Hq, T, R]
    bias = torch.gather(table, 3, dist.expand(B, Hq, T, T))
    logits = (q.float() @ k.float().transpose(2, 3)) / math.sqrt(D) + bias
    allowed = ops.attention_mask(pos, pos, window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    o = (p.to(v.dtype) @ v).transpose(1, 2).reshape(B, T, Hq * D)
    return sconv(o @ attn.o_proj.weight.T, attn.sconv_o.weight)


def _swiglu_stack(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate = torch.stack([e.gate_proj.weight for e in experts])  # [E, I, H]
    up = torch.stack([e.up_proj.weight for e in experts])
    down = torch.stack([e.down_proj.weight.T for e in experts])  # [E, I, H]
    return gate, up, down


def _experts(x: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """Σ_e weights[:, e] * Expert_e(x) for x [N, H], weights [N, E] (zeros for unselected experts)."""
    gate, up, down = _swiglu_stack(experts)
    act = F.silu(torch.einsum("nh,eih->nei", x, gate)) * torch.einsum("nh,eih->nei", x, up)
    act = act * weights[:, :, None].to(act.dtype)
    return act.flatten(1) @ down.flatten(0, 1)  # [N, E*I] @ [E*I, H]


def moe(mlp: ExpertSinkMoE, x: torch.Tensor) -> torch.Tensor:
    """§3.3 over [B, T, H], every routed expert computed and the unselected ones weighted by 0."""
    B, T, H = x.shape
    flat = x.reshape(B * T, H)
    w_top, idx, p_shared = ops.route(flat, mlp.router.weight, mlp.num_routed, mlp.top_k)
    routed = torch.zeros(B * T, mlp.num_routed, device=x.device, dtype=w_top.dtype)
    routed = routed.scatter(1, idx, w_top)
    y = _experts(flat, p_shared, mlp.shared_experts).float() + _experts(flat, routed, mlp.experts).float()
    return sconv(y.to(x.dtype).view(B, T, H), mlp.sconv_m.weight)


def swiglu(mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return ops.swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def layer(block: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    h = x + attention(block.self_attn, block.input_layernorm(x), block.window)
    return h + moe(block.mlp, block.post_attention_layernorm(h))


def head(block: MTPHead, h_prev: torch.Tensor, e_next: torch.Tensor) -> torch.Tensor:
    """§5, one head over [B, T_m, H]."""
    u = torch.cat([block.hnorm(h_prev), block.enorm(e_next)], dim=-1) @ block.eh_proj.weight.T
    h = u + attention(block.self_attn, block.input_layernorm(u), 0)
    return h + swiglu(block.mlp, block.post_attention_layernorm(h))


def forward(model: InklingReference, ids: torch.Tensor, num_heads: int | None = None):
    """Text-only forward over ids [B, T]: main logits [B, T, V] and, per head m = 1..num_heads
    (default all), logits [B, T-m, V] whose row t predicts ids[:, t+m+1] (the last row has no target).
    Logits come out in the activation dtype; the loss takes them to float32."""
    e = model.model.embed_tokens(ids)
    x = e
    for block in model.model.layers:
        x = layer(block, x)
    lm_head = model.lm_head.weight
    logits = model.model.norm(x) @ lm_head.T
    heads = []
    h = x
    T = ids.shape[1]
    M = len(model.mtp) if num_heads is None else num_heads
    for m in range(1, M + 1):
        if T - m <= 0:
            break
        h = head(model.mtp[m - 1], h[:, : T - m], e[:, m:])
        heads.append(model.mtp[m - 1].final_layernorm(h) @ lm_head.T)
    return logits, heads

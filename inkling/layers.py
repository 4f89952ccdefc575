"""The decoder's building blocks as nn.Modules whose parameter names are the checkpoint's (§8).

Plain and readable first: each forward works on one sequence, [T, H], with no cache. The math
lives in `inkling.ops`; these modules hold weights and wire the math together.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import ops
from .config import InklingConfig


def linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class SConv(nn.Module):
    """Causal depthwise convolution over positions (§3.2); weight [C, K]."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, C]
        return ops.sconv(x, self.weight)


class Attention(nn.Module):
    """GQA attention with the learned relative term and the K, V and output sconvs (§3.1)."""

    def __init__(self, c: InklingConfig):
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rel_head_dim = c.rel_head_dim
        self.sizes = (c.q_size, c.kv_size, c.kv_size, c.r_size)
        self.qkvr_proj = linear(c.hidden_size, c.qkvr_size)
        self.o_proj = linear(c.q_size, c.hidden_size)
        self.rel_embed = nn.Parameter(
            torch.zeros(c.num_attention_heads, c.max_relative_distance, c.rel_head_dim)
        )
        self.sconv_k = SConv(c.kv_size, c.sconv_kernel_size)
        self.sconv_v = SConv(c.kv_size, c.sconv_kernel_size)
        self.sconv_o = SConv(c.hidden_size, c.sconv_kernel_size)

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:  # [T, H] -> [T, H]
        T = x.shape[0]
        q, k, v, r = self.qkvr_proj(x).split(self.sizes, dim=-1)
        k = self.sconv_k(k)
        v = self.sconv_v(v)
        o = ops.relative_attention(
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            r.view(T, self.num_heads, self.rel_head_dim),
            self.rel_embed,
            window,
        )
        return self.sconv_o(self.o_proj(o.reshape(T, -1)))


class SwiGLU(nn.Module):
    """An expert (routed or shared) or an MTP head's dense FFN: (silu(x Wg) * x Wu) Wd."""

    def __init__(self, hidden: int, inter: int, nvfp4: bool = False):
        super().__init__()
        if nvfp4:
            from .nvfp4 import NVFP4Linear

            self.gate_proj = NVFP4Linear(hidden, inter)
            self.up_proj = NVFP4Linear(hidden, inter)
            self.down_proj = NVFP4Linear(inter, hidden)
        else:
            self.gate_proj = linear(hidden, inter)
            self.up_proj = linear(hidden, inter)
            self.down_proj = linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertSinkMoE(nn.Module):
    """Routed top-k experts plus shared experts that take part in the softmax (§3.3)."""

    def __init__(self, c: InklingConfig):
        super().__init__()
        self.num_routed = c.num_routed_experts
        self.top_k = c.num_experts_per_tok
        nvfp4 = c.is_quantized
        self.router = linear(c.hidden_size, c.num_router_outputs)
        self.experts = nn.ModuleList(
            SwiGLU(c.hidden_size, c.moe_intermediate_size, nvfp4) for _ in range(c.num_routed_experts)
        )
        self.shared_experts = nn.ModuleList(
            SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_shared_experts)
        )
        self.sconv_m = SConv(c.hidden_size, c.sconv_kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        w_top, idx, p_shared = ops.route(x, self.router.weight, self.num_routed, self.top_k)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for s, expert in enumerate(self.shared_experts):
            y += p_shared[:, s : s + 1] * expert(x).float()
        # Each routed expert sees only its own tokens (and is never called with none), so hooks on
        # its linears observe exactly its inputs: calibration relies on this.
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y.index_add_(0, rows, w_top[rows, slot, None] * self.experts[e](x[rows]).float())
        return self.sconv_m(y.to(x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, c: InklingConfig, layer: int):
        super().__init__()
        self.window = c.sliding_window if c.is_sliding(layer) else 0
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = ExpertSinkMoE(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), self.window)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(nn.Module):
    """One MTP head (§5): a full-attention layer with a dense FFN over cat(h, e)."""

    def __init__(self, c: InklingConfig):
        super().__init__()
        H = c.hidden_size
        self.hnorm = RMSNorm(H, c.rms_norm_eps)
        self.enorm = RMSNorm(H, c.rms_norm_eps)
        self.eh_proj = linear(2 * H, H)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = SwiGLU(H, c.mtp_intermediate_size)
        self.final_layernorm = RMSNorm(H, c.rms_norm_eps)

    def forward(self, h_prev: torch.Tensor, e_next: torch.Tensor) -> torch.Tensor:
        """h_prev: the previous head's (or main model's) states; e_next: embeddings m ahead. [T, H] each."""
        u = self.eh_proj(torch.cat([self.hnorm(h_prev), self.enorm(e_next)], dim=-1))  # h first, then e
        h = u + self.self_attn(self.input_layernorm(u), 0)
        return h + self.mlp(self.post_attention_layernorm(h))


def init_like_synth(module: nn.Module) -> None:
    """Small, finite weights for a model built in memory without a checkpoint (tests, training start)."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
            elif name.endswith("rel_embed"):
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
            elif "sconv" in name:
                p.normal_(0, 0.2)
                p[:, -1] = 1.0
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))

"""The earlier, invented model's math for one sequence, in plain PyTorch: what its plugin ops
(`sheared_bias_attention`, `sconv`, `expert_sink_moe`, `mtp_draft`) are tested against. The model is
retired; these stay while the real model's ops reuse those ops' kernels (docs/interfaces.md "Ops"). The real
Inkling's math is transformers' (inkling/published/ops.py holds what the engine's programs share).

Every function here computes in the dtype of its inputs, with float32 softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(dtype)


def sconv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution over positions (§3.2).

    x: [T, C]; weight: [C, K], weight[:, K-1] multiplies the current token.
    state: [K-1, C], the inputs before x[0] (zeros when None).
    """
    T, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(K - 1, C)
    xp = torch.cat([state.to(x.dtype), x], dim=0)  # [K-1+T, C]
    y = torch.zeros_like(x)
    for k in range(K):
        y = y + weight[:, k].to(x.dtype) * xp[k : k + T]
    return y


def relative_bias(
    r: torch.Tensor, rel_embed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> torch.Tensor:
    """r[i,h] · E[h, min(i - j, R - 1)] for every query position i and key position j <= i.

    r: [Tq, Hq, Dr]; rel_embed: [Hq, R, Dr]; q_pos: [Tq]; k_pos: [Tk] -> [Hq, Tq, Tk].
    Materialises [Hq, Tq, Tk]: fine for a reference, which is what this is.
    """
    R = rel_embed.shape[1]
    dist = (q_pos[:, None] - k_pos[None, :]).clamp(min=0, max=R - 1)  # [Tq, Tk]
    # The table r @ E.T over all R rows, then gathered by distance: [Hq, Tq, R] -> [Hq, Tq, Tk].
    table = torch.einsum("qhd,hrd->hqr", r, rel_embed.to(r.dtype))
    return torch.gather(table, 2, dist[None].expand(table.shape[0], -1, -1))


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """allowed(i, j) = j <= i and (window == 0 or i - j < window): [Tq, Tk] bool."""
    d = q_pos[:, None] - k_pos[None, :]
    allowed = d >= 0
    if window > 0:
        allowed &= d < window
    return allowed


def relative_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    rel_embed: torch.Tensor,
    window: int,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA attention with the relative term (§3.1), for one sequence.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] at positions 0..Tk-1; r: [Tq, Hq, Dr];
    q_pos: absolute positions of the queries (default: the last Tq positions). window 0 = full.
    Returns o: [Tq, Hq, D].
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    if q_pos is None:
        q_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    k_pos = torch.arange(Tk, device=q.device)
    group = Hq // Hkv
    kx = k.repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    vx = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kx.float()) / math.sqrt(D)
    logits = logits + relative_bias(r.float(), rel_embed.float(), q_pos, k_pos)
    allowed = attention_mask(q_pos, k_pos, window)
    logits = logits.masked_fill(~allowed[None], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    o = torch.einsum("hqk,khd->qhd", p, vx.float())
    return o.to(q.dtype)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def route(x: torch.Tensor, router_weight: torch.Tensor, num_routed: int, top_k: int):
    """Expert-sink routing (§3.3): softmax over E+S in float32, top-k over the routed E only.

    Returns (w_top [T, k] float32, idx [T, k] int64, p_shared [T, S] float32).
    Ties go to the lower expert index (torch.topk on CPU and CUDA keeps the first of equal values
    only for sorted=True with stable ordering; we make it explicit with a stable sort).
    """
    z = x @ router_weight.T.to(x.dtype)
    p = torch.softmax(z.float(), dim=-1)
    routed = p[:, :num_routed]
    # A stable descending sort keeps equal probabilities in index order: ties to the lower index.
    order = torch.sort(routed, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w_top = torch.gather(routed, 1, order)
    return w_top, order, p[:, num_routed:]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")

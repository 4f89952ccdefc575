"""The real Inkling's math as plain functions on one sequence (INKLING_SPEC §3), no cache, no batching.

Each is transformers 5.23.0's computation restated, with its precision: what it keeps in float32 stays in
float32 here. The plugins' reference ops (plugins/*/reference.py) run these over the paged caches and
ragged batches; tests check both against transformers' own modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The statistic in float32, cast back to x's dtype, *then* the weight (§3.0)."""
    xf = x.float()
    return weight.to(x.dtype) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def residual_sconv(
    x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None = None
) -> torch.Tensor:
    """u + causal depthwise conv(u), all in float32, cast back (§3.3). x [T, C]; weight [C, K] (tap K-1 on the
    current token); history [K-1, C]: the inputs before x[0] (zeros when None)."""
    T, C = x.shape
    K = weight.shape[1]
    u = x.float()
    prev = u.new_zeros(K - 1, C) if history is None else history.float()
    up = torch.cat([prev, u], dim=0)
    w = weight.float()
    y = u.clone()
    for k in range(K):
        y += w[:, k] * up[k : k + T]
    return y.to(x.dtype)


def log_scale(q_pos: torch.Tensor, n_floor: int | None, alpha: float) -> torch.Tensor | None:
    """τ_i = 1 + α ln(max(1, (i + 1) / n_floor)) per query position, float32 [Tq]; None without scaling."""
    if not n_floor:
        return None
    return 1.0 + alpha * torch.log(((q_pos + 1).float() / n_floor).clamp(min=1.0))


def bank_bias(r: torch.Tensor, bank: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """B[h, i, j] = r[i, h] · P[:, i - j] for 0 <= i - j < X, else 0 (§3.4). r [Tq, Hq, d_rel]; bank P
    [d_rel, X]; -> [Hq, Tq, Tk] in r's dtype."""
    X = bank.shape[1]
    table = torch.einsum("qhd,dx->hqx", r, bank.to(r.dtype))  # [Hq, Tq, X]
    dist = q_pos[:, None] - k_pos[None, :]
    gathered = table.gather(-1, dist.clamp(0, X - 1)[None].expand(table.shape[0], -1, -1))
    return gathered.masked_fill(((dist < 0) | (dist >= X))[None], 0.0)


def bank_attention(
    q: torch.Tensor,  # [Tq, Hq, D], after q_norm
    k: torch.Tensor,  # [Tk, Hkv, D], after k_sconv and k_norm
    v: torch.Tensor,  # [Tk, Hkv, D]
    r: torch.Tensor,  # [Tq, Hq, d_rel]
    bank: torch.Tensor,  # [d_rel, X]
    q_pos: torch.Tensor,  # [Tq] absolute positions
    k_pos: torch.Tensor,  # [Tk]
    window: int | None,
    scale: float,
    n_floor: int | None = None,
    alpha: float = 0.1,
) -> torch.Tensor:
    """softmax(τ (q·k scale + B)) v over the allowed keys (j <= i, and i - j < window when sliding): [Tq, Hq, D]."""
    Hq, Hkv = q.shape[1], k.shape[1]
    bias = bank_bias(r, bank, q_pos, k_pos)
    tau = log_scale(q_pos, n_floor, alpha)
    if tau is not None:  # on the normalised query and on the bias, each in float32 and cast back
        q = (q.float() * tau[:, None, None]).to(q.dtype)
        bias = (bias.float() * tau[None, :, None]).to(bias.dtype)
    kk = k.repeat_interleave(Hq // Hkv, dim=1)
    vv = v.repeat_interleave(Hq // Hkv, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, kk) * scale + bias
    d = q_pos[:, None] - k_pos[None, :]
    allowed = (d >= 0) if window is None else (d >= 0) & (d < window)
    logits = logits.masked_fill(~allowed[None], -math.inf)
    p = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", p, vv)


def sigmoid_route(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    global_scale: torch.Tensor,
    route_scale: float,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router, all in float32 (§3.6): (routed weights [T, k], expert ids [T, k], shared weights [T, S]),
    the weights cast to x's dtype. gate [E+S, H]: rows E.. are the shared experts' logits."""
    E = bias.shape[0]
    logits = F.linear(x.float(), gate.float())
    choice = logits[:, :E].sigmoid() + bias.float()
    idx = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    picked = torch.cat([logits[:, :E].gather(-1, idx), logits[:, E:]], dim=-1)
    log_p = F.logsigmoid(picked)
    w = torch.exp(log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)) * route_scale * global_scale.float()
    w = w.to(x.dtype)
    return w[:, :top_k], idx, w[:, top_k:]


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate_up [2I, H] = [gate; up] (de-interleaved) and down [H, I]."""
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


def deinterleave(w13: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows 2j (gate) and 2j+1 (up) of a fused checkpoint tensor, regrouped as [gate; up] along `dim`."""
    n = w13.shape[dim] // 2
    shape = (*w13.shape[:dim], n, 2, *w13.shape[dim + 1 :])
    return w13.reshape(shape).transpose(dim, dim + 1).reshape(w13.shape)

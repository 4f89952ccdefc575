"""Plain-PyTorch reference of `inkling::expert_sink_moe` (INKLING_SPEC §3.3) on the packed weights.

Routing is inkling.ops.route; each routed expert used by some token is dequantized with
plugins.nvfp4 (float32, exactly §9) and run through inkling.ops.swiglu in the activation dtype.
"""

from __future__ import annotations

import torch

from inkling import ops

from ..nvfp4 import dequantize_nvfp4


def dequantize_expert(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    e: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's (gate [I, H], up [I, H], down [H, I]) in float32."""
    I = w13.shape[1] // 2
    gate = dequantize_nvfp4(w13[e, :I], w13_scale[e, :I], w13_scale_2[e, 0])
    up = dequantize_nvfp4(w13[e, I:], w13_scale[e, I:], w13_scale_2[e, 1])
    down = dequantize_nvfp4(w2[e], w2_scale[e], w2_scale_2[e])
    return gate, up, down


def expert_sink_moe(
    x: torch.Tensor,  # [T, H]
    router_weight: torch.Tensor,  # [E+S, H]
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    shared_w13: torch.Tensor,  # [S, 2I, H]
    shared_w2: torch.Tensor,  # [S, H, I]
    num_routed: int,
    top_k: int,
) -> torch.Tensor:
    dtype = x.dtype
    I = shared_w13.shape[1] // 2
    w_top, idx, p_shared = ops.route(x, router_weight, num_routed, top_k)  # [T, k], [T, k], [T, S]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for s in range(shared_w13.shape[0]):
        out = ops.swiglu(x, shared_w13[s, :I].to(dtype), shared_w13[s, I:].to(dtype), shared_w2[s].to(dtype))
        y += p_shared[:, s : s + 1] * out.float()
    packed = (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        gate, up, down = dequantize_expert(*packed, e)
        out = ops.swiglu(x[rows], gate.to(dtype), up.to(dtype), down.to(dtype))
        y.index_add_(0, rows, w_top[rows, slot][:, None] * out.float())
    return y.to(dtype)

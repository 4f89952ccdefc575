"""Plain-PyTorch reference of `inkling::expert_sink_moe` (INKLING_SPEC §3.3) on the packed weights.

Routing is inkling.ops.route; each routed expert used by some token is dequantized with
plugins.nvfp4 (float32, exactly §9) and run through inkling.ops.swiglu in the activation dtype.
"""

from __future__ import annotations

import torch

from inkling import ops

from ..nvfp4 import dequantize_nvfp4

DEQUANT_GROUP = 16  # routed experts dequantized together by the reference


def dequantize_experts(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    experts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed experts' w13 [n, 2I, H] (gate rows, then up rows) and w2 [n, H, I] in float32, in one
    batched dequantization each (the per-row global scale is gate's or up's, exactly as §9)."""
    I = w13.shape[1] // 2
    scale_2 = w13_scale_2[experts].repeat_interleave(I, dim=1)[:, :, None]  # [n, 2I, 1]
    gate_up = dequantize_nvfp4(w13[experts], w13_scale[experts], scale_2)
    down = dequantize_nvfp4(w2[experts], w2_scale[experts], w2_scale_2[experts][:, None, None])
    return gate_up, down


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
    used = torch.unique(idx)
    # A group of experts dequantized at a time: inkling-bench's 256 at once need over 100 GB of
    # temporaries (the H200 ran out of memory at T = 1000, 2026-12-01).
    for group in used.split(DEQUANT_GROUP):
        gate_up, down = dequantize_experts(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, group)
        gate_up, down = gate_up.to(dtype), down.to(dtype)
        for n, e in enumerate(group.tolist()):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            out = ops.swiglu(x[rows], gate_up[n, :I], gate_up[n, I:], down[n])
            y.index_add_(0, rows, w_top[rows, slot][:, None] * out.float())
    return y.to(dtype)


def sigmoid_sink_moe(
    x: torch.Tensor,  # [T, H]
    gate: torch.Tensor,  # [E+S, H]
    gate_bias: torch.Tensor,  # float32 [E]: the selection bias
    gate_scale: torch.Tensor,  # float32 [1]
    w13: torch.Tensor,  # [E, 2I, H] = [gate; up] per expert (BF16), or NVFP4 codes [E, 2I, H/2]
    w13_scale: torch.Tensor,  # NVFP4: E4M3 [E, 2I, H/16]; BF16 experts: empty
    w13_scale_2: torch.Tensor,  # NVFP4: float32 [E], shared by gate and up; BF16: empty
    w2: torch.Tensor,  # [E, H, I] or NVFP4 codes [E, H, I/2]
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    shared_w13: torch.Tensor,  # [S, 2I, H] = [gate; up]
    shared_w2: torch.Tensor,  # [S, H, I]
    route_scale: float,
    top_k: int,
    expert_offset: int = 0,
) -> torch.Tensor:
    """The real Inkling's MoE (INKLING_SPEC §3.6): the sigmoid router, the chosen routed experts (each
    weight after its down projection, accumulated in x's dtype) and the shared experts (weighted before
    their down projection, summed in float32), as transformers computes them.

    Under expert parallelism (builder/expert_parallel.py) the stacks hold experts expert_offset ..
    expert_offset + w13.shape[0] - 1 of the gate's E, and the shared experts a slice of their width: the
    result is this rank's part of the sum, the router's choices being every rank's."""
    from inkling.published.ops import sigmoid_route, swiglu

    dtype = x.dtype
    w_top, idx, w_shared = sigmoid_route(x, gate, gate_bias, gate_scale, route_scale, top_k)
    quantized = w13_scale.numel() > 0
    y = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        if not expert_offset <= e < expert_offset + w13.shape[0]:
            continue  # another rank's expert
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        e -= expert_offset
        if quantized:
            sel = torch.tensor([e], device=x.device)
            gate_up = dequantize_nvfp4(w13[sel], w13_scale[sel], w13_scale_2[sel][:, None, None])[0]
            down = dequantize_nvfp4(w2[sel], w2_scale[sel], w2_scale_2[sel][:, None, None])[0]
        else:
            gate_up, down = w13[e], w2[e]
        out = swiglu(x[rows], gate_up.to(dtype), down.to(dtype)) * w_top[rows, slot, None]
        y.index_add_(0, rows, out.to(dtype))
    I = shared_w13.shape[1] // 2
    shared = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for s in range(shared_w13.shape[0]):
        g, u = (x @ shared_w13[s, :I].to(dtype).T), (x @ shared_w13[s, I:].to(dtype).T)
        act = torch.nn.functional.silu(g) * u * w_shared[:, s : s + 1]
        shared += (act @ shared_w2[s].to(dtype).T).float()
    return y + shared.to(dtype)

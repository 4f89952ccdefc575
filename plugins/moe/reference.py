"""Plain-PyTorch reference of `inkling::sigmoid_sink_moe` (INKLING_SPEC §3.6): the model's router
(inkling.published.ops.sigmoid_route), each routed expert some token chose dequantized with plugins.nvfp4
(float32, exactly §9) where it is NVFP4, the experts computed as transformers computes them.
"""

from __future__ import annotations

import torch

from inkling.published.ops import sigmoid_route, swiglu

from ..nvfp4 import dequantize_nvfp4


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
    expert_load: torch.Tensor | None = None,  # int32 [E], mutated: each valid row's choices counted
    row_valid: torch.Tensor | None = None,  # bool [T]
) -> torch.Tensor:
    """The real Inkling's MoE (INKLING_SPEC §3.6): the sigmoid router, the chosen routed experts (each
    weight after its down projection, accumulated in x's dtype) and the shared experts (weighted before
    their down projection, summed in float32), as transformers computes them.

    Under expert parallelism (builder/expert_parallel.py) the stacks hold experts expert_offset ..
    expert_offset + w13.shape[0] - 1 of the gate's E, and the shared experts a slice of their width: the
    result is this rank's part of the sum, the router's choices being every rank's."""
    dtype = x.dtype
    w_top, idx, w_shared = sigmoid_route(x, gate, gate_bias, gate_scale, route_scale, top_k)
    if expert_load is not None and expert_load.numel():  # empty: nothing counted
        chosen = idx[row_valid].flatten()
        expert_load.index_add_(0, chosen, torch.ones_like(chosen, dtype=expert_load.dtype))
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

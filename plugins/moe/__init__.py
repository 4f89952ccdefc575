"""`inkling::sigmoid_sink_moe`: the real Inkling's MoE (INKLING_SPEC §3.6, before the MLP's sconv).

The sigmoid router with its selection bias chooses top_k of the E routed experts; the chosen and the S
shared experts (the sinks) share one normalisation, times route_scale and the learned scale. Routed experts
are BF16 or NVFP4 (the published layout, de-interleaved by the builder); shared experts are BF16.
`tile_configs` is "" (built-in tiles) or the JSON of `launcher.tune()`'s table, chosen at build time.
"""

from __future__ import annotations

import torch

from ..registry import PluginSpec, check_impl, register
from ..triton_utils import can_run_triton
from . import reference

SIGMOID_SPEC = register(
    PluginSpec(
        name="sigmoid_sink_moe",
        version=3,  # 2: the Triton kernels; 3: the expert load (expert_load, row_valid)
        doc="the real Inkling's MoE: sigmoid router with a selection bias, joint weights over the chosen and "
        "shared experts, BF16 or NVFP4 routed stacks (the published layout, de-interleaved)",
    )
)


@torch.library.custom_op("inkling::sigmoid_sink_moe", mutates_args=("expert_load",))
def sigmoid_sink_moe(
    x: torch.Tensor,
    gate: torch.Tensor,
    gate_bias: torch.Tensor,
    gate_scale: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    shared_w13: torch.Tensor,
    shared_w2: torch.Tensor,
    route_scale: float,
    top_k: int,
    tile_configs: str,
    impl: str,
    ep_size: int,
    expert_load: torch.Tensor,
    row_valid: torch.Tensor,
) -> torch.Tensor:
    """BF16 routed experts pass empty scale tensors; NVFP4 ones their E4M3 block scales and float32 [E]
    global scales (plugins/moe/reference.py says every shape).
    ep_size > 1: the stacks are this rank's share of the experts (its rank from the process's
    communicator, as the collectives find theirs) and the result its part of the sum.
    expert_load int32 [E] (mutated), row_valid bool [T]: each valid row's top_k choices are added to the
    load of the experts chosen, all E of them on every rank (runtime/expert_load.py); empty tensors count
    nothing. Every argument is required: torch 2.11's in-place bookkeeping of a custom op indexes the
    mutated argument among those passed, so one left to its default fails there."""
    check_impl(SIGMOID_SPEC.name, impl)
    offset = 0
    if ep_size > 1:
        from plugins.collectives import get_communicator

        offset = get_communicator().rank * w13.shape[0]
    if impl == "triton":
        if not can_run_triton(x):
            raise RuntimeError(
                "inkling::sigmoid_sink_moe impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1)"
            )
        from . import launcher

        config = launcher.select_config(launcher.parse_table(tile_configs), x.shape[0])
        if config.get("kernel") == "bd" and x.dtype == torch.float32:
            # bd hands the tensor cores fp16 activations: a float32 network keeps its precision on the GEMV
            config = launcher.without_bd(config)
        return launcher.sigmoid_sink_moe(
            x, gate, gate_bias, gate_scale, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
            shared_w2, route_scale, top_k, config=config, expert_offset=offset, load=expert_load,
            row_valid=row_valid,
        )  # fmt: skip
    return reference.sigmoid_sink_moe(
        x, gate, gate_bias, gate_scale, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
        shared_w2, route_scale, top_k, offset, expert_load, row_valid,
    )  # fmt: skip


NO_LOAD = torch.empty(0, dtype=torch.int32)  # expert_load and row_valid of a call that counts nothing


def moe(*args, tile_configs: str = "", impl: str = "triton", ep_size: int = 1) -> torch.Tensor:
    """The op on its weight arguments (x .. top_k) without counting the expert load (tests, benchmarks)."""
    none = NO_LOAD.to(args[0].device)
    return torch.ops.inkling.sigmoid_sink_moe(*args, tile_configs, impl, ep_size, none, none)


@sigmoid_sink_moe.register_fake
def _(x, gate, gate_bias, gate_scale, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
      shared_w2, route_scale, top_k, tile_configs, impl, ep_size, expert_load, row_valid):  # fmt: skip
    return torch.empty_like(x)

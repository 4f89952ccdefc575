"""`inkling::sconv`: the causal depthwise convolution of INKLING_SPEC §3.3 (the network adds the skip) with
its per-sequence state (docs/interfaces.md "Sconv state"), plus `sconv_rollback` for rejected drafts."""

from __future__ import annotations

import torch

from ..registry import PluginSpec, check_impl, register
from ..triton_utils import can_run_triton
from . import reference
from .reference import sconv_rollback  # noqa: F401

SPEC = register(PluginSpec(name="sconv", version=1, doc="causal depthwise conv with state (§3.3)"))


def _triton_ok(name: str, t: torch.Tensor) -> None:
    if not can_run_triton(t):
        raise RuntimeError(f"inkling::{name} impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")


@torch.library.custom_op("inkling::sconv", mutates_args=("state",))
def sconv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    check_impl(SPEC.name, impl)
    if impl == "reference":
        return reference.sconv(x, weight, state, state_indices, cu_seqlens_q)
    _triton_ok(SPEC.name, x)
    from . import launcher

    return launcher.sconv(x, weight, state, state_indices, cu_seqlens_q)


@sconv.register_fake
def _sconv_fake(x, weight, state, state_indices, cu_seqlens_q, impl):
    return torch.empty_like(x)

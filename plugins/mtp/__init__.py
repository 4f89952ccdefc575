"""`inkling::mtp_draft`: the close of one MTP head (INKLING_SPEC §5), the greedy draft token.

    mtp_draft(hidden [N, H], norm_weight [H], lm_head [V, H], num_real_tokens, eps, impl) -> int64 [N]

draft[i] = argmax over v < num_real_tokens of (RMSNorm(hidden) @ lm_head.T)[i, v], logits in
float32, ties to the lowest index; rows of lm_head past num_real_tokens (vocabulary padding) are
never read. The "triton" impl fuses the GEMV with the argmax: no [N, V] logits tensor is written,
so a decode step reads lm_head once and writes N integers. It never synchronises with the host.
Inputs are assumed finite (NaN logits are not ranked as torch.argmax ranks them).
"""

from __future__ import annotations

import torch

from ..registry import PluginSpec, check_impl, register
from ..triton_utils import can_run_triton
from . import reference

SPEC = register(
    PluginSpec(
        name="mtp_draft",
        version=1,
        doc="MTP head close: final RMSNorm, lm_head GEMV and argmax over the real vocabulary, fused",
    )
)


@torch.library.custom_op("inkling::mtp_draft", mutates_args=())
def mtp_draft(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    num_real_tokens: int,
    eps: float,
    impl: str,
) -> torch.Tensor:
    check_impl(SPEC.name, impl)
    reference.check_inputs(hidden, norm_weight, lm_head, num_real_tokens)
    if impl == "reference":
        return reference.mtp_draft(hidden, norm_weight, lm_head, num_real_tokens, eps)
    if not can_run_triton(hidden):
        raise RuntimeError(
            f"inkling::mtp_draft impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got {hidden.device}"
        )
    from . import launcher

    return launcher.mtp_draft(hidden, norm_weight, lm_head, num_real_tokens, eps)


@mtp_draft.register_fake
def _mtp_draft_fake(hidden, norm_weight, lm_head, num_real_tokens, eps, impl):
    check_impl(SPEC.name, impl)
    reference.check_inputs(hidden, norm_weight, lm_head, num_real_tokens)
    return hidden.new_empty((hidden.shape[0],), dtype=torch.int64)

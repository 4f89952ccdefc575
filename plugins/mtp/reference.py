"""Plain-PyTorch reference of `inkling::mtp_draft`, and the argument checks both impls share.

draft[i] = argmax over v < num_real_tokens of (RMSNorm(hidden) @ lm_head.T)[i, v], the logits in
float32: the norm rounds back to the input dtype (as builder/network.py's rms_norm), the products
and the accumulation are float32. Ties go to the lowest index, as torch.argmax.
"""

from __future__ import annotations

import torch

from inkling.ops import rms_norm

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_ROWS = 16384  # vocabulary rows per float32 matmul: bounds the float32 copy of lm_head


def check_inputs(
    hidden: torch.Tensor,  # [N, H]
    norm_weight: torch.Tensor,  # [H]
    lm_head: torch.Tensor,  # [V, H]
    num_real_tokens: int,
) -> None:
    if hidden.dim() != 2 or lm_head.dim() != 2 or norm_weight.dim() != 1:
        raise ValueError(
            f"mtp_draft: want hidden [N, H], norm_weight [H], lm_head [V, H]; got {tuple(hidden.shape)}, "
            f"{tuple(norm_weight.shape)}, {tuple(lm_head.shape)}"
        )
    H = hidden.shape[1]
    V = lm_head.shape[0]
    if lm_head.shape[1] != H or norm_weight.shape[0] != H:
        raise ValueError(
            f"mtp_draft: hidden size differs: hidden {tuple(hidden.shape)}, norm_weight "
            f"{tuple(norm_weight.shape)}, lm_head {tuple(lm_head.shape)}"
        )
    if hidden.dtype not in DTYPES or lm_head.dtype != hidden.dtype:
        raise ValueError(
            f"mtp_draft: hidden and lm_head must share a dtype in {DTYPES}; got {hidden.dtype}, {lm_head.dtype}"
        )
    if not norm_weight.dtype.is_floating_point:
        raise ValueError(f"mtp_draft: norm_weight must be floating point, got {norm_weight.dtype}")
    if not 1 <= num_real_tokens <= V:
        raise ValueError(
            f"mtp_draft: num_real_tokens must be in 1..{V} (lm_head rows), got {num_real_tokens}"
        )
    if not (hidden.device == lm_head.device == norm_weight.device):
        raise ValueError(
            f"mtp_draft: tensors on different devices: {hidden.device}, {norm_weight.device}, {lm_head.device}"
        )


def mtp_draft(
    hidden: torch.Tensor,  # [N, H]
    norm_weight: torch.Tensor,  # [H]
    lm_head: torch.Tensor,  # [V, H]
    num_real_tokens: int,
    eps: float,
    chunk_rows: int = CHUNK_ROWS,
) -> torch.Tensor:
    N = hidden.shape[0]
    if N == 0:
        return torch.empty(0, dtype=torch.int64, device=hidden.device)
    normed = rms_norm(hidden, norm_weight, eps).float()  # [N, H], rounded to hidden.dtype first
    vals, idxs = [], []
    for v0 in range(0, num_real_tokens, chunk_rows):
        logits = normed @ lm_head[v0 : min(v0 + chunk_rows, num_real_tokens)].float().T  # [N, chunk]
        idx = logits.argmax(dim=-1, keepdim=True)  # [N, 1]
        vals.append(logits.gather(1, idx))
        idxs.append(idx + v0)
    best = torch.cat(vals, dim=1).argmax(dim=1, keepdim=True)  # the first chunk holding the max
    return torch.cat(idxs, dim=1).gather(1, best).squeeze(1)

"""Launchers of the sconv Triton kernels: shape, stride and dtype checks, tile and grid choice."""

from __future__ import annotations

import torch
import triton

from . import kernels

_TARGET_PROGRAMS = 264  # two per SM of an H100/H200


def _tiles(num_seqs: int, C: int, T: int) -> tuple[int, int]:
    block_c = 256
    while block_c > 32 and num_seqs * triton.cdiv(C, block_c) < _TARGET_PROGRAMS:
        block_c //= 2
    block_t = 16 if T <= 16 * max(num_seqs, 1) else 32
    return block_t, block_c


def _check(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, state_indices, cu_seqlens_q) -> None:
    T, C = x.shape
    if x.stride(1) != 1 or state.stride(2) != 1:
        raise ValueError("sconv: x and state need unit stride on channels")
    if weight.shape[0] != C or state.shape[2] != C:
        raise ValueError(
            f"sconv: channels differ: x {tuple(x.shape)}, weight {tuple(weight.shape)}, state {tuple(state.shape)}"
        )
    if state.shape[1] < weight.shape[1] - 1:
        raise ValueError(f"sconv: state has {state.shape[1]} rows, needs K-1 = {weight.shape[1] - 1}")
    if state_indices.dtype != torch.int32 or cu_seqlens_q.dtype != torch.int32:
        raise ValueError("sconv: state_indices and cu_seqlens_q must be int32")
    if cu_seqlens_q.shape[0] != state_indices.shape[0] + 1:
        raise ValueError("sconv: cu_seqlens_q must have B+1 entries for B state_indices")


def sconv(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    state: torch.Tensor,  # [slots, S, C], mutated
    state_indices: torch.Tensor,  # int32 [B]
    cu_seqlens_q: torch.Tensor,  # int32 [B+1]
) -> torch.Tensor:
    _check(x, weight, state, state_indices, cu_seqlens_q)
    T, C = x.shape
    B = state_indices.shape[0]
    K, S = weight.shape[1], state.shape[1]
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if B == 0 or T == 0:
        return y
    block_t, block_c = _tiles(B, C, T)
    grid = (B, triton.cdiv(C, block_c))
    kernels.sconv_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), weight.stride(1),
        state, state.stride(0), state.stride(1), state_indices, cu_seqlens_q,
        y, y.stride(0), C, S,
        K=K, BLOCK_T=block_t, BLOCK_C=block_c, S_POW2=triton.next_power_of_2(S), num_warps=4,
    )  # fmt: skip
    return y

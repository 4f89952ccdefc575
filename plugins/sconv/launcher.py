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


def sconv_kv_write(
    k_raw: torch.Tensor,  # [T, Hkv*D]
    v_raw: torch.Tensor,
    wk: torch.Tensor,  # [Hkv*D, K]
    wv: torch.Tensor,
    state_k: torch.Tensor,  # [slots, S, Hkv*D], mutated
    state_v: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D], mutated
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(k_raw, wk, state_k, state_indices, cu_seqlens_q)
    _check(v_raw, wv, state_v, state_indices, cu_seqlens_q)
    T, C = k_raw.shape
    NB, BS, Hkv, D = key_cache.shape
    if Hkv * D != C or value_cache.shape != key_cache.shape:
        raise ValueError(f"sconv_kv_write: cache {tuple(key_cache.shape)} does not hold {C} channels")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("sconv_kv_write: the paged caches must be contiguous")
    if state_k.stride() != state_v.stride() or wk.stride() != wv.stride():
        raise ValueError("sconv_kv_write: K and V states (and weights) must share strides")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] != T:
        raise ValueError("sconv_kv_write: slot_mapping must be int64 [T]")
    B = state_indices.shape[0]
    K, S = wk.shape[1], state_k.shape[1]
    k = torch.empty((T, C), dtype=k_raw.dtype, device=k_raw.device)
    v = torch.empty_like(k)
    if B > 0 and T > 0:
        block_t, block_c = _tiles(2 * B, C, T)
        grid = (B, triton.cdiv(C, block_c), 2)
        kernels.sconv_kv_write_kernel[grid](
            k_raw, v_raw, k_raw.stride(0), v_raw.stride(0), wk, wv, wk.stride(0), wk.stride(1),
            state_k, state_v, state_k.stride(0), state_k.stride(1), state_indices, cu_seqlens_q,
            k, v, k.stride(0), key_cache, value_cache, slot_mapping, C, C, S,
            K=K, BLOCK_T=block_t, BLOCK_C=block_c, S_POW2=triton.next_power_of_2(S), num_warps=4,
        )  # fmt: skip
    return k.view(T, Hkv, D), v.view(T, Hkv, D)

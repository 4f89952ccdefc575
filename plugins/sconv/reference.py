"""Plain-PyTorch reference of the batched sconv ops (docs/interfaces.md "Sconv state").

Per sequence b (tokens cu_seqlens_q[b]..cu_seqlens_q[b+1]-1, slot state_indices[b]): the inputs
before its first new token are rows S-K+1..S-1 of its state; afterwards the state holds the last S
inputs. A slot < 0 means "no state" (x[t<0] = 0, nothing saved), e.g. padding rows of a graph bucket.
"""

from __future__ import annotations

import torch


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution of one sequence (INKLING_SPEC §3.3, without the skip the network
    adds): x [T, C]; weight [C, K], tap K-1 on the current token; history [K-1, C], the inputs before x[0]."""
    T, K = x.shape[0], weight.shape[1]
    xp = torch.cat([history.to(x.dtype), x], dim=0)
    y = torch.zeros_like(x)
    for k in range(K):
        y = y + weight[:, k].to(x.dtype) * xp[k : k + T]
    return y


def sconv(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    state: torch.Tensor,  # [slots, S, C], mutated
    state_indices: torch.Tensor,  # int32 [B]
    cu_seqlens_q: torch.Tensor,  # int32 [B+1]
) -> torch.Tensor:
    K = weight.shape[1]
    S = state.shape[1]
    if S < K - 1:
        raise ValueError(f"sconv state has {S} rows, needs at least K-1 = {K - 1}")
    y = torch.zeros_like(x)
    cu = cu_seqlens_q.tolist()
    slots = state_indices.tolist()
    for b, slot in enumerate(slots):
        start, end = cu[b], cu[b + 1]
        xb = x[start:end]
        prev = state[slot, S - K + 1 :] if slot >= 0 else x.new_zeros(K - 1, x.shape[1])
        y[start:end] = causal_conv(xb, weight, prev)
        if slot >= 0 and end > start:
            hist = torch.cat([state[slot], xb.to(state.dtype)], dim=0)
            state[slot] = hist[-S:]
    return y


def sconv_rollback(state: torch.Tensor, state_indices: torch.Tensor, n: int | torch.Tensor) -> None:
    """Undo the last n inputs of each slot: state[s, n:] = state[s, :-n] (rows 0..n-1 become stale).

    n: an int for every sequence, or an int tensor [B] (0 = keep). Sync-free: usable in a CUDA graph.
    Slots < 0 are left alone.
    """
    S = state.shape[1]
    B = state_indices.shape[0]
    if B == 0:
        return
    dev = state.device
    n_b = torch.as_tensor(n, device=dev).to(torch.int64).expand(B)  # [B]
    slots = state_indices.to(torch.int64)
    valid = slots >= 0
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    # Shift per slot; entries with slot < 0 alias slot 0 with shift 0, and amax makes every entry
    # that aliases one slot compute the same new rows, so duplicate writes agree.
    shift = torch.zeros(state.shape[0], dtype=torch.int64, device=dev)
    shift.scatter_reduce_(0, safe, torch.where(valid, n_b, torch.zeros_like(n_b)), reduce="amax")
    src_rows = (torch.arange(S, device=dev)[None, :] - shift[safe][:, None]).clamp(min=0)  # [B, S]
    new = torch.gather(state[safe], 1, src_rows[:, :, None].expand(-1, -1, state.shape[2]))
    state.index_copy_(0, safe, new)

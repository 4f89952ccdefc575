"""Plain-PyTorch references of the attention plugin's ops, on the paged cache, any device.

Each sequence's keys are gathered through its block table (only the positions its queries may see,
so freed sliding-window blocks are never touched) and handed to the model's math,
`inkling.published.ops.bank_attention`.
"""

from __future__ import annotations

import torch

from inkling.published.ops import bank_attention as attend


def kv_cache_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D], written in place
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T], -1 = skip
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k[slots] = k[keep].to(key_cache.dtype)
    flat_v[slots] = v[keep].to(value_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_table_row: torch.Tensor,  # [MB]
    positions: torch.Tensor,  # [n] int64
) -> torch.Tensor:
    """The cache rows of one sequence's positions: [n, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_table_row[positions // block_size].long()
    return cache[blocks, positions % block_size]


def bank_attention(
    q: torch.Tensor,  # [T, Hq, D], after q_norm
    r: torch.Tensor,  # [T, Hq, d_rel]
    bank: torch.Tensor,  # [d_rel, X]: the layer's relative bank, shared by its heads
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [B, MB]
    cu_seqlens_q: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    max_seqlen_q: int,
    window: int,  # 0: full attention
    scale: float,
    log_floor: int,  # 0: no log scaling
    log_alpha: float,
) -> torch.Tensor:
    """The real Inkling's attention (INKLING_SPEC §3.4) per sequence over its paged keys: only the
    positions its queries may see are gathered, so blocks freed behind a window are never read."""
    out = torch.zeros_like(q)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end - start > max_seqlen_q:
            raise ValueError(
                f"sequence {b} has {end - start} new tokens, more than max_seqlen_q={max_seqlen_q}"
            )
        if end == start:
            continue
        first = seq_len - (end - start)
        lo = max(0, first - window + 1) if window > 0 else 0
        k_pos = torch.arange(lo, seq_len, device=q.device)
        k = gather_kv(key_cache, block_table[b], k_pos)
        v = gather_kv(value_cache, block_table[b], k_pos)
        q_pos = torch.arange(first, seq_len, device=q.device)
        out[start:end] = attend(
            q[start:end],
            k,
            v,
            r[start:end],
            bank,
            q_pos,
            k_pos,
            window or None,
            scale,
            log_floor or None,
            log_alpha,
        )
    return out

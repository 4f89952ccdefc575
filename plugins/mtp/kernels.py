"""Triton kernels of `inkling::mtp_draft` (@triton.jit code only; launcher.py picks tiles and grids).

Three launches, none of which writes the [N, V] logits:
1. rms_norm_kernel: one program per row, the normalised hidden in the input dtype (the reference's
   rounding), read afterwards from L2 by every program of step 2;
2. lm_head_argmax_kernel: one program per (block of rows, block of vocabulary): the dot products
   over H in float32, then the tile's max and its first index per row. The vocabulary sits on the
   MMA's M side ("swap AB"): at decode N is 1..64, far below a tensor-core tile, while every
   program streams BLOCK_V rows of lm_head, the bytes that set the time;
3. tile_argmax_kernel: per row, the first tile holding the global max.
"""

from __future__ import annotations

import triton
import triton.language as tl

INDEX_MAX = tl.constexpr(2147483647)  # larger than any vocabulary index: loses every min()


@triton.jit
def _round_to(y, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> DTYPE, round to nearest even. The CPU interpreter (triton 3.6) truncates
    float32 -> bfloat16, so there the rounding is done on the bits."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(DTYPE)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [N, H]
    stride_xn,
    w_ptr,  # [H]
    out_ptr,  # [N, H], contiguous, the dtype of x
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    sum_sq = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_row + offs, mask=offs < H, other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        mask = offs < H
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _round_to(x * rstd * w, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(out_ptr + row * H + offs, y, mask=mask)


@triton.jit
def lm_head_argmax_kernel(
    xn_ptr,  # [N, H] normalised hidden, contiguous
    lm_head_ptr,  # [V, H], unit stride along H
    stride_lv,
    tile_val_ptr,  # float32 [num_tiles, N]
    tile_idx_ptr,  # int32 [num_tiles, N]
    N,
    num_real_tokens,
    num_row_blocks,
    H: tl.constexpr,  # constexpr: a static loop bound (software pipelining)
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Row blocks vary fastest, so the programs sharing a vocabulary tile run together and read
    # it from DRAM once when N needs several row blocks.
    pid = tl.program_id(0)
    pid_n = pid % num_row_blocks
    pid_v = pid // num_row_blocks
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < num_real_tokens
    w_rows = lm_head_ptr + offs_v.to(tl.int64)[:, None] * stride_lv  # [BLOCK_V, 1]
    x_cols = xn_ptr + offs_n.to(tl.int64)[None, :] * H  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_V, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :], mask=v_mask[:, None], other=0.0)
            x = tl.load(x_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < H
            w = tl.load(w_rows + offs_k[None, :], mask=v_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_cols + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if INTERPRET:  # the interpreter's dot reads bfloat16 as integers; the products are exact
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)  # [BLOCK_V, BLOCK_N]
    logits = tl.where(v_mask[:, None], acc, float("-inf"))
    best = tl.max(logits, axis=0)  # [BLOCK_N]
    first = tl.min(tl.where(logits == best[None, :], offs_v[:, None], INDEX_MAX), axis=0)
    out = pid_v * N + offs_n
    tl.store(tile_val_ptr + out, best, mask=n_mask)
    tl.store(tile_idx_ptr + out, first, mask=n_mask)


@triton.jit
def tile_argmax_kernel(
    tile_val_ptr,  # float32 [num_tiles, N]
    tile_idx_ptr,  # int32 [num_tiles, N]
    out_ptr,  # int64 [N]
    N,
    num_tiles,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK_N], dtype=tl.int32)
    # A while loop: the interpreter cannot take a runtime scalar as a range() bound.
    t0 = 0
    while t0 < num_tiles:
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask = (offs_t < num_tiles)[:, None] & n_mask[None, :]
        at = offs_t[:, None] * N + offs_n[None, :]
        vals = tl.load(tile_val_ptr + at, mask=mask, other=float("-inf"))  # [BLOCK_T, BLOCK_N]
        idx = tl.load(tile_idx_ptr + at, mask=mask, other=INDEX_MAX)
        m = tl.max(vals, axis=0)
        first = tl.min(tl.where(vals == m[None, :], idx, INDEX_MAX), axis=0)
        # Strictly greater: on a tie the earlier chunk, hence the lower index, stays.
        take = m > best
        best_idx = tl.where(take, first, best_idx)
        best = tl.where(take, m, best)
        t0 += BLOCK_T
    tl.store(out_ptr + offs_n, best_idx.to(tl.int64), mask=n_mask)

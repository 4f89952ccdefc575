"""Triton kernels of the sconv ops (@triton.jit code only; launcher.py picks grids and checks shapes).

One program owns one sequence and one block of channels: it reads the sequence's state, walks its
new tokens in tiles of BLOCK_T, and finally shifts the new inputs into the state. Owning the whole
sequence makes the state update race-free in a single launch (no program reads a state another
one writes), which is what decode and verify steps want; a long prefill runs fewer programs, but
sconv is a small part of a layer either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sconv_sequence(
    x_ptr,
    stride_xt,
    w_ptr,
    stride_wc,
    stride_wk,
    st_ptr,  # this slot's state, [S, C]
    stride_sr,
    y_ptr,
    stride_yt,
    has_state,
    start,
    end,
    S,
    offs_c,
    c_mask,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    S_POW2: tl.constexpr,
):
    # A while loop: the interpreter cannot take loaded scalars as range() bounds.
    t0 = start
    while t0 < end:
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < end
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(K):
            src = offs_t - (K - 1) + k
            in_x = src >= start
            xv = tl.load(
                x_ptr + src[:, None] * stride_xt + offs_c[None, :],
                mask=(t_mask & in_x)[:, None] & c_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            # Inputs before the sequence's first new token: state rows S-K+1..S-1.
            sv = tl.load(
                st_ptr + (S + src - start)[:, None] * stride_sr + offs_c[None, :],
                mask=(t_mask & (src < start) & has_state)[:, None] & c_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            wk = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
            acc += wk[None, :] * (xv + sv)
        tl.store(
            y_ptr + offs_t[:, None] * stride_yt + offs_c[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=t_mask[:, None] & c_mask[None, :],
        )
        t0 += BLOCK_T

    n = end - start
    if has_state & (n > 0):
        # New state row r = (old state ++ new inputs)[n + r]: load every source, then store.
        offs_r = tl.arange(0, S_POW2)
        r_mask = offs_r < S
        src = offs_r + n
        from_state = src < S
        old = tl.load(
            st_ptr + src[:, None] * stride_sr + offs_c[None, :],
            mask=(r_mask & from_state)[:, None] & c_mask[None, :],
            other=0.0,
        )
        new = tl.load(
            x_ptr + (start + src - S)[:, None] * stride_xt + offs_c[None, :],
            mask=(r_mask & ~from_state)[:, None] & c_mask[None, :],
            other=0.0,
        )
        new = tl.where(from_state[:, None], old, new.to(old.dtype))
        # Rows are shifted across threads: every read (above, and the loop's) before any write.
        tl.debug_barrier()
        tl.store(
            st_ptr + offs_r[:, None] * stride_sr + offs_c[None, :],
            new,
            mask=r_mask[:, None] & c_mask[None, :],
        )


@triton.jit
def sconv_kernel(
    x_ptr,  # [T, C]
    stride_xt,
    w_ptr,  # [C, K]
    stride_wc,
    stride_wk,
    state_ptr,  # [slots, S, C]
    stride_ss,
    stride_sr,
    state_indices_ptr,  # int32 [B]
    cu_seqlens_ptr,  # int32 [B+1]
    y_ptr,  # [T, C]
    stride_yt,
    C,
    S,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    S_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    start = tl.load(cu_seqlens_ptr + b)
    end = tl.load(cu_seqlens_ptr + b + 1)
    slot = tl.load(state_indices_ptr + b)
    has_state = slot >= 0
    st_ptr = state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_ss
    _sconv_sequence(
        x_ptr, stride_xt, w_ptr, stride_wc, stride_wk, st_ptr, stride_sr, y_ptr, stride_yt,
        has_state, start, end, S, offs_c, c_mask, K, BLOCK_T, BLOCK_C, S_POW2,
    )  # fmt: skip

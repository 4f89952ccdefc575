"""The decode forms of `inkling::sigmoid_sink_moe`'s routed GEMMs (@triton.jit code only; launcher.py
drives them). Same blocks, rows and outputs as kernels.moe_gemm_kernel, for calls of a few tokens, where a
block holds one to four rows:

- moe_gemv_kernel ("gemv"): CUDA cores, the codes read as uint32 words and decoded in place; exact in
  float32, so a float32 network runs it in place of "bd";
- moe_bd_kernel ("bd"): tensor cores through a block-diagonal activation operand (its docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _block, _e2m1_pair_f16, _expert_weights, _program_ids, _words_tile


@triton.jit
def _e2m1_word_f32(words, P: tl.constexpr):
    """Nibble P (0 = lowest) of each uint32 word of E2M1 codes, as float32 E2M1 * 2^-14 (`_e2m1_pair_f16`'s
    placement, with the nibble's shift folded into the two shifts that place it)."""
    if 4 * P >= 12:
        sign = words >> (4 * P - 12)
    else:
        sign = words << (12 - 4 * P)
    if 4 * P >= 9:
        mag = words >> (4 * P - 9)
    else:
        mag = words << (9 - 4 * P)
    h = (mag & 0x0E00) | (sign & 0x8000)  # s.000e1e0.m000000000 in the low 16 bits
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _words_dot(a_ptr, a_row, k0, words, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 8] partial sums of one activation row against a tile of E2M1 words: word j of
    a row holds columns 8j..8j+7 (nibble p = column 8j+p), each met by its activation column. Everything
    stays in the words' own layout: no reshape, join or broadcast of the weights."""
    offs_j = tl.arange(0, BLOCK_K // 8)
    s = tl.zeros(words.shape, dtype=tl.float32)
    for p in tl.static_range(8):
        a_p = tl.load(a_ptr + a_row + k0 + 8 * offs_j + p).to(tl.float32)
        s += _e2m1_word_f32(words, p) * a_p[None, :]
    return s


@triton.jit
def moe_gemv_kernel(
    a_ptr,  # as moe_gemm_kernel (NVFP4 weights only: the routed experts)
    stride_at,
    w_ptr,
    stride_we,
    stride_wn,
    ws_ptr,
    stride_wse,
    stride_wsn,
    wg_ptr,
    out_ptr,
    stride_ot,
    sorted_rows_ptr,
    expert_ids_ptr,
    block_rows_ptr,
    route_w_ptr,
    num_tokens,
    N,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    KS: tl.constexpr,
    ROUTED: tl.constexpr,
    NVFP4: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per block: a few (decode), each against the tile held in registers
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The decode form of moe_gemm_kernel (same blocks, same outputs): a GEMV on CUDA cores.

    The codes are read as uint32 words of eight E2M1 codes, and every operation keeps the words' layout:
    nibble p of word j is decoded in place and met by activation column 8j+p (eight strided loads of the
    activation row per tile), the products are summed per word, and a word's sum is scaled by its block's
    scale. The per-word sums accumulate across the K loop and are reduced once at the end. Rows past a
    block's count cost nothing; a block's rows share each tile load.
    """
    tl.static_assert(ROUTED and NVFP4, "moe_gemv_kernel: NVFP4 routed experts only")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    e, count, rows, a_rows = _block(
        pid_m, expert_ids_ptr, block_rows_ptr, sorted_rows_ptr, num_tokens, TOP_K, KS, ROUTED, GATED, BLOCK_M
    )
    if e < 0:
        return
    w_base, ws_base, g_gate, g_up = _expert_weights(
        w_ptr, ws_ptr, wg_ptr, e, stride_we, stride_wse, NVFP4, GATED
    )

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    W: tl.constexpr = BLOCK_K // 8
    acc = tl.zeros([BLOCK_M, BLOCK_N, W], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N, W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g_words, g_scale = _words_tile(
            w_base, ws_base, g_gate, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K
        )
        if GATED:
            u_words, u_scale = _words_tile(w_base + N * stride_wn, ws_base + N * stride_wsn, g_up, offs_n, n_mask,
                                           k0, stride_wn, stride_wsn, BLOCK_K)  # fmt: skip
        for mi in tl.static_range(BLOCK_M):
            if mi < count:
                r = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + mi).to(
                    tl.int64
                )  # a scalar load, no reduction
                a_row = (r // KS if GATED else r) * stride_at
                p = _words_dot(a_ptr, a_row, k0, g_words, BLOCK_K) * g_scale
                acc += tl.where(offs_m[:, None, None] == mi, p[None, :, :], 0.0)
                if GATED:
                    pu = _words_dot(a_ptr, a_row, k0, u_words, BLOCK_K) * u_scale
                    acc_u += tl.where(offs_m[:, None, None] == mi, pu[None, :, :], 0.0)

    gate = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if GATED:
        up = tl.sum(acc_u, axis=2)
        out = gate / (1.0 + tl.exp(-gate)) * up
    else:
        out = gate * tl.load(route_w_ptr + rows, mask=offs_m < count, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_m < count)[:, None] & n_mask[None, :],
    )


@triton.jit
def _rows_f16(row_ptrs, row_mask, a_mult):
    """Activation rows [BLOCK_M, K] at row_ptrs as fp16, each scaled by its a_mult [BLOCK_M] (rows masked
    off as zeros)."""
    x = tl.load(row_ptrs, mask=row_mask[:, None], other=0.0).to(tl.float32)
    return (x * a_mult[:, None]).to(tl.float16)


@triton.jit
def _bd_operand(
    row_ptrs, row_mask, in_block, in_block_rows, a_mult, BLOCK_M: tl.constexpr, KBP: tl.constexpr,
    K_MAJOR: tl.constexpr, LOADED: tl.constexpr = False,
):  # fmt: skip
    """The block-diagonal activation operand [K, C] as fp16, rows scaled by a_mult. One activation row
    (BLOCK_M 1): its K values at row_ptrs [K], loaded once and placed in their scale block's column (K_MAJOR:
    built as [C, K] and transposed, so the loads come out K-contiguous; in_block [K, C]). Several rows: each
    row's K values loaded once at row_ptrs [BLOCK_M, K] (rows past the block's count as zeros), broadcast
    over the scale blocks as [KBP, BLOCK_M, K] and kept where in_block_rows [KBP, K] says the column lies
    in that block, so column c = b * BLOCK_M + m holds row m's block b. LOADED (one row): row_ptrs holds
    the values themselves, loaded a step ahead."""
    if BLOCK_M == 1:
        if LOADED:
            a = (row_ptrs.to(tl.float32) * a_mult).to(tl.float16)
        else:
            a = (tl.load(row_ptrs).to(tl.float32) * a_mult).to(tl.float16)
        if K_MAJOR:
            a = tl.trans(tl.where(tl.trans(in_block), a[None, :], 0.0))
        else:
            a = tl.where(in_block, a[:, None], 0.0)
    else:
        x = _rows_f16(row_ptrs, row_mask, a_mult)
        a = tl.where(in_block_rows[:, None, :], x[None, :, :], 0.0)  # [KBP, BLOCK_M, K]
        a = tl.trans(tl.reshape(a, (KBP * BLOCK_M, x.shape[1])))
    return a


@triton.jit
def _one_dot_position(n, BK: tl.constexpr):
    """Where column n of a row lies when every K step of BK columns is stored in ONE_DOT's K order (BK 0:
    columns in their own order). Column c = 8j + P + 4t of a step goes to position (P * W + j) * 2 + t, so a
    K step's activations load contiguously, piece P of the four at positions 2PW .. 2(P+1)W - 1."""
    if BK:
        c = n % BK
        n = n - c + ((c % 4) * (BK // 8) + c // 8) * 2 + (c // 4) % 2
    return n


@triton.jit
def one_dot_order_kernel(x_ptr, stride_x, y_ptr, stride_y, BK: tl.constexpr):
    """y = x with each K step of BK columns in ONE_DOT's K order (`_one_dot_position`); grid (rows, K / BK)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    tl.store(y_ptr + row * stride_y + _one_dot_position(c, BK), tl.load(x_ptr + row * stride_x + c))


@triton.jit
def _word_scales(ptrs, row_mask, ROWS: tl.constexpr, KB: tl.constexpr):
    """A K step's block scales [ROWS, KB] (E4M3, contiguous per row) as fp16 [ROWS, 2 KB], one a word of
    codes (word j lies in block j // 2). Loaded small and broadcast after: the compiler then moves the
    scales, not the decoded codes, into the dot operand's register layout (multiplying the codes by a
    [ROWS, 2 KB] load sent the whole operand through shared memory, 288 stores a thread and step)."""
    s = tl.load(ptrs, mask=row_mask[:, None], other=0.0).to(tl.float16)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, KB, 2)), (ROWS, 2 * KB))


@triton.jit
def _e2m1_k_step_f16(words, ROWS: tl.constexpr, W: tl.constexpr, scale=None):
    """A K step's codes [ROWS, W] uint32 as the fp16 operand [ROWS, 8W] of ONE_DOT's K order: the four
    `_e2m1_pair_f16` pieces side by side, piece P at columns 2PW .. 2(P+1)W - 1. scale (fp16 [ROWS, W], each
    word's block scale): the codes times their scales, still exact in fp16 (E2M1 * E4M3 * 2^-14 has at most
    6 significant bits, none below 2^-24, and stays under 0.17)."""
    lo0, hi0 = _e2m1_pair_f16(words, 0)
    lo1, hi1 = _e2m1_pair_f16(words, 1)
    lo2, hi2 = _e2m1_pair_f16(words, 2)
    lo3, hi3 = _e2m1_pair_f16(words, 3)
    p0 = tl.join(tl.join(lo0, hi0), tl.join(lo1, hi1))  # [ROWS, W, 2(t), 2(P)]
    p1 = tl.join(tl.join(lo2, hi2), tl.join(lo3, hi3))
    x = tl.join(p0, p1)  # [ROWS, W, t, P % 2, P // 2]
    w = tl.reshape(tl.permute(x, (0, 4, 3, 1, 2)), (ROWS, 8 * W))
    if scale is not None:
        s2 = tl.join(scale, scale)
        s4 = tl.join(s2, s2)
        s8 = tl.join(s4, s4)
        w = w * tl.reshape(tl.permute(s8, (0, 4, 3, 1, 2)), (ROWS, 8 * W))
    return w


@triton.jit
def moe_bd_kernel(
    a_ptr,  # as moe_gemm_kernel (NVFP4 weights only: the routed experts)
    stride_at,
    w_ptr,
    stride_we,
    stride_wn,
    ws_ptr,
    stride_wse,
    stride_wsn,
    wg_ptr,
    out_ptr,
    stride_ot,
    sorted_rows_ptr,
    expert_ids_ptr,
    block_rows_ptr,
    route_w_ptr,
    num_tokens,
    N,
    part_ptr,  # SPLIT_K > 1: float32 [SPLIT_K, rows, 2N if GATED else N], each split's partial sums
    stride_ps,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    KS: tl.constexpr,
    ROUTED: tl.constexpr,
    NVFP4: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per block (decode: 1 to 4), a power of two up to 16
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # programs per output tile, each over K / SPLIT_K (splitk_epilogue_kernel sums)
    STACK_GU: tl.constexpr = False,  # GEMM 1: gate and up rows in one dot of 2 * BLOCK_N rows
    K_MAJOR_A: tl.constexpr = False,  # 1-row blocks: build the activation operand as [C, 2W], then transpose
    ONE_DOT: tl.constexpr = False,  # the four nibble pieces of a K step in one dot of K = BLOCK_K
    N_FIRST: tl.constexpr = False,  # the grid's N tiles first, as moe_gemm_kernel's routed GEMMs
    PREFETCH_A: tl.constexpr = False,  # ONE_DOT, 1-row blocks: load the next step's activations a step ahead
    SCALE_W: tl.constexpr = False,  # ONE_DOT, BLOCK_M >= 16: a block's rows are the dot's columns (below)
    PERM_A: tl.constexpr = False,  # the activations' K steps stored in ONE_DOT's K order (one_dot_order_kernel)
    PERM_OUT: tl.constexpr = 0,  # store the output's columns in ONE_DOT's order of K steps of PERM_OUT
):
    """The decode form of moe_gemm_kernel on tensor cores (same blocks, same outputs).

    A block of one to four rows is too thin for a dot (16 columns at least), and NVFP4's scale changes
    every 16 columns of W. Both are met by one trick: the dot's columns are (scale block b of the K
    step, row m), and the activation operand is block-diagonal: column (b, m) holds row m's activations
    in block b's columns and zeros elsewhere. So dot(W codes, A) gives, per output row of W, one
    partial sum per scale block, which the block's scale then multiplies in float32. The codes go to the
    tensor cores as exact fp16 (E2M1 * 2^-14), decoded two per 32-bit operation; the activations as
    fp16, a row scaled by a power of two where its values would overflow fp16.

    SPLIT_K > 1 splits the reduction over the grid's third axis: a program sums its K / SPLIT_K columns and
    stores the float32 sums (global scale included) in part_ptr, and splitk_epilogue_kernel adds the splits
    in order and applies the SwiGLU or the route weight. At batch 1 the unsplit grid is a few hundred
    programs, about one wave and a sliver of an H200's SMs; smaller programs fill the waves.

    SCALE_W drops the block-diagonal operand for blocks of 16 or more rows (one expert's rows of a batch or a
    verify): the decoded codes are multiplied by their block scales in fp16 (exact, `_e2m1_k_step_f16`) and
    the dot's columns are the block's rows themselves, so an expert's weights are read once for all of its
    rows and the dot is as wide as the block, whatever the scale blocks.

    ONE_DOT's K order gathers a K step's activations two bytes at a time, which the pipeline cannot load
    ahead. PERM_A reads activations stored in that order (each K step permuted: x by one_dot_order_kernel,
    GEMM 1's output h by GEMM 1 itself through PERM_OUT), so a step's row loads contiguously.
    """
    tl.static_assert(ROUTED and NVFP4, "moe_bd_kernel: NVFP4 routed experts only")
    tl.static_assert(K % (SPLIT_K * BLOCK_K) == 0, "moe_bd_kernel: K must split into whole K steps")
    K_SPLIT: tl.constexpr = K // SPLIT_K
    k_lo = tl.program_id(2) * K_SPLIT
    tl.static_assert(
        not SCALE_W or (ONE_DOT and BLOCK_M >= 16), "moe_bd_kernel: SCALE_W takes ONE_DOT, 16 rows"
    )
    KB: tl.constexpr = BLOCK_K // 16  # scale blocks per K step
    # The dot's columns: (block b, row m) -> b * BLOCK_M + m, padded with empty blocks to 16 columns
    # (SCALE_W: the rows m alone).
    KBP: tl.constexpr = 1 if SCALE_W else (KB if KB * BLOCK_M >= 16 else 16 // BLOCK_M)
    C: tl.constexpr = KBP * BLOCK_M
    W: tl.constexpr = BLOCK_K // 8  # uint32 words of codes per row and K step
    pid_m, pid_n = _program_ids(N_FIRST)
    e, count, rows, a_rows = _block(
        pid_m, expert_ids_ptr, block_rows_ptr, sorted_rows_ptr, num_tokens, TOP_K, KS, ROUTED, GATED, BLOCK_M
    )
    if e < 0:
        return
    w_base, ws_base, g_gate, g_up = _expert_weights(
        w_ptr, ws_ptr, wg_ptr, e, stride_we, stride_wse, NVFP4, GATED
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # The rows of W a program reads: its BLOCK_N, or with STACK_GU its gate rows then its up rows (N + n),
    # so that one dot per K step serves both halves of the SwiGLU.
    STACKED: tl.constexpr = GATED and STACK_GU
    ROWS: tl.constexpr = 2 * BLOCK_N if STACKED else BLOCK_N
    offs_r = tl.arange(0, ROWS)
    n_r = pid_n * BLOCK_N + offs_r % BLOCK_N
    r_mask = n_r < N
    w_row = n_r + (offs_r // BLOCK_N) * N
    offs_j = tl.arange(0, W)
    offs_c = tl.arange(0, C)
    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < count
    a_row_m = a_rows * stride_at  # [BLOCK_M]: each row's activations (row 0's for rows past the count)
    offs_b = tl.arange(0, KBP)
    # The dot's K index k = 2j + t is nibble P + 4t of word j (columns 8j + P + 4t of the K step): the
    # order `_e2m1_pair_f16` yields them in. Word j lies in scale block j // 2.
    offs_k = tl.arange(0, 2 * W)
    col_k = 8 * (offs_k // 2) + 4 * (offs_k % 2)
    in_block = (offs_k // 4)[:, None] == (offs_c // BLOCK_M)[None, :]  # [2W, C]: k in column c's block
    in_block_rows = (offs_k // 4)[None, :] == offs_b[:, None]  # [KBP, 2W]: k in block b
    # ONE_DOT's K order: k = (P * W + j) * 2 + t is column 8j + P + 4t; word j lies in scale block j // 2.
    offs_k8 = tl.arange(0, 8 * W)
    j8 = (offs_k8 // 2) % W
    col8 = 8 * j8 + (offs_k8 // (2 * W)) + 4 * (offs_k8 % 2)
    if PERM_A:  # where the activations of those K indices lie in the step
        col8 = offs_k8
        col_k = offs_k
    in_block8 = (j8 // 2)[:, None] == (offs_c // BLOCK_M)[None, :]  # [8W, C]
    in_block8_rows = (j8 // 2)[None, :] == offs_b[:, None]  # [KBP, 8W]
    r0 = tl.load(sorted_rows_ptr + pid_m * BLOCK_M).to(tl.int64)  # a used block's first row
    a_row0 = (r0 // KS if GATED else r0) * stride_at
    # A K step's activations are at a_base + k + its columns: one row's, or each row's ([BLOCK_M, 1])
    if BLOCK_M == 1:
        a_base = a_ptr + a_row0
    else:
        a_base = a_ptr + a_row_m[:, None]
    wp = w_base.to(tl.pointer_type(tl.uint32))
    w_rows = wp + w_row[:, None] * (stride_wn // 4) + offs_j[None, :]
    s_rows = ws_base + w_row[:, None] * stride_wsn + (offs_c // BLOCK_M)[None, :]
    if KBP == KB:
        s_mask = r_mask[:, None]  # a row's scales of the step are contiguous: one vector load
    else:
        s_mask = r_mask[:, None] & (offs_c // BLOCK_M < KB)[None, :]
    # SCALE_W: a row's KB scales of the step
    sk_rows = ws_base + w_row[:, None] * stride_wsn + tl.arange(0, KB)[None, :]
    # fp16 holds |a| < 65504: a row whose largest |value| reaches 2^15 goes to the dot scaled down by a
    # power of two (exact), and its sums are scaled back up in float32. Rows in range are left as they are.
    if BLOCK_M == 1:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k_step in range(0, K_SPLIT, BLOCK_K):
            k0 = k_lo + k_step
            amax = tl.maximum(
                amax, tl.abs(tl.load(a_ptr + a_row0 + k0 + tl.arange(0, BLOCK_K)).to(tl.float32))
            )
        shift = tl.maximum(tl.ceil(tl.log2(tl.maximum(tl.max(amax, axis=0), 1.0))) - 15.0, 0.0)
    else:
        amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k_step in range(0, K_SPLIT, BLOCK_K):
            k0 = k_lo + k_step
            v = tl.load(
                a_ptr + a_row_m[:, None] + (k0 + tl.arange(0, BLOCK_K))[None, :],
                mask=m_valid[:, None],
                other=0.0,
            )
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        shift = tl.maximum(tl.ceil(tl.log2(tl.maximum(tl.max(amax, axis=1), 1.0))) - 15.0, 0.0)  # [BLOCK_M]
    a_mult = tl.exp2(-shift)
    acc = tl.zeros([ROWS, C], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, C], dtype=tl.float32)  # the up rows when not STACKED
    # The activations in ONE_DOT's K order are 2-byte gathers, which Triton's pipeline does not issue ahead
    # (no cp.async under 4 bytes): each step waited on them (Nsight Compute, H100, T = 1: a third of the
    # stall cycles on L1TEX). PREFETCH_A loads them one step ahead into registers, two values a thread.
    PREFETCH: tl.constexpr = PREFETCH_A and ONE_DOT and BLOCK_M == 1
    if PREFETCH:
        a_next = tl.load(a_base + k_lo + col8)
    for k_step in range(0, K_SPLIT, BLOCK_K):
        k0 = k_lo + k_step
        g_words = tl.load(w_rows + k0 // 8, mask=r_mask[:, None], other=0)
        if GATED and not STACKED:
            u_words = tl.load(w_rows + N * (stride_wn // 4) + k0 // 8, mask=n_mask[:, None], other=0)
        if SCALE_W:
            a = tl.trans(_rows_f16(a_base + k0 + col8[None, :], m_valid, a_mult))  # [8W, BLOCK_M]
            g_sw = _word_scales(sk_rows + k0 // 16, r_mask, ROWS, KB)
            acc = tl.dot(_e2m1_k_step_f16(g_words, ROWS, W, g_sw), a, acc)
            if GATED and not STACKED:
                u_sw = _word_scales(sk_rows + N * stride_wsn + k0 // 16, r_mask, BLOCK_N, KB)
                acc_u = tl.dot(_e2m1_k_step_f16(u_words, BLOCK_N, W, u_sw), a, acc_u)
        else:
            g_scale = tl.load(s_rows + k0 // 16, mask=s_mask, other=0.0).to(tl.float32)
            if GATED and not STACKED:
                u_scale = tl.load(s_rows + N * stride_wsn + k0 // 16, mask=s_mask, other=0.0).to(tl.float32)
            if ONE_DOT:
                # k = (P * W + j) * 2 + t: piece P's pairs side by side along K, so one operand build, one
                # barrier and one wgmma wait per K step instead of four.
                if PREFETCH:
                    a_vals = a_next
                    k_ahead = tl.minimum(
                        k0 + BLOCK_K, k_lo + K_SPLIT - BLOCK_K
                    )  # the last step reloads its own
                    a_next = tl.load(a_base + k_ahead + col8)
                    a = _bd_operand(
                        a_vals, m_valid, in_block8, in_block8_rows, a_mult, BLOCK_M, KBP, True, True
                    )
                else:
                    a_ptrs = a_base + k0 + col8
                    a = _bd_operand(a_ptrs, m_valid, in_block8, in_block8_rows, a_mult, BLOCK_M, KBP, True)
                pg = tl.dot(_e2m1_k_step_f16(g_words, ROWS, W), a)
                if GATED and not STACKED:
                    pu = tl.dot(_e2m1_k_step_f16(u_words, BLOCK_N, W), a)
            else:
                pg = tl.zeros([ROWS, C], dtype=tl.float32)
                pu = tl.zeros([BLOCK_N, C], dtype=tl.float32)
                for P in tl.static_range(4):
                    a_ptrs = a_base + (k0 + (2 * W * P if PERM_A else P)) + col_k
                    a = _bd_operand(a_ptrs, m_valid, in_block, in_block_rows, a_mult, BLOCK_M, KBP, K_MAJOR_A)
                    lo, hi = _e2m1_pair_f16(g_words, P)
                    pg = tl.dot(tl.reshape(tl.join(lo, hi), (ROWS, 2 * W)), a, pg)
                    if GATED and not STACKED:
                        lo, hi = _e2m1_pair_f16(u_words, P)
                        pu = tl.dot(tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * W)), a, pu)
            acc += pg * g_scale
            if GATED and not STACKED:
                acc_u += pu * u_scale
    # Sum the blocks' partial sums: [BLOCK_N, KB, BLOCK_M] -> [BLOCK_N, BLOCK_M], times the global
    # scale and 2^14 (the codes' fp16 placement).
    if BLOCK_M == 1:
        out_mult = tl.exp2(shift)
    else:
        out_mult = tl.exp2(shift)[None, :]  # [1, BLOCK_M]: each row's own scaling, undone
    sums = tl.sum(tl.reshape(acc, (ROWS, KBP, BLOCK_M)), axis=1) * out_mult  # [ROWS, BLOCK_M]
    if STACKED:
        sums = sums * (tl.where(offs_r < BLOCK_N, g_gate, g_up) * 16384.0)[:, None]
        gate, up = tl.split(tl.permute(tl.reshape(sums, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    else:
        gate = sums * (g_gate * 16384.0)
        if GATED:
            up = tl.sum(tl.reshape(acc_u, (BLOCK_N, KBP, BLOCK_M)), axis=1) * out_mult * (g_up * 16384.0)
    store_mask = (offs_m < count)[None, :] & n_mask[:, None]
    if SPLIT_K > 1:  # this split's sums, [n, row] -> part[split, row, n] (gate) and [.., N + n] (up)
        part = part_ptr + tl.program_id(2).to(tl.int64) * stride_ps + offs_n[:, None]
        row_w = 2 * N if GATED else N
        tl.store(part + rows[None, :] * row_w, gate, mask=store_mask)
        if GATED:
            tl.store(part + rows[None, :] * row_w + N, up, mask=store_mask)
        return
    if GATED:
        out = gate / (1.0 + tl.exp(-gate)) * up
    else:
        out = gate * tl.load(route_w_ptr + rows, mask=offs_m < count, other=0.0)[None, :]
    tl.store(
        out_ptr + rows[None, :] * stride_ot + _one_dot_position(offs_n, PERM_OUT)[:, None],
        out.to(out_ptr.dtype.element_ty),
        mask=store_mask,
    )


@triton.jit
def splitk_epilogue_kernel(
    part_ptr,  # float32 [SPLIT_K, rows, 2N if GATED else N]: moe_bd_kernel's partial sums
    stride_ps,
    out_ptr,
    stride_ot,
    sorted_rows_ptr,
    expert_ids_ptr,
    block_rows_ptr,
    route_w_ptr,
    num_tokens,
    N,
    TOP_K: tl.constexpr,
    KS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PERM_OUT: tl.constexpr = 0,  # as moe_bd_kernel's
):
    """moe_bd_kernel's output from its SPLIT_K partial sums, over the same blocks and N tiles: the splits
    added in their order (the same sum on every run), then GEMM 1's SwiGLU or GEMM 2's route weight."""
    pid_m = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    e, count, rows, a_rows = _block(
        pid_m, expert_ids_ptr, block_rows_ptr, sorted_rows_ptr, num_tokens, TOP_K, KS, True, GATED, BLOCK_M
    )
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < count)[:, None] & (offs_n < N)[None, :]
    row_w = 2 * N if GATED else N
    part = part_ptr + rows[:, None] * row_w + offs_n[None, :]
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        gate += tl.load(part + s * stride_ps, mask=mask, other=0.0)
        if GATED:
            up += tl.load(part + s * stride_ps + N, mask=mask, other=0.0)
    if GATED:
        out = gate / (1.0 + tl.exp(-gate)) * up
    else:
        out = gate * tl.load(route_w_ptr + rows, mask=offs_m < count, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + _one_dot_position(offs_n, PERM_OUT)[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )

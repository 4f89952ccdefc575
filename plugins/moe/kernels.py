"""Triton kernels of `inkling::expert_sink_moe` (@triton.jit code only; launcher.py drives them).

Rows. Each token t owns KS = top_k + S rows r = t*KS + j of the intermediate and output buffers:
j < top_k for its routed choices, j = top_k + s for shared expert s. The combine sums a token's KS
rows, so no atomics and a deterministic result.

1. route_kernel (one program per token): softmax over E+S in float32, top-k over the routed E with
   ties to the lower index, the routing weight of every row, and each choice's rank within its
   expert (an atomic count per expert).
2. align_kernel: experts' row ranges padded to BLOCK_M (prefix sums of the counts, recomputed by
   every program), each routed row scattered to its place, and per block its expert and row count.
   Every size comes from static bounds: blocks past the end get expert -1 and exit at once.
3. moe_gemm_kernel: a grouped GEMM over those blocks, out^T = W @ A^T, so the dequantized weight
   tile is the left operand and a block of few tokens is the right one (small BLOCK_M for decode).
   NVFP4 weights are dequantized in registers (W4A16): E2M1 code -> fp16 bits, times the float32
   block scale times the global scale, as INKLING_SPEC §9. The same kernel runs the bf16 shared
   experts (ROUTED=False, NVFP4=False). GATED: gate and up tiles, SwiGLU epilogue (GEMM 1);
   otherwise the rows are scaled by their routing weight (GEMM 2).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_kernel(
    logits_ptr,  # [T, E+S], x @ router.T in the activation dtype
    stride_lt,
    topk_ids_ptr,  # int32 [T*TOP_K]
    rank_ptr,  # int32 [T*TOP_K]
    counts_ptr,  # int32 [E], zeroed
    route_w_ptr,  # float32 [T*KS]
    E,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    KS: tl.constexpr = TOP_K + NUM_SHARED
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E + NUM_SHARED
    z = tl.load(logits_ptr + t * stride_lt + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)
    for s in tl.static_range(NUM_SHARED):
        tl.store(route_w_ptr + t * KS + TOP_K + s, tl.sum(tl.where(offs == E + s, p, 0.0), axis=0))
    # NaN rows (a CUDA-graph bucket's padding rows may read garbage) still pick k distinct valid experts.
    pr = tl.where(offs < E, tl.where(p == p, p, -0.5), -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(pr, axis=0)
        idx = tl.min(tl.where(pr == best, offs, BLOCK_E), axis=0)  # ties: the lower index
        tl.store(route_w_ptr + t * KS + j, best)
        tl.store(topk_ids_ptr + t * TOP_K + j, idx)
        rank = tl.atomic_add(counts_ptr + idx, 1)
        tl.store(rank_ptr + t * TOP_K + j, rank)
        pr = tl.where(offs == idx, -1.0, pr)


@triton.jit
def align_kernel(
    topk_ids_ptr,  # int32 [T*TOP_K]
    rank_ptr,  # int32 [T*TOP_K]
    counts_ptr,  # int32 [E]
    sorted_rows_ptr,  # int32 [num_blocks*BLOCK_M]; padding entries are left unwritten
    expert_ids_ptr,  # int32 [num_blocks]; -1 past the last used block
    block_rows_ptr,  # int32 [num_blocks]; valid rows of each block
    num_entries,
    num_blocks,
    num_entry_programs,
    E,
    TOP_K: tl.constexpr,
    KS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    cnt = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end_e = tl.cumsum(padded, axis=0)
    start_e = end_e - padded
    if pid < num_entry_programs:
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        m = offs < num_entries
        e = tl.load(topk_ids_ptr + offs, mask=m, other=0)
        rank = tl.load(rank_ptr + offs, mask=m, other=0)
        start = tl.sum(tl.where(e[:, None] == offs_e[None, :], start_e[None, :], 0), axis=1)
        row = (offs // TOP_K) * KS + offs % TOP_K
        tl.store(sorted_rows_ptr + start + rank, row, mask=m)
    else:
        offs_b = (pid - num_entry_programs) * CHUNK + tl.arange(0, CHUNK)
        b_mask = offs_b < num_blocks
        pos = offs_b * BLOCK_M
        ex = tl.sum(((end_e[None, :] <= pos[:, None]) & e_mask[None, :]).to(tl.int32), axis=1)
        used = ex < E
        sel = offs_e[None, :] == ex[:, None]
        start = tl.sum(tl.where(sel, start_e[None, :], 0), axis=1)
        c = tl.sum(tl.where(sel, cnt[None, :], 0), axis=1)
        rows = tl.minimum(c - (pos - start), BLOCK_M)
        tl.store(expert_ids_ptr + offs_b, tl.where(used, ex, -1), mask=b_mask)
        tl.store(block_rows_ptr + offs_b, tl.where(used, rows, 0), mask=b_mask)


@triton.jit
def _block(
    pid_m, expert_ids_ptr, block_rows_ptr, sorted_rows_ptr, num_tokens,
    TOP_K: tl.constexpr, KS: tl.constexpr, ROUTED: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Block pid_m of a GEMM: (its expert, -1 for an unused routed block; its row count; its rows r of the
    output buffer and the activation rows they read, int64 [BLOCK_M], valid below the count)."""
    offs_m = tl.arange(0, BLOCK_M)
    if ROUTED:
        e = tl.load(expert_ids_ptr + pid_m)
        count = tl.load(block_rows_ptr + pid_m)  # 0 for an unused block
        rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + offs_m, mask=offs_m < count, other=0)
    else:  # the shared experts: every token, in blocks of BLOCK_M per shared expert
        blocks_per_expert = tl.cdiv(num_tokens, BLOCK_M)
        e = pid_m // blocks_per_expert
        tok0 = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.minimum(num_tokens - tok0, BLOCK_M)
        rows = (tok0 + offs_m) * KS + TOP_K + e
    rows = rows.to(tl.int64)
    if GATED:  # GEMM 1 reads the token's x; GEMM 2 the row's own h
        a_rows = rows // KS
    else:
        a_rows = rows
    return e, count, rows, a_rows


@triton.jit
def _expert_weights(
    w_ptr, ws_ptr, wg_ptr, e, stride_we, stride_wse, NVFP4: tl.constexpr, GATED: tl.constexpr
):
    """Expert e's weights and block scales, and its (gate, up) global scales (1.0 for bf16 weights)."""
    e64 = e.to(tl.int64)
    if NVFP4:
        if GATED:
            g_gate = tl.load(wg_ptr + e64 * 2)
            g_up = tl.load(wg_ptr + e64 * 2 + 1)
        else:
            g_gate = tl.load(wg_ptr + e64)
            g_up = g_gate
    else:
        g_gate = 1.0
        g_up = 1.0
    return w_ptr + e64 * stride_we, ws_ptr + e64 * stride_wse, g_gate, g_up


@triton.jit
def _nvfp4_tile(
    w_ptr, ws_ptr, global_scale, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K: tl.constexpr
):
    """The E2M1 codes [BLOCK_N, BLOCK_K // 2] (two per byte, low nibble = even column) and the block
    scales [BLOCK_N, BLOCK_K // 16] of W's rows offs_n, columns k0..k0+BLOCK_K-1. The scales are §9's
    float32(float32(scale) * scale_2), times 2^14 to undo the fp16 placement of `_e2m1_f16`."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=n_mask[:, None], other=0)
    offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    scale = tl.load(ws_ptr + offs_n[:, None] * stride_wsn + offs_s[None, :], mask=n_mask[:, None], other=0.0)
    return codes, (scale.to(tl.float32) * global_scale) * 16384.0


@triton.jit
def _e2m1_f16(q):
    """E2M1 codes s.e1e0.m -> fp16 s.000e1e0.m000000000: exactly the E2M1 value times 2^-14 (subnormals
    included), so a float32 product with `_nvfp4_tile`'s scale is bit-exact §9."""
    return (((q & 7).to(tl.uint16) << 9) | ((q & 8).to(tl.uint16) << 12)).to(tl.float16, bitcast=True)


@triton.jit
def _weight_tile(
    w_ptr,  # this expert's weights
    ws_ptr,  # this expert's block scales (NVFP4)
    global_scale,  # float32 scalar (NVFP4)
    offs_n,
    n_mask,
    k0,
    stride_wn,
    stride_wsn,
    NVFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] of W (rows offs_n, columns k0..k0+BLOCK_K-1) in DTYPE."""
    if NVFP4:
        codes, scale = _nvfp4_tile(
            w_ptr, ws_ptr, global_scale, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K
        )
        scale = tl.reshape(
            tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 16)), (BLOCK_N, BLOCK_K)
        )
        q = tl.reshape(tl.join(codes & 0xF, codes >> 4), (BLOCK_N, BLOCK_K))  # low nibble = even column
        w = _e2m1_f16(q).to(tl.float32) * scale
        return w.to(DTYPE)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        return w.to(DTYPE)


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # GEMM 1: x [T, H] (row t); GEMM 2: h [T*KS, I] (row r)
    stride_at,
    w_ptr,  # NVFP4 codes [E, N(*2), K/2] or bf16 [S, N(*2), K]
    stride_we,
    stride_wn,
    ws_ptr,  # block scales [E, N(*2), K/16] (NVFP4)
    stride_wse,
    stride_wsn,
    wg_ptr,  # global scales [E, 2] (GATED) or [E] (NVFP4)
    out_ptr,  # GEMM 1: h [T*KS, I]; GEMM 2: out [T*KS, H]
    stride_ot,
    sorted_rows_ptr,  # ROUTED: int32 rows r by expert block
    expert_ids_ptr,
    block_rows_ptr,
    route_w_ptr,  # float32 [T*KS] (not GATED)
    num_tokens,
    N,
    K: tl.constexpr,  # constexpr: the loop bound must be static (pipelining, and the interpreter)
    TOP_K: tl.constexpr,
    KS: tl.constexpr,
    ROUTED: tl.constexpr,
    NVFP4: tl.constexpr,
    GATED: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, count, rows, a_rows = _block(
        pid_m, expert_ids_ptr, block_rows_ptr, sorted_rows_ptr, num_tokens, TOP_K, KS, ROUTED, GATED, BLOCK_M
    )
    if e < 0:
        return
    m_mask = tl.arange(0, BLOCK_M) < count
    w_base, ws_base, g_gate, g_up = _expert_weights(
        w_ptr, ws_ptr, wg_ptr, e, stride_we, stride_wse, NVFP4, GATED
    )

    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[None, :] * stride_at + offs_k[:, None], mask=m_mask[None, :], other=0.0)
        w = _weight_tile(
            w_base, ws_base, g_gate, offs_n, n_mask, k0, stride_wn, stride_wsn, NVFP4, BLOCK_N, BLOCK_K, DTYPE
        )
        if IEEE:
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
        if GATED:
            wu = _weight_tile(
                w_base + N * stride_wn, ws_base + N * stride_wsn, g_up, offs_n, n_mask, k0,
                stride_wn, stride_wsn, NVFP4, BLOCK_N, BLOCK_K, DTYPE,
            )  # fmt: skip
            if IEEE:
                acc_u = tl.dot(wu, a, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(wu, a, acc_u)

    if GATED:
        # SwiGLU in the activation dtype's spirit: silu(gate) * up, computed in float32.
        out = acc / (1.0 + tl.exp(-acc)) * acc_u
    else:
        out = acc * tl.load(route_w_ptr + rows, mask=m_mask, other=0.0)[None, :]
    tl.store(
        out_ptr + rows[None, :] * stride_ot + offs_n[:, None],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[None, :] & n_mask[:, None],
    )


@triton.jit
def _e2m1_word_f32(words, P: tl.constexpr):
    """Nibble P (0 = lowest) of each uint32 word of E2M1 codes, as float32 E2M1 * 2^-14 (`_e2m1_f16`'s
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
def _words_tile(
    w_ptr, ws_ptr, global_scale, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K: tl.constexpr
):
    """The codes of W's rows offs_n, columns k0..k0+BLOCK_K-1, as uint32 words [BLOCK_N, BLOCK_K // 8],
    and each word's block scale (a 16-column block is two words) with the global scale and 2^14 folded in."""
    offs_j = tl.arange(0, BLOCK_K // 8)
    wp = w_ptr.to(tl.pointer_type(tl.uint32))
    words = tl.load(
        wp + offs_n[:, None] * (stride_wn // 4) + (k0 // 8 + offs_j)[None, :], mask=n_mask[:, None], other=0
    )
    scale = tl.load(
        ws_ptr + offs_n[:, None] * stride_wsn + (k0 // 16 + offs_j // 2)[None, :],
        mask=n_mask[:, None],
        other=0.0,
    )
    return words, (scale.to(tl.float32) * global_scale) * 16384.0


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
def _e2m1_pair_f16(words, P: tl.constexpr):
    """Nibbles P and P + 4 (P < 4) of each uint32 word of E2M1 codes as two fp16 tensors, in
    `_e2m1_f16`'s placement (E2M1 * 2^-14). The two codes land in the two halves of one 32-bit value
    with one mask for magnitudes and one for signs, so the decode costs a few operations per pair."""
    if 4 * P <= 9:
        mag = (words << (9 - 4 * P)) & 0x0E000E00  # e1 e0 m -> bits 11..9 (and 27..25)
    else:
        mag = (words >> (4 * P - 9)) & 0x0E000E00
    h = mag | ((words << (12 - 4 * P)) & 0x80008000)  # s -> bits 15 and 31
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


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
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    KS: tl.constexpr,
    ROUTED: tl.constexpr,
    NVFP4: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per block (decode: 1 to 4), a power of two up to 16
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STACK_GU: tl.constexpr = False,  # GEMM 1: gate and up rows in one dot of 2 * BLOCK_N rows
):
    """The decode form of moe_gemm_kernel on tensor cores (same blocks, same outputs).

    A block of one to four rows is too thin for a dot (16 columns at least), and NVFP4's scale changes
    every 16 columns of W. Both are met by one trick: the dot's columns are (scale block b of the K
    step, row m), and the activation operand is block-diagonal: column (b, m) holds row m's activations
    in block b's columns and zeros elsewhere. So dot(W codes, A) gives, per output row of W, one
    partial sum per scale block, which the block's scale then multiplies in float32. The codes go to the
    tensor cores as exact fp16 (E2M1 * 2^-14), decoded two per 32-bit operation; the activations as
    fp16, a row scaled by a power of two where its values would overflow fp16.
    """
    tl.static_assert(ROUTED and NVFP4, "moe_bd_kernel: NVFP4 routed experts only")
    KB: tl.constexpr = BLOCK_K // 16  # scale blocks per K step
    # The dot's columns: (block b, row m) -> b * BLOCK_M + m, padded with empty blocks to 16 columns.
    KBP: tl.constexpr = KB if KB * BLOCK_M >= 16 else 16 // BLOCK_M
    C: tl.constexpr = KBP * BLOCK_M
    W: tl.constexpr = BLOCK_K // 8  # uint32 words of codes per row and K step
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    m_of_c = offs_c % BLOCK_M
    c_valid = m_of_c < count
    r_c = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + m_of_c, mask=c_valid, other=0).to(tl.int64)
    a_row_c = (r_c // KS if GATED else r_c) * stride_at
    # The dot's K index k = 2j + t is nibble P + 4t of word j (columns 8j + P + 4t of the K step): the
    # order `_e2m1_pair_f16` yields them in. Word j lies in scale block j // 2.
    offs_k = tl.arange(0, 2 * W)
    col_k = 8 * (offs_k // 2) + 4 * (offs_k % 2)
    a_mask = ((offs_k // 4)[:, None] == (offs_c // BLOCK_M)[None, :]) & c_valid[None, :]
    a_ptrs = a_ptr + (a_row_c[None, :] + col_k[:, None])
    r0 = tl.load(sorted_rows_ptr + pid_m * BLOCK_M).to(tl.int64)  # a used block's first row
    a_row0 = (r0 // KS if GATED else r0) * stride_at
    wp = w_base.to(tl.pointer_type(tl.uint32))
    w_rows = wp + w_row[:, None] * (stride_wn // 4) + offs_j[None, :]
    s_rows = ws_base + w_row[:, None] * stride_wsn + (offs_c // BLOCK_M)[None, :]
    if KBP == KB:
        s_mask = r_mask[:, None]  # a row's scales of the step are contiguous: one vector load
    else:
        s_mask = r_mask[:, None] & (offs_c // BLOCK_M < KB)[None, :]
    in_block = (offs_k // 4)[:, None] == (offs_c // BLOCK_M)[None, :]
    # fp16 holds |a| < 65504: a row whose largest |value| reaches 2^15 goes to the dot scaled down by a
    # power of two (exact), and its sums are scaled back up in float32. Rows in range are left as they are.
    if BLOCK_M == 1:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(
                amax, tl.abs(tl.load(a_ptr + a_row0 + k0 + tl.arange(0, BLOCK_K)).to(tl.float32))
            )
        shift = tl.maximum(tl.ceil(tl.log2(tl.maximum(tl.max(amax, axis=0), 1.0))) - 15.0, 0.0)
    else:
        amax = tl.zeros([BLOCK_K, C], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(
                a_ptr + a_row_c[None, :] + (k0 + tl.arange(0, BLOCK_K))[:, None],
                mask=c_valid[None, :],
                other=0.0,
            )
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        shift = tl.maximum(tl.ceil(tl.log2(tl.maximum(tl.max(amax, axis=0), 1.0))) - 15.0, 0.0)  # [C]
    a_mult = tl.exp2(-shift)
    acc = tl.zeros([ROWS, C], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, C], dtype=tl.float32)  # the up rows when not STACKED
    for k0 in range(0, K, BLOCK_K):
        g_words = tl.load(w_rows + k0 // 8, mask=r_mask[:, None], other=0)
        g_scale = tl.load(s_rows + k0 // 16, mask=s_mask, other=0.0).to(tl.float32)
        if GATED and not STACKED:
            u_words = tl.load(w_rows + N * (stride_wn // 4) + k0 // 8, mask=n_mask[:, None], other=0)
            u_scale = tl.load(s_rows + N * stride_wsn + k0 // 16, mask=s_mask, other=0.0).to(tl.float32)
        pg = tl.zeros([ROWS, C], dtype=tl.float32)
        pu = tl.zeros([BLOCK_N, C], dtype=tl.float32)
        for P in tl.static_range(4):
            if BLOCK_M == 1:  # one activation row: load its 2W columns once, place them by block
                a = (tl.load(a_ptr + a_row0 + (k0 + P) + col_k).to(tl.float32) * a_mult).to(tl.float16)
                a = tl.where(in_block, a[:, None], 0.0)
            else:
                a = tl.load(a_ptrs + (k0 + P), mask=a_mask, other=0.0).to(tl.float32)
                a = (a * a_mult[None, :]).to(tl.float16)
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
        out_mult = tl.exp2(shift)[None, :]
    sums = tl.sum(tl.reshape(acc * out_mult, (ROWS, KBP, BLOCK_M)), axis=1)  # [ROWS, BLOCK_M]
    offs_m = tl.arange(0, BLOCK_M)
    if STACKED:
        sums = sums * (tl.where(offs_r < BLOCK_N, g_gate, g_up) * 16384.0)[:, None]
        gate, up = tl.split(tl.permute(tl.reshape(sums, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    else:
        gate = sums * (g_gate * 16384.0)
        if GATED:
            up = tl.sum(tl.reshape(acc_u * out_mult, (BLOCK_N, KBP, BLOCK_M)), axis=1) * (g_up * 16384.0)
    if GATED:
        out = gate / (1.0 + tl.exp(-gate)) * up
    else:
        out = gate * tl.load(route_w_ptr + rows, mask=offs_m < count, other=0.0)[None, :]
    tl.store(
        out_ptr + rows[None, :] * stride_ot + offs_n[:, None],
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_m < count)[None, :] & n_mask[:, None],
    )

"""Triton kernels of `inkling::sigmoid_sink_moe` (@triton.jit code only; launcher.py drives them).

Rows. Each token t owns KS = top_k + S rows r = t*KS + j of the intermediate and output buffers:
j < top_k for its routed choices, j = top_k + s for shared expert s. The combine sums a token's KS
rows, so no atomics and a deterministic result.

1. route_kernel (one program per token): the sigmoid router in float32 (top-k of sigmoid + selection bias
   over the routed E, ties to the lower index), the routing weight of every row, and each choice's rank
   within its expert (an atomic count per expert).
2. align_kernel: experts' row ranges padded to BLOCK_M (prefix sums of the counts, recomputed by
   every program), each routed row scattered to its place, and per block its expert and row count.
   Every size comes from static bounds: blocks past the end get expert -1 and exit at once.
3. moe_gemm_kernel: a grouped GEMM over those blocks, out^T = W @ A^T, so the dequantized weight
   tile is the left operand and a block of few tokens is the right one (small BLOCK_M for decode).
   NVFP4 weights are dequantized in registers (W4A16): E2M1 codes, read as uint32 words -> fp16 bits,
   times the float32 block scale times the global scale, as INKLING_SPEC §9. In bf16 on CUDA (PRMT) the
   codes go to bf16 by byte lookups and times the block scale (exact in bf16), and the global scale
   multiplies the float32 sums. The same kernel runs the bf16 shared experts (ROUTED=False,
   NVFP4=False). GATED: gate and up tiles, SwiGLU epilogue (GEMM 1); otherwise the rows are scaled by
   their routing weight (GEMM 2).

The decode forms of GEMM 1 and 2 (a few rows per block) are in decode_kernels.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_kernel(
    logits_ptr,  # [T, E+S], float32 (x @ gate.T summed in float32)
    stride_lt,
    bias_ptr,  # float32 [E], the selection bias
    scale_ptr,  # float32 [1], the learned global scale
    route_scale,
    topk_ids_ptr,  # int32 [T*TOP_K]
    rank_ptr,  # int32 [T*TOP_K]
    counts_ptr,  # int32 [E], zeroed
    route_w_ptr,  # float32 [T*KS]
    sorted_rows_ptr,  # DIRECT: the GEMMs' block arrays (align_kernel's), one entry per block
    expert_ids_ptr,
    block_rows_ptr,
    E,
    expert_offset,  # expert parallelism: this rank's experts are expert_offset .. + num_local - 1 of the E
    num_local,  # (0 and E without it); the others' entries get no block and a weight of 0
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K_P2: tl.constexpr,  # next_power_of_2(TOP_K)
    DIRECT: tl.constexpr = False,  # 1-row blocks: entry t * TOP_K + j is block t * TOP_K + j, no align
    load_ptr=None,  # COUNT: int32 [E], tokens routed to each expert (all E, whichever rank holds them)
    row_valid_ptr=None,  # COUNT: bool [T], the rows that are tokens (not a graph bucket's padding)
    COUNT: tl.constexpr = False,
):
    """INKLING_SPEC §3.6: the choice is top-k of sigmoid(z) + bias over the routed E; a chosen expert's or
    shared expert's weight is its sigmoid over the sum of the k chosen and the S shared sigmoids, times
    route_scale and the global scale."""
    KS: tl.constexpr = TOP_K + NUM_SHARED
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E + NUM_SHARED
    z = tl.load(logits_ptr + t * stride_lt + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.where(valid, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    choice = p + tl.load(bias_ptr + offs, mask=offs < E, other=0.0)
    # NaN rows (a CUDA-graph bucket's padding rows may read garbage) still pick k distinct valid experts.
    pr = tl.where(offs < E, tl.where(choice == choice, choice, -1e30), -3e38)
    offs_k = tl.arange(0, TOP_K_P2)
    ids = tl.zeros([TOP_K_P2], dtype=tl.int32)
    picked = tl.zeros([TOP_K_P2], dtype=tl.float32)  # p of each choice
    for j in tl.static_range(TOP_K):
        best = tl.max(pr, axis=0)
        idx = tl.min(tl.where(pr == best, offs, BLOCK_E), axis=0)  # ties: the lower index
        ids = tl.where(offs_k == j, idx, ids)
        picked = tl.where(offs_k == j, tl.sum(tl.where(offs == idx, p, 0.0), axis=0), picked)
        pr = tl.where(offs == idx, -3e38, pr)
    shared = tl.where(offs >= E, p, 0.0)  # the shared experts' p, in their columns
    norm = route_scale * tl.load(scale_ptr) / (tl.sum(picked, axis=0) + tl.sum(shared, axis=0))
    picked = picked * norm
    shared = shared * norm
    for s in tl.static_range(NUM_SHARED):
        tl.store(route_w_ptr + t * KS + TOP_K + s, tl.sum(tl.where(offs == E + s, shared, 0.0), axis=0))
    # Expert parallelism: the experts held here, by their index in this rank's stacks; another rank's
    # entry keeps weight 0, which combine_kernel(MASKED) reads as "no output row".
    if COUNT:  # the expert load (runtime/expert_load.py): one vector of atomics, as the ranks below
        counted = (offs_k < TOP_K) & (tl.load(row_valid_ptr + t) != 0)
        tl.atomic_add(load_ptr + ids, 1, mask=counted)
    ids = ids - expert_offset
    mine = (ids >= 0) & (ids < num_local)
    tl.store(route_w_ptr + t * KS + offs_k, tl.where(mine, picked, 0.0), mask=offs_k < TOP_K)
    # The k experts are distinct: one vector of atomics takes their ranks (k serial atomics, each waiting
    # for its return, took most of this kernel's 6.5 us on the H200).
    k_mask = offs_k < TOP_K
    if DIRECT:
        # Blocks of one row need no grouping by expert: each entry is its own block, in entry order (the
        # GEMMs' grids run a weight tile's blocks side by side, so two rows of one expert still share its
        # reads through L2). No counts, no atomics, no align_kernel launch.
        tl.store(sorted_rows_ptr + t * TOP_K + offs_k, t * KS + offs_k, mask=k_mask)
        tl.store(expert_ids_ptr + t * TOP_K + offs_k, tl.where(mine, ids, -1), mask=k_mask)
        tl.store(block_rows_ptr + t * TOP_K + offs_k, mine.to(tl.int32), mask=k_mask)
    else:
        tl.store(topk_ids_ptr + t * TOP_K + offs_k, tl.where(mine, ids, -1), mask=k_mask)
        rank = tl.atomic_add(counts_ptr + ids, 1, mask=k_mask & mine)
        tl.store(rank_ptr + t * TOP_K + offs_k, rank, mask=k_mask & mine)


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
        m = m & (e >= 0)  # -1: another rank's expert (route_kernel)
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
def combine_kernel(
    out_ptr,  # [T*KS, H]: row t*KS + k holds expert slot k's weighted output for token t
    y_ptr,  # [T, H]
    route_w_ptr,  # float32 [T*KS]: MASKED reads a slot of weight 0 as one no GEMM wrote
    H,
    KS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MASKED: tl.constexpr = False,  # expert parallelism: another rank's experts' slots hold no output
):
    """y[t] = sum over the KS slots of out[t*KS + k], in float32, slot by slot (one program per token and H
    chunk). Each thread adds its own columns of the KS rows, so there is no reduction across threads and
    all KS loads are in flight at once."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(KS):
        row = tl.load(out_ptr + (t * KS + k) * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        if MASKED:  # the row of an unwritten slot may hold anything, NaN included: select, not multiply
            row = tl.where(tl.load(route_w_ptr + t * KS + k) != 0.0, row, 0.0)
        acc += row
    tl.store(y_ptr + t * H + offs_h, acc.to(y_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _program_ids(N_FIRST: tl.constexpr):
    """(pid_m, pid_n) of a GEMM program: the grid is (blocks, N tiles), or with N_FIRST (N tiles, blocks).

    N tiles first suits the routed GEMMs: the programs running at once then share a few blocks'
    activation rows (re-read from L2, not DRAM, for each N tile) and stream a few experts' weights, each
    read once per block either way (H200, prefill T = 4096: with blocks first, GEMM 2 moved 10 GB of DRAM
    traffic for 3.1 GB of distinct bytes, Nsight Compute, s17c; N first took it from 3794 to 3332 us,
    s17d). Blocks first suits the shared experts: every block reads the same expert, whose tiles are then
    reused from L2 (with N first, their GEMM 1 went from 1107 to 1221 us at T = 4096, s17d)."""
    if N_FIRST:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    return pid_m, pid_n


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
def _words_and_scales(
    w_ptr, ws_ptr, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K: tl.constexpr, PER_WORD: tl.constexpr
):  # fmt: skip
    """The codes of W's rows offs_n, columns k0..k0+BLOCK_K-1, as uint32 words [BLOCK_N, BLOCK_K // 8]
    (word j: columns 8j..8j+7, nibble p = column 8j+p), and their E4M3 block scales as stored: one per word
    (PER_WORD; a 16-column block is two words) or one per block [BLOCK_N, BLOCK_K // 16]."""
    offs_j = tl.arange(0, BLOCK_K // 8)
    wp = w_ptr.to(tl.pointer_type(tl.uint32))
    words = tl.load(
        wp + offs_n[:, None] * (stride_wn // 4) + (k0 // 8 + offs_j)[None, :], mask=n_mask[:, None], other=0
    )
    if PER_WORD:
        offs_s = k0 // 16 + offs_j // 2
    else:
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    scale = tl.load(ws_ptr + offs_n[:, None] * stride_wsn + offs_s[None, :], mask=n_mask[:, None], other=0.0)
    return words, scale


@triton.jit
def _words_tile(
    w_ptr, ws_ptr, global_scale, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K: tl.constexpr,
    PER_WORD: tl.constexpr = True,
):  # fmt: skip
    """`_words_and_scales` with each scale as §9's float32(float32(scale) * scale_2), times 2^14 to undo
    `_e2m1_pair_f16`'s placement."""
    words, scale = _words_and_scales(
        w_ptr, ws_ptr, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K, PER_WORD
    )
    return words, (scale.to(tl.float32) * global_scale) * 16384.0


@triton.jit
def _e2m1_pair_f16(words, P: tl.constexpr):
    """Nibbles P and P + 4 (P < 4) of each uint32 word of E2M1 codes as two fp16 tensors. Each code
    s.e1e0.m goes to the fp16 bits s.000e1e0.m000000000, which is exactly its E2M1 value times 2^-14
    (subnormals included), so a float32 product with `_words_tile`'s scale is bit-exact §9. The two codes
    land in the two halves of one 32-bit value with one mask for magnitudes and one for signs, so the
    decode costs a few 32-bit operations per pair."""
    if 4 * P <= 9:
        mag = (words << (9 - 4 * P)) & 0x0E000E00  # e1 e0 m -> bits 11..9 (and 27..25)
    else:
        mag = (words >> (4 * P - 9)) & 0x0E000E00
    h = mag | ((words << (12 - 4 * P)) & 0x80008000)  # s -> bits 15 and 31
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


# E2M1 codes to bf16 by byte lookups (PTX prmt), for `_weight_tile_prmt`. The magnitudes 0, .5, 1, 1.5, 2,
# 3, 4, 6 as bf16 are 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0: one prmt looks up
# four codes' low bytes in an 8-byte table (bytes 0-3 in one operand, 4-7 in the other), another their high
# bytes, and a third interleaves them into two bf16 pairs. Per uint32 word of 8 codes ($4), four pairs:
# $0 = (code 0, code 1) (code 0 in the low half), $1 = (2, 3), $2 = (4, 5), $3 = (6, 7). The sign bits go
# in by one more prmt and an and/or per pair (bit 7 of byte i of the word and of the word shifted by 4 are
# the signs of codes 2i + 1 and 2i). 14 prmt, 1 shl, 9 and/or per 8 codes. tests/kernels/test_moe_prmt.py
# runs this PTX through a model of prmt on the CPU and checks the kernel's tile on the GPU.
_E2M1_BF16_PRMT = tl.constexpr("""
{
.reg .b32 m, ca, cb, la, ha, lb, hb, w4, t;
and.b32 m, $4, 0x77777777;
prmt.b32 ca, m, m, 0x0020;
prmt.b32 cb, m, m, 0x0031;
prmt.b32 la, 0xC0800000, 0xC0804000, ca;
prmt.b32 ha, 0x3F3F3F00, 0x40404040, ca;
prmt.b32 lb, 0xC0800000, 0xC0804000, cb;
prmt.b32 hb, 0x3F3F3F00, 0x40404040, cb;
prmt.b32 $0, la, ha, 0x5140;
prmt.b32 $2, la, ha, 0x7362;
prmt.b32 $1, lb, hb, 0x5140;
prmt.b32 $3, lb, hb, 0x7362;
shl.b32 w4, $4, 4;
prmt.b32 t, w4, $4, 0x4000;
and.b32 t, t, 0x80008000;
or.b32 $0, $0, t;
prmt.b32 t, w4, $4, 0x5010;
and.b32 t, t, 0x80008000;
or.b32 $1, $1, t;
prmt.b32 t, w4, $4, 0x6020;
and.b32 t, t, 0x80008000;
or.b32 $2, $2, t;
prmt.b32 t, w4, $4, 0x7030;
and.b32 t, t, 0x80008000;
or.b32 $3, $3, t;
}
""")


@triton.jit
def _bf16_halves(pairs):
    """The low and high bf16 of each uint32."""
    lo = (pairs & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (pairs >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _columns(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Eight [BLOCK_N, BLOCK_K // 8] tensors, tensor p holding columns 8j + p, as [BLOCK_N, BLOCK_K]."""
    # [BLOCK_N, W, 2, 2, 2] with column 4a + 2b + c at index (a, b, c): column order once flattened
    w = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_tile_prmt(w_ptr, ws_ptr, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] of E2M1 * block scale in bf16, decoded by `_E2M1_BF16_PRMT` and multiplied by
    the scale in bf16 pairs (HMUL2): E2M1 times an E4M3 scale has at most 6 significant bits and stays in
    bf16's range, so the product is exact. The global scale is left to the caller. bench.sm90_moe (128 x 64
    x 64, 4 warps): GEMM 1's K loop 450 SASS instructions a thread, 545 with `_weight_tile`'s float32
    decode (codes to fp16, to float32, the scale's product, back to bf16). CUDA only (inline PTX)."""
    words, scale = _words_and_scales(w_ptr, ws_ptr, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K, False)
    p01, p23, p45, p67 = tl.inline_asm_elementwise(
        _E2M1_BF16_PRMT, "=r,=r,=r,=r,r", [words],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1,
    )  # fmt: skip
    c0, c1 = _bf16_halves(p01)
    c2, c3 = _bf16_halves(p23)
    c4, c5 = _bf16_halves(p45)
    c6, c7 = _bf16_halves(p67)
    w = _columns(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N, BLOCK_K)
    scale = tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], (BLOCK_N, BLOCK_K // 16, 16))
    return w * tl.reshape(scale, (BLOCK_N, BLOCK_K))


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
    PRMT: tl.constexpr = False,
):
    """[BLOCK_N, BLOCK_K] of W (rows offs_n, columns k0..k0+BLOCK_K-1) in DTYPE. PRMT (bf16 on CUDA):
    `_weight_tile_prmt`, whose tile leaves out the global scale (the caller applies it to its sums)."""
    if NVFP4 and PRMT:
        return _weight_tile_prmt(w_ptr, ws_ptr, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
    elif NVFP4:
        # the words decoded two codes at a time, then put back in column order (bench.sm90_moe: GEMM 1's K
        # loop took 848 instructions per thread with a nibble split per code, 658 with one code per 16-bit
        # value, 545 this way)
        words, scale = _words_tile(
            w_ptr, ws_ptr, global_scale, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_K, PER_WORD=False
        )
        c0, c4 = _e2m1_pair_f16(words, 0)
        c1, c5 = _e2m1_pair_f16(words, 1)
        c2, c6 = _e2m1_pair_f16(words, 2)
        c3, c7 = _e2m1_pair_f16(words, 3)
        w = _columns(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N, BLOCK_K)
        scale = tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 16))
        w = w.to(tl.float32) * tl.reshape(scale, (BLOCK_N, BLOCK_K))
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
    N_FIRST: tl.constexpr = False,  # the grid's N tiles first (launcher._gemm: the routed GEMMs)
    PRMT: tl.constexpr = False,  # NVFP4 in bf16 on CUDA: `_weight_tile_prmt`, the global scales on the sums
):
    pid_m, pid_n = _program_ids(N_FIRST)
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
            w_base, ws_base, g_gate, offs_n, n_mask, k0, stride_wn, stride_wsn, NVFP4, BLOCK_N, BLOCK_K, DTYPE,
            PRMT,
        )  # fmt: skip
        if IEEE:
            acc = tl.dot(w, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a, acc)
        if GATED:
            wu = _weight_tile(
                w_base + N * stride_wn, ws_base + N * stride_wsn, g_up, offs_n, n_mask, k0,
                stride_wn, stride_wsn, NVFP4, BLOCK_N, BLOCK_K, DTYPE, PRMT,
            )  # fmt: skip
            if IEEE:
                acc_u = tl.dot(wu, a, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(wu, a, acc_u)
    if NVFP4 and PRMT:  # W = (E2M1 * block scale) * global scale: the last factor on the float32 sums
        acc = acc * g_gate
        acc_u = acc_u * g_up

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

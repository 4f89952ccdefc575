"""Attention on Hopper's own machinery (Gluon: wgmma, cp.async, shared-memory layouts), the `tl` kernel's
launches rewritten where the tensor cores' explicit control pays.

far_attention_kernel, the far launch (launcher.far_launches, the `tl` kernel's PART 1): each query tile
against the key tiles whose every (query, key) pair is allowed and at least R - 1 apart, where the real
Inkling's relative term is zero: plain flash attention with no mask, no term, only the log scaling's per-row
scale. At 1M tokens that is nearly every tile of a full layer. It computes exactly what PART 1 does (the same
query and key tiles, the same partial (o, lse) in split 0's slot, which the near launch joins).

near_attention_kernel, the rest (PART 2, or on a sliding layer every tile): the tiles within the extent of
the diagonal, masked where a key may be disallowed, with the relative term r . P[:, i - j]:

- for query row a and key column b of a tile the distance is d0 + a - b (d0 = first query's position minus
  the tile's first key), so the term is a band of BLOCK_Q + BLOCK_N - 1 distances read sheared. The band
  F[a, v] = r_a . P[:, clamp(d0 + BLOCK_Q - v)] (v < W = BLOCK_Q + BLOCK_N) is one wgmma of r [BLOCK_Q, DR]
  with the table rows gathered in descending distance ([DR, W] in shared memory, copied by cp.async with
  the tile's K and V, a ring slot each);
- F is stored through a padded layout, a row pitch of W + 1; the same bytes read as an unpadded [BLOCK_Q, W]
  view put F[a, v] at view column v + a, so the view's columns BLOCK_Q .. BLOCK_Q + BLOCK_N - 1 hold
  F[a, BLOCK_Q + b - a], the term of (a, b): a slice at a tile-aligned column. F is stored one element a
  thread (rows of pitch W + 1 start off 16-byte boundaries: wgmma's own layout, which stores vectors, failed
  on the H200 with misaligned addresses when this was first tried) and the view read in vectors of 4.

Common to both: Q of one head (BLOCK_Q rows) is loaded once into shared memory in the layout wgmma reads (or,
with Q_IN_REGISTERS, kept in registers as wgmma's first operand: 16 KB less shared memory a program); K and V
tiles are gathered page by page from the paged cache by cp.async into a ring of STAGES buffers, tile
i + STAGES - 1 in flight while tile i is computed; S = Q K^T and O += P V run on wgmma (one warpgroup, 64
rows a warpgroup), P handed to the second as a register operand; the online softmax runs in float32.

Gluon has no interpreter: tests/kernels/test_bank_attention.py checks both against the `tl` launches and the
model's math on the GPU (`gpu`-marked); bench/sm90.py compiles them for sm_90 offline (registers, spills, and
tests/e2e/test_bench_smoke.py does so in CI). Neither is a launcher default until a GPU has timed it
(AttentionConfig.far_impl, near_impl).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)


@triton.constexpr_function
def _mma_layout(n, num_warps):
    """wgmma's accumulator layout for [rows, n]: 16 rows a warp, the warps stacked along the rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@triton.constexpr_function
def _rows_layout(width, num_warps):
    """Loads of rows `width` elements wide (16 bits each) in 16-byte vectors: a row of 128 is 16 of them."""
    return gl.BlockedLayout([1, 8], [32 // (width // 8), width // 8], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_kv(
    k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, tile, key_lo, key_hi, stage,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, load_layout: gl.constexpr,
):  # fmt: skip
    """Start the copies of key tile `tile` (K and V, page by page through the block table) into ring slot
    `stage`, one commit group; keys outside [key_lo, key_hi) copy nothing (nor read their block-table entry:
    the ring's tail, keys past the sequence, blocks freed behind a window)."""
    keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, load_layout))
    live = (keys >= key_lo) & (keys < key_hi)
    page = gl.load(block_table_ptr + seq * stride_bt + keys // PAGE, mask=live, other=0).to(gl.int64)
    slot = keys % PAGE
    mask = live[:, None]
    k_ptrs = (
        k_cache_ptr + (page * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :]
    )
    v_ptrs = (
        v_cache_ptr + (page * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :]
    )
    cp.async_copy_global_to_shared(k_smem.index(stage), k_ptrs, mask=mask)
    cp.async_copy_global_to_shared(v_smem.index(stage), v_ptrs, mask=mask)
    cp.commit_group()


@gluon.jit
def _far_end(first_pos, last_pos, tile_lo, R, window, BLOCK_N: gl.constexpr):
    """The end of a query tile's far key tiles [tile_lo, far_end): every (query, key) pair allowed and at least
    R - 1 apart, as the `tl` kernel's far loop bounds them (kernels.bank_attention_kernel); none where a
    window's lower edge falls inside the first tile."""
    tile_hi = gl.cdiv(last_pos + 1, BLOCK_N)
    far_end = gl.minimum(gl.maximum((first_pos - R + 2) // BLOCK_N, tile_lo), tile_hi)
    if tile_lo * BLOCK_N < gl.maximum(last_pos - window + 1, 0):
        far_end = tile_lo
    return far_end


@gluon.jit
def _program(cu_seqlens_q_ptr, num_q_heads, GROUP: gl.constexpr):
    """The program's query tile (the longest, causal, tiles first, as the `tl` kernel), sequence, head and
    KV head, and its sequence's first query row and query count."""
    q_tile = gl.num_programs(0) - 1 - gl.program_id(0)
    seq = gl.program_id(1) // num_q_heads
    head = gl.program_id(1) % num_q_heads
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    return q_tile, seq, head, head // GROUP, q_start, q_len


@gluon.jit
def _positions(seq_lens_ptr, seq, q_tile, q_len, window, BLOCK_Q: gl.constexpr):
    """The tile's first and last query positions and the lowest key any of its queries may see."""
    seq_len = gl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + q_tile * BLOCK_Q
    last_pos = seq_len - q_len + gl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    return first_pos, last_pos, gl.maximum(first_pos - window + 1, 0)


@gluon.jit
def _load_q(
    q_ptr, q_start, q_tile, q_len, head, stride_qt, stride_qh, D: gl.constexpr, BLOCK_Q: gl.constexpr,
    load_layout: gl.constexpr, s_layout: gl.constexpr, smem_layout: gl.constexpr, Q_IN_REGISTERS: gl.constexpr,
):  # fmt: skip
    """The query tile of one head as wgmma's first operand: in shared memory, or with Q_IN_REGISTERS in
    registers (rows past the sequence's queries zero)."""
    rows = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, load_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, load_layout))
    tok = (q_start + q_tile * BLOCK_Q + rows).to(gl.int64)
    ok = q_tile * BLOCK_Q + rows < q_len
    q = gl.load(
        q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0
    )
    if Q_IN_REGISTERS:
        return gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        return gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_Q, D], smem_layout, q)


@gluon.jit
def far_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [NB, PAGE, Hkv, D]
    v_cache_ptr,
    block_table_ptr,  # int32 [B, MB]
    cu_seqlens_q_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]
    o_part_ptr,  # float32 [>= 1, T, Hq, D]: split 0's slot
    lse_part_ptr,  # float32 [>= 1, T, Hq], log2 domain
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    num_q_heads,
    R,  # the relative table's rows (the bank's extent + 1): distances >= R - 1 carry no term
    window,  # full attention: a window longer than any sequence
    scale,
    log_floor,
    log_alpha,
    D: gl.constexpr,
    GROUP: gl.constexpr,  # Hq // Hkv
    BLOCK_Q: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE: gl.constexpr,
    STAGES: gl.constexpr,  # K/V ring slots (>= 2)
    LOG_SCALE: gl.constexpr,
    Q_IN_REGISTERS: gl.constexpr = False,  # Q as wgmma's register operand: 16 KB less shared memory a program
):
    NW: gl.constexpr = gl.num_warps()
    # The program: one head of one query tile of one sequence, as PART 1.
    q_tile, seq, head, kv_head, q_start, q_len = _program(cu_seqlens_q_ptr, num_q_heads, GROUP)
    if q_tile * BLOCK_Q < q_len:
        first_pos, last_pos, lo = _positions(seq_lens_ptr, seq, q_tile, q_len, window, BLOCK_Q)
        tile_lo = lo // BLOCK_N
        far_end = _far_end(first_pos, last_pos, tile_lo, R, window, BLOCK_N)

        s_layout: gl.constexpr = _mma_layout(BLOCK_N, NW)
        o_layout: gl.constexpr = _mma_layout(D, NW)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)  # rows of D
        load_layout: gl.constexpr = _rows_layout(D, NW)

        # Q: loaded once, kept in shared memory for every S = Q K^T.
        q_op = _load_q(
            q_ptr, q_start, q_tile, q_len, head, stride_qt, stride_qh, D, BLOCK_Q, load_layout, s_layout, smem_layout,
            Q_IN_REGISTERS,
        )  # fmt: skip
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)

        # The scores' scale per row: the caller's `scale` (1/D for Inkling), log2 e, and tau(i) on full layers.
        rows_s = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, s_layout))
        qk_scale = gl.full([BLOCK_Q], scale * LOG2E, gl.float32, layout=gl.SliceLayout(1, s_layout))
        if LOG_SCALE:
            pos = (first_pos + rows_s).to(gl.float32)
            qk_scale = qk_scale * (1.0 + log_alpha * gl.log(gl.maximum((pos + 1.0) / log_floor, 1.0)))

        m_i = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_Q], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_Q, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_Q, BLOCK_N], gl.float32, layout=s_layout)

        for i in gl.static_range(STAGES - 1):
            _issue_kv(
                k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, tile_lo + i, 0,
                far_end * BLOCK_N, i,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, D, BLOCK_N, PAGE,
                load_layout,
            )  # fmt: skip
        for i in range(far_end - tile_lo):
            stage = i % STAGES
            cp.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
            fence_async_shared()  # its writes (and Q's store), seen by wgmma's async reads
            gl.thread_barrier()  # everyone's have; everyone is past tile i - 1's reads of its slot
            _issue_kv(
                k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, tile_lo + i + STAGES - 1,
                0, far_end * BLOCK_N, (i + STAGES - 1) % STAGES, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, stride_bt, D, BLOCK_N, PAGE, load_layout,
            )  # fmt: skip
            s = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = s * qk_scale[:, None]
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)  # the ring's tail copies (nothing: past far_end) before the program ends

        # Split 0's slot: o normalised and lse in the log2 domain; no keys: o = 0, lse = -inf (PART 2 gives
        # it no weight).
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
        o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        rows_o = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, o_layout))
        offs_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        row_o = (q_start + q_tile * BLOCK_Q + rows_o).to(gl.int64) * num_q_heads + head
        ok_o = q_tile * BLOCK_Q + rows_o < q_len
        gl.store(o_part_ptr + row_o[:, None] * D + offs_o[None, :], o, mask=ok_o[:, None])
        row_s = (q_start + q_tile * BLOCK_Q + rows_s).to(gl.int64) * num_q_heads + head
        gl.store(lse_part_ptr + row_s, lse, mask=q_tile * BLOCK_Q + rows_s < q_len)


@gluon.jit
def near_attention_kernel(
    q_ptr,  # [T, Hq, D]
    r_ptr,  # [T, Hq, DR]
    table_ptr,  # [R, DR]: row x = P[:, x], the last row zero (launcher.bank_table)
    k_cache_ptr,  # [NB, PAGE, Hkv, D]
    v_cache_ptr,
    block_table_ptr,  # int32 [B, MB]
    cu_seqlens_q_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]
    out_ptr,  # [T, Hq, D]
    o_part_ptr,  # JOIN: the far launch's float32 [>= 1, T, Hq, D], split 0's slot
    lse_part_ptr,  # JOIN: float32 [>= 1, T, Hq], log2 domain
    stride_qt,
    stride_qh,
    stride_rt,
    stride_rh,
    stride_tr,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    num_q_heads,
    R,
    window,  # full attention: a window longer than any sequence
    scale,
    log_floor,
    log_alpha,
    D: gl.constexpr,
    DR: gl.constexpr,
    GROUP: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE: gl.constexpr,
    STAGES: gl.constexpr,
    LOG_SCALE: gl.constexpr,
    JOIN: gl.constexpr,  # the far launch ran: start past its tiles and join its partial (full layers)
    Q_IN_REGISTERS: gl.constexpr = False,
    BAND_BF16: gl.constexpr = False,  # the band F through shared memory in bf16 (the term rounded): half the bytes
):
    NW: gl.constexpr = gl.num_warps()
    W: gl.constexpr = BLOCK_Q + BLOCK_N  # the band's columns (one more than the distances a tile spans)
    q_tile, seq, head, kv_head, q_start, q_len = _program(cu_seqlens_q_ptr, num_q_heads, GROUP)
    if q_tile * BLOCK_Q < q_len:
        first_pos, last_pos, lo = _positions(seq_lens_ptr, seq, q_tile, q_len, window, BLOCK_Q)
        hi = last_pos + 1
        tile_lo = lo // BLOCK_N
        tile_hi = gl.cdiv(hi, BLOCK_N)
        start = tile_lo
        if JOIN:  # past the far launch's tiles
            start = _far_end(first_pos, last_pos, tile_lo, R, window, BLOCK_N)

        s_layout: gl.constexpr = _mma_layout(BLOCK_N, NW)
        o_layout: gl.constexpr = _mma_layout(D, NW)
        f_layout: gl.constexpr = _mma_layout(W, NW)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        # the widest swizzle a row allows: 128 bytes for D >= 64, 2 D bytes below (the band: 2 DR)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        band_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([W, DR], dtype)
        load_layout: gl.constexpr = _rows_layout(D, NW)
        band_load_layout: gl.constexpr = _rows_layout(DR, NW)
        # F's store into the padded layout: one element a thread, consecutive columns across a warp (no bank
        # conflicts; a vector store would meet rows that start off 16-byte boundaries, pitch W + 1). The
        # sheared view's load: vectors of 4 (its rows start on 16 bytes), 16 threads a row.
        f_store_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
        view_load_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [NW, 1], [1, 0])
        f_smem_layout: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[W, 1]], [BLOCK_Q, W], [1, 0])
        view_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

        q_op = _load_q(
            q_ptr, q_start, q_tile, q_len, head, stride_qt, stride_qh, D, BLOCK_Q, load_layout, s_layout, smem_layout,
            Q_IN_REGISTERS,
        )  # fmt: skip
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
        band_smem = gl.allocate_shared_memory(dtype, [STAGES, W, DR], band_smem_layout)
        f_dtype: gl.constexpr = gl.bfloat16 if BAND_BF16 else gl.float32
        f_smem = gl.allocate_shared_memory(f_dtype, [BLOCK_Q, W], f_smem_layout)
        f_view = f_smem._reinterpret(f_dtype, [BLOCK_Q, W], view_layout).slice(BLOCK_Q, BLOCK_N, dim=1)

        rows_s = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, s_layout))
        pos_s = first_pos + rows_s
        qk_scale = gl.full([BLOCK_Q], scale * LOG2E, gl.float32, layout=gl.SliceLayout(1, s_layout))
        # r: tau(i) scales it on full layers (as the scores), in float32 and rounded back, as the `tl` kernel
        rows_b = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, band_load_layout))
        offs_r = gl.arange(0, DR, layout=gl.SliceLayout(0, band_load_layout))
        tok_b = (q_start + q_tile * BLOCK_Q + rows_b).to(gl.int64)
        r = gl.load(
            r_ptr + (tok_b * stride_rt + head * stride_rh)[:, None] + offs_r[None, :],
            mask=(q_tile * BLOCK_Q + rows_b < q_len)[:, None],
            other=0.0,
        )
        if LOG_SCALE:
            tau_s = 1.0 + log_alpha * gl.log(gl.maximum((pos_s + 1).to(gl.float32) / log_floor, 1.0))
            qk_scale = qk_scale * tau_s
            pos_b = (first_pos + rows_b + 1).to(gl.float32)
            tau_b = 1.0 + log_alpha * gl.log(gl.maximum(pos_b / log_floor, 1.0))
            r = (r.to(gl.float32) * tau_b[:, None]).to(dtype)
        r_op = gl.convert_layout(r, gl.DotOperandLayout(operand_index=0, parent=f_layout, k_width=2))

        m_i = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_Q], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_Q, D], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_Q, BLOCK_N], gl.float32, layout=s_layout)
        f_zero = gl.zeros([BLOCK_Q, W], gl.float32, layout=f_layout)
        cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        v_band = gl.arange(0, W, layout=gl.SliceLayout(1, band_load_layout))

        # Each tile's band rides in its K/V copies' commit group, in a ring slot of its own: row v of tile t's
        # is P[:, d0 + BLOCK_Q - v] (d0 = first_pos - t * BLOCK_N), clamped to the table.
        for i in gl.static_range(STAGES - 1):
            x = gl.minimum(gl.maximum(first_pos - (start + i) * BLOCK_N + BLOCK_Q - v_band, 0), R - 1)
            cp.async_copy_global_to_shared(
                band_smem.index(i), table_ptr + x[:, None] * stride_tr + offs_r[None, :]
            )
            _issue_kv(
                k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, start + i, lo, hi, i,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, D, BLOCK_N, PAGE,
                load_layout,
            )  # fmt: skip
        for i in range(tile_hi - start):
            t = start + i
            stage = i % STAGES
            cp.wait_group(STAGES - 2)  # this thread's copies of tile i (K, V, its band) have landed
            fence_async_shared()  # they and Q, seen by wgmma's async reads
            gl.thread_barrier()  # everyone's have; everyone is past tile i - 1's reads of its slots and of F
            nxt = (i + STAGES - 1) % STAGES
            x = gl.minimum(gl.maximum(first_pos - (t + STAGES - 1) * BLOCK_N + BLOCK_Q - v_band, 0), R - 1)
            cp.async_copy_global_to_shared(
                band_smem.index(nxt), table_ptr + x[:, None] * stride_tr + offs_r[None, :]
            )
            _issue_kv(
                k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, t + STAGES - 1, lo, hi, nxt,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, D, BLOCK_N, PAGE,
                load_layout,
            )  # fmt: skip
            # The band first: its shear (a store and a read through shared memory) overlaps Q K^T.
            f = warpgroup_mma(
                r_op, band_smem.index(stage).permute((1, 0)), f_zero, use_acc=False, is_async=True
            )
            s = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            f = warpgroup_mma_wait(num_outstanding=1, deps=(f,))
            f_smem.store(gl.convert_layout(f.to(f_dtype), f_store_layout))
            gl.thread_barrier()  # every row of F stored before any row's sheared read
            rel = gl.convert_layout(f_view.load(view_load_layout), s_layout).to(gl.float32)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = s * qk_scale[:, None] + rel * LOG2E
            keys = t * BLOCK_N + cols_s
            dist = pos_s[:, None] - keys[None, :]
            allowed = (dist >= 0) & (dist < window) & (keys < hi)[None, :]
            s = gl.where(allowed, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        rows_o = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, o_layout))
        offs_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        tok_o = (q_start + q_tile * BLOCK_Q + rows_o).to(gl.int64)
        ok_o = q_tile * BLOCK_Q + rows_o < q_len
        if JOIN:
            # The far launch's partial for these rows: one more tile whose running maximum is its lse and whose
            # sum is 1.
            row1 = (q_start + q_tile * BLOCK_Q + rows_s).to(gl.int64) * num_q_heads + head
            lse1 = gl.load(lse_part_ptr + row1, mask=q_tile * BLOCK_Q + rows_s < q_len, other=float("-inf"))
            m_new = gl.maximum(m_i, lse1)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            a1 = gl.exp2(lse1 - m_safe)
            a2 = gl.exp2(m_i - m_safe)
            l_i = l_i * a2 + a1
            o1 = gl.load(
                o_part_ptr + (tok_o * num_q_heads + head)[:, None] * D + offs_o[None, :],
                mask=ok_o[:, None],
                other=0.0,
            )
            acc = (
                acc * gl.convert_layout(a2, gl.SliceLayout(1, o_layout))[:, None]
                + o1 * gl.convert_layout(a1, gl.SliceLayout(1, o_layout))[:, None]
            )
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        o_ptrs = out_ptr + (tok_o * stride_ot + head * stride_oh)[:, None] + offs_o[None, :]
        gl.store(o_ptrs, o.to(dtype), mask=ok_o[:, None])

"""The far tiles of a full layer's prefill on Hopper's own machinery (Gluon: wgmma, cp.async, shared memory).

The far launch (launcher.far_launches, the `tl` kernel's PART 1) attends each query tile to the key tiles
whose every (query, key) pair is allowed and at least R - 1 apart, where the real Inkling's relative term is
zero: plain flash attention with no mask, no term, only the log scaling's per-row scale. At 1M tokens that is
nearly every tile of a full layer. This kernel computes exactly what PART 1 does (the same query and key
tiles, the same partial (o, lse) in split 0's slot, which PART 2 joins), so either can be the far launch:

- Q of one head (BLOCK_Q rows) is loaded once into shared memory in the layout wgmma reads (or, with
  Q_IN_REGISTERS, kept in registers as wgmma's first operand: 16 KB less shared memory a program);
- K and V tiles are gathered page by page from the paged cache by cp.async into a ring of STAGES buffers:
  tile i + STAGES - 1 is in flight while tile i is computed;
- S = Q K^T and O += P V run on wgmma (one warpgroup, M = 64 rows a warpgroup), P handed to the second as
  a register operand; the online softmax runs in float32 in the accumulator's layout.

Gluon has no interpreter: tests/gpu/test_gluon_far.py checks it against PART 1 on the GPU; bench/sm90.py
`--gluon` compiles it for sm_90 offline (registers, spills). Not the launcher's default until a GPU has timed
it against PART 1 (AttentionConfig.far_impl).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _issue_kv(
    k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, tile, far_end, stage,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, load_layout: gl.constexpr,
):  # fmt: skip
    """Start the copies of key tile `tile` (K and V, page by page through the block table) into ring slot
    `stage`, one commit group; a tile at or past far_end copies nothing (the ring's tail)."""
    keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, load_layout))
    live = keys < far_end * BLOCK_N
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
    # The program: one head of one query tile of one sequence, the longest (causal) tiles first, as PART 1.
    q_tile = gl.num_programs(0) - 1 - gl.program_id(0)
    seq = gl.program_id(1) // num_q_heads
    head = gl.program_id(1) % num_q_heads
    kv_head = head // GROUP
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = gl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len + q_tile * BLOCK_Q
        last_pos = seq_len - q_len + gl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        # The far tiles, as the `tl` kernel's far loop bounds them (kernels.bank_attention_kernel).
        lo = gl.maximum(first_pos - window + 1, 0)
        tile_lo = lo // BLOCK_N
        tile_hi = gl.cdiv(last_pos + 1, BLOCK_N)
        far_end = gl.minimum(gl.maximum((first_pos - R + 2) // BLOCK_N, tile_lo), tile_hi)
        if tile_lo * BLOCK_N < gl.maximum(last_pos - window + 1, 0):
            far_end = tile_lo

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        # 16-byte vectors along D: a row of 128 bf16 is 16 of them
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [NW, 1], [1, 0])
        dtype: gl.constexpr = q_ptr.dtype.element_ty

        # Q: loaded once, kept in shared memory for every S = Q K^T.
        rows_l = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, load_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, load_layout))
        tok_l = (q_start + q_tile * BLOCK_Q + rows_l).to(gl.int64)
        ok_l = q_tile * BLOCK_Q + rows_l < q_len
        q = gl.load(
            q_ptr + (tok_l * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
            mask=ok_l[:, None],
            other=0.0,
        )
        if Q_IN_REGISTERS:
            q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q_op = gl.allocate_shared_memory(dtype, [BLOCK_Q, D], smem_layout, q)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], smem_layout)

        # The scores' scale per row: 1/sqrt-free `scale` (the caller's), log2 e, and tau(i) on full layers.
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
                k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, tile_lo + i, far_end, i,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, D, BLOCK_N, PAGE,
                load_layout,
            )  # fmt: skip
        for i in range(far_end - tile_lo):
            stage = i % STAGES
            cp.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
            gl.thread_barrier()  # everyone's have; everyone is past tile i - 1's reads of its slot
            fence_async_shared()  # the copies' writes, seen by wgmma's async reads
            _issue_kv(
                k_smem, v_smem, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, tile_lo + i + STAGES - 1,
                far_end, (i + STAGES - 1) % STAGES, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
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

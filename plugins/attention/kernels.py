"""Triton kernels of the sheared-bias attention plugin (`@triton.jit` code only; see launcher.py).

One attention kernel serves prefill, chunked prefill, verify and decode. A program owns a tile of
BLOCK_Q queries of one sequence for HEADS query heads that share one KV head (HEADS = 1 for long
queries; HEADS = the GQA group for decode/verify, so the group's heads share each K/V tile: the
tile's M dimension is HEADS * BLOCK_Q rows, head-major). It walks the KV tiles its queries may
see (causal, and the window for sliding layers: tiles wholly outside are never visited and the
block table is read only for allowed keys), optionally one split of them (flash-decoding).

The relative term of a (query tile, key tile) pair needs the band of distances
d0 .. d0 + BAND - 1 with d0 = first query position - last key position: r_tile @ E_band.T on
the tensor cores ([M, BAND]), then sheared so that query row a, key column b reads band column
a - b + BLOCK_N - 1 (a gather along the band axis). When every distance in the tile is at least
R - 1 the term is r_i . E[R-1] per row, computed once per program.

One-head tiles (prefill; bf16 engines by default since 2026-12-01) may instead take the term of a chunk
of CHUNK KV tiles at once (U_WIDTH > 0):
U[a, u] = r_a . E[u_base + u] into a per-program table, two barriers per chunk, then the chunk's tiles
read it sheared by plain loads. Their loop then has no barrier, so Triton software-pipelines its K/V loads,
which it does not do for a loop with one (the per-tile scratch shear's two barriers; see bench/sm90.py).

The real Inkling's bank (`inkling::bank_attention`) is the same term with one table for every head
(stride_eh = 0): its [d_rel, X] bank transposed, with a zero row appended at distance X, so that R = X + 1
and "clipped to R - 1" reads zero, as the real model's term is beyond its extent (ZERO_FAR then runs the
tiles past it in a loop of their own, without the term or a mask, or in a launch of their own: PART). Its
log scaling (LOG_SCALE) scales the scores and r per query row.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _gemv_rows(
    r_h,  # [HEADS, DR] float32: one query row of each head
    e_ptr,
    stride_eh,
    stride_er,
    head0,
    dist,  # [BLOCK_N] the keys' distances, clamped to 0 .. R - 1
    DR: tl.constexpr,
    DR_SLICE: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """r_h[h] . E[head0 + h, dist[b]] for every head h and key b: [HEADS, BLOCK_N] float32, on the CUDA
    cores. E's rows are loaded DR_SLICE columns at a time ([HEADS, BLOCK_N, DR_SLICE] in registers; DR_SLICE
    < DR holds fewer of them at once)."""
    g = tl.arange(0, HEADS)
    rows = (head0 + g)[:, None, None] * stride_eh + dist[None, :, None] * stride_er
    if DR_SLICE == DR:
        e_rows = tl.load(e_ptr + rows + tl.arange(0, DR)[None, None, :]).to(tl.float32)
        return tl.sum(r_h[:, None, :] * e_rows, axis=2)
    else:
        NS: tl.constexpr = DR // DR_SLICE
        r_s3 = tl.reshape(r_h, [HEADS, NS, DR_SLICE])
        sl = tl.arange(0, NS)
        out = tl.zeros([HEADS, BLOCK_N], tl.float32)
        for s in tl.static_range(NS):
            r_s = tl.sum(tl.where(sl[None, :, None] == s, r_s3, 0.0), axis=1)  # [HEADS, DR_SLICE]
            cols = s * DR_SLICE + tl.arange(0, DR_SLICE)
            e_rows = tl.load(e_ptr + rows + cols[None, None, :]).to(tl.float32)
            out += tl.sum(r_s[:, None, :] * e_rows, axis=2)
        return out


@triton.jit
def _relative_band(
    r,  # [M, DR] the tile's relative queries (M = HEADS * BLOCK_Q, head-major)
    e_ptr,
    stride_eh,
    stride_er,
    head0,
    d0,  # distance of band column 0: first query position - last key position of the tile
    R,
    num_rows,  # the tile's real query rows (REL_GEMV skips the others: they are masked)
    DR: tl.constexpr,
    DR_SLICE: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BAND: tl.constexpr,
    BAND_3D: tl.constexpr,
    SINGLE_QUERY: tl.constexpr,
    REL_GEMV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    scratch_ptr,  # this program's [BLOCK_Q, BAND] scratch, float32 or bfloat16 (SCRATCH only)
    SCRATCH: tl.constexpr,
):
    """The sheared relative term of one tile: [M, BLOCK_N] float32."""
    offs_dr = tl.arange(0, DR)
    a = tl.arange(0, BLOCK_Q)
    b = tl.arange(0, BLOCK_N)
    if REL_GEMV:
        # Verify (a few queries per head, HEADS > 1): for each real query row, decode's GEMV with that
        # row's distances, d0 + BLOCK_N - 1 + a - b. No band and no shear (the band's tl.gather lowers
        # to warp shuffles, ~8x decode's time per layer on the H200); row a's E rows overlap row a-1's
        # but one, so after the first row they come from L1.
        r3 = tl.reshape(r.to(tl.float32), [HEADS, BLOCK_Q, DR])
        bias = tl.zeros([HEADS, BLOCK_Q, BLOCK_N], tl.float32)
        for qa in tl.static_range(BLOCK_Q):
            if qa < num_rows:
                dist = tl.minimum(tl.maximum(d0 + (BLOCK_N - 1) + qa - b, 0), R - 1)
                r_a = tl.sum(tl.where(a[None, :, None] == qa, r3, 0.0), axis=1)  # [HEADS, DR]
                row = _gemv_rows(r_a, e_ptr, stride_eh, stride_er, head0, dist, DR, DR_SLICE, HEADS, BLOCK_N)
                bias = tl.where(a[None, :, None] == qa, row[:, None, :], bias)
        return tl.reshape(bias, [HEADS * BLOCK_Q, BLOCK_N])
    if SINGLE_QUERY:
        # Decode without REL_DOT: one query per head, so no shear: r_h . E[h, d0 + BLOCK_N - 1 - b] per
        # head (a GEMV on the CUDA cores, E in registers); rows a > 0 are padding and get a copy.
        dist = tl.minimum(tl.maximum(d0 + (BLOCK_N - 1) - b, 0), R - 1)
        r0 = tl.reshape(r.to(tl.float32), [HEADS, BLOCK_Q, DR])
        r0 = tl.sum(tl.where(a[None, :, None] == 0, r0, 0.0), axis=1)  # [HEADS, DR]: query 0 of each head
        bias = _gemv_rows(r0, e_ptr, stride_eh, stride_er, head0, dist, DR, DR_SLICE, HEADS, BLOCK_N)
        return tl.reshape(
            tl.broadcast_to(bias[:, None, :], [HEADS, BLOCK_Q, BLOCK_N]), [HEADS * BLOCK_Q, BLOCK_N]
        )
    # Band column of (query a, key b); rows past the longest query clamp (they are masked rows).
    col = tl.minimum(a[:, None] - b[None, :] + (BLOCK_N - 1), BAND - 1)  # [BLOCK_Q, BLOCK_N]
    if BAND_3D:
        # One band per head: a batched [HEADS] x ([BLOCK_Q, DR] @ [DR, BAND]) product.
        g = tl.arange(0, HEADS)
        c = tl.arange(0, BAND)
        dist = tl.minimum(tl.maximum(d0 + c, 0), R - 1)
        e_offs = (
            (head0 + g)[:, None, None] * stride_eh + dist[None, :, None] * stride_er + offs_dr[None, None, :]
        )
        e_band = tl.load(e_ptr + e_offs)  # [HEADS, BAND, DR]
        r3 = tl.reshape(r, [HEADS, BLOCK_Q, DR])
        band = tl.dot(r3, tl.permute(e_band.to(r.dtype), (0, 2, 1)), input_precision=DOT_PRECISION)
        idx = tl.broadcast_to(col[None, :, :], [HEADS, BLOCK_Q, BLOCK_N])
        sheared = tl.gather(band, idx, axis=2)
        return tl.reshape(sheared, [HEADS * BLOCK_Q, BLOCK_N])
    elif SCRATCH:
        # HEADS == 1: the band goes through this program's scratch (L1/L2-resident) and comes back
        # sheared: row a reads band columns a + BLOCK_N - 1 - b, a contiguous run, so both the store
        # and the load are coalesced (tl.gather along a register axis lowers to warp shuffles).
        c = tl.arange(0, BAND)
        dist = tl.minimum(tl.maximum(d0 + c, 0), R - 1)
        e_band = tl.load(e_ptr + head0 * stride_eh + dist[:, None] * stride_er + offs_dr[None, :])
        band = tl.dot(r, tl.trans(e_band.to(r.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_Q, BAND]
        tl.debug_barrier()  # the previous tile's reads are done before the band is overwritten
        tl.store(scratch_ptr + a[:, None] * BAND + c[None, :], band.to(scratch_ptr.dtype.element_ty))
        tl.debug_barrier()  # the whole band is written before any thread reads it
        return tl.load(scratch_ptr + a[:, None] * BAND + col).to(tl.float32)
    else:
        # Every head's band side by side ([HEADS * BAND] columns); a row gathers from its head's.
        n = tl.arange(0, HEADS * BAND)
        dist = tl.minimum(tl.maximum(d0 + n % BAND, 0), R - 1)
        e_offs = (head0 + n // BAND)[:, None] * stride_eh + dist[:, None] * stride_er + offs_dr[None, :]
        e_band = tl.load(e_ptr + e_offs)  # [HEADS * BAND, DR]
        band = tl.dot(r, tl.trans(e_band.to(r.dtype)), input_precision=DOT_PRECISION)
        m = tl.arange(0, HEADS * BLOCK_Q)
        idx = (m // BLOCK_Q * BAND)[:, None] + tl.reshape(
            tl.broadcast_to(col[None, :, :], [HEADS, BLOCK_Q, BLOCK_N]), [HEADS * BLOCK_Q, BLOCK_N]
        )
        return tl.gather(band, idx, axis=1)


@triton.jit
def _attend_tile(
    t,
    q,
    r,
    r_last,
    pos,
    row_ok,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    first_pos,
    num_rows,
    seq,
    head0,
    kv_head,
    e_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    stride_eh,
    stride_er,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    R,
    window,
    qk_scale,
    D: tl.constexpr,
    DR: tl.constexpr,
    DR_SLICE: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BAND: tl.constexpr,
    BAND_3D: tl.constexpr,
    SINGLE_QUERY: tl.constexpr,
    REL_DOT: tl.constexpr,
    REL_GEMV: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    scratch_ptr,
    SCRATCH: tl.constexpr,
    RELATIVE: tl.constexpr,
    FAR_TEST: tl.constexpr,
    u_base,  # U_WIDTH > 0: the distance of column 0 of this program's table U (see _fill_relative_table)
    U_WIDTH: tl.constexpr,
    MASKED: tl.constexpr,  # False: every (real query, key) of the tile is allowed (see the chunk loop)
):
    """One KV tile of the online softmax: returns the updated (m_i, l_i, acc)."""
    offs_d = tl.arange(0, D)
    j0 = t * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    # An unmasked tile's keys are all in [lo, hi) (the callers' far and interior tiles), so its loads need no
    # mask; dropped where the tile has no term either (the far loop: 179 -> 165 registers at 64 x 64 on
    # sm_90), kept in the chunk loops (dropped there too, the spills of the kernel holding them grew)
    LOADS_MASKED: tl.constexpr = MASKED or RELATIVE
    block_ptrs = block_table_ptr + seq * stride_bt + offs_n // PAGE
    if LOADS_MASKED:
        kv_ok = (offs_n >= lo) & (offs_n < hi)
        block = tl.load(block_ptrs, mask=kv_ok, other=0).to(tl.int64)
    else:
        block = tl.load(block_ptrs).to(tl.int64)
    in_page = offs_n % PAGE
    k_offs = block * stride_kb + in_page * stride_ks + kv_head * stride_kh
    if LOADS_MASKED:
        k = tl.load(k_cache_ptr + k_offs[None, :] + offs_d[:, None], mask=kv_ok[None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_offs[None, :] + offs_d[:, None])
    # [M, BLOCK_N], log2 units (qk_scale: [M, 1] with LOG_SCALE)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale

    if not RELATIVE:
        pass  # the timing probe without the relative term (AttentionConfig.relative)
    elif U_WIDTH > 0:
        # HEADS == 1: the term was written for a chunk of tiles at once (U[a, u] = r_a . E[u_base + u]);
        # query a, key j0 + b reads U[a, first_pos + a - j0 - b - u_base], a run of consecutive columns
        # per row. A plain load: no barrier in the tile loop, which Triton then software-pipelines.
        a = tl.arange(0, BLOCK_Q)
        b = tl.arange(0, BLOCK_N)
        col = (first_pos - j0 - u_base) + a[:, None] - b[None, :]
        s += tl.load(scratch_ptr + a[:, None] * U_WIDTH + col).to(tl.float32) * LOG2E
    elif SINGLE_QUERY and REL_DOT:
        # Decode: key b is at distance first_pos - b from the query, and no shear is needed. The term is
        # one dot on the tensor cores: r here is the block-diagonal [M, HEADS * DR] operand the kernel
        # built (row m holds its head's r in that head's DR columns), and the band tile is [HEADS * DR,
        # BLOCK_N], column b holding E[h, dist_b] for every head h of the group. A plain load feeding a
        # dot, it goes through the software pipeline like K and V. Clipped distances (>= R - 1) take
        # r_last and are not read (masked: no bytes move).
        dist = first_pos - offs_n
        near = dist < R - 1
        kk = tl.arange(0, HEADS * DR)
        e_offs = (head0 + kk // DR)[:, None] * stride_eh + (kk % DR)[:, None]
        e_tile = tl.load(
            e_ptr + e_offs + tl.maximum(dist, 0)[None, :] * stride_er,
            mask=(near & kv_ok)[None, :],
            other=0.0,
        )
        bias = tl.dot(r, e_tile.to(r.dtype), input_precision=DOT_PRECISION)  # [M, BLOCK_N]
        s += tl.where(near[None, :], bias, r_last[:, None]) * LOG2E
    else:
        d0 = first_pos - (j0 + BLOCK_N - 1)
        if FAR_TEST:  # a tile whose every distance is clipped takes r_last (a runtime branch)
            far = d0 >= R - 1
        else:  # no such tile, or not worth the branch: the band clamps its distances to R - 1
            far = False
        if far:
            s += r_last[:, None] * LOG2E
        else:
            bias = _relative_band(
                r,
                e_ptr,
                stride_eh,
                stride_er,
                head0,
                d0,
                R,
                num_rows,
                DR,
                DR_SLICE,
                HEADS,
                BLOCK_Q,
                BLOCK_N,
                BAND,
                BAND_3D,
                SINGLE_QUERY,
                REL_GEMV,
                DOT_PRECISION,
                scratch_ptr,
                SCRATCH,
            )
            s += bias * LOG2E

    if MASKED:
        dist = pos[:, None] - offs_n[None, :]
        allowed = row_ok[:, None] & kv_ok[None, :] & (dist >= 0) & (dist < window)
        s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if LOADS_MASKED:  # a row may have no allowed key yet
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # every score is finite
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_offs = block * stride_vb + in_page * stride_vs + kv_head * stride_vh
    if LOADS_MASKED:
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_tiles(
    t_start,
    t_end,
    q,
    r,
    r_last,
    pos,
    row_ok,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    first_pos,
    num_rows,
    seq,
    head0,
    kv_head,
    e_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    stride_eh,
    stride_er,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    R,
    window,
    qk_scale,
    D: tl.constexpr,
    DR: tl.constexpr,
    DR_SLICE: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BAND: tl.constexpr,
    BAND_3D: tl.constexpr,
    SINGLE_QUERY: tl.constexpr,
    REL_DOT: tl.constexpr,
    REL_GEMV: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    scratch_ptr,
    SCRATCH: tl.constexpr,
    RELATIVE: tl.constexpr,
    FAR_TEST: tl.constexpr,
    u_base,  # U_WIDTH > 0: the distance of column 0 of this program's table U (see _fill_relative_table)
    U_WIDTH: tl.constexpr,
    MASKED: tl.constexpr,  # False: every (real query, key) of the tile is allowed (see the chunk loop)
    INTERPRET: tl.constexpr,
):
    """KV tiles t_start .. t_end - 1 of the online softmax (_attend_tile): the updated (m_i, l_i, acc)."""
    if INTERPRET:
        # The CPU interpreter (numpy 2) cannot take computed loop bounds in range().
        t = t_start
        while t < t_end:
            m_i, l_i, acc = _attend_tile(
                t,
                q,
                r,
                r_last,
                pos,
                row_ok,
                m_i,
                l_i,
                acc,
                lo,
                hi,
                first_pos,
                num_rows,
                seq,
                head0,
                kv_head,
                e_ptr,
                k_cache_ptr,
                v_cache_ptr,
                block_table_ptr,
                stride_eh,
                stride_er,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_bt,
                R,
                window,
                qk_scale,
                D,
                DR,
                DR_SLICE,
                HEADS,
                BLOCK_Q,
                BLOCK_N,
                BAND,
                BAND_3D,
                SINGLE_QUERY,
                REL_DOT,
                REL_GEMV,
                PAGE,
                DOT_PRECISION,
                scratch_ptr,
                SCRATCH,
                RELATIVE,
                FAR_TEST,
                u_base,
                U_WIDTH,
                MASKED,
            )
            t += 1
    else:
        for t in range(t_start, t_end):
            m_i, l_i, acc = _attend_tile(
                t,
                q,
                r,
                r_last,
                pos,
                row_ok,
                m_i,
                l_i,
                acc,
                lo,
                hi,
                first_pos,
                num_rows,
                seq,
                head0,
                kv_head,
                e_ptr,
                k_cache_ptr,
                v_cache_ptr,
                block_table_ptr,
                stride_eh,
                stride_er,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_bt,
                R,
                window,
                qk_scale,
                D,
                DR,
                DR_SLICE,
                HEADS,
                BLOCK_Q,
                BLOCK_N,
                BAND,
                BAND_3D,
                SINGLE_QUERY,
                REL_DOT,
                REL_GEMV,
                PAGE,
                DOT_PRECISION,
                scratch_ptr,
                SCRATCH,
                RELATIVE,
                FAR_TEST,
                u_base,
                U_WIDTH,
                MASKED,
            )
    return m_i, l_i, acc


@triton.jit
def _fill_relative_table(
    r,  # [BLOCK_Q, DR]
    e_ptr,
    stride_eh,
    stride_er,
    head0,
    u_base,
    R,
    scratch_ptr,
    DR: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    PIECE: tl.constexpr,
    U_WIDTH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """U[a, u] = r_a . E[head0, clamp(u_base + u, 0, R - 1)] for u < U_WIDTH, into this program's float32
    [BLOCK_Q, U_WIDTH] scratch, PIECE columns per tensor-core dot. Each distance is computed once per chunk
    of KV tiles (the band per tile computes most twice), and the barriers are once per chunk."""
    a = tl.arange(0, BLOCK_Q)
    offs_dr = tl.arange(0, DR)
    tl.debug_barrier()  # the previous chunk's reads are done before U is overwritten
    for piece in tl.static_range(U_WIDTH // PIECE):
        u = piece * PIECE + tl.arange(0, PIECE)
        dist = tl.minimum(tl.maximum(u_base + u, 0), R - 1)
        e_rows = tl.load(
            e_ptr + head0 * stride_eh + dist[:, None] * stride_er + offs_dr[None, :]
        )  # [PIECE, DR]
        part = tl.dot(r, tl.trans(e_rows.to(r.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_Q, PIECE]
        tl.store(scratch_ptr + a[:, None] * U_WIDTH + u[None, :], part.to(scratch_ptr.dtype.element_ty))
    tl.debug_barrier()  # U is whole before any thread reads it


@triton.jit
def bank_attention_kernel(
    q_ptr,  # [T, Hq, D]
    r_ptr,  # [T, Hq, DR]
    e_ptr,  # the relative table: row (h, x) at h * stride_eh + x * stride_er (the bank: [R, DR], stride_eh 0)
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,
    block_table_ptr,  # int32 [B, MB]
    cu_seqlens_q_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]
    out_ptr,  # [T, Hq, D]
    o_part_ptr,  # float32 [num_splits, T, Hq, D] (split mode only)
    lse_part_ptr,  # float32 [num_splits, T, Hq], log2 domain (split mode only)
    scratch_ptr,  # [programs, BLOCK_Q, BAND] (SCRATCH) or [programs, BLOCK_Q, U_WIDTH] (U_WIDTH > 0);
    # float32, or bfloat16 (AttentionConfig.table_dtype)
    stride_qt,
    stride_qh,
    stride_rt,
    stride_rh,
    stride_eh,
    stride_er,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    num_tokens,
    num_q_heads,
    num_splits,
    R,
    window,  # full attention: a window longer than any sequence
    scale,
    log_floor,  # LOG_SCALE: the real Inkling's n_floor (float)
    log_alpha,
    D: tl.constexpr,
    DR: tl.constexpr,
    DR_SLICE: tl.constexpr,  # the GEMV forms reduce r . E over DR_SLICE of DR's columns at a time
    GROUP: tl.constexpr,  # Hq // Hkv
    HEADS: tl.constexpr,  # query heads per program: 1 or GROUP
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BAND: tl.constexpr,
    BAND_3D: tl.constexpr,
    SINGLE_QUERY: tl.constexpr,  # max_seqlen_q == 1: the relative term needs no shear
    REL_DOT: tl.constexpr,  # SINGLE_QUERY: the relative term as a pipelined tensor-core dot (else a GEMV)
    REL_GEMV: tl.constexpr,  # HEADS > 1, several queries (verify): one GEMV per query row, no band
    PAGE: tl.constexpr,  # tokens per cache block
    SPLIT: tl.constexpr,  # num_splits > 1: write partial (o, lse) for split_kv_reduce_kernel
    DOT_PRECISION: tl.constexpr,
    SCRATCH: tl.constexpr,  # shear the relative band through a per-program scratch (HEADS == 1)
    RELATIVE: tl.constexpr,  # False: no relative term (a timing probe only, see AttentionConfig.relative)
    FAR_TEST: tl.constexpr,  # test each tile for distances all clipped at R - 1 (see AttentionConfig.far_test)
    U_WIDTH: tl.constexpr,  # > 0 (HEADS == 1): the relative term from a table per chunk of CHUNK tiles
    CHUNK: tl.constexpr,
    UNMASKED_CHUNKS: tl.constexpr,  # U_WIDTH > 0: chunks wholly inside every query's allowed keys skip the mask
    INTERPRET: tl.constexpr,
    LOG_SCALE: tl.constexpr = False,  # logits times tau(i) = 1 + log_alpha ln(max(1, (i + 1) / log_floor))
    ZERO_FAR: tl.constexpr = False,  # the table's row R - 1 is zero: tiles past it carry no relative term
    PART: tl.constexpr = 0,  # ZERO_FAR chunks: 1 the far tiles alone, a partial (o, lse) in split 0's slot
    # (SPLIT, one split); 2 the rest, joined with that partial into the output
):
    M: tl.constexpr = HEADS * BLOCK_Q
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (causal) tiles start first
    heads_per_seq = num_q_heads // HEADS
    seq = tl.program_id(1) // heads_per_seq
    head0 = (tl.program_id(1) % heads_per_seq) * HEADS
    kv_head = head0 // GROUP
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    # The scratch holds one slot per query tile that exists, not per program of the (longest sequence's
    # tiles x sequences) grid: tile t of sequence b takes slot q_start // BLOCK_Q + b + t, distinct for
    # every (b, t) and below num_tokens // BLOCK_Q + B (scratch_slots).
    slot = q_start // BLOCK_Q + seq + q_tile
    program = (slot * heads_per_seq + tl.program_id(1) % heads_per_seq) * num_splits + split
    if U_WIDTH > 0:
        scratch_ptr += program.to(tl.int64) * (BLOCK_Q * U_WIDTH)
    else:
        scratch_ptr += program.to(tl.int64) * (BLOCK_Q * BAND)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + q_tile * BLOCK_Q  # position of the tile's query 0
    last_pos = seq_len - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_rows = tl.minimum(q_len - q_tile * BLOCK_Q, BLOCK_Q)

    offs_m = tl.arange(0, M)
    a = offs_m % BLOCK_Q
    heads = head0 + offs_m // BLOCK_Q
    row_ok = q_tile * BLOCK_Q + a < q_len
    tok = (q_start + q_tile * BLOCK_Q + a).to(tl.int64)
    pos = first_pos + a
    offs_d = tl.arange(0, D)
    offs_dr = tl.arange(0, DR)

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    r = tl.load(
        r_ptr + tok[:, None] * stride_rt + heads[:, None] * stride_rh + offs_dr[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    qk_scale = scale * LOG2E
    if LOG_SCALE:
        # tau(i) scales q . k and the relative term alike (INKLING_SPEC §3.4): the scores through their
        # per-row scale (the multiply each tile makes anyway), the term through r, scaled once here in
        # float32 and rounded back. q itself stays as loaded: scaled in registers it was held there as the
        # dot's operand (about 35 more registers a thread at 64 x 64 on sm_90, bench/sm90.py), where
        # loaded it feeds the tensor cores from shared memory.
        tau = 1.0 + log_alpha * tl.log(tl.maximum((pos + 1).to(tl.float32) / log_floor, 1.0))
        qk_scale = qk_scale * tau[:, None]  # [M, 1]
        r = (r.to(tl.float32) * tau[:, None]).to(r_ptr.dtype.element_ty)
    # r_i . E[R-1]: the whole relative term of tiles where every distance is clipped.
    e_last = tl.load(e_ptr + heads[:, None] * stride_eh + (R - 1) * stride_er + offs_dr[None, :])
    r_last = tl.sum(r.to(tl.float32) * e_last.to(tl.float32), axis=1)  # [M]
    if SINGLE_QUERY and REL_DOT:
        # The decode's relative operand (see _attend_tile): row m keeps r in its head's DR columns.
        kk = tl.arange(0, HEADS * DR)
        r_wide = tl.reshape(tl.broadcast_to(r[:, None, :], [M, HEADS, DR]), [M, HEADS * DR])
        r = tl.where((kk // DR)[None, :] == (offs_m // BLOCK_Q)[:, None], r_wide, 0.0).to(
            r_ptr.dtype.element_ty
        )

    # Keys this tile may see: [lo, hi). Nothing below lo is read, not even its block-table entry.
    hi = last_pos + 1
    lo = tl.maximum(first_pos - window + 1, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(hi, BLOCK_N)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    my_lo = tile_lo + split * tiles_per_split
    my_hi = tl.minimum(my_lo + tiles_per_split, tile_hi)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    if U_WIDTH > 0:
        c = my_lo
        if ZERO_FAR and UNMASKED_CHUNKS:
            # The tiles whose every (query, key) pair is allowed and past the table's last row (distances
            # >= R - 1: no relative term; the real Inkling's full layers but the 1024 tokens next to the
            # diagonal) go first, in one loop that Triton software-pipelines across all of them: chunk by
            # chunk, its pipeline restarted every CHUNK tiles. Tile t qualifies when its last key
            # (t + 1) * BLOCK_N - 1 <= first_pos - (R - 1) and its first is inside every query's window.
            far_end = tl.minimum(tl.maximum((first_pos - R + 2) // BLOCK_N, my_lo), my_hi)
            if my_lo * BLOCK_N < tl.maximum(last_pos - window + 1, 0):
                far_end = my_lo  # a window's lower edge in the first tile: the chunks mask it
            if PART != 2:
                m_i, l_i, acc = _attend_tiles(
                    my_lo, far_end, q, r, r_last, pos, row_ok, m_i, l_i, acc, lo, hi, first_pos, num_rows, seq,
                    head0, kv_head, e_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, stride_eh, stride_er,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, R, window,
                    qk_scale, D, DR, DR_SLICE, HEADS, BLOCK_Q, BLOCK_N, BAND, BAND_3D, SINGLE_QUERY, REL_DOT,
                    REL_GEMV, PAGE, DOT_PRECISION, scratch_ptr, SCRATCH, False, FAR_TEST, 0, U_WIDTH, False,
                    INTERPRET,
                )  # fmt: skip
            c = far_end
        # Chunks of CHUNK tiles: the relative table of a chunk, then its tiles (a loop without barriers);
        # none in the far tiles' launch (PART 1), whose kernel then holds the far loop alone.
        if PART != 1:
            while c < my_hi:
                u_base = first_pos - (c + CHUNK) * BLOCK_N + 1  # the chunk's smallest distance
                # A chunk whose every (real query, key) pair is allowed (its keys at or below the first query
                # and within every query's window) skips the mask: all but the chunks at the diagonal and at
                # a sliding window's lower edge.
                c_end = tl.minimum(c + CHUNK, my_hi)
                if UNMASKED_CHUNKS:
                    interior = (c * BLOCK_N >= tl.maximum(last_pos - window + 1, 0)) & (
                        c_end * BLOCK_N - 1 <= first_pos
                    )
                else:
                    interior = False  # every chunk masked: one copy of the tile loop
                # Chunks wholly past the table's last row (ZERO_FAR) are the far loop's, above; one only reaches
                # here behind a window's edge inside the first tile (not the published shapes), and takes the
                # table, zero there. (A copy of the tile loop for them had cost the kernel registers.)
                _fill_relative_table(
                    r, e_ptr, stride_eh, stride_er, head0, u_base, R, scratch_ptr,
                    DR, BLOCK_Q, BLOCK_N, U_WIDTH, DOT_PRECISION,
                )  # fmt: skip
                if interior:
                    m_i, l_i, acc = _attend_tiles(
                        c, c_end, q, r, r_last, pos, row_ok, m_i, l_i, acc, lo, hi, first_pos, num_rows, seq,
                        head0, kv_head, e_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, stride_eh, stride_er,
                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, R, window,
                        qk_scale, D, DR, DR_SLICE, HEADS, BLOCK_Q, BLOCK_N, BAND, BAND_3D, SINGLE_QUERY, REL_DOT,
                        REL_GEMV, PAGE, DOT_PRECISION, scratch_ptr, SCRATCH, RELATIVE, FAR_TEST, u_base, U_WIDTH, False,
                        INTERPRET,
                    )  # fmt: skip
                else:
                    m_i, l_i, acc = _attend_tiles(
                        c, c_end, q, r, r_last, pos, row_ok, m_i, l_i, acc, lo, hi, first_pos, num_rows, seq,
                        head0, kv_head, e_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, stride_eh, stride_er,
                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, R, window,
                        qk_scale, D, DR, DR_SLICE, HEADS, BLOCK_Q, BLOCK_N, BAND, BAND_3D, SINGLE_QUERY, REL_DOT,
                        REL_GEMV, PAGE, DOT_PRECISION, scratch_ptr, SCRATCH, RELATIVE, FAR_TEST, u_base, U_WIDTH, True,
                        INTERPRET,
                    )  # fmt: skip
                c += CHUNK
    else:
        m_i, l_i, acc = _attend_tiles(
            my_lo,
            my_hi,
            q,
            r,
            r_last,
            pos,
            row_ok,
            m_i,
            l_i,
            acc,
            lo,
            hi,
            first_pos,
            num_rows,
            seq,
            head0,
            kv_head,
            e_ptr,
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            stride_eh,
            stride_er,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_bt,
            R,
            window,
            qk_scale,
            D,
            DR,
            DR_SLICE,
            HEADS,
            BLOCK_Q,
            BLOCK_N,
            BAND,
            BAND_3D,
            SINGLE_QUERY,
            REL_DOT,
            REL_GEMV,
            PAGE,
            DOT_PRECISION,
            scratch_ptr,
            SCRATCH,
            RELATIVE,
            FAR_TEST,
            0,
            0,
            True,
            INTERPRET,
        )

    if PART == 2:
        # The far tiles' launch (PART 1) left this program's rows their partial (o, lse): join it as one more
        # tile whose running maximum is its lse and whose sum is 1 (PART 1's slot, split 0)
        row1 = tok * num_q_heads + heads
        o1 = tl.load(o_part_ptr + row1[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse1 = tl.load(lse_part_ptr + row1, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m_i, lse1)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a1 = tl.exp2(lse1 - m_safe)
        a2 = tl.exp2(m_i - m_safe)
        l_i = l_i * a2 + a1
        acc = acc * a2[:, None] + o1 * a1[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if not SPLIT:
        o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # A split with no keys writes lse = -inf and o = 0: the reduce (or PART 2) gives it no weight.
        if PART == 1:  # one split: slot 0 (a constant, not program_id(2): 165 registers, not 181)
            split = 0
        row = (split * num_tokens + tok) * num_q_heads + heads
        tl.store(o_part_ptr + row[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_part_ptr + row, lse, mask=row_ok)


@triton.jit
def split_kv_reduce_kernel(
    o_part_ptr,  # float32 [num_splits, T, Hq, D]
    lse_part_ptr,  # float32 [num_splits, T, Hq], log2 domain
    out_ptr,  # [T, Hq, D]
    stride_ot,
    stride_oh,
    num_tokens,
    num_q_heads,
    num_splits,
    D: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Combines the splits of one (token, head): o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    row = (s * num_tokens + tok) * num_q_heads + head
    lse = tl.load(lse_part_ptr + row, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [SPLITS_P2]
    offs_d = tl.arange(0, D)
    o = tl.load(o_part_ptr + row[:, None] * D + offs_d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(w[:, None] * o, axis=0) / total
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def kv_cache_write_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # int64 [T], -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HKV: tl.constexpr,
    HKV_P2: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    block = slot // PAGE
    in_page = slot % PAGE
    h = tl.arange(0, HKV_P2)
    d = tl.arange(0, D)
    mask = (h < HKV)[:, None]
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kcb + in_page * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + block * stride_vcb + in_page * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

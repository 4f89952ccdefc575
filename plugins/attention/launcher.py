"""Launchers of the attention plugin's Triton kernels: check shapes, strides and dtypes, pick tiles,
splits and the grid from host-side shapes only (no device sync, so the ops run inside CUDA graphs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ..triton_utils import interpreting
from . import kernels

MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 2
LONG_SPLIT_TILES = 16  # KV tiles per split above which a decode with few programs splits further
VERIFY_TILE_ROWS = 8  # query rows of a verify tile (GQA-packed: the tile is group * 8 rows)
FULL_WINDOW = 1 << 30  # what the kernel gets as the window of a full-attention layer
MIN_DR = 16  # the relative width the kernel's dots need at least (bank_attention pads a narrower one)


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of one launch. heads = query heads per program (1, or the GQA group for decode/verify)."""

    heads: int
    block_q: int
    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    # How the relative band is sheared for one-head tiles: "gather" (tl.gather in registers), "scratch"
    # (through a per-program float32 scratch in global memory, L1/L2-resident, two barriers per tile), or
    # "chunk": the term of `chunk_tiles` KV tiles at once into a per-program float32 table U of
    # [block_q, chunk_tiles * block_n + block_q - 1 rounded up to block_n] (two barriers per chunk), which each tile
    # reads sheared by plain loads, so the tile loop has no barrier and Triton pipelines its K/V loads
    # (compiled for sm_90, the scratch form's loop had no cp.async at all).
    shear: str = "gather"
    chunk_tiles: int = 3
    # shear="chunk": a chunk whose keys every query may see (all but those at the diagonal and at a
    # sliding window's edge) runs a second copy of the tile loop without the causal/window mask.
    unmasked_chunks: bool = True
    # The scratch's or table's element type (shear "scratch" or "chunk"): "float32", or "bfloat16", which
    # halves its bytes (the term is rounded to bf16 before it joins the float32 logits). choose_config
    # gives float32 engines a float32 table.
    table_dtype: str = "float32"
    # Decode (one query): the relative term as a tensor-core dot whose E tile goes through the software
    # pipeline with K and V (True), or as a GEMV on the CUDA cores with E loaded into registers (False).
    rel_dot: bool = False
    # Verify (heads > 1, several queries): the relative term as one GEMV per query row (True), or as a
    # band product per head sheared with tl.gather (False; needs block_q >= 16).
    rel_gemv: bool = False
    # The GEMV forms (decode without rel_dot, verify with rel_gemv): E's rows are loaded and reduced this
    # many of Dr's columns at a time (0: all Dr at once). Fewer columns at once hold fewer registers: at
    # block_n 128 a decode program's [8 heads, 128 keys, 32] float32 rows alone are 256 a thread.
    rel_slice: int = 0
    # Test each KV tile for distances all clipped at R - 1 (then the term is r . E[R-1] per row, no band):
    # a runtime branch in the tile loop. False: every tile takes the band path, which clamps distances
    # itself (the same result; for launches whose tiles are never wholly past R - 1).
    far_test: bool = True
    # False: no relative term at all. A timing probe of the kernel's floor (bench/sm90.py's variants), whose
    # result is NOT the op's; choose_config never sets it.
    relative: bool = True
    # shear="chunk" on a layer whose table ends inside every query's window (full layers): the far tiles
    # (no relative term, nothing masked) in a launch of their own, whose kernel holds that loop alone and so
    # its registers, writes a partial result (o, lse) that the second launch, the rest, joins into the
    # output (one float32 [T, Hq, D] buffer between them, no reduce).
    far_launch: bool = False
    # The far launch's kernel: "triton" (the `tl` kernel's PART 1) or "gluon" (gluon_attention.py: wgmma and
    # cp.async on Hopper; bf16/fp16, one warpgroup of 64 query rows, tested on the GPU only).
    far_impl: str = "triton"
    # The near launch's kernel (the rest of a far-launched layer, or every tile of another one-head prefill):
    # "triton", or "gluon" (gluon_attention.py: the relative band on wgmma, sheared through a padded
    # shared-memory layout, in table_dtype; block_q = block_n, one split).
    near_impl: str = "triton"
    # far_impl / near_impl "gluon": Q held in registers as wgmma's operand, not in shared memory (16 KB less
    # shared memory a program; on sm_90 the far kernel's 126 registers become 164: three programs an SM)
    far_q_in_registers: bool = False

    def __post_init__(self) -> None:
        for name in ("heads", "block_q", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"AttentionConfig.{name} must be a power of two, got {v}")
        if self.heads * self.block_q < 16 or self.block_n < 16:
            raise ValueError("AttentionConfig: heads*block_q and block_n must be at least 16 (tl.dot)")
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"AttentionConfig.num_splits must be in 1..{MAX_SPLITS}")
        if self.shear not in ("gather", "scratch", "chunk"):
            raise ValueError(
                f"AttentionConfig.shear must be 'gather', 'scratch' or 'chunk', got {self.shear!r}"
            )
        if self.table_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"AttentionConfig.table_dtype must be 'float32' or 'bfloat16', got {self.table_dtype!r}"
            )
        if self.rel_slice < 0 or self.rel_slice & (self.rel_slice - 1):
            raise ValueError(f"AttentionConfig.rel_slice must be 0 or a power of two, got {self.rel_slice}")
        if self.chunk_tiles < 1:
            raise ValueError(f"AttentionConfig.chunk_tiles must be at least 1, got {self.chunk_tiles}")
        for name in ("far_impl", "near_impl"):
            impl = getattr(self, name)
            if impl not in ("triton", "gluon"):
                raise ValueError(f"AttentionConfig.{name} must be 'triton' or 'gluon', got {impl!r}")
            if impl == "gluon" and (
                self.block_q != 16 * self.num_warps or self.block_n > 256 or self.heads != 1
            ):
                raise ValueError(
                    f"AttentionConfig.{name} 'gluon' takes one head, block_q = 16 x num_warps (wgmma's rows) "
                    "and block_n <= 256"
                )
        if self.near_impl == "gluon" and (self.block_n != self.block_q or self.num_splits != 1):
            raise ValueError("AttentionConfig.near_impl 'gluon' takes block_n = block_q and one split")


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def choose_config(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_kv_len: int,
    num_sms: int,
    float32: bool = False,
    window: int = 0,
    gluon: bool = False,
) -> AttentionConfig:
    """Tiles and splits from shapes only: (batch, heads, max_seqlen_q, max KV length bucket), and the
    layer's kind (window > 0: a sliding layer). gluon: the one-head prefill launches on Hopper's wgmma
    (gluon_attention.py; the op's impl "gluon"): the far launch, and the rest where it runs unsplit; decode
    and verify keep the `tl` kernel.

    max_kv_len is a bound known on the host (block-table capacity, or window + max_seqlen_q for
    sliding layers); each split then takes its share of the tiles of the device-side seq_len.
    float32 (IEEE dots, unrolled FMA loops) gets tiles of at most 32 keys and 32 query rows: compiling for
    sm_90 took 28 s at 16x64 and 182 s at 64x64 against 3-9 s at 32x32 (Triton 3.6, timed on the CPU).
    """
    group = num_q_heads // num_kv_heads
    small = interpreting()  # CPU interpreter: small tiles keep tests fast and exercise tile edges
    pow2_group = group & (group - 1) == 0
    packed = pow2_group and max_seqlen_q * group <= 128 and max_seqlen_q <= 16
    # A verify's query tile: the query count's power of two, at most VERIFY_TILE_ROWS (a verify of 9-16
    # queries takes two tiles); decode pads one query to the 16 rows of a tensor-core tile
    rows = triton.next_power_of_2(max_seqlen_q)
    if max_seqlen_q > 1:
        rows = min(rows, VERIFY_TILE_ROWS)
    block_q = max(rows, triton.cdiv(16, group))
    if packed and float32 and not small:
        # float32 packs at most 32 rows (a verify of group 8 did not compile within 90 s on the H200)
        packed = group * block_q <= 32
    far_launch = False
    if packed:
        # decode / verify: the GQA group's heads share every K/V tile
        # (H200, bench/results/attention.md: decode block_n 128 beat 64 by 1.1-2x; verify 64 beat 128)
        heads = group
        # A verify: the relative term as one GEMV per query row (rel_gemv). H200, graph-timed
        # (bench/results/gpu-2026-12-01/s13-verify/): 4 queries at 8K 0.050 ms against 0.280 for the band
        # sheared with tl.gather (BAND_3D, block_q 16), 0.025 against 0.194 on a 4K-window layer. At 9
        # queries in one 16-row tile the GEMV took 0.33-0.61 ms, slower than the band's 0.287; so 9-16
        # queries take two tiles of 8 rows (measured 2026-12-02). (The heads' bands side by side, below block_q
        # 16, were slower still; ptxas spent 180-260 s on them.)
        rel_gemv = max_seqlen_q > 1
        block_n = 16 if small else (128 if max_seqlen_q == 1 else 64)
        # Decode: three stages (H200, graph-timed, bench/results/gpu-2026-11-30/s10/attention-decode/:
        # 3-7% faster than two at B=1 KV 8K and 128K and B=32 KV 8K; eight warps were 20-50% slower).
        num_warps, num_stages = 4, (3 if max_seqlen_q == 1 else 2)
        if rel_gemv and heads * block_q >= 64:  # H200, 6 and 8 queries of group 8: 11-17% faster
            num_warps = 8
        shear = "gather"
        # The relative term as a pipelined dot (rel_dot) where decode programs fill the GPU unsplit; with
        # split-KV the GEMV form (H200, graph-timed, bench/results/gpu-2026-12-01/s12-attn/: B=32 KV 8K
        # 0.469 ms at block_n 64 against 0.508 for the GEMV's best; B=1 KV 8K 0.028-0.031 ms for both;
        # KV 128K 0.240 against 0.212 and 1M 1.80 against 1.18 ms, the dot's larger pipeline stages
        # leaving fewer programs per SM).
        rel_dot = max_seqlen_q == 1 and not float32 and num_seqs * (num_q_heads // heads) >= num_sms
        if rel_dot and not small:
            block_n = 64
    else:
        # One head per program; the relative term from a per-program table per chunk of 3 KV tiles (H200,
        # bench/results/gpu-2026-12-01/s16/: prefill 8K 12.82 ms at 64x64 and 4 warps, against 14.42 for
        # the band sheared through a scratch per tile, 18.1-22.6 for 8 warps or other tiles; tl.gather,
        # 2026-11-29, 21.4). float32 keeps the scratch form: the chunk form's second tile loop (unmasked
        # chunks) would double the IEEE dots' long sm_90 compile.
        # One H100, 2026-12-07 (bench/results/gpu-2026-12-07/h100-attention-variants/): a sliding layer's 8K
        # prefill 1.91 ms through the scratch against 2.45 for the chunked table (2.44 with the whole window
        # in one table); its every tile carries the term, so the table's pipelined loop gains nothing there.
        # A full layer's far tiles in their own launch: an 8K chunk at the end of 128K keys 127.1 ms against
        # 146.4 in one launch, an 8K prompt 6.46 against 6.43.
        heads = 1
        block_q = 16 if small else 64
        block_n = 16 if small else 64
        num_warps, num_stages = 4, 2
        shear = "scratch" if float32 or window > 0 else "chunk"
        far_launch = not float32
        rel_dot = rel_gemv = False
        if float32 and not small:
            block_q = 32
    if float32:
        block_n = min(block_n, 32)
    programs = triton.cdiv(max_seqlen_q, block_q) * num_seqs * (num_q_heads // heads)
    kv_tiles = triton.cdiv(max(max_kv_len, 1), block_n)
    num_splits = 1
    target = 2 * num_sms
    min_tiles = MIN_TILES_PER_SPLIT
    if programs < num_sms and (
        kv_tiles > LONG_SPLIT_TILES * triton.cdiv(target, programs) or (max_seqlen_q == 1 and not small)
    ):
        # Few programs: four per SM rather than two, so that more loads are in flight (H200, B=1 KV 128K,
        # graph-timed: 64 splits 0.203 ms against 0.235 at 33). Decode (one query) at any length, down to one
        # KV tile a split: in the e2e's batch-1 step every layer had taken 23.3 us, a 4K-window layer (16
        # splits of 2 tiles) as long as a full 8K one (33 of 2), each reading its KV and relative table cold;
        # with 32 and 64 splits, 20.0 us (bench/results/gpu-2026-12-01/s19-attn/). The earlier model's attention
        # bench, which replayed one layer from a warm L2, put 64 splits for the full layer 13% behind 32 (0.0346 against
        # 0.0306 ms) and 32 for the window 8% ahead of 16.
        target = 4 * num_sms
        if max_seqlen_q == 1 and not small:
            min_tiles = 1
    if programs < target:
        num_splits = min(triton.cdiv(target, programs), triton.cdiv(kv_tiles, min_tiles), MAX_SPLITS)
        num_splits = max(num_splits, 1)
    far_impl = near_impl = "triton"
    if gluon and heads == 1 and not float32 and block_q == 16 * num_warps:
        far_impl = "gluon" if far_launch and shear == "chunk" else "triton"  # see far_launches
        near_impl = "gluon" if num_splits == 1 and block_n == block_q else "triton"
    return AttentionConfig(
        heads=heads,
        block_q=block_q,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        shear=shear,
        rel_dot=rel_dot,
        rel_gemv=rel_gemv,
        far_launch=far_launch,
        far_impl=far_impl,
        near_impl=near_impl,
    )


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"bank_attention: {msg}")


def kernel_constexprs(
    config: AttentionConfig, max_seqlen_q: int, group: int, D: int, Dr: int, page: int, dtype: torch.dtype,
    log_scale: bool = False,
) -> dict:  # fmt: skip
    """The attention kernel's compile-time arguments for a launch (bench/sm90.py compiles the same);
    log_scale: the full layers' log scaling. The table's last row is zero (the term beyond the extent)."""
    one_head_tiles = config.heads == 1 and max_seqlen_q > 1
    rel_gemv = config.rel_gemv and config.heads > 1 and max_seqlen_q > 1
    u_width = 0
    if config.shear == "chunk" and one_head_tiles:
        # Whole key tiles (the table is filled block_n columns a dot), not a power of two: 640 columns, not
        # 1024, for a sliding layer's 9 tiles of 64 (its 512-token window and the diagonal's tile in one table).
        u_width = (
            triton.cdiv(config.chunk_tiles * config.block_n + config.block_q - 1, config.block_n)
            * config.block_n
        )
    return dict(
        D=D,
        DR=Dr,
        DR_SLICE=min(config.rel_slice, Dr) if config.rel_slice else Dr,
        GROUP=group,
        HEADS=config.heads,
        BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n,
        BAND=triton.next_power_of_2(min(config.block_q, max_seqlen_q) + config.block_n - 1),
        BAND_3D=config.heads > 1 and config.block_q >= 16 and not rel_gemv,
        SINGLE_QUERY=max_seqlen_q == 1,
        REL_DOT=config.rel_dot,
        REL_GEMV=rel_gemv,
        PAGE=page,
        SPLIT=config.num_splits > 1,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        SCRATCH=config.shear == "scratch" and one_head_tiles,
        RELATIVE=config.relative,
        FAR_TEST=config.far_test,
        U_WIDTH=u_width,
        CHUNK=config.chunk_tiles,
        UNMASKED_CHUNKS=config.unmasked_chunks,
        INTERPRET=interpreting(),
        LOG_SCALE=log_scale,
        ZERO_FAR=True,
        PART=0,  # every tile in one launch (`far_launches` makes two)
    )


def table_dtype(config: AttentionConfig) -> torch.dtype:
    """The element type of a launch's scratch or relative table."""
    return torch.bfloat16 if config.table_dtype == "bfloat16" else torch.float32


def scratch_row(constexprs: dict) -> int:
    """Elements per query row of a program's scratch (0: the launch needs none)."""
    return constexprs["U_WIDTH"] or (constexprs["BAND"] if constexprs["SCRATCH"] else 0)


def scratch_slots(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles that can exist over `num_seqs` sequences of `num_tokens` in all: the kernel's scratch
    slots (its slot q_start // block_q + b + t). Not the grid's tiles of the longest sequence times the
    sequences: an 8K prefill beside 31 decodes would take 32 times its own scratch (10 GiB, seen)."""
    return num_tokens // block_q + num_seqs


def _check_common(q, r, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens) -> None:
    T, Hq, D = q.shape
    Hkv, Dk = key_cache.shape[2:]
    B = seq_lens.shape[0]
    Dr = r.shape[-1]
    _check(r.shape == (T, Hq, Dr), f"r {tuple(r.shape)} must be [T={T}, Hq={Hq}, Dr]")
    _check(Dk == D and value_cache.shape == key_cache.shape, "key/value cache must be [NB, BS, Hkv, D]")
    _check(Hq % Hkv == 0, f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    _check(D & (D - 1) == 0 and Dr & (Dr - 1) == 0 and Dr >= 16, "D and Dr must be powers of two, Dr >= 16")
    _check(key_cache.shape[1] & (key_cache.shape[1] - 1) == 0, "block_size must be a power of two")
    _check(q.dtype == r.dtype == key_cache.dtype == value_cache.dtype, "q, r and the caches share one dtype")
    _check(q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}")
    _check(block_table.dtype == torch.int32 and block_table.dim() == 2, "block_table must be int32 [B, MB]")
    _check(
        cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (B + 1,),
        "cu_seqlens_q must be int32 [B+1]",
    )
    _check(seq_lens.dtype == torch.int32 and block_table.shape[0] == B, "seq_lens must be int32 [B]")
    for name, t in (("q", q), ("r", r), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    _check(block_table.stride(1) == 1, "block_table must be contiguous in its last dim")


def bank_table(bank: torch.Tensor) -> torch.Tensor:
    """The kernel's relative table of a [d_rel, X] bank: [X + 1, d_rel], row x = P[:, x], row X zero (the
    term beyond the extent, where the kernel clips distances)."""
    d_rel, X = bank.shape
    table = bank.new_zeros(X + 1, d_rel)
    table[:X] = bank.t()
    return table


def bank_attention(
    q: torch.Tensor,  # [T, Hq, D], after q_norm
    r: torch.Tensor,  # [T, Hq, d_rel]
    bank: torch.Tensor,  # [d_rel, X], shared by the heads
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
    config: AttentionConfig | None = None,
    gluon: bool = False,
) -> torch.Tensor:
    """The real Inkling's attention (INKLING_SPEC §3.4): one relative table for every head (stride 0 between
    heads), zero from distance X on, the log scaling of full layers. Without a config the tiles come from
    choose_config (gluon: its Hopper prefill launches)."""
    _check(bank.dim() == 2 and bank.shape[0] == r.shape[-1], f"bank {tuple(bank.shape)} must be [d_rel, X]")
    d_rel = r.shape[-1]
    if d_rel < MIN_DR:  # the tensor cores' smallest reduction: zero columns add nothing (toy widths only)
        r = torch.nn.functional.pad(r, (0, MIN_DR - d_rel))
        bank = torch.nn.functional.pad(bank, (0, 0, 0, MIN_DR - d_rel))
    _check_common(q, r, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
    table = bank_table(bank.to(q.dtype))
    return _attention(
        q, r, table, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, window, scale,
        float(log_floor), log_alpha, config, gluon,
    )  # fmt: skip


def _attention(
    q, r, table: torch.Tensor, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, window,
    scale, log_floor: float, log_alpha: float, config: AttentionConfig | None, gluon: bool = False,
) -> torch.Tensor:  # fmt: skip
    T, Hq, D = q.shape
    BS, Hkv = key_cache.shape[1], key_cache.shape[2]
    B = seq_lens.shape[0]
    cu_seqlens_q = cu_seqlens_q.contiguous()
    seq_lens = seq_lens.contiguous()

    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    if config is None:
        gluon = gluon and gluon_misfit(q, table.shape[1]) is None
        max_kv = block_table.shape[1] * BS
        if window > 0:
            max_kv = min(max_kv, window + max_seqlen_q - 1)
        config = choose_config(
            B,
            Hq,
            Hkv,
            max_seqlen_q,
            max_kv,
            _num_sms(q.device),
            float32=q.dtype == torch.float32,
            window=window,
            gluon=gluon,
        )
    group = Hq // Hkv
    _check(config.heads in (1, group), f"config.heads must be 1 or the GQA group {group}")
    splits = config.num_splits
    grid = (triton.cdiv(max_seqlen_q, config.block_q), B * (Hq // config.heads), splits)
    constexprs = kernel_constexprs(config, max_seqlen_q, group, D, r.shape[-1], BS, q.dtype, log_floor > 0)
    # The kernel's PART: 0 every tile in one launch; 1 the far tiles, a partial (o, lse) in one slot, which
    # 2, the rest, joins into the output
    parts = (0,)
    if far_launches(config, constexprs, window, table.shape[0], block_table.shape[1] * BS):
        parts = (1, 2)
    partials = splits if constexprs["SPLIT"] else len(parts) - 1
    if partials:
        o_part = torch.empty((partials, T, Hq, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((partials, T, Hq), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    row = 0 if config.near_impl == "gluon" else scratch_row(constexprs)
    if row:
        scratch = torch.empty(
            (scratch_slots(T, B, config.block_q) * (Hq // config.heads) * splits, config.block_q, row),
            dtype=table_dtype(config),
            device=q.device,
        )
    else:
        scratch = out  # unused
    for part in parts:
        if part == 1 and config.far_impl == "gluon":
            gluon_far_launch(
                q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, o_part, lse_part, max_seqlen_q,
                table.shape[0], window, scale, log_floor, log_alpha, config,
            )  # fmt: skip
            continue
        if part != 1 and config.near_impl == "gluon":
            gluon_near_launch(
                q, r, table, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, out, o_part, lse_part,
                max_seqlen_q, window, scale, log_floor, log_alpha, config, join=part == 2,
            )  # fmt: skip
            continue
        kernels.bank_attention_kernel[grid](
            q, r, table, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, out, o_part, lse_part,
            scratch, q.stride(0), q.stride(1), r.stride(0), r.stride(1), 0, table.stride(0),  # one table, all heads
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table.stride(0), out.stride(0), out.stride(1), T, Hq, splits, table.shape[0],
            window if window > 0 else FULL_WINDOW, scale, log_floor or 1.0, log_alpha,
            **(constexprs | {"PART": part, "SPLIT": constexprs["SPLIT"] or part == 1}),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    if constexprs["SPLIT"]:
        kernels.split_kv_reduce_kernel[(T, Hq)](
            o_part, lse_part, out, out.stride(0), out.stride(1), T, Hq, partials,
            D=D, SPLITS_P2=triton.next_power_of_2(partials),
        )  # fmt: skip
    return out


def gluon_far_launch(
    q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, o_part, lse_part, max_seqlen_q: int, rows: int,
    window: int, scale: float, log_floor: float, log_alpha: float, config: AttentionConfig,
) -> None:  # fmt: skip
    """The far launch (PART 1) on Hopper's wgmma through Gluon (gluon_attention.py): the same far tiles of the
    same query tiles, the same partial in split 0's slot of (o_part, lse_part)."""
    from . import gluon_attention

    T, Hq, D = q.shape
    _check_gluon(q, "far_impl")
    grid = (triton.cdiv(max_seqlen_q, config.block_q), seq_lens.shape[0] * Hq)
    gluon_attention.far_attention_kernel[grid](
        q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, o_part, lse_part,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0), Hq, rows,
        window if window > 0 else FULL_WINDOW, scale, log_floor or 1.0, log_alpha,
        D=D, GROUP=Hq // key_cache.shape[2], BLOCK_Q=config.block_q, BLOCK_N=config.block_n,
        PAGE=key_cache.shape[1], STAGES=max(2, config.num_stages), LOG_SCALE=log_floor > 0,
        Q_IN_REGISTERS=config.far_q_in_registers, num_warps=config.num_warps,
    )  # fmt: skip


def gluon_near_launch(
    q, r, table, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, out, o_part, lse_part,
    max_seqlen_q: int, window: int, scale: float, log_floor: float, log_alpha: float, config: AttentionConfig,
    join: bool,
) -> None:  # fmt: skip
    """The near launch on Hopper's wgmma through Gluon (gluon_attention.py): after a far launch (join) its
    query tiles' remaining key tiles, joined with the far partial, else every tile; into `out`."""
    from . import gluon_attention

    T, Hq, D = q.shape
    DR = table.shape[1]
    _check_gluon(q, "near_impl", DR)
    grid = (triton.cdiv(max_seqlen_q, config.block_q), seq_lens.shape[0] * Hq)
    gluon_attention.near_attention_kernel[grid](
        q, r, table, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, out, o_part, lse_part,
        q.stride(0), q.stride(1), r.stride(0), r.stride(1), table.stride(0), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
        value_cache.stride(2), block_table.stride(0), out.stride(0), out.stride(1), Hq, table.shape[0],
        window if window > 0 else FULL_WINDOW, scale, log_floor or 1.0, log_alpha,
        D=D, DR=DR, GROUP=Hq // key_cache.shape[2], BLOCK_Q=config.block_q, BLOCK_N=config.block_n,
        PAGE=key_cache.shape[1], STAGES=max(2, config.num_stages), LOG_SCALE=log_floor > 0, JOIN=join,
        Q_IN_REGISTERS=config.far_q_in_registers, BAND_BF16=config.table_dtype == "bfloat16",
        num_warps=config.num_warps,
    )  # fmt: skip


def gluon_device_misfit(device: torch.device | None = None) -> str | None:
    """Why `device` (default: this machine's current CUDA device) cannot run the Gluon launches at all, or
    None where it can: a Hopper GPU (sm_90) whose Triton has Gluon's Hopper ops. What the builder asks
    before it takes them and the runtime before it loads an engine built with them."""
    if device is not None and device.type != "cuda":
        return f"needs a Hopper GPU (sm_90); {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "needs a Hopper GPU (sm_90); this machine has no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"needs a Hopper GPU (sm_90); this one is sm_{major}{minor}"
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError as e:
        return f"needs Triton with Gluon (3.6 or later): {e}"
    return None


def gluon_misfit(q: torch.Tensor, d_rel: int | None = None) -> str | None:
    """Why the Gluon launches cannot take these queries, or None where they can: a Hopper GPU, bf16 or fp16
    (wgmma), a head dimension of 16, 32, 64, 128 or 256 (rows loaded in 16-byte vectors), and for the near
    launch a relative table of 16 or 32 columns (after its padding)."""
    D = q.shape[-1]
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "takes bf16 or fp16 (wgmma)"
    if not (D % 16 == 0 and D <= 256 and 32 % (D // 8) == 0):
        return f"takes a head dimension of 16, 32, 64, 128 or 256, got {D}"
    if d_rel is not None and d_rel not in (16, 32):
        return f"takes d_rel 16 or 32 (padded), got {d_rel}"
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return "runs on sm_90"
    return None


def _check_gluon(q: torch.Tensor, what: str, d_rel: int | None = None) -> None:
    why = gluon_misfit(q, d_rel)
    _check(why is None, f"{what} 'gluon' {why}")


def far_launches(config: AttentionConfig, constexprs: dict, window: int, rows: int, max_kv: int) -> bool:
    """Whether a launch's far tiles go in a launch of their own (AttentionConfig.far_launch): the chunked
    table with its far loop, unsplit, on a layer whose table (`rows` rows, the last zero) ends inside every
    query's window (a full layer; a sliding layer's window is its extent), over sequences that may hold
    keys that far (`max_kv`: the block tables' capacity in tokens)."""
    chunked = constexprs["U_WIDTH"] > 0 and constexprs["ZERO_FAR"] and constexprs["UNMASKED_CHUNKS"]
    far = (window <= 0 or window >= rows) and max_kv > rows + config.block_n
    return config.far_launch and chunked and config.num_splits == 1 and far


def kv_cache_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    T, Hkv, D = k.shape
    BS = key_cache.shape[1]
    if not (v.shape == k.shape and key_cache.shape[2:] == (Hkv, D) and value_cache.shape == key_cache.shape):
        raise ValueError("kv_cache_write: k, v [T, Hkv, D] and caches [NB, BS, Hkv, D] disagree")
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        raise ValueError("kv_cache_write: slot_mapping must be int64 [T]")
    if D & (D - 1) or BS & (BS - 1):
        raise ValueError("kv_cache_write: D and block_size must be powers of two")
    for name, t in (("k", k), ("v", v), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"kv_cache_write: {name} must be contiguous in its last dim")
    if T == 0:
        return
    kernels.kv_cache_write_kernel[(T,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        HKV=Hkv,
        HKV_P2=triton.next_power_of_2(Hkv),
        D=D,
        PAGE=BS,
    )

"""The real Inkling's attention, `inkling::bank_attention`: Triton ⇄ the model's math (inkling.published.ops,
itself checked against transformers in tests/unit/test_published.py).

Shapes that hit the edges of INKLING_SPEC §3.4: full layers past the relative extent X (the term is zero
there, not clipped) and past a small log-scaling floor, sliding layers past their window (= their extent),
GQA groups of 8 (full) and 4 (sliding), ragged batches of prefill, chunked prefill, verify and decode rows,
page boundaries, one-token prompts, freed blocks behind a window (NaN in every row nobody owns). On the
CPU the kernel runs in the Triton interpreter in float32; bf16 and the H200's tiles are `gpu`-marked.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

import plugins  # noqa: F401  (registers the ops)
from inkling.published import ops
from inkling.published.ops import bank_attention as bank_math
from plugins.attention import launcher
from plugins.attention.launcher import AttentionConfig

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


@dataclass
class Layer:
    hq: int
    hkv: int
    extent: int  # X: the bank's columns
    window: int  # 0: full attention
    log_floor: int  # 0: no log scaling


FULL = Layer(hq=8, hkv=1, extent=24, window=0, log_floor=20)  # group 8; extent and floor passed below
SLIDING = Layer(hq=8, hkv=2, extent=16, window=16, log_floor=0)  # group 4; window = extent, as published
WIDE_WINDOW = Layer(hq=8, hkv=2, extent=8, window=40, log_floor=0)


@dataclass
class Batch:
    args: tuple
    truth: torch.Tensor  # the model's math per sequence on unpaged K/V, float32
    # (make_batch's bias_move) how far rounding the truth's relative bias to bf16 moves it, at most
    bias_move: float = 0.0


@contextlib.contextmanager
def _bias_rounded():
    """Inside: the model math's relative bias rounded to bf16 (as a bf16 model computes it in r's dtype),
    while its inputs and the rest of its math stay float32."""
    exact = ops.bank_bias
    with mock.patch.object(ops, "bank_bias", lambda *args: exact(*args).bfloat16().float()):
        yield


def make_batch(
    seqs: list[tuple[int, int]],  # (seq_len, q_len) per sequence
    layer: Layer,
    d: int = 32,
    d_rel: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    bias_move: bool = False,
) -> Batch:
    """A paged batch: shuffled block ids, NaN in every cache row no sequence owns, and on sliding layers the
    blocks wholly behind every query's window freed (-1 in the table or a block of NaN). bias_move: also
    the truth with its relative bias rounded to bf16 (as a bf16 model's math rounds it, the rest float32), and
    the most that moves it (Batch.bias_move)."""
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(d_rel, layer.extent, generator=g) * 0.5
    blocks_per_seq = [math.ceil(n / block_size) for n, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    key_cache = torch.full((num_blocks, block_size, layer.hkv, d), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    block_table = torch.full((len(seqs), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    ids = torch.randperm(num_blocks - 1, generator=g).tolist()
    qs, rs, truths, move = [], [], [], 0.0
    for b, (seq_len, q_len) in enumerate(seqs):
        k, v = (torch.randn(seq_len, layer.hkv, d, generator=g) for _ in range(2))
        q = torch.randn(q_len, layer.hq, d, generator=g) * 2.0
        r = torch.randn(q_len, layer.hq, d_rel, generator=g)
        q, k, v, r = (t.to(dtype).float() for t in (q, k, v, r))
        positions = torch.arange(seq_len, device=DEVICE)
        math_args = (
            *(t.to(DEVICE) for t in (q, k, v, r, bank.to(dtype).float())),
            positions[seq_len - q_len :], positions, layer.window or None, 1.0 / d, layer.log_floor or None, 0.1,
        )  # fmt: skip
        truths.append(bank_math(*math_args))
        if bias_move:
            with _bias_rounded():
                move = max(move, (bank_math(*math_args) - truths[-1]).abs().max().item())
        qs.append(q)
        rs.append(r)
        lo = max(0, seq_len - q_len - layer.window + 1) if layer.window else 0
        for n in range(blocks_per_seq[b]):
            rows = slice(n * block_size, min((n + 1) * block_size, seq_len))
            if (n + 1) * block_size <= lo:
                block_table[b, n] = -1 if n % 2 else num_blocks - 1
                continue
            blk = ids.pop()
            block_table[b, n] = blk
            key_cache[blk, : rows.stop - rows.start] = k[rows]
            value_cache[blk, : rows.stop - rows.start] = v[rows]
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    args = (
        torch.cat(qs).to(DEVICE, dtype),
        torch.cat(rs).to(DEVICE, dtype),
        bank.to(DEVICE, dtype),
        key_cache.to(DEVICE, dtype),
        value_cache.to(DEVICE, dtype),
        block_table.to(DEVICE),
        cu.to(DEVICE),
        torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=DEVICE),
        max(q_lens),
        layer.window,
        1.0 / d,
        layer.log_floor,
        0.1,
    )
    return Batch(args, torch.cat(truths).to(DEVICE), move)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


# Every batch is ragged and crosses pages; lengths pass the extent (24 / 16), the window (16) and the floor
# (20), and one-token prompts sit beside long ones.
PREFILL = [(45, 45), (1, 1), (20, 20)]
CHUNKED = [(70, 23), (40, 5), (33, 33), (17, 1)]
VERIFY = [(60, 9), (26, 1), (47, 4), (9, 9)]
DECODE = [(70, 1), (7, 1), (25, 1), (1, 1)]
BATCHES = {"prefill": PREFILL, "chunked": CHUNKED, "verify": VERIFY, "decode": DECODE}


@pytest.mark.parametrize("layer", [FULL, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("name", BATCHES)
def test_reference_op_matches_the_math(name, layer):
    """The reference op over the paged caches (freed blocks and NaN rows never read) equals the math."""
    batch = make_batch(BATCHES[name], layer)
    assert batch.truth.abs().mean() > 0.1
    out = torch.ops.inkling.bank_attention(*batch.args, "reference")
    assert_close(out, batch.truth, 1e-5)


@pytest.mark.parametrize("layer", [FULL, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("name", BATCHES)
def test_triton_matches_the_math(name, layer):
    """The op's Triton impl with the tiles and splits the launcher chooses."""
    batch = make_batch(BATCHES[name], layer)
    out = torch.ops.inkling.bank_attention(*batch.args, "triton")
    assert_close(out, batch.truth, 1e-4)


def _cfg(**kw) -> AttentionConfig:
    return AttentionConfig(**{"heads": 1, "block_q": 16, "block_n": 16, "num_splits": 1, **kw})


# The kernel's forms, forced: the chunked table (with the far chunks it skips and the unmasked chunks),
# the scratch shear, tl.gather, split-KV, the decode dot and GEMV, the verify GEMV.
FORMS = [
    ("chunk-far", FULL, CHUNKED + [(90, 16)], _cfg(shear="chunk", chunk_tiles=1)),
    ("chunk-far-split", FULL, [(96, 30), (50, 3)], _cfg(shear="chunk", chunk_tiles=1, num_splits=3)),
    # the far tiles in one loop ahead of the chunks, which then start off the chunk grid
    ("chunk-3-far-loop", FULL, [(120, 120), (100, 37), (58, 2)], _cfg(shear="chunk", chunk_tiles=3)),
    # a window wider than the extent (not the published shapes): far tiles above a masked window edge
    ("chunk-far-window", WIDE_WINDOW, CHUNKED + [(90, 16)], _cfg(shear="chunk", chunk_tiles=1)),
    # the far tiles in a launch of their own, merged with the rest's: programs with far tiles, with none
    # (the diagonal's, prompts shorter than the extent), and above a window's edge
    (
        "chunk-3-far-launch",
        FULL,
        [(120, 120), (100, 37), (58, 2), (12, 12)],
        _cfg(shear="chunk", chunk_tiles=3, far_launch=True),
    ),  # fmt: skip
    (
        "chunk-far-launch-window",
        WIDE_WINDOW,
        CHUNKED + [(90, 16)],
        _cfg(shear="chunk", chunk_tiles=1, far_launch=True),
    ),  # fmt: skip
    # a table of 48 columns (2 tiles of 16 and 15 query rows, rounded to a tile), not a power of two
    ("chunk-2-sliding", SLIDING, CHUNKED, _cfg(shear="chunk", chunk_tiles=2, num_splits=2)),
    ("chunk-masked", FULL, PREFILL, _cfg(shear="chunk", chunk_tiles=1, unmasked_chunks=False)),
    ("scratch", FULL, CHUNKED, _cfg(shear="scratch", num_splits=2)),
    ("gather-no-far-test", SLIDING, CHUNKED, _cfg(shear="gather", far_test=False)),
    ("decode-dot", FULL, DECODE, _cfg(heads=8, block_q=2, rel_dot=True, num_splits=3)),
    ("decode-gemv-sliding", SLIDING, DECODE, _cfg(heads=4, block_q=4, num_splits=2)),
    ("verify-gemv", FULL, VERIFY, _cfg(heads=8, block_q=8, rel_gemv=True, num_splits=2)),
    ("verify-band", SLIDING, VERIFY, _cfg(heads=4, block_q=16)),
]


@pytest.mark.parametrize("layer,seqs,config", [f[1:] for f in FORMS], ids=[f[0] for f in FORMS])
def test_kernel_forms(layer, seqs, config):
    batch = make_batch(seqs, layer)
    out = launcher.bank_attention(*batch.args, config=config)
    assert_close(out, batch.truth, 1e-4)


def test_far_launches_where_far_tiles_may_exist():
    """The far tiles' own launch (AttentionConfig.far_launch) is taken on a full layer whose block tables
    reach past the table's extent, and not on a sliding layer (its window is its extent) or a short one."""
    config = _cfg(shear="chunk", far_launch=True)
    constexprs = launcher.kernel_constexprs(config, 64, 8, 16, 16, 16, torch.float32, log_scale=True)
    rows = FULL.extent + 1
    assert launcher.far_launches(config, constexprs, FULL.window, rows, max_kv=128)
    assert not launcher.far_launches(config, constexprs, SLIDING.window, SLIDING.extent + 1, max_kv=128)
    assert not launcher.far_launches(config, constexprs, FULL.window, rows, max_kv=rows + 16)
    assert not launcher.far_launches(_cfg(shear="chunk"), constexprs, FULL.window, rows, max_kv=128)


def test_zero_beyond_the_extent_and_log_scaling_are_the_kernels_own():
    """Mutations the test must see: the same batch with the distances clipped at the extent (the earlier
    model's rule, a non-zero term far away) or without the log scaling differs from the kernel's output."""
    batch = make_batch([(60, 60)], FULL)
    out = launcher.bank_attention(*batch.args)
    bank = batch.args[2]
    # the earlier rule: distances past the extent read its last column (a bank long enough that nothing is
    # beyond it, its columns from X - 1 on all the last one)
    clipped_bank = torch.cat([bank, bank[:, -1:].expand(-1, 60 - bank.shape[1])], dim=1)
    clipped = launcher.bank_attention(*batch.args[:2], clipped_bank, *batch.args[3:11], 0, 0.1)
    no_log = launcher.bank_attention(*batch.args[:11], 0, 0.1)
    assert_close(out, batch.truth, 1e-4)
    assert (clipped - no_log).abs().max() > 1e-2
    assert (no_log - out).abs().max() > 1e-2


def test_bank_table_zero_row():
    bank = torch.randn(16, 5)
    table = launcher.bank_table(bank)
    assert table.shape == (6, 16)
    assert torch.equal(table[:5], bank.t()) and not table[5].any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("layer", [FULL, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("name", BATCHES)
def test_gpu_bf16(name, layer):
    """bf16 on the H200 with the launcher's own tiles, against the float32 math on the bf16-rounded inputs."""
    batch = make_batch(BATCHES[name], layer, d=128, dtype=torch.bfloat16)
    out = torch.ops.inkling.bank_attention(*batch.args, "triton")
    assert_close(out, batch.truth, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("layer,seqs,config", [f[1:] for f in FORMS], ids=[f[0] for f in FORMS])
def test_gpu_kernel_forms_float32(layer, seqs, config):
    batch = make_batch(seqs, layer, d=64)
    out = launcher.bank_attention(*batch.args, config=config)
    assert_close(out, batch.truth, 2e-3)  # tf32 is not used in float32 (IEEE dots); sums differ in order


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_long_prefill_real_shapes():
    """The real layers' shapes: 64 query heads, 8 or 16 KV heads, D 128, d_rel 16, X 1024 / 512, log floor
    passed; a 3000-token prefill in bf16 with the launcher's chunked table (far chunks skipped)."""
    full = Layer(hq=64, hkv=8, extent=1024, window=0, log_floor=1000)
    sliding = Layer(hq=64, hkv=16, extent=512, window=512, log_floor=0)
    for layer in (full, sliding):
        batch = make_batch([(3000, 3000), (1500, 700)], layer, d=128, dtype=torch.bfloat16)
        out = torch.ops.inkling.bank_attention(*batch.args, "triton")
        assert_close(out, batch.truth, 3e-2)


def long_batch(
    seq_len: int, q_len: int, layer: Layer, block_size: int = 16, device: str = "cuda", dtype=torch.bfloat16
) -> Batch:
    """One sequence of seq_len keys and its last q_len queries, built on `device` in `dtype` at the real
    head dimension 128 and d_rel 16: shuffled blocks, NaN in the rows it does not own, and on a sliding layer
    the blocks behind every query's window freed (-1, their rows NaN). Queries are scaled so that the scores
    spread (a standard deviation of about 4): over a million keys a near-uniform softmax would average v to
    about zero, which a kernel returning zeros would match. The truth: the model's math in float32 on the
    rounded inputs, a KV head and 64 queries at a time, holding O(keys) rather than O(keys x heads) (1M keys
    of 64 query heads in float32 would be 32 GB a tensor)."""
    g = torch.Generator(device=device).manual_seed(0)
    dt, d, d_rel, nan = dtype, 128, 16, float("nan")

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    k, v = randn(seq_len, layer.hkv, d), randn(seq_len, layer.hkv, d)
    q, r, bank = (
        randn(q_len, layer.hq, d, scale=45.0),
        randn(q_len, layer.hq, d_rel),
        randn(d_rel, layer.extent, scale=0.5),
    )
    blocks = math.ceil(seq_len / block_size)
    slots = torch.randperm(blocks, generator=g, device=device)  # the sequence's block n lives in slots[n]
    tail = torch.full((blocks * block_size - seq_len, layer.hkv, d), nan, dtype=dt, device=device)
    caches = []
    for x in (k, v):
        cache = torch.full((blocks + 1, block_size, layer.hkv, d), nan, dtype=dt, device=device)
        cache[slots] = torch.cat([x, tail]).view(blocks, block_size, layer.hkv, d)
        caches.append(cache)
    table = torch.cat([slots, slots.new_full((1,), -1)]).to(torch.int32)[None]
    lo = max(0, seq_len - q_len - layer.window + 1) if layer.window else 0  # the first key any query sees
    behind = (torch.arange(blocks, device=device) + 1) * block_size <= lo
    for cache in caches:
        cache[slots[behind]] = nan
    table[0, :blocks][behind] = -1
    args = (
        q, r, bank, *caches, table, torch.tensor([0, q_len], dtype=torch.int32, device=device),
        torch.tensor([seq_len], dtype=torch.int32, device=device), q_len, layer.window, 1.0 / d, layer.log_floor, 0.1,
    )  # fmt: skip
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    k_pos = torch.arange(lo, seq_len, device=device)
    group = layer.hq // layer.hkv
    truth = torch.empty(q_len, layer.hq, d, device=device)
    for h in range(layer.hkv):
        heads = slice(h * group, (h + 1) * group)
        for c in range(0, q_len, 64):
            rows = slice(c, min(c + 64, q_len))
            truth[rows, heads] = bank_math(
                q[rows, heads].float(), k[lo:, h : h + 1].float(), v[lo:, h : h + 1].float(), r[rows, heads].float(),
                bank.float(), q_pos[rows], k_pos, layer.window or None, 1.0 / d, layer.log_floor or None, 0.1,
            )  # fmt: skip
    return Batch(args, truth)


# The published log-scaling floor (128,000 tokens): passed at 1M keys (tau 1.21), barely at 128K.
LONG_FULL = Layer(hq=64, hkv=8, extent=1024, window=0, log_floor=128000)
LONG_SLIDING = Layer(hq=64, hkv=16, extent=512, window=512, log_floor=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("impl", ["triton", "gluon"])
@pytest.mark.parametrize("layer", [LONG_FULL, LONG_SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("seq_len,q_len", [(1 << 20, 1), (131072, 512)], ids=["decode-at-1M", "512-at-128K"])
def test_gpu_long_kv_real_shapes(seq_len, q_len, layer, impl):
    """The real layers at length in bf16, with the launcher's tiles: decode against 1M keys (split-KV over 8,192 key
    tiles) and a 512-query chunk ending at 128K keys (the far tiles' launch, the near tiles joined to it; with
    impl "gluon" both on Hopper's wgmma), against the float32 math."""
    if impl == "gluon" and (q_len == 1 or not gluon_ok()):
        pytest.skip("the Gluon launches are prefill's, on sm_90")
    batch = long_batch(seq_len, q_len, layer)
    assert batch.truth.abs().mean() > 0.1  # a few keys weigh: zeros would fail
    out = torch.ops.inkling.bank_attention(*batch.args, impl)
    assert_close(out, batch.truth, 3e-2)


@pytest.mark.parametrize("layer", [LONG_FULL, LONG_SLIDING], ids=["full", "sliding"])
def test_long_batch_pages_and_truth(layer):
    """long_batch's paging (shuffled, NaN tails, freed blocks behind the window) and its head-by-head,
    chunked truth, on the CPU at a small length: the reference op over its caches gives its truth."""
    batch = long_batch(1100, 70, layer, device="cpu", dtype=torch.float32)
    assert (batch.args[5] == -1).sum() == (1 if layer.window == 0 else 1 + (1100 - 70 - 512 + 1) // 16)
    out = torch.ops.inkling.bank_attention(*batch.args, "reference")
    assert_close(out, batch.truth, 1e-5)


def gluon_ok() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


SMALL_FULL = Layer(hq=8, hkv=1, extent=24, window=0, log_floor=20)
REAL_FULL = Layer(hq=64, hkv=8, extent=1024, window=0, log_floor=1000)
REAL_SLIDING = Layer(hq=64, hkv=16, extent=512, window=512, log_floor=0)
# Programs with far tiles and with none (prompts shorter than the extent, the diagonal's), chunks, one-query rows.
SMALL_SEQS = [(300, 300), (260, 100), (58, 2), (12, 12), (200, 1)]
REAL_SEQS = [(3000, 3000), (2600, 512), (1500, 700), (700, 1)]


def _gluon(block_n: int = 64, stages: int = 2, **kw) -> AttentionConfig:
    return AttentionConfig(
        heads=1, block_q=64, block_n=block_n, num_splits=1, num_stages=stages, shear="chunk", **kw
    )


# (layer, seqs, head dim, the config with a Gluon launch): the far launch with key tiles of 16, 32 and 64, 2
# or 3 K/V slots, Q in registers; the near launch after the `tl` far launch or the Gluon one, alone on a full
# layer (its band clamped to the zero row past the extent) and on sliding layers (the window's edge masked)
GLUON_CASES = {
    "far-small-16": (SMALL_FULL, SMALL_SEQS, 64, _gluon(16, far_launch=True, far_impl="gluon")),
    "far-small-32-3s": (SMALL_FULL, SMALL_SEQS, 64, _gluon(32, 3, far_launch=True, far_impl="gluon")),
    "far-real": (REAL_FULL, REAL_SEQS, 128, _gluon(far_launch=True, far_impl="gluon")),
    "far-real-q-registers": (REAL_FULL, REAL_SEQS, 128, _gluon(far_launch=True, far_impl="gluon",
                                                               far_q_in_registers=True)),
    "far-real-128-rows": (REAL_FULL, REAL_SEQS, 128, AttentionConfig(heads=1, block_q=128, block_n=64, num_splits=1,
                          num_warps=8, shear="chunk", far_launch=True, far_impl="gluon")),
    "near-small-join": (SMALL_FULL, SMALL_SEQS, 64, _gluon(far_launch=True, near_impl="gluon")),
    "near-small-alone": (SMALL_FULL, SMALL_SEQS, 64, _gluon(near_impl="gluon")),
    "near-small-sliding": (SLIDING, SMALL_SEQS, 64, _gluon(near_impl="gluon")),
    "both-real": (REAL_FULL, REAL_SEQS, 128, _gluon(far_launch=True, far_impl="gluon", near_impl="gluon")),
    "both-real-3s-q-registers": (REAL_FULL, REAL_SEQS, 128, _gluon(64, 3, far_launch=True, far_impl="gluon",
                                                                   near_impl="gluon", far_q_in_registers=True)),
    "near-real-sliding": (REAL_SLIDING, REAL_SEQS, 128, _gluon(near_impl="gluon")),
    # the band through shared memory in bf16 (against the `tl` launch's bf16 table), Q in registers
    "both-real-bf16-band": (REAL_FULL, REAL_SEQS, 128, _gluon(far_launch=True, far_impl="gluon", near_impl="gluon",
                                                              table_dtype="bfloat16", far_q_in_registers=True)),
    "near-real-sliding-bf16-band": (REAL_SLIDING, REAL_SEQS, 128, _gluon(near_impl="gluon", table_dtype="bfloat16")),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not gluon_ok(), reason="needs an sm_90 GPU (Gluon's wgmma)")
@pytest.mark.parametrize("name", GLUON_CASES)
def test_gpu_gluon_launches(name):
    """The Gluon launches (AttentionConfig.far_impl, near_impl) give what the `tl` launches of the same tiles
    give, and both the model's math, in bf16."""
    import dataclasses

    layer, seqs, d, config = GLUON_CASES[name]
    # A bf16 table rounds the bias, as a bf16 model's math does (not at the same points): the outputs may
    # move as far as that rounding moves the float32 truth on the same batch (0.047 on the real full layer,
    # 0.057 on the sliding one: the `tl` launch's error against the float32 truth, 0.047 and 0.061)
    bf16_table = config.table_dtype == "bfloat16"
    batch = make_batch(seqs, layer, d=d, dtype=torch.bfloat16, bias_move=bf16_table)
    tol = 3e-2 + batch.bias_move
    tl_config = dataclasses.replace(config, far_impl="triton", near_impl="triton", far_q_in_registers=False)
    tl_out = launcher.bank_attention(*batch.args, config=tl_config)
    out = launcher.bank_attention(*batch.args, config=config)
    assert_close(tl_out, batch.truth, tol)
    assert_close(out, batch.truth, tol)
    assert_close(out, tl_out, 1.6e-2)


def test_gluon_launches_are_asked_for_their_own_shapes():
    """far_impl / near_impl 'gluon' take one head, wgmma's rows (16 per warp) and tiles of at most 256 keys; the
    near launch square tiles and one split; other values refused."""
    assert _gluon(far_impl="gluon", near_impl="gluon").near_impl == "gluon"
    with pytest.raises(ValueError, match="16 x num_warps"):
        AttentionConfig(heads=1, block_q=32, block_n=64, num_splits=1, far_impl="gluon")
    with pytest.raises(ValueError, match="block_n = block_q"):
        _gluon(32, near_impl="gluon")
    with pytest.raises(ValueError, match="one split"):
        AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=2, near_impl="gluon")
    with pytest.raises(ValueError, match="far_impl must be"):
        _gluon(far_impl="cuda")

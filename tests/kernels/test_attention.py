"""The attention kernel's forms and tiles, on the real op (`inkling::bank_attention`), and `kv_cache_write`:
every form the launcher may choose or a benchmark may time (split-KV, the decode dot and GEMV, the verify GEMV,
the scratch and chunked shears, tl.gather, bf16 tables, tile shapes) against the model's math
(test_bank_attention.make_batch's truth). Every batch is ragged, crosses pages, and passes the extent (zero
beyond it), the window and the log-scaling floor. On the CPU the kernel runs in the interpreter in float32 at
small shapes; bf16, the real shapes and CUDA graphs are `gpu`-marked.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest
import torch
import triton

import plugins  # noqa: F401  (registers the ops)
from plugins.attention import launcher
from plugins.attention.launcher import AttentionConfig

from .test_bank_attention import DEVICE, HAS_CUDA, Layer, assert_close, make_batch

# GQA group 4, so that tiles of 4 heads (the decode and verify forms) and of one head both apply
FULL = Layer(hq=8, hkv=2, extent=24, window=0, log_floor=20)
SLIDING = Layer(hq=8, hkv=2, extent=32, window=32, log_floor=0)  # window = extent, as published
PREFILL = [(37, 37), (1, 1), (50, 50)]
CHUNKED = [(90, 23), (70, 5), (33, 33), (17, 1)]
VERIFY = [(80, 9), (65, 1), (100, 4), (9, 9), (48, 7)]
DECODE = [(130, 1), (7, 1), (64, 1), (1, 1)]


def layer_of(window: int) -> Layer:
    return SLIDING if window else FULL


@pytest.mark.parametrize(
    "seqs,window,config",
    [
        (DECODE, 0, AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=3)),
        (DECODE, 32, AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=7)),
        (DECODE, 32, AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=3, rel_dot=False)),
        (VERIFY, 0, AttentionConfig(heads=4, block_q=16, block_n=16, num_splits=4)),
        # a verify of fewer queries than block_q (the GPU default for q 2..8, bf16)
        ([(100, 4), (65, 2)], 0, AttentionConfig(heads=4, block_q=16, block_n=16, num_splits=2)),
        # the relative term as one GEMV per query row (rel_gemv, the default for a verify): block_q the
        # query count's power of two, and padded rows in a tile, full and sliding, split or not
        (VERIFY, 0, AttentionConfig(heads=4, block_q=16, block_n=16, num_splits=3, rel_gemv=True)),
        (
            [(100, 4), (65, 2), (40, 3)],
            32,
            AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=2, rel_gemv=True),
        ),
        # a verify of more queries than a tile's rows (9-16 queries take tiles of 8 on the GPU): the later
        # tiles' rows start past the first, and the last tile is partly padding
        (
            [(100, 9), (65, 12), (40, 16), (20, 9)],
            32,
            AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=3, rel_gemv=True),
        ),
        # the GEMV forms reducing r . E a slice of Dr's columns at a time (rel_slice): decode and verify
        (
            DECODE,
            32,
            AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=3, rel_dot=False, rel_slice=4),
        ),
        (
            VERIFY,
            0,
            AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=2, rel_gemv=True, rel_slice=8),
        ),
        (VERIFY[:3], 32, AttentionConfig(heads=1, block_q=16, block_n=32, num_splits=2)),
        (CHUNKED[:2], 0, AttentionConfig(heads=1, block_q=32, block_n=16, num_splits=5)),
        # the previous GPU default for prefill (gather shear, 32x32)
        ([(70, 70), (9, 2)], 32, AttentionConfig(heads=1, block_q=32, block_n=32, num_splits=1, num_warps=2)),
        # the GPU defaults' tile shapes (launcher.choose_config off the interpreter)
        ([(300, 1), (5, 1)], 0, AttentionConfig(heads=4, block_q=4, block_n=128, num_splits=2)),
        # the relative band sheared through the per-program scratch, split and not, past the extent
        (
            PREFILL + CHUNKED,
            0,
            AttentionConfig(heads=1, block_q=16, block_n=16, num_splits=1, shear="scratch"),
        ),
        (
            CHUNKED + VERIFY,
            32,
            AttentionConfig(heads=1, block_q=32, block_n=16, num_splits=3, shear="scratch"),
        ),
        (
            [(150, 150), (9, 2)],
            0,
            AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=2, shear="scratch"),
        ),
        # no per-tile test for wholly clipped tiles (far_test off): tiles past the extent take the band path,
        # whose distances clamp to the table's zero row (prefill by scratch and by gather, decode GEMV, verify GEMV)
        (
            [(150, 150), (90, 23)],
            0,
            AttentionConfig(heads=1, block_q=16, block_n=16, num_splits=1, shear="scratch", far_test=False),
        ),
        (
            [(150, 150)],
            32,
            AttentionConfig(heads=1, block_q=32, block_n=16, num_splits=2, far_test=False),
        ),
        (
            DECODE,
            0,
            AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=3, rel_dot=False, far_test=False),
        ),
        (
            [(150, 4), (80, 3)],
            0,
            AttentionConfig(heads=4, block_q=4, block_n=16, num_splits=2, rel_gemv=True, far_test=False),
        ),
        # the relative table per chunk of tiles: chunks of 1, 3 (not dividing a split's tiles) and 4 tiles,
        # split or not, sliding, distances past the extent, prefill and chunked prefill (queries over a prefix)
        (
            PREFILL + CHUNKED,
            0,
            AttentionConfig(heads=1, block_q=16, block_n=16, num_splits=1, shear="chunk", chunk_tiles=1),
        ),
        (
            [(150, 150), (90, 23), (17, 1)],
            0,
            AttentionConfig(heads=1, block_q=16, block_n=16, num_splits=2, shear="chunk", chunk_tiles=3),
        ),
        (
            CHUNKED + [(150, 150)],
            32,
            AttentionConfig(heads=1, block_q=32, block_n=16, num_splits=3, shear="chunk", chunk_tiles=4),
        ),
        (
            CHUNKED + [(150, 150)],
            32,
            AttentionConfig(
                heads=1,
                block_q=32,
                block_n=16,
                num_splits=3,
                shear="chunk",
                chunk_tiles=4,
                unmasked_chunks=False,
            ),
        ),
        # the GPU's prefill tile shape, 64x64, past the extent
        (
            [(200, 200), (9, 2)],
            0,
            AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", chunk_tiles=3),
        ),
    ],
    ids=[
        "decode",
        "decode-sliding",
        "decode-sliding-gemv",
        "verify-packed",
        "verify-packed-short",
        "verify-gemv",
        "verify-gemv-short-sliding",
        "verify-gemv-two-tiles-sliding",
        "decode-gemv-sliced-sliding",
        "verify-gemv-sliced",
        "verify-unpacked",
        "chunked",
        "prefill-gather-32x32",
        "decode-bn128",
        "scratch-shear",
        "scratch-shear-sliding-split",
        "scratch-shear-64x64-far",
        "scratch-no-far-test",
        "gather-no-far-test-sliding",
        "decode-gemv-no-far-test",
        "verify-gemv-no-far-test",
        "chunk-1",
        "chunk-3-split-far",
        "chunk-4-sliding-split",
        "chunk-4-sliding-split-all-masked",
        "chunk-3-64x64-far",
    ],
)
def test_split_kv(seqs, window, config):
    """Split-KV (flash-decoding) with splits that do not divide the tiles, and empty splits, in every form."""
    batch = make_batch(seqs, layer_of(window))
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, 1e-4)


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(heads=1, block_q=16, block_n=16, num_splits=2, shear="chunk", table_dtype="bfloat16"),
        AttentionConfig(
            heads=1, block_q=32, block_n=16, num_splits=1, shear="scratch", table_dtype="bfloat16"
        ),
    ],
    ids=["chunk", "scratch"],
)
def test_bfloat16_relative_table(config):
    """A bf16 scratch or chunk table (AttentionConfig.table_dtype, half the bytes): the term is rounded to
    bf16 and nothing else changes, so the output stays within bf16 rounding of the truth (inputs float32,
    as the interpreter computes bf16 arithmetic wrongly), while a float32 table is exact."""
    batch = make_batch(PREFILL + CHUNKED, SLIDING)
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, 3e-2)
    exact = dataclasses.replace(config, table_dtype="float32")
    assert_close(launcher.bank_attention(*batch.args, config=exact), batch.truth, 1e-4)


def test_scratch_slots_are_distinct_and_bounded():
    """The kernel's scratch slot of query tile t of sequence b, q_start // block_q + b + t (kernels.py), is
    distinct for every tile of a ragged batch and below launcher.scratch_slots; the launcher sizes the
    scratch by it (an 8K prefill beside 31 decodes: 160 slots of 64 rows, not the grid's 4096)."""
    rng = random.Random(0)
    for _ in range(300):
        block_q = rng.choice([1, 2, 16, 64, 128])
        lens = [rng.choice([1, 1, 2, 9, rng.randint(1, 700)]) for _ in range(rng.randint(1, 40))]
        starts = [sum(lens[:b]) for b in range(len(lens))]
        slots = [
            s // block_q + b + t
            for b, (s, n) in enumerate(zip(starts, lens))
            for t in range(-(-n // block_q))
        ]
        assert len(set(slots)) == len(slots)
        assert max(slots) < launcher.scratch_slots(sum(lens), len(lens), block_q)
    assert launcher.scratch_slots(8192 + 31, 32, 64) == 160


def test_probe_without_the_relative_term():
    """AttentionConfig(relative=False), the benchmarks' floor probe: attention without r . P, i.e. the
    reference op with r = 0 (so the probe times the rest of the kernel's work, not some other math)."""
    batch = make_batch(PREFILL + CHUNKED, SLIDING)
    config = AttentionConfig(heads=1, block_q=16, block_n=16, num_splits=2, shear="scratch", relative=False)
    out = launcher.bank_attention(*batch.args, config=config)
    args = list(batch.args)
    args[1] = torch.zeros_like(args[1])
    assert_close(out, torch.ops.inkling.bank_attention(*args, "reference"), 1e-4)
    assert (out - batch.truth).abs().max() > 1e-2  # the relative term does matter in this batch


def test_triton_head_dim_128():
    batch = make_batch([(40, 3), (21, 1)], SLIDING, d=128)
    assert_close(torch.ops.inkling.bank_attention(*batch.args, "triton"), batch.truth, 1e-4)


def test_choose_config_is_shape_only(monkeypatch):
    decode = launcher.choose_config(1, 64, 8, 1, 1 << 20, num_sms=132)
    assert decode.heads == 8 and decode.num_splits > 1
    monkeypatch.setattr(launcher, "interpreting", lambda: False)  # the GPU's tiles
    # split-KV for a decode with few programs: 4 programs an SM, down to one tile of 128 keys a split (H200
    # timings: the e2e's batch-1 attention 23.3 -> 20.0 us a layer)
    assert launcher.choose_config(1, 64, 8, 1, 8192, num_sms=132).num_splits == 64
    assert launcher.choose_config(1, 64, 8, 1, 4096, num_sms=132).num_splits == 32
    assert launcher.choose_config(1, 64, 8, 1, 131072, num_sms=132).num_splits == 64
    assert (
        launcher.choose_config(1, 64, 8, 4, 8192, num_sms=132).num_splits == 33
    )  # a verify: 2 programs an SM
    assert launcher.choose_config(32, 64, 8, 1, 8192, num_sms=132).num_splits == 2  # the GPU is full
    monkeypatch.undo()
    prefill = launcher.choose_config(4, 64, 8, 4096, 4096, num_sms=132)
    assert prefill.heads == 1 and prefill.num_splits == 1 and prefill.shear == "chunk"
    assert prefill.chunk_tiles == 3 and prefill.table_dtype == "float32" and prefill.far_launch
    sliding = launcher.choose_config(4, 64, 16, 4096, 4096 + 511, num_sms=132, window=512)
    assert sliding.heads == 1 and sliding.shear == "scratch"  # every tile carries the term
    assert (
        not decode.far_launch
        and not launcher.choose_config(4, 64, 8, 4096, 4096, 132, float32=True).far_launch
    )
    assert launcher.choose_config(4, 64, 8, 4096, 4096, num_sms=132, float32=True).shear == "scratch"
    for q_len, block_q in ((2, 2), (4, 4), (8, 8), (9, 8), (16, 8)):  # a verify of group 8: a GEMV per
        verify = launcher.choose_config(2, 64, 8, q_len, 8192, num_sms=132)  # query row, tiles of 8 rows
        assert verify.heads == 8 and verify.block_q == block_q and verify.rel_gemv
    # float32 (tests) on the GPU: tiles of at most 32 x 32, which compile in seconds
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    for q_len in (1, 2, 4, 9, 4096):
        c = launcher.choose_config(2, 64, 8, q_len, 8192, num_sms=132, float32=True)
        assert c.heads * c.block_q <= 32 and c.block_n <= 32, c


def test_gluon_impl_takes_the_prefill_launches_it_fits(monkeypatch):
    """bank_attention's impl "gluon" (choose_config(gluon=True)): the GPU's one-head prefill tiles put the far
    launch and an unsplit rest on Gluon; decode, verify, float32 and a split rest keep the `tl` kernel; on
    the CPU the op runs the `tl` kernel and gives what "triton" gives; a build asks for a Hopper GPU."""
    monkeypatch.setattr(launcher, "interpreting", lambda: False)  # the GPU's tiles
    full = launcher.choose_config(1, 64, 8, 8192, 8192, num_sms=132, gluon=True)
    assert (full.far_impl, full.near_impl) == ("gluon", "gluon") and full.far_launch
    sliding = launcher.choose_config(1, 64, 16, 8192, 8192 + 511, num_sms=132, window=512, gluon=True)
    assert (sliding.far_impl, sliding.near_impl) == ("triton", "gluon")
    short = launcher.choose_config(1, 64, 8, 64, 131072, num_sms=132, gluon=True)  # 64 programs: split
    assert short.num_splits > 1 and short.near_impl == "triton"
    for other in (
        launcher.choose_config(1, 64, 8, 1, 8192, num_sms=132, gluon=True),  # decode
        launcher.choose_config(4, 64, 8, 4, 8192, num_sms=132, gluon=True),  # verify
        launcher.choose_config(1, 64, 8, 4096, 4096, num_sms=132, float32=True, gluon=True),
    ):
        assert (other.far_impl, other.near_impl) == ("triton", "triton"), other
    assert launcher.choose_config(1, 64, 8, 8192, 8192, num_sms=132).near_impl == "triton"  # opt-in
    monkeypatch.undo()
    assert launcher.gluon_misfit(torch.zeros(4, 2, 64, dtype=torch.bfloat16), 16) == "runs on sm_90"  # no GPU
    assert launcher.gluon_misfit(torch.zeros(4, 2, 64), 16) == "takes bf16 or fp16 (wgmma)"
    assert "d_rel" in launcher.gluon_misfit(torch.zeros(4, 2, 64, dtype=torch.bfloat16), 64)
    batch = make_batch(PREFILL[:2] + CHUNKED[:1], FULL)
    gluon = torch.ops.inkling.bank_attention(*batch.args, "gluon")
    assert torch.equal(gluon, torch.ops.inkling.bank_attention(*batch.args, "triton"))
    from builder import BuildConfig, PluginConfig
    from builder.build import resolve_impls
    from builder.config import BuildError

    with pytest.raises(BuildError, match="needs a CUDA engine"):
        resolve_impls(BuildConfig(plugin_config=PluginConfig(attention="gluon")))
    if not torch.cuda.is_available():
        with pytest.raises(BuildError, match="Hopper GPU"):
            resolve_impls(BuildConfig(device="cuda", plugin_config=PluginConfig(attention="gluon")))
    with pytest.raises(BuildError, match="unknown impl 'gluon'"):
        PluginConfig(moe="gluon")


def test_auto_attention_is_gluon_where_the_build_runs_on_hopper(monkeypatch):
    """ "auto" takes the Gluon launches where the build's GPU runs them (sm_90 with Gluon's Hopper ops), the
    `tl` kernel elsewhere; "triton" keeps the `tl` kernel on Hopper too. An engine built with them refuses to
    load on another device with a clear error, instead of failing at its first prefill."""
    from builder import BuildConfig, PluginConfig

    build_module = importlib.import_module("builder.build")  # the module (builder.build is build())
    from runtime.model_runner import check_device_impls

    cuda = BuildConfig(device="cuda")
    no_gpu = "needs a Hopper GPU (sm_90); this machine has no CUDA GPU"
    monkeypatch.setattr(build_module, "gluon_device_misfit", lambda: no_gpu)
    assert build_module.resolve_impls(cuda)["bank_attention"] == "triton"
    monkeypatch.setattr(build_module, "gluon_device_misfit", lambda: None)  # a Hopper GPU
    impls = build_module.resolve_impls(cuda)
    assert impls["bank_attention"] == "gluon" and impls["kv_cache_write"] == "triton"
    assert build_module.resolve_impls(BuildConfig(device="cuda", plugin_config=PluginConfig(attention="triton")))[
        "bank_attention"
    ] == "triton"  # fmt: skip
    assert build_module.resolve_impls(BuildConfig())["bank_attention"] == "reference"  # a CPU engine
    with pytest.raises(ValueError, match="rebuild the engine here"):
        check_device_impls(impls, torch.device("cpu"))
    check_device_impls({"bank_attention": "triton"}, torch.device("cpu"))  # the `tl` kernel runs anywhere


# --- kv_cache_write ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_kv_cache_write(impl):
    g = torch.Generator().manual_seed(1)
    T, hkv, d, nb, bs = 11, 2, 32, 5, 4
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[2, 7]] = -1
    key_cache = torch.randn(nb, bs, hkv, d, generator=g)
    value_cache = torch.randn(nb, bs, hkv, d, generator=g)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs] = k[t]
            want_v[s // bs, s % bs] = v[t]
    dev = [x.to(DEVICE) for x in (k, v, key_cache, value_cache, slots)]
    torch.ops.inkling.kv_cache_write(*dev, impl)
    assert torch.equal(dev[2].cpu(), want_k) and torch.equal(dev[3].cpu(), want_v)


# --- registration and export ---------------------------------------------------------------------


def test_ops_registered_with_fakes():
    from plugins import registry

    assert registry.get("bank_attention").version >= 2
    assert registry.get("kv_cache_write").version >= 1
    batch = make_batch(CHUNKED, SLIDING)
    args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in batch.args)
    torch.library.opcheck(
        torch.ops.inkling.bank_attention.default,
        (*args, "reference"),
        test_utils=("test_schema", "test_faketensor"),
    )
    with pytest.raises(ValueError):
        torch.ops.inkling.bank_attention(*args, "cuda-magic")


# --- GPU: bf16, the real extents, tile sweeps, CUDA graphs ---------------------------------------

# Query heads 8 (or 16) over 1 or 2 KV heads, D 128, d_rel 16; full layers with the real extent and a log
# floor the longer sequences pass, sliding ones with window = extent
GPU_FULL = Layer(hq=8, hkv=1, extent=1024, window=0, log_floor=1000)
GPU_FULL_G4 = Layer(hq=8, hkv=2, extent=1024, window=0, log_floor=1000)


def gpu_sliding(window: int, hq: int = 8, hkv: int = 2) -> Layer:
    return Layer(hq=hq, hkv=hkv, extent=window, window=window, log_floor=0)


GPU_CASES = [
    ("prefill-8/1", [(1700, 1700), (1, 1), (333, 333)], GPU_FULL, 16),
    ("prefill-sliding", [(1000, 1000), (129, 129)], gpu_sliding(256), 16),
    ("chunked", [(2900, 300), (513, 64), (70, 70)], GPU_FULL_G4, 64),
    ("chunked-sliding", [(900, 300), (513, 64), (70, 70)], gpu_sliding(128), 32),
    ("verify", [(2000, 9), (17, 9), (300, 5), (1, 1)], GPU_FULL, 16),
    ("verify-sliding", [(2000, 9), (17, 9), (300, 5)], gpu_sliding(256), 16),
    ("decode", [(5000, 1), (3, 1), (257, 1)], GPU_FULL, 16),
    ("decode-sliding", [(5000, 1), (3, 1), (257, 1)], gpu_sliding(512, hq=16), 128),
    ("decode-2/1", [(3000, 1), (64, 1)], Layer(hq=2, hkv=1, extent=1024, window=0, log_floor=1000), 16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,seqs,layer,block_size", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_bf16(name, seqs, layer, block_size):
    batch = make_batch(seqs, layer, d=128, block_size=block_size, dtype=torch.bfloat16)
    assert_close(torch.ops.inkling.bank_attention(*batch.args, "triton"), batch.truth, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", [0, 3, 4, 6], ids=[GPU_CASES[i][0] for i in (0, 3, 4, 6)])
def test_gpu_float32(case):
    """float32 with IEEE dots (slow to compile: a few cases only)."""
    _, seqs, layer, block_size = GPU_CASES[case]
    batch = make_batch(seqs, layer, d=128, block_size=block_size)
    assert_close(torch.ops.inkling.bank_attention(*batch.args, "triton"), batch.truth, 2e-4)


GPU_CONFIGS = [
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, num_warps=4, num_stages=2),
    AttentionConfig(heads=1, block_q=32, block_n=32, num_splits=3, num_warps=2, num_stages=3),
    AttentionConfig(heads=8, block_q=16, block_n=128, num_splits=5),
    AttentionConfig(
        heads=1, block_q=64, block_n=64, num_splits=1, num_warps=4, num_stages=2, shear="scratch"
    ),
    AttentionConfig(
        heads=1, block_q=128, block_n=64, num_splits=2, num_warps=8, num_stages=2, shear="scratch"
    ),
]

# The relative table per chunk of tiles (shear="chunk"), as the benchmarks time it for prefill.
CHUNK_CONFIGS = {
    "chunk3": AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", chunk_tiles=3),
    "chunk3-8warps": AttentionConfig(
        heads=1, block_q=64, block_n=64, num_splits=1, num_warps=8, shear="chunk", chunk_tiles=3
    ),
    "chunk7-8warps-split": AttentionConfig(
        heads=1, block_q=64, block_n=64, num_splits=2, num_warps=8, shear="chunk", chunk_tiles=7
    ),
    "chunk3-64x32": AttentionConfig(
        heads=1, block_q=64, block_n=32, num_splits=1, shear="chunk", chunk_tiles=3
    ),
    "chunk3-bf16-table": AttentionConfig(
        heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", chunk_tiles=3, table_dtype="bfloat16"
    ),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 256])
@pytest.mark.parametrize("name", list(CHUNK_CONFIGS))
def test_gpu_chunk_shear(name, window):
    """Prefill and chunked prefill in bf16 with the chunked relative table, distances past the extent."""
    layer = gpu_sliding(window) if window else GPU_FULL_G4
    batch = make_batch([(2000, 2000), (1300, 300), (65, 65)], layer, d=128, dtype=torch.bfloat16)
    config = CHUNK_CONFIGS[name]
    # A bf16 table rounds the term itself, so it gets more room (0.0503 at window 256 on an H100).
    tol = 6e-2 if config.table_dtype == "bfloat16" else 3e-2
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "config",
    GPU_CONFIGS,
    ids=["64x64", "32x32-split", "verify-bn128", "scratch-64x64", "scratch-128x64-split"],
)
def test_gpu_tile_variants(config):
    batch = make_batch([(1900, 9), (300, 5), (17, 1)], GPU_FULL, d=128, dtype=torch.bfloat16)
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, 3e-2)


def decode_layer(window: int) -> Layer:
    """The real group (8 query heads per KV head): full with the real extent, or sliding."""
    if window:
        return gpu_sliding(window, hq=16, hkv=2)
    return Layer(hq=16, hkv=2, extent=1024, window=0, log_floor=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 256])
@pytest.mark.parametrize("rel_dot", [True, False])
@pytest.mark.parametrize("block_n,splits", [(64, 7), (128, 3)])
def test_gpu_decode_variants(window, rel_dot, block_n, splits):
    """Decode at the real group with the relative term as a dot and as a GEMV, distances past the extent,
    full and sliding, several splits, bf16."""
    batch = make_batch(
        [(2500, 1), (600, 1), (130, 1), (1, 1)], decode_layer(window), d=128, dtype=torch.bfloat16
    )
    config = AttentionConfig(
        heads=8, block_q=2, block_n=block_n, num_splits=splits, num_stages=3, rel_dot=rel_dot
    )
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("q_len", [1, 4, 9])
@pytest.mark.parametrize("rel_slice", [4, 8])
def test_gpu_gemv_rel_slice(q_len, rel_slice):
    """The GEMV forms of the relative term (decode, verify) reducing a slice of d_rel's columns at a time:
    the real group and d_rel, past the extent, sliding, split, bf16."""
    seqs = [(1500, q_len), (600, q_len), (130, q_len), (q_len, q_len)]
    batch = make_batch(seqs, decode_layer(256), d=128, dtype=torch.bfloat16)
    block_q = max(min(triton.next_power_of_2(q_len), launcher.VERIFY_TILE_ROWS), 2)
    config = AttentionConfig(
        heads=8, block_q=block_q, block_n=128 if q_len == 1 else 64, num_splits=5, num_stages=3 if q_len == 1 else 2,
        rel_gemv=q_len > 1, rel_slice=rel_slice,
    )  # fmt: skip
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 256])
@pytest.mark.parametrize("q_len", [2, 4, 8, 9, 16])
@pytest.mark.parametrize("rel_gemv", [True, False])
def test_gpu_verify_variants(window, q_len, rel_gemv):
    """Verify at the real group with the relative term as one GEMV per query row and as the sheared band,
    distances past the extent, full and sliding, split, bf16; eight warps for 8-query GEMV tiles, and 9 or 16
    queries in two of them (the launcher's choices)."""
    seqs = [(1500, q_len), (600, q_len), (130, q_len), (q_len, q_len)]
    batch = make_batch(seqs, decode_layer(window), d=128, dtype=torch.bfloat16)
    block_q = min(triton.next_power_of_2(q_len), launcher.VERIFY_TILE_ROWS) if rel_gemv else 16
    warps = 8 if rel_gemv and block_q >= 8 else 4
    config = AttentionConfig(
        heads=8, block_q=max(block_q, 2), block_n=64, num_splits=5, num_warps=warps, rel_gemv=rel_gemv
    )
    assert_close(launcher.bank_attention(*batch.args, config=config), batch.truth, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_decode():
    """Captured once, replayed with other lengths and contents: no host sync, fixed grid."""
    batch = make_batch([(3000, 1), (40, 1), (700, 1)], GPU_FULL, d=128, dtype=torch.bfloat16)
    args = list(batch.args)
    torch.ops.inkling.bank_attention(*args, "triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.inkling.bank_attention(*args, "triton")
    other = make_batch([(2900, 1), (48, 1), (5, 1)], GPU_FULL, d=128, dtype=torch.bfloat16, seed=3)
    pad = args[5].shape[1] - other.args[5].shape[1]
    for dst, src in zip(args[:8], other.args[:8]):
        if src.dim() == 2 and src.dtype == torch.int32:
            src = torch.nn.functional.pad(src, (0, pad), value=-1)
        if src.shape[0] > dst.shape[0]:  # the caches: other has fewer blocks
            raise AssertionError("shape mismatch")
        dst[: src.shape[0]].copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, other.truth, 3e-2)

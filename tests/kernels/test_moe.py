"""expert_sink_moe: NVFP4 dequantization ⇄ ModelOpt, reference op ⇄ spec math (inkling.ops),
Triton ⇄ reference op (interpreter on the CPU at inkling-tiny shapes; bf16 and larger on the GPU).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import plugins  # noqa: F401  (registers the ops)
from inkling import ops
from plugins.moe import PACKED_NAMES, pack_weights
from plugins.moe import launcher as moe_launcher
from plugins.moe import reference as moe_reference
from plugins.moe.reference import dequantize_experts
from plugins.nvfp4 import dequantize_nvfp4, random_nvfp4

HAS_CUDA = torch.cuda.is_available()
HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None
DEVICE = "cuda" if HAS_CUDA else "cpu"
TINY = dict(H=256, I=64, E=16, S=2, top_k=6)  # inkling-tiny
PROJ_SHAPES = {"gate_proj": ("I", "H"), "up_proj": ("I", "H"), "down_proj": ("H", "I")}


def _experts(H, I, E, seed=0, device=DEVICE):
    g = torch.Generator(device=device).manual_seed(seed)
    dims = {"H": H, "I": I}
    experts = []
    for e in range(E):
        ex = {}
        for proj, (o, i) in PROJ_SHAPES.items():
            w, s, s2 = random_nvfp4(dims[o], dims[i], device=device, generator=g, weight_std=0.05)
            ex[f"{proj}.weight"], ex[f"{proj}.weight_scale"] = w, s
            ex[f"{proj}.weight_scale_2"] = s2 * (1 + 0.1 * e)  # distinct global scales per linear
        experts.append(ex)
    return experts


def _layer(H, I, E, S, top_k, seed=0, dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    packed = pack_weights(_experts(H, I, E, seed))
    router = (torch.randn(E + S, H, generator=g) * H**-0.5).to(DEVICE, dtype)
    shared_w13 = (torch.randn(S, 2 * I, H, generator=g) * 0.05).to(DEVICE, dtype)
    shared_w2 = (torch.randn(S, H, I, generator=g) * 0.05).to(DEVICE, dtype)
    return router, packed, shared_w13, shared_w2


def dequantize_expert(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, e):
    """Expert e's (gate, up, down) in float32 through the reference op's batched dequantization."""
    gate_up, down = dequantize_experts(
        w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, torch.tensor([e])
    )
    I = w13.shape[1] // 2
    return gate_up[0, :I], gate_up[0, I:], down[0]


def _args(x, router, packed, shared_w13, shared_w2, E, top_k, tile_configs=""):
    return (x, router, *[packed[n] for n in PACKED_NAMES], shared_w13, shared_w2, E, top_k, tile_configs)


def _spec_moe(x, router, packed, shared_w13, shared_w2, E, top_k):
    """§3.3 token by token, on the dequantized weights."""
    I = shared_w13.shape[1] // 2
    w_top, idx, p_shared = ops.route(x, router, E, top_k)
    deq = {e: dequantize_expert(*[packed[n] for n in PACKED_NAMES], e) for e in range(E)}
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t : t + 1]
        acc = torch.zeros_like(xt)
        for s in range(shared_w13.shape[0]):
            acc += p_shared[t, s] * ops.swiglu(xt, shared_w13[s, :I], shared_w13[s, I:], shared_w2[s])
        for n in range(top_k):
            acc += w_top[t, n] * ops.swiglu(xt, *deq[int(idx[t, n])])
        y[t] = acc[0]
    return y


@pytest.mark.skipif(not HAS_MODELOPT, reason="needs nvidia-modelopt")
@pytest.mark.parametrize("shape", [(32, 64), (48, 256)])
def test_dequant_matches_modelopt_bit_for_bit(shape):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]
    w[0, :16] = 0.0  # a zero block
    w[1, 5] = 1e4  # an outlier that saturates its block's neighbours
    qt, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
    codes = qt._quantized_data
    assert codes.dtype == torch.uint8 and codes.shape == (shape[0], shape[1] // 2)
    assert scale.dtype == torch.float8_e4m3fn
    theirs = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    ours = dequantize_nvfp4(codes, scale, scale_2)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_pack_weights_layout():
    H, I, E = 64, 32, 3
    experts = _experts(H, I, E, device="cpu")
    packed = pack_weights(experts)
    assert packed["w13"].shape == (E, 2 * I, H // 2) and packed["w13_scale"].shape == (E, 2 * I, H // 16)
    assert packed["w2"].shape == (E, H, I // 2) and packed["w2_scale_2"].shape == (E,)
    for e in range(E):
        gate, up, down = dequantize_expert(*[packed[n] for n in PACKED_NAMES], e)
        for proj, got in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            want = dequantize_nvfp4(
                *[experts[e][f"{proj}.{f}"] for f in ("weight", "weight_scale", "weight_scale_2")]
            )
            assert torch.equal(got, want)
    with pytest.raises(ValueError):
        bad = [dict(ex) for ex in experts]
        bad[1]["up_proj.weight"] = bad[1]["up_proj.weight"][:, :-1]
        pack_weights(bad)


@pytest.mark.parametrize("group", [16, 3])  # experts dequantized together: all of TINY's, or a few at a time
@pytest.mark.parametrize("T", [1, 7])
def test_reference_matches_spec(T, group, monkeypatch):
    monkeypatch.setattr(moe_reference, "DEQUANT_GROUP", group)
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"])
    x = torch.randn(T, c["H"], generator=torch.Generator().manual_seed(T)).to(DEVICE)
    y = torch.ops.inkling.expert_sink_moe(
        *_args(x, router, packed, sw13, sw2, c["E"], c["top_k"]), "reference"
    )
    want = _spec_moe(x, router, packed, sw13, sw2, c["E"], c["top_k"])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def _check_triton(x, router, packed, sw13, sw2, E, top_k, tile_configs="", tol=2e-5):
    args = _args(x, router, packed, sw13, sw2, E, top_k, tile_configs)
    y = torch.ops.inkling.expert_sink_moe(*args, "triton")
    want = torch.ops.inkling.expert_sink_moe(*args, "reference")
    assert y.shape == want.shape and torch.isfinite(y).all()
    err = (y.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("T", [1, 5, 33, 70])
def test_triton_matches_reference(T):
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=T)
    x = torch.randn(T, c["H"], generator=torch.Generator().manual_seed(T)).to(DEVICE)
    _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"])


def _capped_table() -> str:
    """A prefill config with both GEMMs register-capped (maxnreg: two 8-warp programs an SM; the 2026-12-01 prefill tuning's
    candidate, slower on the H200 in s18), as a one-bucket table."""
    g = {"block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128}
    cfg = {"block_m": 128, "shared": "torch", "gemm1": g, "gemm2": dict(g)}
    return json.dumps({"buckets": [dict(cfg, max_tokens=1 << 30)]})


def test_triton_register_capped_config():
    """A config with a register cap goes through the launcher (the interpreter ignores the cap itself)."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=40)
    x = torch.randn(40, c["H"], generator=torch.Generator().manual_seed(40)).to(DEVICE)
    _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"], tile_configs=_capped_table())


def test_triton_routed_blocks_first():
    """The routed GEMMs in the grid order they fall back to when their blocks exceed the grid's second
    dimension (blocks first; N tiles first is the default)."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=33)
    x = torch.randn(33, c["H"], generator=torch.Generator().manual_seed(33)).to(DEVICE)
    g = {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2, "n_first": False}
    table = {"buckets": [{"max_tokens": 1 << 30, "block_m": 16, "shared": "triton", "gemm1": g, "gemm2": g}]}
    _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"], tile_configs=json.dumps(table))


def test_triton_routing_ties_go_to_lower_index():
    """Duplicate router rows give equal probabilities: both impls must keep the lower expert."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=7)
    for lo, hi in ((2, 9), (4, 5), (0, 15)):
        router[hi] = router[lo]
    # Make the tied pairs win, so the tie decides a top-k slot.
    router[[0, 2, 4, 5, 9, 15]] *= 4.0
    x = torch.randn(5, c["H"], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _, idx, _ = ops.route(x, router, c["E"], c["top_k"])
    assert (idx[:, None, :] == idx[:, :, None]).sum() == idx.numel()  # distinct ids
    _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"])


def test_triton_every_token_on_the_same_experts():
    """A biased router sends all 33 tokens to experts 0..5 (several blocks each); the rest get none."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=3)
    x = torch.rand(33, c["H"], generator=torch.Generator().manual_seed(2)).to(DEVICE) + 0.5
    router.zero_()
    router[:6] = torch.linspace(0.02, 0.01, 6, device=DEVICE)[:, None]
    router[6:16] = -0.01
    _, idx, _ = ops.route(x, router, c["E"], c["top_k"])
    assert set(idx.flatten().tolist()) == set(range(6))
    table = {"version": 1, "buckets": [{"max_tokens": 1 << 30, "block_m": 16,
             "gemm1": {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2},
             "gemm2": {"block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 2}}]}  # fmt: skip
    for shared in ("triton", "torch"):  # shared experts through the grouped GEMM or cuBLAS
        table["buckets"][0]["shared"] = shared
        _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"], tile_configs=json.dumps(table))


GEMV = {"block_m": 4, "kernel": "gemv", "gemm1": {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2},
        "gemm2": {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}}  # fmt: skip


@pytest.mark.parametrize(
    "T, shared, block_m", [(1, "triton", 1), (9, "triton", 4), (1, "torch", 4), (3, "torch", 1)]
)
def test_triton_gemv_matches_reference(T, shared, block_m):
    """The decode GEMV of the routed experts (uint32 words of codes): blocks of 1 or 4 rows (an expert
    with more rows than that gets several blocks at T = 9), the shared experts on tensor cores or cuBLAS."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=10 + T)
    x = torch.randn(T, c["H"], generator=torch.Generator().manual_seed(T)).to(DEVICE)
    table = {"version": 1, "buckets": [{"max_tokens": 1 << 30, "shared": shared, **GEMV, "block_m": block_m}]}
    _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"], tile_configs=json.dumps(table))


@pytest.mark.parametrize(
    "T, block_m, block_k, scale, stack, k_major, one_dot, n_first",
    [
        (1, 1, 256, 2.0**17, False, False, False, False),
        (2, 1, 256, 1.0, True, True, False, True),
        (9, 2, 128, 1.0, True, False, False, False),
        (3, 4, 64, 2.0**17, False, False, False, False),
        (1, 1, 256, 2.0**17, True, False, True, False),
        (9, 2, 128, 1.0, False, False, True, True),
        (9, 4, 256, 2.0**17, True, True, True, False),  # as tune()'s bd candidates for 16 < T <= 128
    ],
)
def test_triton_bd_matches_reference(T, block_m, block_k, scale, stack, k_major, one_dot, n_first):
    """The block-diagonal decode kernel on tensor cores: one to four rows a block, the dot's columns padded
    when K or the step is short (GEMM 2 reduces over I = 64 here). It hands the tensor cores fp16
    activations, so x holds fp16 values and only h's rounding to fp16 (GEMM 2's input) and float32
    summation orders remain: a misplaced nibble, scale block or row is off by the whole output. The op
    itself runs a float32 network on the GEMV instead. At scale 2^17 every activation (and h) exceeds fp16's
    range, which the kernel's power-of-two row scaling must absorb. `stack`: GEMM 1's gate and up rows in
    one dot; `k_major`: the 1-row activation operand built K-contiguous; `one_dot`: a K step's four nibble
    pieces in one dot (its own K order); `n_first`: the grid's N tiles first."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=20 + T)
    x = torch.randn(T, c["H"], generator=torch.Generator().manual_seed(T)).half().float().to(DEVICE) * scale
    g = {"block_n": 16, "block_k": block_k, "num_warps": 4, "num_stages": 2, "k_major_a": k_major,
         "one_dot": one_dot, "n_first": n_first}  # fmt: skip
    cfg = {"block_m": block_m, "kernel": "bd", "gemm1": {**g, "stack_gu": stack}, "gemm2": dict(g)}
    args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"])
    y = moe_launcher.expert_sink_moe(*args[:-1], config=cfg)
    want = torch.ops.inkling.expert_sink_moe(*args, "reference")
    err = (y - want).norm() / want.norm()
    assert torch.isfinite(y).all() and err < 1.5e-3, f"relative error {err:.2e}"
    table = json.dumps({"version": 1, "buckets": [{"max_tokens": 1 << 30, **cfg}]})
    exact = torch.ops.inkling.expert_sink_moe(
        *_args(x, router, packed, sw13, sw2, c["E"], c["top_k"], table), "triton"
    )
    assert (exact - want).norm() / want.norm() < 2e-5  # float32 through the op: the GEMV


def test_triton_nan_rows_stay_in_bounds():
    """A NaN row (a CUDA-graph bucket's padding row may hold one) routes to valid experts, so no kernel reads
    or writes out of bounds, and the finite rows are unaffected."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=4)
    x = torch.randn(5, c["H"], generator=torch.Generator().manual_seed(4)).to(DEVICE)
    args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"])
    want = torch.ops.inkling.expert_sink_moe(*args, "reference")
    x[2] = float("nan")
    y = torch.ops.inkling.expert_sink_moe(*args, "triton")
    keep = [0, 1, 3, 4]
    err = (y[keep].float() - want[keep].float()).norm() / want[keep].float().norm()
    assert err < 2e-5, f"relative error {err:.2e}"


def test_select_config_buckets():
    assert moe_launcher.select_config(None, 1)["kernel"] == "bd"
    assert moe_launcher.select_config(None, 17)["block_m"] == 16
    assert moe_launcher.select_config(None, 10**6) == moe_launcher.DEFAULT_TABLE["buckets"][-1]
    table = json.loads(json.dumps(moe_launcher.DEFAULT_TABLE))
    assert moe_launcher.parse_table(json.dumps(table)) == table


def test_tune_leaves_buckets_above_max_tokens_at_their_defaults():
    """tune_max_tokens: a bucket sampled above it is neither built nor timed, and keeps the default tiles
    for its sample size (here every bucket, so no GPU is needed)."""
    sampled = []
    table = moe_launcher.tune(lambda T: sampled.append(T), max_tokens=0, log=lambda _: None)
    assert sampled == []
    samples = (1, 8, 32, 64, 512, 4096)
    for bucket, T in zip(table["buckets"], samples):
        want = {k: v for k, v in moe_launcher.select_config(None, T).items() if k != "max_tokens"}
        assert {k: v for k, v in bucket.items() if k != "max_tokens"} == want
    assert [b["max_tokens"] for b in table["buckets"]] == [1, 16, 32, 128, 1024, 1 << 30]


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "dims", [TINY, dict(H=7168, I=2560, E=256, S=2, top_k=6), dict(H=512, I=384, E=40, S=1, top_k=3)]
)
@pytest.mark.parametrize("T", [1, 3, 64, 1000])
def test_triton_gpu_bf16(dims, T):
    c = dims
    router, packed, sw13, sw2 = _layer(
        c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=T, dtype=torch.bfloat16
    )
    x = torch.randn(T, c["H"], device=DEVICE, dtype=torch.bfloat16)
    args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"])
    y = torch.ops.inkling.expert_sink_moe(*args, "triton")
    # The reference in bf16 too: both route on the same bf16 logits, so a near tie cannot flip.
    want = torch.ops.inkling.expert_sink_moe(*args, "reference").float()
    err = (y.float() - want).norm() / want.norm()
    assert torch.isfinite(y).all() and err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_triton_gpu_bf16_maxnreg():
    """tune()'s register-capped prefill tiles at inkling-bench's sizes (the cap compiles and stays correct)."""
    c = dict(H=7168, I=2560, E=256, S=2, top_k=6)
    router, packed, sw13, sw2 = _layer(
        c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=7, dtype=torch.bfloat16
    )
    x = torch.randn(1000, c["H"], device=DEVICE, dtype=torch.bfloat16)
    args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"], _capped_table())
    y = torch.ops.inkling.expert_sink_moe(*args, "triton")
    want = torch.ops.inkling.expert_sink_moe(*args, "reference").float()
    err = (y.float() - want).norm() / want.norm()
    assert torch.isfinite(y).all() and err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 33, 300])
def test_triton_gpu_float32_exact(T):
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=T)
    x = torch.randn(T, c["H"], device=DEVICE)
    _check_triton(x, router, packed, sw13, sw2, c["E"], c["top_k"], tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_triton_gpu_cuda_graph():
    """The op captures in a CUDA graph (no host sync) and replays on new inputs and routes."""
    c = TINY
    router, packed, sw13, sw2 = _layer(c["H"], c["I"], c["E"], c["S"], c["top_k"], dtype=torch.bfloat16)
    x = torch.randn(8, c["H"], device=DEVICE, dtype=torch.bfloat16)
    args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"])
    torch.ops.inkling.expert_sink_moe(*args, "triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.inkling.expert_sink_moe(*args, "triton")
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = torch.ops.inkling.expert_sink_moe(*args, "triton")
        torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_triton_gpu_decode_kernels_bf16(T):
    """The decode kernels (the GEMV and the block-diagonal tensor-core one) at inkling-bench shapes, in
    every tile shape tune() may pick (the decode bucket's; at T = 64 the bd candidates of batches and
    verifies), against the reference op and against the tensor-core kernel."""
    c = dict(H=7168, I=2560, E=256, S=2, top_k=6)
    router, packed, sw13, sw2 = _layer(
        c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=T, dtype=torch.bfloat16
    )
    x = torch.randn(T, c["H"], device=DEVICE, dtype=torch.bfloat16)
    args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"])
    want = torch.ops.inkling.expert_sink_moe(*args, "reference").float()
    mma = torch.ops.inkling.expert_sink_moe(*args, "triton").float()
    for cfg in [k for k in moe_launcher._candidates(min(T, 64)) if k.get("kernel") in ("gemv", "bd")]:
        table = json.dumps({"version": 1, "buckets": [{"max_tokens": 1 << 30, **cfg}]})
        y = torch.ops.inkling.expert_sink_moe(
            *_args(x, router, packed, sw13, sw2, c["E"], c["top_k"], table), "triton"
        )
        err = (y.float() - want).norm() / want.norm()
        assert torch.isfinite(y).all() and err < 2e-2, f"{cfg}: relative error {err:.2e}"
        assert (y.float() - mma).norm() / mma.norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 64])
def test_triton_gpu_overlap_equals_serial(T):
    """The shared experts on a side stream ("overlap") give the serial op's output bit for bit, eagerly and
    replayed from a CUDA graph on new inputs (a missing wait would read a buffer before it is written)."""
    c = dict(H=7168, I=2560, E=256, S=2, top_k=6)
    router, packed, sw13, sw2 = _layer(
        c["H"], c["I"], c["E"], c["S"], c["top_k"], seed=T, dtype=torch.bfloat16
    )
    x = torch.randn(T, c["H"], device=DEVICE, dtype=torch.bfloat16)
    for shared in ("triton", "torch"):
        # (the default decode bucket has "overlap" on: turned off here for the serial run)
        serial = {**moe_launcher.select_config(None, T), "shared": shared, "overlap": False}
        overlap = {**serial, "overlap": True}
        args = _args(x, router, packed, sw13, sw2, c["E"], c["top_k"])[:12]
        torch.testing.assert_close(
            moe_launcher.expert_sink_moe(*args, config=overlap),
            moe_launcher.expert_sink_moe(*args, config=serial),
            rtol=0,
            atol=0,
        )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe_launcher.expert_sink_moe(*args, config=overlap)
        for _ in range(3):
            x.copy_(torch.randn_like(x) * 4)
            graph.replay()
            torch.testing.assert_close(y, moe_launcher.expert_sink_moe(*args, config=serial), rtol=0, atol=0)

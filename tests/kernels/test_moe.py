"""The MoE launcher's kernel forms and tile tables, on the real op (`inkling::sigmoid_sink_moe`): every GEMM
kernel (tensor-core grouped GEMM, decode GEMV, block-diagonal decode) in the tile shapes tune() may pick,
against the model's math token by token (test_sigmoid_moe.spec_moe). On the CPU the kernels run in the
Triton interpreter in float32; bf16, register caps, CUDA graphs and the side stream are `gpu`-marked.
"""

from __future__ import annotations

import json

import pytest
import torch

import plugins  # noqa: F401  (registers the ops)
from inkling.published.ops import sigmoid_route
from plugins.moe import launcher, moe

from .test_sigmoid_moe import DEVICE, HAS_CUDA, assert_close, make_layer, moe_args, spec_moe

# 16 experts of which 6 are chosen: a token's rows spread over several blocks, and at T = 33 an expert
# holds several blocks of 16 rows
SMALL = dict(H=256, I=128, E=16, S=2, top_k=6)
REAL = dict(H=6144, I=3072, E=256, S=2, top_k=6)


def table_of(cfg: dict) -> str:
    return json.dumps({"version": 1, "buckets": [{"max_tokens": 1 << 30, **cfg}]})


def run_op(x, layer, top_k, tile_configs="", impl="triton"):
    return moe(*moe_args(x, layer, top_k), tile_configs=tile_configs, impl=impl)


def tokens(T, H, seed=0, dtype=torch.float32):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("T", [1, 5, 33, 70])
def test_default_tiles_match_the_math(T):
    layer = make_layer(**SMALL, seed=T)
    x = tokens(T, SMALL["H"], seed=T)
    assert_close(run_op(x, layer, 6), spec_moe(x, layer, 6))


def test_register_capped_config():
    """A config with a register cap goes through the launcher (the interpreter ignores the cap itself)."""
    g = {"block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128}
    table = table_of({"block_m": 128, "shared": "torch", "gemm1": g, "gemm2": dict(g)})
    layer = make_layer(**SMALL, seed=40)
    x = tokens(40, SMALL["H"], seed=40)
    assert_close(run_op(x, layer, 6, table), spec_moe(x, layer, 6))


def test_routing_ties_go_to_the_lower_index():
    """Duplicate gate rows with equal biases give equal choices: the kernel keeps the lower expert (torch.topk,
    the model's, leaves the order of ties open), so it equals the math where the higher one's bias is a
    little lower (the experts' weights differ, so a wrong pick changes the output)."""
    layer = make_layer(**SMALL, seed=7)
    gate, bias = layer[0].clone(), layer[1].clone()
    gate[9], bias[9] = gate[2], bias[2]
    bias[[1, 3, 6, 7, 8]] += 3.0  # five sure choices, then the tied pair for the sixth slot
    bias[[2, 9]] += 1.5
    layer[0], layer[1] = gate, bias
    x = tokens(5, SMALL["H"], seed=1)
    untied = list(layer)
    untied[1] = bias.clone()
    untied[1][9] -= 1e-3
    _, idx, _ = sigmoid_route(x, *untied[:3], 2.5, 6)
    assert (idx.sort(-1).values.cpu() == torch.tensor([1, 2, 3, 6, 7, 8])).all()
    mma = {"block_m": 16, "gemm1": {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}}
    mma["gemm2"] = dict(mma["gemm1"])
    for cfg in (None, mma):
        got = run_op(x, layer, 6, table_of(cfg) if cfg else "")
        assert_close(got, spec_moe(x, untied, 6))


def test_every_token_on_the_same_experts():
    """A selection bias sends all 33 tokens to experts 0..5 (several blocks each); the rest get none."""
    layer = make_layer(**SMALL, seed=3)
    layer[1] = torch.full_like(layer[1], -5.0)
    layer[1][:6] = 5.0
    x = tokens(33, SMALL["H"], seed=2)
    _, idx, _ = sigmoid_route(x, *layer[:3], 2.5, 6)
    assert set(idx.flatten().tolist()) == set(range(6))
    cfg = {"block_m": 16, "gemm1": {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2},
           "gemm2": {"block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 2}}  # fmt: skip
    for shared in ("triton", "torch"):  # shared experts through the grouped GEMM or cuBLAS
        assert_close(run_op(x, layer, 6, table_of({**cfg, "shared": shared})), spec_moe(x, layer, 6))


GEMV = {"kernel": "gemv", "gemm1": {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2},
        "gemm2": {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}}  # fmt: skip


@pytest.mark.parametrize(
    "T, shared, block_m", [(1, "triton", 1), (9, "triton", 4), (1, "torch", 4), (3, "torch", 1)]
)
def test_gemv(T, shared, block_m):
    """The decode GEMV of the routed experts (uint32 words of codes): blocks of 1 or 4 rows (an expert with
    more rows than that gets several blocks at T = 9), the shared experts on tensor cores or cuBLAS."""
    layer = make_layer(**SMALL, seed=10 + T)
    x = tokens(T, SMALL["H"], seed=T)
    cfg = {**GEMV, "shared": shared, "block_m": block_m}
    assert_close(run_op(x, layer, 6, table_of(cfg)), spec_moe(x, layer, 6))


@pytest.mark.parametrize(
    "T, block_m, block_k, scale, stack, k_major, one_dot, n_first, split, prefetch",
    [
        (1, 1, 256, 2.0**17, False, False, False, False, 1, False),
        (2, 1, 256, 1.0, True, True, False, True, 1, False),
        (9, 2, 128, 1.0, True, False, False, False, 1, False),
        (3, 4, 64, 2.0**17, False, False, False, False, 1, False),
        (1, 1, 256, 2.0**17, True, False, True, False, 1, False),
        (9, 2, 128, 1.0, False, False, True, True, 1, False),
        (
            9,
            4,
            256,
            2.0**17,
            True,
            True,
            True,
            False,
            1,
            False,
        ),  # as tune()'s bd candidates for 16 < T <= 128
        # split K: GEMM 1's 4 steps in 2 splits, the activations prefetched a step ahead within each; then
        # 2-row blocks with GEMM 2's single step unsplit (2 does not divide it)
        (1, 1, 64, 2.0**17, True, True, True, False, 2, True),
        (3, 2, 128, 1.0, False, False, False, True, 2, False),
    ],
)
def test_block_diagonal_decode(T, block_m, block_k, scale, stack, k_major, one_dot, n_first, split, prefetch):
    """The block-diagonal decode kernel on tensor cores: one to four rows a block, the dot's columns padded
    when the step is short. It hands the tensor cores fp16 activations, so x holds fp16 values and only h's
    rounding to fp16 (GEMM 2's input) and float32 summation orders remain: a misplaced nibble, scale block or
    row is off by the whole output. The op itself runs a float32 network on the GEMV instead. At scale 2^17
    every activation (and h) exceeds fp16's range, which the kernel's power-of-two row scaling must absorb.
    `stack`: GEMM 1's gate and up rows in one dot; `k_major`: the 1-row activation operand built
    K-contiguous; `one_dot`: a K step's four nibble pieces in one dot; `n_first`: the grid's N tiles first;
    `split`: the reduction split over programs whose partial sums the epilogue kernel adds (a split that
    does not divide the K steps falls back to one that does); `prefetch`: one_dot's activations loaded a
    step ahead."""
    layer = make_layer(**SMALL, seed=20 + T)
    x = tokens(T, SMALL["H"], seed=T).half().float() * scale
    g = {"block_n": 16, "block_k": block_k, "num_warps": 4, "num_stages": 2, "k_major_a": k_major,
         "one_dot": one_dot, "n_first": n_first, "split_k": split, "prefetch_a": prefetch}  # fmt: skip
    cfg = {"block_m": block_m, "kernel": "bd", "gemm1": {**g, "stack_gu": stack}, "gemm2": dict(g)}
    want = spec_moe(x, layer, 6)
    assert_close(launcher.sigmoid_sink_moe(*moe_args(x, layer, 6), config=cfg), want, 1.5e-3)
    assert_close(run_op(x, layer, 6, table_of(cfg)), want)  # float32 through the op: the GEMV


@pytest.mark.parametrize(
    "T, block_m, block_k, scale, stack, split, perm",
    [
        (33, 16, 128, 2.0**17, True, 1, False),
        (5, 16, 256, 1.0, False, 2, True),
        (70, 32, 64, 1.0, True, 1, False),
    ],
    ids=["33-rows-stacked-2e17", "5-rows-split-perm", "70-rows-32"],
)
def test_scaled_weight_decode(T, block_m, block_k, scale, stack, split, perm):
    """The decode kernel's `scale_w` form: blocks of 16 or 32 rows of one expert as the dot's columns, the
    codes multiplied by their block scales in fp16 before the dot. At T = 33 and 70 experts hold several
    blocks and partly filled ones, at T = 5 one or two rows each; 2^17 exceeds fp16's range, which the rows'
    power-of-two scaling must absorb; a wrong scale block for a word is off by most of the output. `perm`:
    both GEMMs' activations stored in ONE_DOT's K order (x permuted, h so written by GEMM 1 and its split
    reduction's epilogue)."""
    layer = make_layer(**SMALL, seed=20 + T)
    x = tokens(T, SMALL["H"], seed=T).half().float() * scale
    g = {"block_n": 16, "block_k": block_k, "num_warps": 4, "num_stages": 2, "one_dot": True, "scale_w": True,
         "split_k": split, "perm_a": perm}  # fmt: skip
    cfg = {"block_m": block_m, "kernel": "bd", "gemm1": {**g, "stack_gu": stack}, "gemm2": dict(g)}
    assert_close(launcher.sigmoid_sink_moe(*moe_args(x, layer, 6), config=cfg), spec_moe(x, layer, 6), 1.5e-3)


@pytest.mark.parametrize(
    "one_dot, k_major, split, prefetch",
    [(True, False, 2, True), (False, True, 1, False)],
    ids=["one-dot", "pieces"],
)
def test_one_dot_order_decode(one_dot, k_major, split, prefetch):
    """perm_a on 1-row blocks: one_dot's activations (prefetched, split K) and the four-piece dots' read from
    activations stored in ONE_DOT's K order, GEMM 1's x and GEMM 2's h (a misplaced activation column
    meets another code: off by the whole output)."""
    layer = make_layer(**SMALL, seed=23)
    x = tokens(2, SMALL["H"], seed=3).half().float() * 2.0**17
    g = {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2, "one_dot": one_dot, "k_major_a": k_major,
         "split_k": split, "prefetch_a": prefetch, "perm_a": True}  # fmt: skip
    cfg = {"block_m": 1, "kernel": "bd", "gemm1": {**g, "stack_gu": True}, "gemm2": dict(g)}
    assert_close(launcher.sigmoid_sink_moe(*moe_args(x, layer, 6), config=cfg), spec_moe(x, layer, 6), 1.5e-3)


def test_one_dot_order_kernel():
    """one_dot_order_kernel puts column 8j + P + 4t of each K step at (P * W + j) * 2 + t."""
    from plugins.moe import decode_kernels

    BK, T, K = 64, 3, 192
    x = torch.arange(T * K, dtype=torch.float32, device=DEVICE).view(T, K)
    y = torch.empty_like(x)
    decode_kernels.one_dot_order_kernel[(T, K // BK)](x, x.stride(0), y, y.stride(0), BK=BK)
    W = BK // 8
    pos = [(c % 4 * W + c // 8) * 2 + c // 4 % 2 for c in range(BK)]
    assert sorted(pos) == list(range(BK))
    want = torch.empty_like(x)
    for s in range(K // BK):
        want[:, s * BK + torch.tensor(pos)] = x[:, s * BK : (s + 1) * BK]
    assert torch.equal(y, want)


def test_fit_split():
    assert [launcher._fit_split(s, 24) for s in (1, 2, 3, 4, 5, 7, 48)] == [1, 2, 3, 4, 4, 6, 24]
    assert launcher._fit_split(3, 2) == 2 and launcher._fit_split(0, 12) == 1


def test_select_config_buckets():
    assert launcher.select_config(None, 1)["kernel"] == "bd"
    assert launcher.select_config(None, 17)["block_m"] == 16
    assert launcher.select_config(None, 10**6) == launcher.DEFAULT_TABLE["buckets"][-1]
    table = json.loads(json.dumps(launcher.DEFAULT_TABLE))
    assert launcher.parse_table(json.dumps(table)) == table


def test_tune_leaves_buckets_above_max_tokens_at_their_defaults():
    """tune_max_tokens: a bucket sampled above it is neither built nor timed, and keeps the default tiles
    for its sample size (here every bucket, so no GPU is needed)."""
    sampled = []
    table = launcher.tune(lambda T: sampled.append(T), max_tokens=0, log=lambda _: None)
    assert sampled == []
    samples = (1, 8, 32, 64, 512, 4096)
    for bucket, T in zip(table["buckets"], samples):
        want = {k: v for k, v in launcher.select_config(None, T).items() if k != "max_tokens"}
        assert {k: v for k, v in bucket.items() if k != "max_tokens"} == want
    assert [b["max_tokens"] for b in table["buckets"]] == [1, 16, 32, 128, 1024, 1 << 30]


# ---------------------------------------------------------------------------------------- GPU


def bf16_layer(shape, seed=0):
    return make_layer(**shape, dtype=torch.bfloat16, seed=seed)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", [SMALL, dict(H=512, I=384, E=40, S=1, top_k=3)], ids=["small", "odd"])
@pytest.mark.parametrize("T", [1, 3, 64, 1000])
def test_gpu_bf16_default_tiles(shape, T):
    layer = bf16_layer(shape, seed=T)
    x = torch.randn(T, shape["H"], device=DEVICE, dtype=torch.bfloat16)
    k = shape["top_k"]
    assert_close(run_op(x, layer, k), run_op(x, layer, k, impl="reference"), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_register_capped_real_shapes():
    """tune()'s register-capped prefill tiles at the real sizes (the cap compiles and stays correct)."""
    g = {"block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128}
    table = table_of({"block_m": 128, "shared": "torch", "gemm1": g, "gemm2": dict(g)})
    layer = bf16_layer(REAL, seed=7)
    x = torch.randn(1000, REAL["H"], device=DEVICE, dtype=torch.bfloat16)
    assert_close(run_op(x, layer, 6, table), run_op(x, layer, 6, impl="reference"), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 33, 300])
def test_gpu_float32(T):
    layer = make_layer(**SMALL, seed=T)
    x = torch.randn(T, SMALL["H"], device=DEVICE)
    assert_close(run_op(x, layer, 6), spec_moe(x, layer, 6), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph():
    """The op captures in a CUDA graph (no host sync) and replays on new inputs and routes."""
    layer = bf16_layer(SMALL)
    x = torch.randn(8, SMALL["H"], device=DEVICE, dtype=torch.bfloat16)
    run_op(x, layer, 6)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run_op(x, layer, 6)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, run_op(x, layer, 6), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_gpu_decode_kernels_real_shapes(T):
    """The decode kernels (the GEMV and the block-diagonal tensor-core one) at the real shapes, in every tile
    shape tune() may pick (the decode bucket's; at T = 64 the bd candidates of batches and verifies), against
    the reference op and against the tensor-core kernel."""
    layer = bf16_layer(REAL, seed=T)
    x = torch.randn(T, REAL["H"], device=DEVICE, dtype=torch.bfloat16)
    want = run_op(x, layer, 6, impl="reference")
    mma = launcher.sigmoid_sink_moe(*moe_args(x, layer, 6), config=launcher.select_config(None, 64))
    for cfg in [c for c in launcher._candidates(min(T, 64)) if c.get("kernel") in ("gemv", "bd")]:
        y = run_op(x, layer, 6, table_of(cfg))
        assert_close(y, want, 2e-2)
        assert_close(y, mma, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_overlap_equals_serial(T):
    """The shared experts on a side stream ("overlap") give the serial op's output bit for bit, eagerly and
    replayed from a CUDA graph on new inputs (a missing wait would read a buffer before it is written)."""
    layer = bf16_layer(REAL, seed=T)
    x = torch.randn(T, REAL["H"], device=DEVICE, dtype=torch.bfloat16)
    args = moe_args(x, layer, 6)
    for shared in ("triton", "torch"):
        # (the default decode bucket has "overlap" on: turned off here for the serial run)
        serial = {**launcher.select_config(None, T), "shared": shared, "overlap": False}
        overlap = {**serial, "overlap": True}
        same = dict(rtol=0, atol=0)
        torch.testing.assert_close(
            launcher.sigmoid_sink_moe(*args, config=overlap),
            launcher.sigmoid_sink_moe(*args, config=serial),
            **same,
        )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = launcher.sigmoid_sink_moe(*args, config=overlap)
        for _ in range(3):
            x.copy_(torch.randn_like(x) * 4)
            graph.replay()
            torch.testing.assert_close(y, launcher.sigmoid_sink_moe(*args, config=serial), **same)

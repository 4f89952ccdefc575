"""The real Inkling's MoE, `inkling::sigmoid_sink_moe`: Triton ⇄ the reference op, which follows
transformers' computation (tests/unit/test_published.py checks it against transformers' own MoE).

The sigmoid router (selection bias, joint normalisation with the shared experts, route_scale, the learned
scale) in the route kernel, then the grouped GEMMs: NVFP4 routed experts in the published layout (one
global scale per expert for gate and up) and BF16 routed experts (the published file's first MoE layer),
every decode and prefill kernel form. On the CPU the kernels run in the Triton interpreter in float32.
"""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers the ops)
from inkling.published.ops import sigmoid_route
from plugins.moe import launcher, moe
from plugins.nvfp4 import dequantize_nvfp4, random_nvfp4

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
TINY = dict(H=64, I=32, E=8, S=2, top_k=3)


def make_layer(H, I, E, S, top_k, nvfp4=True, dtype=torch.float32, seed=0):
    """The op's weight arguments after engine_tensors: w13 de-interleaved [gate; up] per expert. Drawn on the
    device in their dtype (the real shapes' BF16 experts are 29 GB; drawn in float32 first they did not fit
    an H100's 80 GB)."""
    g = torch.Generator(DEVICE).manual_seed(seed)

    def randn(*shape, std):
        return torch.randn(shape, generator=g, device=DEVICE, dtype=dtype).mul_(std)

    gate = torch.randn(E + S, H, generator=g, device=DEVICE) * H**-0.5
    # a selection bias large enough to change the choice against the sigmoid alone
    bias = torch.randn(E, generator=g, device=DEVICE) * 0.3
    scale = torch.tensor([1.3], device=DEVICE)
    if nvfp4:
        w13, s13, g13 = random_nvfp4(2 * I, H, batch=(E,), generator=g, device=DEVICE, weight_std=0.1)
        w2, s2, g2 = random_nvfp4(H, I, batch=(E,), generator=g, device=DEVICE, weight_std=0.1)
        g13 = g13 * torch.linspace(0.8, 1.2, E, device=DEVICE)  # distinct global scales per expert
        routed = [w13, s13, g13, w2, s2, g2]
    else:
        empty = torch.empty(0, device=DEVICE)
        routed = [randn(E, 2 * I, H, std=0.1), empty, empty, randn(E, H, I, std=0.1), empty, empty]
    return [gate, bias, scale, *routed, randn(S, 2 * I, H, std=0.1), randn(S, H, I, std=0.1)]


def moe_args(x, layer, top_k, route_scale=2.5):
    return (x, *layer, route_scale, top_k)


def spec_moe(x, layer, top_k, route_scale=2.5):
    """INKLING_SPEC §3.6 token by token, on the dequantized weights."""
    gate, bias, scale, w13, s13, g13, w2, s2, g2, sw13, sw2 = layer
    if s13.numel():
        w13 = dequantize_nvfp4(w13, s13, g13[:, None, None])
        w2 = dequantize_nvfp4(w2, s2, g2[:, None, None])
    I = w13.shape[1] // 2
    w_top, idx, w_shared = sigmoid_route(x, gate, bias, scale, route_scale, top_k)

    def swiglu(xt, w, down):
        return (torch.nn.functional.silu(xt @ w[:I].T) * (xt @ w[I:].T)) @ down.T

    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t : t + 1]
        for n in range(top_k):
            e = int(idx[t, n])
            y[t] += w_top[t, n] * swiglu(xt, w13[e], w2[e])[0]
        for s in range(sw13.shape[0]):
            y[t] += w_shared[t, s] * swiglu(xt, sw13[s], sw2[s])[0]
    return y


def assert_close(out, ref, tol=2e-4):
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item() / ref.abs().max().item()
    assert err <= tol, f"max error {err:.3g} of the output's range > {tol}"


@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "bf16-experts"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_reference_op_matches_the_spec(T, nvfp4):
    layer = make_layer(**TINY, nvfp4=nvfp4)
    x = torch.randn(T, TINY["H"], device=DEVICE)
    out = moe(*moe_args(x, layer, TINY["top_k"]), impl="reference")
    assert_close(out, spec_moe(x, layer, TINY["top_k"]), 1e-5)


def _tiles(block_m, kernel="mma", n=32, k=32, **extra):
    g = {"block_n": n, "block_k": k, "num_warps": 4, "num_stages": 2}
    return {"block_m": block_m, "kernel": kernel, "gemm1": g, "gemm2": dict(g), **extra}


# The routed GEMMs' forms: one-row blocks (the route kernel writes them itself) on the block-diagonal
# tensor-core kernel and the CUDA-core GEMV, aligned blocks of 16 on the tensor-core GEMM (grid N-first),
# and the shared experts through cuBLAS.
FORMS = {
    "bd": _tiles(1, "bd", n=32, k=64),
    "gemv": _tiles(1, "gemv"),
    "mma-16": _tiles(16),
    "mma-16-blocks-first": _tiles(16, n_first=False),
    "mma-16-shared-torch": _tiles(16, shared="torch"),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 6])
def test_triton_nvfp4_forms(T, form):
    # bd's dots need a reduction of 128 at least (narrower layers take the GEMV), and it hands the tensor
    # cores fp16 activations (the op gives float32 engines the GEMV instead)
    shape = {**TINY, "H": 128, "I": 128} if form == "bd" else TINY
    layer = make_layer(**shape)
    x = torch.randn(T, shape["H"], device=DEVICE)
    got = launcher.sigmoid_sink_moe(*moe_args(x, layer, shape["top_k"]), config=FORMS[form])
    assert_close(got, spec_moe(x, layer, shape["top_k"]), 2e-3 if form == "bd" else 2e-4)


def test_toy_widths_take_the_gemv_where_bd_cannot_run():
    layer = make_layer(**TINY)
    x = torch.randn(2, TINY["H"], device=DEVICE)
    got = launcher.sigmoid_sink_moe(*moe_args(x, layer, TINY["top_k"]), config=FORMS["bd"])
    assert_close(got, spec_moe(x, layer, TINY["top_k"]))


@pytest.mark.parametrize("T", [1, 6, 40])
def test_triton_bf16_routed_experts(T):
    """BF16 routed experts take the tensor-core GEMM at every size, also where the tile table names a
    decode kernel for NVFP4 (T = 1)."""
    layer = make_layer(**TINY, nvfp4=False)
    x = torch.randn(T, TINY["H"], device=DEVICE)
    got = moe(*moe_args(x, layer, TINY["top_k"]))
    assert_close(got, spec_moe(x, layer, TINY["top_k"]))


def test_triton_op_with_its_default_tiles():
    layer = make_layer(**TINY)
    for T in (1, 20):
        x = torch.randn(T, TINY["H"], device=DEVICE)
        got = moe(*moe_args(x, layer, TINY["top_k"]))
        assert_close(got, spec_moe(x, layer, TINY["top_k"]))


def test_the_selection_bias_chooses_and_the_sinks_share_the_weight():
    """What the route kernel must get right, shown to matter: without the bias other experts are chosen, and
    the weights of a token's chosen and shared experts sum to route_scale times the learned scale."""
    layer = make_layer(**TINY)
    x = torch.randn(12, TINY["H"], device=DEVICE)
    want = launcher.sigmoid_sink_moe(*moe_args(x, layer, TINY["top_k"]), config=FORMS["mma-16"])
    unbiased = list(layer)
    unbiased[1] = torch.zeros_like(layer[1])
    other = launcher.sigmoid_sink_moe(*moe_args(x, unbiased, TINY["top_k"]), config=FORMS["mma-16"])
    assert (want - other).abs().max() > 1e-3 * want.abs().max()
    w_top, _, w_shared = sigmoid_route(x, *layer[:3], 2.5, TINY["top_k"])
    total = torch.cat([w_top, w_shared], -1).sum(-1)
    assert torch.allclose(total, torch.full_like(total, 2.5 * 1.3), rtol=1e-5)


def test_nan_padding_rows_do_not_harm_real_rows():
    """A CUDA-graph bucket's padding rows may hold garbage: a NaN row still picks distinct experts and the
    other rows' outputs stay exact."""
    layer = make_layer(**TINY)
    x = torch.randn(4, TINY["H"], device=DEVICE)
    x[2] = float("nan")
    got = launcher.sigmoid_sink_moe(*moe_args(x, layer, TINY["top_k"]), config=FORMS["mma-16"])
    keep = [0, 1, 3]
    assert_close(got[keep], spec_moe(x[keep], layer, TINY["top_k"]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "bf16-experts"])
@pytest.mark.parametrize("T", [1, 8, 32, 300, 2048])
def test_gpu_real_shapes_bf16(T, nvfp4):
    """The real layer (H 6144, I 3072, 256 experts, top 6 + 2 sinks) in bf16 with the default tiles, against
    the reference op on the same weights."""
    shape = dict(H=6144, I=3072, E=256, S=2, top_k=6)
    layer = make_layer(**shape, nvfp4=nvfp4, dtype=torch.bfloat16)
    x = torch.randn(T, shape["H"], device=DEVICE, dtype=torch.bfloat16)
    args = moe_args(x, layer, 6, 8.0)
    got = moe(*args)
    want = moe(*args, impl="reference")
    assert_close(got, want, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_bf16_gate_equals_its_float32_copy():
    """A bf16 engine keeps a BF16 gate and sums its products in float32 (torch.mm with out_dtype): the same
    function as the float32 router on the same values (the sums in another order)."""
    shape = dict(H=6144, I=3072, E=256, S=2, top_k=6)
    layer = make_layer(**shape, dtype=torch.bfloat16)
    layer[0] = layer[0].bfloat16()
    x = torch.randn(8, shape["H"], device=DEVICE, dtype=torch.bfloat16)  # few tokens: a near tie is unlikely
    bf16_gate = moe(*moe_args(x, layer, 6, 8.0))
    f32 = list(layer)
    f32[0] = layer[0].float()
    f32_gate = moe(*moe_args(x, f32, 6, 8.0))
    assert_close(bf16_gate, f32_gate, 1e-2)


def ep_share(layer, rank: int, ep_size: int):
    """Rank `rank`'s arguments under expert parallelism (builder/expert_parallel.py): its E/ep routed experts
    whole, a 1/ep slice of the shared experts' width, the router whole."""
    gate, bias, scale, w13, s13, g13, w2, s2, g2, sw13, sw2 = layer
    E, I2 = w13.shape[0], sw13.shape[1]
    n, i = E // ep_size, I2 // 2 // ep_size
    ex = slice(rank * n, (rank + 1) * n)
    cols = slice(rank * i, (rank + 1) * i)
    share = [w[ex] if w.numel() else w for w in (w13, s13, g13, w2, s2, g2)]
    shared_w13 = torch.cat([sw13[:, : I2 // 2][:, cols], sw13[:, I2 // 2 :][:, cols]], dim=1)
    return [gate, bias, scale, *share, shared_w13.contiguous(), sw2[:, :, cols].contiguous()], rank * n


EP_FORMS = {k: FORMS[k] for k in ("gemv", "mma-16", "mma-16-shared-torch")}


@pytest.mark.parametrize("form", EP_FORMS)
@pytest.mark.parametrize("ep_size", [2, 4])
def test_triton_on_an_expert_parallel_share(form, ep_size):
    """Each rank's Triton MoE on its share (its experts whole, a slice of the shared experts' width) equals
    the reference op's part on the same share, and the ranks' parts sum to the whole op: tokens routed to
    another rank's experts take no block and add nothing, in one-row and aligned blocks alike."""
    from plugins.moe.reference import sigmoid_sink_moe as reference

    layer = make_layer(**TINY)
    x = torch.randn(6, TINY["H"], device=DEVICE)
    k = TINY["top_k"]
    whole = spec_moe(x, layer, k)
    parts = []
    for rank in range(ep_size):
        share, offset = ep_share(layer, rank, ep_size)
        got = launcher.sigmoid_sink_moe(*moe_args(x, share, k), config=EP_FORMS[form], expert_offset=offset)
        assert_close(got, reference(*moe_args(x, share, k), expert_offset=offset), 2e-4)
        parts.append(got)
    assert_close(sum(parts), whole, 2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "bf16-experts"])
@pytest.mark.parametrize("T", [1, 32, 300])
def test_gpu_expert_parallel_shares_real_shapes(T, nvfp4):
    """ep 8 shares of the real layer in bf16 with the default tiles (the decode kernels at T = 1 and 32, the
    aligned tensor-core GEMM at 300): each rank's part against the reference op's on its share."""
    from plugins.moe.reference import sigmoid_sink_moe as reference

    shape = dict(H=6144, I=3072, E=256, S=2, top_k=6)
    layer = make_layer(**shape, nvfp4=nvfp4, dtype=torch.bfloat16)
    x = torch.randn(T, shape["H"], device=DEVICE, dtype=torch.bfloat16)
    for rank in (0, 5):
        share, offset = ep_share(layer, rank, 8)
        args = moe_args(x, share, 6, 8.0)
        got = launcher.sigmoid_sink_moe(*args, config=launcher.select_config(None, T), expert_offset=offset)
        assert_close(got, reference(*args, expert_offset=offset), 2e-2)


@pytest.mark.parametrize("form", ["gemv", "mma-16"])
@pytest.mark.parametrize("ep", [1, 2])
def test_the_route_counts_the_expert_load(form, ep):
    """expert_load: the Triton route adds each valid row's top_k choices, by global expert id on every rank
    (a rank's share routes all E), as the reference op does; invalid rows (a graph bucket's padding) add
    nothing, and the output is the same with or without counting."""
    from plugins.moe.reference import sigmoid_sink_moe as reference

    layer = make_layer(**TINY)
    x = torch.randn(7, TINY["H"], device=DEVICE)
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool, device=DEVICE)
    k, E = TINY["top_k"], TINY["E"]
    share, offset = ep_share(layer, 1, ep) if ep > 1 else (layer, 0)
    _, idx, _ = sigmoid_route(x, *layer[:3], 2.5, k)
    want = torch.zeros(E, dtype=torch.int32, device=DEVICE).index_add_(
        0, idx[valid].flatten(), torch.ones(int(valid.sum()) * k, dtype=torch.int32, device=DEVICE)
    )
    args = moe_args(x, share, k)
    got, ref = torch.zeros_like(want), torch.zeros_like(want)
    y = launcher.sigmoid_sink_moe(*args, config=FORMS[form], expert_offset=offset, load=got, row_valid=valid)
    y_ref = reference(*args, expert_offset=offset, expert_load=ref, row_valid=valid)
    assert torch.equal(got, want) and torch.equal(ref, want)
    assert torch.equal(y, launcher.sigmoid_sink_moe(*args, config=FORMS[form], expert_offset=offset))
    assert_close(y_ref, reference(*args, expert_offset=offset), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 300])
def test_gpu_route_counts_real_shapes(T):
    """The expert load at the real layer's shapes, on the decode kernel's one-row blocks (T = 1), the bd
    batch bucket and the aligned blocks, replayed from a CUDA graph: each valid row's choices, as the model's
    router makes them (float32 activations: the router's logits are the same computation)."""
    shape = dict(H=6144, I=3072, E=256, S=2, top_k=6)
    layer = make_layer(**shape)
    x = torch.randn(T, shape["H"], device=DEVICE)
    valid = torch.rand(T, device=DEVICE) > 0.25
    valid[0] = True
    _, idx, _ = sigmoid_route(x, *layer[:3], 8.0, 6)
    want = torch.bincount(idx[valid].flatten(), minlength=256).to(torch.int32)
    load = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    args = moe_args(x, layer, 6, 8.0)
    cfg = launcher.select_config(None, T)
    if cfg.get("kernel") == "bd":  # float32 activations take the GEMV, as the op gives them
        cfg = {**cfg, "kernel": "gemv"}
    launcher.sigmoid_sink_moe(*args, config=cfg, load=load, row_valid=valid)  # compile outside the capture
    assert torch.equal(load, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher.sigmoid_sink_moe(*args, config=cfg, load=load, row_valid=valid)
    load.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(load, 3 * want)

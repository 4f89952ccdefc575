"""mtp_draft: reference op ⇄ float64 math, Triton ⇄ reference op, ties, padded vocabulary, export.

On the CPU the Triton kernels run in the interpreter (conftest.py) at small shapes, in float32 and
bfloat16; the decode shapes of inkling-bench (H 7168, V 163840) are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers the ops)
from inkling.ops import rms_norm
from plugins.mtp import launcher
from plugins.mtp import reference as mtp_reference
from plugins.mtp.launcher import MtpConfig

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
EPS = 1e-6
PADDED_LOGIT_SCALE = 100.0  # padded vocabulary rows would win every argmax if they were read


def _problem(N, H, V, num_real_tokens, dtype=torch.float32, seed=0, device=DEVICE):
    """Random hidden, norm weight and lm_head, with huge rows past num_real_tokens."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g) * 2
    norm_weight = torch.rand(H, generator=g) + 0.5
    lm_head = torch.randn(V, H, generator=g) * H**-0.5
    lm_head[num_real_tokens:] *= PADDED_LOGIT_SCALE
    return hidden.to(device, dtype), norm_weight.to(device), lm_head.to(device, dtype)


def _logits64(hidden, norm_weight, lm_head, num_real_tokens):
    """The logits in float64 from the rounded normalised hidden: [N, num_real_tokens]."""
    normed = rms_norm(hidden, norm_weight, EPS).double()
    return normed @ lm_head[:num_real_tokens].double().T


def _draft(hidden, norm_weight, lm_head, num_real_tokens, impl):
    return torch.ops.inkling.mtp_draft(hidden, norm_weight, lm_head, num_real_tokens, EPS, impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [mtp_reference.CHUNK_ROWS, 48])
def test_reference_matches_float64_math(dtype, chunk_rows):
    hidden, w, lm_head = _problem(N=9, H=64, V=260, num_real_tokens=250, dtype=dtype)
    want = _logits64(hidden, w, lm_head, 250).argmax(dim=-1)
    got = mtp_reference.mtp_draft(hidden, w, lm_head, 250, EPS, chunk_rows=chunk_rows)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    assert torch.equal(_draft(hidden, w, lm_head, 250, "reference"), want)


# (N, H, V, num_real_tokens, dtype, config); config None = the launcher's choice
TRITON_CASES = [
    (1, 96, 300, 300, torch.float32, None),
    (5, 80, 300, 250, torch.bfloat16, None),  # H not a multiple of BLOCK_K
    (37, 64, 200, 190, torch.float32, MtpConfig(block_n=16, block_v=32, block_k=32)),  # 3 row blocks
    (70, 64, 130, 129, torch.bfloat16, None),  # 2 row blocks of 64; last tile holds one real row
    (16, 48, 100, 77, torch.bfloat16, MtpConfig(block_n=16, block_v=16, block_k=16)),
]


@pytest.mark.parametrize("N,H,V,num_real_tokens,dtype,config", TRITON_CASES)
def test_triton_matches_reference(N, H, V, num_real_tokens, dtype, config):
    hidden, w, lm_head = _problem(N, H, V, num_real_tokens, dtype=dtype, seed=N)
    want = _draft(hidden, w, lm_head, num_real_tokens, "reference")
    if config is None:
        got = _draft(hidden, w, lm_head, num_real_tokens, "triton")
    else:
        got = launcher.mtp_draft(hidden, w, lm_head, num_real_tokens, EPS, config=config)
    assert got.dtype == torch.int64 and got.shape == (N,)
    assert torch.equal(got, want)
    assert int(got.max()) < num_real_tokens


def _tie_problem(dtype):
    """Exact ties: a logit that is a single product c * normed[i, k] is the same in any summation
    order. Rows 0..9 tie between vocabulary 37 and 150 (different tiles), rows 10..19 between 90
    and 91 (one tile); padded rows hold the same pattern doubled; row 20 is zero: all logits 0."""
    H, V, num_real_tokens, c = 64, 200, 180, 8.0
    hidden, w, lm_head = _problem(N=21, H=H, V=V, num_real_tokens=num_real_tokens, seed=7)
    hidden *= 0.05
    hidden[:10, 0] = 5.0
    hidden[10:20, 0] = 0.0
    hidden[10:20, 1] = -5.0
    hidden[20] = 0.0
    for v in (37, 150):
        lm_head[v] = 0.0
        lm_head[v, 0] = c
    for v in (90, 91):
        lm_head[v] = 0.0
        lm_head[v, 1] = -c
    lm_head[190] = 0.0
    lm_head[190, 0] = 2 * c
    want = torch.tensor([37] * 10 + [90] * 10 + [0], device=DEVICE)
    return hidden.to(dtype), w, lm_head.to(dtype), num_real_tokens, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "impl,config", [("reference", None), ("triton", None), ("triton", MtpConfig(16, 16, 16))]
)
def test_ties_pick_the_first_index(dtype, impl, config):
    hidden, w, lm_head, num_real_tokens, want = _tie_problem(dtype)
    if config is None:
        got = _draft(hidden, w, lm_head, num_real_tokens, impl)
    else:
        got = launcher.mtp_draft(hidden, w, lm_head, num_real_tokens, EPS, config=config)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_no_rows(impl):
    _, w, lm_head = _problem(N=1, H=32, V=40, num_real_tokens=40)
    hidden = torch.empty(0, 32, device=DEVICE)
    got = _draft(hidden, w, lm_head, 40, impl)
    assert got.shape == (0,) and got.dtype == torch.int64


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_argument_errors(impl):
    hidden, w, lm_head = _problem(N=2, H=32, V=40, num_real_tokens=40)
    bad = [
        ((hidden, w, lm_head.to(torch.bfloat16), 40), "dtype"),
        ((hidden.to(torch.int32), w, lm_head.to(torch.int32), 40), "dtype"),
        ((hidden, w, lm_head[:, :16], 40), "hidden size"),
        ((hidden, w[:16], lm_head, 40), "hidden size"),
        ((hidden[0], w, lm_head, 40), "want hidden"),
        ((hidden, w, lm_head, 0), "num_real_tokens"),
        ((hidden, w, lm_head, 41), "num_real_tokens"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            _draft(*args, impl)
    with pytest.raises(ValueError, match="unknown impl"):
        _draft(hidden, w, lm_head, 40, "cuda-magic")


def test_op_registered_with_fake():
    from plugins import registry

    spec = registry.get("mtp_draft")
    assert spec.version == 1 and spec.qualname == "inkling::mtp_draft"
    hidden, w, lm_head = _problem(N=3, H=32, V=40, num_real_tokens=33, device="cpu")
    torch.library.opcheck(
        torch.ops.inkling.mtp_draft.default,
        (hidden, w, lm_head, 33, EPS, "reference"),
        test_utils=("test_schema", "test_faketensor"),
    )


class _DraftHead(torch.nn.Module):
    def __init__(self, norm_weight: torch.Tensor, lm_head: torch.Tensor, num_real_tokens: int) -> None:
        super().__init__()
        self.norm_weight = torch.nn.Parameter(norm_weight, requires_grad=False)
        self.lm_head = torch.nn.Parameter(lm_head, requires_grad=False)
        self.num_real_tokens = num_real_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.inkling.mtp_draft(
            hidden, self.norm_weight, self.lm_head, self.num_real_tokens, EPS, "reference"
        )


def test_export_with_dynamic_rows():
    hidden, w, lm_head = _problem(N=6, H=32, V=48, num_real_tokens=45, device="cpu")
    n = torch.export.Dim("num_logits", min=1, max=64)
    ep = torch.export.export(_DraftHead(w, lm_head, 45), (hidden,), dynamic_shapes={"hidden": {0: n}})
    calls = [node for node in ep.graph.nodes if node.target is torch.ops.inkling.mtp_draft.default]
    assert len(calls) == 1 and calls[0].args[3:] == (45, EPS, "reference")
    other, _, _ = _problem(N=11, H=32, V=48, num_real_tokens=45, seed=3, device="cpu")
    assert torch.equal(ep.module()(other), _draft(other, w, lm_head, 45, "reference"))


# --- GPU: bf16 at inkling-bench decode shapes ------------------------------------------------------


def _assert_same_or_near_tie(got, want, logits64, rtol=1e-4):
    """Equal drafts, except where the two picks' float64 logits are within rtol of the row's max
    (float32 summation order, or a last-bit difference of the normalised hidden, decides those)."""
    rows = torch.arange(got.shape[0], device=got.device)
    best = logits64.max(dim=-1).values
    gap = best - logits64[rows, got]
    assert torch.all(gap <= rtol * best.abs().clamp(min=1.0)), f"drafts far from the max: {gap.max()}"
    assert int((got != want).sum()) <= got.shape[0] // 8


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 8, 33, 64])
def test_mtp_draft_gpu_bf16(N):
    H, V, num_real_tokens = 7168, 163840, 163840 - 77
    hidden, w, lm_head = _problem(N, H, V, num_real_tokens, dtype=torch.bfloat16, seed=N)
    got = _draft(hidden, w, lm_head, num_real_tokens, "triton")
    want = _draft(hidden, w, lm_head, num_real_tokens, "reference")
    assert int(got.max()) < num_real_tokens
    _assert_same_or_near_tie(got, want, _logits64(hidden, w, lm_head, num_real_tokens))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_mtp_draft_gpu_float32_and_ties():
    hidden, w, lm_head = _problem(N=40, H=1024, V=32768, num_real_tokens=32000, seed=1)
    got = _draft(hidden, w, lm_head, 32000, "triton")
    _assert_same_or_near_tie(
        got, _draft(hidden, w, lm_head, 32000, "reference"), _logits64(hidden, w, lm_head, 32000), rtol=1e-6
    )
    hidden, w, lm_head, num_real_tokens, want = _tie_problem(torch.bfloat16)
    assert torch.equal(_draft(hidden, w, lm_head, num_real_tokens, "triton"), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_mtp_draft_gpu_cuda_graph():
    """No host sync: the op captures in a CUDA graph and replays on new inputs."""
    hidden, w, lm_head = _problem(8, 7168, 16384, 16000, dtype=torch.bfloat16)
    static_hidden = hidden.clone()
    _draft(static_hidden, w, lm_head, 16000, "triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _draft(static_hidden, w, lm_head, 16000, "triton")
    new_hidden, _, _ = _problem(8, 7168, 16384, 16000, dtype=torch.bfloat16, seed=5)
    static_hidden.copy_(new_hidden)
    graph.replay()
    assert torch.equal(out, _draft(new_hidden, w, lm_head, 16000, "triton"))

"""sconv: Triton ⇄ reference op ⇄ the model's math (inkling.published.ops.residual_sconv less its skip), plus
rollback.

On the CPU the Triton kernels run in the interpreter (conftest.py) in float32 at small shapes;
bf16 and larger sweeps are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

import plugins  # noqa: F401  (registers the ops)
from inkling.published.ops import residual_sconv
from plugins.sconv import sconv_rollback

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
K = 4


def _cu(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _problem(q_lens, C, S, dtype=torch.float32, num_slots=None, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(q_lens)
    num_slots = num_slots or B + 3
    x = torch.randn(sum(q_lens), C, generator=g).to(DEVICE, dtype)
    w = torch.randn(C, K, generator=g).to(DEVICE, dtype)
    state = torch.randn(num_slots, S, C, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(num_slots, generator=g)[:B].to(torch.int32).to(DEVICE)
    return x, w, state, slots, _cu(q_lens)


def conv(x, w, history=None):
    """The model's short convolution without its skip, in float32."""
    return residual_sconv(x.float(), w.float(), None if history is None else history.float()) - x.float()


def _truth(x, w, state, slots, q_lens):
    """The spec's math per sequence, and the expected new state (last S inputs)."""
    S = state.shape[1]
    y, new_state = [], state.clone()
    start = 0
    for b, n in enumerate(q_lens):
        xb = x[start : start + n]
        s = int(slots[b])
        y.append(conv(xb, w, state[s, S - K + 1 :]))
        new_state[s] = torch.cat([state[s], xb])[-S:]
        start += n
    return torch.cat(y), new_state


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("q_lens,S", [([1], 3), ([5, 1, 17], 3), ([1, 1, 1, 1], 11), ([9, 2, 40, 3], 11)])
def test_sconv_matches_spec(impl, q_lens, S):
    x, w, state, slots, cu = _problem(q_lens, C=48, S=S)
    y_true, state_true = _truth(x, w, state, slots, q_lens)
    y = torch.ops.inkling.sconv(x, w, state, slots, cu, impl)
    torch.testing.assert_close(y, y_true, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_true, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_decode_continues_prefill(impl):
    """Prefill in chunks, then decode steps: equals one-shot over the whole sequence."""
    C, S = 40, 7
    x, w, _, _, _ = _problem([20], C=C, S=S)
    state = torch.zeros(2, S, C, device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    pieces = [(0, 9), (9, 12), *[(t, t + 1) for t in range(12, 20)]]
    ys = [torch.ops.inkling.sconv(x[a:b], w, state, slot, _cu([b - a]), impl) for a, b in pieces]
    torch.testing.assert_close(torch.cat(ys), conv(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], x[-S:], rtol=0, atol=0)
    assert torch.all(state[0] == 0)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_padding_slot_is_stateless(impl):
    """A slot < 0 (a padding row of a graph bucket) reads zeros and saves nothing."""
    x, w, state, _, cu = _problem([3, 2], C=16, S=3)
    slots = torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)
    before = state.clone()
    y = torch.ops.inkling.sconv(x, w, state, slots, cu, impl)
    torch.testing.assert_close(y[:3], conv(x[:3], w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1:], before[1:], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_rollback_then_refeed_equals_never_fed(impl):
    """Feed A, then drafts B (n_b per sequence), roll back n_b, feed C: as if B was never fed."""
    C, S = 24, 3 + 8
    g = torch.Generator().manual_seed(3)
    B = 3
    a_lens, b_lens, c_lens, n_roll = [5, 2, 9], [4, 9, 1], [3, 1, 2], [4, 8, 0]
    xa, xb, xc = (torch.randn(sum(q), C, generator=g).to(DEVICE) for q in (a_lens, b_lens, c_lens))
    w = torch.randn(C, K, generator=g).to(DEVICE)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    s1 = torch.zeros(B, S, C, device=DEVICE)
    s2 = s1.clone()
    torch.ops.inkling.sconv(xa, w, s1, slots, _cu(a_lens), impl)
    torch.ops.inkling.sconv(xa, w, s2, slots, _cu(a_lens), impl)
    torch.ops.inkling.sconv(xb, w, s2, slots, _cu(b_lens), impl)
    sconv_rollback(s2, slots, torch.tensor(n_roll, device=DEVICE))
    # Drafts kept by the sequence that rolled back fewer than it fed are fed to s1 too.
    kept = torch.cat(
        [xb[int(_cu(b_lens)[i]) : int(_cu(b_lens)[i]) + b_lens[i] - n_roll[i]] for i in range(B)]
    )
    torch.ops.inkling.sconv(kept, w, s1, slots, _cu([b - n for b, n in zip(b_lens, n_roll)]), impl)
    y1 = torch.ops.inkling.sconv(xc, w, s1, slots, _cu(c_lens), impl)
    y2 = torch.ops.inkling.sconv(xc, w, s2, slots, _cu(c_lens), impl)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    for i in range(B):
        s = int(slots[i])
        fresh = S - max(n_roll[i] - c_lens[i], 0)  # rows never made stale
        torch.testing.assert_close(s2[s, S - fresh :], s1[s, S - fresh :], rtol=0, atol=0)


def test_rollback_padding_slot_untouched():
    S, C = 6, 8
    state = torch.randn(3, S, C, device=DEVICE)
    before = state.clone()
    sconv_rollback(
        state, torch.tensor([-1, 2], dtype=torch.int32, device=DEVICE), torch.tensor([3, 2]).to(DEVICE)
    )
    torch.testing.assert_close(state[:2], before[:2], rtol=0, atol=0)
    torch.testing.assert_close(state[2, 2:], before[2, :-2], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("C", [1024, 6144])
@pytest.mark.parametrize("q_lens", [[1] * 64, [1000, 7, 1, 300], [4096]])
def test_sconv_gpu_bf16(C, q_lens):
    S = 11
    x, w, state, slots, cu = _problem(q_lens, C=C, S=S, dtype=torch.bfloat16)
    s_ref = state.float()  # a float32 copy the reference mutates
    y = torch.ops.inkling.sconv(x, w, state, slots, cu, "triton")
    y_ref = torch.ops.inkling.sconv(x.float(), w.float(), s_ref, slots, cu, "reference")
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state.float(), s_ref, rtol=0, atol=0)

"""The spec's math (inkling.ops) against independent, explicit formulations."""

import math

import pytest
import torch
import torch.nn.functional as F

from inkling import ops


def test_sconv_equals_depthwise_conv1d():
    torch.manual_seed(0)
    T, C, K = 23, 12, 4
    x, w = torch.randn(T, C), torch.randn(C, K)
    # conv1d with groups=C and left padding K-1 on x transposed to [C, T] (§3.2).
    want = F.conv1d(F.pad(x.T[None], (K - 1, 0)), w[:, None, :], groups=C)[0].T
    torch.testing.assert_close(ops.sconv(x, w), want, rtol=1e-6, atol=1e-6)


def test_sconv_state_continues_the_sequence():
    torch.manual_seed(1)
    x, w = torch.randn(17, 8), torch.randn(8, 4)
    whole = ops.sconv(x, w)
    tail = ops.sconv(x[10:], w, state=x[7:10])
    torch.testing.assert_close(tail, whole[10:])


def test_sconv_current_token_uses_last_tap():
    x = torch.zeros(5, 1)
    x[2, 0] = 1.0
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # An impulse at t=2 reaches t=2 through w[K-1], t=3 through w[K-2], ...
    assert ops.sconv(x, w)[:, 0].tolist() == [0.0, 0.0, 4.0, 3.0, 2.0]


def _explicit_attention(q, k, v, r, E, window):
    """The §3.1 formula, one logit at a time."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    R = E.shape[1]
    out = torch.zeros_like(q)
    for h in range(Hq):
        g = h // (Hq // Hkv)
        for i in range(T):
            js = [j for j in range(T) if j <= i and (window == 0 or i - j < window)]
            logits = torch.stack(
                [q[i, h] @ k[j, g] / math.sqrt(D) + r[i, h] @ E[h, min(i - j, R - 1)] for j in js]
            )
            p = torch.softmax(logits, 0)
            out[i, h] = sum(p[n] * v[j, g] for n, j in enumerate(js))
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_relative_attention_matches_explicit_loop(window):
    torch.manual_seed(2)
    T, Hq, Hkv, D, Dr, R = 13, 4, 2, 128, 8, 6  # T beyond R and beyond the window
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    r, E = torch.randn(T, Hq, Dr), torch.randn(Hq, R, Dr)
    got = ops.relative_attention(q, k, v, r, E, window)
    torch.testing.assert_close(got, _explicit_attention(q, k, v, r, E, window), rtol=1e-5, atol=1e-5)


def test_relative_attention_suffix_queries_equal_full_run():
    """Queries given for the last positions only (a decode step) equal those rows of the whole run."""
    torch.manual_seed(3)
    T, Hq, Hkv, D, Dr, R = 20, 2, 1, 128, 4, 8
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    r, E = torch.randn(T, Hq, Dr), torch.randn(Hq, R, Dr)
    whole = ops.relative_attention(q, k, v, r, E, 7)
    torch.testing.assert_close(ops.relative_attention(q[-3:], k, v, r[-3:], E, 7), whole[-3:])


def test_relative_term_is_clipped_at_R():
    """Keys at distance >= R-1 see the same relative row E[R-1]."""
    r, E = torch.randn(1, 1, 4), torch.randn(1, 5, 4)
    bias = ops.relative_bias(r, E, torch.tensor([20]), torch.arange(21))[0, 0]
    expect_far = r[0, 0] @ E[0, 4]
    torch.testing.assert_close(bias[: 20 - 4 + 1], expect_far.expand(17))
    torch.testing.assert_close(bias[20], r[0, 0] @ E[0, 0])


def test_sink_routing_weights_sum_below_one():
    torch.manual_seed(4)
    E, S, k, H = 16, 2, 6, 32
    x, W = torch.randn(9, H), torch.randn(E + S, H)
    w, idx, p_shared = ops.route(x, W, E, k)
    p = torch.softmax((x @ W.T).float(), -1)
    total = w.sum(-1) + p_shared.sum(-1)
    assert torch.all(w.sum(-1) < 1) and torch.all(total <= 1 + 1e-6)
    assert torch.all(idx < E), "shared experts are never selected"
    torch.testing.assert_close(w, torch.gather(p[:, :E], 1, idx))
    # The selection is the top k of the routed columns.
    torch.testing.assert_close(w, p[:, :E].topk(k).values)


def test_routing_ties_go_to_the_lower_index():
    E, S, H = 8, 2, 4
    W = torch.zeros(E + S, H)
    W[[1, 3, 5, 6]] = 1.0  # four equal routed scores, two slots
    w, idx, _ = ops.route(torch.ones(3, H), W, E, 2)
    assert idx.tolist() == [[1, 3]] * 3
    W[:E] = 0.0  # every routed score equal: the first k experts
    _, idx, _ = ops.route(torch.ones(1, H), W, E, 6)
    assert idx.tolist() == [[0, 1, 2, 3, 4, 5]]

"""Sampler statistics on a small vocabulary, and the streaming detokenizer on CJK and emoji."""

import math

import pytest
import torch

from inkling.detokenizer import IncrementalDetokenizer
from inkling.published.tokens import build_tiny_tokenizer
from runtime.params import SamplingParams
from runtime.sampler import filter_logits, make_generator, sample, sample_tokens, target_probs

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def draw(params, n=4000, seed=0):
    g = make_generator(seed)
    return torch.tensor([sample(LOGITS, params, g).token for _ in range(n)])


def test_greedy_takes_the_argmax():
    assert sample(LOGITS, SamplingParams(), None).token == 0


def test_top_k_never_leaves_the_top_k():
    tokens = draw(SamplingParams(temperature=2.0, top_k=3))
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus():
    p = torch.softmax(LOGITS, -1)  # cumulative: 0.40, 0.64, 0.79, 0.88, ...
    params = SamplingParams(temperature=1.0, top_p=0.7)
    kept = torch.isfinite(filter_logits(LOGITS, params)).nonzero().flatten().tolist()
    assert kept == [0, 1, 2] and p[:2].sum() < 0.7 <= p[:3].sum()
    assert set(draw(params).tolist()) <= {0, 1, 2}


def test_temperature_distribution_chi_square():
    """4000 draws against softmax(l / T): chi-square with 7 degrees of freedom, failing above the
    0.9999 quantile (27.9), so a correct sampler fails this test once in 10,000 seeds."""
    T, n = 1.5, 4000
    counts = torch.bincount(draw(SamplingParams(temperature=T), n), minlength=8).double()
    expected = torch.softmax(LOGITS.double() / T, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, f"chi-square {chi2:.1f}"


def test_seeds_reproduce_and_differ():
    params = SamplingParams(temperature=1.0)
    assert torch.equal(draw(params, 200, 5), draw(params, 200, 5))
    assert not torch.equal(draw(params, 200, 5), draw(params, 200, 6))


def test_logprobs():
    out = sample(LOGITS, SamplingParams(logprobs=2), None)
    logp = torch.log_softmax(LOGITS, -1)
    assert out.token == 0 and math.isclose(out.logprob, float(logp[0]), rel_tol=1e-6)
    assert list(out.top_logprobs) == [0, 1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(1024)


@pytest.mark.parametrize(
    "text",
    [
        "東京は日本の首都です。 漢字かな交じり文",
        "emoji 🎉🙂👍🏽 and flags 🇰🇷 mixed",
        "  leading and  double  spaces ",
        "naïve café",
    ],
)
def test_streaming_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces), "a delta split a UTF-8 character"


def test_filter_logits_on_rows_equals_row_by_row():
    """The sampled verify filters all of a sequence's rows at once: each row as if alone (top-k, top-p)."""
    rows = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    for params in (
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.3, top_k=9, top_p=0.8),
    ):
        want = torch.stack([filter_logits(r, params) for r in rows])
        assert torch.equal(filter_logits(rows, params), want)
        assert (torch.isfinite(want).sum(-1) > 1).all()


MIXED = [
    SamplingParams(temperature=0.8),
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.2, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.2, top_k=20),
]


def test_batched_draws_equal_each_row_drawn_alone():
    """A batch's draws (one softmax per distinct params) equal each row's own draw from its own generator:
    softmax(filter(row)), one exponential race from the request's generator, argmax. Mixed greedy and
    sampled rows, repeated params not side by side, several steps so the generators advance."""
    logits = torch.randn(len(MIXED), 1000, generator=torch.Generator().manual_seed(1)) * 3
    batched = [make_generator(100 + i) for i in range(len(MIXED))]
    alone = [make_generator(100 + i) for i in range(len(MIXED))]
    for _ in range(5):
        got = sample_tokens(logits, MIXED, batched)
        for i, (row, params) in enumerate(zip(logits, MIXED)):
            if params.greedy:
                want = int(row.argmax())
            else:
                probs = torch.softmax(filter_logits(row, params), -1)
                want = int((probs / torch.empty_like(probs).exponential_(generator=alone[i])).argmax())
            assert int(got[i]) == want, (i, params)
        logits = logits.roll(7, dims=-1)


def test_target_probs_of_spans_equal_span_by_span():
    """The sampled verify's target rows: spans of several rows under their own params, not contiguous and
    not grouped by params, come back in span order, each as its own filter and softmax."""
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(2))
    spans = [(0, 2), (3, 6), (6, 7), (8, 12)]
    params = [MIXED[0], MIXED[3], MIXED[0], MIXED[4]]
    got = target_probs(logits, spans, params)
    want = torch.cat([torch.softmax(filter_logits(logits[a:b], p), -1) for (a, b), p in zip(spans, params)])
    assert torch.equal(got, want)
    one = target_probs(logits, spans[1:3], [MIXED[0], MIXED[0]])  # contiguous spans of one params: no copy
    assert torch.equal(one, torch.softmax(filter_logits(logits[3:7], MIXED[0]), -1))

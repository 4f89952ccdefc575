"""Sampler statistics on a small vocabulary, and the streaming detokenizer on CJK and emoji."""

import math

import pytest
import torch

from inkling.detokenizer import IncrementalDetokenizer
from inkling.tokenizer import build_tokenizer
from runtime.params import SamplingParams
from runtime.sampler import filter_logits, make_generator, sample

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
    return build_tokenizer()


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

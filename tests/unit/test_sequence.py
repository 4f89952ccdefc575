"""Sequence.token_range and the runner's fed_tokens: slices of prompt + outputs (+ drafts) without
building the whole token list."""

from __future__ import annotations

from runtime.model_runner import fed_tokens
from runtime.params import SamplingParams
from runtime.sequence import Sequence


def test_token_range_and_fed_tokens_equal_list_slices():
    seq = Sequence("r", list(range(100, 107)), SamplingParams())
    seq.output_ids = [200, 201, 202]
    drafts = [300, 301, 302]
    tokens = seq.tokens
    for start in range(len(tokens) + 2):
        for end in range(start, len(tokens) + 2):
            assert seq.token_range(start, min(end, len(seq))) == tokens[start:end], (start, end)
        for n in range(0, 5):
            if start + n <= len(tokens) + len(drafts):
                assert fed_tokens(seq, drafts, start, n) == (tokens + drafts)[start : start + n], (start, n)
    seq.output_ids = []
    assert seq.token_range(2, 5) == [102, 103, 104] and fed_tokens(seq, [9], 6, 2) == [106, 9]

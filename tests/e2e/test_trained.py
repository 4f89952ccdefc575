"""The trained small Inkling (data/inkling-small) through the converter, the builder and the runtime:
passkey retrieval within the trained length, token for token with the reference, and MTP drafts that
a trained model's heads get accepted (random weights cannot show either)."""

from __future__ import annotations

import pytest
import torch

from bench.acceptance import task_prompts
from bench.needle import ANSWER_TOKENS, needle_prompts, prepare_engine, reference_check
from inkling.model import InklingReference
from inkling.tokenizer import load_tokenizer
from runtime import LLM, SamplingParams
from runtime.engine import PromptInput
from runtime.speculative import AcceptanceStats
from train import SMALL_CHECKPOINT


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    fp4, engine = prepare_engine(str(tmp_path_factory.mktemp("small")), 1600)
    reference = InklingReference.from_pretrained(fp4, dtype=torch.float32, cache_dequantized=True)
    llm = LLM(engine)
    yield llm, reference, load_tokenizer(SMALL_CHECKPOINT)
    llm.shutdown()


def test_checkpoint_follows_the_spec():
    # Loads through the same checks as any checkpoint: every tensor present, shapes and dtypes right.
    model = InklingReference.from_pretrained(SMALL_CHECKPOINT, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) < 4_000_000
    assert model.config.hidden_size == 128 and model.config.num_mtp_heads == 8


def test_passkey_retrieval_through_the_engine(small):
    llm, reference, tok = small
    # Lengths far beyond the sliding window (128) and the relative table (256): the full layer retrieves.
    prompts = needle_prompts(tok, [600, 1500], [0.1, 0.9], trials=1, seed=5)
    outs = llm.generate(
        [PromptInput(torch.tensor(p.prompt)) for p in prompts],
        SamplingParams(max_tokens=ANSWER_TOKENS),
    )
    for p, out in zip(prompts, outs):
        got = list(out.token_ids)
        assert reference_check(reference, p.prompt, got) == (None, False), (p.length, p.depth)
        assert tok.decode(got).startswith(f" {p.passkey}."), (p.length, p.depth, tok.decode(got))


def test_trained_heads_get_drafts_accepted(small):
    llm, _, tok = small
    prompts = [PromptInput(torch.tensor(ids)) for ids in task_prompts(tok, "count", 3, seed=3)]
    plain = llm.generate(prompts, SamplingParams(max_tokens=24))
    llm.engine.spec.acceptance = AcceptanceStats()  # count these requests' steps only
    spec = llm.generate(prompts, SamplingParams(max_tokens=24, num_draft_tokens=3))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # Counting is what the heads learned best (bench/acceptance.py: 3.9 of 4 tokens per step at k=3);
    # random heads accept next to nothing (about 1.0).
    assert llm.engine.metrics()["mean_acceptance_length"] > 2.5

"""The trained small real Inkling (data/inkling-small-published, train/published.py) through the builder
and the runtime: on needle prompts past the window, the relative extent and the log-scaling floor the
float32 engine's greedy tokens equal transformers' token for token, and the trained MTP depths get their
drafts accepted while the output stays the plain greedy one (random depths accept next to nothing)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from builder.build import build
from builder.config import BuildConfig
from inkling.published.mtp import MTPReference
from runtime import LLM, SamplingParams
from runtime.engine import PromptInput
from runtime.speculative import AcceptanceStats
from train.data import Mixture
from train.published import CHECKPOINT, EOS, SEPARATOR, materialize, trained_config

ANSWER_TOKENS = 8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    ckpt = materialize(CHECKPOINT, tmp_path_factory.mktemp("trained") / "small")
    bc = BuildConfig(
        dtype="float32",
        device="cpu",
        max_batch_size=4,
        max_input_len=1200,
        max_seq_len=1280,
        max_num_tokens=512,
    )
    llm = LLM(build(ckpt, bc, echo=False))
    tok = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
    yield llm, MTPReference.load(ckpt), tok, Mixture(tok, 2048, seed=5, held_out=True, bos=SEPARATOR, eos=EOS)
    llm.shutdown()


def test_checkpoint_is_the_trained_config():
    from inkling.published.config import InklingConfig

    assert InklingConfig.from_pretrained(CHECKPOINT) == trained_config()


@torch.no_grad()
def greedy(reference: MTPReference, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        _, _, logits = reference.trunk_pass(torch.tensor(ids))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :]


def test_engine_equals_transformers_on_needle_prompts(small):
    llm, reference, tok, mixture = small
    prompts = []
    for length, depth in ((300, 0.3), (1150, 0.6)):  # window 128, extent 256, log floor 1024
        s = mixture.needle(length, depth=depth)
        prompts.append(s.ids[: s.answer_positions[0]])
    outs = llm.generate(
        [PromptInput(torch.tensor(p)) for p in prompts], SamplingParams(max_tokens=ANSWER_TOKENS)
    )
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == greedy(reference, p, len(out.token_ids)), len(p)


def test_trained_depths_get_drafts_accepted(small):
    llm, _, _, mixture = small
    prompts = []
    for _ in range(3):
        s = mixture.count()
        prompts.append(PromptInput(torch.tensor(s.ids[: s.answer_positions[0] + 2])))
    plain = llm.generate(prompts, SamplingParams(max_tokens=24))
    llm.engine.spec.acceptance = AcceptanceStats()  # these requests' steps only
    spec = llm.generate(prompts, SamplingParams(max_tokens=24, num_draft_tokens=3))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    print("mean acceptance length", llm.engine.metrics()["mean_acceptance_length"])
    # measured 2026-12-03: see BENCHMARKS.md; random depths accept about 1.0 token a step
    assert llm.engine.metrics()["mean_acceptance_length"] > 2.0

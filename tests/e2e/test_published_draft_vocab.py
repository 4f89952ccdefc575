"""A draft vocabulary on the real Inkling (builder/draft_vocab.py): the MTP depths draft only its tokens (each
draft pick reads those rows of the unembedding alone), the verified output stays the plain greedy one, and
the builder refuses a vocabulary it cannot serve."""

from __future__ import annotations

import pytest
import torch

from builder import BuildConfig, build
from builder.config import BuildError
from builder.engine import Engine
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from runtime import LLMEngine, PromptInput, SamplingParams

from ..hooks import override_drafts
from .test_runtime import run_all

CONFIG = dict(
    dtype="float32", device="cpu", max_batch_size=4, max_input_len=64, max_seq_len=96, max_num_tokens=48
)
VOCAB = 960  # prompt ids below the special tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", preset("inkling-tiny"), seed=7)


def requests() -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(3)
    return [(f"r{i}", torch.randint(0, VOCAB, (5 + 9 * i,), generator=g), 1 + i % 4) for i in range(4)]


def run(engine, k: int | None = None, record: list | None = None) -> dict:
    eng = LLMEngine(engine)
    if record is not None:
        override_drafts(eng, lambda rid, tokens, drafts: record.extend(drafts) or drafts)
    for rid, ids, drafts in requests():
        params = SamplingParams(max_tokens=12, ignore_eos=True, num_draft_tokens=drafts if k is None else k)
        eng.add_request(rid, PromptInput(ids), params)
    return run_all(eng)


def test_depths_draft_only_the_vocabulary_and_the_output_stays_plain(ckpt, tmp_path):
    plain_engine = build(ckpt, BuildConfig(**CONFIG), echo=False)
    plain = run(plain_engine, k=0)
    # The plain continuation's tokens and a spread of others: the depths' own picks, random, mostly fall
    # outside, so a pick that ignored the vocabulary would be seen.
    vocab = sorted({t for out in plain.values() for t in out} | set(range(0, VOCAB, 7)))
    engine = build(ckpt, BuildConfig(**CONFIG), echo=False, draft_vocab=vocab)
    assert engine.config["draft_vocab"] == vocab
    everywhere: list[int] = []
    assert run(plain_engine, record=everywhere) == plain
    assert any(t not in vocab for t in everywhere)  # without a vocabulary the depths draft outside it
    drafted: list[int] = []
    assert run(engine, record=drafted) == plain
    assert drafted and set(drafted) <= set(vocab)
    engine.save(tmp_path / "engine")  # a saved engine keeps it, and a load checks it
    assert Engine.from_dir(tmp_path / "engine").config["draft_vocab"] == vocab


def test_builder_refuses_a_vocabulary_it_cannot_serve(ckpt):
    with pytest.raises(BuildError, match="outside"):
        build(ckpt, BuildConfig(**CONFIG), echo=False, draft_vocab=[1, 2, 10**6])
    with pytest.raises(BuildError, match="no MTP depths"):
        build(ckpt, BuildConfig(**{**CONFIG, "max_draft_len": 0}), echo=False, draft_vocab=[1, 2])

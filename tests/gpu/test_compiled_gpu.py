"""`--compile` on the GPU: the real Inkling's CUDA engine built with torch.compile around its Triton plugins
(+17% tokens/s at batch 1 on an H100) against transformers 5.23.0, as tests/gpu/test_published_gpu.py checks
the uncompiled one. Apart from it because the compile takes a minute or two: `bash bench/gpu_session.sh
real-check` runs both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from builder import build
from inkling.published.config import preset
from inkling.published.reference import reference_model
from inkling.published.synth import write_checkpoint
from runtime import LLM, PromptInput, SamplingParams

from .test_published_gpu import NEW, config, greedy, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", preset("inkling-tiny"), seed=11)


def test_compiled_cuda_engine_equals_transformers(ckpt):
    """`--compile` (torch.compile's Inductor around the Triton plugins, +17% tokens/s at batch 1 on an H100):
    the float32 engine built with it, its steps compiled and replayed from CUDA graphs, still gives
    transformers' greedy tokens, and its compiler artifacts travel with the engine."""
    engine = build(ckpt, dataclasses.replace(config("float32"), compile=True), echo=False)
    assert engine.config["build_config"]["compile"] and engine.compile_cache
    llm = LLM(engine)
    ref = reference_model(ckpt).cuda()
    ps = prompts()
    got = [
        o.token_ids
        for o in llm.generate([PromptInput(p) for p in ps], SamplingParams(max_tokens=NEW, ignore_eos=True))
    ]
    want = [greedy(ref, p.tolist(), NEW) for p in ps]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    print(
        f"\ncompiled float32 CUDA engine vs transformers on CUDA: {same}/{NEW * len(ps)} greedy tokens equal"
    )
    assert got == want

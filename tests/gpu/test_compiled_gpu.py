"""`--compile` on the GPU: the real Inkling's CUDA engine built with torch.compile around its Triton plugins
(+17% tokens/s at batch 1 on an H100) against transformers 5.23.0, as tests/gpu/test_published_gpu.py checks
the uncompiled one. Apart from it because the compile takes a minute or two: `bash bench/gpu_session.sh
real-check` runs both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from builder import build
from runtime import LLM

from .test_published_gpu import config, engine_and_transformers, equal_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_compiled_cuda_engine_equals_transformers(ckpt):
    """`--compile` (torch.compile's Inductor around the Triton plugins, +17% tokens/s at batch 1 on an H100):
    the float32 engine built with it, its steps compiled and replayed from CUDA graphs, still gives
    transformers' greedy tokens, and its compiler artifacts travel with the engine."""
    engine = build(ckpt, dataclasses.replace(config("float32"), compile=True), echo=False)
    assert engine.config["build_config"]["compile"] and engine.compile_cache
    got, want = engine_and_transformers(LLM(engine), ckpt)
    print(f"\ncompiled float32 CUDA engine vs transformers on CUDA: {equal_tokens(got, want)}")
    assert got == want

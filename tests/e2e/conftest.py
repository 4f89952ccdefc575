"""Engines built once per session from the tiny NVFP4 checkpoint, the reference model, test prompts."""

from __future__ import annotations

import pytest
import torch

from builder import BuildConfig, build
from inkling.demo import demo_png, demo_wav
from inkling.model import InklingReference
from inkling.processing import Processor
from inkling.tokenizer import load_tokenizer

from ..engine_runner import Prompt

SMALL = dict(max_batch_size=4, max_seq_len=256, max_input_len=256, max_num_tokens=512)


@pytest.fixture(scope="session")
def engine_f32(tiny_nvfp4_ckpt_dir, tmp_path_factory):
    engine = build(tiny_nvfp4_ckpt_dir, BuildConfig(dtype="float32", **SMALL), echo=False)
    path = tmp_path_factory.mktemp("engines") / "tiny-f32"
    engine.save(path)
    return engine, path


@pytest.fixture(scope="session")
def engine_bf16(tiny_nvfp4_ckpt_dir):
    return build(tiny_nvfp4_ckpt_dir, BuildConfig(dtype="bfloat16", **SMALL), echo=False)


@pytest.fixture(scope="session")
def reference(tiny_nvfp4_ckpt_dir):
    return InklingReference.from_pretrained(tiny_nvfp4_ckpt_dir, dtype=torch.float32, cache_dequantized=True)


@pytest.fixture(scope="session")
def prompts(tiny_nvfp4_ckpt_dir, reference):
    """Text longer than the window (32) and R (64); a short one; image+audio; two images."""
    proc = Processor(reference.config, load_tokenizer(tiny_nvfp4_ckpt_dir))
    g = torch.Generator().manual_seed(0)
    long_text = torch.randint(11, 1000, (90,), generator=g)
    return [
        Prompt(long_text),
        Prompt(torch.randint(11, 1000, (3,), generator=g)),
        _media(
            proc("A picture <|image|> and a sound <|audio|>, described:", [demo_png(40, 24)], [demo_wav(0.5)])
        ),
        _media(proc("<|image|> versus <|image|>", [demo_png(16, 16), demo_png(50, 33)])),
    ]


def _media(p):
    return Prompt(p.input_ids, list(p.images), list(p.audios))

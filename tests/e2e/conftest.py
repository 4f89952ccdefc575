"""The real Inkling's tiny engines, built once per session from a synthetic NVFP4 inkling-tiny checkpoint in
the published layout (its first MoE layer's experts BF16, the others NVFP4, 8 MTP depths), transformers as
the reference (on the dequantized experts), and test prompts past the window (16), the relative extent (24)
and the log-scaling floor (20), with images and audio."""

from __future__ import annotations

import pytest
import torch

from builder import BuildConfig, build
from inkling.published.config import preset
from inkling.published.processing import Prompt
from inkling.published.synth import write_checkpoint

SMALL = dict(max_batch_size=4, max_seq_len=256, max_input_len=256, max_num_tokens=512)
SEED = 0


@pytest.fixture(scope="session")
def pub_ckpt_dir(tmp_path_factory) -> str:
    """`python -m inkling.published.synth --preset inkling-tiny --nvfp4 --seed 0` (read-only)."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-nvfp4", preset("inkling-tiny", nvfp4=True), SEED
    )


@pytest.fixture(scope="session")
def engine_f32(pub_ckpt_dir, tmp_path_factory):
    engine = build(pub_ckpt_dir, BuildConfig(dtype="float32", **SMALL), echo=False)
    path = tmp_path_factory.mktemp("engines") / "tiny-f32"
    engine.save(path)
    return engine, path


@pytest.fixture(scope="session")
def engine_bf16(pub_ckpt_dir):
    return build(pub_ckpt_dir, BuildConfig(dtype="bfloat16", **SMALL), echo=False)


class Reference:
    """transformers' InklingForConditionalGeneration on the checkpoint (its NVFP4 experts dequantized):
    greedy tokens of a processed prompt, media on the first step only."""

    def __init__(self, path: str):
        from inkling.published.reference import reference_model

        self.model = reference_model(path)

    def generate(self, prompt: Prompt, max_tokens: int) -> list[int]:
        from runtime.demo import reference_greedy

        return reference_greedy(self.model, prompt, max_tokens)


@pytest.fixture(scope="session")
def reference(pub_ckpt_dir) -> Reference:
    pytest.importorskip("transformers")
    return Reference(pub_ckpt_dir)


@pytest.fixture(scope="session")
def processor(engine_f32):
    from runtime import LLM

    return LLM(engine_f32[0]).processor


@pytest.fixture(scope="session")
def prompts(processor) -> list[Prompt]:
    """Text past the window, the extent and the floor (90 tokens); a short one; image+audio; two images."""
    from tests.unit.test_published_processing import png, wav

    g = torch.Generator().manual_seed(0)
    return [
        Prompt(torch.randint(0, 960, (90,), generator=g)),
        Prompt(torch.randint(0, 960, (3,), generator=g)),
        processor(
            "A picture <|content_image|><|unused_200054|> and a sound <|content_audio_input|><|unused_200053|>, "
            "described:", [png(40, 24, seed=1)], [wav(0.5, 16000, 1, 2)],
        ),
        processor(
            "<|content_image|><|unused_200054|> versus <|content_image|><|unused_200054|>",
            [png(16, 16, seed=4), png(50, 33, seed=5)],
        ),
    ]  # fmt: skip


# Request limits of the module's Triton server (model_repo/serve.py ServeConfig), small enough to test.
LIMITS = dict(
    max_image_bytes=200_000, max_image_pixels=512 * 512, max_audio_bytes=400_000, max_audio_seconds=8.0,
    max_text_bytes=4096, max_images=2, max_audios=2,
)  # fmt: skip


@pytest.fixture(scope="session")
def server(engine_f32, tmp_path_factory, request):
    """A real Triton server on the float32 tiny engine, free localhost ports, LIMITS (the serving and
    OpenAI API tests share it). Where a test failed while it served, its log's tail goes to the terminal:
    a CI run keeps no files (one run, once, had every request refused with "Stub process 'ensemble_0_0' is
    not healthy" after a timeout, and nothing said why)."""
    from model_repo.serve import ServeConfig, TritonServer, free_port

    cfg = ServeConfig(
        engine_dir=str(engine_f32[1]), work_dir=str(tmp_path_factory.mktemp("serve")), http_port=free_port(),
        grpc_port=free_port(), metrics_port=free_port(), **LIMITS,
    )  # fmt: skip
    with TritonServer(cfg) as s:
        failed = request.session.testsfailed
        yield s
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if request.session.testsfailed > failed and reporter is not None:
            reporter.write_line(f"\nthe Triton server's log (tests failed while it served):\n{s.log_tail()}")
    assert s.process.poll() is not None

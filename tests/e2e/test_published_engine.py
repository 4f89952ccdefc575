"""The real Inkling end to end on the CPU: a published-layout checkpoint -> `builder.build` -> an engine
on disk -> `runtime.LLM`, against transformers 5.23.0.

float32: greedy tokens equal transformers' token for token, on a batch whose prompts are longer than the
window, the extent and the log-scaling floor, prefilled in chunks (max_num_tokens below the prompts'
sum), then again from the prefix cache. bf16: top-1 agreement and logit error within INKLING_SPEC's
bf16 tolerance against transformers in bf16. NVFP4: the converter's checkpoint builds, with BF16 and
NVFP4 experts in one engine.
"""

from __future__ import annotations

import pytest
import torch

from builder.build import build
from builder.config import BuildConfig, BuildError
from builder.engine import Engine
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from runtime import LLM, SamplingParams
from runtime.requests import PromptInput

transformers = pytest.importorskip("transformers")

MAX_NEW = 10


def build_config(dtype: str) -> BuildConfig:
    return BuildConfig(
        dtype=dtype, device="cpu", max_batch_size=4, max_input_len=96, max_seq_len=128, max_num_tokens=40
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", preset("inkling-tiny"), seed=5)


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.InklingForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine_dir(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "tiny-f32"
    build(ckpt, build_config("float32"), echo=False).save(out)
    return out


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 960, (n,), generator=g) for n in (1, 53, 30)]


def greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_engine_equals_transformers_token_for_token(engine_dir, hf):
    llm = LLM(Engine.from_dir(engine_dir))
    ps = prompts()
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([PromptInput(p) for p in ps], params)]
    want = [greedy(hf, p.tolist(), MAX_NEW) for p in ps]
    assert first == want
    assert sum(len(p) for p in ps) > build_config("float32").max_num_tokens  # so the prefill ran in chunks
    before = llm.engine.stats.prefill_tokens
    again = [o.token_ids for o in llm.generate([PromptInput(p) for p in ps[1:]], params)]
    assert again == want[1:]
    assert llm.engine.stats.prefill_tokens - before < len(ps[1]) + len(ps[2])  # served from the prefix cache


def test_text_prompts_use_the_checkpoints_tokenizer_without_bos(engine_dir, ckpt, hf):
    llm = LLM(Engine.from_dir(engine_dir))
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    text = "def fibonacci(n):"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = llm.generate([text], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_tokens == len(ids)
    assert out.token_ids == greedy(hf, ids, 6)


def test_text_image_audio_prompt_equals_transformers(engine_dir, hf):
    """Images of two sizes and a stereo 44.1 kHz clip through the processor, the towers and the step;
    transformers gets the same pixel values and dMel levels (its image processor needs torchvision)."""
    from runtime.demo import reference_greedy
    from tests.unit.test_published_processing import png, wav

    llm = LLM(Engine.from_dir(engine_dir))
    text = "look <|unused_200054|> then <|unused_200054|> and hear <|unused_200053|>:"
    images, audios = [png(50, 30, seed=1), png(41, 90, mode="RGBA", seed=2)], [wav(0.4, 44100, 2, 2)]
    out = llm.generate(
        [{"text": text, "images": images, "audios": audios}], SamplingParams(max_tokens=8, ignore_eos=True)
    )[0]
    p = llm.processor(text, images, audios)
    assert out.prompt_tokens == len(p.input_ids) == 40  # 6 + 15 image rows, 8 audio frames, 11 of text
    assert out.token_ids == reference_greedy(hf, p, 8)


def test_generation_stops_at_the_models_eos(engine_dir):
    llm = LLM(Engine.from_dir(engine_dir))
    eos = preset("inkling-tiny").eos_token_id
    assert eos in llm.engine.outputs.eos_ids
    out = llm.generate([PromptInput(torch.tensor([3, 4, 5]))], SamplingParams(max_tokens=40))[0]
    assert eos not in out.token_ids[:-1]


def test_bf16_engine_agrees_with_transformers_in_bf16(ckpt):
    """Over each prompt's positions: relative logit error under 3% and top-1 agreement over 90% (the
    earlier model's bf16 rule, here against transformers in bf16)."""
    from tests.engine_runner import EngineRunner

    runner = EngineRunner(build(ckpt, build_config("bfloat16"), echo=False))
    hf16 = transformers.InklingForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    H = preset("inkling-tiny").hidden_size
    no_media = (torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long))
    for b, p in enumerate(prompts()[1:]):
        runner.runner.reset_slot(b)
        pieces = [
            runner.run_step([p[s : s + 20]], [s], [no_media], all_logits=True, seq_ids=[b])[0]
            for s in range(0, len(p), 20)
        ]
        got = torch.cat(pieces)
        with torch.no_grad():
            want = hf16(input_ids=p[None]).logits[0].float()
        rel = float((got - want).norm() / want.norm())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        assert rel < 0.03 and agree > 0.9, (len(p), rel, agree)


def test_nvfp4_checkpoint_builds_with_both_expert_kinds(ckpt, tmp_path):
    from convert.published import convert

    convert(ckpt, str(tmp_path / "fp4"), calibration_prompts_n=0)
    engine = build(tmp_path / "fp4", build_config("float32"), echo=False)
    w = engine.weights
    assert w["model.llm.layers.2.mlp.experts.w13_weight"].dtype == torch.float32  # the first MoE layer: BF16
    assert w["model.llm.layers.3.mlp.experts.w13_weight"].dtype == torch.uint8
    out = LLM(engine).generate([PromptInput(prompts()[2])], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_a_bad_published_checkpoint_is_refused_by_name(ckpt, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BuildError, match=r"wrong shape or dtype: model\.llm\.embed\.weight"):
        build(bad, build_config("float32"), echo=False)


def test_engine_equals_transformers_on_its_own_save_pretrained(tmp_path):
    """transformers' own checkpoint: a randomly initialised InklingForConditionalGeneration at inkling-tiny's
    widths, every norm weight, selection bias, global scale and sconv randomised (its init leaves them
    1, 0, 1), saved with save_pretrained (float32, no MTP tensors), built and served."""
    c = preset("inkling-tiny")
    hc = transformers.InklingConfig.from_dict(c.to_dict())
    torch.manual_seed(0)
    model = transformers.InklingForConditionalGeneration(hc).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("gate.global_scale"):
                t.copy_(0.1 + 0.1 * torch.rand(t.shape, generator=g))
            elif name.endswith("global_scale"):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif "sconv" in name or name.endswith("rel_logits_proj.proj"):
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    model.save_pretrained(tmp_path / "hf")
    engine = build(tmp_path / "hf", build_config("float32"), echo=False)
    ps = prompts()
    got = [
        o.token_ids
        for o in LLM(engine).generate(
            [PromptInput(p) for p in ps], SamplingParams(max_tokens=8, ignore_eos=True)
        )
    ]
    assert got == [greedy(model, p.tolist(), 8) for p in ps]

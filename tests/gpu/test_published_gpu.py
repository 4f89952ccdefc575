"""The real Inkling's CUDA engine against transformers 5.23.0 on the GPU: `make GPU=1 test-gpu`.

inkling-tiny in the published layout, built for CUDA (every op on its Triton kernel: bank attention, the
sigmoid MoE, sconv, the KV write) and served with CUDA graphs (the runtime's default there): float32 greedy
tokens equal transformers' token for token, bf16 within the bf16 rule against transformers in bf16, and the
NVFP4 checkpoint equal to transformers on its dequantized experts. Each test prints its figures.
"""

from __future__ import annotations

import pytest
import torch

from builder import BuildConfig, PluginConfig, build
from inkling.published.config import preset
from inkling.published.reference import reference_model
from inkling.published.synth import write_checkpoint
from runtime import LLM, PromptInput, SamplingParams

from ..engine_runner import EngineRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12


def config(dtype: str, attention: str = "auto") -> BuildConfig:
    # untuned MoE tiles: tuning the toy widths' NVFP4 layers would compile every candidate for nothing
    return BuildConfig(
        dtype=dtype, device="cuda", max_batch_size=4, max_input_len=128, max_seq_len=160, max_num_tokens=64,
        plugin_config=PluginConfig(attention=attention, tune=False),
    )  # fmt: skip


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 960, (n,), generator=g) for n in (1, 90, 37)]


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out], device="cuda")).logits[0, -1].argmax()))
    return out[len(ids) :]


def engine_and_transformers(llm: LLM, ckpt) -> tuple[list[list[int]], list[list[int]]]:
    """NEW greedy tokens of each of prompts() from the engine, and from transformers on the checkpoint."""
    ref = reference_model(ckpt).cuda()
    ps = prompts()
    got = [
        o.token_ids
        for o in llm.generate([PromptInput(p) for p in ps], SamplingParams(max_tokens=NEW, ignore_eos=True))
    ]
    return got, [greedy(ref, p.tolist(), NEW) for p in ps]


def equal_tokens(got: list[list[int]], want: list[list[int]]) -> str:
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    return f"{same}/{sum(map(len, want))} greedy tokens equal"


def test_float32_cuda_engine_equals_transformers(ckpt):
    engine = build(ckpt, config("float32"), echo=False)
    impls = engine.config["plugin_config"]["impls"]
    hopper = torch.cuda.get_device_capability()[0] == 9  # "auto" takes the Gluon prefill launches there
    assert impls.pop("bank_attention") == ("gluon" if hopper else "triton")
    assert set(impls.values()) == {"triton"}
    llm = LLM(engine)
    assert llm.engine.runner.step_graphs is not None  # decode steps replay CUDA graphs
    got, want = engine_and_transformers(llm, ckpt)
    print(f"\nfloat32 CUDA engine vs transformers on CUDA: {equal_tokens(got, want)}")
    assert got == want


@pytest.mark.parametrize("attention", ["triton", "gluon"])
def test_bf16_cuda_engine_agrees_with_transformers_in_bf16(ckpt, attention):
    """Also with `--attention_plugin gluon` on a Hopper GPU: the 90-token prompt's 32-token chunks reach past
    the extent, so both Gluon launches (the far tiles, the rest joined to them) and the sliding layers' run."""
    if attention == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon launches run on sm_90")
    engine = build(ckpt, config("bfloat16", attention), echo=False)
    assert engine.config["plugin_config"]["impls"]["bank_attention"] == attention
    runner = EngineRunner(engine)
    ref = reference_model(ckpt, torch.bfloat16).cuda()
    H = preset("inkling-tiny").hidden_size
    no_media = (torch.zeros(0, H, dtype=torch.bfloat16, device="cuda"), torch.zeros(0, dtype=torch.long))
    for b, p in enumerate(prompts()[1:]):
        runner.runner.reset_slot(b)
        got = torch.cat([
            runner.run_step([p[s : s + 32]], [s], [no_media], all_logits=True, seq_ids=[b])[0]
            for s in range(0, len(p), 32)
        ]).float()  # fmt: skip
        with torch.no_grad():
            want = ref(input_ids=p[None].cuda()).logits[0].float()
        rel = float((got - want).norm() / want.norm())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        print(f"\nbf16 CUDA engine ({attention} attention) vs transformers bf16, {len(p)} tokens: relative logit "
              f"error {rel:.4f}, top-1 agreement {agree:.3f}")  # fmt: skip
        assert rel < 0.03 and agree > 0.9


def test_nvfp4_cuda_engine_equals_transformers_on_dequantized_experts(tmp_path):
    """A synthetic NVFP4 checkpoint (random codes: the GPU host has no ModelOpt for the converter)."""
    write_checkpoint(tmp_path / "fp4", preset("inkling-tiny", nvfp4=True), seed=11)
    llm = LLM(build(tmp_path / "fp4", config("float32"), echo=False))
    got, want = engine_and_transformers(llm, tmp_path / "fp4")
    print(f"\nNVFP4 float32 CUDA engine vs transformers on the dequantized experts: {got == want}")
    assert got == want


def test_mtp_on_cuda_equals_plain_decoding(ckpt):
    """The real depths drafting on the GPU, verify steps and depths from CUDA graphs: greedy tokens with 1, 4
    and 8 drafts equal plain decoding."""
    llm = LLM(build(ckpt, config("float32"), echo=False))
    ps = prompts()
    plain = [
        o.token_ids
        for o in llm.generate([PromptInput(p) for p in ps], SamplingParams(max_tokens=NEW, ignore_eos=True))
    ]
    for k in (1, 4, 8):
        params = SamplingParams(max_tokens=NEW, ignore_eos=True, num_draft_tokens=k)
        got = [o.token_ids for o in llm.generate([PromptInput(p) for p in ps], params)]
        print(f"\nMTP k={k} on CUDA: equal to plain decoding: {got == plain}")
        assert got == plain


def test_heads_left_behind_catch_up_in_their_graphs(ckpt):
    """Heads left behind by rounds that draft nothing catch up through the catch-up graphs
    (runner.catchup_graphs): one sequence drafts again at its 30th step, the other's ring fills. Its tokens,
    drafts and the heads' positions equal an eager engine's (float32), no catch-up pass runs eager, and no
    bucket is captured while serving."""
    from ..hooks import leave_heads_behind

    engine = build(ckpt, config("float32"), echo=False)
    # drafts by the policy alone (no measured round costs), steps in order (no overlap)
    graphed, got = leave_heads_behind(engine, draft_costs=False, overlap=False)
    eager, want = leave_heads_behind(engine, draft_costs=False, overlap=False, cuda_graphs=False)
    stats = graphed.runner.catchup_graphs.stats
    print(f"\ncatch-up passes graphed {stats.graphed}, eager {stats.eager}; buckets {sorted(stats.buckets)}")
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert [s.drafts for s in got] == [s.drafts for s in want]
    assert [s.head_computed for s in got] == [s.head_computed for s in want]
    assert stats.graphed >= 2 and stats.eager == 0
    assert graphed.runner.graph_stats()["head_captures_while_serving"] == 0

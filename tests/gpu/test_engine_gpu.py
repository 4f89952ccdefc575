"""CUDA engines (Triton plugins) against the reference model on the GPU: `make GPU=1 test-gpu`."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from builder import BuildConfig, Engine, PluginConfig, build
from inkling.model import InklingReference
from runtime import LLM, PromptInput, SamplingParams

from ..engine_runner import EngineRunner, Prompt
from ..hooks import override_drafts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = dict(max_batch_size=4, max_seq_len=256, max_input_len=256, max_num_tokens=512, device="cuda")


@pytest.fixture(scope="module")
def reference(tiny_nvfp4_ckpt_dir):
    return InklingReference.from_pretrained(tiny_nvfp4_ckpt_dir, dtype=torch.float32, device="cuda")


@pytest.fixture(scope="module")
def gpu_prompts():
    g = torch.Generator().manual_seed(0)
    return [Prompt(torch.randint(11, 1000, (n,), generator=g)) for n in (90, 3, 40, 17)]


def _reference_logits(reference, prompt, new):
    ids = torch.cat([prompt.input_ids, torch.tensor(new[:-1], dtype=torch.long)]).cuda()
    with torch.no_grad():
        return reference(ids)[0]


@pytest.mark.parametrize("dtype, rel_tol, agree_min", [("bfloat16", 0.03, 0.9), ("float32", 2e-3, 0.99)])
def test_cuda_engine_matches_reference(
    tiny_nvfp4_ckpt_dir, reference, gpu_prompts, dtype, rel_tol, agree_min, tmp_path
):
    start = time.perf_counter()
    engine = build(
        tiny_nvfp4_ckpt_dir, BuildConfig(dtype=dtype, plugin_config=PluginConfig(tune=False), **SMALL)
    )
    assert engine.config["plugin_config"]["impls"] == {
        "sheared_bias_attention": "triton", "sconv": "triton", "expert_sink_moe": "triton", "mtp_draft": "triton",
    }  # fmt: skip
    build_s = time.perf_counter() - start
    engine.save(tmp_path / "engine")
    start = time.perf_counter()
    engine = Engine.from_dir(tmp_path / "engine")
    load_s = time.perf_counter() - start
    runner = EngineRunner(engine)
    start = time.perf_counter()
    out, logits = runner.generate(gpu_prompts, 6, return_logits=True)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    runner.generate(gpu_prompts, 6)
    warm_s = time.perf_counter() - start
    worst_rel, same_tokens, flips, rows, gaps = 0.0, 0, 0, 0, []
    for b, p in enumerate(gpu_prompts):
        want = _reference_logits(reference, p, out[b])
        worst_rel = max(worst_rel, float((logits[b] - want).norm() / want.norm()))
        differ = logits[b].argmax(-1) != want.argmax(-1)
        top2 = want.topk(2, -1).values
        gaps += (top2[differ, 0] - top2[differ, 1]).tolist()  # reference top-2 gap where the engine flipped
        flips, rows = flips + int(differ.sum()), rows + len(differ)
        greedy = reference.generate(p.input_ids.cuda(), 6, stop_ids=[]).tolist()
        same_tokens += sum(a == b for a, b in zip(out[b], greedy))
    print(
        f"\n[gpu engine {dtype}] build {build_s:.1f} s, load {load_s:.2f} s, first generate (Triton compile) "
        f"{first_s:.1f} s, warm {warm_s:.2f} s; worst rel logit error {worst_rel:.2e}, top-1 agreement "
        f"{1 - flips / rows:.3f} ({flips}/{rows} flipped, reference top-2 gaps there {gaps}), greedy tokens equal "
        f"to reference {same_tokens}/{6 * len(gpu_prompts)}"
    )
    assert worst_rel < rel_tol and 1 - flips / rows >= agree_min
    assert all(g < 20 * rel_tol for g in gaps), "a flipped top-1 where the reference had no near tie"
    # The runtime on the same engine gives the runner's tokens.
    llm = LLM(engine)
    outs = llm.generate(
        [PromptInput(p.input_ids) for p in gpu_prompts], SamplingParams(max_tokens=6, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == out
    # A fresh process loads the saved engine (Triton's disk cache now warm).
    code = (
        "import time,sys; t=time.perf_counter(); from builder import Engine; from tests.engine_runner import EngineRunner, Prompt; import torch\n"
        "e=Engine.from_dir(sys.argv[1]); r=EngineRunner(e); l=time.perf_counter()-t\n"
        "r.generate([Prompt(torch.arange(11, 40))], 2); print(f'fresh process: load {l:.2f} s, first generate {time.perf_counter()-t-l:.2f} s')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "engine")], capture_output=True, text=True
    )
    print(res.stdout.strip(), res.stderr[-500:] if res.returncode else "")
    assert res.returncode == 0


def test_cuda_engine_mtp(tiny_nvfp4_ckpt_dir, reference, gpu_prompts):
    """MTP on the CUDA float32 engine (Triton verify path, head program, mtp_draft kernel): greedy
    output with drafts 0..8 equals plain decoding, with the heads' own drafts and with an oracle that
    forces accepts; the heads' drafts equal the reference chain's."""
    import random

    from runtime import LLMEngine

    engine = build(
        tiny_nvfp4_ckpt_dir, BuildConfig(dtype="float32", plugin_config=PluginConfig(tune=False), **SMALL)
    )

    def run(k_of, override=None):
        eng = LLMEngine(engine)
        override_drafts(eng, override)
        for i, p in enumerate(gpu_prompts * 2):
            params = SamplingParams(max_tokens=12, ignore_eos=True, num_draft_tokens=k_of(i))
            eng.add_request(str(i), PromptInput(p.input_ids), params)
        outs: dict = {}
        while eng.has_unfinished():
            for d in eng.step():
                outs.setdefault(d.request_id, []).extend(d.token_ids)
        return outs, eng

    plain, _ = run(lambda i: 0)
    own, _ = run(lambda i: i)
    assert own == plain
    rng = random.Random(0)
    lens = {str(i): len(p.input_ids) for i, p in enumerate(gpu_prompts * 2)}
    rounds = []

    def oracle(rid, tokens, drafts):
        rounds.append((tokens, drafts))
        truth = (plain[rid][len(tokens) - lens[rid] :] + drafts)[: len(drafts)]
        cut = rng.randint(0, len(truth))
        return truth[:cut] + [(t + 1) % 1000 for t in truth[cut:]]

    forced, eng = run(lambda i: 8 - i, oracle)
    assert forced == plain
    assert eng.acceptance.mean_acceptance_length > 1.5
    agree = sum(reference.draft(torch.tensor(t).cuda(), len(d)) == d for t, d in rounds[:12])
    assert agree >= 11, f"{agree} of 12 draft rounds equal the reference chain"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graphs_match_eager(tiny_nvfp4_ckpt_dir, dtype):
    """Decode/verify steps and MTP head passes replayed from CUDA graphs (runtime/step_graphs.py): the
    greedy tokens of cuda_graphs=True, plain and with 3 drafts, over 8 ragged prompts. A replay is the
    padded bucket run eagerly (pad_eager), bit for bit; against the unpadded eager run float32 is equal
    too, while bf16 may round a real row differently where a GEMM runs at the bucket's row count (printed,
    and most requests must agree). Prints ms per decode step, graphed vs eager, at batch 1 and 8. The engine
    takes 16 sequences, so a batch of 8 with ragged draft counts has room for a padding sequence."""
    from runtime import LLMEngine

    bc = BuildConfig(dtype=dtype, plugin_config=PluginConfig(tune=False), **{**SMALL, "max_batch_size": 16})
    engine = build(tiny_nvfp4_ckpt_dir, bc)
    g = torch.Generator().manual_seed(1)
    prompts = [
        PromptInput(torch.randint(11, 1000, (n,), generator=g)) for n in (90, 3, 40, 17, 5, 64, 33, 12)
    ]

    def run(eng, k: int, batch: int = 8, max_tokens: int = 12) -> list[list[int]]:
        for i, p in enumerate(prompts[:batch]):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_draft_tokens=k)
            eng.add_request(str(i), p, params)
        outs: dict = {str(i): [] for i in range(batch)}
        while eng.has_unfinished():
            for d in eng.step():
                outs[d.request_id].extend(d.token_ids)
        return list(outs.values())

    modes = {
        "eager": dict(cuda_graphs=False, overlap=False),
        "graphed": dict(cuda_graphs=True, overlap=False),
        "graphed+overlap": dict(cuda_graphs=True, overlap=True),  # the default
    }
    for k in (0, 3):
        eager = run(LLMEngine(engine, **modes["eager"]), k)
        padded = run(LLMEngine(engine, pad_eager=True, overlap=False), k)
        graphed_eng = LLMEngine(engine, **modes["graphed"])
        graphed = run(graphed_eng, k)
        stats = graphed_eng.runner.graph_stats()
        agree = sum(a == b for a, b in zip(graphed, eager))
        print(f"\n[cuda graphs {dtype}] k={k}: {stats}; requests equal to eager {agree}/{len(eager)}")
        assert stats["step_graphed"] > 0 and stats["step_captures"] > 0
        assert k == 0 or stats["head_graphed"] > 0
        assert graphed == padded
        assert graphed == eager if dtype == "float32" else agree >= 6
        # Overlapped steps (LLMEngine.step) replay the same graphs: the same tokens, bit for bit.
        overlapped_eng = LLMEngine(engine)
        assert overlapped_eng.overlap and overlapped_eng.runner.step_graphs is not None
        assert run(overlapped_eng, k) == graphed
        print(f"[overlap {dtype}] k={k}: {overlapped_eng.stats.overlapped_steps} overlapped steps")
        assert k or overlapped_eng.stats.overlapped_steps >= 8
    for batch in (1, 8):
        times = {}
        for mode, kw in modes.items():
            eng = LLMEngine(engine, **kw)
            run(eng, 0, batch, 8)  # warm-up: Triton compiles, the buckets are captured
            for i in range(batch):
                eng.add_request(f"timed{i}", prompts[i], SamplingParams(max_tokens=40, ignore_eos=True))
            eng.step()  # the prefill
            torch.cuda.synchronize()
            start, steps = time.perf_counter(), 0
            while eng.has_unfinished():
                eng.step()
                steps += 1
            torch.cuda.synchronize()
            times[mode] = (time.perf_counter() - start) / steps * 1e3
        print(
            f"[cuda graphs {dtype}] batch {batch}: "
            + ", ".join(f"{m} {t:.2f} ms/step" for m, t in times.items())
        )


def test_sampling_and_logprobs_on_the_gpu_overlap(tiny_nvfp4_ckpt_dir):
    """Sampling draws on the logits' device (the request's generator there), and a step whose picks and
    logprobs stay on the GPU is overlapped with the next: with CUDA graphs, sampled requests (temperature,
    top-k, top-p, seeds), greedy ones and logprobs give the same tokens with overlap on and off, and the
    same seed gives the same tokens twice. MTP with sampling (rejection sampling, its own CPU generator)
    runs beside them."""
    from runtime import LLMEngine

    bc = BuildConfig(
        dtype="bfloat16", plugin_config=PluginConfig(tune=False), **{**SMALL, "max_batch_size": 8}
    )
    engine = build(tiny_nvfp4_ckpt_dir, bc)
    g = torch.Generator().manual_seed(2)
    prompts = [PromptInput(torch.randint(11, 1000, (n,), generator=g)) for n in (70, 5, 33, 12, 48, 9)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=12, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=13, ignore_eos=True),
        SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0),
        # MTP (steps with drafts are not overlapped): done early, so that the others overlap after it
        SamplingParams(max_tokens=6, temperature=0.9, seed=14, ignore_eos=True, num_draft_tokens=3),
        SamplingParams(max_tokens=24, ignore_eos=True),
    ]

    def run(overlap: bool) -> tuple[dict, dict, int]:
        eng = LLMEngine(engine, cuda_graphs=True, overlap=overlap)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), p, sp)
        tokens: dict = {}
        logprobs: dict = {}
        while eng.has_unfinished():
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
                logprobs.setdefault(d.request_id, []).extend(d.logprobs or [])
        return tokens, logprobs, eng.stats.overlapped_steps

    plain, plain_lp, none = run(False)
    got, got_lp, overlapped = run(True)
    again, _, _ = run(True)
    print(f"\n[sampling on the GPU] {overlapped} overlapped steps; tokens {got}")
    assert none == 0 and overlapped > 0
    assert [len(got[str(i)]) for i in range(6)] == [p.max_tokens for p in params]
    assert all(0 <= x < engine.model_config.vocab_size for t in got.values() for x in t)
    assert got == plain and again == got
    for rid in ("1", "3"):
        assert len(got_lp[rid]) == 24
        torch.testing.assert_close(torch.tensor(got_lp[rid]), torch.tensor(plain_lp[rid]), rtol=0, atol=1e-4)


def test_moved_program_keeps_its_dynamic_batch(tiny_nvfp4_ckpt_dir, tmp_path):
    """A tensor-parallel rank runs the program exported on cuda:0 on its own GPU (runtime.programs.retarget).
    Moved (here to the same GPU, through the same rewrite), an engine built for one sequence, saved and
    loaded, still takes a batch of one: its export example had two sequences. Also prints what
    torch.export.passes.move_to_device_pass gives in its place (rank 1 of a tp 2 engine so moved failed
    `Guard failed: seq_lens.size()[0] == 2` on 2xH200)."""
    import dataclasses

    from torch.export.passes import move_to_device_pass

    from runtime.programs import retarget

    bc = BuildConfig(
        dtype="bfloat16", plugin_config=PluginConfig(tune=False), **{**SMALL, "max_batch_size": 1}
    )
    build(tiny_nvfp4_ckpt_dir, bc).save(tmp_path / "engine")
    prompt = [Prompt(torch.randint(11, 1000, (21,), generator=torch.Generator().manual_seed(0)))]
    results = {}
    for name, move in (
        ("unmoved", lambda p: p),
        ("retarget", lambda p: retarget(p, "cuda:0", "cuda:0")),
        ("move_to_device_pass", lambda p: move_to_device_pass(p, {"cuda:0": "cuda:0"})),
    ):
        engine = Engine.from_dir(tmp_path / "engine")
        engine = dataclasses.replace(
            engine, programs={**engine.programs, "step": move(engine.programs["step"])}
        )
        try:
            results[name] = EngineRunner(engine).generate(prompt, 4)
        except Exception as exc:  # noqa: BLE001 (a diagnostic: printed, asserted below for ours only)
            results[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(f"\n[moved programs] {results}")
    assert results["retarget"] == results["unmoved"]

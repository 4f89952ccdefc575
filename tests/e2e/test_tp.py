"""Tensor parallelism on the CPU (DESIGN.md "Tensor parallelism"): ranks as processes over gloo.

inkling-tiny has 2 query heads and 1 KV head, so these tests use a small model whose heads divide by 4
(8 query heads, 4 KV heads; 2 layers, one sliding and one full; 2 MTP heads). Engines for tp_size 1, 2
and 4 are built from the same synthetic tensors; tp_size 2 and 4 run as LLMs that start their workers
themselves, and must give tp_size 1's greedy tokens and, within LOGIT_ATOL, its logits (float32: the
ranks' partial sums are added in another order than one GEMM's). Each rank holds 1/N of the output and
MoE sconv states and of the KV cache; where there are fewer KV heads than ranks they are replicated.

On the GPU host (one GPU per rank; tp sizes above the GPU count are skipped), the same tests run the
CUDA engines over NCCL, or the Lamport kernel with INKLING_TP_COLLECTIVES=triton:
    INKLING_TP_DEVICE=cuda python3 -m pytest tests/e2e/test_tp.py
"""

from __future__ import annotations

import os

import pytest
import torch

from builder import BuildConfig, BuildError, Engine, EngineError, PluginConfig, build
from builder.build import arrange_weights
from builder.sharding import DRAFT_LM_HEAD, TensorParallel
from inkling.demo import demo_png, demo_wav
from inkling.synth import iter_synthetic_tensors, synth_config
from inkling.tokenizer import build_tokenizer
from runtime import LLM, LLMEngine, PromptInput, SamplingParams

from ..hooks import Oracle, override_drafts

DEVICE = os.environ.get("INKLING_TP_DEVICE", "cpu")
COLLECTIVES = os.environ.get("INKLING_TP_COLLECTIVES", "auto")
LOGIT_ATOL = 1e-4  # float32 logits of O(1); measured max differences on the CPU are about 1e-6
SIZES = dict(dtype="float32", max_batch_size=4, max_seq_len=256, max_input_len=256, max_num_tokens=512)
MAX_TOKENS = 6


def build_config(tp_size: int) -> BuildConfig:
    plugins = PluginConfig(
        collectives=COLLECTIVES, tune=False
    )  # tuning compiles minutes of variants on the GPU
    return BuildConfig(**SIZES, device=DEVICE, tp_size=tp_size, plugin_config=plugins)


def tp_config(num_kv_heads: int = 4):
    """On the GPU I = 128, so that I / 4 suits the Triton MoE kernel (a multiple of 32)."""
    config, _ = synth_config("inkling-tiny", nvfp4=True, mtp_heads=2)
    return config.replace(
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
        num_hidden_layers=2,
        layer_types=("sliding_attention", "full_attention"),
        moe_intermediate_size=128 if DEVICE == "cuda" else 64,
    )


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory):
    """tp_size -> engine directory, all from the same tensors (seed 0), with the tiny tokenizer."""
    config = tp_config()
    tokenizer = build_tokenizer().to_str()
    out = {}
    for n in (1, 2, 4):
        engine = build(iter_synthetic_tensors(config, 0), build_config(n), config=config, echo=False)
        engine.tokenizer_json = tokenizer
        out[n] = tmp_path_factory.mktemp("engines") / f"tp{n}"
        engine.save(out[n])
    return out


PROMPTS = [
    {"text": "A picture <|image|> and a sound <|audio|>, described:", "images": [demo_png(40, 24)], "audios": [demo_wav(0.5)]},
    PromptInput(torch.randint(11, 1000, (40,), generator=torch.Generator().manual_seed(0))),  # > window (32)
    "Hello there",
]  # fmt: skip
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's logits (rank 0's runner), in order."""
    seen, run = [], llm.engine.runner.run

    def recorded(batch, input_ids=None):
        logits, rows, hidden = run(batch, input_ids)
        seen.append(logits.clone())
        return logits, rows, hidden

    llm.engine.runner.run = recorded
    return seen


def generate(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    """PROMPTS twice: the second time starts on the prefix cache (sconv snapshots restored on every rank)."""
    logits = record_logits(llm)
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    stats = llm.engine.stats
    before = stats.prefill_tokens
    again = llm.generate(PROMPTS[:2], GREEDY)
    assert stats.prefill_tokens - before < sum(o.prompt_tokens for o in again)  # cached blocks were reused
    return outs + [o.token_ids for o in again], logits


@pytest.fixture(scope="module")
def baseline(engine_dirs):
    llm = LLM(engine_dirs[1])
    tokens, logits = generate(llm)
    report = llm.engine.runner.memory_report()
    return tokens, logits, report


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path):
    """inkling-tiny's case (1 KV head) under tp 2: both ranks keep the KV head (its qkvr rows and K/V sconv
    weights), so their KV caches and K/V sconv states are whole, not halves; queries and the o/m sconv
    channels split. lm_head splits by vocabulary rows; with 1025 rows, rank 1's slice ends in a zero row,
    and every rank also keeps the whole lm_head for the MTP heads' draft picks. The heads split as a layer
    does. Tokens and logits still equal tp 1's."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("tp_size 2 needs 2 GPUs")
    config = tp_config(num_kv_heads=1).replace(vocab_size=1025)
    weights, _ = arrange_weights(
        config, iter_synthetic_tensors(config, 0), torch.float32, torch.device("cpu")
    )
    lm_head = weights["lm_head.weight"].clone()
    tp = TensorParallel(config, 2)
    assert (tp.num_heads, tp.num_kv_heads, tp.kv_replicas, tp.vocab_slice) == (4, 1, 2, 513)
    shards = tp.split(weights)
    a, b = shards[0]["lm_head.weight"], shards[1]["lm_head.weight"]
    assert a.shape[0] == b.shape[0] == 513 and torch.equal(torch.cat([a, b])[:1025], lm_head)
    assert not b[512:].any()  # the padding row
    assert all(torch.equal(shard[DRAFT_LM_HEAD], lm_head) for shard in shards)
    head, Im = "mtp.0", config.mtp_intermediate_size // 2
    a, b = shards[0][f"{head}.mlp.gate_proj.weight"], shards[1][f"{head}.mlp.gate_proj.weight"]
    assert a.shape[0] == b.shape[0] == Im and not torch.equal(a, b)  # the heads' FFN: split
    assert torch.equal(shards[0][f"{head}.eh_proj.weight"], shards[1][f"{head}.eh_proj.weight"])  # replicated
    p, q, kv = "model.layers.0.self_attn", config.q_size // 2, config.kv_size
    for name in ("qkvr_proj.weight", "sconv_k.weight", "sconv_v.weight"):
        a, b = shards[0][f"{p}.{name}"], shards[1][f"{p}.{name}"]
        rows = slice(q, q + 2 * kv) if name == "qkvr_proj.weight" else slice(None)
        assert torch.equal(a[rows], b[rows])  # the K/V head, replicated
    assert not torch.equal(shards[0][f"{p}.qkvr_proj.weight"][:q], shards[1][f"{p}.qkvr_proj.weight"][:q])

    runs = {}
    for n in (1, 2):
        engine = build(iter_synthetic_tensors(config, 0), build_config(n), config=config, echo=False)
        engine.tokenizer_json = build_tokenizer().to_str()
        engine.save(tmp_path / f"tp{n}")
        llm = LLM(tmp_path / f"tp{n}")
        logits = record_logits(llm)
        tokens = [o.token_ids for o in llm.generate(PROMPTS[1:], GREEDY)]
        runs[n] = tokens, logits, llm.engine.runner.memory_reports()
        llm.shutdown()
    assert runs[2][0] == runs[1][0]
    assert max(float((a - b).abs().max()) for a, b in zip(runs[2][1], runs[1][1])) < LOGIT_ATOL
    whole = runs[1][2][0]
    for r in runs[2][2]:
        assert r["kv_cache_shape"] == whole["kv_cache_shape"]  # replicated, not split
        assert r["conv_state_channels"][:4] == [128, 128, 128, 128]  # k, v whole (1 head); o, m half of 256


@pytest.fixture(scope="class", params=[2, 4], ids=lambda n: f"tp{n}")
def tp_llm(request, engine_dirs):
    if DEVICE == "cuda" and request.param > torch.cuda.device_count():
        pytest.skip(f"tp_size {request.param} needs {request.param} GPUs")
    llm = LLM(engine_dirs[request.param])
    yield request.param, llm
    llm.shutdown()
    assert all(p.poll() == 0 for p in llm.workers.procs)


class TestTensorParallelLLM:
    """tp 2 and 4 through the LLM (its workers live as long as the class's tests: one tensor-parallel
    LLM per process at a time)."""

    def test_same_tokens_and_logits_as_tp1(self, tp_llm, baseline):
        """Text+image+audio, a prompt longer than the sliding window, a short one; again from the prefix cache."""
        n, llm = tp_llm
        want_tokens, want_logits, _ = baseline
        tokens, logits = generate(llm)
        assert tokens == want_tokens
        assert_same_logits(logits, want_logits, f"tp{n}", "tp1")

    def test_each_rank_holds_its_slice(self, tp_llm, baseline):
        """Measured on the running ranks: output/MoE sconv states, K/V sconv states and the KV cache are 1/N of
        tp1's on every rank (the KV heads divide here), and so are the MTP heads' KV and sconv states: every
        rank runs its share of every head."""
        n, llm = tp_llm
        whole = baseline[2]
        ranks = llm.engine.runner.memory_reports()
        assert [r["rank"] for r in ranks] == list(range(n))
        for r in ranks:
            assert [C * n for C in r["conv_state_channels"]] == whole["conv_state_channels"]
            assert r["conv_state_bytes"] * n == whole["conv_state_bytes"]
            assert r["kv_cache_shape"][2] * n == whole["kv_cache_shape"][2]
            assert r["kv_cache_bytes"] * n == whole["kv_cache_bytes"]
            assert r["num_mtp_heads"] == whole["num_mtp_heads"]
            assert r["head_state_bytes"] * n == whole["head_state_bytes"]
            print(
                f"tp{n} rank {r['rank']}: sconv state channels {r['conv_state_channels']} "
                f"(tp1 {whole['conv_state_channels']}), KV {r['kv_cache_shape']} (tp1 {whole['kv_cache_shape']}), "
                f"weights {r['weight_bytes'] / 1e6:.1f} MB (tp1 {whole['weight_bytes'] / 1e6:.1f} MB)"
            )

    def test_split_heads_draft_what_whole_heads_draft(self, tp_llm, engine_dirs):
        """The heads split over the ranks (attention by head, FFN by slice, partial sums all-reduced) draft
        the tokens tp 1's whole heads draft, round by round."""
        n, llm = tp_llm
        whole = LLM(engine_dirs[1])
        want = drafts_of(whole)
        assert any(d for round_ in want for d in round_)
        assert drafts_of(llm) == want

    def test_mtp_gives_the_same_greedy_tokens(self, tp_llm, baseline):
        """num_draft_tokens 2: the heads' own drafts, then drafts right up to a random cut (accepts and
        rejects, so rollbacks reach every rank). Under tp 2: every rank runs its share of the heads, and every
        rank's pick must give the same drafts (the heads' collectives would hang or the outputs differ if not)."""
        n, llm = tp_llm
        if n != 2:
            pytest.skip("MTP is checked under tp 2")
        want = baseline[0]
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want[:3]
        assert with_oracle_drafts(llm, want[:3]) == want[:3]
        assert 0 < llm.engine.acceptance.acceptance_rate < 1, llm.engine.acceptance.acceptance_rates


def assert_same_logits(logits: list[torch.Tensor], want: list[torch.Tensor], name: str, base: str) -> None:
    """As many steps as `want`, each step's logits within LOGIT_ATOL of its own."""
    assert len(logits) == len(want)
    diff = max(float((a - b).abs().max()) for a, b in zip(logits, want))
    print(f"{name}: {len(logits)} steps, logits max |diff| vs {base} = {diff:.2e}")
    assert diff < LOGIT_ATOL


def drafts_of(llm: LLM) -> list[list[list[int]]]:
    """Every MTP round's drafts (rank 0's `run_heads`) while PROMPTS generate with 2 drafts a step."""
    runner, seen = llm.engine.runner, []
    run = runner.run_heads

    def recorded(work):
        seen.append(run(work))
        return seen[-1]

    runner.run_heads = recorded
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2))
    finally:
        runner.run_heads = run
    return seen


def with_oracle_drafts(llm: LLM, plain: list[list[int]], prompts: list | None = None) -> list[list[int]]:
    """`prompts` (default PROMPTS) with 2 drafts each from an Oracle that knows the plain tokens and cuts
    them at random (accepts and rejects, so rollbacks reach every rank): each request's tokens."""
    prompts = [llm.prepare(p) for p in (PROMPTS if prompts is None else prompts)]
    want = {f"r{i}": tokens for i, tokens in enumerate(plain)}
    override_drafts(
        llm.engine, Oracle(want, {f"r{i}": len(p.input_ids) for i, p in enumerate(prompts)}, 1000)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2)
    try:
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", p, params)
        got: dict[str, list[int]] = {rid: [] for rid in want}
        while llm.engine.has_unfinished():
            for d in llm.engine.step():
                got[d.request_id] += d.token_ids
    finally:
        override_drafts(llm.engine, None)
    return list(got.values())


def test_step_graphs_on_every_rank(engine_dirs, baseline):
    """Decode/verify steps from the (batch, tokens) buckets on both ranks of tp 2: CUDA graphs on the GPU
    (the collectives captured inside), their padding run eagerly on the CPU. The ranks must pad alike or
    their collectives would not meet; greedy tokens equal tp 1's, plain and with MTP drafts cut at random
    (ragged accepted counts, rollbacks on every rank)."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("tp_size 2 needs 2 GPUs")
    llm = LLM(engine_dirs[2], cuda_graphs=DEVICE == "cuda", pad_eager=DEVICE != "cuda")
    try:
        want = baseline[0]
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want[:3]
        assert with_oracle_drafts(llm, want[:3]) == want[:3]
        stats = llm.engine.runner.graph_stats()
        assert stats["step_graphed"] >= 5, stats
    finally:
        llm.shutdown()
    assert all(p.poll() == 0 for p in llm.workers.procs)


def test_overlapped_steps_on_every_rank(engine_dirs, baseline):
    """tp 2 with overlapped steps (opt-in for tensor parallelism): the successor's input ids reach rank 1
    by a broadcast from rank 0's device; tokens and logits equal tp 1's (plain and from the prefix
    cache), and most decode steps overlapped."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("tp_size 2 needs 2 GPUs")
    llm = LLM(engine_dirs[2], overlap=True)
    try:
        tokens, logits = generate(llm)
        want_tokens, want_logits, _ = baseline
        assert tokens == want_tokens and len(logits) == len(want_logits)
        assert max(float((a - b).abs().max()) for a, b in zip(logits, want_logits)) < LOGIT_ATOL
        assert llm.engine.stats.overlapped_steps >= 6, llm.engine.stats
    finally:
        llm.shutdown()
    assert all(p.poll() == 0 for p in llm.workers.procs)


def test_wrong_world_size_is_refused(engine_dirs):
    with pytest.raises(
        EngineError, match="built for tp_size 2, ep_size 1 and runs on exactly 2 ranks, not 4"
    ):
        Engine.from_dir(engine_dirs[2], world_size=4)
    with pytest.raises(EngineError, match="not rank 2"):
        Engine.from_dir(engine_dirs[2], rank=2)
    with pytest.raises(EngineError, match="built for tp_size 1"):
        Engine.from_dir(engine_dirs[1], world_size=2)
    rank1 = Engine.from_dir(engine_dirs[2], rank=1, world_size=2)
    assert sorted(rank1.programs) == ["mtp_head", "step"]  # the encoders run on rank 0 only
    assert any(k.startswith("mtp.0.") for k in rank1.weights)  # its share of the heads
    with pytest.raises(ValueError, match="runs from its directory"):
        LLM(Engine.from_dir(engine_dirs[2]))
    with pytest.raises(ValueError, match="starts its ranks"):
        LLMEngine(Engine.from_dir(engine_dirs[2]))


def test_unshardable_sizes_are_refused():
    config = tp_config()
    with pytest.raises(BuildError, match="tp_size 3 does not divide num_attention_heads"):
        build(iter_synthetic_tensors(config, 0), BuildConfig(**SIZES, tp_size=3), config=config, echo=False)
    with pytest.raises(BuildError, match="not a multiple of 16"):
        TensorParallel(config.replace(moe_intermediate_size=64), 8)  # 64 / 8: NVFP4 scale groups cannot split


def test_triton_serves_a_tp2_engine(engine_dirs, baseline, tmp_path):
    """The `inkling` model's LLM starts the workers of a tp_size 2 engine; a text+image+audio request
    through the ensemble gives tp1's greedy tokens."""
    import base64
    import importlib.util
    import json
    import urllib.request

    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton is not installed (make venv)")
    from model_repo.serve import ServeConfig, TritonServer, free_port

    prompt = PROMPTS[0]
    cfg = ServeConfig(
        engine_dir=str(engine_dirs[2]),
        work_dir=str(tmp_path / "serve"),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    body = {
        "text_input": prompt["text"],
        "max_tokens": MAX_TOKENS,
        "image_data_input": [base64.b64encode(x).decode() for x in prompt["images"]],
        "audio_data_input": [base64.b64encode(x).decode() for x in prompt["audios"]],
    }
    with TritonServer(cfg) as server:
        req = urllib.request.Request(
            f"http://{cfg.http_url}/v2/models/ensemble_unary/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["output_ids"] == baseline[0][0], server.log_tail()

"""Tensor parallelism on the real Inkling, on the CPU (builder/tensor_parallel.py): ranks as processes over
gloo.

Engines for tp_size 1, 2 and 4 are built from one synthetic inkling-tiny checkpoint (NVFP4 routed experts,
the first MoE layer's in BF16 as published) whose experts are 64 wide, so that a quarter still holds whole
NVFP4 scale groups. inkling-tiny has 4 query heads a layer, 1 KV head in its full layers and 2 in its
sliding ones: tp 2 splits the sliding layers' KV heads and replicates the full layers' one, tp 4
replicates both. tp 2 and 4 run as LLMs that start their workers themselves, and must give tp 1's greedy
tokens and, within LOGIT_ATOL, its logits (float32: the ranks' partial sums are added in another order
than one GEMM's).

On the GPU host (one GPU per rank; tp sizes above the GPU count are skipped), the same tests run the CUDA
engines over NCCL, or the Lamport kernel with INKLING_TP_COLLECTIVES=triton:
    INKLING_TP_DEVICE=cuda python3 -m pytest tests/e2e/test_tp.py
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors import safe_open

from builder import BuildConfig, BuildError, Engine, EngineError, PluginConfig, build
from builder.engine import read_engine_config
from builder.tensor_parallel import DRAFT_UNEMBED, UNEMBED, TensorParallel
from inkling.demo import demo_png, demo_wav
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from runtime import LLM, LLMEngine, PromptInput, SamplingParams

from ..hooks import Oracle, override_drafts

DEVICE = os.environ.get("INKLING_TP_DEVICE", "cpu")
COLLECTIVES = os.environ.get("INKLING_TP_COLLECTIVES", "auto")
LOGIT_ATOL = 1e-4  # float32 logits of O(1); measured max differences on the CPU are about 1e-6
MAX_TOKENS = 6
SIZES = dict(
    dtype="float32", device=DEVICE, max_batch_size=4, max_input_len=64, max_seq_len=96, max_num_tokens=48,
    max_draft_len=2,
    # tuning compiles minutes of variants on the GPU
    plugin_config=PluginConfig(collectives=COLLECTIVES, tune=False),
)  # fmt: skip
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
_g = torch.Generator().manual_seed(3)
PROMPTS = [
    {"text": "see <|unused_200054|> hear <|unused_200053|>", "images": [demo_png(50, 30)], "audios": [demo_wav(0.3)]},
    PromptInput(torch.randint(0, 960, (1,), generator=_g)),  # one token
    # past the 16-token window, the 24-token extent and the log-scaling floor (20)
    PromptInput(torch.randint(0, 960, (60,), generator=_g)),
    "Hello there",
]  # fmt: skip


def tp_config():
    """inkling-tiny with experts 64 wide (128 on the GPU, where the Triton MoE wants slices of 32)."""
    c = preset("inkling-tiny", nvfp4=True)
    return c.replace(text=dataclasses.replace(c.text, moe_intermediate_size=128 if DEVICE == "cuda" else 64))


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory):
    """tp_size -> engine directory, all from the same checkpoint (tokenizer included)."""
    ckpt = write_checkpoint(tmp_path_factory.mktemp("tp") / "tiny", tp_config(), seed=7)
    out = {}
    for n in (1, 2, 4):
        out[n] = tmp_path_factory.mktemp("engines") / f"tp{n}"
        build(ckpt, BuildConfig(**SIZES, tp_size=n), echo=False).save(out[n])
    return out


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
    again = llm.generate(PROMPTS[:3], GREEDY)
    assert stats.prefill_tokens - before < sum(o.prompt_tokens for o in again)  # cached blocks were reused
    return outs + [o.token_ids for o in again], logits


@pytest.fixture(scope="module")
def baseline(engine_dirs):
    llm = LLM(engine_dirs[1])
    tokens, logits = generate(llm)
    return tokens, logits, llm.engine.runner.memory_report()


def assert_same_logits(logits: list[torch.Tensor], want: list[torch.Tensor], name: str, base: str) -> None:
    """As many steps as `want`, each step's logits within LOGIT_ATOL of its own."""
    assert len(logits) == len(want)
    diff = max(float((a - b).abs().max()) for a, b in zip(logits, want))
    print(f"{name}: {len(logits)} steps, logits max |diff| vs {base} = {diff:.2e}")
    assert diff < LOGIT_ATOL


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


def skip_without_gpus(n: int) -> None:
    if DEVICE == "cuda" and n > torch.cuda.device_count():
        pytest.skip(f"tp_size {n} needs {n} GPUs")


@pytest.fixture(scope="class", params=[2, 4], ids=lambda n: f"tp{n}")
def tp_llm(request, engine_dirs):
    skip_without_gpus(request.param)
    llm = LLM(engine_dirs[request.param])
    yield request.param, llm
    llm.shutdown()
    assert all(p.poll() == 0 for p in llm.workers.procs)


class TestTensorParallelLLM:
    """tp 2 and 4 through the LLM (its workers live as long as the class's tests: one multi-rank LLM per
    process at a time)."""

    def test_same_tokens_and_logits_as_tp1(self, tp_llm, baseline):
        """Text+image+audio, one token, past the window, the extent and the log-scaling floor, a short
        text; then again from the prefix cache."""
        n, llm = tp_llm
        want_tokens, want_logits, _ = baseline
        tokens, logits = generate(llm)
        assert tokens == want_tokens
        assert_same_logits(logits, want_logits, f"tp{n}", "tp1")

    def test_each_rank_holds_its_share(self, tp_llm, baseline):
        """Measured on the running ranks: the o/m sconv states are 1/N of tp 1's on every rank; the KV
        caches and k/v states hold the rank's KV heads (the sliding layers' 2 split at tp 2, every KV head
        whole where there are fewer than ranks); rank 0 alone holds the MTP depths' state."""
        n, llm = tp_llm
        whole = baseline[2]
        H, D = 64, 16
        kv = {2: (1, 1), 4: (1, 1)}[n]  # KV heads a rank holds: full layers (1 of 1), sliding (1 of 2)
        ranks = llm.engine.runner.memory_reports()
        assert [r["rank"] for r in ranks] == list(range(n))
        for r in ranks:
            sliding, full = r["conv_state_channels"][0:4], r["conv_state_channels"][12:16]  # layers 0 and 3
            assert full == [kv[0] * D, kv[0] * D, H // n, H // n]
            assert sliding == [kv[1] * D, kv[1] * D, H // n, H // n]
            assert sum(r["conv_state_channels"]) < sum(whole["conv_state_channels"])
            assert r["kv_cache_shape"][2] == 1  # the first cache (a full layer's): its one KV head
            assert (r["num_mtp_heads"], r["head_state_bytes"] > 0) == (
                (whole["num_mtp_heads"], True) if r["rank"] == 0 else (0, False)
            )
            print(
                f"tp{n} rank {r['rank']}: sconv state channels (layer 0) {sliding} (tp1 "
                f"{whole['conv_state_channels'][0:4]}), weights {r['weight_bytes'] / 1e6:.2f} MB (tp1 "
                f"{whole['weight_bytes'] / 1e6:.2f} MB)"
            )

    def test_mtp_with_accepts_and_rejects(self, tp_llm, baseline):
        """Rank 0 drafts alone with whole depths and the whole unembedding; the verify steps, their
        rollbacks and the prefix cache reach every rank. The depths' own drafts, then drafts cut at random
        from the plain tokens (accepts and rejects)."""
        n, llm = tp_llm
        if n != 2:
            pytest.skip("MTP is checked under tp 2 (rank 0 drafts alone whatever N)")
        want = baseline[0][: len(PROMPTS)]
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        assert with_oracle_drafts(llm, want) == want
        assert 0 < llm.engine.acceptance.acceptance_rate < 1, llm.engine.acceptance.acceptance_rates


def rank_tensors(engine_dir, rank: int) -> dict[str, torch.Tensor]:
    with safe_open(str(engine_dir / f"rank{rank}.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_rank_files_hold_their_slices(engine_dirs):
    """The engine files: the unembedding's vocabulary, the routed and shared experts' and the dense MLPs'
    widths, the attention projections' query rows at 1/N a rank, put back together they are tp 1's;
    replicated tensors equal; rank 0 alone holds the depths and the whole unembedding."""
    whole = rank_tensors(engine_dirs[1], 0)
    p = "model.llm.layers"
    for n in (2, 4):
        mapping = read_engine_config(str(engine_dirs[n]))["mapping"]
        assert mapping["world_size"] == mapping["tp_size"] == n and mapping["ep_size"] == 1
        ranks = [rank_tensors(engine_dirs[n], r) for r in range(n)]
        assert torch.equal(torch.cat([r[UNEMBED] for r in ranks]), whole[UNEMBED][:1024])
        assert torch.equal(ranks[0][DRAFT_UNEMBED], whole[UNEMBED])
        for name, dim in (
            (f"{p}.3.mlp.experts.w2_weight", 2),  # NVFP4 codes
            (f"{p}.3.mlp.experts.w2_weight.scale", 2),
            (f"{p}.2.mlp.experts.w2_weight", 2),  # the BF16 first MoE layer
            (f"{p}.3.mlp.shared_experts.shared_w2_weight", 2),
            (f"{p}.0.mlp.w2_md.weight", 1),
            (f"{p}.0.attn.wo_ud.weight", 1),
            (f"{p}.0.mlp_sconv.weight", 0),
        ):
            assert torch.equal(torch.cat([r[name] for r in ranks], dim), whole[name]), name
        gate, up = zip(*(r[f"{p}.3.mlp.experts.w13_weight"].chunk(2, 1) for r in ranks))
        assert torch.equal(torch.cat([*gate, *up], 1), whole[f"{p}.3.mlp.experts.w13_weight"])
        for name in (
            f"{p}.3.mlp.gate.weight",
            f"{p}.3.attn.rel_logits_proj.proj",
            f"{p}.3.attn.q_norm.weight",
        ):
            assert all(torch.equal(r[name], whole[name]) for r in ranks), name
        assert all(not any(k.startswith(("mtp.", "model.visual.")) for k in r) for r in ranks[1:])
        assert any(k.startswith("mtp.0.") for k in ranks[0])


def test_unembedding_padding_and_kv_replication():
    """A vocabulary that does not divide: the last rank's slice ends in zero rows, and the slices put
    together are the unpadded rows. Fewer KV heads than ranks: consecutive ranks share a head's rows."""
    c = tp_config()
    c = c.replace(text=dataclasses.replace(c.text, unpadded_vocab_size=1023))
    tp = TensorParallel(c, 4)
    w = torch.randn(1088, 64)
    parts = [tp.shard(UNEMBED, w, r) for r in range(4)]
    assert tp.vocab_slice == 256 and all(x.shape == (256, 64) for x in parts)
    assert torch.equal(torch.cat(parts)[:1023], w[:1023]) and not parts[3][255].any()
    a = c.text.attention(3)  # full: 4 query heads, 1 KV head
    q = torch.randn(a.q_size + 2 * a.kv_size + a.r_size, 64)
    rows = [tp.shard("model.llm.layers.3.attn.wqkvr.weight", q, r) for r in range(4)]
    k = slice(a.head_dim, a.head_dim + 2 * a.kv_size)  # each rank: 1 query head, then the K and V rows
    assert all(torch.equal(x[k], q[a.q_size : a.q_size + 2 * a.kv_size]) for x in rows)
    assert torch.equal(torch.cat([x[: a.head_dim] for x in rows]), q[: a.q_size])


def test_graph_buckets_and_overlapped_steps_on_every_rank(engine_dirs, baseline):
    """tp 2 with decode/verify steps from the (batch, tokens) buckets (CUDA graphs on the GPU, the
    collectives captured inside; their padding run eagerly on the CPU) and overlapped steps (the
    successor's input ids reach rank 1 by a broadcast from rank 0's device). The ranks must pad alike or
    their collectives would not meet: tokens and logits equal tp 1's, plain and from the prefix cache,
    then with MTP drafts cut at random (verify steps of 1 + max_draft_len tokens on a rank without
    depths)."""
    skip_without_gpus(2)
    llm = LLM(engine_dirs[2], cuda_graphs=DEVICE == "cuda", pad_eager=DEVICE != "cuda", overlap=True)
    try:
        tokens, logits = generate(llm)
        want_tokens, want_logits, _ = baseline
        assert tokens == want_tokens
        assert_same_logits(logits, want_logits, "tp2 bucketed and overlapped", "tp1")
        assert llm.engine.stats.overlapped_steps >= 6, llm.engine.stats
        want = want_tokens[: len(PROMPTS)]
        assert with_oracle_drafts(llm, want) == want
        stats = llm.engine.runner.graph_stats()
        assert stats["step_graphed"] >= 5, stats
    finally:
        llm.shutdown()
    assert all(p.poll() == 0 for p in llm.workers.procs)


def test_impossible_mappings_are_refused(engine_dirs, tmp_path):
    ckpt = write_checkpoint(tmp_path / "tiny", preset("inkling-tiny", nvfp4=True), seed=1)
    with pytest.raises(BuildError, match="tp_size 3 does not divide hidden_size"):
        build(ckpt, BuildConfig(**SIZES, tp_size=3), echo=False)
    with pytest.raises(BuildError, match="moe_intermediate_size / tp_size = 8 is not a multiple of 16"):
        build(ckpt, BuildConfig(**SIZES, tp_size=4), echo=False)  # inkling-tiny's experts are 32 wide
    # with expert parallelism on the same ranks the routed experts stay whole: it builds, on 4 ranks
    assert build(ckpt, BuildConfig(**SIZES, tp_size=4, ep_size=4), echo=False).world_size == 4
    with pytest.raises(BuildError, match="tp_size 2 with ep_size 4: .* must be 1 or equal tp_size"):
        build(ckpt, BuildConfig(**SIZES, tp_size=2, ep_size=4), echo=False)
    with pytest.raises(
        EngineError, match="built for tp_size 2, ep_size 1 and runs on exactly 2 ranks, not 4"
    ):
        Engine.from_dir(engine_dirs[2], world_size=4)
    with pytest.raises(EngineError, match="not rank 2"):
        Engine.from_dir(engine_dirs[2], rank=2)
    with pytest.raises(EngineError, match="built for tp_size 1"):
        Engine.from_dir(engine_dirs[1], world_size=2)
    assert sorted(Engine.from_dir(engine_dirs[2], rank=1, world_size=2).programs) == ["step"]
    with pytest.raises(ValueError, match="runs from its directory"):
        LLM(Engine.from_dir(engine_dirs[2]))
    with pytest.raises(ValueError, match="starts its ranks"):
        LLMEngine(Engine.from_dir(engine_dirs[2]))


@pytest.mark.slow  # the workers' path through Triton is in CI by test_expert_parallel's ep 2 engine
def test_triton_serves_a_tp2_engine(engine_dirs, baseline, tmp_path):
    """The `inkling` model's LLM starts the workers of a tp_size 2 engine; a text+image+audio request
    through the ensemble gives tp 1's greedy tokens."""
    import base64
    import importlib.util
    import json
    import urllib.request

    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton is not installed (make venv)")
    from model_repo.serve import ServeConfig, TritonServer, free_port

    skip_without_gpus(2)
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

"""Expert parallelism on the real Inkling, on the CPU (builder/expert_parallel.py): ranks as processes
over gloo.

Engines for ep_size 1, 2 and 4, and for tp_size 2 with ep_size 2 (attention TP with MoE EP on the same
ranks), are built from one synthetic inkling-tiny checkpoint with NVFP4 routed experts (16 of them, 2 shared
of width 32): they run as LLMs that start their workers themselves, and must give ep 1's greedy tokens and, within test_tp.LOGIT_ATOL, its logits (float32: the ranks' partial MoE
sums are added in another order than one rank's). Each rank's file holds 1/N of the routed experts and of
the shared experts' width, and everything else whole.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from builder import BuildConfig, BuildError, Engine, EngineError, PluginConfig, build
from builder.engine import read_engine_config
from builder.expert_parallel import ROUTED, SHARED_W2, SHARED_W13
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from runtime import LLM, PromptInput, SamplingParams
from runtime.expert_load import rank_loads

from .test_tp import assert_same_logits, record_logits, with_oracle_drafts

MAX_TOKENS = 6
TP2EP2 = (
    "tp2ep2"  # attention split over 2 ranks by tensor parallelism, the routed experts by expert parallelism
)
SIZES = dict(
    dtype="float32", device="cpu", max_batch_size=4, max_input_len=64, max_seq_len=96, max_num_tokens=48,
    max_draft_len=2, plugin_config=PluginConfig(moe="reference"),
)  # fmt: skip
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
_g = torch.Generator().manual_seed(3)
# One token; short; past the 16-token window, the 24-token extent and the log-scaling floor (20)
PROMPTS = [PromptInput(torch.randint(0, 960, (n,), generator=_g)) for n in (1, 5, 40, 60)]


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory):
    """ep_size -> engine directory, all from the same checkpoint (tokenizer included)."""
    c = preset("inkling-tiny", nvfp4=True)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("ep") / "tiny", c, seed=7)
    out = {}
    for n in (1, 2, 4):
        out[n] = tmp_path_factory.mktemp("engines") / f"ep{n}"
        build(ckpt, BuildConfig(**SIZES, ep_size=n), echo=False).save(out[n])
    out[TP2EP2] = tmp_path_factory.mktemp("engines") / "tp2ep2"
    build(ckpt, BuildConfig(**SIZES, tp_size=2, ep_size=2), echo=False).save(out[TP2EP2])
    return out


def generate(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    logits = record_logits(llm)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], logits


@pytest.fixture(scope="module")
def baseline(engine_dirs):
    """ep 1's greedy tokens and logits, and its expert load (runtime/expert_load.py)."""
    llm = LLM(engine_dirs[1])
    tokens, logits = generate(llm)
    llm.engine.expert_load_stats(refresh=True)
    return tokens, logits, llm.engine.load.total.copy()


def rank_bytes(engine_dir, rank: int) -> dict[str, int]:
    """A rank file's bytes: its routed experts', its shared experts', the rest."""
    out = {"routed": 0, "shared": 0, "rest": 0}
    with safe_open(str(engine_dir / f"rank{rank}.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            kind = (
                "routed" if ROUTED in name else "shared" if name.endswith((SHARED_W13, SHARED_W2)) else "rest"
            )
            out[kind] += t.numel() * t.element_size()
    return out


def test_each_rank_holds_its_share_of_the_experts(engine_dirs):
    """Measured on the engine files: the routed experts and the shared experts' width at 1/N a rank; rank 0
    holds the rest whole (MTP depths and towers too), the other ranks the step's rest only; the placement
    is recorded."""
    whole = rank_bytes(engine_dirs[1], 0)
    for n in (2, 4):
        mapping = read_engine_config(str(engine_dirs[n]))["mapping"]
        want = {"world_size": n, "tp_size": 1, "ep_size": n, "dp_size": 1, "experts_per_rank": 16 // n}
        assert mapping == want
        for r in range(n):
            got = rank_bytes(engine_dirs[n], r)
            assert got["routed"] * n == whole["routed"] and got["shared"] * n == whole["shared"]
            assert (got["rest"] == whole["rest"]) == (r == 0)
            print(
                f"ep{n} rank {r}: routed {got['routed']} B (ep1 {whole['routed']}), shared {got['shared']} B"
            )
        worker = Engine.from_dir(engine_dirs[n], rank=1, world_size=n)
        assert sorted(worker.programs) == ["step"]
        assert not any(k.startswith(("mtp.", "model.visual.", "model.audio.")) for k in worker.weights)


def test_tp_with_ep_splits_attention_by_heads_and_the_experts_whole(engine_dirs):
    """tp 2 with ep 2 on the same two ranks: each rank holds half the routed experts whole (their bytes
    ep 2's rank files hold, expert for expert) and half of everything tensor parallelism splits (the shared
    experts' width, attention's heads, the dense MLPs, the unembedding); the mapping records both."""
    mapping = read_engine_config(str(engine_dirs[TP2EP2]))["mapping"]
    assert mapping["world_size"] == 2 and mapping["tp_size"] == 2 and mapping["ep_size"] == 2
    assert (
        mapping["experts_per_rank"] == 8
        and mapping["num_attention_heads"] == preset("inkling-tiny").text.num_attention_heads // 2
    )
    whole = rank_bytes(engine_dirs[1], 0)
    for r in range(2):
        got = rank_bytes(engine_dirs[TP2EP2], r)
        assert got["routed"] * 2 == whole["routed"] and got["shared"] * 2 == whole["shared"]
        assert got["rest"] < whole["rest"]  # attention and the rest split, not replicated as under ep alone
        with (
            safe_open(str(engine_dirs[TP2EP2] / f"rank{r}.safetensors"), "pt") as f,
            safe_open(str(engine_dirs[2] / f"rank{r}.safetensors"), "pt") as g,
        ):
            routed = [n for n in f.keys() if ROUTED in n]
            assert routed and all(torch.equal(f.get_tensor(n), g.get_tensor(n)) for n in routed)


@pytest.mark.parametrize("nvfp4", [False, True], ids=["bf16-experts", "nvfp4-experts"])
def test_the_ranks_parts_add_up_to_the_whole_moe(nvfp4):
    """The op on each rank's share (its experts at its offset, its slice of the shared width), summed over
    the ranks, is the one-rank MoE: every routed expert counted once, on its owner."""
    from builder.expert_parallel import ExpertParallel
    from builder.network import engine_tensors
    from inkling.published.synth import iter_tensors
    from plugins.moe import reference

    c = preset("inkling-tiny", nvfp4=nvfp4)
    p = "model.llm.layers.3.mlp"
    w = {n: t for n, t in engine_tensors(c, iter_tensors(c, seed=2), torch.float32) if n.startswith(p)}
    x = torch.randn(37, c.text.hidden_size, generator=torch.Generator().manual_seed(0))
    e, sh, t = f"{p}.experts", f"{p}.shared_experts", c.text
    empty = torch.empty(0)

    def moe(weights, offset=0):
        return reference.sigmoid_sink_moe(
            x, weights[f"{p}.gate.weight"], weights[f"{p}.gate.bias"], weights[f"{p}.gate.global_scale"],
            weights[f"{e}.w13_weight"], weights.get(f"{e}.w13_weight.scale", empty),
            weights.get(f"{e}.w13_weight.scale2", empty), weights[f"{e}.w2_weight"],
            weights.get(f"{e}.w2_weight.scale", empty), weights.get(f"{e}.w2_weight.scale2", empty),
            weights[f"{sh}.shared_w13_weight"], weights[f"{sh}.shared_w2_weight"], t.route_scale,
            t.num_experts_per_tok, offset,
        )  # fmt: skip

    whole = moe(w)
    for n in (2, 4):
        ep = ExpertParallel(c, n)
        parts = [moe(ep.rank_weights(w, r), r * ep.experts_per_rank) for r in range(n)]
        assert all(part.abs().max() > 0 for part in parts)  # each rank's experts are used
        torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="class", params=[2, 4, TP2EP2], ids=lambda n: n if n == TP2EP2 else f"ep{n}")
def ep_llm(request, engine_dirs):
    llm = LLM(engine_dirs[request.param])
    yield request.param, llm
    llm.shutdown()
    assert all(p.poll() == 0 for p in llm.workers.procs)


class TestExpertParallelLLM:
    """ep 2 and 4, and tp 2 with ep 2, through the LLM (its workers live as long as the class's tests: one
    multi-rank LLM per process at a time)."""

    def test_same_tokens_and_logits_as_ep1(self, ep_llm, baseline):
        n, llm = ep_llm
        want_tokens, want_logits, want_load = baseline
        tokens, logits = generate(llm)
        assert tokens == want_tokens
        assert_same_logits(logits, want_logits, n if n == TP2EP2 else f"ep{n}", "ep1")
        # Rank 0 counts every expert's tokens (the router is every rank's), and its ranks' loads follow the
        # placement of E / ep experts a rank
        load = llm.engine.expert_load_stats(refresh=True)
        ep = 2 if n == TP2EP2 else n
        assert (llm.engine.load.total == want_load).all()
        assert (
            load["moe_ep_size"] == ep and load["moe_rank_tokens"] == rank_loads(want_load, ep).sum(0).tolist()
        )
        # Again from the prefix cache (sconv snapshots restored on every rank)
        stats = llm.engine.stats
        before = stats.prefill_tokens
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want_tokens
        assert stats.prefill_tokens - before < sum(len(p.input_ids) for p in PROMPTS)

    def test_mtp_with_accepts_and_rejects(self, ep_llm, baseline):
        """Rank 0 drafts alone; the verify steps, their rollbacks and the prefix cache reach every rank. The
        depths' own drafts, then drafts cut at random from the plain tokens (accepts and rejects)."""
        n, llm = ep_llm
        want = baseline[0]
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        assert with_oracle_drafts(llm, want, PROMPTS) == want
        assert 0 < llm.engine.acceptance.acceptance_rate < 1


def test_preemption_on_every_rank(engine_dirs, baseline):
    """A pool that holds the longest request and little beside it: sequences are preempted and recomputed on every
    rank, and the tokens stay ep 1's."""
    llm = LLM(engine_dirs[2], num_blocks=24)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline[0]
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


def test_impossible_mappings_are_refused(engine_dirs, tmp_path):
    c = preset("inkling-tiny")
    ckpt = write_checkpoint(tmp_path / "tiny", c, seed=1)
    with pytest.raises(BuildError, match="ep_size 3 does not divide n_routed_experts"):
        build(ckpt, BuildConfig(**SIZES, ep_size=3), echo=False)
    with pytest.raises(BuildError, match="tp_size 2 with ep_size 4: .* ep_size must be 1 or equal tp_size"):
        build(ckpt, BuildConfig(**SIZES, tp_size=2, ep_size=4), echo=False)
    with pytest.raises(EngineError, match="tp_size 1, ep_size 2 and runs on exactly 2 ranks, not 4"):
        Engine.from_dir(engine_dirs[2], world_size=4)
    with pytest.raises(ValueError, match="runs from its directory"):
        LLM(Engine.from_dir(engine_dirs[2]))


def test_triton_serves_an_ep2_engine(engine_dirs, tmp_path):
    """The `inkling` model's LLM starts the workers of an ep_size 2 engine; a text request through the
    ensemble gives ep 1's greedy tokens."""
    import importlib.util
    import json
    import urllib.request

    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton is not installed (make venv)")
    from model_repo.serve import ServeConfig, TritonServer, free_port

    text = "Expert parallelism splits the experts, not the tokens."
    want = LLM(engine_dirs[1]).generate([text], GREEDY)[0].token_ids
    cfg = ServeConfig(
        engine_dir=str(engine_dirs[2]),
        work_dir=str(tmp_path / "serve"),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    with TritonServer(cfg) as server:
        req = urllib.request.Request(
            f"http://{cfg.http_url}/v2/models/ensemble_unary/generate",
            data=json.dumps({"text_input": text, "max_tokens": MAX_TOKENS}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["output_ids"] == want, server.log_tail()

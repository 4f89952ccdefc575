"""Data-parallel attention with expert-parallel MoE on the CPU (runtime/data_parallel.py, runtime/data_parallel_front.py): two replicas as
processes over gloo, each with its own requests, caches and scheduler, meeting in every MoE layer.

dp 2 x ep 2 is built from the same synthetic inkling-tiny checkpoint as test_expert_parallel's engines (NVFP4
routed experts) and must give ep 1's greedy tokens, and its log-probabilities within test_tp.LOGIT_ATOL
(float32: the MoE's partial sums are added in another order). The prompts (1, 5, 40 and 60 tokens, past the
window, the extent and the log-scaling floor) spread over both replicas, so their steps have different
token counts and each pads to the other's; one prompt alone leaves a replica with only padding steps.
"""

from __future__ import annotations

import pytest
import torch

from builder import BuildConfig, BuildError, Engine, build
from builder.contracts import StepInputs
from builder.engine import read_engine_config
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from runtime import LLM, PromptInput, SamplingParams
from runtime.data_parallel import pad_step
from runtime.data_parallel_front import Router, merge_stats

from .test_expert_parallel import GREEDY, MAX_TOKENS, PROMPTS, SIZES, rank_bytes
from .test_tp import LOGIT_ATOL

LOGPROBS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory):
    """ "ep1" and "dp2" (dp_size 2 with ep_size 2) from one checkpoint."""
    c = preset("inkling-tiny", nvfp4=True)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("dp") / "tiny", c, seed=7)
    out = {name: tmp_path_factory.mktemp("engines") / name for name in ("ep1", "dp2")}
    build(ckpt, BuildConfig(**SIZES), echo=False).save(out["ep1"])
    build(ckpt, BuildConfig(**SIZES, ep_size=2, dp_size=2), echo=False).save(out["dp2"])
    return out


@pytest.fixture(scope="module")
def baseline(engine_dirs):
    """ep 1's outputs (greedy, with log-probabilities) and its expert load per expert."""
    llm = LLM(engine_dirs["ep1"])
    outs = llm.generate(PROMPTS, LOGPROBS)
    return outs, llm.engine.expert_load_stats(refresh=True)["moe_expert_tokens"]


@pytest.fixture(scope="module")
def dp_llm(engine_dirs):
    llm = LLM(engine_dirs["dp2"])
    yield llm
    llm.shutdown()
    assert all(r.proc.poll() == 0 for r in llm.engine.replicas)  # they stopped together, cleanly


def assert_same_outputs(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    diff = max(
        abs(a - b)
        for g, w in zip(got, want)
        for ga, wa in zip(g.top_logprobs, w.top_logprobs)
        for (_, a), (_, b) in zip(sorted(ga.items()), sorted(wa.items()))
    )
    print(f"dp2: top log-probabilities max |diff| vs ep1 = {diff:.2e}")
    assert diff < LOGIT_ATOL


def test_each_replica_holds_half_the_experts_and_the_rest_whole(engine_dirs):
    """Measured on the files: each rank's routed experts and shared experts' width at 1/2 of ep 1's; the
    rest whole on both ranks, MTP depths included, and both have every program (each replica drafts and
    encodes media for its own requests)."""
    mapping = read_engine_config(str(engine_dirs["dp2"]))["mapping"]
    assert mapping["world_size"] == 2 and mapping["ep_size"] == 2 and mapping["dp_size"] == 2
    whole = rank_bytes(engine_dirs["ep1"], 0)
    for r in range(2):
        got = rank_bytes(engine_dirs["dp2"], r)
        assert got["routed"] * 2 == whole["routed"] and got["shared"] * 2 == whole["shared"]
        assert got["rest"] == whole["rest"]
    one, two = (Engine.from_dir(engine_dirs["dp2"], rank=r, world_size=2) for r in range(2))
    assert sorted(two.programs) == sorted(one.programs) and "vision" in two.programs
    assert any(k.startswith("mtp.") for k in two.weights)


class TestDataParallelLLM:
    def test_same_tokens_and_logprobs_as_ep1(self, dp_llm, baseline):
        want, want_load = baseline
        assert_same_outputs(dp_llm.generate(PROMPTS, LOGPROBS), want)
        stats = dp_llm.engine.cache_stats()
        assert stats["dp_size"] == 2
        # Every replica counts every replica's rows (each routes all of them): the load is ep 1's
        assert stats["moe_expert_tokens"] == want_load

    def test_one_request_leaves_a_replica_stepping_padding(self, dp_llm, baseline):
        want = baseline[0]
        before = dp_llm.engine.cache_stats()["dp_running"]
        assert before == [0, 0]
        got = dp_llm.generate(PROMPTS[3:], LOGPROBS)
        assert_same_outputs(got, want[3:])

    def test_mtp_drafts_verify_and_reject(self, dp_llm, baseline):
        """Each replica drafts with its own depths; verify steps of different sizes pad to each other."""
        want = baseline[0]
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2)
        before = dp_llm.engine.cache_stats()["spec_draft_tokens"]
        assert [o.token_ids for o in dp_llm.generate(PROMPTS, params)] == [o.token_ids for o in want]
        assert dp_llm.engine.cache_stats()["spec_draft_tokens"] > before

    def test_a_conversation_stays_on_its_replica(self, dp_llm, baseline):
        """The next turn (the prompt grown by the answer) goes where the prompt went, and hits its prefix
        cache there."""
        prompt, first = PROMPTS[2], baseline[0][2]
        r = dp_llm.engine.router
        routed = r.pick(prompt.input_ids.tolist())
        r.done(routed)
        hits = dp_llm.engine.cache_stats()["prefix_hit_tokens"]
        turn = PromptInput(torch.cat([prompt.input_ids, torch.tensor(first.token_ids)]))
        assert r.pick(turn.input_ids.tolist()) == routed
        r.done(routed)
        dp_llm.generate([turn], GREEDY)
        assert dp_llm.engine.cache_stats()["prefix_hit_tokens"] - hits >= 32  # the prompt's two whole blocks

    def test_media_prompts_embed_in_the_front(self, dp_llm, engine_dirs):
        """An image and an audio clip through LLM: the front embeds them with the towers' programs and the
        replica gets ep 1's tokens."""
        from tests.unit.test_published_processing import png, wav

        prompt = {
            "text": "Look: <|content_image|><|unused_200054|> and listen: "
            "<|content_audio_input|><|unused_200053|><|audio_end|>.",
            "images": [png(48, 40)],
            "audios": [wav(0.5, 16000)],
        }
        want = LLM(engine_dirs["ep1"]).generate(prompt, GREEDY)[0].token_ids
        assert dp_llm.generate(prompt, GREEDY)[0].token_ids == want

    def test_a_refused_request_harms_nobody(self, dp_llm, baseline):
        with pytest.raises(ValueError, match="max_input_len"):
            dp_llm.generate([PROMPTS[0], PromptInput(torch.zeros(80, dtype=torch.long))], GREEDY)
        assert [o.token_ids for o in dp_llm.generate(PROMPTS[:2], GREEDY)] == [
            o.token_ids for o in baseline[0][:2]
        ]


def test_replicas_replay_buckets_of_the_agreed_size(engine_dirs, baseline):
    """With the step graphs' buckets (run eager here: pad_eager), a replica replays a bucket of exactly the
    agreed token count where one holds its batch, else pads and runs eager; the tokens stay ep 1's, MTP's
    verify steps included."""
    llm = LLM(engine_dirs["dp2"], pad_eager=True)
    try:
        want = [o.token_ids for o in baseline[0]]
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_draft_tokens=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        stats = llm.engine.cache_stats()
        assert stats["step_graphed"] > 0 and stats["step_eager"] > 0  # decode steps bucketed, prefills eager
    finally:
        llm.shutdown()


def test_preemption_in_each_replica(engine_dirs, baseline):
    """Pools that hold a replica's longest request and little beside it: the 40- and 60-token prompts share
    replica 1 (the router alternates), one is preempted and recomputed, and the tokens stay ep 1's."""
    order = [0, 2, 1, 3]
    llm = LLM(engine_dirs["dp2"], num_blocks=22)
    try:
        got = [o.token_ids for o in llm.generate([PROMPTS[i] for i in order], GREEDY)]
        assert got == [baseline[0][i].token_ids for i in order]
        assert llm.engine.cache_stats()["preemptions"] > 0
    finally:
        llm.shutdown()


def test_impossible_data_parallel_mappings_are_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "tiny", preset("inkling-tiny"), seed=1)
    with pytest.raises(BuildError, match="dp_size 2 with ep_size 1 and tp_size 1: .* needs ep_size equal"):
        build(ckpt, BuildConfig(**SIZES, dp_size=2), echo=False)
    with pytest.raises(BuildError, match="dp_size 2 with ep_size 2 and tp_size 2"):
        build(ckpt, BuildConfig(**SIZES, dp_size=2, ep_size=2, tp_size=2), echo=False)


def test_router_affinity_and_load():
    r = Router(2, block_size=4, slack=1)
    a, b = list(range(12)), list(range(100, 112))
    assert r.pick(a) == 0 and r.pick(b) == 1  # least loaded, lowest rank first
    assert r.pick(a + [7, 7, 7, 7]) == 0  # three blocks in common with replica 0's prompt
    assert r.pick([1, 2]) == 1  # no whole block: the least loaded
    assert r.pick(a) == 0 and r.pick(a) == 0  # within the slack: 2, then 3 in flight against 2
    assert r.pick(a) == 1  # past it: replica 0 has 4 in flight, replica 1 only 2
    for _ in range(4):
        r.done(0)
    assert r.load == [0, 3]


def test_pad_step_adds_one_inert_sequence():
    G, MB = 2, 3
    inputs = StepInputs(
        input_ids=torch.tensor([5, 6, 7]),
        mm_embeds=torch.zeros(1, 4),
        mm_positions=torch.tensor([3]),
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([9, 2], dtype=torch.int32),
        block_tables=torch.ones(G, 2, MB, dtype=torch.int32),
        slot_mappings=torch.arange(3).repeat(G, 1),
        state_indices=torch.tensor([0, 1], dtype=torch.int32),
        logits_indices=torch.tensor([0, 2]),
        q_bound=torch.zeros(2, dtype=torch.int8),
    )
    out = pad_step(inputs, 8)
    assert out.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert out.cu_seqlens_q.tolist() == [0, 1, 3, 8] and out.seq_lens.tolist() == [9, 2, 5]
    assert (out.slot_mappings[:, 3:] == -1).all() and out.state_indices.tolist() == [0, 1, -1]
    assert (out.block_tables[:, 2] == 0).all() and out.block_tables.shape == (G, 3, MB)
    assert out.mm_positions.tolist() == [8] and out.q_bound.shape[0] == 5
    assert out.logits_indices.tolist() == [0, 2]
    assert pad_step(inputs, 3) is inputs
    with pytest.raises(ValueError):
        pad_step(inputs, 2)


def test_merged_stats_sum_counters_and_keep_the_latest_load():
    a = {"steps": 3, "moe_routed_choices": 10, "moe_expert_tokens": [1, 2], "running": 1}
    b = {"steps": 4, "moe_routed_choices": 12, "moe_expert_tokens": [2, 2], "running": 0}
    out = merge_stats([a, b])
    assert out["steps"] == 7 and out["moe_expert_tokens"] == [2, 2] and out["dp_running"] == [1, 0]


def test_triton_serves_a_dp2_engine(engine_dirs, baseline, tmp_path):
    """The `inkling` model starts the replicas of a dp_size 2 engine behind their router; two text requests
    through the ensemble give ep 1's greedy tokens."""
    import importlib.util
    import json
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton is not installed (make venv)")
    from model_repo.serve import ServeConfig, TritonServer, free_port

    texts = ["Data-parallel attention keeps each request on one replica.", "Two replicas, one MoE."]
    ep1 = LLM(engine_dirs["ep1"])
    want = [o.token_ids for o in ep1.generate(texts, GREEDY)]
    cfg = ServeConfig(
        engine_dir=str(engine_dirs["dp2"]),
        work_dir=str(tmp_path / "serve"),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )

    def ask(text: str) -> list[int]:
        req = urllib.request.Request(
            f"http://{cfg.http_url}/v2/models/ensemble_unary/generate",
            data=json.dumps({"text_input": text, "max_tokens": MAX_TOKENS}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["output_ids"]

    with TritonServer(cfg) as server:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, texts))
        assert got == want, server.log_tail()

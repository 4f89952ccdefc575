"""The MoE's expert load (runtime/expert_load.py): every token the engine computes counted once per MoE layer
at the experts transformers' router sends it to, in prefill, decode, batches and CUDA-graph-shaped padding
alike; the per-rank loads and imbalance an expert-parallel placement implies; and the figures in the engine's
stats, which Triton's /metrics publishes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.expert_load import ExpertLoad, imbalance, rank_loads


def routed_counts(model, token_ids: list[int]) -> np.ndarray:
    """transformers' choices over one forward of `token_ids`: [MoE layers, E], every router hooked."""
    from transformers.models.inkling.modeling_inkling import InklingTopkRouter

    routers = [m for m in model.modules() if isinstance(m, InklingTopkRouter)]
    counts = np.zeros((len(routers), routers[0].num_experts), dtype=np.int64)

    def hook(i):
        def record(_module, _args, out):
            np.add.at(counts[i], out[2].reshape(-1).numpy(), 1)

        return record

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return counts


def test_the_engine_counts_what_transformers_routes(engine_f32, reference, prompts):
    """A batch of two text prompts (one past the window, extent and floor; one of 3 tokens), greedy: per
    MoE layer and expert, the engine's counts equal transformers' routing of every token each request fed
    (its prompt and its generated tokens but the last), summed over the two."""
    llm = LLM(engine_f32[0])
    texts = [prompts[0], prompts[1]]
    outs = llm.generate(texts, SamplingParams(max_tokens=5))
    stats = llm.engine.expert_load_stats(refresh=True)
    want = sum(
        routed_counts(reference.model, p.input_ids.tolist() + o.token_ids[:-1]) for p, o in zip(texts, outs)
    )
    got = llm.engine.load.total
    assert got.shape == want.shape and (got == want).all(), np.argwhere(got != want)[:5]
    top_k = llm.engine.config.text.num_experts_per_tok
    fed = sum(len(p.input_ids) + 4 for p in texts)
    assert stats["moe_routed_choices"] == fed * top_k * got.shape[0]
    assert stats["moe_expert_tokens"] == want.sum(0).tolist()
    assert stats["moe_rank_tokens"] == [int(want.sum())] and stats["moe_ep_size"] == 1
    assert stats["moe_expert_imbalance"] == pytest.approx(imbalance(want))
    assert llm.engine.runner.read_expert_load().sum() == 0  # the read zeroed the device counters


def test_padding_rows_of_graph_buckets_are_not_counted(engine_f32):
    """pad_eager runs every step in its CUDA-graph bucket's shape (padding rows and sequences added): the
    counts are those of the unpadded engine."""
    plain, padded = LLM(engine_f32[0]), LLM(engine_f32[0], pad_eager=True)
    from inkling.published.processing import Prompt

    prompts = [Prompt(torch.arange(5, 40)), Prompt(torch.arange(100, 107)), Prompt(torch.tensor([9]))]
    params = SamplingParams(max_tokens=6)
    for llm in (plain, padded):
        llm.generate(prompts, params)
        llm.engine.expert_load_stats(refresh=True)
    assert padded.engine.runner.step_graphs is not None  # the padded engine did run bucket shapes
    assert (padded.engine.load.total == plain.engine.load.total).all()


def test_rank_loads_and_imbalance():
    loads = np.array([[4, 0, 2, 2], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert rank_loads(loads, 2).tolist() == [[4, 4], [2, 2], [0, 0]]
    # expert imbalance per layer: 4 / 2 = 2.0 (8 tokens) and 1.0 (4 tokens), weighted: (16 + 4) / 12
    assert imbalance(loads) == pytest.approx(20 / 12)
    assert imbalance(rank_loads(loads, 2)) == pytest.approx(1.0)
    assert imbalance(rank_loads(loads, 4)) == imbalance(loads)
    assert imbalance(np.zeros((2, 4))) == 1.0
    with pytest.raises(ValueError, match="does not divide"):
        rank_loads(loads, 3)
    load = ExpertLoad([2, 3, 4], 4, ep_size=2)
    load.add(loads)
    assert load.window().tolist() == loads.tolist() and not load.window().any()
    s = load.summary()
    assert s["expert_tokens"] == [5, 1, 3, 3] and s["rank_tokens"] == [6, 6] and s["routed_choices"] == 12

"""The runtime over the real Inkling's float32 tiny engine, against transformers token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random

import pytest
import torch

from runtime import LLM, LLMEngine, PromptInput, SamplingParams

from .conftest import SMALL

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def prompt_input(llm: LLM, p) -> PromptInput:
    return llm.embed_media(p)


def reference_greedy(reference, p, n: int) -> list[int]:
    return reference.generate(p, n)


@pytest.fixture
def llm(engine_f32):
    return LLM(engine_f32[0])


def run_all(engine: LLMEngine, max_steps: int = 10_000, outs: dict | None = None) -> dict:
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    assert max_steps < 10_000 or not engine.has_unfinished()
    return outs


def test_batched_greedy_equals_reference(engine_f32, reference, prompts):
    """Ragged lengths, page boundaries, windows exceeded, text+image+audio; a small token budget forces
    chunked prefill, and a request joins while others decode."""
    llm = LLM(engine_f32[0])
    eng = llm.engine
    eng.scheduler.max_num_tokens = 24
    eng.scheduler.chunk_size = 16
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"r{i}", prompt_input(llm, p), GREEDY)
    outs = run_all(eng, max_steps=2)
    eng.add_request("late", prompt_input(llm, prompts[3]), GREEDY)  # joins a running batch
    outs = run_all(eng, outs=outs)
    for rid, p in zip(["r0", "r1", "r2", "late"], prompts):
        assert outs[rid] == reference_greedy(reference, p, 6), rid
    assert eng.stats.steps > 8  # chunks and joins, not one big step


def test_prefix_cache_hit_reuses_blocks_and_keeps_outputs(llm, reference, prompts):
    p = prompt_input(llm, prompts[0])  # 90 tokens: 5 full blocks of 16
    first = llm.generate(p, GREEDY)[0]
    computed = llm.engine.stats.prefill_tokens
    second = llm.generate(p, GREEDY)[0]
    assert second.token_ids == first.token_ids == reference_greedy(reference, prompts[0], 6)
    assert llm.engine.blocks.stats["prefix_hits"] == 1
    saved = 2 * computed - llm.engine.stats.prefill_tokens
    assert saved >= 64, f"the second prefill computed only {saved} fewer tokens"


def test_different_images_behind_the_same_text_do_not_share(llm, reference, processor):
    from tests.unit.test_published_processing import png

    text = "<|content_image|><|unused_200054|> What is in this picture? Describe it at length, then stop."
    a = processor(text, [png(64, 64, seed=7)])
    b = processor(text, [png(64, 64, seed=8)])
    assert torch.equal(a.input_ids, b.input_ids)  # same tokens, different pixels
    out_a = llm.generate(llm.embed_media(a), GREEDY)[0].token_ids
    out_b = llm.generate(llm.embed_media(b), GREEDY)[0].token_ids
    assert llm.engine.blocks.stats["prefix_hits"] == 0
    assert out_a == reference.generate(a, 6)
    assert out_b == reference.generate(b, 6)


def test_preemption_under_a_tiny_pool(engine_f32, reference, prompts):
    """24 blocks hold both prompts but not both sequences grown by 40 tokens (the 130-token one needs 21 over
    the full and sliding groups): the newer one is preempted and recomputed, and both still equal the
    reference."""
    llm = LLM(engine_f32[0], num_blocks=24)
    llm.engine.scheduler.chunk_size = 16
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts[:2]):
        llm.engine.add_request(f"r{i}", prompt_input(llm, p), params)
    outs = run_all(llm.engine)
    assert llm.engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts[:2]):
        assert outs[f"r{i}"] == reference_greedy(reference, p, 40)


def test_paced_prefill_beside_a_decoding_request(engine_f32):
    """decode_slowdown: the engine reports each step it completes to the scheduler's pacer, its prefill
    chunks told apart from its decodes; priced as on a GPU (a chunk reads every expert: 4x a decode step),
    the long prompt's chunks take turns with decode-only steps, and both requests' tokens are those of an
    unpaced engine. With overlap, the decode-only steps the pacer will hold to run overlapped, in the same
    pattern."""

    def run(slowdown: float | None, overlap: bool = False) -> tuple[dict, list]:
        eng = LLMEngine(engine_f32[0], decode_slowdown=slowdown, overlap=overlap)
        eng.scheduler.chunk_size = 16
        kinds, overlapped = [], []  # (decoding, prefilling) of each completed step; overlapped steps by then
        if slowdown is not None:
            record = eng.scheduler.record_step

            def priced(batch, seconds):
                assert seconds > 0
                kinds.append((any(not s.prefill for s in batch), any(s.prefill for s in batch)))
                overlapped.append(eng.stats.overlapped_steps)
                record(batch, 4.0 if kinds[-1][1] else 1.0)

            eng.scheduler.record_step = priced
        g = torch.Generator().manual_seed(3)
        eng.add_request("short", PromptInput(torch.randint(8, 200, (5,), generator=g)),
                        SamplingParams(max_tokens=60, ignore_eos=True))  # fmt: skip
        outs = {}
        for _ in range(3):
            for d in eng.step():
                outs.setdefault(d.request_id, []).extend(d.token_ids)
        eng.add_request("long", PromptInput(torch.randint(8, 200, (150,), generator=g)),
                        SamplingParams(max_tokens=4, ignore_eos=True))  # fmt: skip
        return run_all(eng, outs=outs), kinds, overlapped

    plain, _, _ = run(None)
    for overlap in (False, True):
        paced, kinds, overlapped = run(2.0, overlap)
        assert paced == plain and len(paced["long"]) == 4
        mixed = [i for i, k in enumerate(kinds) if k == (True, True)]
        assert len(mixed) == 10  # 150 tokens in chunks of 16 (the last one its own first token's)
        between = kinds[mixed[0] : mixed[-1]]
        assert between.count((True, False)) == 2 * (len(mixed) - 1)  # each chunk's 2 d of excess repaid
        during = overlapped[mixed[-1] - 1] - overlapped[mixed[0]]  # the last chunk samples: it overlaps too
        assert during == (len(mixed) - 1 if overlap else 0)  # the first held step overlaps the second


def test_cancellation_frees_everything(llm, prompts):
    eng = llm.engine
    eng.add_request("a", prompt_input(llm, prompts[0]), SamplingParams(max_tokens=50))
    eng.add_request("b", prompt_input(llm, prompts[1]), SamplingParams(max_tokens=50))
    eng.step()
    eng.step()
    final = eng.abort_request("a")
    assert final.finish_reason == "abort"
    eng.abort_request("b")
    usage = eng.cache_stats()
    assert not eng.has_unfinished() and usage["running"] == 0
    assert usage["free_blocks"] + usage["evictable_blocks"] == usage["total_blocks"]
    assert sorted(eng.scheduler.free_slots) == list(range(SMALL["max_batch_size"]))


def test_rollback_equals_never_having_had_the_tokens(llm, prompts):
    p = prompt_input(llm, prompts[0])
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    want = llm.generate(p, params)[0]
    eng = llm.engine
    eng.add_request("x", p, params)
    got, logprobs = [], []
    rolled = False
    while eng.has_unfinished():
        for d in eng.step():
            got += d.token_ids
            logprobs += d.logprobs
        if len(got) == 9 and not rolled:  # forget 4 generated tokens (3 of them computed), then go on
            eng.rollback("x", 4)
            del got[-4:], logprobs[-4:]
            rolled = True
    assert rolled and got == want.token_ids
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)


def test_seeded_sampling_is_reproducible(llm, prompts):
    p = prompt_input(llm, prompts[1])
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    a = llm.generate([p, p], [params, SamplingParams(max_tokens=3)])[0].token_ids
    b = llm.generate(p, params)[0].token_ids  # alone, not batched: same draws
    c = llm.generate(p, SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_stop_strings_and_tokens(llm, prompts):
    p = prompt_input(llm, prompts[0])
    full = llm.generate(p, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_tok = full.token_ids[3]
    out = llm.generate(p, SamplingParams(max_tokens=10, stop_token_ids=(stop_tok,)))[0]
    assert (
        out.finish_reason == "stop" and out.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    )
    piece = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    if piece.strip():
        cut = llm.generate(p, SamplingParams(max_tokens=10, stop=(piece,), ignore_eos=True))[0]
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(piece)]


def test_stream_equals_generate(llm, prompts):
    p = prompt_input(llm, prompts[2])
    whole = llm.generate(p, GREEDY)[0]

    async def collect():
        return [d async for d in llm.stream(p, GREEDY)]

    deltas = asyncio.run(collect())
    assert "".join(d.text for d in deltas) == whole.text
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 6
    m = deltas[-1].metrics
    assert 0 < m["ttft_s"] <= m["e2e_s"] and m["itl_s"] > 0 and m["tokens_per_s"] > 0
    assert whole.metrics["tokens_per_s"] > 0 and llm.engine.metrics()["mean_ttft_s"] > 0
    # Deltas merged (how the Triton model coalesces a request's queued deltas) give the whole.
    merged = functools.reduce(lambda a, b: a.merge(b), deltas)
    assert (merged.text, merged.token_ids, merged.finish_reason) == (whole.text, whole.token_ids, "length")
    assert merged.completion_tokens == 6 and merged.metrics == deltas[-1].metrics
    with pytest.raises(ValueError, match="cannot merge"):
        deltas[0].merge(dataclasses.replace(deltas[1], request_id="other"))


def test_invalid_requests_get_clear_errors(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request("e", PromptInput(torch.zeros(0, dtype=torch.long)), GREEDY)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add_request("e", PromptInput(torch.ones(10, dtype=torch.long)), SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="token ids must lie"):
        eng.add_request("e", PromptInput(torch.tensor([5, 99999])), GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert not eng.has_unfinished()


def test_soak_random_requests_and_cancellations(llm):
    """Hundreds of short random requests, a third cancelled at random points: every block ends free."""
    eng = llm.engine
    rng = random.Random(0)
    live: set[str] = set()
    n = 240
    for i in range(n):
        ids = torch.tensor([rng.randrange(0, 960) for _ in range(rng.randrange(1, 40))])
        params = SamplingParams(max_tokens=rng.randrange(1, 5), temperature=rng.choice([0.0, 0.8]), seed=i)
        eng.add_request(f"s{i}", PromptInput(ids), params)
        live.add(f"s{i}")
        if rng.random() < 0.5:
            for d in eng.step():
                if d.finish_reason:
                    live.discard(d.request_id)
        if rng.random() < 0.33 and live:
            victim = rng.choice(sorted(live))
            eng.abort_request(victim)
            live.discard(victim)
    run_all(eng)
    usage = eng.cache_stats()
    assert usage["running"] == usage["waiting"] == 0
    assert usage["free_blocks"] + usage["evictable_blocks"] == usage["total_blocks"]
    assert sorted(eng.scheduler.free_slots) == list(range(SMALL["max_batch_size"]))


def test_engine_says_its_cache_capacity_at_start_up(engine_f32, caplog):
    """At start-up the engine logs its block pool, its bytes and the sequences of max_seq_len it serves at
    once; the default pool serves a whole batch of them."""
    import logging

    with caplog.at_level(logging.INFO, logger="runtime.engine"):
        llm = LLM(engine_f32[1])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    eng, bc = llm.engine, llm.engine.build
    per_seq = eng.blocks.peak_blocks(bc.max_seq_len, eng.scheduler.chunk_size)
    peaks = eng.blocks.pool_peaks(bc.max_seq_len, eng.scheduler.chunk_size)
    at_once = min(size // peak for size, peak in zip(eng.blocks.pool_sizes, peaks))
    full, sliding = eng.blocks.pool_sizes  # a pool per attention kind
    assert (
        f"{eng.blocks.num_blocks} blocks ({full}+{sliding} by kind) of {bc.tokens_per_block} tokens" in line
    )
    assert f"{at_once} sequences of max_seq_len {bc.max_seq_len} at once ({per_seq} blocks each)" in line
    assert at_once >= bc.max_batch_size
    kv = sum(
        t.numel() * t.element_size() for t in [*eng.runner.state.key_caches, *eng.runner.state.value_caches]
    )
    assert f"{kv / 2**30:.2f} GiB" in line

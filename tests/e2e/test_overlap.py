"""Overlapped steps (LLMEngine.step): a decode step launched before the host has read the previous one's
tokens must change nothing a user sees. The float32 tiny engine runs the same request scripts with
overlap off and on (on the CPU the device work is synchronous, but the bookkeeping is the same: the
successor step is built from picks still "on the device", sequences that finish or are aborted while
it is in flight are dropped from it, blocks are settled one step later)."""

from __future__ import annotations

import random

import pytest
import torch

from builder import BuildConfig, build
from runtime import LLM, PromptInput, SamplingParams

from .conftest import SMALL
from .test_runtime import prompt_input, reference_greedy, run_all


def script(llm: LLM, prompts, stop_token: int | None) -> tuple[dict, dict, dict]:
    """Requests that join, finish by length, stop token and stop string, sample (drawn on the device,
    so it overlaps too), ask for logprobs, and one aborted after its fifth token (with overlap, while its next step
    runs); 60 calls of step(). Returns each request's tokens, finish reasons, text and logprobs. (A request that
    joins while a step is in flight is admitted one call later with overlap: the outputs, not the
    calls, are compared.)"""
    eng = llm.engine
    inputs = [prompt_input(llm, p) for p in prompts]
    greedy = dict(ignore_eos=True)
    plan = {
        0: [("long", inputs[0], SamplingParams(max_tokens=40, **greedy))],  # > window and R, crosses pages
        1: [("media", inputs[2], SamplingParams(max_tokens=12, **greedy))],
        3: [("stop", inputs[1], SamplingParams(max_tokens=25, stop_token_ids=(stop_token,) if stop_token else ())),
            ("logprobs", inputs[1], SamplingParams(max_tokens=8, logprobs=0, **greedy)),
            ("sampled-logprobs", inputs[3], SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=0,
                                                           **greedy))],
        12: [("sampled", inputs[1], SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True))],
        20: [("aborted", inputs[3], SamplingParams(max_tokens=30, **greedy)),
             ("text", inputs[1], SamplingParams(max_tokens=9, stop=("zz",), **greedy))],
    }  # fmt: skip
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    texts: dict[str, str] = {}
    logprobs: dict[str, list[float]] = {}
    for call in range(60):
        for rid, p, params in plan.get(call, []):
            eng.add_request(rid, p, params)
        if len(tokens.get("aborted", [])) >= 5 and "aborted" not in reasons:
            reasons["aborted"] = eng.abort_request("aborted").finish_reason
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
            if d.logprobs is not None:
                logprobs.setdefault(d.request_id, []).extend(d.logprobs)
            if d.finish_reason:
                reasons.setdefault(d.request_id, d.finish_reason)
    run_all(eng)
    return tokens, reasons, texts, logprobs


def assert_all_free(llm: LLM) -> None:
    usage = llm.engine.cache_stats()
    assert usage["running"] == usage["waiting"] == 0 and not llm.engine.has_unfinished()
    assert usage["free_blocks"] + usage["evictable_blocks"] == usage["total_blocks"]
    assert sorted(llm.engine.scheduler.free_slots) == list(range(SMALL["max_batch_size"]))


def test_overlapped_steps_change_no_output(engine_f32, reference, prompts):
    plain = LLM(engine_f32[0], overlap=False)
    probe = LLM(engine_f32[0], overlap=False)
    probe = probe.generate(prompt_input(plain, prompts[1]), SamplingParams(max_tokens=25, ignore_eos=True))[0]
    stop_token = probe.token_ids[7]  # the "stop" request ends at its first occurrence, mid-decode
    want = script(plain, prompts, stop_token)
    assert plain.engine.stats.overlapped_steps == 0
    llm = LLM(engine_f32[0], overlap=True)
    got = script(llm, prompts, stop_token)
    assert got[:3] == want[:3]
    # Logprobs within float32 rounding: a request that joins during an overlapped step is admitted a
    # step later, so some steps batch other sequences, and the CPU's GEMMs round by batch shape.
    assert got[3].keys() == want[3].keys()
    for rid in want[3]:
        torch.testing.assert_close(torch.tensor(got[3][rid]), torch.tensor(want[3][rid]), rtol=0, atol=1e-5)
    assert want[1]["stop"] == "stop" and want[1]["aborted"] == "abort" and len(want[0]["long"]) == 40
    assert len(want[0]["aborted"]) == 5
    assert want[0]["long"] == reference_greedy(reference, prompts[0], 40)
    assert len(want[3]["logprobs"]) == len(want[3]["sampled-logprobs"]) == 8
    # The overlap really ran: 27 of the 41 steps (sampling and logprobs included; not prefills or joins).
    assert llm.engine.stats.overlapped_steps >= 24, llm.engine.stats
    assert llm.engine.stats.generated_tokens == plain.engine.stats.generated_tokens
    assert_all_free(llm)


def test_overlapped_steps_have_the_same_layout_and_logits(engine_f32, prompts):
    """Every step of a run with overlap has the batch layout (sequences, order, positions) and the logits
    of the same step without overlap, bit for bit: prompts that finish their prefill in different steps
    (the oldest, 90 tokens in chunks of 16 under a budget of 24, ends its prompt in a step where the
    short one decodes first) still decode oldest first."""

    def run(overlap: bool) -> list:
        llm = LLM(engine_f32[0], overlap=overlap)
        eng = llm.engine
        eng.scheduler.max_num_tokens, eng.scheduler.chunk_size = 24, 16
        steps, run = [], eng.runner.run

        def recorded(batch, input_ids=None):
            logits, rows, hidden = run(batch, input_ids)
            steps.append(([(s.seq.request_id, s.start, s.num_tokens) for s in batch], logits.clone()))
            return logits, rows, hidden

        eng.runner.run = recorded
        for i, p in enumerate(prompts[:2]):  # r1 with logprobs, from the device in overlapped steps
            params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0 if i else None)
            eng.add_request(f"r{i}", prompt_input(llm, p), params)
        logprobs = []
        while eng.has_unfinished():
            logprobs += [x for d in eng.step() for x in d.logprobs or []]
        return steps, eng.stats.overlapped_steps, logprobs

    plain, _, plain_logprobs = run(False)
    got, overlapped, logprobs = run(True)
    assert [layout for layout, _ in got] == [layout for layout, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, plain))
    assert logprobs == plain_logprobs and len(logprobs) == 10
    assert overlapped >= 8
    assert ("r1", 7, 1) in plain[5][0] and ("r0", 80, 10) in plain[5][0]  # r0's last chunk after r1


@pytest.fixture(scope="module")
def engine_no_drafts(pub_ckpt_dir):
    """max_draft_len 0: the sconv history holds K-1 rows only, so a block is a restore point only if
    registered when the caches hold exactly up to its end (counting the step in flight)."""
    return build(pub_ckpt_dir, BuildConfig(dtype="float32", max_draft_len=0, **SMALL), echo=False)


@pytest.mark.parametrize("which", ["max_draft_len 8", "max_draft_len 0"])
def test_blocks_registered_under_overlap_restore_exactly(which, engine_f32, engine_no_drafts, prompts):
    """Blocks settled while a successor step was in flight (their sconv snapshots queued behind it)
    serve a continuation through the prefix cache: its logprobs equal those of the engine without
    overlap, and as many prompt tokens are skipped."""
    engine = engine_f32[0] if which.endswith("8") else engine_no_drafts
    p = prompts[0]
    outs = {}
    for overlap in (False, True):
        llm = LLM(engine, overlap=overlap)
        first = llm.generate(prompt_input(llm, p), SamplingParams(max_tokens=40, ignore_eos=True))[0]
        follow = PromptInput(torch.tensor(list(p.input_ids.tolist()) + first.token_ids[:-1]))  # text only
        computed = llm.engine.stats.prefill_tokens
        params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
        second = llm.generate(follow, params)[0]
        hits = llm.engine.blocks.stats["prefix_hits"]
        outs[overlap] = (first.token_ids, second.token_ids, second.logprobs, hits)
        saved = len(follow.input_ids) - (llm.engine.stats.prefill_tokens - computed)
        assert hits >= 1 and saved >= 96, (
            overlap,
            hits,
            saved,
        )  # decoded blocks were reused, not only the prompt's
    assert outs[True][:2] == outs[False][:2] and outs[True][3:] == outs[False][3:]
    torch.testing.assert_close(torch.tensor(outs[True][2]), torch.tensor(outs[False][2]), rtol=0, atol=1e-5)


def test_rollback_completes_the_step_in_flight(engine_f32, prompts):
    plain = LLM(engine_f32[0], overlap=False)
    p = prompt_input(plain, prompts[0])
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    want = plain.generate(p, params)[0].token_ids
    llm = LLM(engine_f32[0], overlap=True)
    eng = llm.engine
    eng.add_request("x", p, params)
    got, rolled = [], False
    while eng.has_unfinished():
        for d in eng.step():
            got += d.token_ids
        if len(got) == 9 and not rolled:
            assert eng._inflight is not None  # the step after the ninth token is running
            eng.rollback("x", 4)  # completes it (its token is held for the next step()), then forgets 4
            rolled = True
            got = got[:5]
    assert rolled and got == want
    assert_all_free(llm)


def test_soak_with_overlap(engine_f32):
    """Random requests (greedy and sampled) and cancellations: every request not cancelled gives the
    tokens it gives without overlap; a cancelled one a prefix of them (how far it got depends on the
    calls); every block and slot ends free. The script's random choices do not depend on the engine."""

    def soak(overlap: bool) -> tuple[dict, set, int]:
        llm = LLM(engine_f32[0], overlap=overlap)
        eng = llm.engine
        rng = random.Random(1)
        outs: dict[str, list[int]] = {}
        aborted = set()
        for i in range(80):
            ids = torch.tensor([rng.randrange(11, 1000) for _ in range(rng.randrange(1, 40))])
            temperature = rng.choice([0.0, 0.0, 0.0, 0.8])
            params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=temperature, seed=i)
            eng.add_request(f"s{i}", PromptInput(ids), params)
            for _ in range(rng.randrange(0, 4)):
                for d in eng.step():
                    outs.setdefault(d.request_id, []).extend(d.token_ids)
            victim = f"s{rng.randrange(0, i + 1)}"
            if rng.random() < 0.3 and victim in eng.requests:
                eng.abort_request(victim)
                aborted.add(victim)
        run_all(eng, outs=outs)
        assert_all_free(llm)
        return outs, aborted, eng.stats.overlapped_steps

    plain, plain_aborted, _ = soak(False)
    got, got_aborted, overlapped = soak(True)
    assert overlapped >= 15, overlapped  # 22: requests keep arriving
    for rid in (f"s{i}" for i in range(80)):
        want, have = plain.get(rid, []), got.get(rid, [])
        if rid in plain_aborted | got_aborted:
            n = min(len(want), len(have))
            assert want[:n] == have[:n], rid
        else:
            assert have == want, rid
    assert len(plain_aborted | got_aborted) >= 5

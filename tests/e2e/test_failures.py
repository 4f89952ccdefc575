"""Failure isolation: an exception while one request is served (its step, drafting, sampling, detokenizing)
ends that request with finish_reason "error" and frees its blocks and slot, while the requests beside it
keep exactly the tokens they get without the failure, and the engine, LLM, EngineLoop and EngineProcess
(the Triton model's engine) go on serving.

Failures are injected by wrapping the engine's own methods on the instance (no hook in the engine):
each raises only when the request named "bad" is in the work it is given."""

from __future__ import annotations

import os
import queue
import sys
import textwrap

import pytest
import torch

from runtime import LLM, EngineLoop, LLMEngine, PromptInput, SamplingParams
from runtime.engine_process import EngineProcess

BAD = "bad"


class Injected(RuntimeError):
    pass


def _requests(drafts: int = 0) -> list[tuple[str, PromptInput, SamplingParams]]:
    """Five requests of ragged lengths (one longer than the window, one of a single token), the failing
    one in the middle; greedy and seeded sampling without drafts, greedy with them. (A recomputed sampled
    MTP request keeps its distribution but not its draws: the recompute samples the token its verify
    would have drawn with the rejection sampler's generator, as after any preemption.)"""
    g = torch.Generator().manual_seed(7)
    lens = {"r0": 70, "r1": 9, BAD: 21, "r3": 1, "r4": 33}
    out = []
    for i, (rid, n) in enumerate(lens.items()):
        temperature = 1.0 if not drafts and i % 2 else 0.0
        params = SamplingParams(
            max_tokens=8, temperature=temperature, seed=100 + i, ignore_eos=True, num_draft_tokens=drafts
        )
        out.append((rid, PromptInput(torch.randint(11, 1000, (n,), generator=g)), params))
    return out


def _engine(engine_f32) -> LLMEngine:
    eng = LLMEngine(engine_f32[0])
    eng.scheduler.max_num_tokens = 48  # chunked prefill beside decodes
    eng.scheduler.chunk_size = 16
    return eng


def _run(eng: LLMEngine, requests) -> tuple[dict[str, list[int]], dict]:
    finals = {}
    outs: dict[str, list[int]] = {}
    for rid, p, params in requests:
        eng.add_request(rid, p, params)
    while eng.has_unfinished():
        for d in eng.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                finals[d.request_id] = d
    return outs, finals


def _assert_clean(eng: LLMEngine) -> None:
    """Nothing of any request is left: every block is free or held only by prefix-cache entries, every
    state slot is free."""
    usage = eng.blocks.usage()
    assert usage["used_blocks"] == usage["evictable_blocks"], usage
    assert sorted(eng.scheduler.free_slots) == list(range(eng.build.max_batch_size))
    assert not eng.requests and not eng.scheduler.running and not eng.scheduler.waiting


def _step_failure(eng: LLMEngine, after: int = 2, bad: str = BAD):
    """The step program fails in any batch holding request `bad` from its `after`-th such step on."""
    run, seen = eng.runner.run, [0]

    def failing(batch, input_ids=None):
        if any(s.seq.request_id == bad for s in batch):
            seen[0] += 1
            if seen[0] >= after:
                raise Injected("step program failed")
        return run(batch, input_ids)

    eng.runner.run = failing


def _sampling_failure(eng: LLMEngine):
    sample = eng._sample

    def failing(s, *args):
        if s.seq.request_id == BAD and s.seq.output_ids:
            raise Injected("sampler failed")
        return sample(s, *args)

    eng._sample = failing


def _detok_failure(eng: LLMEngine):
    detok = eng.requests[BAD].detok
    add = detok.add

    def failing(ids):
        if len(detok.ids) >= 2:
            raise Injected("detokenizer failed")
        return add(ids)

    detok.add = failing


def _drafting_failure(eng: LLMEngine):
    run_heads = eng.runner.run_heads

    def failing(work):
        if any(w.seq.request_id == BAD and w.num_drafts for w in work):
            raise Injected("MTP heads failed")
        return run_heads(work)

    eng.runner.run_heads = failing


@pytest.fixture(scope="module")
def clean(engine_f32):
    """The tokens of every request without a failure (plain and with 2 MTP drafts)."""
    return {
        drafts: _run(_engine(engine_f32), _requests(drafts=drafts))[0]
        for drafts in (0, 2)  # fmt: skip
    }


@pytest.mark.parametrize(
    "inject, stage, drafts",
    [
        (_step_failure, "its step", 0),
        (_sampling_failure, "sampling", 0),
        (_detok_failure, "sampling", 0),
        (_drafting_failure, "drafting", 2),
    ],
    ids=["step", "sampling", "detokenizing", "drafting"],
)
def test_a_failing_request_harms_no_other(engine_f32, clean, inject, stage, drafts):
    eng = _engine(engine_f32)
    requests = _requests(drafts=drafts)
    if inject is _detok_failure:
        for rid, p, params in requests:
            eng.add_request(rid, p, params)
        inject(eng)
        requests = []
    else:
        inject(eng)
    outs, finals = _run(eng, requests)
    assert finals[BAD].finish_reason == "error" and stage in finals[BAD].error
    assert "Injected" in finals[BAD].error
    for rid, want in clean[drafts].items():
        if rid != BAD:
            assert finals[rid].finish_reason == "length" and outs[rid] == want, rid
    assert eng.stats.failed_requests == 1
    _assert_clean(eng)
    # The engine goes on: the same requests again, now without the failing one's fault, give clean tokens.
    for name in ("run", "run_heads"):
        eng.runner.__dict__.pop(name, None)
    eng.__dict__.pop("_sample", None)
    again, _ = _run(eng, _requests(drafts=drafts))
    assert again == clean[drafts]
    _assert_clean(eng)


def test_a_batch_failure_isolates_its_requests(engine_f32, clean):
    """A step that fails in a batch of several: each of its sequences recomputes alone up to where the
    batch failed, so the step that fails again alone names the request at fault; requests waiting beside
    them are admitted after."""
    eng = _engine(engine_f32)
    _step_failure(eng, after=4)  # past the prompts: every request is decoding in the failing batch
    outs, finals = _run(eng, _requests())
    assert finals[BAD].finish_reason == "error"
    assert eng.scheduler.num_preemptions >= 4  # the batch's sequences, recomputed
    assert {rid: outs[rid] for rid in outs if rid != BAD} == {k: v for k, v in clean[0].items() if k != BAD}
    _assert_clean(eng)


def test_llm_stays_usable(engine_f32, clean):
    """LLM.generate returns the failed request's error beside the others' outputs; an engine-wide fault
    (the scheduler's) aborts generate's requests before it propagates, and the next generate works."""
    llm = LLM(engine_f32[0])
    requests = _requests()
    _step_failure(llm.engine, bad="gen-2")  # LLM names requests gen-0, gen-1, ...: the third is "bad"
    outs = llm.generate([p for _, p, _ in requests], [params for _, _, params in requests])
    by_id = dict(zip([rid for rid, _, _ in requests], outs))
    assert by_id[BAD].finish_reason == "error" and "step program failed" in by_id[BAD].error
    assert all(by_id[rid].token_ids == clean[0][rid] for rid in by_id if rid != BAD)
    schedule, calls = llm.engine.scheduler.schedule, [0]

    def broken(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise Injected("scheduler failed")
        return schedule(*a, **k)

    llm.engine.scheduler.schedule = broken
    with pytest.raises(Injected):
        llm.generate([p for _, p, _ in requests[:2]], [params for _, _, params in requests[:2]])
    _assert_clean(llm.engine)
    again = llm.generate([p for _, p, _ in requests[:2]], [params for _, _, params in requests[:2]])
    assert [o.token_ids for o in again] == [clean[0]["r0"], clean[0]["r1"]]


def test_engine_loop_survives_an_engine_fault(engine_f32, clean):
    loop = EngineLoop(engine_f32[0])
    try:
        schedule, calls = loop.engine.scheduler.schedule, [0]

        def broken(*a, **k):
            calls[0] += 1
            if calls[0] == 2:
                raise Injected("scheduler failed")
            return schedule(*a, **k)

        got: queue.Queue = queue.Queue()
        rid, p, params = _requests()[0]
        loop.submit("first", p, params, got.put)
        loop.engine.scheduler.schedule = broken
        while (d := got.get(timeout=60)).finish_reason is None:
            pass
        assert d.finish_reason == "error" and "engine failure" in d.error
        loop.submit("second", p, params, got.put)
        tokens = []
        while (d := got.get(timeout=60)).finish_reason is None or d.request_id != "second":
            tokens += d.token_ids
        assert tokens + d.token_ids == clean[0][rid]
    finally:
        loop.shutdown()


INJECT = """
# Test-only: loaded by the EngineProcess child through PYTHONPATH (tests/e2e/test_failures.py).
import runtime.model_runner as mr

_run = mr.ModelRunner.run


def _failing(self, batch, input_ids=None):
    if any(s.seq.request_id == "bad" for s in batch):
        raise RuntimeError("injected step failure")
    return _run(self, batch, input_ids)


mr.ModelRunner.run = _failing
"""


def test_engine_process_serves_on(engine_f32, clean, tmp_path, monkeypatch):
    """The Triton model's engine (EngineProcess, a child process): a request failing in its step ends
    with an error, the child lives on, and the request beside it and a later one get their tokens."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(INJECT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    ep = EngineProcess(engine_f32[1])
    try:
        got: queue.Queue = queue.Queue()
        requests = {rid: (p, params) for rid, p, params in _requests()}
        for rid in (BAD, "r1"):
            ep.submit(rid, *requests[rid], got.put)
        finals, tokens = {}, {}
        while len(finals) < 2:
            d = got.get(timeout=120)
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                finals[d.request_id] = d
        assert finals[BAD].finish_reason == "error" and "injected step failure" in finals[BAD].error
        assert tokens["r1"] == clean[0]["r1"]
        ep.submit("r4", *requests["r4"], got.put)
        out = []
        while (d := got.get(timeout=120)).finish_reason is None:
            out += d.token_ids
        assert out + d.token_ids == clean[0]["r4"] and ep.alive
    finally:
        ep.shutdown()

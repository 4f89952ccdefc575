"""EngineProcess (runtime/engine_process.py): the engine in a child process, as the Triton stub runs it.

Its deltas equal the in-process LLM's for a ragged batch with media; an abort frees the request's
blocks; a refused request comes back "rejected" while the others go on; a load error, a dead child and
a shutdown with requests in flight each end cleanly."""

from __future__ import annotations

import queue
import signal

import pytest
import torch

from runtime import LLM, PromptInput, SamplingParams, StreamDelta
from runtime.engine_process import EngineGone, EngineProcess

TIMEOUT = 120  # seconds for a delta: the child shares this machine's cores with the test


@pytest.fixture(scope="module")
def llm(engine_f32):
    return LLM(engine_f32[1])


@pytest.fixture(scope="module")
def process(engine_f32):
    ep = EngineProcess(engine_f32[1])
    yield ep
    ep.shutdown()
    assert ep.proc.returncode == 0


def collect(got: queue.Queue, n: int) -> dict[str, StreamDelta]:
    """The deltas of n requests until each has ended, merged per request."""
    out: dict[str, StreamDelta] = {}
    ended = 0
    while ended < n:
        d = got.get(timeout=TIMEOUT)
        out[d.request_id] = d if d.request_id not in out else out[d.request_id].merge(d)
        ended += d.finish_reason is not None
    return out


def held(ep: EngineProcess) -> int:
    s = ep.cache_stats()
    return s["used_blocks"] - s["evictable_blocks"]


def test_deltas_equal_the_in_process_llm(process, llm, prompts):
    """A ragged batch (longer than the window and R, a 3-token prompt, image+audio), greedy, submitted
    together: each request's merged deltas equal LLM.generate's output."""
    inputs = [_prompt_input(llm, p) for p in prompts[:3]]
    params = [SamplingParams(max_tokens=n) for n in (9, 4, 7)]
    expected = llm.generate(inputs, params)
    got: queue.Queue = queue.Queue()
    for i, (prompt, p) in enumerate(zip(inputs, params)):
        process.submit(f"eq-{i}", prompt, p, got.put)
    out = collect(got, len(inputs))
    for i, want in enumerate(expected):
        d = out[f"eq-{i}"]
        assert (d.token_ids, d.text, d.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert d.completion_tokens == len(want.token_ids) and d.prompt_tokens == len(inputs[i].input_ids)


def _prompt_input(llm: LLM, p) -> PromptInput:
    """A processed prompt as the stub gets it: ids and the placeholders' embeddings."""
    return llm.embed_media(p)


def test_abort_frees_the_requests_blocks(process):
    got: queue.Queue = queue.Queue()
    process.submit("long", PromptInput(torch.arange(11, 60)), SamplingParams(max_tokens=200), got.put)
    first = got.get(timeout=TIMEOUT)
    assert first.finish_reason is None and held(process) > 0
    process.abort("long")
    last = collect(got, 1)["long"]
    assert last.finish_reason == "abort"
    assert held(process) == 0 and process.cache_stats()["running"] == 0


def test_a_rejected_request_leaves_the_others_running(process, llm):
    got: queue.Queue = queue.Queue()
    ok = PromptInput(torch.tensor([11, 12, 13]))
    process.submit("ok", ok, SamplingParams(max_tokens=5), got.put)
    process.submit("too-long", PromptInput(torch.tensor([11, 12])), SamplingParams(max_tokens=10**6), got.put)
    process.submit("bad-ids", PromptInput(torch.tensor([11, 10**7])), SamplingParams(max_tokens=2), got.put)
    out = collect(got, 3)
    assert out["too-long"].finish_reason == "rejected" and "max_seq_len" in out["too-long"].error
    assert out["bad-ids"].finish_reason == "rejected" and "token ids" in out["bad-ids"].error
    assert out["ok"].token_ids == llm.generate(ok, SamplingParams(max_tokens=5))[0].token_ids
    process.submit("dup", ok, SamplingParams(max_tokens=50), got.put)
    with pytest.raises(ValueError, match="already in flight"):
        process.submit("dup", ok, SamplingParams(max_tokens=50), got.put)
    process.abort("dup")
    assert collect(got, 1)["dup"].finish_reason in ("abort", "length")


def test_a_load_error_is_raised_with_its_cause(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="could not load"):
        EngineProcess(tmp_path)


def generating(engine_dir, rid: str) -> tuple[EngineProcess, queue.Queue, queue.Queue]:
    """A fresh EngineProcess with request `rid` under way (its first delta out): the process, the
    request's deltas, and the reasons its on_exit got."""
    exits: queue.Queue = queue.Queue()
    ep = EngineProcess(engine_dir, on_exit=exits.put)
    got: queue.Queue = queue.Queue()
    ep.submit(rid, PromptInput(torch.arange(11, 40)), SamplingParams(max_tokens=200), got.put)
    assert got.get(timeout=TIMEOUT).finish_reason is None
    return ep, got, exits


def test_a_dead_child_ends_its_requests_and_refuses_more(engine_f32):
    ep, got, exits = generating(engine_f32[1], "doomed")
    ep.proc.send_signal(signal.SIGKILL)
    last = collect(got, 1)["doomed"]
    assert last.finish_reason == "error" and "exited" in last.error
    assert "code -9" in exits.get(timeout=TIMEOUT) and not ep.alive
    with pytest.raises(EngineGone, match="engine process is gone"):
        ep.submit("late", PromptInput(torch.tensor([11])), SamplingParams(max_tokens=2), got.put)
    ep.shutdown()


def test_shutdown_aborts_what_is_in_flight(engine_f32):
    ep, got, exits = generating(engine_f32[1], "cut")
    ep.shutdown()
    assert collect(got, 1)["cut"].finish_reason == "abort" and ep.proc.returncode == 0
    assert exits.empty()  # a shutdown is not a death

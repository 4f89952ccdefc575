"""The decode/verify step and MTP head passes padded to CUDA-graph buckets (runtime/step_graphs.py), on the
CPU: `pad_eager` runs each padded bucket eagerly from its static buffers, so the padding is tested without
a GPU (tests/gpu/test_engine_gpu.py replays the graphs)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runtime import LLMEngine, SamplingParams
from runtime.step_graphs import (
    HEAD_ARGS,
    STEP_ARGS,
    StepGraphs,
    batch_buckets,
    choose_bucket,
    copy_padded,
    empty_batch,
    pad_ragged,
    program_max_batch,
    q_buckets,
    ragged_indices,
    sized_args,
    stage_ragged,
    tensor_bits,
    token_buckets,
)

from ..hooks import Oracle, override_drafts
from .test_runtime import prompt_input, run_all


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(6) == (1, 2, 4, 6)
    tokens = token_buckets(4, 9, 512)
    assert tokens == (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36)
    assert token_buckets(64, 9, 100)[-1] == 100  # capped by max_num_tokens
    assert q_buckets(9) == (1, 2, 4, 8, 9) and q_buckets(1) == (1,)
    b, t, q = batch_buckets(4), tokens, q_buckets(9)
    assert choose_bucket(1, 1, 1, b, t, q) == (1, 1, 1)  # plain decode, batch 1
    assert choose_bucket(3, 3, 1, b, t, q) == (4, 4, 1)  # a padding sequence holds the padding token
    assert choose_bucket(4, 4, 1, b, t, q) == (4, 4, 1)
    assert choose_bucket(2, 10, 9, b, t, q) == (4, 12, 9)  # ragged drafts: 10 tokens -> 12, a padding seq
    assert choose_bucket(2, 10, 7, b, t, q) == (4, 12, 8)
    assert choose_bucket(4, 16, 4, b, t, q) == (4, 16, 4)  # a full batch, 3 drafts each
    assert choose_bucket(4, 13, 4, b, t, q) is None  # a full batch of ragged drafts: no padding seq, eager
    assert choose_bucket(1, 40, 40, b, t, q) is None  # beyond the largest bucket (a prefill chunk)
    # Decode at batch 5 of 8: 3 padding tokens need 3 padding sequences of one token (q bound 1).
    assert choose_bucket(5, 5, 1, batch_buckets(8), token_buckets(8, 9, 512), q) == (8, 8, 1)
    assert choose_bucket(5, 5, 1, batch_buckets(6), token_buckets(6, 9, 512), q) == (6, 6, 1)


def _step_args(B: int, T: int, q_lens: list[int], G: int = 2, MB: int = 4, H: int = 8) -> list:
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return [
        {},  # weights
        torch.arange(1, T + 1),
        torch.zeros(1, H),
        torch.tensor([T]),
        cu,
        torch.tensor([10 + n for n in q_lens], dtype=torch.int32),
        torch.arange(1, 1 + G * B * MB, dtype=torch.int32).view(G, B, MB),
        torch.arange(100, 100 + G * T).view(G, T),
        torch.arange(B, dtype=torch.int32),
        cu[1:].long() - 1,
        torch.zeros(max(q_lens), dtype=torch.int8),
        [],
        [],
        [],
    ]


def test_pad_ragged_layout():
    args = _step_args(3, 5, [1, 1, 3])
    p = pad_ragged(args, STEP_ARGS, 4, 8, 4)
    assert p[4].tolist() == [0, 1, 2, 5, 8]  # the padding sequence holds the 3 padding tokens
    assert p[5].tolist() == [11, 11, 13, 3]  # its seq_len = its q_len: reads positions 0..2 only
    assert p[1].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert p[3].tolist() == [8]  # the media dummy aims past the bucket's last token
    assert torch.equal(p[6][:, :3], args[6]) and (p[6][:, 3] == 0).all()  # block 0: valid, read only
    assert torch.equal(p[7][:, :5], args[7]) and (p[7][:, 5:] == -1).all()  # no KV write
    assert p[8].tolist() == [0, 1, 2, -1]  # no sconv state
    assert p[9].tolist() == [0, 1, 4, 0, 0, 0, 0, 0]
    assert p[10].shape == (4,)  # the q bound: the attention's tiles are chosen for 4 queries per sequence
    assert pad_ragged(args, STEP_ARGS, 4, 5, 4)[4].tolist() == [0, 1, 2, 5, 5]  # no padding tokens
    with pytest.raises(ValueError, match="cannot pad"):
        pad_ragged(args, STEP_ARGS, 3, 8, 4)  # padding tokens but no padding sequence
    with pytest.raises(ValueError, match="cannot pad"):
        pad_ragged(args, STEP_ARGS, 4, 8, 2)  # a sequence feeds 3 tokens, more than the bound
    assert pad_ragged(args, STEP_ARGS, 4, 8, 3)[4].tolist() == [0, 1, 2, 5, 8]  # 3 padding tokens fit q 3
    decode = _step_args(3, 3, [1, 1, 1])
    p = pad_ragged(decode, STEP_ARGS, 8, 8, 1)  # 5 padding tokens, one per padding sequence
    assert p[4].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8] and p[5].tolist() == [11, 11, 11, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_ragged(decode, STEP_ARGS, 4, 8, 1)  # 5 padding tokens of q 1 need 5 padding sequences
    only = pad_ragged(empty_batch(args, STEP_ARGS), STEP_ARGS, 2, 4, 4)
    assert only[4].tolist() == [0, 4, 4] and only[5].tolist() == [4, 0] and (only[7] == -1).all()


@pytest.mark.parametrize(
    "q_lens, bucket",
    [
        ([1, 1, 3], (4, 8, 4)),
        ([1, 1, 3], (4, 5, 4)),
        ([1, 1, 1], (8, 8, 1)),
        ([2, 9], (4, 12, 9)),
        ([1], (1, 1, 1)),
    ],
)
def test_staging_equals_pad_ragged(q_lens, bucket):
    """What a call writes into a bucket's pinned staging (NumPy, stage_ragged) is pad_ragged's padding, for
    the step's arguments and the head's (a float h_prev among them), into views of one flat buffer."""
    B, T, Q = bucket
    step = _step_args(len(q_lens), sum(q_lens), q_lens)
    head = [
        {}, torch.randn(sum(q_lens), 8, dtype=torch.bfloat16), step[1], step[2], step[3], step[4], step[5],
        step[6][0], step[7][0], step[8], step[10], [], [], [],
    ]  # fmt: skip
    for args, spec in ((step, STEP_ARGS), (head, HEAD_ARGS)):
        want = pad_ragged(args, spec, B, T, Q)
        dst = {i: torch.full_like(want[i], 77) for i in ragged_indices(spec)}
        stage_ragged(args, spec, B, T, Q, {i: tensor_bits(x) for i, x in dst.items()})
        for i, x in dst.items():
            assert torch.equal(x, want[i]), (spec is HEAD_ARGS, i, x, want[i])
        # the MTP drafter passes its host arguments as NumPy arrays: the same bytes staged
        as_numpy = [
            x.numpy() if isinstance(x, torch.Tensor) and x.dtype != torch.bfloat16 else x for x in args
        ]
        dst = {i: torch.full_like(want[i], 77) for i in ragged_indices(spec)}
        stage_ragged(as_numpy, spec, B, T, Q, {i: tensor_bits(x) for i, x in dst.items()})
        for i, x in dst.items():
            assert torch.equal(x, want[i]), ("NumPy", spec is HEAD_ARGS, i, x, want[i])
    with pytest.raises(ValueError, match="cannot pad"):
        stage_ragged(step, STEP_ARGS, B, T, 1 if max(q_lens) > 1 else 0, dst)
    # Inputs already on the device are padded there (copy_padded), as pad_ragged pads them.
    for args, spec in ((step, STEP_ARGS), (head, HEAD_ARGS)):
        want = pad_ragged(args, spec, B, T, Q)
        for i, d, v in sized_args(spec):
            out = torch.full_like(want[i], 77)
            copy_padded(out, args[i], d, v)
            assert torch.equal(out, want[i]), (spec is HEAD_ARGS, i)


def test_bucket_buffers_are_views_of_one_flat_buffer():
    """Each ragged input of a bucket is a view of its flat buffer (one host-to-device copy a call), at an
    aligned offset; repeated calls with other batches in one bucket give the eager program's outputs."""
    seen, fixed = [], []

    def program(*args):
        seen.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        return args[9].float(), args[1].float() * 2  # sized by the logits rows (N), then tokens (T)

    graphs = StepGraphs(
        program,
        STEP_ARGS,
        torch.device("cpu"),
        (1, 2, 4),
        (1, 2, 4, 8),
        (1, 2, 4),
        use_graphs=False,
        pad_eager=True,
    )
    for q_lens in ([1, 1, 2], [2, 1, 1], [1, 2], [1, 1, 1, 1], [3]):
        args = _step_args(len(q_lens), sum(q_lens), q_lens)
        args[0] = args[11] = args[12] = args[13] = fixed  # weights and caches: one object per bucket
        rows, ids = graphs(args)
        assert torch.equal(ids, args[1].float() * 2) and torch.equal(rows, args[9].float())
        bucket = graphs.bucket(args)
        want = pad_ragged(args, STEP_ARGS, *bucket)
        for i, x in want.items():
            if i in ragged_indices(STEP_ARGS):
                assert torch.equal(seen[-1][i], x), (q_lens, i)
        # A GPU bucket stages into a pinned host copy of flat's layout: the same bytes.
        entry = graphs.buckets[(None, *bucket)]
        host = np.zeros(entry.flat.numel(), dtype=np.uint8)
        stage_ragged(args, STEP_ARGS, *bucket, entry.bit_views(host))
        assert np.array_equal(host, entry.flat.numpy())
    assert len(graphs.buckets) == 3  # (4, 4, 2) three times, (4, 4, 1), (2, 4, 4)
    for entry in graphs.buckets.values():
        base = entry.flat.data_ptr()
        for i in ragged_indices(STEP_ARGS):
            ptr = entry.args[i].data_ptr()
            assert base <= ptr < base + entry.flat.numel() and (ptr - base) % 64 == 0


def _snapshot(runner) -> list[torch.Tensor]:
    heads = [t for states in runner.head_conv_states for t in states]
    return [
        t.clone()
        for t in (
            *runner.key_caches, *runner.value_caches, *runner.conv_states, *runner.expert_load,
            *runner.head_key_caches, *runner.head_value_caches, *heads,
        )
    ]  # fmt: skip


def test_a_batch_of_padding_writes_nothing(engine_f32):
    """What a bucket runs beyond the real rows (and all of the warm-up runs before a capture): no KV,
    sconv state, expert load or head cache changes."""
    runner = LLMEngine(engine_f32[0], pad_eager=True).runner
    g = torch.Generator().manual_seed(0)
    for t in _snapshot_sources(runner):
        t.copy_(torch.randn(t.shape, generator=g))
    before = _snapshot(runner)
    c = runner.config
    step = _step_args(1, 1, [1], runner.num_groups, runner.build.max_blocks_per_seq, c.hidden_size)
    step = [
        runner.weights, *step[1:11], runner.key_caches, runner.value_caches, runner.conv_states,
        runner.expert_load,
    ]  # fmt: skip
    padded = empty_batch(step, STEP_ARGS)
    for i, x in pad_ragged(padded, STEP_ARGS, 4, 12, 4).items():
        padded[i] = x
    runner.step(*padded)
    head = [
        runner.head_weights[0], torch.zeros(1, c.hidden_size), step[1], step[2], step[3], step[4], step[5],
        step[6][0], step[7][0], step[8], step[10], runner.head_key_caches[0], runner.head_value_caches[0],
        runner.head_conv_states[0],
    ]  # fmt: skip
    padded = empty_batch(head, HEAD_ARGS)
    for i, x in pad_ragged(padded, HEAD_ARGS, 2, 8, 4).items():
        padded[i] = x
    runner.head(*padded)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(runner)))


def _snapshot_sources(runner) -> list[torch.Tensor]:
    heads = [t for states in runner.head_conv_states for t in states]
    return [
        *runner.key_caches, *runner.value_caches, *runner.conv_states, *runner.expert_load,
        *runner.head_key_caches, *runner.head_value_caches, *heads,
    ]  # fmt: skip


def _requests(engine_f32, prompts):
    """Ragged prompts (90 tokens crossing a page at 96, 3 tokens, image+audio, two images), MTP with
    k = 0, 1, 3, 8 drafts in one batch."""
    from runtime import LLM

    llm = LLM(engine_f32[0])
    return [
        (f"k{k}", prompt_input(llm, p), SamplingParams(max_tokens=8, ignore_eos=True, num_draft_tokens=k))
        for k, p in zip((0, 1, 3, 8), prompts)
    ]


def _run(engine, requests, override=None, **kw):
    eng = LLMEngine(engine, **kw)
    override_drafts(eng, override)
    for rid, p, params in requests:
        eng.add_request(rid, p, params)
    return run_all(eng), eng


@pytest.fixture(scope="module")
def unpadded(engine_f32, prompts):
    """The requests run without padding, with the heads' own drafts (rarely accepted)."""
    requests = _requests(engine_f32, prompts)
    outs, _ = _run(engine_f32[0], requests)
    return requests, outs


def test_padded_steps_equal_unpadded(engine_f32, unpadded):
    """Greedy outputs token for token, with an oracle whose drafts are partly accepted, partly rejected
    (k = 0, 1, 3, 8 in one batch); every cache and state at the end equals the unpadded run's: the real
    ones, and nothing else written (padding rows skip the KV write, padding sequences have no state)."""
    requests, base = unpadded
    lens = {rid: len(p.input_ids) for rid, p, _ in requests}
    want, plain = _run(engine_f32[0], requests, Oracle(base, lens, 1000, seed=3))
    got, eng = _run(engine_f32[0], requests, Oracle(base, lens, 1000, seed=3), pad_eager=True)
    assert got == want == base
    rates = eng.acceptance.acceptance_rates
    assert 0 < rates[0] < 1, rates
    stats = eng.runner.graph_stats()
    assert stats["step_graphed"] >= 3 and stats["head_graphed"] >= 10, stats
    assert len(eng.runner.step_graphs.stats.buckets) >= 2, eng.runner.step_graphs.stats.buckets
    # Equal up to float32 rounding: a real row's GEMMs run at the bucket's row count (writes of padding
    # would differ by O(1)).
    worst = max(float((a - b).abs().max()) for a, b in zip(_snapshot(plain.runner), _snapshot(eng.runner)))
    assert worst < 1e-5, worst


def test_padded_draft_picks_equal_unpadded(engine_f32, unpadded):
    """The heads' own drafts, round by round: padded head passes with the holes' ids and the pick inside
    the bucket (runner.draft_graphs: pick rows and destinations padded to sinks, draft sources to -1) draft
    what the unpadded runs do, and so does the head's bucket with the holes and the pick launched apart."""
    requests, base = unpadded
    runs = []
    for kw, draft_graphs in (({}, True), ({"pad_eager": True}, True), ({"pad_eager": True}, False)):
        seen: list = []

        def record(rid, tokens, drafts, seen=seen):
            seen.append((rid, len(tokens), list(drafts)))
            return drafts

        eng = LLMEngine(engine_f32[0], **kw)
        if not draft_graphs:  # bench.e2e --eager_pick: the head's bucket, the holes and the pick apart
            eng.runner.draft_graphs = None
        override_drafts(eng, record)
        for rid, p, params in requests:
            eng.add_request(rid, p, params)
        runs.append((run_all(eng), seen))
        if draft_graphs and kw:
            assert eng.runner.draft_graphs.stats.graphed > 0 and eng.runner.head_graphs.stats.graphed > 0
    assert runs[0] == runs[1] == runs[2] and runs[0][0] == base
    assert sum(len(d) for _, _, d in runs[0][1]) >= 20, runs[0][1]
    assert eng.runner.head_graphs.stats.graphed > 0  # the eager-pick run's drafting passes used the head's


def test_full_batch_of_ragged_drafts_pads_to_the_programs_extra_sequence(engine_f32, unpadded):
    """The step and head programs take max_batch_size + 1 sequences (builder.profiles.program_batch), so a
    full batch with ragged draft counts (k = 0, 1, 3, 8 at max_batch_size 4) is padded with that extra
    sequence instead of running eagerly."""
    requests, base = unpadded
    eng = LLMEngine(engine_f32[0], pad_eager=True)
    full = eng.runner.build.max_batch_size
    assert full == len(requests)
    assert program_max_batch(eng.runner.engine.programs["step"]) == full + 1
    graphs = eng.runner.step_graphs
    assert graphs.batch[-1] == full + 1
    for rid, p, params in requests:
        eng.add_request(rid, p, params)
    outs = run_all(eng)
    assert outs == base
    assert any(b == full + 1 for _, b, _, _ in graphs.stats.buckets), graphs.stats.buckets


def test_attention_tiles_follow_the_longest_sequence_not_the_batch(engine_f32, prompts, monkeypatch):
    """The step passes its q_bound's length to the attention as max_seqlen_q: 1 in a decode step of 3
    sequences, 1 + drafts in a verify step (not the step's T, which picked prefill tiles for decode batches
    above 16 on the GPU)."""
    from plugins.attention import reference
    from runtime import LLM

    seen, original = [], reference.bank_attention

    def recording(q, *args):
        seen.append((q.shape[0], args[7]))  # (T, max_seqlen_q)
        return original(q, *args)

    monkeypatch.setattr(reference, "bank_attention", recording)
    llm = LLM(engine_f32[0])
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([prompt_input(llm, p) for p in prompts[:3]], plain)
    assert {m for T, m in seen if T == 3} == {1}, seen  # the decode steps of 3 sequences
    seen.clear()
    drafting = SamplingParams(max_tokens=6, num_draft_tokens=3, ignore_eos=True)
    llm.generate([prompt_input(llm, p) for p in prompts[1:3]], [plain, drafting])
    verify = [(T, m) for T, m in seen if T == 5]  # one decode token beside a verify of 1 + 3 drafts
    assert verify and {m for _, m in verify} == {4}, seen


def test_cuda_graphs_by_default_on_one_gpu_only(engine_f32):
    """CUDA graphs are the default for a one-rank CUDA engine with the Triton plugins and nothing else; on
    the CPU the default runs eager and asking for graphs is an error."""
    from runtime.model_runner import default_cuda_graphs

    triton = dict.fromkeys(("kv_cache_write", "bank_attention", "sconv", "sigmoid_sink_moe"), "triton")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert default_cuda_graphs(cuda, triton, tp_size=1)
    assert not default_cuda_graphs(cuda, triton, tp_size=2)
    assert not default_cuda_graphs(cpu, triton, tp_size=1)
    assert not default_cuda_graphs(cuda, {**triton, "sconv": "reference"}, tp_size=1)
    assert not default_cuda_graphs(cuda, {**triton, "sigmoid_sink_moe": "reference"}, tp_size=1)
    runner = LLMEngine(engine_f32[0]).runner
    assert runner.step_graphs is None and runner.head_graphs is None
    with pytest.raises(ValueError, match="CUDA engine"):
        LLMEngine(engine_f32[0], cuda_graphs=True)


def test_every_bucket_a_call_uses_is_made_at_start_up(engine_f32, unpadded):
    """Graph buckets are made when the runner starts (captured, on a GPU), every one a step or head pass can
    reach: a ragged MTP workload (k = 0, 1, 3, 8 in one batch) then uses only buckets made before it ran."""
    requests, base = unpadded
    eng = LLMEngine(engine_f32[0], pad_eager=True)
    made = {name: set(g.buckets) for name, g in _graphs(eng.runner).items()}
    assert all(made.values()), {k: len(v) for k, v in made.items()}
    lens = {rid: len(p.input_ids) for rid, p, _ in requests}
    override_drafts(eng, Oracle(base, lens, 1000, seed=5))
    for rid, p, params in requests:
        eng.add_request(rid, p, params)
    assert run_all(eng) == base
    for name, g in _graphs(eng.runner).items():
        assert g.stats.buckets and g.stats.buckets <= made[name], (name, g.stats.buckets - made[name])
        assert set(g.buckets) == made[name]  # nothing made while serving


def _graphs(runner) -> dict:
    return {"step": runner.step_graphs, "head": runner.head_graphs, "draft": runner.draft_graphs}


def test_reachable_buckets_are_those_calls_choose():
    from runtime.step_graphs import catchup_token_buckets, choose_bucket, reachable_buckets

    batch, tokens, qs = batch_buckets(4, 5), token_buckets(4, 9, 256), q_buckets(9)
    reachable = set(reachable_buckets(4, batch, tokens, qs))
    # every (sequences, tokens, longest) a batch may have, one by one: the buckets reachable_buckets finds
    # by q bound instead of by q (the catch-up graphs' q of 64 made the walk by q take seconds)
    for n_seqs, toks, q_s in ((4, tokens, qs), (3, catchup_token_buckets(16, 40), (16,))):
        walked = {
            choose_bucket(n, T, q, batch, toks, q_s)
            for n in range(1, n_seqs + 1)
            for q in range(1, q_s[-1] + 1)
            for T in range(q + n - 1, min(n * q, toks[-1]) + 1)
        } - {None}
        assert set(reachable_buckets(n_seqs, batch, toks, q_s)) == walked
    rng = random.Random(0)
    for _ in range(2000):
        q_lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
        bucket = choose_bucket(len(q_lens), sum(q_lens), max(q_lens), batch, tokens, qs)
        assert bucket is None or bucket in reachable


def test_heads_left_behind_catch_up_through_the_catch_up_buckets(engine_f32):
    """Heads left behind by rounds that draft nothing (Drafter.stays_behind) catch up in the catch-up
    buckets (runner.catchup_graphs: up to TRUNK_RING positions a sequence), padded: one sequence drafts
    again at its 30th step, the other's ring fills; tokens, drafts and the heads' KV rows equal the unpadded
    engine's, and no catch-up pass runs outside a bucket."""
    from runtime.drafter import TRUNK_RING

    from ..hooks import kv_rows, leave_heads_behind

    plain, want = leave_heads_behind(engine_f32[0])
    padded, got = leave_heads_behind(engine_f32[0], pad_eager=True)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert [s.drafts for s in got] == [s.drafts for s in want] and any(s.drafts for s in got)
    stats = padded.runner.catchup_graphs.stats
    assert stats.graphed >= 2 and stats.eager == 0, stats
    assert {q for _, _, _, q in stats.buckets} == {TRUNK_RING}
    for seq, ref in zip(got, want):
        assert seq.head_computed == ref.head_computed
        for d, n in enumerate(seq.head_computed):
            for a, b in zip(
                kv_rows(padded.runner, seq, d, range(n), True), kv_rows(plain.runner, ref, d, range(n), True)
            ):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

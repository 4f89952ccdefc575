"""MTP speculative decoding (INKLING_SPEC §5) over the float32 tiny engine.

The synthetic heads are random, so their own drafts are almost never accepted. To exercise every
acceptance length, an oracle replaces the drafts before verification with the true greedy
continuation corrupted after a random cut (`tests.hooks.override_drafts`); the heads' states keep
standing on their own drafts, as in a real run, and the engine must tell which of them stay valid.
"""

from __future__ import annotations

import json

import pytest
import torch

from builder import BuildConfig, Engine, EngineError, build
from builder.config import BuildError
from runtime import LLM, LLMEngine, PromptInput, SamplingParams

from ..hooks import Oracle, kv_rows, override_drafts
from .conftest import SMALL
from .test_runtime import prompt_input, run_all


def _engine(engine, chunk: int | None = None, **kw) -> LLMEngine:
    eng = LLMEngine(engine, **kw)
    if chunk:
        eng.scheduler.max_num_tokens = 4 * chunk
        eng.scheduler.chunk_size = chunk
    return eng


def _requests(llm: LLM, prompts) -> list[tuple[str, PromptInput, SamplingParams]]:
    """num_draft_tokens 0..8 over text (longer than W and R), short, image+audio and two-image prompts;
    one request stops on a token, one is cut by max_tokens mid-verification."""
    out = []
    for k in range(9):
        p = prompts[k % len(prompts)]
        out.append(
            (
                f"k{k}",
                prompt_input(llm, p),
                SamplingParams(max_tokens=9 + k % 3, ignore_eos=True, num_draft_tokens=k),
            )
        )
    return out


def _run(engine, requests, k_of=None, override=None, chunk=32, **kw):
    eng = _engine(engine, chunk, **kw)
    override_drafts(eng, override)
    for rid, p, params in requests:
        if k_of is not None:
            params = SamplingParams(**{**params.__dict__, "num_draft_tokens": k_of(params)})
        eng.add_request(rid, p, params)
    return run_all(eng), eng


@pytest.fixture(scope="module")
def plain(engine_f32, prompts):
    llm = LLM(engine_f32[0])
    requests = _requests(llm, prompts)
    outs, eng = _run(engine_f32[0], requests, k_of=lambda p: 0)
    lens = {rid: len(p.input_ids) for rid, p, _ in requests}
    return requests, outs, lens, eng.stats.steps


def test_greedy_with_mtp_equals_plain_for_every_draft_count(engine_f32, plain):
    """Draft counts 0..8 mixed in one batch, chunked prefill (heads catch up chunk by chunk), media."""
    requests, base, lens, plain_steps = plain
    own, eng = _run(engine_f32[0], requests)
    assert own == base
    oracle = Oracle(base, lens, 1000)
    forced, eng = _run(engine_f32[0], requests, override=oracle)
    assert forced == base
    m = eng.metrics()
    assert m["mean_acceptance_length"] > 1.5, m
    rates = eng.acceptance.acceptance_rates
    assert 0 < rates[0] < 1 and sum(r > 0 for r in rates) >= 6, rates  # accepts and rejects, deep accepts
    usage = eng.blocks.usage()
    assert usage["used_blocks"] == usage["evictable_blocks"]  # every block free or only cached
    assert eng.stats.steps < plain_steps


def test_heads_past_max_draft_len_are_not_loaded(tiny_nvfp4_ckpt_dir, plain):
    """An engine built with max_draft_len 2 runs 2 of the model's 8 heads (no KV for the rest): its greedy
    output with 1-2 drafts (the oracle's, accepted and rejected) equals plain decoding; 3 drafts are refused."""
    requests, base, lens, _ = plain
    engine = build(tiny_nvfp4_ckpt_dir, BuildConfig(dtype="float32", max_draft_len=2, **SMALL), echo=False)
    eng = LLMEngine(engine)
    assert eng.runner.num_heads == 2 == len(eng.runner.head_key_caches) < eng.config.num_mtp_heads
    with pytest.raises(ValueError, match="3 exceeds this engine's 2 MTP heads.*max_draft_len 2"):
        eng.add_request("k3", requests[3][1], requests[3][2])
    few = [r for r in requests if r[2].num_draft_tokens <= 2]
    outs, eng = _run(engine, few, override=Oracle(base, lens, 1000))
    assert outs == {rid: base[rid] for rid, _, _ in few}
    assert eng.metrics()["mean_acceptance_length"] > 1.2


def test_stop_token_inside_accepted_drafts(engine_f32, plain):
    """A stop token among accepted drafts ends the request there, as without drafts."""
    requests, base, lens, plain_steps = plain
    rid, p, params = requests[8]
    stop = base[rid][4]
    params = SamplingParams(max_tokens=12, ignore_eos=True, num_draft_tokens=8, stop_token_ids=(stop,))
    out, _ = _run(
        engine_f32[0],
        [(rid, p, params)],
        override=lambda r, t, d: (base[rid][len(t) - lens[rid] :] + d)[: len(d)],
    )
    assert out[rid] == base[rid][: base[rid].index(stop) + 1]


NUM_BLOCKS = 12  # four requests of 3 to 22 prompt tokens cannot all run at once


def test_preemption_with_mtp_recomputes_heads(engine_f32, plain):
    requests, base, lens, plain_steps = plain
    picked = [requests[i] for i in (1, 3, 5, 7)]
    out, eng = _run(engine_f32[0], picked, override=Oracle(base, lens, 1000, seed=1), num_blocks=NUM_BLOCKS)
    assert eng.scheduler.num_preemptions > 0
    assert out == {rid: base[rid] for rid, _, _ in picked}
    usage = eng.blocks.usage()
    assert usage["used_blocks"] == usage["evictable_blocks"]


def test_drafts_equal_the_reference_heads(engine_f32, reference, prompts, plain):
    """Every round's drafts (the heads' own, standing on each other) equal the reference chain's
    `draft()` over the tokens known at that round, after accepts and rejects."""
    requests, base, lens, plain_steps = plain
    by_id = {f"k{k}": prompts[k % len(prompts)] for k in range(9)}
    picked = [requests[i] for i in (2, 4, 8)]  # media prompt (2 heads), long text (4), short text (8)
    oracle = Oracle(base, lens, 1000, seed=2)
    _run(engine_f32[0], picked, override=oracle)
    assert len(oracle.rounds) >= 6
    for rid, tokens, drafts in oracle.rounds:
        p = by_id[rid]
        want = reference.draft(
            torch.tensor(tokens), len(drafts), images=p.images or None, audios=p.audios or None
        )
        assert drafts == want, (rid, len(tokens))


def test_draft_vocabulary(tiny_nvfp4_ckpt_dir, engine_f32, reference, prompts, plain, tmp_path):
    """An engine built with a draft vocabulary (every third token id), saved and loaded: its heads draft
    only those tokens, each round's drafts equal the reference chain's argmax over the same ids (and
    differ from the unrestricted chain's somewhere, so the restriction acts), and the greedy outputs
    are still plain decoding's."""
    requests, base, lens, plain_steps = plain
    vocab = list(range(0, reference.num_real_tokens, 3))
    built = build(
        tiny_nvfp4_ckpt_dir, BuildConfig(dtype="float32", **SMALL), echo=False, draft_vocab=vocab[::-1]
    )
    assert built.config["draft_vocab"] == vocab
    built.save(tmp_path / "engine")
    engine = Engine.from_dir(tmp_path / "engine")
    assert engine.config["draft_vocab"] == vocab
    by_id = {f"k{k}": prompts[k % len(prompts)] for k in range(9)}
    picked = [requests[i] for i in (2, 4, 8)]
    oracle = Oracle(base, lens, 1000, seed=2)
    out, _ = _run(engine, picked, override=oracle)
    assert out == {rid: base[rid] for rid, _, _ in picked}
    assert len(oracle.rounds) >= 6
    differs = 0
    for rid, tokens, drafts in oracle.rounds:
        p = by_id[rid]
        media = dict(images=p.images or None, audios=p.audios or None)
        want = reference.draft(torch.tensor(tokens), len(drafts), draft_vocab=vocab, **media)
        assert drafts == want, (rid, len(tokens))
        assert all(d % 3 == 0 for d in drafts)
        differs += want != reference.draft(torch.tensor(tokens), len(drafts), **media)
    assert differs > 0
    own, _ = _run(engine, requests)  # the heads' own drafts, every draft count
    assert own == base
    config_path = tmp_path / "engine" / "config.json"  # a hand-edited engine: a clear error at load
    config = json.loads(config_path.read_text())
    config["draft_vocab"] = [3, 3]
    config_path.write_text(json.dumps(config))
    with pytest.raises(EngineError, match="corrupt: draft_vocab: token ids repeat"):
        Engine.from_dir(tmp_path / "engine")


@pytest.mark.parametrize(
    "vocab, match",
    [
        ([], "non-empty"),
        ([1, 1], "repeat"),
        ([5, 10**6], "outside"),
        ([1.5], "integers"),
        ("12", "non-empty"),
    ],
)
def test_bad_draft_vocabulary_is_refused(tiny_nvfp4_ckpt_dir, vocab, match):
    with pytest.raises(BuildError, match=match):
        build(tiny_nvfp4_ckpt_dir, BuildConfig(dtype="float32", **SMALL), echo=False, draft_vocab=vocab)
    with pytest.raises(BuildError, match="no MTP heads"):
        build(
            tiny_nvfp4_ckpt_dir,
            BuildConfig(dtype="float32", **{**SMALL, "max_draft_len": 0}),
            echo=False,
            draft_vocab=[1],
        )


def test_caches_after_accepts_and_rejects_equal_fresh_recomputation(engine_f32, reference, plain):
    """Mid-generation, after many accepted and rejected drafts: the main model's KV and sconv states,
    and every head's KV and sconv states, equal those of a fresh prefill of the same tokens; the heads'
    hidden states whose inputs are all known equal §5's definition over the known sequence."""
    requests, base, lens, plain_steps = plain
    engine = engine_f32[0]
    picked = [requests[i] for i in (4, 8)]  # long text with 4 heads, short text with 8
    eng = _engine(engine, 16)
    override_drafts(eng, Oracle(base, lens, 1000, seed=3))
    for rid, p, params in picked:
        eng.add_request(rid, p, SamplingParams(**{**params.__dict__, "max_tokens": 40}))
    while eng.acceptance.steps < 8:
        eng.step()
    assert 0 < eng.acceptance.acceptance_rate < 1 and set(eng.requests) == {rid for rid, _, _ in picked}
    runner, c = eng.runner, engine.model_config
    K1 = c.sconv_kernel_size - 1
    for rid, _, params in picked:
        seq = eng.requests[rid].seq
        L = len(seq.tokens)
        assert seq.num_computed == L - 1
        fresh = _engine(engine)
        fresh.add_request(
            rid,
            PromptInput(torch.tensor(seq.tokens[:-1])),
            SamplingParams(max_tokens=40, num_draft_tokens=params.num_draft_tokens),
        )
        fseq = fresh.requests[rid].seq
        while not fseq.output_ids:
            fresh.step()
        assert fseq.output_ids == [seq.tokens[-1]] and fseq.num_computed == L - 1
        assert fseq.drafts == seq.head_drafts  # the heads' own drafts, from equal states
        for layer in range(c.num_hidden_layers):
            g = runner.layout["group_of_layer"][layer]
            held = [t for t in range(L - 1) if seq.blocks.tables[g][t // runner.block_size] >= 0]
            held = [t for t in held if fseq.blocks.tables[g][t // runner.block_size] >= 0]
            assert len(held) >= min(L - 1, c.sliding_window)
            for a, b in zip(
                kv_rows(runner, seq, layer, held, False), kv_rows(fresh.runner, fseq, layer, held, False)
            ):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(runner.conv_states, fresh.runner.conv_states):
            torch.testing.assert_close(a[seq.slot, -K1:], b[fseq.slot, -K1:], rtol=1e-5, atol=1e-5)
        for m in range(1, params.num_draft_tokens + 1):
            assert seq.head_computed[m - 1] == fseq.head_computed[m - 1] == L - 1
            for a, b in zip(
                kv_rows(runner, seq, m - 1, range(L - 1), True),
                kv_rows(fresh.runner, fseq, m - 1, range(L - 1), True),
            ):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            for a, b in zip(runner.head_conv_states[m - 1], fresh.runner.head_conv_states[m - 1]):
                torch.testing.assert_close(a[seq.slot, -K1:], b[fseq.slot, -K1:], rtol=1e-5, atol=1e-5)
        # §5 over the known tokens x[0..L-1]: h^m at t <= L-1-m (the ring keeps the last positions).
        ids = torch.tensor(seq.tokens)
        e = reference.embed(ids)
        _, h = reference(ids)
        for m in range(1, min(params.num_draft_tokens, c.num_mtp_heads - 1) + 1):
            h = reference.mtp[m - 1](h[: L - m], e[m:L])
            end = L - m
            ring = runner.drafter.hidden_ring[m, seq.slot]
            for t in range(max(0, end - 8), end):
                torch.testing.assert_close(ring[t % len(ring)], h[t], rtol=1e-4, atol=1e-4)


CHI2_15_P999 = 37.697  # chi-square critical value, 15 degrees of freedom, upper tail 1e-3


def test_sampling_with_mtp_keeps_the_distribution(tiny_nvfp4_ckpt_dir, reference):
    """Temperature 1, top_k 2, 4 tokens: 16 possible outputs. 1200 seeded requests with 2 drafts per
    step (drafts forced to the likeliest token, or to one outside the top 2 for odd requests, so
    both acceptance and rejection paths run; every third request's second draft is an id past the
    tokenizer's vocabulary, as heads over a draft vocabulary may pick) against the exact distribution
    from the reference model's logits. Chi-square with 15 degrees of freedom at p = 1e-3: for a random seed the test
    fails wrongly once in a thousand runs; the seeds here are fixed."""
    engine = build(
        tiny_nvfp4_ckpt_dir, BuildConfig(dtype="float32", **{**SMALL, "max_batch_size": 32}), echo=False
    )
    from runtime.sampler import filter_logits

    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=2, num_draft_tokens=2, ignore_eos=True)
    prompt = torch.tensor([101, 202, 303, 404, 505])
    # The engine as if its tokenizer were 8 tokens short of the model's vocabulary (inkling-tiny's fills it;
    # the bench's does not): the ids past it can be drafted, never emitted.
    n_real = reference.num_real_tokens - 8

    probs_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in probs_cache:
            logits, _ = reference(torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)]))
            probs_cache[prefix] = torch.softmax(filter_logits(logits[-1, :n_real], params), -1)
        return probs_cache[prefix]

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(4):
        exact = {
            seq + (int(t),): p * float(probs(seq)[t])
            for seq, p in exact.items()
            for t in probs(seq).nonzero().flatten()
        }
    assert len(exact) == 16

    def override(rid: str, tokens: list[int], drafts: list[int]) -> list[int]:
        out = list(tokens[len(prompt) :])
        picked = []
        for _ in drafts:
            p = probs(tuple(out))
            t = int(p.argmax()) if int(rid) % 2 == 0 else int(p.argmin())
            if int(rid) % 3 == 2 and picked:
                t = n_real + int(rid) % 5  # the target cannot emit it: rejected
            picked.append(t)
            out.append(t)
        return picked

    eng = LLMEngine(engine)
    eng.num_real_tokens = eng.spec.num_real_tokens = n_real
    override_drafts(eng, override)
    n = 1200
    for i in range(n):
        eng.add_request(str(i), PromptInput(prompt), SamplingParams(**{**params.__dict__, "seed": 1000 + i}))
    outs = run_all(eng)
    counts: dict[tuple[int, ...], int] = {}
    for toks in outs.values():
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    assert set(counts) <= set(exact)
    assert eng.acceptance.steps > 0 and 0.1 < eng.acceptance.acceptance_rate < 0.8
    chi2 = sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in exact.items())
    assert chi2 < CHI2_15_P999, (chi2, counts, exact)


def test_deferred_rollbacks_equal_immediate_ones(engine_f32):
    """A step's sconv rollbacks are deferred and applied together (ModelRunner.rollback(defer=True),
    flush_rollbacks): the states equal those of the same rollbacks applied one by one, with two of the same
    rows in one batch (the second must read the first's result), heads included, and any use of the states
    (here a slot reset of another sequence) applies what is pending first."""
    runner = LLMEngine(engine_f32[0]).runner
    g = torch.Generator().manual_seed(0)
    states = [*runner.conv_states, *(t for s in runner.head_conv_states for t in s)]
    start = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in states]

    def apply(defer: bool) -> list[torch.Tensor]:
        for t, x in zip(states, start):
            t.copy_(x)
        runner.rollback(0, 2, defer=defer)
        runner.rollback_heads(0, [1, 0, 2][: runner.num_heads], defer=defer)
        runner.rollback(1, 1, defer=defer)
        runner.rollback(0, 1, defer=defer)  # the same rows again
        if defer:
            assert runner._pending_keys  # not applied yet
            runner.reset_slot(2)  # another slot's use of the states applies the pending rollbacks
            assert not runner._pending_keys
        else:
            runner.reset_slot(2)
        runner.flush_rollbacks()
        return [t.clone() for t in states]

    assert runner.num_heads >= 1
    immediate, deferred = apply(False), apply(True)
    assert all(torch.equal(a, b) for a, b in zip(immediate, deferred))
    assert not all(torch.equal(a, x) for a, x in zip(immediate, start))

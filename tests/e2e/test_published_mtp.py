"""The real Inkling's MTP (INKLING_SERVING §1) over the float32 tiny engine, against the reference depths
(inkling/published/mtp.py: transformers' own block around the published input fusion).

inkling-tiny's eight depths mix sliding attention (2 KV heads, window and extent 16) and full attention
(1 KV head, extent 24, a log-scaling floor of 20), as `local_layer_ids` [0, 2, 4, 5, 6, 7] says. The synthetic depths are random, so their
own drafts are almost never right: an oracle (tests/hooks.py) replaces them before verification with the
true greedy continuation, wrong from a random cut on, while the depths' states keep standing on their own
drafts as in a real run; the engine must repair what a rejection leaves stale.
"""

from __future__ import annotations

import pytest
import torch

from builder import BuildConfig, build
from inkling.published.config import FULL, preset
from inkling.published.mtp import MTPDepth, MTPReference
from inkling.published.ops import bank_attention, deinterleave, residual_sconv, rms_norm, swiglu
from inkling.published.synth import write_checkpoint
from runtime import LLMEngine, PromptInput, SamplingParams
from runtime.device_state import MAX_SNAPSHOTS
from runtime.drafter import TRUNK_RING

from ..hooks import Oracle, kv_rows, override_drafts
from .test_runtime import run_all

pytest.importorskip("transformers")

CONFIG = dict(
    dtype="float32", device="cpu", max_batch_size=8, max_input_len=64, max_seq_len=96, max_num_tokens=48
)
VOCAB = 960  # prompt ids below the special tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", preset("inkling-tiny"), seed=7)


@pytest.fixture(scope="module")
def engine(ckpt):
    return build(ckpt, BuildConfig(**CONFIG), echo=False)


@pytest.fixture(scope="module")
def reference(ckpt):
    return MTPReference.load(ckpt)


def every_k_and_length() -> list[tuple[str, torch.Tensor, SamplingParams]]:
    """k = 1..8 drafts with every prompt length 1..k+2 (one-token prompts included); max_tokens 1..10, so
    some requests end inside a verification."""
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(1, 9):
        for n in range(1, k + 3):
            params = SamplingParams(max_tokens=1 + (n + k) % 10, ignore_eos=True, num_draft_tokens=k)
            out.append((f"k{k}n{n}", torch.randint(0, VOCAB, (n,), generator=g), params))
    return out


def run(engine, requests, k=None, override=None, **kw):
    eng = LLMEngine(engine, **kw)
    override_drafts(eng, override)
    for rid, ids, params in requests:
        if k is not None:
            params = SamplingParams(**{**params.__dict__, "num_draft_tokens": k})
        eng.add_request(rid, PromptInput(ids), params)
    return run_all(eng), eng


@pytest.fixture(scope="module")
def plain(engine):
    requests = every_k_and_length()
    outs, eng = run(engine, requests, k=0)
    return requests, outs, {rid: len(ids) for rid, ids, _ in requests}, eng.stats.steps


def test_a_depth_is_the_published_fusion_and_block(ckpt, reference):
    """The reference depth (transformers' decoder block) against INKLING_SERVING §1.2 restated with our
    own ops: hidden first, the depth's hidden_norm and embed_norm, input_proj, the block with its kind's
    heads, window and extent, a dense MLP times its global scale, every sconv with its skip; no τ inside
    full depths unless mtp_config.log_scaling; logits unembed(h / muP) over the real tokens, no norm. At
    40 positions: past the window (16), the extent (24) and the log-scaling floor (20)."""
    from inkling.published.checkpoint import PublishedCheckpoint

    c = reference.config
    t, T = c.text, 40
    g = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(T, t.hidden_size, generator=g), torch.randn(T, t.hidden_size, generator=g)
    pos = torch.arange(T)
    with PublishedCheckpoint(ckpt) as ck:
        for d in (0, 1):  # a sliding depth and a full one
            w = {k.removeprefix(f"model.mtp.layers.{d}."): ck.get(k).float() for k in ck.keys()
                 if k.startswith(f"model.mtp.layers.{d}.")}  # fmt: skip
            a = c.mtp_attention(d)
            assert (a.window is None) == (c.mtp.layer_types[d] == FULL)
            got = {}
            for log_scaling in (False, True):
                b = "transformer_block."
                eps = t.rms_norm_eps
                x = torch.cat(
                    [
                        rms_norm(hidden, w["hidden_norm.weight"], eps),
                        rms_norm(embeds, w["embed_norm.weight"], eps),
                    ],
                    -1,
                )
                x = x @ w["input_proj.weight"].T
                u = rms_norm(x, w[b + "attn_norm.weight"], eps)
                q = (u @ w[b + "attn.wq_du.weight"].T).view(T, a.num_heads, a.head_dim)
                q = rms_norm(q, w[b + "attn.q_norm.weight"], eps)
                k = residual_sconv(u @ w[b + "attn.wk_dv.weight"].T, w[b + "attn.k_sconv.weight"][:, 0])
                v = residual_sconv(u @ w[b + "attn.wv_dv.weight"].T, w[b + "attn.v_sconv.weight"][:, 0])
                k = rms_norm(k.view(T, a.num_kv_heads, a.head_dim), w[b + "attn.k_norm.weight"], eps)
                r = (u @ w[b + "attn.wr_du.weight"].T).view(T, a.num_heads, a.d_rel)
                o = bank_attention(
                    q, k, v.view(T, a.num_kv_heads, a.head_dim), r, w[b + "attn.rel_logits_proj.proj"], pos, pos,
                    a.window, 1.0 / a.head_dim, a.log_scaling_n_floor if log_scaling else None, a.log_scaling_alpha,
                )  # fmt: skip
                x = x + residual_sconv(
                    o.reshape(T, -1) @ w[b + "attn.wo_ud.weight"].T, w[b + "attn_sconv.weight"][:, 0]
                )
                m = rms_norm(x, w[b + "mlp_norm.weight"], eps)
                f = swiglu(m, deinterleave(w[b + "mlp.w13_dn.weight"], 0), w[b + "mlp.w2_md.weight"])
                want = x + residual_sconv(f * w[b + "mlp.global_scale"], w[b + "mlp_sconv.weight"][:, 0])
                depth = MTPDepth(reference.trunk.config.text_config, c.mtp.layer_types[d], log_scaling)
                depth.load_state_dict(reference.depths[d].state_dict())
                with torch.no_grad():
                    got[log_scaling] = depth(hidden, embeds)
                torch.testing.assert_close(got[log_scaling], want, rtol=1e-4, atol=1e-4)
            # τ changes a full depth past its floor (the switch is live), never a sliding one
            assert torch.allclose(got[False], got[True]) == (a.window is not None)
    unembed = reference.trunk.lm_head.weight[: t.num_real_tokens]
    torch.testing.assert_close(reference.logits(hidden), hidden / t.logits_mup_width_multiplier @ unembed.T)


def test_depth_zero_reads_the_trunk_after_its_final_norm(reference):
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    embeds, hidden, logits = reference.trunk_pass(ids)
    with torch.no_grad():
        out = reference.trunk.model(input_ids=ids[None])
        want_embeds = reference.trunk.get_input_embeddings()(ids[None])[0]
    torch.testing.assert_close(hidden, out.last_hidden_state[0])  # InklingTextModel ends in its norm
    torch.testing.assert_close(embeds, want_embeds)  # the trunk's embed norm applied


def test_greedy_with_mtp_equals_plain_for_every_draft_count_and_prompt_length(engine, plain):
    """k = 1..8 and prompts of 1..k+2 tokens in one engine run (batches of mixed k), the oracle's drafts
    accepted and rejected at every depth: the same tokens as plain decoding, in fewer steps, every block
    back in the pool."""
    requests, base, lens, plain_steps = plain
    own, _ = run(engine, requests)
    assert own == base  # the depths' own drafts (almost all rejected)
    forced, eng = run(engine, requests, override=Oracle(base, lens, VOCAB))
    assert forced == base
    rates = eng.acceptance.acceptance_rates
    assert 0 < rates[0] < 1 and sum(r > 0 for r in rates) >= 6, rates
    assert eng.stats.steps < plain_steps
    usage = eng.blocks.usage()
    assert usage["used_blocks"] == usage["evictable_blocks"]


def test_preemption_and_the_prefix_cache_with_mtp(engine):
    """Too few blocks for the batch: preempted MTP requests recompute their depths. The same requests
    again in the same engine, with plain twins that take prefix-cache hits, still equal plain decoding
    (MTP requests start from position 0: the cache keeps no depth states)."""
    g = torch.Generator().manual_seed(5)
    picked = [
        (f"r{i}", torch.randint(0, VOCAB, (18 + 3 * i,), generator=g),
         SamplingParams(max_tokens=16, ignore_eos=True, num_draft_tokens=3 + i))
        for i in range(6)
    ]  # fmt: skip
    base, _ = run(engine, picked, k=0)
    eng = LLMEngine(engine, num_blocks=16)
    override_drafts(eng, Oracle(base, {rid: len(ids) for rid, ids, _ in picked}, VOCAB, seed=1))
    for rid, ids, params in picked:
        eng.add_request(rid, PromptInput(ids), params)
    assert run_all(eng) == base
    assert eng.scheduler.num_preemptions > 0
    override_drafts(
        eng,
        Oracle(
            {rid + "-2": base[rid] for rid in base}, {rid + "-2": len(ids) for rid, ids, _ in picked}, VOCAB
        ),
    )
    hits = eng.blocks.stats["prefix_hits"]
    for rid, ids, params in picked:
        eng.add_request(rid + "-2", PromptInput(ids), params)
        eng.add_request(
            rid + "-plain", PromptInput(ids), SamplingParams(**{**params.__dict__, "num_draft_tokens": 0})
        )
    outs = run_all(eng)
    assert outs == {**{rid + "-2": base[rid] for rid in base}, **{rid + "-plain": base[rid] for rid in base}}
    assert eng.blocks.stats["prefix_hits"] > hits  # the plain twins start from the cache


def test_drafts_equal_the_reference_depths(engine, reference, plain):
    """Every round's drafts (the depths' own, each standing on the one before) equal the reference chain's
    `draft()` over the tokens known at that round, after accepts and rejects; prompts past the window and
    the extent, with 3 and 8 drafts."""
    g = torch.Generator().manual_seed(3)
    requests = [
        ("long", torch.randint(0, VOCAB, (37,), generator=g), SamplingParams(max_tokens=10, ignore_eos=True, num_draft_tokens=3)),
        ("short", torch.randint(0, VOCAB, (4,), generator=g), SamplingParams(max_tokens=12, ignore_eos=True, num_draft_tokens=8)),
    ]  # fmt: skip
    base, _ = run(engine, requests, k=0)
    oracle = Oracle(base, {rid: len(ids) for rid, ids, _ in requests}, VOCAB, seed=2)
    assert run(engine, requests, override=oracle)[0] == base
    assert len(oracle.rounds) >= 4
    for rid, tokens, drafts in oracle.rounds:
        assert drafts == reference.draft(torch.tensor(tokens), len(drafts)), (rid, len(tokens))


def test_states_after_accepts_and_rejects_equal_fresh_recomputation(engine, reference):
    """Mid-generation, after accepted and rejected drafts: every depth's KV rows and sconv states equal a
    fresh prefill's of the same tokens (the stale rows a rejection left were rewritten), the depths' own
    next drafts agree, and the depths' hidden states whose inputs are all known equal the reference's."""
    g = torch.Generator().manual_seed(4)
    requests = [
        ("a", torch.randint(0, VOCAB, (30,), generator=g), SamplingParams(max_tokens=40, ignore_eos=True, num_draft_tokens=4)),
        ("b", torch.randint(0, VOCAB, (3,), generator=g), SamplingParams(max_tokens=40, ignore_eos=True, num_draft_tokens=8)),
    ]  # fmt: skip
    base, _ = run(engine, requests, k=0)
    eng = LLMEngine(engine)
    override_drafts(eng, Oracle(base, {rid: len(ids) for rid, ids, _ in requests}, VOCAB, seed=3))
    for rid, ids, params in requests:
        eng.add_request(rid, PromptInput(ids), params)
    while eng.acceptance.steps < 8:
        eng.step()
    assert 0 < eng.acceptance.acceptance_rate < 1 and set(eng.requests) == {"a", "b"}
    runner, c = eng.runner, engine.model_config
    K1 = c.sconv_kernel_size - 1
    for rid, _, params in requests:
        seq = eng.requests[rid].seq
        L = len(seq.tokens)
        assert seq.num_computed == L - 1
        fresh = LLMEngine(engine)
        fresh.add_request(rid, PromptInput(torch.tensor(seq.tokens[:-1])),
                          SamplingParams(max_tokens=40, num_draft_tokens=params.num_draft_tokens))  # fmt: skip
        fseq = fresh.requests[rid].seq
        while not fseq.output_ids:
            fresh.step()
        assert fseq.output_ids == [seq.tokens[-1]] and fseq.drafts == seq.head_drafts
        for d in range(params.num_draft_tokens):
            assert seq.head_computed[d] == fseq.head_computed[d] == L - 1
            for a, b in zip(kv_rows(runner, seq, d, range(L - 1), True),
                            kv_rows(fresh.runner, fseq, d, range(L - 1), True)):  # fmt: skip
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            for a, b in zip(runner.head_conv_states[d], fresh.runner.head_conv_states[d]):
                torch.testing.assert_close(a[seq.slot, -K1:], b[fseq.slot, -K1:], rtol=1e-5, atol=1e-5)
        for a, b in zip(runner.conv_states, fresh.runner.conv_states):
            torch.testing.assert_close(a[seq.slot, -K1:], b[fseq.slot, -K1:], rtol=1e-5, atol=1e-5)
        # Head m's state at t reads tokens up to t+m: those at t <= L-1-m stand on known tokens only.
        embeds, h, _ = reference.trunk_pass(torch.tensor(seq.tokens))
        for m in range(1, min(params.num_draft_tokens, c.num_mtp_heads - 1) + 1):
            with torch.no_grad():
                h = reference.depths[m - 1](h[: L - m], embeds[m:L])
            ring = runner.drafter.hidden_ring[m][seq.slot]
            for t in range(max(0, L - m - 8), L - m):
                torch.testing.assert_close(ring[t % len(ring)], h[t], rtol=1e-4, atol=1e-4)


def test_only_the_depths_a_deployment_drafts_with_are_built(ckpt, plain):
    """max_draft_len 2: depths 0 (sliding) and 1 (full), one program of each kind, their KV alone; 3 drafts
    refused with a clear error. Outputs with 1-2 drafts equal plain decoding."""
    requests, base, lens, _ = plain
    two = build(ckpt, BuildConfig(**{**CONFIG, "max_draft_len": 2}), echo=False)
    assert {n for n in two.programs if n.startswith("mtp")} == {"mtp_head_sliding", "mtp_head_full"}
    assert {n.split(".")[1] for n in two.weights if n.startswith("mtp.")} == {"0", "1"}
    eng = LLMEngine(two)
    assert eng.runner.num_heads == 2 == len(eng.runner.head_key_caches)
    assert [k.shape[2] for k in eng.runner.head_key_caches] == [2, 1]  # sliding: 2 KV heads, full: 1
    # Each kind's caches hold its pool alone: the full layers' and the depths' (group 0's ids) the full
    # groups' blocks, the sliding layers' the windows'.
    full, sliding = eng.runner.pool_sizes
    assert eng.blocks.group_pools[0] == 0 and sliding > 0 and full + sliding == eng.runner.num_blocks
    assert [k.shape[0] for k in eng.runner.head_key_caches] == [full, full]
    g = len(eng.runner.key_caches) // 2
    assert [k.shape[0] for k in eng.runner.key_caches] == [full] * g + [sliding] * g
    # What a GPU's pools are fitted to (ModelRunner._fit_pools_to_memory) is what they take.
    runner, nbytes = eng.runner, lambda ts: sum(t.numel() * t.element_size() for t in ts)
    kv = [*runner.key_caches, *runner.value_caches, *runner.head_key_caches, *runner.head_value_caches]
    assert sum(n * b for n, b in zip(runner.pool_sizes, runner._pool_block_bytes())) == nbytes(kv)
    conv = nbytes([*runner.conv_states, *sum(runner.head_conv_states, [])])
    snapshots = (
        nbytes(runner.snapshots) * MAX_SNAPSHOTS // runner.num_snapshots
    )  # as many as a GPU's pools hold
    assert runner._state_bytes() == conv + snapshots
    with pytest.raises(ValueError, match="3 exceeds this engine's 2 MTP heads"):
        eng.add_request("x", PromptInput(torch.tensor([1, 2])), SamplingParams(num_draft_tokens=3))
    few = [r for r in requests if r[2].num_draft_tokens <= 2]
    assert run(two, few, override=Oracle(base, lens, VOCAB))[0] == {rid: base[rid] for rid, _, _ in few}


CHI2_7_P999 = 24.322  # chi-square critical value, 7 degrees of freedom, upper tail 1e-3


def test_sampling_with_mtp_keeps_the_distribution(engine, reference):
    """Temperature 1, top_k 2, 3 tokens: 8 possible outputs. 480 seeded requests with 2 drafts per step
    (forced to the likeliest token for even requests, to the least likely of the top 2 for odd ones, so
    acceptance and rejection both run) against the exact distribution from transformers' logits;
    chi-square with 7 degrees of freedom at p = 1e-3 (fixed seeds)."""
    from runtime.sampler import filter_logits

    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, num_draft_tokens=2, ignore_eos=True)
    prompt = torch.tensor([101, 202, 303, 404, 505])
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            _, _, logits = reference.trunk_pass(torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)]))
            cache[prefix] = torch.softmax(
                filter_logits(logits[-1, : reference.config.text.num_real_tokens], params), -1
            )
        return cache[prefix]

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        exact = {
            s + (int(t),): p * float(probs(s)[t])
            for s, p in exact.items()
            for t in probs(s).nonzero().flatten()
        }
    assert len(exact) == 8

    def override(rid: str, tokens: list[int], drafts: list[int]) -> list[int]:
        out, picked = list(tokens[len(prompt) :]), []
        for _ in drafts:
            p = probs(tuple(out))
            top = p.topk(2).indices
            t = int(top[0] if int(rid) % 2 == 0 else top[1])
            picked.append(t)
            out.append(t)
        return picked

    eng = LLMEngine(engine)
    override_drafts(eng, override)
    n = 480
    for i in range(n):
        eng.add_request(str(i), PromptInput(prompt), SamplingParams(**{**params.__dict__, "seed": 2000 + i}))
    counts: dict[tuple[int, ...], int] = {}
    for toks in run_all(eng).values():
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    assert set(counts) <= set(exact)
    assert 0.1 < eng.acceptance.acceptance_rate < 0.95
    chi2 = sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in exact.items())
    assert chi2 < CHI2_7_P999, (chi2, counts, exact)


def test_stop_token_inside_accepted_drafts(engine, plain):
    """A stop token among accepted drafts ends the request there, as without drafts."""
    requests, base, lens, _ = plain
    rid, ids, _ = next(r for r in requests if r[2].num_draft_tokens == 8 and len(base[r[0]]) >= 6)
    stop = base[rid][4]
    params = SamplingParams(max_tokens=12, ignore_eos=True, num_draft_tokens=8, stop_token_ids=(stop,))
    out, _ = run(
        engine, [(rid, ids, params)], override=lambda r, t, d: (base[rid][len(t) - lens[rid] :] + d)[: len(d)]
    )
    assert out[rid] == base[rid][: base[rid].index(stop) + 1]


def test_deferred_rollbacks_equal_immediate_ones(engine):
    """A step's sconv rollbacks are deferred and applied together (ModelRunner.rollback(defer=True),
    flush_rollbacks): the states equal those of the same rollbacks applied one by one, with two of the same
    rows in one batch (the second must read the first's result), depths included, and any use of the states
    (here a slot reset of another sequence) applies what is pending first."""
    runner = LLMEngine(engine).runner
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


def test_rollbacks_of_consecutive_slots_equal_slot_by_slot(engine):
    """Deferred rollbacks of one (depth, n) are applied as runs of consecutive slots, one pair of views a state
    a run: the states equal the rows shifted slot by slot, for the main model and the depths, runs and single
    slots mixed."""
    from runtime.model_runner import slot_runs

    assert slot_runs([3, 0, 1, 1, 5]) == [(0, 2), (3, 4), (5, 6)]
    runner = LLMEngine(engine).runner
    assert runner.build.max_batch_size >= 4 and runner.num_heads >= 2
    g = torch.Generator().manual_seed(1)
    heads = [runner.conv_states, *runner.head_conv_states]
    for states in heads:
        for t in states:
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    want = [[t.clone() for t in states] for states in heads]
    rollbacks = [(0, 0, 2), (1, 0, 2), (2, 0, 2), (3, 0, 1), (1, 1, 1), (2, 1, 1), (0, 2, 3), (2, 2, 3)]
    for slot, head, n in rollbacks:  # (slot, head, n); head 0 is the main model
        for t in want[head]:
            t[slot, n:] = t[slot, :-n].clone()
        if head == 0:
            runner.rollback(slot, n, defer=True)
        else:
            counts = [0] * runner.num_heads
            counts[head - 1] = n
            runner.rollback_heads(slot, counts, defer=True)
    runner.flush_rollbacks()
    for states, expected in zip(heads, want):
        assert all(torch.equal(t, w) for t, w in zip(states, expected))


@pytest.mark.parametrize("pays", [True, False])
def test_drafts_stop_where_rounds_do_not_pay(engine, monkeypatch, pays):
    """The cost side of the draft policy (speculative.RoundCosts) in the engine, on a fake clock whose rounds
    take 1 + (0.1 or 2) x drafts units: the depths' drafts always right (an oracle), 3 drafts and none are
    measured (1 and 2 priced between them), then all 3 are kept where they pay and none where they do not.
    Either way the tokens are plain decoding's."""
    import runtime.spec_decode

    g = torch.Generator().manual_seed(3)
    requests = [(f"r{i}", torch.randint(0, VOCAB, (5,), generator=g), SamplingParams(max_tokens=40, ignore_eos=True))
                for i in range(4)]  # fmt: skip
    base, _ = run(engine, requests, k=0)
    clock = [0.0]
    monkeypatch.setattr(runtime.spec_decode, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))
    eng = LLMEngine(engine, draft_costs=True)
    drafted = []
    heads = eng.runner.run_heads

    def timed_heads(work):
        drafts = max(w.num_drafts for w in work)
        clock[0] += 1 + (0.1 if pays else 2) * drafts
        drafted.append(drafts)
        return heads(work)

    eng.runner.run_heads = timed_heads
    lens = {rid: len(ids) for rid, ids, _ in requests}

    def truth(rid, tokens, drafts):  # plain decoding's next tokens, as many as the depths drafted
        done = len(tokens) - lens[rid]
        return base[rid][done : done + len(drafts)] + drafts[len(base[rid]) - done :]

    override_drafts(eng, truth)
    for rid, ids, params in requests:
        eng.add_request(rid, PromptInput(ids), SamplingParams(**{**params.__dict__, "num_draft_tokens": 3}))
    assert run_all(eng) == base
    explored = [d for d in drafted if d]
    if pays:
        assert drafted[:5] == [3, 3, 3, 0, 0] and set(drafted[5:-3]) == {3}, drafted
        assert eng.acceptance.mean_acceptance_length > 2.5  # exploration and the last tokens draft less
    else:
        # the prefill's round, then two rounds to measure 3 drafts (and two of none), then none: 1 and 2,
        # priced between, never pay either
        assert explored == [3, 3, 3], str(drafted)
    seconds = eng.spec.round_costs.seconds
    assert seconds[(4, 0)] == 1.0 and seconds[(4, 3)] == pytest.approx(1.3 if pays else 7)


@pytest.mark.parametrize(
    "drafts_again,lengths,overlap",
    [(True, (5, 20, 9, 14), False), (False, (5, 20), False), (True, (60, 3), False),
     (True, (5, 20, 9, 14), True), (False, (5, 20), True)],
)  # fmt: skip
def test_heads_left_behind_catch_up_to_the_same_states(engine, drafts_again, lengths, overlap):
    """Rounds that draft nothing leave the heads behind (Drafter.stays_behind): no head pass runs until the
    sequence drafts again (here from its 17th to 20th decode step on: catch-ups of every length modulo a
    verify's 4 positions) or the trunk's ring would drop a row they need; then a catch-up pass and a last
    piece of a verify's shape cover every position, the deep heads' positions that read drafts in the
    last, each level's ring written
    after the next level has read the older rows it needs. A prompt longer than a step's tokens (60 > 48: chunked
    prefill) keeps them current through its chunks. The heads' KV rows, sconv states and drafts equal
    those of an engine whose heads kept up every step. With overlap, the steps that will not draft next run
    overlapped (runtime/overlap.py), the heads settling each one after its successor was launched."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]

    def run_steps(keep_up: bool):
        eng = LLMEngine(engine, overlap=overlap and not keep_up)
        drafter = eng.runner.drafter
        if keep_up:
            drafter.stays_behind = lambda w: False
        resume = {}  # a sequence's stats -> the decode step it drafts from: 17, 18, 19, 20 in turn
        eng.spec.draft_policy = lambda stats, requested: (
            requested
            if drafts_again and stats.steps >= resume.setdefault(id(stats), 17 + len(resume) % 4)
            else 0
        )
        passes, head_pass = [], drafter._head_pass
        drafter._head_pass = lambda m, args, drafting, catchup=False: (
            passes.append((m, catchup)) or head_pass(m, args, drafting, catchup)
        )
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_tokens=96 - max(lengths), ignore_eos=True, num_draft_tokens=3)
            eng.add_request(f"r{i}", PromptInput(ids), params)
        for _ in range(min(60, 96 - max(lengths) - 6)):  # short of max_tokens: no request ends
            eng.step()
        return eng, [eng.requests[f"r{i}"].seq for i in range(len(prompts))], passes

    behind, seqs, few = run_steps(keep_up=False)
    current, kept, every = run_steps(keep_up=True)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in kept]
    assert (behind.stats.overlapped_steps > 10) == overlap and not current.stats.overlapped_steps
    # where drafting resumes, the first rounds' passes saved but for the catch-ups'; where it does not, all but
    # the catch-ups when the ring fills
    saved = len(few) < len(every) - 3 * 6 if drafts_again else len(few) < len(every) / 3
    assert few and saved, (len(few), len(every))
    if drafts_again:  # each sequence's catch-up (under 64 positions) takes one catch-up pass a head, at most
        assert 0 < sum(catchup for _, catchup in few) <= 3 * len(prompts), few
    for seq, ref in zip(seqs, kept):
        if drafts_again:
            assert seq.drafts == ref.drafts and seq.head_computed == ref.head_computed
        # never further behind than the ring (with overlap, the step in flight fed one more token)
        assert seq.num_computed - seq.head_computed[0] <= TRUNK_RING + (behind._inflight is not None)
        for d, n in enumerate(seq.head_computed):
            for a, b in zip(kv_rows(behind.runner, seq, d, range(n), True),
                            kv_rows(current.runner, ref, d, range(n), True)):  # fmt: skip
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            if drafts_again:
                for a, b in zip(behind.runner.head_conv_states[d], current.runner.head_conv_states[d]):
                    torch.testing.assert_close(a[seq.slot], b[ref.slot], rtol=1e-5, atol=1e-5)

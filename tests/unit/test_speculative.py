"""Acceptance for speculative decoding: greedy exact match, rejection sampling's output distribution,
the degenerate cases, acceptance statistics and the adaptive number of drafts."""

import pytest
import torch
from scipy.stats import chi2

from runtime.speculative import (
    AcceptanceStats,
    RoundCosts,
    accept_targets,
    greedy_accept,
    next_num_drafts,
    one_hot_probs,
    rejection_sample,
)

V, K = 6, 3
P_FAIL = 1e-4  # each chi-square test fails a correct sampler with this probability (fixed seeds here)


def logits_with_argmax(argmaxes, v=V):
    x = torch.zeros(len(argmaxes), v)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return x


# Greedy.
def test_greedy_all_accepted_plus_bonus():
    assert greedy_accept([1, 2, 3], logits_with_argmax([1, 2, 3, 4])) == ([1, 2, 3, 4], 3)


def test_greedy_first_rejected():
    assert greedy_accept([1, 2, 3], logits_with_argmax([5, 2, 3, 4])) == ([5], 0)


def test_greedy_middle_rejected():
    assert greedy_accept([1, 2, 3], logits_with_argmax([1, 0, 3, 4])) == ([1, 0], 1)
    assert greedy_accept([1, 2, 3], logits_with_argmax([1, 2, 0, 4])) == ([1, 2, 0], 2)


def test_greedy_no_drafts_and_shapes():
    assert greedy_accept([], logits_with_argmax([4])) == ([4], 0)
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        greedy_accept([1, 2], logits_with_argmax([1, 2]))


def test_accept_targets_equals_greedy_accept():
    """The engine verifies greedy drafts against every row's argmax read at once (accept_targets)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=g))
        logits = torch.randn(k + 1, V, generator=g)
        targets = logits.argmax(-1).tolist()
        drafts = [t if torch.rand(1, generator=g) < 0.7 else (t + 1) % V for t in targets[:k]]
        assert accept_targets(drafts, targets) == greedy_accept(drafts, logits)
    with pytest.raises(ValueError, match="2 drafts need 3 targets"):
        accept_targets([1, 2], [1, 2])


# Rejection sampling: the output distribution.
def random_dists(seed):
    """Draft rows q [K, V] and target rows p [K+1, V], with zeros in both; q resembles p, as a draft
    model's distribution does, so that later positions are reached often enough to be tested."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=g) ** 2
    p = p / p.sum(-1, keepdim=True)
    noise = torch.rand(K, V, generator=g)
    q = 0.6 * p[:K] + 0.4 * noise / noise.sum(-1, keepdim=True)  # a draft close to the target
    q[0, 2] = 0.0  # never drafted at position 0
    p[0, 4] = 0.0  # never emitted first, though the draft proposes it
    p[1, 1] = 0.0
    return q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)


def chi_square(counts, probs):
    """Pearson's statistic over the categories with probs > 0 and its p=P_FAIL critical value;
    any count on a zero-probability category is an outright failure."""
    counts, probs = torch.as_tensor(counts, dtype=torch.float64), probs.double()
    n = counts.sum()
    assert n > 1000, f"too few samples ({int(n)}) for the test"
    assert counts[probs == 0].sum() == 0, "emitted a token of target probability 0"
    live = probs > 0
    expected = n * probs[live]
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return stat, float(chi2.ppf(1 - P_FAIL, int(live.sum()) - 1))


def emitted_counts(sampler, q, p, n, seed, greedy=False):
    """counts[j] over the j-th emitted token of each step that emitted one (j = 0..K)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(K + 1, V, dtype=torch.long)
    q_used = one_hot_probs(q.argmax(-1).tolist(), V) if greedy else q
    for _ in range(n):
        if greedy:
            drafts = q.argmax(-1).tolist()
        else:
            drafts = torch.multinomial(q, 1, generator=g).flatten().tolist()  # d_i ~ q_i
        for j, t in enumerate(sampler(drafts, q_used, p, g)):
            counts[j, t] += 1
    return counts


def test_rejection_sampling_emits_the_target_distribution():
    """V=6, k=3, random draft and target rows (fixed per position, so the j-th emitted token, when a
    step emits one, must follow target row j). 16,000 steps; each of the 4 positions is tested with
    Pearson's chi-square (df = live categories - 1) against its critical value at p = 1e-4: a correct
    sampler fails one of them with probability < 4e-4 over seeds (this seed is fixed)."""
    q, p = random_dists(0)
    counts = emitted_counts(rejection_sample, q, p, 16000, seed=1)
    for j in range(K + 1):  # the first emitted token, the second when drafts 0 was accepted, ...
        stat, critical = chi_square(counts[j], p[j])
        assert stat < critical, f"emitted token {j}: chi-square {stat:.1f} >= {critical:.1f}"
    assert counts[1].sum() > 0.3 * counts[0].sum()  # the drafts do get accepted


def test_the_chi_square_test_catches_a_biased_sampler():
    """Power check: resampling from p itself after a rejection (instead of the residual) is biased."""

    def naive(drafts, q, p, g):
        out = rejection_sample(drafts[:1], q[:1], p[:2], g)
        if len(out) == 1:
            out = [int(torch.multinomial(p[0], 1, generator=g))]
        return out

    q, p = random_dists(0)
    counts = emitted_counts(naive, q, p, 16000, seed=1)
    stat, critical = chi_square(counts[0], p[0])
    assert stat > critical


def test_greedy_drafts_with_one_hot_draft_probs_keep_the_target():
    """Argmax drafts, q one-hot: the first emitted token still follows p[0] (chi-square, p = 1e-4)."""
    q, p = random_dists(2)
    counts = emitted_counts(rejection_sample, q, p, 8000, seed=3, greedy=True)
    for j in range(2):
        stat, critical = chi_square(counts[j], p[j])
        assert stat < critical, f"emitted token {j}: chi-square {stat:.1f} >= {critical:.1f}"


# Rejection sampling: degenerate cases.
def one_hot(i, v=V):
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(K + 1, V, generator=g), -1)
    for _ in range(50):
        drafts = torch.multinomial(p[:K], 1, generator=g).flatten().tolist()
        assert rejection_sample(drafts, p[:K], p, g)[:K] == drafts


def test_draft_probability_zero():
    g = torch.Generator().manual_seed(0)
    q = one_hot(0).unsqueeze(0)  # the draft distribution gives token 3 probability 0
    p_pos = torch.stack([torch.full((V,), 1 / V), one_hot(5)])
    for _ in range(20):  # p(3) > 0: min(1, p/0) = 1, always accepted
        assert rejection_sample([3], q, p_pos, g) == [3, 5]
    # p(3) = 0 too, and p == q: rejected, the residual is all zeros, so the correction comes from p.
    p_same = torch.stack([one_hot(0), one_hot(5)])
    for _ in range(20):
        assert rejection_sample([3], q, p_same, g) == [0]


def test_target_probability_zero_is_never_accepted():
    g = torch.Generator().manual_seed(0)
    q = torch.full((1, V), 1 / V)
    p = torch.stack([one_hot(2), one_hot(5)])
    for d in range(V):
        assert rejection_sample([d], q, p, g) == ([2, 5] if d == 2 else [2])


def test_greedy_draft_against_a_one_hot_target():
    g = torch.Generator().manual_seed(0)
    q = one_hot_probs([1, 4], V)
    assert rejection_sample([1, 4], q, torch.stack([one_hot(1), one_hot(4), one_hot(0)]), g) == [1, 4, 0]
    assert rejection_sample([1, 4], q, torch.stack([one_hot(1), one_hot(2), one_hot(0)]), g) == [1, 2]
    assert rejection_sample([], q[:0], one_hot(3).unsqueeze(0), g) == [3]
    with pytest.raises(ValueError, match=r"\[k, V\]"):
        rejection_sample([1, 4], q[:1], torch.stack([one_hot(1), one_hot(4), one_hot(0)]), g)


# Statistics and the adaptive number of drafts.
def test_acceptance_stats():
    s = AcceptanceStats(max_drafts=4)
    s.update(4, 4)  # 5 tokens
    s.update(4, 1)  # 2 tokens
    s.update(2, 0)  # 1 token
    s.update(0, 0)  # 1 token, no drafts
    assert s.steps == 4 and s.tokens == 9 and s.mean_acceptance_length == 9 / 4
    assert s.proposed == [3, 3, 2, 2] and s.accepted == [2, 1, 1, 1]
    assert s.acceptance_rates == [2 / 3, 1 / 3, 1 / 2, 1 / 2]
    assert s.ema[0] == pytest.approx(0.9) and s.ema[1] == pytest.approx(0.81)  # alpha 0.1: 1,1,0 and 1,0,0
    assert AcceptanceStats().mean_acceptance_length == 0.0
    with pytest.raises(ValueError):
        s.update(2, 3)


def run_policy(rates_by_position, steps, requested=8, **kw):
    """Each step accepts a fixed number of drafts: the longest prefix whose per-position acceptance
    (deterministic here) says yes. Returns the stats and the drafts of the last step."""
    s = AcceptanceStats()
    n = 0
    for _ in range(steps):
        n = next_num_drafts(s, requested, **kw)
        accepted = 0
        while accepted < n and rates_by_position[accepted]:
            accepted += 1
        s.update(n, accepted)
    return s, next_num_drafts(s, requested, **kw)


def test_policy_drafts_everything_while_acceptance_is_high():
    s, n = run_policy([1] * 8, 100)
    assert n == 8 and s.mean_acceptance_length == 9.0


def test_policy_drops_positions_whose_acceptance_stays_low():
    s = AcceptanceStats()
    assert next_num_drafts(s, 8) == 8  # step 0 is a probe; the EMAs start at 1
    # Positions 1-3 always accepted, position 4 never: positions >= 4 fall below the threshold.
    s, _ = run_policy([1, 1, 1, 0, 0, 0, 0, 0], 40, probe_interval=1000)
    assert next_num_drafts(s, 8, probe_interval=1000) == 3
    assert next_num_drafts(s, 2, probe_interval=1000) == 2  # never more than requested
    assert next_num_drafts(s, 0) == 0


def test_policy_keeps_one_draft_until_position_1_falls_below_the_floor():
    s = AcceptanceStats(alpha=0.1)
    s.ema = [0.1, 0.0, 0, 0, 0, 0, 0, 0]  # below the threshold 0.25, above the floor 0.05
    s.steps = 1
    assert next_num_drafts(s, 8) == 1
    s.ema[0] = 0.04
    assert next_num_drafts(s, 8) == 0
    assert next_num_drafts(s, 8, probe_interval=1) == 8  # a probe step drafts everything


def test_policy_probes_and_recovers():
    s, _ = run_policy([0] * 8, 64, probe_interval=16)  # nothing accepted: down to 0 drafts
    assert next_num_drafts(s, 8, probe_interval=16) == 8  # step 64 is a probe
    s.update(0, 0)
    assert next_num_drafts(s, 8, probe_interval=16) == 0
    # Acceptance comes back: the probes (and then every step) raise the EMAs until all 8 are drafted.
    s2 = AcceptanceStats()
    s2.ema = [0.0] * 8
    for _ in range(16 * 40):
        n = next_num_drafts(s2, 8, probe_interval=16)
        s2.update(n, n)
    assert next_num_drafts(s2, 8, probe_interval=16) == 8


def measured(costs: RoundCosts, batch: int, seconds: dict[int, float], times: int = 1) -> None:
    for _ in range(times):
        for drafts, t in seconds.items():
            costs.record(batch, drafts, t)


def test_round_costs_explore_then_keep_what_pays():
    """The cost side of the draft policy: at a batch bucket the most drafts asked for and none are measured
    first, then the number whose expected tokens per second are highest (those between priced by
    interpolation) is kept."""
    from runtime.speculative import batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    costs = RoundCosts()
    wants = [([0.9, 0.8, 0.7], 3)] * 4
    assert costs.cap([([1.0], 0)] * 4) == 0  # nobody drafts: nothing to measure
    tried = []
    for _ in range(3):
        tried.append(cap := costs.cap(wants))
        costs.record(4, cap, 0.010 + 0.002 * cap)
    assert tried == [3, 0, 3] and (4, 2) not in costs.seconds  # 2 drafts: priced, never worth a round
    assert costs.cap(wants) == 3  # 3.4 tokens a sequence in 16 ms beats 1 in 10 ms
    # a batch of 3 shares the bucket of 4; a batch of 5 has its own, still unmeasured
    assert costs.cap(wants[:3]) == 3 and costs.cap(wants * 2) == 3 and (8, 3) not in costs.seconds
    # the EMA follows a cost that moved: drafting became dear
    measured(costs, 4, {1: 0.030, 2: 0.050, 3: 0.070}, times=20)
    assert costs.cap(wants) == 0


def test_round_costs_try_a_number_between_only_where_its_estimate_pays():
    """Depths that accept nothing (random ones: their EMAs fall while 3 drafts are measured) cost the two ends'
    rounds and no more: 1 and 2 drafts, priced between the ends, never beat none. Where a round's cost rises
    steeply past one draft, the estimate of 1 draft wins, so it is tried, measured, and kept."""
    costs = RoundCosts()
    plain, three = 0.0034, 0.0122  # H100, batch 1 (test_round_costs_on_measured_h100_rounds)
    tried = []
    ema = [0.81, 0.81, 0.81]  # after two rounds of 3 drafts that accepted nothing (EMAs start at 1.0)
    for _ in range(6):
        tried.append(cap := costs.cap([(ema, 3)]))
        costs.record(1, cap, {0: plain, 3: three}.get(cap, 0.5))
    assert tried == [3, 0, 0, 0, 0, 0]
    assert (
        costs.cap([(ema, 2)]) == 0
    )  # 2 drafts asked for (a sequence near its end): priced below 3, not tried
    costs = RoundCosts()
    ema = [0.9, 0.3, 0.3]  # position 1 pays, the others hardly
    measured(costs, 1, {3: 0.0122, 0: 0.0034})
    assert costs.cap([(ema, 3)]) == 1  # (1 + 0.9) / 6.3 ms, interpolated, beats 1 / 3.4 ms and 2.5 / 12.2 ms
    costs.record(1, 1, 0.0050)
    assert costs.cap([(ema, 3)]) == 1 and costs.seconds[(1, 1)] == pytest.approx(0.0050)


def test_round_costs_on_measured_h100_rounds():
    """bench/results/gpu-2026-12-06/h100-rounds: plain steps of 3.4, 6.8, 11.3 and 13.6 ms and rounds of 3
    drafts of 12.2, 21.7, 34.9 and 50.7 ms at batch 1, 8, 32 and 64 (inkling-bench, 2K prompts). With depths
    whose positions yield 0.8, 0.75 and 0.7 (2.25 drafts a round, near the trained small model's), 3 drafts
    pay at batch 8 and 32, not at batch 1 or 64; the tokens that the sequences not drafting emit count too."""
    costs = RoundCosts()
    rounds = {1: (3.4, 12.2), 8: (6.8, 21.7), 32: (11.3, 34.9), 64: (13.6, 50.7)}
    for batch, (plain, three) in rounds.items():
        measured(costs, batch, {0: plain / 1e3, 1: 1.0, 2: 1.0, 3: three / 1e3})  # 1 and 2 drafts: dear
    ema = [0.8, 0.75, 0.7]
    assert {b: costs.cap([(ema, 3)] * b) for b in rounds} == {1: 0, 8: 3, 32: 3, 64: 0}
    # at batch 32, 26 sequences that never draft make a round of 6 drafting ones not pay
    assert costs.cap([(ema, 3)] * 6, batch=32) == 0
    # better depths (0.95 a position) pay at batch 64 too
    assert costs.cap([([0.95] * 3, 3)] * 64) == 3


def test_round_costs_revisit_the_least_recent_measure():
    """Every `revisit` measured rounds of a bucket, the number of drafts measured least recently is tried
    again (two rounds in a row: a round is measured after one of its kind), so a choice can change back."""
    costs = RoundCosts(revisit=10)
    wants = [([0.9, 0.9], 2)] * 2
    measured(costs, 2, {0: 0.01, 1: 0.05, 2: 0.09})
    assert costs.cap(wants) == 0
    measured(costs, 2, {0: 0.01}, times=9)  # 1 drafts, measured before these, is now 10 rounds old
    assert costs.cap(wants) == 1 and costs.cap(wants) == 1  # tried until measured again
    costs.record(2, 1, 0.011)
    assert costs.cap(wants) == 2  # then 2's turn (its measure is as old), then the choice itself
    costs.record(2, 2, 0.012)
    assert costs.cap(wants) == 2  # 2.8 tokens a sequence in 12 ms


def test_inverse_cdf_draws_never_pick_a_zero_probability_token():
    """The sampler under rejection sampling (`_sample`): zero-probability tokens, leading, inner and
    trailing, are never drawn; the others as often as their weights say (unnormalised weights)."""
    from runtime.speculative import _sample

    weights = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.0, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = [_sample(weights, g) for _ in range(4000)]
    assert set(draws) == {1, 3}
    assert abs(draws.count(3) / len(draws) - 0.75) < 0.03


def test_rows_drawn_together_equal_one_draw_each():
    """`draw_rows` (the engine's corrections and bonuses, every row at once on the device) draws what
    `_sample` draws from each row's residual at the same uniform: rows with a token removed, rows whole,
    a row whose only mass is the removed token (then the whole row), zero-probability tails."""
    from runtime.speculative import _sample, draw_rows

    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 50, generator=g) * 3, -1)
    probs[2] = 0.0
    probs[2, 7] = 1.0  # its removed token holds all the mass
    probs[3, 40:] = 0.0
    probs[3] /= probs[3].sum()
    rows, removed = [0, 1, 2, 3, 5, 0], [4, -1, 7, 39, 10, -1]
    want, uniforms = [], []
    for r, d in zip(rows, removed):
        p = probs[r].double()
        residual = p.clone()
        if d >= 0:
            residual = (p - one_hot_probs([d], 50)[0].double()).clamp(min=0)
        if not residual.sum() > 0:
            residual = p
        state = g.get_state()
        want.append(_sample(residual, g))
        g.set_state(state)
        uniforms.append(float(torch.rand((), generator=g, dtype=torch.float64)))
    assert draw_rows(probs, rows, removed, uniforms) == want
    assert want[2] == 7 and want[3] < 40

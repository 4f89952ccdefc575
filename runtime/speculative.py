"""Speculative decoding's acceptance, pure torch (no engine): greedy exact match, Leviathan et al.'s
rejection sampling, acceptance statistics and an adaptive number of drafts.

A step verifies k drafts d_0..d_{k-1} with the main model's k+1 rows of logits (or probabilities):
row i is the target distribution for the token at draft i's place, given the prefix and d_0..d_{i-1};
row k is the bonus row, used when all k drafts are accepted. Every step emits between 1 and k+1
tokens: the accepted drafts, then one token of the target's own (the correction at the first
rejection, or the bonus). Rows must already be cut to the real vocabulary (no padded rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def _check(draft_ids: Sequence[int], target: torch.Tensor, name: str) -> int:
    k = len(draft_ids)
    if target.dim() != 2 or target.shape[0] < k + 1:
        raise ValueError(f"{name} must be [k+1, V] = [{k + 1}, V] for {k} drafts, got {list(target.shape)}")
    return k


def greedy_accept(draft_ids: Sequence[int], target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Exact match: accept drafts while each equals the argmax of its target row, then append the
    target's argmax at the first mismatch (or the bonus row's argmax after all k).

    Returns (emitted tokens, number of accepted drafts); len(emitted) == accepted + 1. This is what
    greedy decoding without drafts would emit, token for token. torch.argmax takes the first index
    among exact ties, as the greedy sampler does.
    """
    k = _check(draft_ids, target_logits, "target_logits")
    return accept_targets(draft_ids, target_logits[: k + 1].argmax(dim=-1).tolist())


def accept_targets(draft_ids: Sequence[int], targets: Sequence[int]) -> tuple[list[int], int]:
    """greedy_accept from the target rows' argmaxes (a batch's, read in one transfer)."""
    k = len(draft_ids)
    if len(targets) < k + 1:
        raise ValueError(f"{k} drafts need {k + 1} targets, got {len(targets)}")
    accepted: list[int] = []
    for i, d in enumerate(draft_ids):
        if int(d) != targets[i]:
            return [*accepted, targets[i]], i
        accepted.append(int(d))
    return [*accepted, targets[k]], k


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from the categorical `probs` (float64 [V], non-negative, not necessarily normalised) by its
    inverse CDF: token j where cdf[j-1] <= u * total < cdf[j], u ~ U[0, 1). A token of probability 0 owns an
    empty interval and is never drawn. One cumulative sum and one binary search: over the real Inkling's
    200K tokens 0.4 ms on the CPU, where torch.multinomial took 5.6 ms on the H200 host (an MTP round's
    largest cost at temperature 1, bench/results/gpu-2026-12-04/profiles/mtp3-batch1.txt)."""
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator, device=probs.device, dtype=torch.float64)
    j = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if j >= len(cdf):  # u * total rounded up to the total: the last token that has probability
        j = int(probs.nonzero()[-1])
    return j


def rejection_sample(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): the emitted tokens
    are distributed exactly as sampling from the target autoregressively.

    draft_probs [k, V]: row i is the distribution draft i was drawn from, q_i. target_probs [k+1, V]:
    p_i (rows summing to 1, after temperature/top-k/top-p). For each i in order: accept d_i with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a sample of
    normalize(max(0, p_i - q_i)) and stop; if all k are accepted, emit a bonus sample of p_k.
    Returns the emitted tokens (accepted drafts, then the correction or bonus): the number of
    accepted drafts is len(result) - 1.

    Greedy (argmax) drafts: pass q_i one-hot at d_i (`one_hot_probs`). Then d_i is accepted with
    probability p_i(d_i), and a rejection samples p_i with d_i removed: the output is still exactly p_i.

    Edge cases. The test is written u * q < p with u ~ U[0, 1), so no division: q(d) = 0 (a draft
    its own distribution could not have drawn) is accepted iff p(d) > 0 (min(1, p/0) = 1), and a
    token with p(d) = 0 is never accepted. When the residual max(0, p - q) is all zeros (p <= q
    everywhere, i.e. p == q, so a rejection happens only through rounding), the correction is
    sampled from p itself. `generator` must live on the tensors' device.
    """
    k = _check(draft_ids, target_probs, "target_probs")
    if draft_probs.shape[0] < k or draft_probs.shape[-1] != target_probs.shape[-1]:
        raise ValueError(
            f"draft_probs must be [k, V] = [{k}, {target_probs.shape[-1]}], got {list(draft_probs.shape)}"
        )
    device = target_probs.device
    emitted: list[int] = []
    for i, d in enumerate(draft_ids):
        d = int(d)
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=device, dtype=torch.float64)
        if bool(u * q[d].double() < p[d].double()):
            emitted.append(d)
            continue
        # Whole rows in float64 only here, at the one rejection.
        residual = (p.double() - q.double()).clamp(min=0)
        if not bool(residual.sum() > 0):
            residual = p.double()
        return [*emitted, _sample(residual, generator)]
    return [*emitted, _sample(target_probs[k].double(), generator)]


def draw_rows(probs: torch.Tensor, rows: list[int], removed: list[int], uniforms: list[float]) -> list[int]:
    """For each i, a draw from row rows[i] of `probs` [N, V] with token removed[i] taken out (-1: none; the
    residual max(0, p - q) of a rejected one-hot draft), or from the whole row where that leaves nothing:
    `_sample` at uniform uniforms[i], every row at once on the rows' device (one read back)."""
    if not rows:
        return []
    device = probs.device
    p = probs[torch.tensor(rows, device=device)].double()
    residual = p.clone()
    cut = [(i, d) for i, d in enumerate(removed) if d >= 0]
    if cut:
        residual[[i for i, _ in cut], [d for _, d in cut]] = 0.0
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    cdf = residual.cumsum(-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # u * total rounded up to the total: the last token that has probability
    last = residual.shape[1] - 1 - (residual > 0).flip(-1).int().argmax(-1)
    return torch.minimum(picked, last).tolist()


def one_hot_probs(draft_ids: Sequence[int], vocab_size: int, device=None) -> torch.Tensor:
    """draft_probs [k, V] for greedy drafts: each row one-hot at its draft."""
    q = torch.zeros(len(draft_ids), vocab_size, device=device)
    if len(draft_ids):
        q[torch.arange(len(draft_ids), device=device), torch.tensor(list(draft_ids), device=device)] = 1.0
    return q


@dataclass
class AcceptanceStats:
    """Counts over the steps of one sequence (or one engine), and an EMA per draft position.

    Position i (1-based) is *proposed* in a step that drafted >= i tokens and *accepted* when drafts
    1..i were all accepted; `acceptance_rates[i-1]` = accepted / proposed is that unconditional rate
    (the chance that drafting position i yields a token). `ema[i-1]` follows the same 0/1 outcome
    with weight `alpha`, updated only in steps that proposed position i; it starts at 1.0
    (optimistic: draft everything until evidence says otherwise).
    """

    max_drafts: int = 8
    alpha: float = 0.1
    steps: int = 0
    tokens: int = 0  # emitted, bonus/correction included
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    ema: list[float] = field(default_factory=list)

    def __post_init__(self):
        n = self.max_drafts
        self.proposed = self.proposed or [0] * n
        self.accepted = self.accepted or [0] * n
        self.ema = self.ema or [1.0] * n

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """Record one step that drafted `num_drafts` tokens and accepted the first `num_accepted`."""
        if not 0 <= num_accepted <= num_drafts <= self.max_drafts:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted}) <= drafts ({num_drafts}) <= {self.max_drafts}"
            )
        self.steps += 1
        self.tokens += num_accepted + 1
        for i in range(num_drafts):
            hit = i < num_accepted
            self.proposed[i] += 1
            self.accepted[i] += hit
            self.ema[i] = (1 - self.alpha) * self.ema[i] + self.alpha * float(hit)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per step, bonus included (1.0 means no draft was ever accepted); steps that
        drafted nothing count, with their one token."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts, all positions together (0.0 before any draft)."""
        proposed = sum(self.proposed)
        return sum(self.accepted) / proposed if proposed else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position: accepted / proposed (0.0 where never proposed)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def counters(self) -> dict[str, int]:
        """Running totals as vLLM's speculative-decoding metrics count them: steps that drafted, draft
        tokens proposed, drafts accepted, and accepted per position (`spec_accepted_{i}`, 1-based)."""
        out = {"spec_drafts": self.proposed[0], "spec_draft_tokens": sum(self.proposed),
               "spec_accepted_tokens": sum(self.accepted)}  # fmt: skip
        return out | {f"spec_accepted_{i + 1}": n for i, n in enumerate(self.accepted)}


def draft_every_step(stats: AcceptanceStats, requested: int) -> int:
    """A draft policy that always drafts what the request asks (benchmarks of the cost side: synthetic heads
    accept nothing, so the adaptive policy would stop drafting)."""
    return requested


def next_num_drafts(
    stats: AcceptanceStats,
    requested: int,
    threshold: float = 0.25,
    floor: float = 0.05,
    probe_interval: int = 32,
) -> int:
    """How many drafts the next step makes, at most `requested` (and at most stats.max_drafts).

    - Probe: every `probe_interval`-th step (stats.steps % probe_interval == 0, so also the first)
      drafts `requested`, so that positions no longer drafted keep being measured and can recover.
    - Otherwise, if ema[0] (position 1) < `floor`: 0 drafts (speculation is not paying at all).
    - Otherwise the longest prefix 1..n whose positions 2..n all have ema >= `threshold`; position 1
      is always kept (n >= 1) while its ema is at least the floor.
    """
    requested = min(requested, stats.max_drafts)
    if requested <= 0:
        return 0
    if probe_interval > 0 and stats.steps % probe_interval == 0:
        return requested
    if stats.ema[0] < floor:
        return 0
    n = 1
    while n < requested and stats.ema[n] >= threshold:
        n += 1
    return n


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch`: rounds of nearby sizes share one cost estimate."""
    return 1 << max(0, batch - 1).bit_length()


def expected_tokens(ema: Sequence[float], num_drafts: int) -> float:
    """Tokens a step with `num_drafts` drafts is expected to emit: the bonus or correction, plus each
    position's chance of yielding a token (AcceptanceStats.ema, unconditional)."""
    return 1.0 + sum(ema[:num_drafts])


@dataclass
class RoundCosts:
    """The cost side of the draft policy: what a decode round takes at a batch size, by the most drafts a
    sequence of it makes (0: the heads only keep up). `next_num_drafts` is the acceptance side; together
    they keep a round's drafts only where its expected tokens per second beat fewer drafts': an MTP round
    verifies (k + 1) tokens a sequence, whose routed experts differ, and runs k depths, so at a large
    batch (or with little acceptance) it can cost more than the extra tokens are worth.

    Seconds are EMAs of measured rounds per (batch bucket, drafts), restarted by a revisit. A round is
    measured only when the round before it was a decode round of the same batch size and drafts: the first
    round after a change (a new cap, a prefill, a new sequence, a graph capture) carries work of the other
    kind. At a bucket the two ends are measured first, the most drafts asked for (unless more were measured)
    and none; a number in between is priced by interpolating between its measured neighbours and tried only
    when that estimate makes it the best (depths that accept nothing then cost two exploring rounds, not
    six). Every `revisit` measured rounds of a bucket the number measured least recently is tried again, so
    costs that move (longer contexts, other traffic) are seen and the sequences' acceptance EMAs keep being
    fed while drafting is off."""

    alpha: float = 0.25
    revisit: int = 256
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    measured_at: dict[tuple[int, int], int] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)  # measured rounds per bucket

    def record(self, batch: int, drafts: int, seconds: float) -> None:
        """One measured round of `batch` sequences whose longest draft was `drafts`."""
        key = (bucket := batch_bucket(batch), drafts)
        rounds = self.rounds.get(bucket, 0)
        old = self.seconds.get(key)
        if old is None or rounds - self.measured_at[key] >= self.revisit:  # new, or a revisit: stale
            self.seconds[key] = seconds
        else:
            self.seconds[key] = (1 - self.alpha) * old + self.alpha * seconds
        self.rounds[bucket] = rounds + 1
        self.measured_at[key] = self.rounds[bucket]

    def cap(self, wants: Sequence[tuple[Sequence[float], int]], batch: int | None = None) -> int:
        """The most drafts a sequence of the next round makes. `wants`: each drafting sequence's acceptance
        EMAs and the drafts the acceptance side gives it; `batch`: the round's sequences, those that never
        draft included (one token each; default len(wants)). 0 where no number of drafts pays."""
        top = max((n for _, n in wants), default=0)
        if top == 0:
            return 0
        batch = len(wants) if batch is None else batch
        bucket = batch_bucket(batch)
        known = sorted(c for b, c in self.seconds if b == bucket)  # measured numbers of drafts, any
        if not known or known[-1] < top:  # the upper end: a number at least `top` (fewer drafts near a
            return top  # sequence's end are priced below one measured)
        if known[0] != 0:
            return 0
        caps = range(top + 1)
        stale = min((c for c in known if c <= top), key=lambda c: self.measured_at[(bucket, c)])
        if self.rounds[bucket] - self.measured_at[(bucket, stale)] >= self.revisit:
            return stale

        def seconds(c: int) -> float:
            if (bucket, c) in self.seconds:
                return self.seconds[(bucket, c)]
            below = max(k for k in known if k < c)
            above = min(k for k in known if k > c)
            lo, hi = self.seconds[(bucket, below)], self.seconds[(bucket, above)]
            return lo + (hi - lo) * (c - below) / (above - below)

        def rate(c: int) -> float:
            tokens = sum(expected_tokens(ema, min(n, c)) for ema, n in wants) + batch - len(wants)
            return tokens / seconds(c)

        return max(caps, key=rate)  # an unmeasured best is tried: its round measures it

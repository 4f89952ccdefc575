"""MTP speculative decoding, the engine's side: verifying a step's drafts (greedy exact match or rejection
sampling), rolling rejected drafts back, keeping the heads' states on real tokens, and drafting the next
step's tokens under the acceptance policy. The acceptance rules themselves are runtime/speculative.py;
the heads' passes are runtime/drafter.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .block_manager import BlockManager
from .drafter import HeadWork
from .outputs import RequestState
from .sampler import target_probs, token_logprobs
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .speculative import (
    AcceptanceStats,
    RoundCosts,
    accept_targets,
    draft_every_step,
    draw_rows,
    greedy_accept,
    next_num_drafts,
)

if TYPE_CHECKING:
    from .model_runner import ModelRunner


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, max_draft_len: int, num_real_tokens: int):
        self.runner = runner
        self.blocks = blocks
        self.max_draft_len = max_draft_len
        self.num_real_tokens = num_real_tokens
        self.acceptance = AcceptanceStats()  # over every MTP step of the engine's life
        # How many drafts a sequence's next step makes (stats, requested) -> n: the adaptive policy, or
        # speculative.draft_every_step where a benchmark wants every step to draft.
        self.draft_policy = next_num_drafts
        # The cost side (speculative.RoundCosts): measured rounds cap the drafts where more do not pay; None
        # leaves the acceptance side alone (LLMEngine(draft_costs=False), benchmarks of fixed drafts).
        self.round_costs: RoundCosts | None = RoundCosts()
        self._last_round: tuple[int, int, float] | None = None  # (batch, drafts, end) of a decode round

    def fix_drafts(self) -> None:
        """Draft what each request asks in every step, whatever it costs or accepts (benchmarks of the cost
        side: synthetic depths accept nothing, so the adaptive policy would stop drafting)."""
        self.draft_policy = draft_every_step
        self.round_costs = None

    # Verification.
    def verify_sampled(
        self,
        batch: list[ScheduledSeq],
        logits: torch.Tensor,
        rows: list[int],
        generator_of: Callable[[Sequence], torch.Generator | None],
    ) -> dict[int, list[int]]:
        """The tokens each sampled verify in `batch` emits (batch index -> 1..k+1 tokens): rejection sampling
        (speculative.rejection_sample with q one-hot at each greedy draft) against its rows' target
        distributions (after temperature, top-k, top-p, over the real tokens), the rows staying on the device.

        Draft i is accepted when u_i < p_i(d_i); at the first rejection the correction is drawn from p_i with
        d_i removed (max(0, p_i - q_i)), after all of them the bonus from p_k. The host reads the drafts'
        probabilities (one small read), draws each u_i from the request's own generator, and the device draws
        every correction or bonus by inverse CDF from a uniform the host drew next (`speculative._sample`'s
        draw, row-wise), read back in one more small read. Neither [k + 1, V] rows nor V-wide float64 work
        reach the host: at the real Inkling's 200K tokens and batch 64 those rows were 205 MB a step.
        generator_of(seq): the request's generator for its drafts' draws (RequestState.draft_generator)."""
        want = [
            b
            for b, s in enumerate(batch)
            if s.samples and s.num_drafts and not s.seq.params.greedy and not s.seq.finished
        ]
        if not want:
            return {}
        V = self.num_real_tokens
        real = logits[:, :V]
        probs = target_probs(
            real, [(rows[b], rows[b + 1]) for b in want], [batch[b].seq.params for b in want]
        )
        firsts, drafts, where = [], [], []
        first = 0
        for b in want:
            s = batch[b]
            ds = s.seq.drafts[: s.num_drafts]
            # A depth over a draft vocabulary may pick an id past the tokenizer's: the target gives it
            # probability 0, so it is rejected and nothing after it is read.
            n = next((i for i, d in enumerate(ds) if d >= V), len(ds))
            firsts.append(first)
            drafts.append(ds[:n])
            where += [(first + i, d) for i, d in enumerate(ds[:n])]
            first += s.num_drafts + 1
        p_draft = probs[[r for r, _ in where], [d for _, d in where]].tolist() if where else []
        out, pick_rows, removed, uniforms = {}, [], [], []
        j = 0
        for b, first, ds in zip(want, firsts, drafts):
            generator = generator_of(batch[b].seq)
            kept = []
            for i, d in enumerate(ds):
                u = float(torch.rand((), generator=generator, dtype=torch.float64))
                if u < p_draft[j + i]:
                    kept.append(d)
                    continue
                break
            j += len(ds)
            rejected = len(kept) < len(ds)
            pick_rows.append(first + len(kept))
            removed.append(ds[len(kept)] if rejected else -1)
            uniforms.append(float(torch.rand((), generator=generator, dtype=torch.float64)))
            out[b] = kept
        picks = draw_rows(probs, pick_rows, removed, uniforms)
        return {b: [*kept, pick] for (b, kept), pick in zip(out.items(), picks)}

    def verify(
        self,
        state: RequestState,
        num_drafts: int,
        logits: torch.Tensor,
        targets: list[int] | None,
        sampled: list[int] | None,
    ) -> tuple[list[int], list[float] | None, list[dict[int, float]] | None]:
        """The tokens a step with `num_drafts` drafts emits from its rows of `logits` (real vocabulary): greedy,
        exact match against `targets` (the rows' argmaxes, where given); sampled, the tokens rejection
        sampling drew (`verify_sampled`). 1..k+1 tokens, with their logprobs and top logprobs where the
        request asks (sampler.token_logprobs)."""
        seq, params = state.seq, state.seq.params
        drafts = seq.drafts[:num_drafts]
        if params.greedy:
            tokens, _ = greedy_accept(drafts, logits) if targets is None else accept_targets(drafts, targets)
        else:
            tokens = sampled
        if params.logprobs is None:
            return tokens, None, None
        return tokens, *token_logprobs(logits, tokens, params.logprobs)

    def record(self, state: RequestState, num_drafts: int, num_accepted: int) -> None:
        state.acceptance.update(num_drafts, num_accepted)
        self.acceptance.update(num_drafts, num_accepted)

    def discard_rejected(self, seq: Sequence) -> None:
        """After a verify: forget the rejected drafts the step fed (their KV by length, their sconv rows, their
        blocks) and settle the heads. The sconv rollbacks are deferred, applied with the step's others."""
        back = seq.num_computed - (len(seq) - 1)
        self.runner.rollback(seq.slot, back, defer=True)
        seq.num_computed -= back
        self.blocks.truncate(seq.blocks, len(seq))
        self.settle_heads(seq, defer=True)

    # The heads.
    def settle_heads(self, seq: Sequence, defer: bool = False) -> None:
        """After verification: roll each head back to its states whose inputs are all real tokens.

        The heads' last round stood on drafts head_drafts from token index drafts_from on; those that
        equal the tokens now known count as real. Head m's state at position t reads tokens up to t+m,
        so it stays valid iff t + m < drafts_from + (number of head drafts that proved right); a deep head
        of a short sequence may keep none (never fewer than none: a one-token prompt with 8 drafts)."""
        if seq.drafts_from is None:
            return
        known = seq.token_range(seq.drafts_from, len(seq))
        right = 0
        while right < min(len(known), len(seq.head_drafts)) and known[right] == seq.head_drafts[right]:
            right += 1
        counts = []
        for m in range(1, len(seq.head_computed) + 1):
            valid = max(0, min(seq.head_computed[m - 1], seq.drafts_from + right - m))
            counts.append(seq.head_computed[m - 1] - valid)
            seq.head_computed[m - 1] = valid
        self.runner.rollback_heads(seq.slot, counts, defer=defer)
        seq.head_drafts, seq.drafts_from = [], None

    def roll_back_heads(self, seq: Sequence, new_len: int) -> None:
        """A sequence cut to `new_len` tokens (LLMEngine.rollback): head m at position t reads tokens up to t+m,
        so each head keeps its positions below new_len - 1 - m."""
        seq.drafts, seq.head_drafts, seq.drafts_from = [], [], None
        counts = []
        for m in range(1, len(seq.head_computed) + 1):
            valid = max(0, min(seq.head_computed[m - 1], new_len - 1 - m))
            counts.append(seq.head_computed[m - 1] - valid)
            seq.head_computed[m - 1] = valid
        self.runner.rollback_heads(seq.slot, counts)

    def draft(
        self,
        heads: list[tuple[RequestState, torch.Tensor, int, int]],
        batch: int | None = None,
        followed: bool = False,
    ) -> None:
        """A round of the MTP heads over the sequences that stepped (state, their fresh hidden rows, the
        step's first position, the rows' offset in the step's output): catch up over the new positions and
        draft the next step's tokens, as many as the acceptance policy says (none for a step that still
        feeds known tokens), at most the round's cap from its measured costs (`round_costs`). batch: the
        step's sequences where it fed each its one token and its drafts (a round, whose time RoundCosts
        measures), else None. followed: the next step is already running without drafts (an overlapped
        successor, which `plans_no_drafts` allowed): the heads only keep up, or stay behind."""
        requests, wants = [], []  # heads a sequence's drafts may use; (acceptance EMAs, drafts it would make)
        for state, _, _, _ in heads:
            seq = state.seq
            self.settle_heads(seq)
            requested = min(seq.params.num_draft_tokens, self.runner.num_heads)
            num_drafts = 0
            if not seq.is_prefill and not followed:  # the next step feeds one token: draft behind it
                remaining = seq.params.max_tokens - len(seq.output_ids) - 1
                num_drafts = max(
                    0, min(self.draft_policy(state.acceptance, requested), remaining, self.max_draft_len)
                )
            requests.append(requested)
            wants.append((state.acceptance.ema, num_drafts))
        cap = self.max_draft_len if self.round_costs is None else self.round_costs.cap(wants, batch)
        # A work item's computed length is its step's end: an overlapped successor has already fed the
        # next token (seq.num_computed counts it), whose hidden row this round does not have.
        work = [
            HeadWork(state.seq, start + rows.shape[0], start, rows, requested, min(num_drafts, cap), offset)
            for (state, rows, start, offset), requested, (_, num_drafts) in zip(heads, requests, wants)
        ]
        drafts = self.runner.run_heads(work)
        for w, d in zip(work, drafts):
            if d:
                w.seq.drafts = list(d)
                w.seq.head_drafts = list(d)
                w.seq.drafts_from = len(w.seq)
        self._time_round(batch, max((len(d) for d in drafts), default=0))

    def plans_no_drafts(self, states: list[RequestState], batch: int, ahead: int) -> bool:
        """Whether the step after a decode step of these MTP sequences (batch: the step's sequences) will
        draft nothing, decided before that step's tokens are known: what `draft` would decide once the
        `ahead` decode steps not yet recorded are (each adds one to a sequence's step count; a step without
        drafts changes nothing else the policy reads). Then the engine may overlap the steps
        (runtime/overlap.py): the next one runs without drafts and `draft(followed=True)` keeps to that."""
        wants = []
        for state in states:
            requested = min(state.seq.params.num_draft_tokens, self.runner.num_heads)
            stats = state.acceptance
            stats.steps += ahead  # as `draft` will see them (the policy may key on the stats object)
            try:
                wants.append((stats.ema, min(self.draft_policy(stats, requested), self.max_draft_len)))
            finally:
                stats.steps -= ahead
        if not any(n for _, n in wants):
            return True
        return self.round_costs is not None and self.round_costs.cap(wants, batch) == 0

    def no_round(self) -> None:
        """A step without a round of the heads: the next round's time is not a round's alone."""
        self._last_round = None

    def _time_round(self, batch: int | None, drafts: int) -> None:
        """Measure a decode round (the time since the last one ended) where the round before was of the same
        batch and drafts: a round's drafts are verified by the next one, so a steady state has both."""
        now = time.perf_counter()
        last, self._last_round = self._last_round, (None if batch is None else (batch, drafts, now))
        if (
            self.round_costs is not None
            and batch is not None
            and last is not None
            and last[:2] == (batch, drafts)
        ):
            self.round_costs.record(batch, drafts, now - last[2])

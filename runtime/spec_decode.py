"""MTP speculative decoding, the engine's side: verifying a step's drafts (greedy exact match or rejection
sampling), rolling rejected drafts back, keeping the heads' states on real tokens, and drafting the next
step's tokens under the acceptance policy. The acceptance rules themselves are runtime/speculative.py;
the heads' passes are runtime/drafter.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .block_manager import BlockManager
from .drafter import HeadWork
from .outputs import RequestState
from .sampler import filter_logits, token_logprobs
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .speculative import (
    AcceptanceStats,
    accept_targets,
    greedy_accept,
    next_num_drafts,
    one_hot_probs,
    rejection_sample,
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

    # Verification.
    def verify_probs(
        self, batch: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]
    ) -> dict[int, torch.Tensor]:
        """The target distributions of the sampled verifies in `batch` (after temperature, top-k, top-p, over
        the real tokens), on the host in one read rather than one wait for the device a sequence: batch
        index -> [k + 1, V]."""
        want = [
            b
            for b, s in enumerate(batch)
            if s.samples and s.num_drafts and not s.seq.params.greedy and not s.seq.finished
        ]
        if not want:
            return {}
        real = logits[:, : self.num_real_tokens]
        parts = [
            torch.softmax(filter_logits(real[rows[b] : rows[b + 1]], batch[b].seq.params), -1) for b in want
        ]
        return dict(zip(want, torch.cat(parts).cpu().split([len(p) for p in parts])))

    def verify(
        self,
        state: RequestState,
        num_drafts: int,
        logits: torch.Tensor,
        targets: list[int] | None,
        probs: torch.Tensor | None,
    ) -> tuple[list[int], list[float] | None, list[dict[int, float]] | None]:
        """The tokens a step with `num_drafts` drafts emits from its rows of `logits` (real vocabulary): greedy,
        exact match against `targets` (the rows' argmaxes, where given); sampled, rejection sampling against
        `probs` (the rows' target distributions, `verify_probs`). 1..k+1 tokens, with their logprobs and top
        logprobs where the request asks (sampler.token_logprobs)."""
        seq, params = state.seq, state.seq.params
        drafts = seq.drafts[:num_drafts]
        if params.greedy:
            tokens, _ = greedy_accept(drafts, logits) if targets is None else accept_targets(drafts, targets)
        else:
            # Heads over a draft vocabulary may pick an id past the tokenizer's: the target gives it
            # probability 0, so it is rejected and nothing after it is read.
            n = next((i for i, d in enumerate(drafts) if d >= self.num_real_tokens), num_drafts)
            q = one_hot_probs(drafts[:n], probs.shape[-1])
            tokens = rejection_sample(drafts[:n], q, probs[: n + 1], state.draft_generator)
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

    def draft(self, heads: list[tuple[RequestState, torch.Tensor, int, int]]) -> None:
        """A round of the MTP heads over the sequences that stepped (state, their fresh hidden rows, the
        step's first position, the rows' offset in the step's output): catch up over the new positions and
        draft the next step's tokens, as many as the acceptance policy says (none for a step that still
        feeds known tokens)."""
        work = []
        for state, rows, start, offset in heads:
            seq = state.seq
            self.settle_heads(seq)
            requested = min(seq.params.num_draft_tokens, self.runner.num_heads)
            num_drafts = 0
            if not seq.is_prefill:  # the next step feeds one token: draft behind it
                remaining = seq.params.max_tokens - len(seq.output_ids) - 1
                num_drafts = min(
                    self.draft_policy(state.acceptance, requested), remaining, self.max_draft_len
                )
            work.append(HeadWork(seq, seq.num_computed, start, rows, requested, max(num_drafts, 0), offset))
        drafts = self.runner.run_heads(work)
        for w, d in zip(work, drafts):
            if d:
                w.seq.drafts = list(d)
                w.seq.head_drafts = list(d)
                w.seq.drafts_from = len(w.seq)

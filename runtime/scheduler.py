"""Continuous batching under a token budget with chunked prefill; preemption by recomputation.

Each step: running sequences that decode take one token each; then sequences still prefilling, then
waiting ones, take chunks of what is left of `max_num_tokens`. A chunk's attention grows with its
context (its tokens times the keys before them): with `max_prefill_pairs` set, a chunk that shares its
step with decoding sequences is cut so that tokens x (context + tokens) stays within it, so a long
prompt's chunks near 1M tokens do not stretch their neighbours' steps to seconds; alone, it takes whole
chunks. With `decode_slowdown` set, prefill chunks beside decoding sequences also wait their turn
(PrefillPacer): the decoding sequences' mean step time stays within that multiple of a decode-only step,
however long the prompt beside them. When blocks run out, the newest
running sequence is preempted (its blocks freed, its tokens recomputed later); a request never fails
for lack of memory unless it could not fit in an empty pool, which is refused when it arrives.
A sequence isolated after a failed step (LLMEngine) is scheduled alone until it has recomputed past the
point where the batch failed: a request that fails again there, alone, is the one at fault. No torch here.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


def _may_run(seq: Sequence, alone: Sequence | None) -> bool:
    return alone is None or seq is alone


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first new token
    num_tokens: int  # new tokens fed this step, drafts included
    num_drafts: int = 0  # the last num_drafts tokens fed are MTP drafts (seq.drafts) to verify
    prefill: bool = False  # a prefill chunk (a prompt's, or a preempted sequence's recomputation)

    @property
    def samples(self) -> bool:
        """Whether this step's last rows give the sequence's next token(s)."""
        return self.start + self.num_tokens - self.num_drafts == len(self.seq)


class PrefillPacer:
    """Paces prefill chunks beside decoding sequences, so that a long prompt costs its neighbours a bounded
    share of their speed: over the steps that decoding sequences share with a prefill and the decode-only
    steps after them, the decoding sequences' mean step time stays within `slowdown` times a decode-only
    step's.

    On one GPU a step that carries a prefill chunk of more than a few dozen tokens reads every routed
    expert (on inkling-bench about 11 ms against a 2.9 ms decode step), so chunk size alone cannot bound a
    neighbour's latency; time can. The steps' measured seconds keep a balance: each step with decoding
    sequences adds `slowdown` x d minus its own seconds, d being the decode-only steps' mean (an EMA); a
    prefill chunk may join decoding sequences only while the balance is not negative. The balance never
    exceeds zero (time spent decoding alone is not saved up for a burst of prefill later) and restarts at
    zero when nothing decodes, so over any run of steps from a mixed one the neighbours' mean step is at
    most slowdown x d plus that one mixed step's excess over it. A mixed step before any decode-only one
    owes its whole time. The prompt pays: beside decodes a chunk of m seconds runs once every
    1 + (m - slowdown x d) / ((slowdown - 1) x d) steps."""

    def __init__(self, slowdown: float, alpha: float = 0.2):
        if not slowdown > 1:
            raise ValueError(
                f"decode_slowdown must exceed 1 (prefill beside decodes would never run), got {slowdown}"
            )
        self.slowdown, self.alpha = slowdown, alpha
        self.decode_s: float | None = None  # a decode-only step's seconds (EMA)
        self.balance = 0.0

    def allows_prefill(self) -> bool:
        """Whether a prefill chunk may join this step's decoding sequences."""
        return self.balance >= 0

    def holds_after(self, ahead: int) -> bool:
        """Whether prefill is still held back after `ahead` more decode-only steps, each taken at the
        decode-only mean (as `record` would count them)."""
        return self.balance + ahead * (self.slowdown - 1) * (self.decode_s or 0.0) < 0

    def record(self, seconds: float, decoding: bool, prefilling: bool) -> None:
        """One completed step's seconds; whether it had decoding sequences and prefill chunks."""
        if not decoding:
            self.balance = 0.0  # nobody waited on this step
            return
        if not prefilling:
            a = self.alpha
            self.decode_s = seconds if self.decode_s is None else (1 - a) * self.decode_s + a * seconds
        allowed = 0.0 if self.decode_s is None else self.slowdown * self.decode_s
        self.balance = min(0.0, self.balance + allowed - seconds)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch_size: int,
        max_num_tokens: int,
        chunk_size: int | None = None,
        max_prefill_pairs: int | None = None,
        decode_slowdown: float | None = None,
    ) -> None:
        """max_prefill_pairs: query-key pairs a prefill chunk may have while other sequences decode in its
        step (None: no limit); it never goes below one block a step. decode_slowdown: prefill chunks beside
        decoding sequences are paced so that those sequences' mean step stays within this multiple of a
        decode-only step (PrefillPacer; None: no pacing)."""
        self.blocks = blocks
        self.max_prefill_pairs = max_prefill_pairs
        self.pacer = None if decode_slowdown is None else PrefillPacer(decode_slowdown)
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        # Prefill chunks end on block boundaries where possible, so their ends are prefix-cache
        # restore points.
        bs = blocks.block_size
        self.chunk_size = max(bs, (chunk_size or max_num_tokens) // bs * bs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def isolating(self) -> Sequence | None:
        """The isolated sequence the next steps run alone (running ones first, oldest first), or None."""
        running = [s for s in self.running if s.isolate_until]
        if running:
            return min(running, key=lambda s: s.arrival)
        return next((s for s in self.waiting if s.isolate_until), None)

    def schedule(self, on_admit=None) -> list[ScheduledSeq]:
        """Pick this step's work. `on_admit(seq)` runs when a waiting sequence gets its slot (the
        engine uses it to look up the prefix cache before blocks are allocated)."""
        alone = self.isolating()
        if alone is not None and alone.status == Status.WAITING and self.waiting[0] is not alone:
            self.waiting.remove(alone)
            self.waiting.appendleft(alone)
        budget = self.max_num_tokens
        out: list[ScheduledSeq] = []
        # 1. Decoding sequences: one token each, oldest first, preempting the newest when blocks run out;
        # then their MTP drafts, with the budget and blocks that are left (dropped rather than cost anyone
        # their token).
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.is_prefill or budget == 0 or seq.status != Status.RUNNING or not _may_run(seq, alone):
                continue
            if self._reserve(seq, len(seq), out):
                out.append(ScheduledSeq(seq, seq.num_computed, 1))
                budget -= 1
        for s in out:
            k = min(len(s.seq.drafts), budget)
            if k and self.blocks.can_allocate(s.seq.blocks, len(s.seq) + k):
                self.blocks.allocate(s.seq.blocks, len(s.seq) + k)
                s.num_tokens, s.num_drafts = 1 + k, k
                budget -= k
        # 2. Prefill chunks of running sequences, then of waiting ones (beside decoding sequences, when the
        # pacer allows).
        decoding = bool(out)
        if decoding and self.pacer is not None and not self.pacer.allows_prefill():
            return out
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if (
                budget == 0
                or not seq.is_prefill
                or seq.status != Status.RUNNING
                or len(out) >= self.max_batch_size
                or not _may_run(seq, alone)
            ):
                continue
            n = self._chunk(seq, budget, decoding)
            if self._reserve(seq, seq.num_computed + n, out):
                out.append(ScheduledSeq(seq, seq.num_computed, n, prefill=True))
                budget -= n
        while self.waiting and budget > 0 and len(out) < self.max_batch_size and self.free_slots:
            seq = self.waiting[0]
            if not _may_run(seq, alone):
                break
            seq.blocks = self.blocks.new_sequence()
            if on_admit is not None:
                on_admit(seq)
            n = self._chunk(seq, budget, decoding)
            if not self.blocks.can_allocate(seq.blocks, seq.num_computed + n):
                self.blocks.release(seq.blocks)
                seq.blocks, seq.num_computed = None, 0
                break  # wait for memory; never preempt running work for a new request
            self.waiting.popleft()
            self.blocks.allocate(seq.blocks, seq.num_computed + n)
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, seq.num_computed, n, prefill=True))
            budget -= n
        return out

    def holds_prefill(self, ahead: int) -> bool:
        """Whether the pacer will still hold prefill chunks back after `ahead` more decode-only steps (an
        overlapped successor is launched before the step in flight has its time)."""
        return self.pacer is not None and self.pacer.holds_after(ahead)

    def record_step(self, batch: list[ScheduledSeq], seconds: float) -> None:
        """A completed step of `batch` took `seconds` (what its decoding sequences waited): the pacer's
        measure."""
        if self.pacer is not None and batch:
            decoding = any(not s.prefill for s in batch)
            self.pacer.record(seconds, decoding, any(s.prefill for s in batch))

    def _chunk(self, seq: Sequence, budget: int, decoding: bool = False) -> int:
        """Tokens to feed: up to the last token it has, within the budget and the chunk size (and, beside
        decoding sequences, max_prefill_pairs). A chunk that crosses a block boundary stops at the last
        one it can reach, so that the sconv history holds the state there and the prefix cache can
        restart from it (one extra step a prompt)."""
        bs = self.blocks.block_size
        remaining = len(seq) - seq.num_computed
        n = min(remaining, budget, self.chunk_size)
        if decoding and self.max_prefill_pairs:
            n = min(n, max(bs, self.pairs_cap(seq.num_computed)))
        boundary = (seq.num_computed + n) // bs * bs
        if n > 1 and (n < remaining or seq.num_computed + n - boundary > 1) and boundary > seq.num_computed:
            n = boundary - seq.num_computed
        return n

    def pairs_cap(self, context: int) -> int:
        """The most tokens n after `context` ones with n x (context + n) <= max_prefill_pairs."""
        P = self.max_prefill_pairs
        n = int((math.isqrt(context * context + 4 * P) - context) // 2)
        while (n + 1) * (context + n + 1) <= P:
            n += 1
        return n

    def _reserve(self, seq: Sequence, length: int, scheduled: list[ScheduledSeq]) -> bool:
        """Blocks for `seq` up to `length` tokens, preempting newer running sequences if needed."""
        taken = {s.seq.request_id for s in scheduled}
        while not self.blocks.can_allocate(seq.blocks, length):
            victims = [s for s in self.running if s is not seq and s.request_id not in taken]
            if not victims:
                self.preempt(seq)
                return False
            self.preempt(max(victims, key=lambda s: s.arrival))
        self.blocks.allocate(seq.blocks, length)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free everything of `seq` and queue it first: its tokens are recomputed when it returns."""
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.reset_heads()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _free(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.blocks is not None:
            self.blocks.release(seq.blocks)
            seq.blocks = None
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

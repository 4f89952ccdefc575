"""Overlapped decode steps (docs/interfaces.md "Overlapped steps"): a step whose every sequence takes one
token from one row leaves its picks on the device, and the step that must follow it is launched from
them before the host reads them, so the host builds step n+1 while the GPU runs step n."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .sampler import sample_tokens
from .scheduler import ScheduledSeq, Scheduler


@dataclass
class LaunchedStep:
    """A step whose program is on its way (on a GPU it runs while the host goes on): its batch and
    outputs, and, where each sequence takes one token from one row, those picks (argmax or draw) made on
    the device and copied to the host without waiting (`ready` says when they are there)."""

    batch: list[ScheduledSeq]
    logits: torch.Tensor
    rows: list[int]
    hidden: torch.Tensor
    picks: torch.Tensor | None = None  # [B] int64 on the device: the next step's input ids
    picks_host: torch.Tensor | None = None
    logprobs_host: torch.Tensor | None = None  # [B] float32: each pick's logprob (NaN where not asked)
    ready: torch.cuda.Event | None = None

    def host_picks(self) -> tuple[list[int] | None, list[float] | None]:
        """The picks and their logprobs on the host (waiting for them if they are still on the way)."""
        if self.picks_host is None:
            return None, None
        if self.ready is not None:
            self.ready.synchronize()
        logprobs = None if self.logprobs_host is None else self.logprobs_host.tolist()
        return self.picks_host.tolist(), logprobs


def takes_pick(s: ScheduledSeq, successor: bool, drafts_next: bool = True) -> bool:
    """Whether the sequence's next token is drawn on the device from its one row of this step, with
    nothing for the host to read (a successor's sequences sample, though the token they feed is not
    in `seq.tokens` yet). Not where the request asks for top logprobs (the host's sampler reads them),
    nor where this step verifies drafts. A sequence that asks for MTP drafts takes it in a decode step
    when the step after it will draft nothing (drafts_next False: SpeculativeDecoder.plans_no_drafts)."""
    samples = s.samples or successor
    params = s.seq.params
    mtp = params.num_draft_tokens and (drafts_next or s.num_tokens != 1)
    return samples and not s.num_drafts and not mtp and not params.logprobs


def make_picks(step: LaunchedStep, logits: torch.Tensor, generators: list[torch.Generator | None]) -> None:
    """Each sequence's next token from its row of `logits` (real vocabulary) on the device, the argmax or a
    draw from its request's generator (the draw the host's sampler would make, so the tokens are the same),
    with its logprob where asked, both on their way to the host through pinned memory."""
    batch = step.batch
    step.picks = sample_tokens(logits, [s.seq.params for s in batch], generators)
    logprobs = None
    if any(s.seq.params.logprobs is not None for s in batch):
        nan = torch.full((), float("nan"), device=logits.device)
        logprobs = torch.stack(
            [
                torch.log_softmax(row.float(), -1)[pick] if s.seq.params.logprobs is not None else nan
                for s, row, pick in zip(batch, logits, step.picks)
            ]
        )
    if not step.picks.is_cuda:
        step.picks_host, step.logprobs_host = step.picks, logprobs
        return
    # Pinned buffers from torch's caching host allocator, which reuses one only after the copy into it
    # has run.
    step.picks_host = torch.empty(len(batch), dtype=torch.long, pin_memory=True)
    step.picks_host.copy_(step.picks, non_blocking=True)
    if logprobs is not None:
        step.logprobs_host = torch.empty(len(batch), dtype=logprobs.dtype, pin_memory=True)
        step.logprobs_host.copy_(logprobs, non_blocking=True)
    step.ready = torch.cuda.Event()
    step.ready.record()


def successor(
    step: LaunchedStep, scheduler: Scheduler, blocks: BlockManager
) -> tuple[list[ScheduledSeq], list[int]] | None:
    """The step that follows `step` whatever its tokens turn out to be, with its blocks allocated: its batch
    and, per sequence, its row in `step` (where its input id is). None where the scheduler has a choice to
    make (a request waits, a running sequence sat out `step` other than a prefill the pacer holds back,
    blocks run short, a sequence is isolated after a failure)."""
    live = [s for s in step.batch if not s.seq.finished]
    if scheduler.waiting or scheduler.isolating():
        return None
    stepped = {id(s.seq) for s in live}
    if not stepped <= {id(seq) for seq in scheduler.running}:  # a sequence in `step` no longer runs
        return None
    sat_out = [seq for seq in scheduler.running if id(seq) not in stepped]
    if sat_out and not (all(seq.is_prefill for seq in sat_out) and scheduler.holds_prefill(ahead=1)):
        return None
    batch, rows = [], []
    # Oldest first, as the scheduler orders decoding sequences: the same batch layout as without
    # overlap (`step` may have put a sequence that finished its prompt last).
    for b, s in sorted(enumerate(step.batch), key=lambda x: x[1].seq.arrival):
        seq = s.seq
        if seq.finished or len(seq.output_ids) + 1 >= seq.params.max_tokens:
            continue  # done, or done with this step's token
        position = s.start + s.num_tokens  # of the token `step` picks
        if not blocks.can_allocate(seq.blocks, position + 1):
            return None
        blocks.allocate(seq.blocks, position + 1)
        batch.append(ScheduledSeq(seq, position, 1))
        rows.append(b)
    return (batch, rows) if batch else None

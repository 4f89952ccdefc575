"""A request in flight: its tokens, how many the caches hold, its blocks and state slot."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .block_manager import SeqBlocks
from .params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    mm_positions: list[int] = field(default_factory=list)  # prompt positions of image/audio pad tokens
    mm_embeds: Any = None  # tensor [M, H] in the order of mm_positions (the runner's business)
    mm_digests: dict[int, bytes] = field(default_factory=dict)  # position -> digest of its embedding row
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV and sconv inputs the caches hold
    blocks: SeqBlocks | None = None
    slot: int = -1  # sconv state slot
    finish_reason: str | None = None
    arrival: int = field(default_factory=itertools.count().__next__)
    num_preemptions: int = 0
    restore_snapshot: int | None = None  # prefix-cache sconv snapshot to load before the first step
    # MTP (INKLING_SPEC §5): the drafts the next step verifies; the drafts the heads' states stand on
    # and the index in `tokens` where they begin; each head's computed positions (0..n-1).
    drafts: list[int] = field(default_factory=list)
    head_drafts: list[int] = field(default_factory=list)
    drafts_from: int | None = None
    head_computed: list[int] = field(default_factory=list)
    # Failure isolation (LLMEngine): after a batch it was in failed, the sequence recomputes alone up to
    # this many tokens (0: not isolated); how many failed batches it has been in.
    isolate_until: int = 0
    num_failures: int = 0

    def reset_heads(self) -> None:
        """Forget every head state and draft (a preempted sequence recomputes them)."""
        self.drafts, self.head_drafts, self.drafts_from = [], [], None
        self.head_computed = [0] * len(self.head_computed)

    @property
    def tokens(self) -> list[int]:
        """prompt + outputs (a new list: O(length); `token_range` copies only what it returns)."""
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] for 0 <= start, without building the whole list."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P : end - P]
        return self.prompt_ids[start:] + self.output_ids[: end - P]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_prefill(self) -> bool:
        """Still feeding tokens it already has (the prompt, or prompt+outputs after a preemption)."""
        return self.num_computed < len(self) - 1

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

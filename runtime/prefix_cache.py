"""Prefix caching's policy: which blocks of a sequence become cache entries (and which of those are restore
points, with their sconv inputs saved), and where an admitted sequence starts. The mechanism (chained
hashes, entries, reference counts, LRU eviction) is the BlockManager's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_manager import BlockManager
from .sequence import Sequence

if TYPE_CHECKING:
    from .model_runner import ModelRunner


class PrefixCache:
    def __init__(self, blocks: BlockManager, runner: ModelRunner, max_draft_len: int):
        self.blocks = blocks
        self.runner = runner
        self.max_draft_len = max_draft_len

    def block_media(self, seq: Sequence, index: int) -> bytes:
        """The digests of the image/audio rows in logical block `index`: part of its key, so a block of
        the same placeholder tokens with another image is another entry."""
        bs = self.blocks.block_size
        return b"".join(seq.mm_digests.get(p, b"") for p in range(index * bs, (index + 1) * bs))

    def lookup(self, seq: Sequence) -> None:
        """On admission: start on the longest cached prefix that ends at a restore point, leaving at
        least one token to compute (its logits give the first sample). Not for MTP requests: the prefix
        cache keeps the main model's states only, and the heads need theirs from position 0."""
        seq.restore_snapshot = None
        if seq.params.num_draft_tokens:
            return
        bs = self.blocks.block_size
        self.blocks.stats["prefix_query_tokens"] += len(seq)
        full = (len(seq) - 1) // bs
        keys, entries = self.blocks.lookup(
            [(seq.token_range(i * bs, (i + 1) * bs), self.block_media(seq, i)) for i in range(full)]
        )
        n = max((i + 1 for i, e in enumerate(entries) if e.snapshot is not None), default=0)
        if n:
            self.blocks.adopt(seq.blocks, keys[:n], entries[:n])
            seq.num_computed = n * bs
            # Sliding groups keep only what a future query reaches: a long cached prefix must not hold
            # more of their blocks than a fresh prefill would (their pool is sized for the windows).
            self.blocks.free_behind_windows(seq.blocks, seq.num_computed)
            seq.restore_snapshot = entries[n - 1].snapshot

    def register(self, seq: Sequence) -> None:
        """Register the full blocks that can no longer be rolled back: prompt blocks at once, others
        max_draft_len tokens later. A block whose end the sconv history still holds becomes a restore
        point (its sconv inputs are saved). Registered blocks are shared, so they are never rolled back."""
        bs = self.blocks.block_size
        settled = max(min(seq.num_prompt, seq.num_computed), seq.num_computed - self.max_draft_len)
        for index in range(len(seq.blocks.hashes), settled // bs):
            back = seq.num_computed - (index + 1) * bs
            restorable = back <= self.runner.state_rows - self.runner.K1
            snap = self.blocks.register(
                seq.blocks,
                index,
                seq.token_range(index * bs, (index + 1) * bs),
                self.block_media(seq, index),
                restorable,
            )
            if snap is not None:
                self.runner.save_snapshot(seq.slot, snap, back)

"""ModelRunner: the engine's programs over the caches: builds a step's inputs from the scheduled
sequences, runs the step program, saves and restores sconv states, rolls sequences back.

It owns every device tensor: the KV pool (one tensor per pool slot, docs/interfaces.md), the sconv
states (one slot per running sequence) and the sconv snapshots of prefix-cache restore points.
"""

from __future__ import annotations

import torch

import plugins  # noqa: F401  (the programs call torch.ops.inkling.*)
from builder.engine import Engine
from builder.runner import EngineRunner
from inkling.processing import image_patches

from .block_manager import FREED
from .scheduler import ScheduledSeq

MAX_SNAPSHOTS = 1024  # sconv snapshot slots of prefix-cache restore points


class ModelRunner(EngineRunner):
    """EngineRunner's programs and caches, stepped from the scheduler's batches, plus the sconv
    snapshots of prefix-cache restore points."""

    def __init__(self, engine: Engine, num_blocks: int | None = None, device: str | None = None):
        super().__init__(engine, num_blocks, device)
        self.block_size = self.build.tokens_per_block
        self.K1 = self.config.sconv_kernel_size - 1
        # The last K-1 sconv inputs at prefix-cache restore points. Each slot holds K-1 rows of every
        # site (on inkling-1t about 2.8 MB), so their number is capped, not one per block.
        self.num_snapshots = min(self.num_blocks, MAX_SNAPSHOTS)
        self.snapshots = [
            torch.zeros(self.num_snapshots, self.K1, C, dtype=self.dtype, device=self.device)
            for C in self.conv_channels()
        ]

    # Media.
    @torch.no_grad()
    def encode_media(
        self, images: list[torch.Tensor], audios: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of the image pads then the audio pads: ([Ni, H], [Na, H])."""
        H = self.config.hidden_size
        img = [self.vision(image_patches(x).to(self.device, self.dtype)) for x in images]
        aud = [self.audio(x.to(self.device)) for x in audios]
        empty = torch.zeros(0, H, dtype=self.dtype, device=self.device)
        return (torch.cat(img) if img else empty), (torch.cat(aud) if aud else empty)

    # A step.
    @torch.no_grad()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Feed each scheduled sequence's new tokens; returns float32 logits [B, V] of each one's last row."""
        dev, bs = self.device, self.block_size
        B = len(batch)
        q_lens = [s.num_tokens for s in batch]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        T = int(cu[-1])
        mb = self.build.max_blocks_per_seq
        tables = torch.full((self.num_groups, B, mb), FREED, dtype=torch.int32)
        slots = torch.full((self.num_groups, T), -1, dtype=torch.int64)
        ids, mm_rows, mm_pos = [], [], []
        for b, s in enumerate(batch):
            seq = s.seq
            for g, table in enumerate(seq.blocks.tables):
                tables[g, b, : len(table)] = torch.tensor(table, dtype=torch.int32)
            pos = torch.arange(s.start, s.start + s.num_tokens)
            for g in range(self.num_groups):
                slots[g, cu[b] : cu[b + 1]] = tables[g, b, pos // bs].long() * bs + pos % bs
            ids.append(torch.tensor(seq.tokens[s.start : s.start + s.num_tokens], dtype=torch.long))
            for row, p in enumerate(seq.mm_positions):
                if s.start <= p < s.start + s.num_tokens:
                    mm_rows.append(seq.mm_embeds[row : row + 1])
                    mm_pos.append(int(cu[b]) + p - s.start)
        mm_rows.append(torch.zeros(1, self.config.hidden_size, dtype=self.dtype, device=dev))
        mm_pos.append(T)
        logits, _ = self.step(
            self.weights,
            torch.cat(ids).to(dev),
            torch.cat([r.to(dev, self.dtype) for r in mm_rows]),
            torch.tensor(mm_pos, device=dev),
            cu.to(dev),
            torch.tensor([s.start + s.num_tokens for s in batch], dtype=torch.int32, device=dev),
            tables.to(dev),
            slots.to(dev),
            torch.tensor([s.seq.slot for s in batch], dtype=torch.int32, device=dev),
            (cu[1:] - 1).long().to(dev),
            self.key_caches,
            self.value_caches,
            self.conv_states,
        )
        return logits

    # Sconv states.
    def reset_slot(self, slot: int) -> None:
        for t in self.conv_states:
            t[slot].zero_()

    def save_snapshot(self, slot: int, snapshot: int, back: int) -> None:
        """Keep the sconv inputs before position (computed - back) of the sequence in `slot`."""
        end = self.state_rows - back
        if end < self.K1:
            raise ValueError(f"sconv history holds {self.state_rows} rows, cannot go {back} back")
        for state, snap in zip(self.conv_states, self.snapshots):
            snap[snapshot] = state[slot, end - self.K1 : end]

    def restore_snapshot(self, slot: int, snapshot: int) -> None:
        for state, snap in zip(self.conv_states, self.snapshots):
            state[slot].zero_()
            state[slot, self.state_rows - self.K1 :] = snap[snapshot]

    def rollback(self, slot: int, n: int) -> None:
        """Forget the last n sconv inputs of a sequence (docs/interfaces.md "Sconv state")."""
        if not 0 <= n <= self.build.max_draft_len:
            raise ValueError(f"can roll back 0..{self.build.max_draft_len} tokens, not {n}")
        if n:
            for state in self.conv_states:
                state[slot, n:] = state[slot, :-n].clone()

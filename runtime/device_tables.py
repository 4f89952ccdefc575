"""Block tables that live on the device: one row per state slot and layer group, written entry by entry
as the block manager allocates and frees blocks, so that a step's tables cost the host O(entries that
changed), never O(context).

A step program reads its batch's tables as [G, B, max_blocks_per_seq] int32 (docs/interfaces.md). Built on
the host, that is a fill and a copy of every sequence's whole row each step, and, in the CUDA-graph
staging, a host-to-device copy of G * B * max_blocks_per_seq entries (at inkling-bench's 1M tokens and
batch 64, 32 MB a step). Here the rows stay on the device: each step sends only the entries that changed
since the last (`SeqBlocks.edits`: blocks appended, freed behind a window, taken off by a rollback) in
one small copy, and the batch's tables are a gather of its sequences' rows by slot, device to device.
"""

from __future__ import annotations

import numpy as np
import torch

from .block_manager import FREED, SeqBlocks
from .step_graphs import to_device


class DeviceTables:
    """rows[g, slot]: the block table (pool-local ids, FREED where there is no block) of group g of the
    sequence in state slot `slot`, on `device`."""

    def __init__(self, num_groups: int, num_slots: int, max_blocks: int, device: torch.device):
        self.device = device
        self.rows = torch.full((num_groups, num_slots, max_blocks), FREED, dtype=torch.int32, device=device)
        # The SeqBlocks each slot's rows were last written from: a slot that changes hands starts over.
        self.owner: list[SeqBlocks | None] = [None] * num_slots
        # Gathers since the last write, by (slots, groups): a step that changed no entry reuses its own.
        self._gathered: dict[tuple, torch.Tensor] = {}

    def gather(self, seqs: list[tuple[int, SeqBlocks]], groups: slice = slice(None)) -> torch.Tensor:
        """The tables of `seqs` (state slot, blocks), in order, after writing what changed since the last
        call: [G, B, max_blocks] of the groups `groups`, on the device."""
        g_idx, s_idx, i_idx, vals = [], [], [], []
        for slot, blocks in seqs:
            if self.owner[slot] is not blocks:  # a sequence new to this slot: its rows start over here
                self.owner = [None if o is blocks else o for o in self.owner]
                self.owner[slot] = blocks
                self.rows[:, slot].fill_(FREED)
                self._gathered.clear()
                blocks.repush()
            for g in range(self.rows.shape[0]):
                index, values = blocks.edits(g)
                if len(index):
                    g_idx.append(np.full(len(index), g, dtype=np.int64))
                    s_idx.append(np.full(len(index), slot, dtype=np.int64))
                    i_idx.append(index)
                    vals.append(values.astype(np.int64))
        if g_idx:
            # One host-to-device copy of [4, n] (group, slot, index, value), then one scatter.
            edits = self._to_device(np.stack([np.concatenate(x) for x in (g_idx, s_idx, i_idx, vals)]))
            self.rows.index_put_((edits[0], edits[1], edits[2]), edits[3].to(torch.int32))
            self._gathered.clear()
        key = (tuple(slot for slot, _ in seqs), groups.start, groups.stop)
        out = self._gathered.get(key)  # its readers only read it
        if out is None:
            slots = self._to_device(np.array(key[0], dtype=np.int64))
            out = self._gathered[key] = self.rows[groups].index_select(1, slots)
        return out

    def _to_device(self, x: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(x), self.device)

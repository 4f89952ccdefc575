"""Host-side pieces of a step or head program's ragged inputs (docs/interfaces.md), built with NumPy:
shared by ModelRunner.step_inputs and the MTP heads' passes (runtime/drafter.py)."""

from __future__ import annotations

import numpy as np
import torch


def cu_seqlens(lens: np.ndarray) -> np.ndarray:
    """int32 [B + 1]: 0, then the running sum of the sequences' token counts."""
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    return cu


def slot_mapping(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """int64 KV slots of token `positions` through one block-table row: block * block_size + offset."""
    return table[positions // block_size].astype(np.int64) * block_size + positions % block_size


def add_media(seq, start: int, end: int, first_row: int, rows: list, positions: list) -> None:
    """Append the image/audio embedding rows of `seq` at token positions [start, end) to `rows`, and their
    rows in the program's input (first_row + position - start) to `positions`."""
    for r, p in enumerate(seq.mm_positions):
        if start <= p < end:
            rows.append(seq.mm_embeds[r : r + 1])
            positions.append(first_row + p - start)


def media_splice(
    rows: list[torch.Tensor], positions: list[int], splice_row: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A program's mm_embeds and mm_positions: the media rows at their input rows, then the dummy splice
    row aimed at row num_tokens (written nowhere). Without media the dummy row goes as it is, no copy."""
    positions = torch.tensor([*positions, num_tokens])
    if not rows:
        return splice_row, positions
    device, dtype = splice_row.device, splice_row.dtype
    return torch.cat([*(r.to(device, dtype) for r in rows), splice_row]), positions

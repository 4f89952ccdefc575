"""The collectives computed in one process from every rank's input: what tests and benchmarks compare to."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .communicator import sum_in_rank_order


def reduce_scatter(xs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """xs: every rank's x [T, C] in rank order -> rank `rank`'s [T, C/N] (float32 sum in rank order)."""
    n = len(xs)
    width = xs[0].shape[1] // n
    chunks = torch.stack([x[:, rank * width : (rank + 1) * width] for x in xs])
    return sum_in_rank_order(chunks).to(xs[0].dtype)


def all_gather(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """xs: every rank's x [T, C/N] in rank order -> [T, C]."""
    return torch.cat(list(xs), dim=1)


def without_negative_zero(x: torch.Tensor) -> torch.Tensor:
    """x with every -0.0 made +0.0 (bitwise), as the Lamport all-gather delivers it."""
    return torch.where(x == 0, torch.zeros_like(x), x)

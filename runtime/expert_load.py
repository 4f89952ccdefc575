"""Expert load: how many tokens each routed expert received, per MoE layer, and how evenly that load falls
on the ranks that hold the experts.

The step program counts on the device: each MoE layer's route adds every token row's top_k choices to that
layer's int32 [E] counter (`inkling::sigmoid_sink_moe`'s expert_load; a CUDA-graph bucket's padding rows,
those without a KV slot, are not counted). Every rank routes every token alike, so rank 0's counters hold
all E experts whichever rank computes them. The host reads and zeroes them now and then (`ModelRunner.
read_expert_load`, a device sync) and keeps int64 totals here: per layer and expert, and per read window.

Imbalance is max over mean: of the experts' loads (a hot expert's factor), and of the ranks' loads under an
expert-parallel placement of E / ep contiguous experts a rank (`rank_imbalance(ep)`). A MoE layer waits for
its busiest rank, so a layer's rank imbalance is what expert parallelism loses to routing there; the
figures are averages over layers, weighted by their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def imbalance(loads: np.ndarray) -> float:
    """max / mean of the last axis, averaged over the rows weighted by their totals (1.0: even; 0 rows: 1.0).
    loads [L, n]."""
    totals = loads.sum(-1)
    if totals.sum() == 0:
        return 1.0
    per_row = np.where(totals > 0, loads.max(-1) * loads.shape[-1] / np.maximum(totals, 1), 1.0)
    return float((per_row * totals).sum() / totals.sum())


def rank_loads(loads: np.ndarray, ep_size: int) -> np.ndarray:
    """[L, E] per-expert loads -> [L, ep] per-rank loads, E / ep contiguous experts a rank (the engine's
    placement, builder/expert_parallel.py)."""
    L, E = loads.shape
    if E % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide the {E} experts")
    return loads.reshape(L, ep_size, E // ep_size).sum(-1)


@dataclass
class ExpertLoad:
    """Host totals of the device counters: `total` over the engine's life, `window` since the last `window()`
    call (a dashboard's scrape interval)."""

    layers: list[int]  # the model layer of each MoE layer
    num_experts: int
    ep_size: int = 1
    total: np.ndarray = field(init=False)
    _window: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.total = np.zeros((len(self.layers), self.num_experts), dtype=np.int64)
        self._window = self.total.copy()

    def add(self, counts: np.ndarray) -> None:
        """Counts read from the device, [L, E]."""
        self.total += counts
        self._window += counts

    def window(self) -> np.ndarray:
        """The loads since the previous call, and a new window."""
        out, self._window = self._window, np.zeros_like(self._window)
        return out

    def summary(self, loads: np.ndarray | None = None, ep_size: int | None = None) -> dict:
        """Metrics of `loads` (default: the totals): tokens per expert (summed over layers) and per rank,
        the routed choices counted (tokens times top_k, over the layers), and the expert and rank imbalance."""
        loads = self.total if loads is None else loads
        ep = ep_size or self.ep_size
        ranks = rank_loads(loads, ep)
        return {
            "expert_tokens": loads.sum(0).tolist(),
            "rank_tokens": ranks.sum(0).tolist(),
            "routed_choices": int(loads.sum()),  # tokens times top_k, over the layers
            "expert_imbalance": imbalance(loads),
            "rank_imbalance": imbalance(ranks),
            "ep_size": ep,
        }

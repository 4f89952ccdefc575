"""Expert parallelism for the real Inkling: how its MoE layers' weights are split over `ep_size` ranks
(docs/interfaces.md "Expert parallelism").

- Routed experts: rank r owns whole experts r*E/N .. (r+1)*E/N - 1 of each MoE layer (their NVFP4 codes,
  block scales and global scales, or their BF16 stacks); the engine records the placement.
- Shared experts: sliced along their width I (gate and up rows, down columns), so every rank does 1/N of
  their work and the partial sums add up.
- Everything else is replicated: embedding, attention, sconvs, norms, the router (every rank routes every
  token alike and computes its own experts' share), the unembedding. The step's MoE output is this rank's
  part of the sum; the program adds the parts by a reduce-scatter and an all-gather over the hidden
  channels (builder/network.py), float32 in rank order, so every rank holds the same sum.
- Rank 0 alone holds the MTP depths and the towers: the depths are dense (no experts to split), so it
  drafts alone and the other ranks only run the step.

Alone, every rank gets every token: attention is replicated. With tensor parallelism on the same ranks
(tp_size = ep_size: attention TP with MoE EP, the layout TokenSpeed's CI calls attn_tp4_moe_ep4), attention,
the dense MLPs, the shared experts and the unembedding are split as tensor parallelism splits them, the
routed experts whole as above (`rank_shard`); every rank's MoE input is the whole residual (tensor
parallelism's all-gather), and its partial sum of routed and shared experts joins the same reduce-scatter
that sums the ranks' other partial sums before the MLP's sconv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inkling.published.config import InklingConfig

from .config import require_divides
from .tensor_parallel import TensorParallel

ROUTED = ".mlp.experts."  # a routed stack's tensors: [E, ...] (w13/w2 codes or weights, scales, scale2)
SHARED_W13 = ".mlp.shared_experts.shared_w13_weight"  # [S, 2I, H] = [gate; up] (engine_tensors)
SHARED_W2 = ".mlp.shared_experts.shared_w2_weight"  # [S, H, I]


@dataclass(frozen=True)
class ExpertParallel:
    """The split of the real Inkling's experts over ep_size ranks."""

    config: InklingConfig
    ep_size: int = 1

    def __post_init__(self) -> None:
        t = self.config.text
        require_divides(
            "ep_size",
            self.ep_size,
            [
                ("n_routed_experts", t.n_routed_experts),
                ("moe_intermediate_size (the shared experts' width)", t.moe_intermediate_size),
                ("hidden_size (the MoE's all-reduce)", t.hidden_size),
            ],
        )

    @property
    def experts_per_rank(self) -> int:
        return self.config.text.n_routed_experts // self.ep_size

    def shard(self, name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of the engine tensor `name` (the tensor itself where it is replicated)."""
        n = self.ep_size
        if n == 1:
            return t
        if ROUTED in name:
            k = self.experts_per_rank
            return t[rank * k : (rank + 1) * k].clone()
        if name.endswith(SHARED_W13):
            I = t.shape[1] // 2
            s = I // n
            return torch.cat([t[:, rank * s : (rank + 1) * s], t[:, I + rank * s : I + (rank + 1) * s]], 1)
        if name.endswith(SHARED_W2):
            s = t.shape[2] // n
            return t[:, :, rank * s : (rank + 1) * s].clone()
        return t

    def rank_weights(self, weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s step weights (`weights` holds only the step's: no MTP depths, no towers)."""
        return {name: self.shard(name, t, rank) for name, t in weights.items()}


def rank_shard(tp: TensorParallel, ep: ExpertParallel, name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of the step's engine tensor `name` under tp_size and ep_size, alone or on the same
    ranks: the routed experts whole by expert parallelism; the rest by tensor parallelism where it is on
    (the shared experts' width included), else by expert parallelism (the shared experts' width split,
    everything else whole)."""
    if ep.ep_size > 1 and (ROUTED in name or tp.tp_size == 1):
        return ep.shard(name, t, rank)
    return tp.shard(name, t, rank)

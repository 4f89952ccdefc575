"""Tensor parallelism for the real Inkling: how its step's weights are split over `tp_size` ranks
(docs/interfaces.md "Tensor parallelism").

- Attention, per layer kind: the query heads split evenly; each rank keeps the KV heads its query heads
  read, split where there are at least as many as ranks, else each replicated on tp_size / Hkv
  consecutive ranks (inkling-1t at tp 8: one of the full layers' 8 and two of the sliding layers' 16).
  The fused q/k/v/r rows and the k/v sconv channels follow the heads, wo_ud's columns the query heads;
  q/k norms (over head_dim) and the layer's relative bank (shared by its heads) are replicated.
- MLPs: the dense MLPs', the routed experts' and the shared experts' widths are sliced (gate and up rows,
  down columns; NVFP4 codes and block scales alike, so a slice must hold whole 16-input groups); the router
  is replicated, so every rank routes every token alike and computes its slice of every expert: no token
  moves and the load is even whatever the routing.
- The attention output's and the MLP's partial sums are reduce-scattered over the hidden channels; the
  short convolution after each (attn_sconv, mlp_sconv) runs on the rank's channels r*H/N .. (r+1)*H/N - 1,
  its states too, and an all-gather rebuilds the residual: two collectives a block, an all-reduce's cost.
- The unembedding is split by rows of the unpadded vocabulary, ceil(V / N) a rank (the last padded with
  zero rows); the step all-gathers the logits and drops the padding. A decode step reads 1/N of it.
- Replicated: the embedding and its norm, every RMS norm, the final norm.
- Rank 0 alone holds the MTP depths (whole) with the whole unembedding for their draft picks, and the
  towers: it drafts alone, as under expert parallelism, and the other ranks run the step only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from inkling.published.config import FULL, SLIDING, AttentionShape, InklingConfig

from .config import BuildError, require_divides

NVFP4_GROUP = 16  # inputs per NVFP4 block scale: a slice of an expert's width holds whole groups
DRAFT_UNEMBED = "mtp.unembed.weight"  # rank 0 of a tp > 1 engine: the whole unembedding, for draft picks
UNEMBED = "model.llm.unembed.weight"


@dataclass(frozen=True)
class TensorParallel:
    """The split of the real Inkling's step over tp_size ranks: per-rank shapes and each rank's slices."""

    config: InklingConfig
    tp_size: int = 1

    def __post_init__(self) -> None:
        t, n = self.config.text, self.tp_size
        if n == 1:
            return
        checks = [
            ("hidden_size", t.hidden_size),
            ("num_attention_heads", t.num_attention_heads),
            ("swa_num_attention_heads", t.swa_num_attention_heads),
            ("intermediate_size (the dense MLPs)", t.intermediate_size),
        ]
        if t.n_routed_experts:
            checks.append(("moe_intermediate_size", t.moe_intermediate_size))
        require_divides("tp_size", n, checks)
        for what, kv in (
            ("num_key_value_heads", t.num_key_value_heads),
            ("swa_num_key_value_heads", t.swa_num_key_value_heads),
        ):
            if kv % n and n % kv:
                raise BuildError(
                    f"tp_size {n} and {what} {kv}: one must divide the other (KV heads are split, or "
                    "replicated where there are fewer than ranks)"
                )

    def check_routed_split(self) -> None:
        """The routed experts split along their width (tensor parallelism without expert parallelism): their
        NVFP4 block scales must split with them."""
        t, n, q = self.config.text, self.tp_size, self.config.quant
        if t.n_routed_experts and q is not None and (t.moe_intermediate_size // n) % NVFP4_GROUP:
            raise BuildError(
                f"moe_intermediate_size / tp_size = {t.moe_intermediate_size // n} is not a multiple of "
                f"{NVFP4_GROUP}: the NVFP4 experts' block scales cannot be split (expert parallelism, "
                "ep_size = tp_size, keeps them whole)"
            )

    # Per-rank shapes.
    def attention_of(self, layer_type: str) -> AttentionShape:
        """A rank's share of a layer kind's attention: its query heads and the KV heads they read."""
        a = self.config.text.attention_of(layer_type)
        n = self.tp_size
        return replace(a, num_heads=a.num_heads // n, num_kv_heads=max(a.num_kv_heads // n, 1))

    def attention(self, layer: int) -> AttentionShape:
        return self.attention_of(self.config.text.layer_types[layer])

    @property
    def hidden_slice(self) -> int:
        """The channels of the sconvs after the partial sums (and of their states) on one rank."""
        return self.config.text.hidden_size // self.tp_size

    @property
    def vocab_slice(self) -> int:
        """Unembedding rows per rank (the last rank's padded with zero rows)."""
        return -(-self.config.text.num_real_tokens // self.tp_size)

    def sizes(self) -> dict[str, object]:
        """The per-rank sizes the engine's `mapping` records."""
        full, sliding = self.attention_of(FULL), self.attention_of(SLIDING)
        return {
            "num_attention_heads": full.num_heads,
            "num_key_value_heads": full.num_kv_heads,
            "swa_num_attention_heads": sliding.num_heads,
            "swa_num_key_value_heads": sliding.num_kv_heads,
            "hidden_slice": self.hidden_slice,
            "vocab_slice": self.vocab_slice,
        }

    # Slices.
    def _kv_heads(self, a: AttentionShape, rank: int) -> range:
        """The whole model's KV heads rank `rank` keeps (`a`: the whole layer's shape)."""
        n = self.tp_size
        if a.num_kv_heads >= n:
            k = a.num_kv_heads // n
            return range(rank * k, (rank + 1) * k)
        first = rank // (n // a.num_kv_heads)
        return range(first, first + 1)

    def _attention_rows(self, a: AttentionShape, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the fused q/k/v/r rows, the k or v rows within their kv_size) rank `rank` keeps."""
        h = a.num_heads // self.tp_size
        heads = range(rank * h, (rank + 1) * h)
        kv = self._kv_heads(a, rank)

        def rows(units, size: int, base: int = 0) -> list[int]:
            return [base + u * size + i for u in units for i in range(size)]

        kv_rows = rows(kv, a.head_dim)
        fused = (
            rows(heads, a.head_dim)
            + rows(kv, a.head_dim, a.q_size)
            + rows(kv, a.head_dim, a.q_size + a.kv_size)
            + rows(heads, a.d_rel, a.q_size + 2 * a.kv_size)
        )
        return torch.tensor(fused), torch.tensor(kv_rows)

    def _layer_shape(self, name: str) -> AttentionShape | None:
        """The whole attention shape of the trunk layer `name` belongs to (None: not a trunk layer's)."""
        prefix = "model.llm.layers."
        if not name.startswith(prefix):
            return None
        return self.config.text.attention(int(name[len(prefix) :].split(".", 1)[0]))

    def shard(self, name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of the step's engine tensor `name` (the tensor itself where replicated)."""
        n = self.tp_size
        if n == 1:
            return t
        if name == UNEMBED:
            V, s = self.config.text.num_real_tokens, self.vocab_slice
            part = t[rank * s : min((rank + 1) * s, V)]
            return torch.cat([part, part.new_zeros(s - part.shape[0], *part.shape[1:])])
        a = self._layer_shape(name)
        if a is not None and ".attn." in name:
            fused, kv = self._attention_rows(a, rank)
            if name.endswith("attn.wqkvr.weight"):
                return t[fused].contiguous()
            if name.endswith(("attn.k_sconv.weight", "attn.v_sconv.weight")):
                return t[kv].contiguous()
            if name.endswith("attn.wo_ud.weight"):
                return chunk(t, 1, rank, n)
            return t  # q/k norms, the relative bank
        if name.endswith(("attn_sconv.weight", "mlp_sconv.weight")):
            return chunk(t, 0, rank, n)
        if name.endswith("mlp.gate_up.weight"):  # [gate; up] rows
            return gate_up_rows(t, 0, rank, n)
        if name.endswith("mlp.w2_md.weight"):
            return chunk(t, 1, rank, n)
        if name.endswith(("experts.w13_weight", "experts.w13_weight.scale", "shared_w13_weight")):
            return gate_up_rows(t, 1, rank, n)
        if name.endswith(("experts.w2_weight", "experts.w2_weight.scale", "shared_w2_weight")):
            return chunk(t, 2, rank, n)
        return t

    def rank_weights(self, weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s step weights (`weights` holds only the step's: no MTP depths, no towers)."""
        return {name: self.shard(name, t, rank) for name, t in weights.items()}


def chunk(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """The rank-th of n equal parts of t along dim."""
    return t.chunk(n, dim)[rank].contiguous()


def gate_up_rows(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """The rank-th slice of both halves of a [gate; up] stack along dim: [gate_r; up_r]."""
    gate, up = t.chunk(2, dim)
    return torch.cat([chunk(gate, dim, rank, n), chunk(up, dim, rank, n)], dim)

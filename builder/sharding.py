"""Tensor parallelism: how an engine's weights are split over `tp_size` ranks (DESIGN.md "Tensor
parallelism", docs/interfaces.md "Tensor parallelism").

- Attention: query heads split evenly, each rank with the key/value heads its query heads read; where
  Hkv < tp_size, each KV head is replicated on tp_size / Hkv consecutive ranks. qkvr_proj rows, rel_embed,
  sconv_k/sconv_v rows and o_proj columns follow the heads.
- MoE: every routed and shared expert is sliced along its intermediate width I (gate/up rows, down
  columns), the router replicated: every rank routes every token the same way and computes its slice of
  every expert, so no token moves between ranks and the load is even whatever the routing. (Expert
  parallelism would need `inkling::expert_sink_moe` to take the rank's range of experts.)
- The partial sums after o_proj and after the MoE combine are reduce-scattered over the hidden channels:
  sconv_o and sconv_m are split by channel, rank r owning channels r*H/N .. (r+1)*H/N - 1.
- lm_head is split by vocabulary rows, rank r owning rows r*Vs .. (r+1)*Vs - 1 (Vs = ceil(V / N), the
  last rank's slice padded with zero rows); the step all-gathers the ranks' logits and drops the padding.
  A decode step then reads 1/N of lm_head per GPU (inkling-1t: 0.72 of 2.87 GB at tp 4).
- The MTP heads are split as a layer is: attention by head, the dense FFN along mtp_intermediate_size
  (gate/up rows, down columns; the program all-reduces its partial sums), eh_proj and the norms
  replicated. Every rank runs every head pass (the runtime mirrors rank 0's rounds), and every rank makes
  the same draft pick from the whole lm_head (`mtp.lm_head.weight`, where there are heads), so the drafts
  agree without a broadcast.
- Replicated: embeddings, norms, router and final norm. The image/audio encoders live on rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inkling.config import InklingConfig

from .config import BuildError

NVFP4_GROUP = 16  # inputs per NVFP4 block scale: a slice of I must hold whole groups
DRAFT_LM_HEAD = (
    "mtp.lm_head.weight"  # every rank of a tensor-parallel engine: the whole lm_head, for draft picks
)


@dataclass(frozen=True)
class TensorParallel:
    """The split of one model over tp_size ranks: per-rank sizes, and each rank's slices."""

    config: InklingConfig
    tp_size: int = 1

    def __post_init__(self) -> None:
        c, n = self.config, self.tp_size
        if n == 1:
            return
        for what, value in (
            ("num_attention_heads", c.num_attention_heads),
            ("hidden_size", c.hidden_size),
            ("moe_intermediate_size", c.moe_intermediate_size),
        ):
            if value % n:
                raise BuildError(f"tp_size {n} does not divide {what} ({value})")
        if c.num_key_value_heads % n and n % c.num_key_value_heads:
            raise BuildError(
                f"tp_size {n} and num_key_value_heads {c.num_key_value_heads}: one must divide the other "
                "(KV heads are split, or replicated where there are fewer than ranks)"
            )
        if c.num_mtp_heads and c.mtp_intermediate_size % n:
            raise BuildError(f"tp_size {n} does not divide mtp_intermediate_size ({c.mtp_intermediate_size})")
        if (c.moe_intermediate_size // n) % NVFP4_GROUP:
            raise BuildError(
                f"moe_intermediate_size / tp_size = {c.moe_intermediate_size // n} is not a multiple of "
                f"{NVFP4_GROUP} (NVFP4 block scales cannot be split)"
            )

    # Per-rank sizes.
    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.tp_size

    @property
    def num_kv_heads(self) -> int:
        return max(self.config.num_key_value_heads // self.tp_size, 1)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head: 1 where the KV heads split, tp_size / Hkv where they do not."""
        return max(self.tp_size // self.config.num_key_value_heads, 1)

    @property
    def hidden_slice(self) -> int:
        """Channels of the rank's slice of the hidden state (sconv_o, sconv_m and their states)."""
        return self.config.hidden_size // self.tp_size

    @property
    def moe_slice(self) -> int:
        return self.config.moe_intermediate_size // self.tp_size

    @property
    def vocab_slice(self) -> int:
        """lm_head rows per rank (the last rank's padded with zero rows)."""
        return -(-self.config.vocab_size // self.tp_size)

    def conv_channels(self) -> list[int]:
        """Channels of the rank's sconv states, layer by layer, sites k, v, o, m (the step's order)."""
        kv = self.num_kv_heads * self.config.head_dim
        return [
            C
            for _ in range(self.config.num_hidden_layers)
            for C in (kv, kv, self.hidden_slice, self.hidden_slice)
        ]

    def sizes(self) -> dict[str, int]:
        """The per-rank sizes recorded in the engine's config.json `mapping`."""
        return {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "kv_head_replicas": self.kv_replicas,
            "hidden_slice": self.hidden_slice,
            "moe_intermediate_slice": self.moe_slice,
            "vocab_slice": self.vocab_slice,
        }

    # Slices.
    def split(self, weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every rank's weights (`shard`), emptying `weights` tensor by tensor as it goes, so that the
        build holds the model about once, not once whole and once sharded."""
        ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
        for name in list(weights):
            w = weights.pop(name)
            for rank, out in enumerate(ranks):
                out.update(self._parts(name, w, rank))
        return ranks

    def shard(self, weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s weights."""
        out: dict[str, torch.Tensor] = {}
        for name, w in weights.items():
            out.update(self._parts(name, w, rank))
        return out

    def _parts(self, name: str, w: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """What rank `rank` holds of tensor `name`: its part under the same name, and the whole lm_head for
        the MTP heads' draft pick."""
        out = {name: self._part(name, w, rank)}
        if name == "lm_head.weight" and self.tp_size > 1 and self.config.num_mtp_heads:
            out[DRAFT_LM_HEAD] = w
        return out

    def _part(self, name: str, w: torch.Tensor, rank: int) -> torch.Tensor:
        if self.tp_size == 1:
            return w
        if name.startswith("mtp."):
            return self._head_part(name.split(".", 2)[2], w, rank)
        if name == "lm_head.weight":
            Vs = self.vocab_slice
            rows = w[rank * Vs : (rank + 1) * Vs]
            if rows.shape[0] < Vs:  # the last rank's slice: zero rows up to Vs
                rows = torch.cat([rows, rows.new_zeros(Vs - rows.shape[0], *rows.shape[1:])])
            return rows.clone()  # not a view: the rank also saves the whole lm_head (DRAFT_LM_HEAD)
        leaf = name.rsplit(".self_attn.", 1)[-1].rsplit(".mlp.", 1)[-1]
        return self._slice(leaf, w, rank).contiguous()

    def _head_part(self, name: str, w: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of an MTP head's tensor, by its name within `mtp.{m}.`."""
        if name.startswith("self_attn."):
            return self._slice(name.removeprefix("self_attn."), w, rank).contiguous()
        Im = self.config.mtp_intermediate_size // self.tp_size
        if name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return w[rank * Im : (rank + 1) * Im].contiguous()
        if name == "mlp.down_proj.weight":
            return w[:, rank * Im : (rank + 1) * Im].contiguous()
        return w  # replicated: eh_proj, the norms

    def _slice(self, leaf: str, w: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of a layer tensor, by its name within `self_attn.` or `mlp.`."""
        c = self.config
        D, Hq = c.head_dim, self.num_heads
        h0 = rank * Hq  # the rank's first query head
        g0 = h0 // (c.num_attention_heads // c.num_key_value_heads)  # the first KV head it reads
        kv = self.num_kv_heads * D
        H, I = self.hidden_slice, self.moe_slice
        if leaf == "qkvr_proj.weight":  # rows: q | k | v | r, each cut to the rank's heads
            q, k, v, r = w.split((c.q_size, c.kv_size, c.kv_size, c.r_size))
            Dr = c.rel_head_dim
            return torch.cat([q[h0 * D : (h0 + Hq) * D], k[g0 * D : g0 * D + kv], v[g0 * D : g0 * D + kv],
                              r[h0 * Dr : (h0 + Hq) * Dr]])  # fmt: skip
        slices = {
            "o_proj.weight": (1, h0 * D, Hq * D),
            "rel_embed": (0, h0, Hq),
            "sconv_k.weight": (0, g0 * D, kv),
            "sconv_v.weight": (0, g0 * D, kv),
            "sconv_o.weight": (0, rank * H, H),
            "sconv_m.weight": (0, rank * H, H),
            "shared_w2": (2, rank * I, I),
            "experts_packed.w2": (2, rank * I // 2, I // 2),  # two E2M1 codes per byte
            "experts_packed.w2_scale": (2, rank * I // NVFP4_GROUP, I // NVFP4_GROUP),  # a scale per group
        }
        if leaf in slices:
            return w.narrow(*slices[leaf])
        if leaf in ("shared_w13", "experts_packed.w13", "experts_packed.w13_scale"):
            gate, up = w.split(c.moe_intermediate_size, dim=1)  # rows: gate then up
            return torch.cat([gate[:, rank * I : (rank + 1) * I], up[:, rank * I : (rank + 1) * I]], 1)
        return w  # replicated: embeddings, norms, router, NVFP4 global scales, final norm

"""The engine network: the spec's model expressed through the `inkling::*` plugin ops, over paged caches.

One step program serves every step kind (prefill, chunked prefill, MTP verify, decode): the new tokens
of B sequences are concatenated (docs/interfaces.md). Weights are an input (a dict, the engine's
`rank{r}.safetensors`), so the exported program carries no weights and the runtime owns the memory;
the caches are inputs that the ops mutate in place. Under tensor parallelism each rank's program sees
its own heads, expert slices and channel slices, and meets the other ranks in `channel_sconv`.

KV cache groups (docs/interfaces.md "KV cache"): layers are split into groups of `group_size` layers
of one kind; layer l uses pool tensor `l % group_size` and block table `l // group_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import plugins  # noqa: F401  (registers torch.ops.inkling.*)
from inkling.config import InklingConfig

from .config import BuildConfig
from .contracts import HEAD, STEP
from .sharding import TensorParallel


def kv_group_size(c: InklingConfig) -> int:
    """Layers are grouped by kind into groups of this many layers (gcd of the two kinds' counts), so the
    pool needs this many tensors and each group one block table, as vLLM's hybrid allocator does."""
    n_full = sum(1 for i in range(c.num_hidden_layers) if not c.is_sliding(i))
    return math.gcd(n_full, c.num_hidden_layers - n_full) or c.num_hidden_layers


def layer_groups(c: InklingConfig) -> list[list[int]]:
    """Groups of `kv_group_size` layers, each all full or all sliding: full layers first, then sliding."""
    g = kv_group_size(c)
    full = [i for i in range(c.num_hidden_layers) if not c.is_sliding(i)]
    sliding = [i for i in range(c.num_hidden_layers) if c.is_sliding(i)]
    return [full[i : i + g] for i in range(0, len(full), g)] + [
        sliding[i : i + g] for i in range(0, len(sliding), g)
    ]


@dataclass(frozen=True)
class CacheLayout:
    """Where each layer's KV lives: (group index, pool slot) per layer; window per group."""

    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]
    group_windows: tuple[int, ...]
    pool_size: int

    @classmethod
    def of(cls, c: InklingConfig) -> CacheLayout:
        groups = layer_groups(c)
        group_of = [0] * c.num_hidden_layers
        slot_of = [0] * c.num_hidden_layers
        for gi, layers in enumerate(groups):
            for j, layer in enumerate(layers):
                group_of[layer], slot_of[layer] = gi, j
        windows = tuple(c.sliding_window if c.is_sliding(layers[0]) else 0 for layers in groups)
        return cls(tuple(group_of), tuple(slot_of), windows, kv_group_size(c))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class StepProgram(nn.Module):
    """forward(weights, input_ids, mm_embeds, mm_positions, cu_seqlens_q, seq_lens, block_tables,
    slot_mappings, state_indices, logits_indices, q_bound, key_caches, value_caches, conv_states)
    -> (logits float32 [N, V], hidden [T, H]); the arguments are the STEP contract's (builder/contracts.py).

    input_ids [T]; mm_embeds [M+1, H] and mm_positions [M+1] splice image/audio embeddings (the last
    row is a dummy aimed at position T, so M = 0 needs no empty tensor); block_tables int32 [G, B, MB];
    slot_mappings int64 [G, T]; logits_indices [N]: the rows whose logits are wanted.
    conv_states: 4 per layer, sites k, v, o, m, each [slots, S, C].
    """

    def __init__(
        self,
        config: InklingConfig,
        build: BuildConfig,
        impls: dict[str, str],
        moe_tiles: str = "",
        tp: TensorParallel | None = None,
    ):
        """tp: the rank's share of a tensor-parallel engine (builder/sharding.py); None for one rank."""
        super().__init__()
        self.moe_tiles = moe_tiles
        self.c = config
        self.layout = CacheLayout.of(config)
        self.impls = impls
        self.fuse_kv = build.plugin_config.fuse_sconv_kv_write
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.tp = tp or TensorParallel(config)
        self.num_heads, self.num_kv_heads = self.tp.num_heads, self.tp.num_kv_heads

    def embed(self, table, input_ids, mm_embeds, mm_positions):
        """Rows of the embedding `table`, with the image/audio embeddings spliced in by position."""
        e = table[input_ids]
        e = torch.cat([e, e.new_zeros(1, e.shape[1])])
        return e.index_copy(0, mm_positions, mm_embeds.to(e.dtype))[:-1]

    def attention(self, w, p, x, window, meta, key_cache, value_cache, conv):
        c = self.c
        T = x.shape[0]
        cu, seq_lens, state_idx, block_table, slot_mapping, max_q = meta
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, c.head_dim
        q, k, v, r = (x @ w[f"{p}.qkvr_proj.weight"].T).split(
            (Hq * D, Hkv * D, Hkv * D, Hq * c.rel_head_dim), -1
        )
        impl = self.impls["sconv"]
        if self.fuse_kv:
            torch.ops.inkling.sconv_kv_write(
                k.contiguous(), v.contiguous(), w[f"{p}.sconv_k.weight"], w[f"{p}.sconv_v.weight"],
                conv[0], conv[1], state_idx, cu, key_cache, value_cache, slot_mapping, impl,
            )  # fmt: skip
        else:
            k = torch.ops.inkling.sconv(
                k.contiguous(), w[f"{p}.sconv_k.weight"], conv[0], state_idx, cu, impl
            )
            v = torch.ops.inkling.sconv(
                v.contiguous(), w[f"{p}.sconv_v.weight"], conv[1], state_idx, cu, impl
            )
            torch.ops.inkling.kv_cache_write(
                k.view(T, Hkv, D), v.view(T, Hkv, D),
                key_cache, value_cache, slot_mapping, self.impls["sheared_bias_attention"],
            )  # fmt: skip
        o = torch.ops.inkling.sheared_bias_attention(
            q.reshape(T, Hq, D).contiguous(),
            r.reshape(T, Hq, c.rel_head_dim).contiguous(),
            w[f"{p}.rel_embed"], key_cache, value_cache, block_table, cu, seq_lens,
            max_q, window, self.scale, self.impls["sheared_bias_attention"],
        )  # fmt: skip
        a = o.reshape(T, -1) @ w[f"{p}.o_proj.weight"].T  # a partial sum over the rank's heads
        return self.channel_sconv(a, w[f"{p}.sconv_o.weight"], conv[2], state_idx, cu)

    def channel_sconv(self, x, weight, state, state_idx, cu):
        """sconv of the sum over ranks of the partial sums `x` [T, H]: reduce-scatter to the rank's channel
        slice [T, H/N], convolve it with the rank's slice of the weight and its own state, all-gather
        (DESIGN.md "Tensor parallelism"). With one rank, just the sconv."""
        n = self.tp.tp_size
        if n > 1:
            x = torch.ops.inkling.reduce_scatter(x, n, self.impls["collectives"])
        y = torch.ops.inkling.sconv(x, weight, state, state_idx, cu, self.impls["sconv"])
        if n > 1:
            y = torch.ops.inkling.all_gather(y, n, self.impls["collectives"])
        return y

    def moe(self, w, p, x, conv_m, meta):
        from plugins.moe import PACKED_NAMES

        cu, _, state_idx, _, _, _ = meta
        y = torch.ops.inkling.expert_sink_moe(
            x, w[f"{p}.router.weight"], *[w[f"{p}.experts_packed.{key}"] for key in PACKED_NAMES],
            w[f"{p}.shared_w13"], w[f"{p}.shared_w2"], self.c.num_routed_experts, self.c.num_experts_per_tok,
            self.moe_tiles, self.impls["expert_sink_moe"],
        )  # fmt: skip
        return self.channel_sconv(y, w[f"{p}.sconv_m.weight"], conv_m, state_idx, cu)

    @STEP.implements
    def forward(
        self,
        weights: dict[str, torch.Tensor],
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor,
        mm_positions: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mappings: torch.Tensor,
        state_indices: torch.Tensor,
        logits_indices: torch.Tensor,
        q_bound: torch.Tensor,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        conv_states: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w, lay = self.c, weights, self.layout
        x = self.embed(w["model.embed_tokens.weight"], input_ids, mm_embeds, mm_positions)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            g, j = lay.group_of_layer[i], lay.slot_of_layer[i]
            meta = (
                cu_seqlens_q,
                seq_lens,
                state_indices,
                block_tables[g],
                slot_mappings[g],
                q_bound.shape[0],
            )
            conv = conv_states[4 * i : 4 * i + 4]
            h = x + self.attention(
                w, f"{p}.self_attn", rms_norm(x, w[f"{p}.input_layernorm.weight"], c.rms_norm_eps),
                lay.group_windows[g], meta, key_caches[j], value_caches[j], conv,
            )  # fmt: skip
            x = h + self.moe(
                w,
                f"{p}.mlp",
                rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], c.rms_norm_eps),
                conv[3],
                meta,
            )
        normed = rms_norm(x[logits_indices], w["model.norm.weight"], c.rms_norm_eps)
        logits = normed @ w["lm_head.weight"].T
        if self.tp.tp_size > 1:  # each rank's vocabulary rows (builder/sharding.py), gathered
            logits = torch.ops.inkling.all_gather(logits, self.tp.tp_size, self.impls["collectives"])
            logits = logits[:, : c.vocab_size]
        return logits.float(), x


class HeadProgram(StepProgram):
    """One MTP head's pass (INKLING_SPEC §5) over a ragged batch, with the head's own paged KV and
    sconv states: forward(weights, h_prev, input_ids, mm_embeds, mm_positions, cu_seqlens_q, seq_lens,
    block_table, slot_mapping, state_indices, q_bound, key_cache, value_cache, conv_states) -> h^m [T, H].

    The same program serves every head: `weights` holds one head's tensors without their `mtp.{m}.`
    prefix, plus `embed_tokens` (the main model's embedding table). Row t of h_prev is
    h^{m-1} at the head position t, and input_ids[t] is the token m places ahead (a draft where it is
    not known yet); image/audio pads are spliced as in the step. block_table [B, MB] and slot_mapping
    [T] are those of the full-attention group 0 (the heads are full-attention layers; docs/interfaces.md
    "MTP heads"). conv_states: sites k, v, o. The drafts themselves come from `inkling::mtp_draft` on
    the rows that draft (the runtime picks them), so catching up a head costs no lm_head pass.
    """

    @HEAD.implements
    def forward(
        self,
        weights: dict[str, torch.Tensor],
        h_prev: torch.Tensor,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor,
        mm_positions: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        state_indices: torch.Tensor,
        q_bound: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        conv_states: list[torch.Tensor],
    ) -> torch.Tensor:
        c, w = self.c, weights
        eps = c.rms_norm_eps
        e = self.embed(w["embed_tokens"], input_ids, mm_embeds, mm_positions)
        u = torch.cat([rms_norm(h_prev, w["hnorm.weight"], eps), rms_norm(e, w["enorm.weight"], eps)], -1)
        u = u @ w["eh_proj.weight"].T
        meta = (cu_seqlens_q, seq_lens, state_indices, block_table, slot_mapping, q_bound.shape[0])
        h = u + self.attention(
            w, "self_attn", rms_norm(u, w["input_layernorm.weight"], eps), 0, meta, key_cache, value_cache,
            conv_states,
        )  # fmt: skip
        x = rms_norm(h, w["post_attention_layernorm.weight"], eps)
        ffn = torch.nn.functional.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)
        y = ffn @ w["mlp.down_proj.weight"].T  # a partial sum over the rank's slice of the FFN
        n = self.tp.tp_size
        if n > 1:  # the sum over ranks (an all-reduce as reduce-scatter then all-gather, as in the step)
            y = torch.ops.inkling.reduce_scatter(y, n, self.impls["collectives"])
            y = torch.ops.inkling.all_gather(y, n, self.impls["collectives"])
        return h + y

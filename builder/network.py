"""The real Inkling's step program (INKLING_SPEC §3) through the `inkling::*` ops, over paged caches.

The STEP contract of builder/contracts.py: one program for every step kind (prefill, chunked prefill,
verify, decode) over the new tokens of B sequences. What makes it Inkling:
- caches per layer kind: full layers hold `num_key_value_heads` KV heads, sliding ones
  `swa_num_key_value_heads`; layers are grouped by kind (`CacheLayout`) and `key_caches` lists
  the full kind's pool slots, then the sliding kind's;
- the four short convolutions of a layer add their input (u + conv(u)) and run in float32, their
  states float32 too (`conv_states`: sites k, v, attention output, MLP output of every layer);
- q/k RMS norms, a 1/D scale, the layer's relative bank and log scaling in `inkling::bank_attention`;
- dense MLPs in the first layers, the sigmoid router in `inkling::sigmoid_sink_moe`;
- the embedding is RMS-normed (text rows; spliced media rows are the towers' own), the final hidden
  state divided by the muP multiplier, the logits cut to the unpadded vocabulary.

Weights are the engine's (`engine_tensors`): the checkpoint's names, with q/k/v/r fused into one
projection, every w13 de-interleaved to [gate; up], the sconv weights [C, K] and the router's bias and
scale in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

import plugins  # noqa: F401  (registers torch.ops.inkling.*)
from inkling.published.config import FULL, SLIDING, AttentionShape, InklingConfig
from inkling.published.ops import deinterleave, rms_norm

from .contracts import HEAD, STEP
from .tensor_parallel import UNEMBED, TensorParallel

_EMPTY = torch.empty(0)


@dataclass(frozen=True)
class CacheLayout:
    """Layers grouped by kind into groups of `pool_size` (the gcd of the kinds' counts); layer l uses
    block table `group_of_layer[l]` and cache `cache_of_layer[l]` of `key_caches`."""

    group_of_layer: tuple[int, ...]
    cache_of_layer: tuple[int, ...]
    group_kinds: tuple[str, ...]
    pool_size: int

    @classmethod
    def of(cls, c: InklingConfig) -> CacheLayout:
        t = c.text
        by_kind = {
            k: [i for i in range(t.num_hidden_layers) if t.layer_types[i] == k] for k in (FULL, SLIDING)
        }
        g = math.gcd(len(by_kind[FULL]), len(by_kind[SLIDING])) or t.num_hidden_layers
        group_of, cache_of, kinds = [0] * t.num_hidden_layers, [0] * t.num_hidden_layers, []
        for base, kind in enumerate((FULL, SLIDING)):
            layers = by_kind[kind]
            for start in range(0, len(layers), g):
                for j, layer in enumerate(layers[start : start + g]):
                    group_of[layer], cache_of[layer] = len(kinds), base * g + j
                kinds.append(kind)
        return cls(tuple(group_of), tuple(cache_of), tuple(kinds), g)

    def cache_kinds(self) -> tuple[str, ...]:
        """The kind of each of `key_caches`: pool_size full slots, then pool_size sliding ones."""
        return (FULL,) * self.pool_size + (SLIDING,) * self.pool_size


def conv_channels(c: InklingConfig, tp_size: int = 1) -> list[int]:
    """Channels of each layer's four sconv states (k, v, attention output, MLP output) on one of tp_size
    ranks: its KV heads' and its slice of the hidden channels (builder/tensor_parallel.py)."""
    tp = TensorParallel(c, tp_size)
    out = []
    for i in range(c.text.num_hidden_layers):
        kv = tp.attention(i).kv_size
        out += [kv, kv, tp.hidden_slice, tp.hidden_slice]
    return out


def engine_tensors(
    c: InklingConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, num_depths: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in the engine's form (module docstring); NVFP4 stacks keep their codes.
    MTP depths 0..num_depths-1 become `mtp.{d}.*` (the depths a deployment drafts with; the rest are
    dropped), in the same form."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name.startswith("model.mtp.layers."):
            d, rest = name[len("model.mtp.layers.") :].split(".", 1)
            if int(d) >= num_depths:
                continue
            name = f"mtp.{d}.{rest}"
        if name.endswith(
            ("attn.wq_du.weight", "attn.wk_dv.weight", "attn.wv_dv.weight", "attn.wr_du.weight")
        ):
            prefix, part = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            parts = pending.setdefault(prefix, {})
            parts[part] = t
            if len(parts) == 4:
                del pending[prefix]
                fused = torch.cat([parts[k] for k in ("wq_du", "wk_dv", "wv_dv", "wr_du")])
                yield f"{prefix}.wqkvr.weight", fused.to(dtype)
        elif "sconv" in name:
            yield name, t.reshape(t.shape[0], -1).float()  # [C, 1, K] -> [C, K]
        elif name.endswith(("mlp.gate.bias", "mlp.gate.global_scale")):
            yield name, t.float()  # the router runs in float32 (INKLING_SPEC §3.6)
        elif name.endswith("mlp.gate.weight"):
            # Its logits are float32; a BF16 gate stays BF16 in a bf16 engine (its products are exact in
            # float32: the GPU reads half the bytes), anything else becomes float32
            yield name, t if t.dtype == dtype == torch.bfloat16 else t.float()
        elif name.endswith("mlp.w13_dn.weight"):
            yield name.replace("w13_dn", "gate_up"), deinterleave(t, 0).to(dtype)
        elif name.endswith(("experts.w13_weight", "shared_w13_weight", "experts.w13_weight.scale")):
            out = deinterleave(t, 1)  # rows quantize independently: the codes' and scales' rows move alike
            yield name, out if t.dtype in (torch.uint8, torch.float8_e4m3fn) else out.to(dtype)
        elif name.endswith(".original_shape") or name.endswith(".input_amax"):
            continue  # the reference dequantizes weights only; a W4A4 path would read input_amax
        elif t.dtype in (torch.uint8, torch.float8_e4m3fn) or name.endswith(".scale2"):
            yield name, t
        else:
            yield name, t.to(dtype)
    if pending:
        raise ValueError(f"attention projections incomplete for {sorted(pending)}")


class StepProgram(nn.Module):
    """forward(weights, input_ids, mm_embeds, mm_positions, cu_seqlens_q, seq_lens, block_tables,
    slot_mappings, state_indices, logits_indices, q_bound, key_caches, value_caches, conv_states, expert_load)
    -> (logits float32 [N, num_real_tokens], hidden [T, H]): the STEP contract's arguments
    (builder/contracts.py); block_tables int32 [G, B, MB], slot_mappings int64 [G, T] per layer group;
    expert_load int32 [E] per MoE layer, the tokens routed to each expert added by the step (its rows with a
    slot, not a graph bucket's padding)."""

    def __init__(
        self,
        config: InklingConfig,
        impls: dict[str, str],
        moe_tiles: str = "",
        ep_size: int = 1,
        tp_size: int = 1,
        dp_size: int = 1,
    ):
        """ep_size > 1: each rank holds its share of the routed experts and of the shared experts' width
        (builder/expert_parallel.py); the MoE's partial sums meet by a reduce-scatter and an all-gather
        over the hidden channels (an all-reduce, float32 in rank order: impls["collectives"]).
        tp_size > 1: each rank holds its heads and its slices of every MLP and of the unembedding
        (builder/tensor_parallel.py); attention's and the MLP's partial sums are reduce-scattered, their
        sconvs run on the rank's channels, and an all-gather rebuilds the residual; the logits are
        gathered. Both (on the same ranks): the routed experts as ep_size, the rest as tp_size; the MoE's
        partial sum is reduce-scattered with the MLP's sconv as the dense MLPs' are.
        dp_size > 1 (= ep_size, on the same ranks): each rank runs its own requests' tokens (every rank the
        same number T, padded by the runner); a MoE layer gathers all ranks' rows, computes this rank's
        experts' share for all of them, and reduce-scatters the sums back to their ranks (`dp_moe`)."""
        super().__init__()
        self.c, self.impls, self.moe_tiles, self.ep_size = config, impls, moe_tiles, ep_size
        self.dp_size = dp_size
        self.tp = TensorParallel(config, tp_size)
        self.layout = CacheLayout.of(config)
        t = config.text
        self.moe_index = {
            i: n for n, i in enumerate(j for j in range(t.num_hidden_layers) if not t.is_dense(j))
        }

    def sconv(self, x, weight, state, state_idx, cu):
        """u + conv(u) in float32 (INKLING_SPEC §3.3), cast back to x's dtype."""
        u = x.float()
        return (u + torch.ops.inkling.sconv(u, weight, state, state_idx, cu, self.impls["sconv"])).to(x.dtype)

    def summed_sconv(self, part, weight, state, state_idx, cu):
        """The sconv of the sum of the ranks' partial sums `part` [T, H]: under tensor parallelism
        reduce-scattered, convolved on this rank's channels (its slice of the weight and state) and
        gathered; otherwise `part` is the whole sum."""
        n = self.tp.tp_size
        if n == 1:
            return self.sconv(part, weight, state, state_idx, cu)
        impl = self.impls["collectives"]
        own = torch.ops.inkling.reduce_scatter(part, n, impl)
        return torch.ops.inkling.all_gather(self.sconv(own, weight, state, state_idx, cu), n, impl)

    def attention(self, w, p, a, shape: AttentionShape, meta, key_cache, value_cache, conv, log_scaling=True):
        """One attention block of `shape` (a trunk layer's or an MTP depth's); log_scaling: apply the
        shape's τ(i) (full layers; MTP depths only with mtp_config.log_scaling)."""
        t = self.c.text
        cu, seq_lens, state_idx, block_table, slot_mapping, max_q = meta
        T, Hq, Hkv, D = a.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim
        q, k, v, r = (a @ w[f"{p}.attn.wqkvr.weight"].T).split(
            (shape.q_size, shape.kv_size, shape.kv_size, shape.r_size), -1
        )
        k = self.sconv(k, w[f"{p}.attn.k_sconv.weight"], conv[0], state_idx, cu)
        v = self.sconv(v, w[f"{p}.attn.v_sconv.weight"], conv[1], state_idx, cu)
        q = rms_norm(q.reshape(T, Hq, D), w[f"{p}.attn.q_norm.weight"], t.rms_norm_eps)
        k = rms_norm(k.reshape(T, Hkv, D), w[f"{p}.attn.k_norm.weight"], t.rms_norm_eps)
        torch.ops.inkling.kv_cache_write(
            k,
            v.reshape(T, Hkv, D).contiguous(),
            key_cache,
            value_cache,
            slot_mapping,
            self.impls["kv_cache_write"],
        )
        o = torch.ops.inkling.bank_attention(
            q.contiguous(), r.reshape(T, Hq, shape.d_rel).contiguous(), w[f"{p}.attn.rel_logits_proj.proj"],
            key_cache, value_cache, block_table, cu, seq_lens, max_q, shape.window or 0, 1.0 / D,
            (shape.log_scaling_n_floor or 0) if log_scaling else 0, shape.log_scaling_alpha,
            self.impls["bank_attention"],
        )  # fmt: skip
        return o.reshape(T, -1) @ w[f"{p}.attn.wo_ud.weight"].T

    @staticmethod
    def dense_mlp(w, p, m):
        g, u = (m @ w[f"{p}mlp.gate_up.weight"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ w[f"{p}mlp.w2_md.weight"].T * w[f"{p}mlp.global_scale"]

    def embed(self, w, input_ids, mm_embeds, mm_positions):
        """The trunk's input rows: embed-normed token rows, the towers' rows spliced in (not normed)."""
        x = rms_norm(
            w["model.llm.embed.weight"][input_ids], w["model.llm.embed_norm.weight"], self.c.text.rms_norm_eps
        )
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])  # the splice's dummy row at T (STEP contract)
        return x.index_copy(0, mm_positions, mm_embeds.to(x.dtype))[:-1]

    def mlp(self, w, p, m, layer, load, row_valid):
        t = self.c.text
        if t.is_dense(layer):
            return self.dense_mlp(w, f"{p}.", m)
        if self.dp_size > 1:
            return self.dp_moe(w, p, m, load, row_valid)
        return self.moe(w, p, m, load, row_valid)

    def dp_moe(self, w, p, m, load, row_valid):
        """The MoE of data-parallel replicas: rank r's T rows meet the other ranks' in one all-gather (their
        validity as one more channel: a replica's padding rows count no load), every rank computes its
        experts' share and its slice of the shared experts for all N*T rows (the router is replicated, so
        each row routes alike everywhere), and a reduce-scatter gives rank r the sums of its own rows, float32
        in rank order. The collectives split columns, so rows travel transposed: [C, T] per rank."""
        n, impl = self.dp_size, self.impls["collectives"]
        T = m.shape[0]
        own = torch.cat([m, row_valid.to(m.dtype)[:, None]], 1).T.contiguous()  # [H + 1, T]
        rows = torch.ops.inkling.all_gather(own, n, impl).T  # [N*T, H + 1], rank r's rows at r*T..
        y = self.moe(w, p, rows[:, :-1].contiguous(), load, rows[:, -1] > 0, summed=False)
        return torch.ops.inkling.reduce_scatter(y.T.contiguous(), n, impl).T.reshape(T, -1)

    def moe(self, w, p, m, load, row_valid, summed: bool = True):
        """The sigmoid-routed MoE of rows m; under expert parallelism alone (summed) the ranks' parts added
        here, otherwise this rank's part (a partial sum its caller adds)."""
        t = self.c.text
        e = f"{p}.mlp.experts"
        sh = f"{p}.mlp.shared_experts"
        y = torch.ops.inkling.sigmoid_sink_moe(
            m, w[f"{p}.mlp.gate.weight"], w[f"{p}.mlp.gate.bias"], w[f"{p}.mlp.gate.global_scale"],
            w[f"{e}.w13_weight"], w.get(f"{e}.w13_weight.scale", _EMPTY), w.get(f"{e}.w13_weight.scale2", _EMPTY),
            w[f"{e}.w2_weight"], w.get(f"{e}.w2_weight.scale", _EMPTY), w.get(f"{e}.w2_weight.scale2", _EMPTY),
            w[f"{sh}.shared_w13_weight"], w[f"{sh}.shared_w2_weight"], t.route_scale, t.num_experts_per_tok,
            self.moe_tiles, self.impls["sigmoid_sink_moe"], self.ep_size, load, row_valid,
        )  # fmt: skip
        if not summed or self.ep_size == 1 or self.tp.tp_size > 1:  # a partial sum summed_sconv adds
            return y
        n, impl = self.ep_size, self.impls["collectives"]
        return torch.ops.inkling.all_gather(torch.ops.inkling.reduce_scatter(y, n, impl), n, impl)

    def logits(self, w, rows):
        """muP-scaled logits over the unpadded vocabulary: under tensor parallelism each rank's slice of
        the vocabulary, gathered, its padding dropped. As transformers computes them: over every padded row,
        then sliced, so the GEMM's output rows keep an aligned width (201,024, not 200,058): cuBLAS then runs
        the unembedding at 90% of an H100's bandwidth at one row, against 82% on the unpadded rows, and 66%
        against 45% at 128 (a verify), for 0.5% more bytes (bench.unembed)."""
        t, n = self.c.text, self.tp.tp_size
        part = rows / t.logits_mup_width_multiplier @ w[UNEMBED].T
        if n == 1:
            return part[:, : t.num_real_tokens]
        return torch.ops.inkling.all_gather(part, n, self.impls["collectives"])[:, : t.num_real_tokens]

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
        expert_load: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, w, lay = self.c.text, weights, self.layout
        eps = t.rms_norm_eps
        x = self.embed(w, input_ids, mm_embeds, mm_positions)
        row_valid = slot_mappings[0] >= 0  # every group gives a token a slot; padding rows have none
        for i in range(t.num_hidden_layers):
            p, g, j = f"model.llm.layers.{i}", lay.group_of_layer[i], lay.cache_of_layer[i]
            meta = (
                cu_seqlens_q,
                seq_lens,
                state_indices,
                block_tables[g],
                slot_mappings[g],
                q_bound.shape[0],
            )
            conv = conv_states[4 * i : 4 * i + 4]
            o = self.attention(
                w,
                p,
                rms_norm(x, w[f"{p}.attn_norm.weight"], eps),
                self.tp.attention(i),
                meta,
                key_caches[j],
                value_caches[j],
                conv,
            )
            x = x + self.summed_sconv(o, w[f"{p}.attn_sconv.weight"], conv[2], state_indices, cu_seqlens_q)
            load = expert_load[self.moe_index[i]] if i in self.moe_index else None
            f = self.mlp(w, p, rms_norm(x, w[f"{p}.mlp_norm.weight"], eps), i, load, row_valid)
            x = x + self.summed_sconv(f, w[f"{p}.mlp_sconv.weight"], conv[3], state_indices, cu_seqlens_q)
        normed = rms_norm(x, w["model.llm.norm.weight"], eps)
        logits = self.logits(w, normed[logits_indices])
        # The hidden states MTP depth 0 reads: after the final norm (INKLING_SERVING §1.2), or before it
        # with mtp_config.target_hidden_pre_norm
        return logits.float(), (x if self.c.mtp.target_hidden_pre_norm else normed)


class HeadProgram(StepProgram):
    """One MTP depth's pass (INKLING_SERVING §1.2) over a ragged batch with the depth's own paged KV and
    sconv states: the HEAD contract (builder/contracts.py).

    One program serves every depth of one attention kind (`layer_type`: the depths' KV heads differ by
    kind): `weights` holds a depth's tensors without their `mtp.{d}.` prefix (`depth_weights`) and the
    trunk's embedding and embed norm. Row t of h_prev is the previous level's hidden state at position t
    (level 0: the step's hidden output), input_ids[t] the token t+m (a draft where not known yet); image
    and audio rows are spliced as in the step. block_table [B, MB] and slot_mapping [T] are those of
    group 0 (every group maps the same positions to the same block ids). conv_states: sites k, v,
    attention output, MLP output. Returns the depth's raw output [T, H]: the next depth's hidden input and
    its logits' (`unembed(h / muP)`, the drafter's pick)."""

    def __init__(self, config: InklingConfig, impls: dict[str, str], layer_type: str):
        super().__init__(config, impls)
        self.shape = config.text.attention_of(layer_type)

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
        w, eps = weights, self.c.text.rms_norm_eps
        e = self.embed(w, input_ids, mm_embeds, mm_positions)
        u = torch.cat(
            [rms_norm(h_prev, w["hidden_norm.weight"], eps), rms_norm(e, w["embed_norm.weight"], eps)], -1
        )
        x = u @ w["input_proj.weight"].T
        meta = (cu_seqlens_q, seq_lens, state_indices, block_table, slot_mapping, q_bound.shape[0])
        p = "transformer_block"
        o = self.attention(
            w, p, rms_norm(x, w[f"{p}.attn_norm.weight"], eps), self.shape, meta, key_cache, value_cache,
            conv_states, log_scaling=self.c.mtp.log_scaling,
        )  # fmt: skip
        x = x + self.sconv(o, w[f"{p}.attn_sconv.weight"], conv_states[2], state_indices, cu_seqlens_q)
        f = self.dense_mlp(w, f"{p}.", rms_norm(x, w[f"{p}.mlp_norm.weight"], eps))
        return x + self.sconv(f, w[f"{p}.mlp_sconv.weight"], conv_states[3], state_indices, cu_seqlens_q)


def depth_weights(weights: dict[str, torch.Tensor], d: int) -> dict[str, torch.Tensor]:
    """MTP depth d's (0-based) weights for the head program: its engine tensors without the `mtp.{d}.`
    prefix, and the trunk's embedding and embed norm (shared, not copied)."""
    prefix = f"mtp.{d}."
    out = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    for k in ("model.llm.embed.weight", "model.llm.embed_norm.weight"):
        out[k] = weights[k]
    return out


def depth_conv_channels(c: InklingConfig, d: int) -> list[int]:
    """Channels of MTP depth d's four sconv states (k, v, attention output, MLP output)."""
    kv = c.mtp_attention(d).kv_size
    return [kv, kv, c.text.hidden_size, c.text.hidden_size]

"""The real Inkling's MTP depths by full recomputation: the reference an engine's drafts are tested against.

transformers 5.23.0 defines no MTP, so this is plain PyTorch around transformers' own modules, following
INKLING_SERVING.md §1.2 point by point. Depth d (0-based) at trunk position t:
1. hidden input: the trunk's last hidden state at t after its final RMSNorm (depth 0; before it with
   `mtp_config.target_hidden_pre_norm`), or depth d-1's raw output at t;
2. token input: the trunk's embedding of token t+1+d through the trunk's embed norm (the trunk's own
   input row: at an image or audio placeholder, the tower's row, as vLLM feeds it), then the depth's
   `embed_norm`;
3. `input_proj([hidden_norm(hidden), embed_norm(embed)])`, hidden first, 2H -> H;
4. one transformers `InklingDecoderLayer` with a dense MLP, sliding attention at the depths in
   `local_layer_ids` and full attention at the others; positions in trunk coordinates; τ(i) inside full
   depths only with `mtp_config.log_scaling` (SGLang; vLLM and TokenSpeed apply none);
5. its output, the residual stream after the MLP sconv, feeds depth d+1 and the logits:
   `unembed(output / logits_mup_width_multiplier)` over the unpadded vocabulary, no norm.

Notation as the engine's drafter: `input_ids` holds x[0..N+1], the accepted tokens and the target's sample
at position N; drafts d_1..d_k stand for x[N+2]..x[N+k+1]. Depth m-1 (head m, 1-based) runs over
positions 0..N and reads h^{m-1}[t] and the embedding of s[t+m] of the extended sequence
s = x + drafts; its state at N drafts d_m.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

import torch
from torch import nn

from .checkpoint import PublishedCheckpoint
from .config import SLIDING, InklingConfig
from .ops import deinterleave

# A depth's checkpoint names under `model.mtp.layers.{d}.` -> its module's parameter names (the trunk's
# renames of transformers' conversion_mapping.py, spelled out for one block)
_RENAMES = {
    "embed_norm.weight": "embed_norm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "input_proj.weight": "input_proj.weight",
    "transformer_block.attn_norm.weight": "block.input_layernorm.weight",
    "transformer_block.mlp_norm.weight": "block.post_attention_layernorm.weight",
    "transformer_block.attn.wq_du.weight": "block.self_attn.q_proj.weight",
    "transformer_block.attn.wk_dv.weight": "block.self_attn.k_proj.weight",
    "transformer_block.attn.wv_dv.weight": "block.self_attn.v_proj.weight",
    "transformer_block.attn.wr_du.weight": "block.self_attn.r_proj.weight",
    "transformer_block.attn.wo_ud.weight": "block.self_attn.o_proj.weight",
    "transformer_block.attn.q_norm.weight": "block.self_attn.q_norm.weight",
    "transformer_block.attn.k_norm.weight": "block.self_attn.k_norm.weight",
    "transformer_block.attn.k_sconv.weight": "block.self_attn.k_sconv.conv1d.weight",
    "transformer_block.attn.v_sconv.weight": "block.self_attn.v_sconv.conv1d.weight",
    "transformer_block.attn.rel_logits_proj.proj": "block.self_attn.rel_logits_proj.proj",
    "transformer_block.attn_sconv.weight": "block.attn_sconv.conv1d.weight",
    "transformer_block.mlp_sconv.weight": "block.mlp_sconv.conv1d.weight",
    "transformer_block.mlp.w2_md.weight": "block.mlp.down_proj.weight",
    "transformer_block.mlp.global_scale": "block.mlp.global_scale",
}
_W13 = "transformer_block.mlp.w13_dn.weight"  # interleaved gate/up rows -> gate_proj, up_proj


class MTPDepth(nn.Module):
    """One depth: the input fusion and a transformers decoder block (steps 1-5 of the module docstring)."""

    def __init__(self, text_config, layer_type: str, log_scaling: bool):
        from transformers.models.inkling.modeling_inkling import InklingDecoderLayer, InklingRMSNorm

        super().__init__()
        cfg = copy.deepcopy(text_config)
        cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, [layer_type], ["dense"]
        if not log_scaling:
            cfg.log_scaling_n_floor = None
        self.config = cfg
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_norm, self.hidden_norm = InklingRMSNorm(H, eps), InklingRMSNorm(H, eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.block = InklingDecoderLayer(cfg, 0)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """hidden, embeds [T, H] (or [B, T, H]) at positions 0..T-1 -> the depth's output, same shape."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_recurrent_attention_mask,
            create_sliding_window_causal_mask,
        )

        x = self.input_proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(embeds)], -1))
        batched = x.dim() == 3
        x = x if batched else x[None]
        B, T = x.shape[:2]
        kw = dict(
            config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
            position_ids=torch.arange(T, device=x.device)[None].expand(B, T),
        )  # fmt: skip
        sliding = self.config.layer_types[0] == SLIDING
        mask = create_sliding_window_causal_mask(**kw) if sliding else create_causal_mask(**kw)
        out = self.block(x, attention_mask=mask, conv_mask=create_recurrent_attention_mask(**kw))  # [B, T, H]
        return out if batched else out[0]


def load_depths(
    path: str | os.PathLike, text_config, config: InklingConfig, num_depths: int, dtype: torch.dtype
) -> nn.ModuleList:
    """Depths 0..num_depths-1 of a checkpoint, in `dtype`."""
    depths = nn.ModuleList(
        MTPDepth(text_config, config.mtp.layer_types[d], config.mtp.log_scaling) for d in range(num_depths)
    )
    with PublishedCheckpoint(path) as ckpt:
        for d, depth in enumerate(depths):
            prefix = f"model.mtp.layers.{d}."
            state = {_RENAMES[k]: ckpt.get(prefix + k) for k in _RENAMES}
            gate, up = deinterleave(ckpt.get(prefix + _W13), 0).chunk(2, dim=0)
            state["block.mlp.gate_proj.weight"], state["block.mlp.up_proj.weight"] = gate, up
            depth.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return depths.to(dtype).eval()


class MTPReference:
    """transformers' trunk (`reference_model`) and the checkpoint's MTP depths."""

    def __init__(self, trunk, depths: nn.ModuleList, config: InklingConfig):
        self.trunk, self.depths, self.config = trunk, depths, config

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, num_depths: int | None = None):
        from .reference import reference_model

        trunk = reference_model(path, dtype)
        with PublishedCheckpoint(path) as ckpt:
            config = ckpt.config
        n = config.mtp.num_layers if num_depths is None else num_depths
        if not 0 <= n <= config.mtp.num_layers:
            raise ValueError(f"num_depths must be in 0..{config.mtp.num_layers}, got {n}")
        return cls(trunk, load_depths(path, trunk.config.text_config, config, n, dtype), config)

    def to(self, device) -> MTPReference:
        self.trunk.to(device)
        self.depths.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return self.trunk.lm_head.weight.device

    @torch.no_grad()
    def trunk_pass(self, input_ids: torch.Tensor, **media) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trunk over x [T] (and its media, transformers' keyword arguments): its input rows [T, H] (the
        normed embeddings with the towers' rows spliced), the hidden state depth 0 reads [T, H], and the
        logits [T, V] in float32."""
        lm = self.trunk.model.language_model
        seen: dict[str, torch.Tensor] = {}
        hooks = [
            lm.register_forward_pre_hook(
                lambda m, a, kw: seen.__setitem__("embeds", kw["inputs_embeds"]), with_kwargs=True
            ),
            lm.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre_norm", a[0])),
            lm.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("post_norm", out)),
        ]
        try:
            out = self.trunk(input_ids=input_ids[None].to(self.device), **media)
        finally:
            for h in hooks:
                h.remove()
        hidden = seen["pre_norm" if self.config.mtp.target_hidden_pre_norm else "post_norm"]
        return seen["embeds"][0], hidden[0], out.logits[0].float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """A depth's logits over the unpadded vocabulary: unembed(h / muP), float32 [., V]."""
        t = self.config.text
        w = self.trunk.lm_head.weight[: t.num_real_tokens]
        return (h / t.logits_mup_width_multiplier @ w.T).float()

    def _embeds(
        self, input_ids: torch.Tensor, drafts: Sequence[int], **media
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input rows of s = x + drafts [N+2+k, H] (drafts are text tokens) and h^0 at 0..N [N+1, H]."""
        if input_ids.dim() != 1 or input_ids.shape[0] < 2:
            raise ValueError(
                f"input_ids must be 1-D with x[0..N+1] (at least 2 ids), got {list(input_ids.shape)}"
            )
        embeds, hidden, _ = self.trunk_pass(input_ids, **media)
        if drafts:
            ids = torch.tensor(list(drafts), dtype=torch.long, device=self.device)
            embeds = torch.cat([embeds, self.trunk.get_input_embeddings()(ids).to(embeds.dtype)])
        return embeds, hidden[: input_ids.shape[0] - 1]

    @torch.no_grad()
    def depth_states(
        self, input_ids: torch.Tensor, drafts: Sequence[int], num_depths: int | None = None, **media
    ) -> list[torch.Tensor]:
        """Every depth's outputs over positions 0..N given this round's drafts: entry m-1 is h^m [N+1, H]
        (head m = depth m-1 needs d_1..d_{m-1}; default len(drafts) + 1 depths, at most those loaded)."""
        n = min(len(drafts) + 1, len(self.depths)) if num_depths is None else num_depths
        if not 0 <= n <= len(self.depths) or len(drafts) < n - 1:
            raise ValueError(f"{n} depths need {max(n - 1, 0)} drafts and at most {len(self.depths)} depths")
        embeds, h = self._embeds(input_ids, drafts[: max(n - 1, 0)], **media)
        P = h.shape[0]
        states = []
        for m in range(1, n + 1):
            h = self.depths[m - 1](h, embeds[m : m + P])
            states.append(h)
        return states

    @torch.no_grad()
    def draft(self, input_ids: torch.Tensor, num_draft_tokens: int, **media) -> list[int]:
        """Greedy drafts d_1..d_k from x[0..N+1] (argmax over the unpadded vocabulary, first index of a tie)."""
        if not 0 <= num_draft_tokens <= len(self.depths):
            raise ValueError(f"num_draft_tokens must be in 0..{len(self.depths)}, got {num_draft_tokens}")
        embeds, h = self._embeds(input_ids, [], **media)
        P = h.shape[0]
        drafts: list[int] = []
        for m in range(1, num_draft_tokens + 1):
            h = self.depths[m - 1](h, embeds[m : m + P])
            token = int(self.logits(h[-1:])[0].argmax())
            drafts.append(token)
            row = self.trunk.get_input_embeddings()(torch.tensor([token], device=self.device))
            embeds = torch.cat([embeds, row.to(embeds.dtype)])
        return drafts

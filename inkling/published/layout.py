"""Every tensor of a published Inkling checkpoint: name, shape and dtype (INKLING_SPEC §2, INKLING_SERVING §1.3, §2).

`checkpoint_tensors(config)` is the whole plan of a checkpoint, BF16 or NVFP4 (with `config.quant`):
the synthesizer writes it, the converter produces it and a reader checks a checkpoint against it.
Names are the checkpoint's own (`model.llm.*`, `model.visual.*`, `model.audio.*`, `model.mtp.*`), never
transformers' renamed ones. The gate/up projections stay fused and row-interleaved (row 2j gate j, row
2j+1 up j) in every w13 tensor, as the files keep them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .config import InklingConfig, TextConfig

Spec = tuple[tuple[int, ...], torch.dtype]
BF16, F32 = torch.bfloat16, torch.float32
NVFP4_GROUP = 16
# The NVFP4 sidecars of one quantized stack: name suffix -> (shape from [E, rows, cols], dtype)
NVFP4_SIDECARS = (".scale", ".scale2", ".input_amax", ".original_shape")


def _attention_block(prefix: str, t: TextConfig, layer_type: str) -> Iterator[tuple[str, Spec]]:
    a, H, K = t.attention_of(layer_type), t.hidden_size, t.conv_kernel_size
    yield f"{prefix}attn_norm.weight", ((H,), BF16)
    yield f"{prefix}attn.wq_du.weight", ((a.q_size, H), BF16)
    yield f"{prefix}attn.wk_dv.weight", ((a.kv_size, H), BF16)
    yield f"{prefix}attn.wv_dv.weight", ((a.kv_size, H), BF16)
    yield f"{prefix}attn.wr_du.weight", ((a.r_size, H), BF16)
    yield f"{prefix}attn.wo_ud.weight", ((H, a.q_size), BF16)
    yield f"{prefix}attn.q_norm.weight", ((a.head_dim,), BF16)
    yield f"{prefix}attn.k_norm.weight", ((a.head_dim,), BF16)
    yield f"{prefix}attn.k_sconv.weight", ((a.kv_size, 1, K), BF16)
    yield f"{prefix}attn.v_sconv.weight", ((a.kv_size, 1, K), BF16)
    yield f"{prefix}attn.rel_logits_proj.proj", ((a.d_rel, a.rel_extent), BF16)
    yield f"{prefix}attn_sconv.weight", ((H, 1, K), BF16)
    yield f"{prefix}mlp_norm.weight", ((H,), BF16)
    yield f"{prefix}mlp_sconv.weight", ((H, 1, K), BF16)


def _dense_mlp(prefix: str, t: TextConfig) -> Iterator[tuple[str, Spec]]:
    H, Id = t.hidden_size, t.intermediate_size
    yield f"{prefix}mlp.w13_dn.weight", ((2 * Id, H), BF16)
    yield f"{prefix}mlp.w2_md.weight", ((H, Id), BF16)
    yield f"{prefix}mlp.global_scale", ((1,), BF16)


def expert_stack(name: str, shape: tuple[int, int, int], quantized: bool) -> Iterator[tuple[str, Spec]]:
    """A stacked expert weight [E, rows, cols]: BF16, or NVFP4 codes (two per byte) with their sidecars."""
    E, rows, cols = shape
    if not quantized:
        yield name, (shape, BF16)
        return
    yield name, ((E, rows, cols // 2), torch.uint8)
    yield f"{name}.scale", ((E, rows, cols // NVFP4_GROUP), torch.float8_e4m3fn)
    yield f"{name}.scale2", ((E,), F32)
    yield f"{name}.input_amax", ((1,), BF16)
    yield f"{name}.original_shape", ((3,), torch.int64)


def _moe(prefix: str, t: TextConfig, quantized: bool) -> Iterator[tuple[str, Spec]]:
    H, I, E, S = t.hidden_size, t.moe_intermediate_size, t.n_routed_experts, t.n_shared_experts
    yield f"{prefix}mlp.gate.weight", ((E + S, H), BF16)
    yield f"{prefix}mlp.gate.bias", ((E,), F32)
    yield f"{prefix}mlp.gate.global_scale", ((1,), F32)
    yield from expert_stack(f"{prefix}mlp.experts.w13_weight", (E, 2 * I, H), quantized)
    yield from expert_stack(f"{prefix}mlp.experts.w2_weight", (E, H, I), quantized)
    if S:
        yield f"{prefix}mlp.shared_experts.shared_w13_weight", ((S, 2 * I, H), BF16)
        yield f"{prefix}mlp.shared_experts.shared_w2_weight", ((S, H, I), BF16)


def layer_tensors(c: InklingConfig, i: int) -> Iterator[tuple[str, Spec]]:
    prefix, t = f"model.llm.layers.{i}.", c.text
    yield from _attention_block(prefix, t, t.layer_types[i])
    if t.is_dense(i):
        yield from _dense_mlp(prefix, t)
    else:
        yield from _moe(prefix, t, c.experts_quantized(i))


def mtp_tensors(c: InklingConfig, d: int) -> Iterator[tuple[str, Spec]]:
    """Depth d: 20 BF16 tensors, a full Inkling block with a dense MLP (INKLING_SERVING §1.3)."""
    prefix, H = f"model.mtp.layers.{d}.", c.text.hidden_size
    yield f"{prefix}embed_norm.weight", ((H,), BF16)
    yield f"{prefix}hidden_norm.weight", ((H,), BF16)
    yield f"{prefix}input_proj.weight", ((H, 2 * H), BF16)
    yield from _attention_block(f"{prefix}transformer_block.", c.text, c.mtp.layer_types[d])
    yield from _dense_mlp(f"{prefix}transformer_block.", c.text)


def vision_scales(c: InklingConfig) -> list[tuple[int, int, int, int]]:
    """The hMLP's scale plan (t, h, w, channels) from the input to the last hidden scale (INKLING_SPEC §4.3)."""
    v = c.vision
    P, T, C, n = v.patch_size, v.temporal_patch_size, v.num_channels, v.n_layers
    factors, m = [], P
    for p in range(2, P + 1):
        while m % p == 0:
            factors.append(p)
            m //= p
    candidates = [(1, 1, 1, C)]
    h = 1
    for f in reversed(factors):
        h *= f
        candidates.append((1, h, h, 64 * math.ceil(C * h * h / 64)))
    candidates.append((T, P, P, 64 * math.ceil(P * P * C * T)))
    targets = [math.log(P * P * T * C) * a / n for a in range(n + 1)]
    cost = [[abs(tg - math.log(t * hh * ww)) for (t, hh, ww, _) in candidates] for tg in targets]
    if n + 1 >= len(candidates):
        rows = [min(range(len(candidates)), key=lambda j: r[j]) for r in cost]
    else:
        from scipy.optimize import linear_sum_assignment

        r_idx, c_idx = linear_sum_assignment(cost)
        rows = [int(j) for _, j in sorted(zip(r_idx, c_idx))]
    rows[0], rows[-1] = 0, len(candidates) - 1
    return [candidates[j] for j in rows]


def vision_layers(c: InklingConfig) -> list[tuple[int, int]]:
    """(in, out) features of each hMLP linear; every one but the last is followed by RMSNorm(out) + GELU."""
    scales = vision_scales(c)
    dims = []
    for n, ((t, h, _, ch), (t2, h2, _, ch2)) in enumerate(zip(scales, scales[1:])):
        out = c.text.hidden_size if n == len(scales) - 2 else ch2
        dims.append((ch * (t2 // t) * (h2 // h) ** 2, out))
    return dims


def tower_tensors(c: InklingConfig) -> Iterator[tuple[str, Spec]]:
    H = c.text.hidden_size
    layers = vision_layers(c)
    for n, (n_in, n_out) in enumerate(layers):
        yield f"model.visual.layers.linear_{n}.weight", ((n_out, n_in), BF16)
        if n < len(layers) - 1:
            yield f"model.visual.layers.norm_{n}.weight", ((n_out,), BF16)
    yield "model.visual.final_norm.weight", ((H,), BF16)
    yield "model.audio.encoder.weight", ((c.audio.n_mel_bins * c.audio.mel_vocab_size, H), BF16)
    yield "model.audio.final_norm.weight", ((H,), BF16)


def checkpoint_tensors(c: InklingConfig) -> dict[str, Spec]:
    """name -> (shape, dtype) of every tensor, in the files' order: trunk, towers, MTP depths."""
    t = c.text
    V, H = t.vocab_size, t.hidden_size
    out: dict[str, Spec] = {
        "model.llm.embed.weight": ((V, H), BF16),
        "model.llm.embed_norm.weight": ((H,), BF16),
    }
    for i in range(t.num_hidden_layers):
        out.update(layer_tensors(c, i))
    out["model.llm.norm.weight"] = ((H,), BF16)
    out["model.llm.unembed.weight"] = ((V, H), BF16)
    out.update(tower_tensors(c))
    for d in range(c.mtp.num_layers):
        out.update(mtp_tensors(c, d))
    stored = getattr(torch, c.dtype)  # a checkpoint saved in float32 keeps every BF16 tensor in float32
    if stored != BF16:
        out = {n: (s, stored if dt == BF16 else dt) for n, (s, dt) in out.items()}
    return out

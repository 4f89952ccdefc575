"""`pack_weights()`: the checkpoint's NVFP4 routed experts -> the layout the MoE kernels read.

Layout version 1 (WEIGHT_LAYOUT_VERSION), E experts, hidden H, intermediate I:

    w13          uint8          [E, 2I, H/2]   rows 0..I-1 gate_proj, I..2I-1 up_proj; ModelOpt packing
                                               (two E2M1 codes per byte, low nibble = even column)
    w13_scale    float8_e4m3fn  [E, 2I, H/16]  block scales, rows as w13
    w13_scale_2  float32        [E, 2]         global scales of (gate, up): kept apart, so nothing is
                                               rescaled and dequantization stays exactly §9's
    w2           uint8          [E, H, I/2]    down_proj
    w2_scale     float8_e4m3fn  [E, H, I/16]
    w2_scale_2   float32        [E]

The kernels read a [BLOCK_N, BLOCK_K/2] byte tile of codes per K step (rows of 64 contiguous bytes
at BLOCK_K = 128) and the matching [BLOCK_N, BLOCK_K/16] scale tile, so the checkpoint's row-major
order is already the coalesced one; stacking gate and up lets one program hold both halves of a
SwiGLU column block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

WEIGHT_LAYOUT_VERSION = 1
PACKED_NAMES = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def _get(expert: Mapping[str, torch.Tensor], proj: str, field: str) -> torch.Tensor:
    key = f"{proj}.{field}"
    if key not in expert:
        raise KeyError(f"pack_weights: expert tensors lack {key!r}; have {sorted(expert)}")
    return expert[key]


def pack_weights(experts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """experts[e] maps "{gate,up,down}_proj.{weight,weight_scale,weight_scale_2}" (the checkpoint's
    names under `mlp.experts.{e}.`; input_scale is ignored by W4A16) to its tensor.

    Returns the PACKED_NAMES tensors, on the device of the inputs.
    """
    if not experts:
        raise ValueError("pack_weights: no experts")
    gate_w = _get(experts[0], "gate_proj", "weight")
    down_w = _get(experts[0], "down_proj", "weight")
    I, half_h = gate_w.shape
    H = 2 * half_h
    if down_w.shape != (H, I // 2):
        raise ValueError(
            f"pack_weights: down_proj {tuple(down_w.shape)} does not match gate_proj {tuple(gate_w.shape)}"
        )
    for e, ex in enumerate(experts):
        for proj, shape in (("gate_proj", (I, H // 2)), ("up_proj", (I, H // 2)), ("down_proj", (H, I // 2))):
            w, s = _get(ex, proj, "weight"), _get(ex, proj, "weight_scale")
            if w.dtype != torch.uint8 or tuple(w.shape) != shape:
                raise ValueError(
                    f"pack_weights: expert {e} {proj}.weight is {w.dtype} {tuple(w.shape)}, want uint8 {shape}"
                )
            if s.dtype != torch.float8_e4m3fn or tuple(s.shape) != (shape[0], shape[1] // 8):
                raise ValueError(
                    f"pack_weights: expert {e} {proj}.weight_scale is {s.dtype} {tuple(s.shape)}"
                )

    def stack(proj: str, field: str) -> torch.Tensor:
        return torch.stack([_get(ex, proj, field) for ex in experts])

    def scalars(proj: str) -> torch.Tensor:
        return torch.stack([_get(ex, proj, "weight_scale_2").reshape(()).float() for ex in experts])

    return {
        "w13": torch.cat([stack("gate_proj", "weight"), stack("up_proj", "weight")], dim=1).contiguous(),
        "w13_scale": torch.cat(
            [stack("gate_proj", "weight_scale"), stack("up_proj", "weight_scale")], dim=1
        ).contiguous(),
        "w13_scale_2": torch.stack([scalars("gate_proj"), scalars("up_proj")], dim=1).contiguous(),
        "w2": stack("down_proj", "weight").contiguous(),
        "w2_scale": stack("down_proj", "weight_scale").contiguous(),
        "w2_scale_2": scalars("down_proj").contiguous(),
    }

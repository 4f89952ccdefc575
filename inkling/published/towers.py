"""The real Inkling's vision tower and audio embedding as the engine's encoder programs (INKLING_SPEC §4, §5).

    VisionTower(config): pixel_values float [N, T, P, P, C] (processor layout) -> [N, H]
    AudioEmbedding(config): dMel levels int [F, mel_bins] (valid frames only) -> [F, H]

Weights are inputs (a dict under the checkpoint's names), as the step program's are. The tower has no
attention and no mixing between patches: each patch (each frame) maps to its own row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import InklingConfig
from .layout import vision_scales
from .ops import rms_norm

TOWER_EPS = 1e-6  # the towers' norms use a fixed eps (INKLING_SPEC §1.5, §1.6)


def fold(x: torch.Tensor, t_fold: int, hw_fold: int) -> torch.Tensor:
    """[N, T, Hh, Ww, C] -> [N, T/t, Hh/hw, Ww/hw, t·hw·hw·C], features ordered (t_sub, y_sub, x_sub, c)."""
    N, T, Hh, Ww, C = x.shape
    x = x.reshape(N, T // t_fold, t_fold, Hh // hw_fold, hw_fold, Ww // hw_fold, hw_fold, C)
    x = x.permute(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(N, T // t_fold, Hh // hw_fold, Ww // hw_fold, t_fold * hw_fold * hw_fold * C)


class VisionTower(nn.Module):
    def __init__(self, config: InklingConfig):
        super().__init__()
        scales = vision_scales(config)
        self.folds = [(t2 // t1, h2 // h1) for (t1, h1, _, _), (t2, h2, _, _) in zip(scales, scales[1:])]

    def forward(self, weights: dict[str, torch.Tensor], pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.to(weights["model.visual.final_norm.weight"].dtype)
        last = len(self.folds) - 1
        for n, (t_fold, hw_fold) in enumerate(self.folds):
            if t_fold > 1 or hw_fold > 1:
                x = fold(x, t_fold, hw_fold)
            x = x @ weights[f"model.visual.layers.linear_{n}.weight"].T
            if n < last:
                x = F.gelu(rms_norm(x, weights[f"model.visual.layers.norm_{n}.weight"], TOWER_EPS))
        x = rms_norm(x, weights["model.visual.final_norm.weight"], TOWER_EPS)
        return x.reshape(pixel_values.shape[0], -1)


class AudioEmbedding(nn.Module):
    def __init__(self, config: InklingConfig):
        super().__init__()
        self.levels = config.audio.mel_vocab_size

    def forward(self, weights: dict[str, torch.Tensor], levels: torch.Tensor) -> torch.Tensor:
        table = weights["model.audio.encoder.weight"]
        offsets = torch.arange(levels.shape[-1], device=levels.device) * self.levels
        x = table[levels.long() + offsets].sum(dim=-2)  # each mel channel's own block of rows, summed
        return rms_norm(x, weights["model.audio.final_norm.weight"], TOWER_EPS)


class EncoderProgram(nn.Module):
    """A tower with its weights held (buffers), so that the exported program takes the media alone:
    `program(x)`, as the runtime's GraphedEncoder calls it."""

    def __init__(self, tower: nn.Module, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.tower, self.names = tower, sorted(weights)
        for i, name in enumerate(self.names):
            self.register_buffer(f"w{i}", weights[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tower({n: getattr(self, f"w{i}") for i, n in enumerate(self.names)}, x)

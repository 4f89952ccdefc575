"""The image and audio stems: hMLP patches (§6) and the dMel embedding (§7).

Each takes what `inkling.processing` produces and returns the embeddings of its pad tokens, [N, H].
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .config import InklingConfig
from .processing.image import image_patches


def _group_2x2(x: torch.Tensor) -> torch.Tensor:
    """[N, h, w, d] -> [N, h/2, w/2, 4d], each 2x2 group concatenated in order (0,0),(0,1),(1,0),(1,1)."""
    n, h, w, d = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(n, h // 2, w // 2, 4 * d)


class HMLP(nn.Module):
    """Parameters `vision.hmlp.{0,1,2}` (Linear) and `vision.hmlp.norm{0,1}` (LayerNorm)."""

    def __init__(self, c: InklingConfig):
        super().__init__()
        d1, d2 = c.vision.hmlp_dims
        self.add_module("0", nn.Linear(48, d1))
        self.add_module("1", nn.Linear(4 * d1, d2))
        self.add_module("2", nn.Linear(4 * d2, c.hidden_size))
        self.norm0 = nn.LayerNorm(d1, eps=1e-5)
        self.norm1 = nn.LayerNorm(d2, eps=1e-5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches: [N, 16, 16, 3], the image's 16x16 patches in raster order
        (`inkling.processing.image_patches`) -> [N, H], one embedding per patch.

        Every 2x2 group of 2x2 groups of 4x4 cells lies inside one 16x16 patch, so the stem works on
        the patches independently; only N is dynamic, which keeps the exported program guard-free."""
        if patches.shape[1:] != (16, 16, 3):
            raise ValueError(f"image patches must be [N, 16, 16, 3], got {list(patches.shape)}")
        stage = getattr(self, "0")
        x = patches.to(stage.weight.dtype)
        x = (
            x.reshape(-1, 4, 4, 4, 4, 3).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, 4, 48)
        )  # (row, col, channel)
        x = ops.gelu_tanh(self.norm0(stage(x)))  # [N, 4, 4, d1]
        x = ops.gelu_tanh(self.norm1(getattr(self, "1")(_group_2x2(x))))  # [N, 2, 2, d2]
        x = getattr(self, "2")(_group_2x2(x))  # [N, 1, 1, H]
        return x.reshape(-1, x.shape[-1])


class Vision(nn.Module):
    def __init__(self, c: InklingConfig):
        super().__init__()
        self.hmlp = HMLP(c)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [Hpx, Wpx, 3], sides multiples of 16 -> [Hpx/16 * Wpx/16, H], raster order."""
        return self.hmlp(image_patches(pixels))


class Audio(nn.Module):
    """Parameters `audio.dmel_embed` [num_mels * num_levels, dA] and `audio.proj` (Linear with bias)."""

    def __init__(self, c: InklingConfig):
        super().__init__()
        a = c.audio
        self.num_mels, self.num_levels, self.frame_stack = a.num_mels, a.num_levels, a.frame_stack
        self.dmel_embed = nn.Embedding(a.num_mels * a.num_levels, a.embed_dim)
        self.proj = nn.Linear(a.frame_stack * a.embed_dim, c.hidden_size)

    def check_levels(self, levels: torch.Tensor) -> None:
        """Values in range (kept out of forward, which is exported and must not branch on data)."""
        if levels.numel() and (levels.min() < 0 or levels.max() >= self.num_levels):
            raise ValueError(f"audio levels must lie in [0, {self.num_levels})")

    def forward(self, levels: torch.Tensor) -> torch.Tensor:
        """levels: [num_mels, F] int in [0, num_levels), F a multiple of frame_stack -> [F/frame_stack, H]."""
        M, F = levels.shape
        if M != self.num_mels or F % self.frame_stack:
            raise ValueError(
                f"audio levels must be [{self.num_mels}, F] with F a multiple of {self.frame_stack}, "
                f"got {list(levels.shape)}"
            )
        channel = torch.arange(M, device=levels.device)[:, None] * self.num_levels
        frames = self.dmel_embed(channel + levels.long()).sum(0)  # [F, dA]: Σ_c dmel_embed[c*L + level[c, f]]
        return self.proj(frames.reshape(F // self.frame_stack, -1))

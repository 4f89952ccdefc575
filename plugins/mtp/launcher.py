"""Launcher of the mtp_draft Triton kernels: stride checks, tile choice and grids from host-side shapes
only (no device sync: the op runs inside CUDA graphs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..triton_utils import interpreting
from . import kernels

NORM_BLOCK_H = 1024
REDUCE_BLOCK_T, REDUCE_BLOCK_N = 256, 16


@dataclass(frozen=True)
class MtpConfig:
    """Tiles of the lm_head + argmax launch: rows of hidden, rows of lm_head, and H per step."""

    block_n: int
    block_v: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_v", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MtpConfig.{name} must be a power of two >= 16 (tl.dot), got {v}")


def choose_config(N: int, H: int, dtype: torch.dtype) -> MtpConfig:
    """Decode (N = 1..64) reads all of lm_head once; the time is its bytes over DRAM bandwidth.

    On an H200 (132 SMs, 228 KB of shared memory each) every choice keeps a pipeline stage at 16 KB
    of lm_head and about 100 KB of shared memory per program, so two programs per SM keep some
    100 KB of loads in flight. Up to 64 rows share one row block, so lm_head is read once; past 32
    rows a tile holds 128 vocabulary rows, halving how often each program re-reads hidden from L2.
    float32 (exactness runs) does not use tensor cores: half the K step for the same bytes.
    """
    if N <= 16:
        config = MtpConfig(block_n=16, block_v=64, block_k=128)
    elif N <= 32:
        config = MtpConfig(block_n=32, block_v=64, block_k=128)
    else:
        config = MtpConfig(block_n=64, block_v=128, block_k=64, num_warps=8)
    block_k = config.block_k // 2 if dtype == torch.float32 else config.block_k
    block_k = min(block_k, max(16, triton.next_power_of_2(H)))  # small H (tests, interpreter)
    return MtpConfig(config.block_n, config.block_v, block_k, config.num_warps, config.num_stages)


def mtp_draft(
    hidden: torch.Tensor,  # [N, H]
    norm_weight: torch.Tensor,  # [H]
    lm_head: torch.Tensor,  # [V, H]
    num_real_tokens: int,
    eps: float,
    config: MtpConfig | None = None,
) -> torch.Tensor:
    """Shapes and dtypes are checked by the op (reference.check_inputs); strides here."""
    N, H = hidden.shape
    if lm_head.stride(1) != 1:
        raise ValueError("mtp_draft: lm_head needs unit stride along H (a copy would cost its whole size)")
    out = torch.empty(N, dtype=torch.int64, device=hidden.device)
    if N == 0:
        return out
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    config = config or choose_config(N, H, hidden.dtype)

    normed = torch.empty((N, H), dtype=hidden.dtype, device=hidden.device)  # [N, H]
    kernels.rms_norm_kernel[(N,)](
        hidden, hidden.stride(0), norm_weight.contiguous(), normed, eps,
        H=H, BLOCK_H=min(NORM_BLOCK_H, triton.next_power_of_2(H)), INTERPRET=interpreting(), num_warps=4,
    )  # fmt: skip

    num_row_blocks = triton.cdiv(N, config.block_n)
    num_tiles = triton.cdiv(num_real_tokens, config.block_v)  # padded rows: never launched
    tile_val = torch.empty((num_tiles, N), dtype=torch.float32, device=hidden.device)
    tile_idx = torch.empty((num_tiles, N), dtype=torch.int32, device=hidden.device)
    kernels.lm_head_argmax_kernel[(num_row_blocks * num_tiles,)](
        normed, lm_head, lm_head.stride(0), tile_val, tile_idx, N, num_real_tokens, num_row_blocks,
        H=H, EVEN_K=H % config.block_k == 0,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_K=config.block_k, INTERPRET=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip

    kernels.tile_argmax_kernel[(triton.cdiv(N, REDUCE_BLOCK_N),)](
        tile_val, tile_idx, out, N, num_tiles,
        BLOCK_T=REDUCE_BLOCK_T, BLOCK_N=REDUCE_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return out

"""NVFP4 (ModelOpt layout, INKLING_SPEC §9) in plain PyTorch: the E2M1 table and dequantization.

The reference ops and the tests use this; the Triton kernels dequantize in registers with the same
arithmetic (E2M1 value times float32(float32(block scale) * global scale)).
"""

from __future__ import annotations

import torch

# E2M1 code -> value (code 8, -0, is +0 as in ModelOpt's table) and the block size: one definition,
# the checkpoint format's.
from inkling.nvfp4 import BLOCK_SIZE, E2M1_VALUES, unpack_codes  # noqa: F401


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def dequantize_nvfp4(
    weight_u8: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """weight uint8 [out, in/2], weight_scale fp8 e4m3 [out, in/16], weight_scale_2 float32 [] -> float32 [out, in].

    Leading batch dimensions are allowed on all three (e.g. [E, out, in/2] with weight_scale_2 [E, 1, 1]).
    """
    values = e2m1_table(weight_u8.device)[unpack_codes(weight_u8).long()]  # [..., out, in]
    block_scale = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32)  # [..., out, in/16]
    scale = block_scale.repeat_interleave(BLOCK_SIZE, dim=-1)
    return values * scale


def random_nvfp4(
    out_features: int,
    in_features: int,
    *,
    batch: tuple[int, ...] = (),
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    weight_std: float = 0.02,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random NVFP4 tensors (uniform codes, block scales in [0.25, 1]) made directly on `device`.

    For tests and benchmarks that need realistic bytes without ModelOpt; weight_std sets the
    global scale so that dequantized weights have roughly that standard deviation.
    """
    codes = torch.randint(
        0,
        256,
        (*batch, out_features, in_features // 2),
        dtype=torch.uint8,
        device=device,
        generator=generator,
    )
    scale = (
        torch.rand((*batch, out_features, in_features // BLOCK_SIZE), device=device, generator=generator)
        .mul_(0.75)
        .add_(0.25)
    )
    # Uniform codes have RMS about 3.2, block scales about 0.65.
    global_scale = torch.full(batch, weight_std / (3.2 * 0.65), dtype=torch.float32, device=device)
    return codes, scale.to(torch.float8_e4m3fn), global_scale

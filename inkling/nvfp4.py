"""NVFP4 weights in ModelOpt's layout (INKLING_SPEC §9): packing, dequantization and a linear module.

    weight          uint8 [out, in/2]           two E2M1 codes per byte, low nibble = even column
    weight_scale    float8_e4m3fn [out, in/16]  one scale per 16 consecutive inputs
    weight_scale_2  float32 []                  amax(|W|) / (6 * 448)
    input_scale     float32 []                  activation amax / (6 * 448), from calibration

`dequantize` is the spec's formula and needs nothing but torch. `quantize` is ModelOpt's quantizer
(the spec asks for its block scales, zero blocks and clamping included), imported lazily so that
loading an NVFP4 checkpoint does not need ModelOpt.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Indexed by the 4-bit code sign<<3 | magnitude index; code 8 (-0) is 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _check_layout(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> None:
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"NVFP4 weight must be uint8 [out, in/2], got {weight.dtype} {list(weight.shape)}")
    out, half = weight.shape
    if half * 2 % BLOCK_SIZE:
        raise ValueError(f"NVFP4 weight has {half * 2} inputs, not a multiple of {BLOCK_SIZE}")
    expected = [out, half * 2 // BLOCK_SIZE]
    if weight_scale.dtype != torch.float8_e4m3fn or list(weight_scale.shape) != expected:
        raise ValueError(
            f"NVFP4 weight_scale must be float8_e4m3fn {expected}, got {weight_scale.dtype} {list(weight_scale.shape)}"
        )
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() != 1:
        raise ValueError(
            f"NVFP4 weight_scale_2 must be a float32 scalar, got {weight_scale_2.dtype} {list(weight_scale_2.shape)}"
        )


def unpack_codes(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [..., out, in/2] -> the 4-bit codes, uint8 [..., out, in]: low nibble is the even column."""
    return torch.stack((weight & 0x0F, weight >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_codes`: uint8 [out, in] codes (0..15) -> uint8 [out, in/2]."""
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W[o, c] = E2M1[code] * float32(float32(weight_scale[o, c // 16]) * weight_scale_2), then cast: [out, in]."""
    _check_layout(weight, weight_scale, weight_scale_2)
    out, inp = weight.shape[0], weight.shape[1] * 2
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    values = table[unpack_codes(weight).long()]  # [out, in]
    scale = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())  # [out, in/16]
    w = values.view(out, inp // BLOCK_SIZE, BLOCK_SIZE) * scale.unsqueeze(-1)
    return w.reshape(out, inp).to(dtype)


def _modelopt_nvfp4() -> Any:
    try:
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except ImportError as e:
        raise ImportError(
            "NVFP4 quantization needs NVIDIA ModelOpt (nvidia-modelopt): pip install .[convert]"
        ) from e
    return NVFP4QTensor


def global_scale(weight: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 = amax(|W|) / (6 * 448), float32 [], as ModelOpt computes it."""
    return _modelopt_nvfp4().get_weights_scaling_factor_2(weight).float().reshape(())


def quantize(
    weight: torch.Tensor, weight_scale_2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's NVFP4 quantization of a [out, in] weight -> (weight uint8, weight_scale fp8, weight_scale_2 f32 []).

    Given `weight_scale_2` (the whole tensor's, from `global_scale`), a block of rows quantizes exactly as
    those rows do inside the whole tensor: the converter uses this to quantize one tensor on several threads.
    An all-zero weight gets weight_scale_2 = 0 (the spec's formula), block scales 1.0 and zero codes; ModelOpt
    itself would divide 0 by 0 there.
    """
    if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs a 2-D weight with in % {BLOCK_SIZE} == 0, got {list(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"NVFP4 quantizes floating-point weights, got {weight.dtype}")
    if weight_scale_2 is None:
        weight_scale_2 = global_scale(weight)
    if not torch.isfinite(weight_scale_2):
        raise ValueError("weight has non-finite values (inf or NaN): cannot quantize it")
    out, inp = weight.shape
    if weight_scale_2 == 0:
        return (
            torch.zeros(out, inp // 2, dtype=torch.uint8, device=weight.device),
            torch.ones(out, inp // BLOCK_SIZE, device=weight.device).to(torch.float8_e4m3fn),
            torch.zeros((), dtype=torch.float32, device=weight.device),
        )
    qtensor, weight_scale, weight_scale_2 = _modelopt_nvfp4().quantize(
        weight, BLOCK_SIZE, weights_scaling_factor_2=weight_scale_2
    )
    return (
        qtensor._quantized_data.contiguous(),
        weight_scale.contiguous(),
        weight_scale_2.float().reshape(()).contiguous(),
    )


def activation_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """input_scale = amax / (6 * 448), float32 [] (ModelOpt's get_activation_scaling_factor for NVFP4)."""
    return (torch.as_tensor(amax).float() / (E2M1_MAX * E4M3_MAX)).reshape(())


class NVFP4Linear(nn.Module):
    """A bias-free linear whose weight stays packed NVFP4 and is dequantized in each forward.

    Buffer names are the checkpoint's suffixes, so `state_dict()` keys match the NVFP4 checkpoint.
    `cache=True` keeps the last dequantized weight (per dtype and device) instead of recomputing it.
    """

    def __init__(self, in_features: int, out_features: int, cache: bool = False) -> None:
        super().__init__()
        if in_features % BLOCK_SIZE:
            raise ValueError(f"NVFP4Linear needs in_features % {BLOCK_SIZE} == 0, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.cache = cache
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer(
            "weight_scale", torch.ones(out_features, in_features // BLOCK_SIZE).to(torch.float8_e4m3fn)
        )
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32))
        self._cached: tuple[tuple[Any, ...], torch.Tensor] | None = None

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, input_scale: torch.Tensor | None = None, cache: bool = False
    ) -> NVFP4Linear:
        """Quantize a float weight [out, in] with ModelOpt."""
        out, inp = weight.shape
        module = cls(inp, out, cache=cache)
        module.weight, module.weight_scale, module.weight_scale_2 = quantize(weight)
        if input_scale is not None:
            module.input_scale = input_scale.float().reshape(())
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of `dtype`."""
        if not self.cache:
            return dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)
        # Keyed on the buffers themselves, so that assigning new ones (a load) invalidates the cache.
        key = (self.weight, self.weight_scale, self.weight_scale_2, self.weight._version, dtype)
        if (
            self._cached is None
            or any(a is not b for a, b in zip(self._cached[0][:3], key[:3]))
            or self._cached[0][3:] != key[3:]
        ):
            self._cached = (key, dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype))
        return self._cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return x @ self.dequantized_weight(x.dtype).T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4, cache={self.cache}"

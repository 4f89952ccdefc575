"""NVFP4 (inkling/nvfp4.py), the converter's and the engine's quantization: E2M1 codes two to a byte, E4M3
scales per 16 inputs and a global scale, equal to ModelOpt's bit for bit at weights that hit the edges."""

from __future__ import annotations

import pytest
import torch

from inkling import nvfp4

NVFP4QTensor = pytest.importorskip("modelopt.torch.quantization.qtensor").NVFP4QTensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_nibble_order_and_code_layout() -> None:
    # One block: column 0 is the amax (6 -> code 7), column 1 is -1 (code 8|2), column 2 is 0.5 (code 1).
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -1.0, 0.5
    weight, weight_scale, weight_scale_2 = nvfp4.quantize(w)
    assert weight[0, 0].item() == (0xA << 4) | 0x7  # low nibble = even column
    assert weight[0, 1].item() == 0x1
    assert weight_scale.float().item() == 448.0 and weight_scale_2.item() == pytest.approx(6.0 / 2688.0)
    assert torch.equal(nvfp4.unpack_codes(weight)[0, :3], torch.tensor([7, 10, 1], dtype=torch.uint8))
    assert torch.equal(nvfp4.pack_codes(nvfp4.unpack_codes(weight)), weight)


def _hard_weights(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g)
    w[3, 16:32] = 0.0  # a zero block
    w[5] = 0.0  # a zero row
    w[7, 40] = 300.0  # a large outlier: its block saturates, the global scale grows
    w[9, 64:80] *= 1e-6  # a block far below the others: its fp8 scale clamps at 2**-9
    w[11, 100:116] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 2)  # rounding ties
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_dequantize_match_modelopt_bit_for_bit(dtype: torch.dtype) -> None:
    w = _hard_weights(dtype)
    qtensor, ref_scale, ref_scale_2 = NVFP4QTensor.quantize(w, 16)
    weight, weight_scale, weight_scale_2 = nvfp4.quantize(w)
    assert torch.equal(weight, qtensor._quantized_data)
    assert torch.equal(_bits(weight_scale), _bits(ref_scale))
    assert torch.equal(weight_scale_2, ref_scale_2.float().reshape(()))
    kwargs = {"scale": ref_scale, "double_scale": ref_scale_2, "block_sizes": {-1: 16}}
    for out_dtype in (torch.float32, torch.bfloat16):
        ours = nvfp4.dequantize(weight, weight_scale, weight_scale_2, dtype=out_dtype)
        theirs = qtensor.dequantize(dtype=out_dtype, **kwargs)
        assert ours.dtype == out_dtype and torch.equal(_bits(ours), _bits(theirs))
    assert (nvfp4.dequantize(weight, weight_scale, weight_scale_2)[3, 16:32] == 0).all()


def test_all_zero_weight_quantizes_to_zero() -> None:
    weight, weight_scale, weight_scale_2 = nvfp4.quantize(torch.zeros(4, 32))
    assert weight_scale_2.item() == 0.0 and (weight == 0).all() and (weight_scale.float() == 1.0).all()
    assert (nvfp4.dequantize(weight, weight_scale, weight_scale_2) == 0).all()


def test_relative_error_on_gaussian_weights() -> None:
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    err = (nvfp4.dequantize(*nvfp4.quantize(w)) - w).norm() / w.norm()
    print(f"NVFP4 relative weight error on N(0,1) weights: {err:.4f}")
    assert err <= 0.12


def test_nvfp4_linear() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    lin = nvfp4.NVFP4Linear.from_weight(w, input_scale=torch.tensor(0.5))
    assert list(lin.state_dict()) == ["weight", "weight_scale", "weight_scale_2", "input_scale"]
    dense = nvfp4.dequantize(lin.weight, lin.weight_scale, lin.weight_scale_2)
    assert torch.equal(lin(x), x @ dense.T)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    cached = nvfp4.NVFP4Linear(64, 32, cache=True)
    cached.load_state_dict(lin.state_dict())
    assert torch.equal(cached(x), lin(x)) and torch.equal(cached(x), lin(x))
    cached.weight = torch.zeros_like(cached.weight)  # a new buffer invalidates the cache
    assert (cached(x) == 0).all()

"""The MoE GEMM's NVFP4 decode by byte lookups (plugins/moe/kernels.py `_E2M1_BF16_PRMT`, inline PTX).

On the CPU: the PTX run by a small model of its four instructions (prmt's default mode, and, or, shl), for
every code in every nibble, against INKLING_SPEC §9's E2M1 table. On the GPU: the tile the kernel builds
with it, bit for bit against E2M1 * block scale in PyTorch.
"""

from __future__ import annotations

import random
import re
import struct

import pytest
import torch
import triton
import triton.language as tl

from plugins.moe import kernels
from plugins.nvfp4 import E2M1_VALUES, random_nvfp4, unpack_codes

HAS_CUDA = torch.cuda.is_available()


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte s & 7 of {b, a} (a's bytes 0-3, b's 4-7)
    for selector nibble s, or that byte's sign replicated when s & 8."""
    pool = list(a.to_bytes(4, "little")) + list(b.to_bytes(4, "little"))
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _run_asm(word: int) -> list[int]:
    """The PTX of `_E2M1_BF16_PRMT` on one word: its four outputs $0..$3."""
    regs = {"$4": word}

    def value(x: str) -> int:
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    ops = {
        "and.b32": lambda a, b: a & b,
        "or.b32": lambda a, b: a | b,
        "shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF,
        "prmt.b32": _prmt,
    }
    for line in kernels._E2M1_BF16_PRMT.value.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        assert op in ops, f"the model knows no {op}: extend it with the PTX"
        regs[dst] = ops[op](*(value(s) for s in srcs))
    return [regs[f"${i}"] for i in range(4)]


def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def test_prmt_decode_model_matches_e2m1():
    """Output j holds codes 2j (low half) and 2j + 1 (high half) as bf16: every code at every nibble,
    -0 (code 8) included, and random words."""
    words = [code << (4 * p) for p in range(8) for code in range(16)]
    rng = random.Random(0)
    words += [rng.getrandbits(32) for _ in range(2000)]
    for word in words:
        out = _run_asm(word)
        for col in range(8):
            code = (word >> (4 * col)) & 0xF
            bits = (out[col // 2] >> (16 * (col % 2))) & 0xFFFF
            want = (-1.0 if code & 8 else 1.0) * E2M1_VALUES[code & 7]
            assert _bf16_value(bits) == want and (bits >> 15) == (code >> 3), (hex(word), col, hex(bits))
    assert re.search(r"prmt\.b32", kernels._E2M1_BF16_PRMT.value)


@triton.jit
def _tile_kernel(w_ptr, ws_ptr, out_ptr, stride_wn, stride_wsn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K: tl.constexpr):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < BLOCK_N
    for k0 in range(0, K, BLOCK_K):
        w = kernels._weight_tile_prmt(
            w_ptr, ws_ptr, offs_n, n_mask, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K
        )
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block_k", [64, 128])
def test_gpu_prmt_tile_is_exact(block_k):
    """The tile equals E2M1 * block scale (float32, then bf16, which it fits exactly) bit for bit, but for
    code 8, which the kernel gives as -0 and the table as 0 (s18-prmt: the only difference)."""
    n, k = 64, 512
    codes, scale, _ = random_nvfp4(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    scale = (scale.float() * torch.logspace(-6, 6, n, base=2.0, device="cuda")[:, None]).to(
        torch.float8_e4m3fn
    )
    out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    _tile_kernel[(1,)](codes, scale, out, codes.stride(0), scale.stride(0), BLOCK_N=n, BLOCK_K=block_k, K=k)
    values = torch.tensor(E2M1_VALUES, device="cuda")[unpack_codes(codes).long()]
    want = (values * scale.float().repeat_interleave(16, dim=-1)).to(torch.bfloat16)
    assert torch.equal(want.float(), values * scale.float().repeat_interleave(16, dim=-1))  # exact in bf16
    assert torch.equal(out.float(), want.float())  # -0 == 0
    nonzero = want != 0
    assert torch.equal(out.view(torch.int16)[nonzero], want.view(torch.int16)[nonzero])
    assert bool((out[~nonzero].view(torch.int16) & 0x7FFF == 0).all())

"""The checkpoint's tensor names and shapes (INKLING_SPEC §8) and the NVFP4 layout of §9.

`expected_tensors(config)` is the one list that the synth tool writes, the checkpoint reader checks
and the converter walks: name -> (shape, dtype), in a stable order.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator

import torch

from .config import InklingConfig

PROJS = ("gate_proj", "up_proj", "down_proj")
NVFP4_BLOCK = 16
ROUTED_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")

# The exclude list of §9: every bf16 linear matches one of these, no quantized one does.
NVFP4_EXCLUDE_MODULES = (
    "lm_head",
    "model.embed_tokens",
    "model.layers.*.self_attn*",
    "model.layers.*.mlp.shared_experts*",
    "model.layers.*.mlp.router",
    "mtp*",
    "vision*",
    "audio*",
)

Spec = tuple[tuple[int, ...], torch.dtype]


def _attention(prefix: str, c: InklingConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    K = c.sconv_kernel_size
    yield f"{prefix}.self_attn.qkvr_proj.weight", (c.qkvr_size, c.hidden_size)
    yield f"{prefix}.self_attn.o_proj.weight", (c.hidden_size, c.q_size)
    yield f"{prefix}.self_attn.rel_embed", (c.num_attention_heads, c.max_relative_distance, c.rel_head_dim)
    yield f"{prefix}.self_attn.sconv_k.weight", (c.kv_size, K)
    yield f"{prefix}.self_attn.sconv_v.weight", (c.kv_size, K)
    yield f"{prefix}.self_attn.sconv_o.weight", (c.hidden_size, K)


def _swiglu(prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{prefix}.gate_proj.weight", (inter, hidden)
    yield f"{prefix}.up_proj.weight", (inter, hidden)
    yield f"{prefix}.down_proj.weight", (hidden, inter)


def layer_tensors(c: InklingConfig, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}"
    H, I = c.hidden_size, c.moe_intermediate_size
    yield f"{p}.input_layernorm.weight", (H,)
    yield from _attention(p, c)
    yield f"{p}.post_attention_layernorm.weight", (H,)
    yield f"{p}.mlp.router.weight", (c.num_router_outputs, H)
    for e in range(c.num_routed_experts):
        yield from _swiglu(f"{p}.mlp.experts.{e}", H, I)
    for s in range(c.num_shared_experts):
        yield from _swiglu(f"{p}.mlp.shared_experts.{s}", H, I)
    yield f"{p}.mlp.sconv_m.weight", (H, c.sconv_kernel_size)


def mtp_tensors(c: InklingConfig, m: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    p = f"mtp.{m}"
    H = c.hidden_size
    yield f"{p}.hnorm.weight", (H,)
    yield f"{p}.enorm.weight", (H,)
    yield f"{p}.eh_proj.weight", (H, 2 * H)
    yield f"{p}.input_layernorm.weight", (H,)
    yield from _attention(p, c)
    yield f"{p}.post_attention_layernorm.weight", (H,)
    yield from _swiglu(f"{p}.mlp", H, c.mtp_intermediate_size)
    yield f"{p}.final_layernorm.weight", (H,)


def encoder_tensors(c: InklingConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    d1, d2 = c.vision.hmlp_dims
    H = c.hidden_size
    yield "vision.hmlp.0.weight", (d1, 48)
    yield "vision.hmlp.0.bias", (d1,)
    yield "vision.hmlp.norm0.weight", (d1,)
    yield "vision.hmlp.norm0.bias", (d1,)
    yield "vision.hmlp.1.weight", (d2, 4 * d1)
    yield "vision.hmlp.1.bias", (d2,)
    yield "vision.hmlp.norm1.weight", (d2,)
    yield "vision.hmlp.norm1.bias", (d2,)
    yield "vision.hmlp.2.weight", (H, 4 * d2)
    yield "vision.hmlp.2.bias", (H,)
    a = c.audio
    yield "audio.dmel_embed.weight", (a.num_mels * a.num_levels, a.embed_dim)
    yield "audio.proj.weight", (H, a.frame_stack * a.embed_dim)
    yield "audio.proj.bias", (H,)


def bf16_tensors(c: InklingConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a bf16 checkpoint, in the order the synth tool writes them."""
    yield "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        yield from layer_tensors(c, i)
    yield "model.norm.weight", (c.hidden_size,)
    yield "lm_head.weight", (c.vocab_size, c.hidden_size)
    for m in range(c.num_mtp_heads):
        yield from mtp_tensors(c, m)
    yield from encoder_tensors(c)


def routed_expert_module(name: str) -> str | None:
    """`model.layers.3.mlp.experts.7.up_proj` for that module's `.weight`; None if not a routed expert linear."""
    if not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    return module if ROUTED_EXPERT_RE.match(module) else None


def nvfp4_tensors(module: str, shape: tuple[int, int]) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """The four tensors that replace one quantized linear's bf16 weight (§9)."""
    out, inp = shape
    yield f"{module}.weight", (out, inp // 2), torch.uint8
    yield f"{module}.weight_scale", (out, inp // NVFP4_BLOCK), torch.float8_e4m3fn
    yield f"{module}.weight_scale_2", (), torch.float32
    yield f"{module}.input_scale", (), torch.float32


def expected_tensors(c: InklingConfig) -> dict[str, Spec]:
    """name -> (shape, dtype) for a checkpoint of this config, NVFP4 routed experts if it is quantized."""
    out: dict[str, Spec] = {}
    for name, shape in bf16_tensors(c):
        module = routed_expert_module(name) if c.is_quantized else None
        if module is None:
            out[name] = (shape, torch.bfloat16)
        else:
            for qname, qshape, dtype in nvfp4_tensors(module, shape):
                out[qname] = (qshape, dtype)
    return out


def is_excluded(module: str, patterns: tuple[str, ...] | list[str] = NVFP4_EXCLUDE_MODULES) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)

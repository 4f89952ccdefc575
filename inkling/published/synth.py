"""Synthetic checkpoints of the real Inkling in the published layout (BF16, or NVFP4 routed experts).

    python -m inkling.published.synth --preset inkling-tiny --out DIR [--nvfp4] [--seed 0] [--force]

Every tensor of `layout.checkpoint_tensors` is drawn from its own generator seeded by (seed, name), so
its bytes depend on nothing else; tensors stream into planned shards (inkling.checkpoint.ShardedWriter)
and the directory appears only when complete. With the config.json, hf_quant_config.json (NVFP4),
tokenizer (a toy vocabulary's own, trained here; the real presets get none: theirs ships with the real
checkpoint), generation_config.json and a README.

Scales keep activations O(1) through every layer, and randomise every norm, bias and scale:
- linear weights N(0, 1/in); residual-branch outputs (wo_ud, w2_md, the experts' w2) also x 1/sqrt(2 L).
- norm weights 1 + N(0, 0.1²); sconv taps N(0, 0.2²) (the module adds its input: the skip keeps scale).
- rel_logits_proj N(0, 1/d_rel): the bias r·P has std ~1.
- router N(0, 4/H), selection bias N(0, 0.1²) (float32), gate.global_scale U(0.1, 0.2) (float32) so that
  the expert weights add to route_scale x it ~ 1.2; the dense layers' global_scale U(0.5, 1.5).
- embed N(0, 1); unembed N(0, m²/H) with m the muP divisor, so the logits have std ~1.
- audio table N(0, 1/mel_bins) (a frame sums one row per channel).
- NVFP4 stacks: uniformly random E2M1 codes, block scales 448·U(0.5, 1) in E4M3, scale2 per expert so the
  dequantized weight has the BF16 rule's std, input_amax 8 (raw amax, as the published files store it):
  random codes, not a quantization of some BF16 weights (the converter makes those).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import zlib
from collections.abc import Iterator

import torch

from ..checkpoint import GENERATION_CONFIG_FILE, ShardedWriter, atomic_checkpoint_dir, write_json
from .config import InklingConfig, preset
from .layout import NVFP4_GROUP, checkpoint_tensors
from .processing import PREPROCESSOR_FILE, PreprocessorSettings
from .tokens import build_tiny_tokenizer, save_tokenizer

MAX_TRAINED_VOCAB = 4096  # the real 200058-token tokenizer ships with the real checkpoint, not with synth
_RESIDUAL_OUT = ("attn.wo_ud.weight", "mlp.w2_md.weight", "experts.w2_weight", "shared_w2_weight")


_CHUNK = 1 << 24  # elements drawn per randn call: bounds the float32 temporary
_E2M1_MEAN_SQUARE = sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return g


def _normal(shape, gen, device, std: float, mean: float = 0.0, dtype=torch.bfloat16) -> torch.Tensor:
    """mean + std * N(0, 1) in `dtype`, drawn in float32 chunks of fixed size (deterministic, low memory)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        end = min(start + _CHUNK, flat.numel())
        flat[start:end] = torch.randn(end - start, generator=gen, device=device).mul_(std).add_(mean)
    return out


def _random_bytes(shape, gen, device) -> torch.Tensor:
    """Uniform random uint8 (full-range int64 draws viewed as bytes: 8x faster than uint8 draws)."""
    n = math.prod(shape)
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=device).random_(-(2**63), None, generator=gen)
    data = words.view(torch.uint8)
    return data.reshape(shape) if n % 8 == 0 else data[:n].reshape(shape).clone()


def _uniform(shape, gen, device, lo: float, hi: float, dtype) -> torch.Tensor:
    return torch.empty(shape, device=device).uniform_(lo, hi, generator=gen).to(dtype)


def synth_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, c: InklingConfig, seed: int, device
) -> torch.Tensor:
    """The BF16/F32 tensor `name` of a synthetic checkpoint (NVFP4 stacks: `nvfp4_stack`)."""
    t, gen = c.text, _generator(seed, name, device)
    residual = (2 * t.num_hidden_layers) ** -0.5
    if name.endswith("norm.weight") or name.endswith("norm_weight") or ".norm_" in name:
        return _normal(shape, gen, device, 0.1, mean=1.0, dtype=dtype)
    if "sconv" in name:
        return _normal(shape, gen, device, 0.2, dtype=dtype)
    if name.endswith("rel_logits_proj.proj"):
        return _normal(shape, gen, device, t.d_rel**-0.5, dtype=dtype)
    if name.endswith("mlp.gate.weight"):
        return _normal(shape, gen, device, 2.0 * t.hidden_size**-0.5, dtype=dtype)
    if name.endswith("mlp.gate.bias"):
        return _normal(shape, gen, device, 0.1, dtype=dtype)
    if name.endswith("mlp.gate.global_scale"):
        return _uniform(shape, gen, device, 0.1, 0.2, dtype)
    if name.endswith("mlp.global_scale"):
        return _uniform(shape, gen, device, 0.5, 1.5, dtype)
    if name == "model.llm.embed.weight":
        return _normal(shape, gen, device, 1.0, dtype=dtype)
    if name == "model.llm.unembed.weight":
        return _normal(shape, gen, device, t.logits_mup_width_multiplier * t.hidden_size**-0.5, dtype=dtype)
    if name == "model.audio.encoder.weight":
        return _normal(shape, gen, device, c.audio.n_mel_bins**-0.5, dtype=dtype)
    if name.endswith("weight") and len(shape) in (2, 3):
        scale = residual if name.endswith(_RESIDUAL_OUT) else 1.0
        return _normal(shape, gen, device, scale * shape[-1] ** -0.5, dtype=dtype)
    raise ValueError(f"synth has no rule for tensor {name} {list(shape)}")


def nvfp4_stack(
    name: str, shape: tuple[int, int, int], std: float, seed: int, device
) -> Iterator[tuple[str, torch.Tensor]]:
    """A quantized stack [E, rows, cols] and its sidecars, dequantizing to std ~`std`."""
    E, rows, cols = shape
    codes = _random_bytes((E, rows, cols // 2), _generator(seed, name, device), device)
    g = _generator(seed, f"{name}.scale", device)
    block = torch.empty((E, rows, cols // NVFP4_GROUP), device=device).uniform_(224.0, 448.0, generator=g)
    block = block.to(torch.float8_e4m3fn)
    mean_square = block.float().square().mean(dim=(1, 2))
    yield name, codes
    yield f"{name}.scale", block
    yield f"{name}.scale2", (std / (_E2M1_MEAN_SQUARE * mean_square).sqrt()).float()
    yield f"{name}.input_amax", torch.tensor([8.0], dtype=torch.bfloat16, device=device)
    yield f"{name}.original_shape", torch.tensor(list(shape), dtype=torch.int64, device=device)


def iter_tensors(
    c: InklingConfig, seed: int = 0, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `checkpoint_tensors(c)`, in its order, one at a time."""
    device = torch.device(device)
    specs = checkpoint_tensors(c)
    residual = (2 * c.text.num_hidden_layers) ** -0.5
    for name, (shape, dtype) in specs.items():
        if name.endswith((".scale", ".scale2", ".input_amax", ".original_shape")):
            continue  # written with their stack
        if dtype == torch.uint8:  # an NVFP4 stack: its logical shape is in the plan's original_shape
            E, rows, half = shape
            cols = half * 2
            std = (residual if name.endswith("w2_weight") else 1.0) * cols**-0.5
            yield from nvfp4_stack(name, (E, rows, cols), std, seed, device)
        else:
            yield name, synth_tensor(name, shape, dtype, c, seed, device)


def write_checkpoint(
    out: str | os.PathLike, c: InklingConfig, seed: int = 0, force: bool = False, device="cpu"
) -> str:
    """Write the synthetic checkpoint of `c` to `out` atomically; returns the directory."""
    with atomic_checkpoint_dir(out, force) as tmp:
        c.save(tmp)
        if (
            c.text.num_real_tokens <= MAX_TRAINED_VOCAB
        ):  # a toy vocabulary gets a trained tokenizer of its size
            save_tokenizer(build_tiny_tokenizer(c.text.num_real_tokens), tmp)
        write_json(
            os.path.join(tmp, PREPROCESSOR_FILE), PreprocessorSettings().to_dict()
        )  # the published settings
        write_json(
            os.path.join(tmp, GENERATION_CONFIG_FILE), {"eos_token_id": c.eos_token_id, "max_new_tokens": 256}
        )
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(
                f"# Synthetic Inkling checkpoint (random weights, seed {seed})\n\n`{' '.join(sys.argv)}`\n"
            )
        with ShardedWriter(tmp, checkpoint_tensors(c)) as writer:
            for name, tensor in iter_tensors(c, seed, device):
                writer.write(name, tensor)
    return os.path.abspath(os.fspath(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="inkling-tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--nvfp4", action="store_true", help="the published NVFP4 layout: random codes for the routed experts"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    c = preset(args.preset, nvfp4=args.nvfp4)
    n = sum(math.prod(s) * d.itemsize for s, d in checkpoint_tensors(c).values())
    print(
        f"[synth] {args.preset}{' NVFP4' if args.nvfp4 else ''}: {n / 1e9:.3f} GB -> {args.out}", flush=True
    )
    write_checkpoint(args.out, c, args.seed, args.force, args.device)


if __name__ == "__main__":
    main()

"""Synthetic Inkling checkpoints: random weights with every tensor of INKLING_SPEC §8 (and §9 with --nvfp4).

    python -m inkling.synth --preset inkling-tiny --out DIR --seed 0 [--layers N] [--mtp-heads M]
                            [--nvfp4] [--force] [--device cpu]

Every tensor is drawn from its own generator seeded by (seed, name), so a tensor's bytes do not depend
on the order, on the other tensors or on slicing with --layers / --mtp-heads (the residual scale below
uses the preset's depth, not the slice's). Same seed, same device kind: same bytes.

Scales, chosen so that activations stay O(1) through every layer (x has RMS ~1 after each RMSNorm):
- linear weights N(0, 1/in), so x @ W.T keeps RMS ~1; lm_head N(0, 1/H): logits have std ~1.
- residual-branch outputs (o_proj, routed and shared experts' down_proj, the MTP FFN's down_proj)
  further times 1/sqrt(2 L) with L the preset's number of layers: the residual stream grows by a
  bounded factor over the whole depth.
- norm weights 1 + N(0, 0.1²); LayerNorm biases and linear biases N(0, 0.02²).
- rel_embed N(0, 1/Dr): r (RMS ~1) · E gives relative logits of std ~1, like q·k/sqrt(D).
- sconv: the current-token tap w[c, K-1] = 1 + N(0, 0.1²), earlier taps N(0, 0.2²): sconv roughly
  preserves scale while still mixing in the previous tokens.
- router N(0, 4/H): routing logits of std ~2, so routing is neither uniform nor one-hot and the
  top-k rarely has near-ties.
- embed_tokens N(0, 1) (padded rows beyond the tokenizer included).
- audio dmel_embed N(0, 1/num_mels): a frame sums one row per mel channel, so it has std ~1.
- NVFP4 routed experts (§9): uniformly random E2M1 codes (RMS of a code 2.93), block scales
  448·U(0.5, 1) rounded to float8_e4m3fn, and weight_scale_2 chosen from the block scales so that
  the dequantized weight has the bf16 weight's std; input_scale 1.0 (uncalibrated). These are random
  codes, not a quantization of some bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from .checkpoint import DEFAULT_MAX_SHARD_BYTES, GENERATION_CONFIG_FILE, ShardedWriter
from .config import PRESET_NAMES, InklingConfig, default_layer_types, preset
from .tensors import NVFP4_BLOCK, NVFP4_EXCLUDE_MODULES, expected_tensors, routed_expert_module
from .tokenizer import TOKENIZER_FILE, build_tokenizer, special_token_ids

MODELOPT_VERSION = "0.47.0"
MAX_NEW_TOKENS = 256
_CHUNK = 1 << 24  # elements drawn per randn call: bounds the float32 temporary
_E2M1_MEAN_SQUARE = sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8
_RESIDUAL_OUT = (".self_attn.o_proj.weight", ".down_proj.weight")
_NORM_WEIGHT = re.compile(r"norm\d*\.weight$")  # RMSNorm and LayerNorm weights


def nvfp4_quantization_config(calibrated: bool = False) -> dict[str, Any]:
    """config.json["quantization_config"] of an NVFP4 checkpoint (INKLING_SPEC §9)."""
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": NVFP4_BLOCK,
        "kv_cache_quant_algo": None,
        "calibrated": calibrated,
        "exclude_modules": list(NVFP4_EXCLUDE_MODULES),
    }


def hf_quant_config(quantization_config: dict[str, Any]) -> dict[str, Any]:
    """hf_quant_config.json: the same settings, nested as ModelOpt writes them."""
    quantization = {k: v for k, v in quantization_config.items() if k != "quant_method"}
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": quantization}


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


def _sconv(shape, gen, device) -> torch.Tensor:
    w = _normal(shape, gen, device, 0.2, dtype=torch.float32)
    w[:, -1] = 1.0 + 0.5 * w[:, -1]  # the current-token tap: 1 + N(0, 0.1²)
    return w.to(torch.bfloat16)


def _bf16_tensor(
    name: str, shape: tuple[int, ...], c: InklingConfig, gen, device, residual: float
) -> torch.Tensor:
    if _NORM_WEIGHT.search(name):
        return _normal(shape, gen, device, 0.1, mean=1.0)
    if name.endswith(".bias"):
        return _normal(shape, gen, device, 0.02)
    if name.endswith(".rel_embed"):
        return _normal(shape, gen, device, c.rel_head_dim**-0.5)
    if ".sconv_" in name:
        return _sconv(shape, gen, device)
    if name.endswith(".router.weight"):
        return _normal(shape, gen, device, 2.0 * c.hidden_size**-0.5)
    if name == "model.embed_tokens.weight":
        return _normal(shape, gen, device, 1.0)
    if name == "audio.dmel_embed.weight":
        return _normal(shape, gen, device, c.audio.num_mels**-0.5)
    if name.endswith(".weight") and len(shape) == 2:
        scale = residual if name.endswith(_RESIDUAL_OUT) else 1.0
        return _normal(shape, gen, device, scale * shape[1] ** -0.5)
    raise ValueError(f"synth has no rule for tensor {name} {list(shape)}")


def _nvfp4_linear(
    module: str, shape: tuple[int, int], std: float, seed: int, device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The four §9 tensors of one routed expert linear whose dequantized weight has std ~`std`."""
    out, inp = shape
    codes = _random_bytes((out, inp // 2), _generator(seed, f"{module}.weight", device), device)
    g = _generator(seed, f"{module}.weight_scale", device)
    block = torch.empty((out, inp // NVFP4_BLOCK), device=device).uniform_(224.0, 448.0, generator=g)
    block = block.to(torch.float8_e4m3fn)
    mean_square = block.float().square().mean().item()
    scale_2 = std / math.sqrt(_E2M1_MEAN_SQUARE * mean_square)
    yield f"{module}.weight", codes
    yield f"{module}.weight_scale", block
    yield f"{module}.weight_scale_2", torch.tensor(scale_2, dtype=torch.float32, device=device)
    yield f"{module}.input_scale", torch.tensor(1.0, dtype=torch.float32, device=device)


def residual_scale(num_layers: int) -> float:
    return (2 * num_layers) ** -0.5


def iter_synthetic_tensors(
    config: InklingConfig,
    seed: int = 0,
    device: str | torch.device = "cpu",
    *,
    residual_depth: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `expected_tensors(config)`, in that order, on `device`.

    `residual_depth` is the depth used for the residual-branch scale (default: the config's layers);
    a slice of a preset passes the preset's depth so that its tensors equal the full model's.
    """
    device = torch.device(device)
    residual = residual_scale(residual_depth or config.num_hidden_layers)
    specs = expected_tensors(config)
    for name, (shape, dtype) in specs.items():
        module = routed_expert_module(name) if config.is_quantized else None
        if module is not None:
            if dtype != torch.uint8:
                raise ValueError(f"{name}: expected the NVFP4 codes (uint8), found {dtype}")
            in_features = shape[1] * 2
            std = (residual if name.endswith(_RESIDUAL_OUT) else 1.0) * in_features**-0.5
            yield from _nvfp4_linear(module, (shape[0], in_features), std, seed, device)
        elif name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue  # yielded with its module's codes
        else:
            if dtype != torch.bfloat16:
                raise ValueError(f"{name}: synth writes bf16 here, the plan says {dtype}")
            yield name, _bf16_tensor(name, shape, config, _generator(seed, name, device), device, residual)


def synth_config(
    preset_name: str,
    *,
    layers: int | None = None,
    mtp_heads: int | None = None,
    nvfp4: bool = False,
    tokenizer: Tokenizer | None = None,
) -> tuple[InklingConfig, int]:
    """The config of a synthetic checkpoint and the preset's full depth (for `residual_depth`)."""
    tok = tokenizer or build_tokenizer()
    overrides: dict[str, Any] = {"token_ids": special_token_ids(tok)}
    if preset_name == "inkling-tiny":
        overrides["vocab_size"] = tok.get_vocab_size()
    config = preset(preset_name, **overrides)
    full_depth = config.num_hidden_layers
    if layers is not None:
        config = config.replace(num_hidden_layers=layers, layer_types=default_layer_types(layers))
    if mtp_heads is not None:
        config = config.replace(num_mtp_heads=mtp_heads)
    if nvfp4:
        config = config.replace(quantization_config=nvfp4_quantization_config())
    return config, full_depth


def _readme(config: InklingConfig, argv_line: str) -> str:
    kind = "NVFP4 routed experts" if config.is_quantized else "bf16"
    text = (
        "# Synthetic Inkling checkpoint\n\n"
        f"Random weights ({kind}), not a trained model. Written by:\n\n    {argv_line}\n\n"
        "Scales are chosen so that activations stay O(1); see `inkling/synth.py`.\n"
    )
    if config.is_quantized:
        text += (
            "\nThe NVFP4 codes and block scales are random, not the output of a ModelOpt quantization,\n"
            "although hf_quant_config.json names modelopt as its producer so that loaders accept it.\n"
        )
    return text


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _write_checkpoint(
    tmp: str,
    config: InklingConfig,
    tok: Tokenizer,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int,
    progress: bool,
) -> None:
    config.save(os.path.join(tmp, "config.json"))
    tok.save(os.path.join(tmp, TOKENIZER_FILE))
    ids = config.token_ids
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    _write_json(os.path.join(tmp, GENERATION_CONFIG_FILE), generation)
    if config.is_quantized:
        _write_json(os.path.join(tmp, "hf_quant_config.json"), hf_quant_config(config.quantization_config))
    with ShardedWriter(tmp, expected_tensors(config), max_shard_bytes) as writer:
        bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, disable=not progress, desc="write")
        for name, tensor in tensors:
            writer.write(name, tensor)
            bar.update(tensor.numel() * tensor.dtype.itemsize)
            del tensor
        bar.close()


def _publish(tmp: str, out: str) -> None:
    """Move the finished temp dir to `out`, replacing an old one only once the new one is complete."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.old-")
        os.rmdir(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def write_checkpoint(
    out: str | os.PathLike,
    config: InklingConfig,
    tok: Tokenizer,
    tensors: Iterable[tuple[str, torch.Tensor]],
    readme: str,
    *,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
) -> None:
    """Write a checkpoint directory that follows the spec (§8: config, tokenizer, generation config,
    safetensors shards and index, README) atomically: a temp dir beside `out`, renamed when complete.
    `tensors` yields (name, tensor) for every tensor of `expected_tensors(config)`, in any order."""
    with atomic_checkpoint_dir(out, force) as tmp:
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(readme)
        _write_checkpoint(tmp, config, tok, tensors, max_shard_bytes, progress)


@contextmanager
def atomic_checkpoint_dir(out: str | os.PathLike, force: bool = False) -> Iterator[str]:
    """A temp dir beside `out` to write a checkpoint into; it replaces `out` once the block completes, and
    is removed if it fails. An existing non-empty `out` needs `force`."""
    out = os.path.abspath(os.fspath(out))
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not force):
        raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.tmp-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is not
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def synthesize(
    out: str | os.PathLike,
    preset_name: str = "inkling-tiny",
    seed: int = 0,
    *,
    layers: int | None = None,
    mtp_heads: int | None = None,
    nvfp4: bool = False,
    force: bool = False,
    device: str = "cpu",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
) -> InklingConfig:
    """Write a synthetic checkpoint directory atomically (temp dir beside `out`, then rename)."""
    tok = build_tokenizer()
    config, full_depth = synth_config(
        preset_name, layers=layers, mtp_heads=mtp_heads, nvfp4=nvfp4, tokenizer=tok
    )
    argv = f"python -m inkling.synth --preset {preset_name} --seed {seed}"
    argv += f" --layers {layers}" if layers is not None else ""
    argv += f" --mtp-heads {mtp_heads}" if mtp_heads is not None else ""
    argv += " --nvfp4" if nvfp4 else ""
    tensors = iter_synthetic_tensors(config, seed, device, residual_depth=full_depth)
    write_checkpoint(
        out,
        config,
        tok,
        tensors,
        _readme(config, argv),
        force=force,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )
    return config


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m inkling.synth", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="inkling-tiny", choices=PRESET_NAMES)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="write only the first N decoder layers")
    p.add_argument("--mtp-heads", type=int, default=None, help="write only the first M MTP heads")
    p.add_argument("--nvfp4", action="store_true", help="routed experts in the NVFP4 layout of §9")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--device", default="cpu", help="where to draw the random numbers (cpu, cuda)")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        config = synthesize(
            args.out,
            args.preset,
            args.seed,
            layers=args.layers,
            mtp_heads=args.mtp_heads,
            nvfp4=args.nvfp4,
            force=args.force,
            device=args.device,
            max_shard_bytes=args.max_shard_bytes,
            progress=sys.stderr.isatty(),
        )
    except FileExistsError as e:
        p.error(str(e))
    total = sum(math.prod(s) * d.itemsize for s, d in expected_tensors(config).values())
    print(
        f"wrote {args.out}: {config.num_hidden_layers} layers, {config.num_mtp_heads} MTP heads, "
        f"{total / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s; peak RSS {peak_rss_bytes() / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()

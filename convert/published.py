"""A BF16 checkpoint of the real Inkling in, the published NVFP4 layout out (INKLING_SERVING.md §2).

    python -m convert.published --model_dir BF16_DIR --output_dir NVFP4_DIR [--quantize_first_moe]
                                [--calibration_prompts N] [--workers N] [--force]

What the published Inkling-NVFP4 holds, and what this writes: the routed experts of every MoE layer but
the first, as stacks over the experts (`mlp.experts.w13_weight` with gate/up rows still interleaved,
`mlp.experts.w2_weight`) of U8 E2M1 codes with `.scale` (E4M3, one per 16 inputs), `.scale2` (F32, one
global scale per expert, shared by gate and up), `.input_amax` (the layer's raw calibrated activation
amax, BF16 [1]) and `.original_shape` (I64 [3]); hf_quant_config.json in ModelOpt's nested form with the
unquantized modules in exclude_modules; everything else copied byte for byte. Each expert's weight is
quantized by ModelOpt (`inkling.nvfp4.quantize`), one expert at a time.

Calibration runs transformers' model on built-in text (CPU, float32) and records, per MoE layer, the
amax of the routed experts' input and of their intermediate activation over the tokens routed to them.
Without it (`--calibration_prompts 0`), input_amax is 6 x 448: ModelOpt's input scale 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from inkling import nvfp4
from inkling.checkpoint import CheckpointError, ShardedWriter
from inkling.published.checkpoint import PublishedCheckpoint
from inkling.published.config import InklingConfig, QuantConfig, published_exclude_modules
from inkling.published.layout import checkpoint_tensors

from . import output
from .errors import ConvertError

UNCALIBRATED_AMAX = nvfp4.E2M1_MAX * nvfp4.E4M3_MAX
DEFAULT_PROMPTS = 8
MAX_PROMPT_TOKENS = 256
# Built-in calibration text: varied registers (prose, code, numbers, dialogue, lists), so that the
# router spreads the tokens over many experts.
CALIBRATION_TEXTS = (
    "The history of the printing press is a story of small improvements: movable type, oil-based ink, "
    "and a screw press borrowed from winemakers changed how ideas travelled across Europe.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Q: How many minutes are there in a week? A: 7 days * 24 hours * 60 minutes = 10080 minutes.",
    "Ingredients: 200 g flour, 2 eggs, 300 ml milk, a pinch of salt. Whisk, rest for 30 minutes, then fry.",
    "Dear team, the release is planned for Thursday. Please merge fixes by Tuesday noon and update the changelog.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (id) GROUP BY name ORDER BY orders DESC;",
    "In 1969 the Apollo 11 mission landed on the Moon; Neil Armstrong and Buzz Aldrin spent about 21 hours there.",
    "The mitochondria convert nutrients into ATP through oxidative phosphorylation across the inner membrane.",
    '{"id": 42, "tags": ["alpha", "beta"], "active": true, "score": 3.14159, "owner": {"name": "Ada"}}',
    "Il pleut depuis ce matin, mais nous irons quand même au marché acheter des pommes et du fromage.",
    "Theorem: there are infinitely many primes. Proof: suppose p1..pn are all of them; p1*...*pn + 1 has a new factor.",
    "- buy milk\n- call the plumber about the kitchen sink\n- renew the passport before March\n- water the plants",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product, O(n) time and O(1) memory",
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.",
    "Error: connection refused (errno 111) while contacting 10.0.0.7:8080; retrying in 5 seconds.",
    "She said, 'I will be there at half past six,' and then, after a pause, 'unless the train is late again.'",
)
_SIDE_FILES_SKIP = {"config.json", "hf_quant_config.json", "model.safetensors.index.json", "README.md"}


def modelopt_version() -> str:
    try:
        import modelopt
    except ImportError as e:
        raise ConvertError(
            "NVFP4 conversion needs NVIDIA ModelOpt (nvidia-modelopt): pip install .[convert]"
        ) from e
    return modelopt.__version__


def quantized_config(config: InklingConfig, quantize_first_moe: bool = False) -> InklingConfig:
    exclude = published_exclude_modules(config)
    if quantize_first_moe:
        exclude = tuple(m for m in exclude if not m.endswith(".mlp.experts"))
    return config.replace(quant=QuantConfig(exclude_modules=exclude))


def quantize_stack(stack: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """[E, rows, cols] BF16 -> (suffix, tensor) of the codes and block scales (stacked), and scale2 [E]."""
    parts = [nvfp4.quantize(stack[e]) for e in range(stack.shape[0])]
    yield "", torch.stack([p[0] for p in parts])
    yield ".scale", torch.stack([p[1] for p in parts])
    yield ".scale2", torch.stack([p[2].reshape(()) for p in parts])


def dequantize_stack(codes: torch.Tensor, scale: torch.Tensor, scale2: torch.Tensor) -> torch.Tensor:
    """The stack's weight in float32 [E, rows, cols]: each expert by `inkling.nvfp4.dequantize`."""
    return torch.stack([nvfp4.dequantize(codes[e], scale[e], scale2[e]) for e in range(codes.shape[0])])


def calibrate(model_dir: str, config: InklingConfig, num_prompts: int) -> dict[str, float]:
    """`model.llm.layers.L.mlp.experts.{w13,w2}_weight` -> the raw activation amax of its input."""
    import transformers
    from tokenizers import Tokenizer

    model = transformers.InklingForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    amax: dict[str, float] = {}

    def hook_for(layer: int, experts):
        name = f"model.llm.layers.{layer}.mlp.experts"

        def hook(_module, args) -> None:
            x, idx = args[0], args[1]
            amax[f"{name}.w13_weight"] = max(amax.get(f"{name}.w13_weight", 0.0), float(x.abs().max()))
            inter = amax.get(f"{name}.w2_weight", 0.0)
            for e in idx.unique().tolist():
                rows = (idx == e).any(dim=-1)
                gate, up = torch.nn.functional.linear(x[rows], experts.gate_up_proj[e]).chunk(2, dim=-1)
                inter = max(inter, float((torch.nn.functional.silu(gate) * up).abs().max()))
            amax[f"{name}.w2_weight"] = inter

        return hook

    layers = model.model.language_model.layers
    handles = [
        layers[i].mlp.experts.register_forward_pre_hook(hook_for(i, layers[i].mlp.experts))
        for i in range(config.text.num_hidden_layers)
        if config.experts_quantized(i)
    ]
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConvertError(
            f"calibration needs the checkpoint's tokenizer: no {path} (or --calibration_prompts 0)"
        )
    tok = Tokenizer.from_file(path)
    media = {config.image_token_id, config.audio_token_id}  # placeholders would ask for media not given
    with torch.no_grad():
        for text in CALIBRATION_TEXTS[:num_prompts]:  # no BOS: the real tokenizer prepends nothing
            ids = [t for t in tok.encode(text).ids if t not in media][:MAX_PROMPT_TOKENS]
            model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    return amax


def convert(
    model_dir: str,
    output_dir: str,
    *,
    quantize_first_moe: bool = False,
    calibration_prompts_n: int = DEFAULT_PROMPTS,
    force: bool = False,
    progress: bool = False,
) -> InklingConfig:
    """Write the NVFP4 checkpoint of the BF16 one at `model_dir`; returns its config."""
    model_dir, output_dir = os.path.abspath(model_dir), os.path.abspath(output_dir)
    output.check_output_path(model_dir, output_dir, force)
    try:
        reader = PublishedCheckpoint(model_dir)
    except CheckpointError as e:
        raise ConvertError(str(e)) from e
    with reader:
        if reader.config.is_quantized:
            raise ConvertError(f"{model_dir} is already quantized (it has hf_quant_config.json)")
        if reader.config.dtype != "bfloat16":
            raise ConvertError(
                f"{model_dir} is {reader.config.dtype}; the published NVFP4 layout starts from BF16"
            )
        config = quantized_config(reader.config, quantize_first_moe)
        amax = calibrate(model_dir, config, calibration_prompts_n) if calibration_prompts_n else {}
        plan = checkpoint_tensors(config)
        with output.atomic_output_dir(output_dir, force) as tmp:
            config.save(tmp, modelopt_version())
            output.copy_side_files(model_dir, tmp, _SIDE_FILES_SKIP)
            with ShardedWriter(tmp, plan) as writer:
                for name in tqdm(reader.keys(), disable=not progress, desc="convert"):
                    tensor = reader.get(name)
                    if plan[name][1] != torch.uint8:
                        writer.write(name, tensor)
                        continue
                    for suffix, t in quantize_stack(tensor):
                        writer.write(name + suffix, t)
                    writer.write(
                        f"{name}.input_amax",
                        torch.tensor([amax.get(name, UNCALIBRATED_AMAX)], dtype=torch.bfloat16),
                    )
                    writer.write(
                        f"{name}.original_shape", torch.tensor(list(tensor.shape), dtype=torch.int64)
                    )
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--quantize_first_moe", action="store_true",
                    help="also quantize the first MoE layer's experts (the published file keeps them BF16)")  # fmt: skip
    ap.add_argument("--calibration_prompts", type=int, default=DEFAULT_PROMPTS)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        convert(args.model_dir, args.output_dir, quantize_first_moe=args.quantize_first_moe,
                calibration_prompts_n=args.calibration_prompts, force=args.force, progress=True)  # fmt: skip
    except (ConvertError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"[convert] {args.output_dir} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

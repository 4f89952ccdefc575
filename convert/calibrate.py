"""Activation scales of the routed experts (input_scale, INKLING_SPEC §9) from a calibration run.

The reference model runs a few prompts; a forward pre-hook on every routed expert linear records the
amax of exactly the tokens routed to that expert (the reference never calls an expert with none).
input_scale = amax / (6 * 448), as ModelOpt's `get_activation_scaling_factor` computes it for NVFP4.
An expert that no calibration token reached takes the largest input_scale of the same projection
(gate_proj, up_proj or down_proj) in its layer, as ModelOpt's MoE export fills uncalibrated experts.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence

import torch

from inkling import nvfp4
from inkling.config import InklingConfig
from inkling.tensors import PROJS

from .errors import ConvertError

DEFAULT_NUM_PROMPTS = 8
MAX_PROMPT_TOKENS = 256
MEMORY_FRACTION = 0.8  # of the available memory the float32 model may take

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


def read_calibration_texts(path: str | os.PathLike | None) -> list[str]:
    """The non-empty lines of `path`, or the built-in texts."""
    if path is None:
        return list(CALIBRATION_TEXTS)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except FileNotFoundError as e:
        raise ConvertError(f"--calib_data {path} does not exist") from e
    except UnicodeDecodeError as e:
        raise ConvertError(f"--calib_data {path} is not UTF-8 text: {e}") from e
    if not lines:
        raise ConvertError(f"--calib_data {path} has no non-empty lines")
    return lines


def calibration_prompts(
    model_dir: str | os.PathLike, config: InklingConfig, texts: Sequence[str], num_prompts: int
) -> list[torch.Tensor]:
    """Token ids of the first `num_prompts` texts: <|bos|> then the text (media placeholders dropped),
    at most MAX_PROMPT_TOKENS."""
    from inkling.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError as e:
        raise ConvertError(f"calibration needs the checkpoint's tokenizer: {e} (or use --calib 0)") from e
    bos = [config.token_ids["bos"]] if "bos" in config.token_ids else []
    # Text that spells an image or audio placeholder would ask the model for media it does not get.
    media = {tid for name, tid in config.token_ids.items() if name.startswith(("image", "audio"))}
    prompts = []
    for text in texts[:num_prompts]:
        ids = bos + [t for t in tokenizer.encode(text).ids if t not in media]
        prompts.append(torch.tensor(ids[:MAX_PROMPT_TOKENS], dtype=torch.long))
    return prompts


def routed_expert_modules(config: InklingConfig) -> list[str]:
    return [
        f"model.layers.{i}.mlp.experts.{e}.{proj}"
        for i in range(config.num_hidden_layers)
        for e in range(config.num_routed_experts)
        for proj in PROJS
    ]


@torch.no_grad()
def record_input_amax(
    model: torch.nn.Module, modules: Sequence[str], prompts: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """module -> amax |input| over every token the module saw (absent: it saw none), float32 []."""
    amax: dict[str, torch.Tensor] = {}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            a = args[0].detach().abs().amax().float().cpu()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return hook

    handles = [model.get_submodule(m).register_forward_pre_hook(hook_for(m)) for m in modules]
    try:
        device = next(model.parameters()).device
        for ids in prompts:
            model(ids.to(device))
    finally:
        for h in handles:
            h.remove()
    return amax


def input_scales(config: InklingConfig, amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module -> input_scale for every routed expert linear; unreached experts take their layer's max.

    A zero amax (every input exactly 0) counts as unreached: input_scale 0 would divide by zero later.
    """
    scales: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        for proj in PROJS:
            names = [f"model.layers.{i}.mlp.experts.{e}.{proj}" for e in range(config.num_routed_experts)]
            reached = {n: nvfp4.activation_scale(amax[n]) for n in names if n in amax and amax[n] > 0}
            if not reached:
                raise ConvertError(
                    f"calibration reached no expert's {proj} in layer {i}: the prompts are empty or the "
                    "activations are all zero"
                )
            fallback = max(reached.values())
            scales.update({n: reached.get(n, fallback) for n in names})
    return scales


def float32_model_bytes(config: InklingConfig) -> int:
    from inkling.tensors import bf16_tensors

    return sum(4 * torch.Size(shape).numel() for _, shape in bf16_tensors(config))


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits_in_memory(config: InklingConfig) -> None:
    need = float32_model_bytes(config)
    have = available_memory_bytes()
    if have is not None and need > MEMORY_FRACTION * have:
        raise ConvertError(
            f"calibration runs the whole float32 reference model on the CPU: it needs about {need / 1e9:.1f} GB "
            f"and {have / 1e9:.1f} GB are available. Use --calib 0 (input_scale 1.0, calibrated false)."
        )


def calibrate(
    model_dir: str | os.PathLike,
    config: InklingConfig,
    num_prompts: int = DEFAULT_NUM_PROMPTS,
    calib_data: str | os.PathLike | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the float32 reference model on the calibration prompts: (input_scale, recorded amax) per module."""
    from inkling.model import InklingReference

    texts = read_calibration_texts(calib_data)
    prompts = calibration_prompts(model_dir, config, texts, num_prompts)
    check_fits_in_memory(config)
    model = InklingReference.from_pretrained(model_dir, dtype=torch.float32, device="cpu")
    try:
        amax = record_input_amax(model, routed_expert_modules(config), prompts)
    finally:
        del model
        gc.collect()
    return input_scales(config, amax), amax

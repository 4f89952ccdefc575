"""Train a small real Inkling: `python -m train.published --out DIR [--steps N | --time_budget S]`.

The training model is transformers' own `InklingForConditionalGeneration` (the numerical reference) at
small widths, with the real MTP depths of inkling/published/mtp.py (transformers' decoder block around
the published fusion) trained beside it: the main loss is next-token cross-entropy, depth d (0-based)
at position t predicts the token d+2 ahead from the trunk's post-norm hidden state (or depth d-1's
output) and the embedding of token t+d+1, teacher-forced over the whole row; `--mtp_weight` times the
mean of the depths' losses is added. Every token is weighted by the mixture (answers count more,
train/data.py), the towers are left as initialised. AdamW, warm-up then cosine; float32 (TF32 matmuls on CUDA).

Writes DIR/ in the published BF16 layout (the trunk as transformers' save_pretrained names it, the
depths under `model.mtp.layers.{d}.` with interleaved w13), with the tiny tokenizer's special-token
layout, the chat template and train_log.json: an ordinary checkpoint for the builder and the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from inkling.checkpoint import GENERATION_CONFIG_FILE, ShardedWriter, atomic_checkpoint_dir
from inkling.published.config import FULL, SLIDING, InklingConfig, preset
from inkling.published.layout import checkpoint_tensors
from inkling.published.mtp import _RENAMES, _W13
from inkling.published.processing import PREPROCESSOR_FILE, PreprocessorSettings
from inkling.published.synth import synth_tensor
from inkling.published.tokens import build_tiny_tokenizer, save_tokenizer

from .data import Mixture
from .loop import add_arguments, fit, needle_accuracy, weighted_ce

SEPARATOR, EOS = "<|endoftext|>", "<|content_model_end_sampling|>"  # no BOS in the real model
TRAINED_FILE = "trained.safetensors"
UNTRAINED = "model.visual."
CHECKPOINT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "inkling-small-published"
)


def trained_config() -> InklingConfig:
    """About 3M parameters in the trunk: hidden 128; 6 layers (5 sliding of window 128 with 2 KV heads, one
    full with 1, head width 64), the first two dense and then MoE of 16 routed experts of width 32 (top 6,
    2 shared); the relative term to 256 tokens; log scaling from 1,024 tokens (so the needle lengths past
    it test it); 8 MTP depths of both kinds; inkling-tiny's 1,024-id vocabulary and towers."""
    tiny = preset("inkling-tiny")
    text = dataclasses.replace(
        tiny.text, hidden_size=128, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_head_dim=64,
        sliding_window_size=128, d_rel=8, rel_extent=256, log_scaling_n_floor=1024,
        max_position_embeddings=8192, layer_types=(SLIDING,) * 3 + (FULL,) + (SLIDING,) * 2,
        mlp_layer_types=tiny.text.mlp_layer_types[:6], intermediate_size=256, moe_intermediate_size=32,
        logits_mup_width_multiplier=2.0,
    )  # fmt: skip
    return tiny.replace(text=text)


class Trainee(torch.nn.Module):
    """transformers' model and the MTP depths, one module for the optimizer."""

    def __init__(self, config: InklingConfig, directory: str, seed: int):
        """Initialised as the synthesizer initialises a checkpoint (`seed`), loaded the way the reference
        loads one: transformers' constructor leaves some tensors uninitialised (the expert stacks, the
        relative banks), which on a GPU start as whatever memory held."""
        from inkling.published.mtp import MTPReference
        from inkling.published.synth import write_checkpoint

        super().__init__()
        reference = MTPReference.load(write_checkpoint(os.path.join(directory, "init"), config, seed))
        self.trunk, self.depths = reference.trunk.train(), reference.depths.train()
        self.config = config

    def forward(self, ids: torch.Tensor, num_depths: int | None = None):
        """ids [B, T] -> main logits [B, T, V] and each depth's logits [B, T-d-2, V] (float32 unpadded)."""
        lm = self.trunk.model.language_model
        seen = {}
        hooks = [
            lm.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("embeds", kw["inputs_embeds"]),
                                         with_kwargs=True),
            lm.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("hidden", out)),
        ]  # fmt: skip
        try:
            logits = self.trunk(input_ids=ids).logits
        finally:
            for h in hooks:
                h.remove()
        t = self.config.text
        unembed = self.trunk.lm_head.weight[: t.num_real_tokens]
        h, embeds, T = seen["hidden"], seen["embeds"], ids.shape[1]
        heads = []
        for m in range(1, (len(self.depths) if num_depths is None else num_depths) + 1):
            P = T - m - 1
            h = self.depths[m - 1](h[:, :P], embeds[:, m : m + P])
            heads.append(h / t.logits_mup_width_multiplier @ unembed.T)
        return logits[..., : t.num_real_tokens], heads

    def tensors(self, directory: str) -> dict[str, torch.Tensor]:
        """Every tensor under its published name, as the checkpoint plan wants it."""
        self.trunk.save_pretrained(directory)  # writes the published names
        out = {}
        for f in sorted(os.listdir(directory)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(directory, f)))
        inverse = {v: k for k, v in _RENAMES.items()}
        for d, depth in enumerate(self.depths):
            state = depth.state_dict()
            prefix = f"model.mtp.layers.{d}."
            for name, value in state.items():
                if name in inverse:
                    out[prefix + inverse[name]] = value
            gate, up = state["block.mlp.gate_proj.weight"], state["block.mlp.up_proj.weight"]
            out[prefix + _W13] = torch.stack([gate, up], 1).flatten(0, 1)  # rows 2j gate, 2j+1 up
        return out


def losses(model: Trainee, ids, weights):
    logits, heads = model(ids)
    main = weighted_ce(logits[:, :-1], ids[:, 1:], weights[:, 1:])
    head_losses = [
        weighted_ce(hl, ids[:, m + 1 :], weights[:, m + 1 :]) for m, hl in enumerate(heads, start=1)
    ]
    return main, head_losses


def answer_logits(model: Trainee):
    return lambda ids: model(ids, num_depths=0)[0]


def write(out: str, model: Trainee, tok, readme: str, log: dict, force: bool) -> None:
    """The trained checkpoint in its committed form: every trained tensor in TRAINED_FILE, with the config,
    tokenizer and side files; the vision tower, untrained and 26M parameters at its fixed real widths,
    is left to `materialize` (the device tool and the repository both have size limits)."""
    config = model.config
    plan = checkpoint_tensors(config)
    with tempfile.TemporaryDirectory() as scratch, atomic_checkpoint_dir(out, force) as tmp:
        tensors = model.tensors(scratch)
        if set(tensors) != set(plan):
            raise RuntimeError(
                f"model and layout disagree on tensors: {sorted(set(tensors) ^ set(plan))[:5]}"
            )
        config.save(tmp)
        save_tokenizer(tok, tmp)
        for name, data in ((PREPROCESSOR_FILE, PreprocessorSettings().to_dict()),
                           (GENERATION_CONFIG_FILE, {"eos_token_id": config.eos_token_id, "max_new_tokens": 256}),
                           ("train_log.json", log)):  # fmt: skip
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(data, f, indent=1)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(readme)
        kept = {
            n: t.detach().to("cpu", plan[n][1]).contiguous()
            for n, t in tensors.items()
            if not n.startswith(UNTRAINED)
        }
        save_file(kept, os.path.join(tmp, TRAINED_FILE))


def materialize(src: str | os.PathLike, out: str | os.PathLike, seed: int = 0, force: bool = False) -> str:
    """The committed form at `src` -> a whole published BF16 checkpoint at `out`: the trained tensors, and
    the vision tower from the synthesizer (seeded; untrained either way). Returns `out`."""
    src = os.fspath(src)
    config = InklingConfig.from_pretrained(src)
    trained = load_file(os.path.join(src, TRAINED_FILE))
    plan = checkpoint_tensors(config)
    if missing := sorted(n for n in plan if n not in trained and not n.startswith(UNTRAINED)):
        raise ValueError(f"{src}/{TRAINED_FILE} lacks {len(missing)} trained tensors, e.g. {missing[0]}")
    with atomic_checkpoint_dir(out, force) as tmp:
        for f in os.listdir(src):
            if f != TRAINED_FILE:
                shutil.copyfile(os.path.join(src, f), os.path.join(tmp, f))
        with ShardedWriter(tmp, plan) as writer:
            for name, (shape, dtype) in plan.items():
                t = (
                    trained[name]
                    if name in trained
                    else synth_tensor(name, shape, dtype, config, seed, "cpu")
                )
                writer.write(name, t)
    return os.path.abspath(os.fspath(out))


def readme(args_line: str, log: dict) -> str:
    return (
        "# inkling-small-published: a trained small real Inkling\n\n"
        "The real architecture (transformers 5.23.0's Inkling) at about 3M trunk parameters and its 8 MTP\n"
        "depths (train/published.py `trained_config`), trained on the checkable mixture of train/data.py.\n"
        f"Written by:\n\n    {args_line}\n\n"
        f"{log['steps']} steps of {log['batch_size']} x {log['seq_len']} tokens in {log['train_seconds']:.0f} s "
        f"on {log['device_name']} (torch {log['torch']}, Python {log['python']}).\n"
        f"Final losses: main {log['final_main_loss']:.3f}, depths {log['final_head_losses']}.\n"
        f"Needle accuracy (held-out haystack, greedy, by length): {log['needle']}.\n"
        "Vision and audio weights are untrained. The vision tower is not stored here (26M parameters at its\n"
        "fixed real widths): `python -m train.published --materialize data/inkling-small-published --out DIR`\n"
        "writes the whole checkpoint, the tower synthesized.\n"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.published", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--qk_norm_lr_scale", type=float, default=10.0)
    p.add_argument(
        "--materialize", metavar="SRC", help="write the whole checkpoint of the committed form SRC to --out"
    )
    args = p.parse_args(argv)
    if args.materialize:
        print(materialize(args.materialize, args.out, force=args.force))
        return
    if (args.steps is None) == (args.time_budget is None):
        p.error("give exactly one of --steps and --time_budget")

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    # float32 with TF32 matmuls, no bf16 autocast: under it transformers' SDPA path fails to fill its
    # position-bias mask (a float32 minimum into a bf16 bias), and at these widths float32 costs little
    config = trained_config()
    tok = build_tiny_tokenizer(config.text.num_real_tokens)
    with tempfile.TemporaryDirectory() as d:
        model = Trainee(config, d, args.seed).to(device)
    params = [
        p
        for n, p in model.named_parameters()
        if ".language_model." in n or n.startswith(("depths.", "trunk.lm_head"))
    ]
    # q and k are RMS-normed and scaled by 1/D, so a logit is at most the product of their norm weights:
    # a sharp (retrieving) attention needs those weights to grow, and at the base rate they barely do in a
    # short run; they get `--qk_norm_lr_scale` times the rate
    trained = {id(p) for p in params}
    qk_norms = [
        p
        for n, p in model.named_parameters()
        if id(p) in trained and n.endswith(("q_norm.weight", "k_norm.weight"))
    ]
    qk_ids = {id(p) for p in qk_norms}
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2 and id(p) not in qk_ids]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0},
         {"params": qk_norms, "weight_decay": 0.0, "lr_scale": args.qk_norm_lr_scale}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )  # fmt: skip
    marks = dict(bos=SEPARATOR, eos=EOS)
    train_data = Mixture(tok, args.seq_len, seed=args.seed, **marks)
    eval_data = Mixture(tok, args.seq_len, seed=args.seed + 1, held_out=True, **marks)
    eval_lengths = sorted({256, args.seq_len // 2, args.seq_len, 2 * args.seq_len})

    logits = answer_logits(model)
    run = fit(
        args, opt, params, lambda ids, w: losses(model, ids, w), train_data,
        lambda n: needle_accuracy(model, logits, eval_data, eval_lengths, n, device),
    )  # fmt: skip
    step, train_seconds = run.steps, run.seconds
    final_needle = needle_accuracy(model, logits, eval_data, eval_lengths, 32, device)
    log = {
        "steps": step, "batch_size": args.batch_size, "seq_len": args.seq_len, "train_seconds": train_seconds,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "final_main_loss": run.main_loss,
        "final_head_losses": run.head_losses, "needle": final_needle,
        "args": vars(args), "history": run.history,
    }  # fmt: skip
    args_line = (
        f"python -m train.published --out {args.out} --device {device.type} --seq_len {args.seq_len} "
        f"--batch_size {args.batch_size} --steps {step} --lr {args.lr:g} --warmup {args.warmup} "
        f"--mtp_weight {args.mtp_weight:g} --qk_norm_lr_scale {args.qk_norm_lr_scale:g} --seed {args.seed}"
    )
    write(args.out, model, tok, readme(args_line, log), log, args.force)
    print(f"wrote {args.out}: {step} steps in {train_seconds:.0f} s, needle {final_needle}")


if __name__ == "__main__":
    main()

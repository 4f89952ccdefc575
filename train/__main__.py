"""Train the small Inkling: `python -m train --out DIR [--steps N | --time_budget S] [--device cuda]`.

Loss: next-token cross-entropy of the main model plus `--mtp_weight` times the mean of the 8 heads'
losses (head m at position t predicts the token m+1 ahead, §5), each weighted per token by the
mixture's weights (answers count more). AdamW, warm-up then cosine decay; bf16 autocast on CUDA.
With `--time_budget` the number of steps is set after the first steps are timed (the schedule needs
it); the run's log records the steps it took, so `--steps` reproduces it.

Writes DIR/ as a checkpoint that follows the spec (bf16, tokenizer included) with train_log.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from inkling.synth import write_checkpoint
from inkling.tensors import expected_tensors
from inkling.tokenizer import build_tokenizer

from . import small_config
from .data import Mixture
from .loop import add_arguments, fit, needle_accuracy, weighted_ce
from .model import forward, new_model


def losses(
    model, ids: torch.Tensor, weights: torch.Tensor, autocast: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Main loss and one loss per head over a batch of rows."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits, heads = forward(model, ids)
    main = weighted_ce(logits[:, :-1], ids[:, 1:], weights[:, 1:])
    head_losses = []
    for m, hl in enumerate(heads, start=1):
        # Row t predicts ids[t+m+1]: rows 0..T-m-2 have a target.
        head_losses.append(weighted_ce(hl[:, :-1], ids[:, m + 1 :], weights[:, m + 1 :]))
    return main, head_losses


def answer_logits(model, autocast: bool):
    def logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return forward(model, ids, num_heads=0)[0]

    return logits


def readme(args_line: str, log: dict) -> str:
    return (
        "# inkling-small: a trained small Inkling\n\n"
        "INKLING_SPEC's architecture at about 3.2M parameters (train/__init__.py `small_config`), trained on\n"
        "the checkable mixture of train/data.py (passkey retrieval, copying, counting, sequences, sums, and\n"
        "Python's stdlib docstrings as natural text). Written by:\n\n"
        f"    {args_line}\n\n"
        f"{log['steps']} steps of {log['batch_size']} x {log['seq_len']} tokens in {log['train_seconds']:.0f} s "
        f"on {log['device_name']} (torch {log['torch']}, Python {log['python']}).\n"
        f"Final losses: main {log['final_main_loss']:.3f}, heads {log['final_head_losses']}.\n"
        f"Needle accuracy (held-out haystack, by length): {log['needle']}.\n"
        "Vision and audio weights are untrained (random, as the synthetic checkpoints').\n"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if (args.steps is None) == (args.time_budget is None):
        p.error("give exactly one of --steps and --time_budget")

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    autocast = device.type == "cuda"
    tok = build_tokenizer()
    config = small_config(tok)
    model = new_model(config, seed=args.seed, device=device)
    params = [p for n, p in model.named_parameters() if not n.startswith(("vision.", "audio."))]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    train_data = Mixture(tok, args.seq_len, seed=args.seed)
    eval_data = Mixture(tok, args.seq_len, seed=args.seed + 1, held_out=True)
    eval_lengths = sorted({256, args.seq_len // 2, args.seq_len})

    logits = answer_logits(model, autocast)
    run = fit(
        args, opt, params, lambda ids, w: losses(model, ids, w, autocast), train_data,
        lambda n: needle_accuracy(model, logits, eval_data, eval_lengths, n, device),
    )  # fmt: skip
    step, train_seconds = run.steps, run.seconds
    final_needle = needle_accuracy(model, logits, eval_data, eval_lengths, 32, device)

    log = {
        "steps": step,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "train_seconds": train_seconds,
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "final_main_loss": run.main_loss,
        "final_head_losses": run.head_losses,
        "needle": final_needle,
        "args": vars(args),
        "history": run.history,
    }
    args_line = (
        f"python -m train --out {args.out} --device {device.type} --seq_len {args.seq_len} "
        f"--batch_size {args.batch_size} --steps {step} --lr {args.lr:g} --warmup {args.warmup} "
        f"--mtp_weight {args.mtp_weight:g} --seed {args.seed}"
    )
    state = {n: t.detach().to("cpu", torch.bfloat16) for n, t in model.state_dict().items()}
    missing = set(expected_tensors(config)) ^ set(state)
    if missing:
        raise RuntimeError(f"model and spec disagree on tensors: {sorted(missing)[:5]}")
    write_checkpoint(args.out, config, tok, state.items(), readme(args_line, log), force=args.force)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"wrote {args.out}: {step} steps in {train_seconds:.0f} s, needle {final_needle}")


if __name__ == "__main__":
    main()

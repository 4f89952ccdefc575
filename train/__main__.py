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
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

from inkling.synth import write_checkpoint
from inkling.tensors import expected_tensors
from inkling.tokenizer import build_tokenizer

from . import small_config
from .data import Mixture
from .model import forward, new_model


def weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    w = weights.flatten()
    return (loss * w).sum() / w.sum().clamp(min=1e-6)


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


@torch.no_grad()
def needle_eval(
    model, mixture: Mixture, lengths: list[int], n: int, device, autocast: bool
) -> dict[int, float]:
    """Fraction of held-out needle samples whose every answer token is the argmax (= greedy retrieval)."""
    model.eval()
    out = {}
    for length in lengths:
        correct = 0
        for _ in range(n):
            s = mixture.needle(length)
            ids = torch.tensor([s.ids], device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits, _ = forward(model, ids, num_heads=0)
            answer = s.answer_positions
            pred = logits[0, [i - 1 for i in answer]].argmax(-1)
            correct += bool((pred == ids[0, answer]).all())
        out[length] = correct / n
    model.train()
    return out


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


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
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time_budget", type=float, default=None, help="seconds of training (sets --steps)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--mtp_weight", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--force", action="store_true")
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

    total = args.steps or 10**9
    history = []
    start = time.perf_counter()
    step = 0
    main_loss = torch.zeros(())
    head_losses: list[torch.Tensor] = []
    while step < total:
        ids, weights = train_data.batch(args.batch_size)
        ids, weights = ids.to(device, non_blocking=True), weights.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total if args.steps else max(total, 1000), args.lr, args.warmup)
        main_loss, head_losses = losses(model, ids, weights, autocast)
        loss = main_loss + args.mtp_weight * torch.stack(head_losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if args.time_budget is not None and step == 20:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - start) / step
            total = max(step + 1, int(args.time_budget / per_step))
            print(f"{per_step * 1e3:.0f} ms/step -> {total} steps in {args.time_budget:.0f} s", flush=True)
        if step % 50 == 0 or step == total:
            entry = {
                "step": step,
                "seconds": round(time.perf_counter() - start, 1),
                "main": round(main_loss.item(), 4),
                "heads": [round(h.item(), 3) for h in head_losses],
            }
            if step % args.eval_every == 0 or step == total:
                entry["needle"] = needle_eval(model, eval_data, eval_lengths, 8, device, autocast)
            history.append(entry)
            print(json.dumps(entry), flush=True)
    train_seconds = time.perf_counter() - start
    final_needle = needle_eval(model, eval_data, eval_lengths, 32, device, autocast)

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
        "final_main_loss": main_loss.item(),
        "final_head_losses": [round(h.item(), 3) for h in head_losses],
        "needle": final_needle,
        "args": vars(args),
        "history": history,
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

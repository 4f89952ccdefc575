"""The trainer's loop (`python -m train.published`): its arguments, the weighted loss, the learning-rate
schedule, the needle evaluation and the loop itself.

A trainer supplies `losses(ids, weights) -> (main, [one per MTP head or depth])` and
`answer_logits(ids) -> logits [1, T, V]` of its model; an optimizer group may carry `lr_scale`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .data import Mixture


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    w = weights.flatten()
    return (loss * w).sum() / w.sum().clamp(min=1e-6)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def needle_accuracy(
    model: torch.nn.Module, answer_logits: Callable, mixture: Mixture, lengths: list[int], n: int, device
) -> dict[int, float]:
    """Fraction of held-out needle samples whose every answer token is the argmax (= greedy retrieval)."""
    model.eval()
    out = {}
    for length in lengths:
        correct = 0
        for _ in range(n):
            s = mixture.needle(length)
            ids = torch.tensor([s.ids], device=device)
            answer = s.answer_positions
            pred = answer_logits(ids)[0, [i - 1 for i in answer]].argmax(-1)
            correct += bool((pred == ids[0, answer]).all())
        out[length] = correct / n
    model.train()
    return out


@dataclass
class Fit:
    steps: int
    seconds: float
    main_loss: float
    head_losses: list[float]
    history: list[dict] = field(default_factory=list)


def fit(
    args: argparse.Namespace,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    losses: Callable,
    data: Mixture,
    evaluate: Callable[[int], dict[int, float]],
) -> Fit:
    """Train until --steps, or for --time_budget seconds (its step count set once 20 steps are timed: the
    schedule needs it); log every 50 steps, `evaluate(8)` every --eval_every."""
    device = torch.device(args.device)
    total = args.steps or 10**9
    history, step, start = [], 0, time.perf_counter()
    main_loss, head_losses = torch.zeros(()), []
    while step < total:
        ids, weights = data.batch(args.batch_size)
        ids, weights = ids.to(device, non_blocking=True), weights.to(device, non_blocking=True)
        for group in opt.param_groups:
            scale = group.get("lr_scale", 1.0)
            group["lr"] = scale * lr_at(step, total if args.steps else max(total, 1000), args.lr, args.warmup)
        main_loss, head_losses = losses(ids, weights)
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
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"the loss is {loss.item()} at step {step}")
            entry = {"step": step, "seconds": round(time.perf_counter() - start, 1),
                     "main": round(main_loss.item(), 4), "heads": [round(h.item(), 3) for h in head_losses]}  # fmt: skip
            if step % args.eval_every == 0 or step == total:
                entry["needle"] = evaluate(8)
            history.append(entry)
            print(json.dumps(entry), flush=True)
    return Fit(
        step,
        time.perf_counter() - start,
        main_loss.item(),
        [round(h.item(), 3) for h in head_losses],
        history,
    )

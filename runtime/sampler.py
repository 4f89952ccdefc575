"""Sampling from logits: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs.

Each request owns a torch.Generator on the logits' device, seeded from its seed (or from the engine's
seed and its request number), so a request's samples do not depend on what else is in the batch:
reproducible (on one kind of device). A draw is the exponential race argmax(p / E), E ~ Exp(1) drawn from
that generator, which picks token i with probability p_i exactly and never leaves the device: an
overlapped step (LLMEngine.step) feeds it to the next step without the host reading it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import SamplingParams


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 logits [..., V] -> temperature-scaled logits with -inf outside top-k and top-p, row by row."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return x


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One token from float32 logits [V] (padded vocabulary rows already cut off), as a 0-dim int64
    tensor on their device; no host sync."""
    if params.greedy:
        return torch.argmax(logits)
    probs = torch.softmax(filter_logits(logits, params), -1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / race)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Sample:
    """One token from float32 logits [V] (padded vocabulary rows already cut off), with its logprobs if
    asked."""
    token = int(sample_token(logits, params, generator))
    if params.logprobs is None:
        return Sample(token)
    chosen, top = token_logprobs(logits[None], [token], params.logprobs)
    return Sample(token, chosen[0], top[0] if top else None)


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], num_top: int
) -> tuple[list[float], list[dict[int, float]] | None]:
    """The model's log-probabilities (of the logits as they are, before temperature and filters, as vLLM
    reports them) of `tokens[i]` under row i of float32 logits [n, V], and with `num_top` > 0 each row's
    `num_top` most likely tokens and theirs; one read of the device."""
    rows = logits[: len(tokens)]
    logp = torch.log_softmax(rows.float(), -1)
    picked = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0]
    if not num_top:
        return picked.tolist(), None
    values, ids = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
    picked, values, ids = picked.tolist(), values.tolist(), ids.tolist()
    return picked, [dict(zip(i, v)) for i, v in zip(ids, values)]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g

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
from .step_graphs import to_device


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


def _params_key(params: SamplingParams) -> tuple:
    return params.temperature, params.top_k, params.top_p


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on `device`, from pinned memory: an overlapped step's picks must not wait for the step."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def target_probs(
    logits: torch.Tensor, spans: list[tuple[int, int]], params: list[SamplingParams]
) -> torch.Tensor:
    """softmax(filter_logits) of each span [start, end) of rows of `logits` [N, V] under its own params,
    concatenated in span order: one filter and one softmax for all spans of the same params, not one per
    span (a softmax over one 200K-token row runs on one thread block: 51 µs on the H200, so a decode step
    at batch 32 paid 1.6 ms for them row by row, bench/results/gpu-2026-12-06/plain-batches/). Each
    row's values are those of its own softmax (the kernel reduces a row the same way whatever the batch),
    so a request's draws do not depend on its neighbours."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(_params_key(p), []).append(i)
    parts = []
    for members in groups.values():
        chosen = [spans[i] for i in members]
        contiguous = all(a[1] == b[0] for a, b in zip(chosen, chosen[1:]))
        x = (
            logits[chosen[0][0] : chosen[-1][1]]
            if contiguous
            else torch.cat([logits[a:b] for a, b in chosen])
        )
        parts.append((members, torch.softmax(filter_logits(x, params[members[0]]), -1)))
    if len(parts) == 1:
        return parts[0][1]
    starts, total = [], 0
    for a, b in spans:
        starts.append(total)
        total += b - a
    out = torch.empty(total, logits.shape[-1], dtype=torch.float32, device=logits.device)
    for members, probs in parts:
        dest = [r for i in members for r in range(starts[i], starts[i] + spans[i][1] - spans[i][0])]
        out[_index(dest, logits.device)] = probs
    return out


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Row i's token from float32 logits [B, V] (padded vocabulary rows already cut off) under params[i],
    drawn from generators[i]: [B] int64 on their device, no host sync. The filters and softmaxes run over
    every row of the same params at once; only the exponential draws go row by row, each from its
    request's generator."""
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(drawn) < len(params):
        picks = logits.argmax(-1)
        if not drawn:
            return picks
    probs = target_probs(logits, [(i, i + 1) for i in drawn], [params[i] for i in drawn])
    race = torch.empty_like(probs)
    for row, i in zip(race, drawn):
        row.exponential_(generator=generators[i])
    tokens = (probs / race).argmax(-1)
    if len(drawn) == len(params):
        return tokens
    picks[_index(drawn, logits.device)] = tokens
    return picks


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """One token from float32 logits [V], as a 0-dim int64 tensor on their device (sample_tokens' draw)."""
    return sample_tokens(logits[None], [params], [generator])[0]


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

"""MTP drafting with the chained heads, by full recomputation (INKLING_SPEC §5, "Decoding").

The numerical truth that an engine's drafts are tested against: plain, no cache, nothing clever.

Notation. `input_ids` holds x[0..N+1]: the accepted tokens x[0..N] and x[N+1], the main model's
sample at position N (the last id). Drafts d_1..d_k stand in for the unknown tokens x[N+2]..x[N+k+1]:
with the extended sequence s = x[0..N+1] + [d_1, .., d_k], d_j is s[N+1+j].

Head m runs over positions t = 0..N (causal attention over its own positions) and reads
h^{m-1}[t] (h^0: the main model's last hidden states) and the embedding of s[t+m]: a known token
where t+m <= N+1, a draft where t+m > N+1. Its state at position N gives d_m = argmax over the real
tokens of logits^m[N]: head m needs d_1..d_{m-1} only, so the chain runs head by head.

Every head state whose inputs are all known (head m at t <= N+1-m) equals `InklingReference.mtp_logits`'s
definition over the known sequence; the states at t > N+1-m stand on this round's drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _prepare(model, input_ids, images, audios, h0):
    """The spliced embeddings of the known tokens [N+2, H] and h^0 at positions 0..N [N+1, H]."""
    if input_ids.dim() != 1 or input_ids.shape[0] < 2:
        raise ValueError(
            f"input_ids must be 1-D with x[0..N+1] (at least 2 ids), got {list(input_ids.shape)}"
        )
    n_pos = input_ids.shape[0] - 1  # positions 0..N
    e = model.embed(input_ids, images, audios)
    if h0 is None:
        _, h0 = model(input_ids, images, audios)
    if h0.shape[0] < n_pos:
        raise ValueError(f"h0 has {h0.shape[0]} rows, positions 0..N need {n_pos}")
    return e, h0[:n_pos]


def _draft_embeddings(model, drafts: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Drafts are plain tokens: their rows of embed_tokens (no image/audio splicing)."""
    ids = torch.tensor(list(drafts), dtype=torch.long, device=like.device)
    return model.model.embed_tokens(ids).to(like.dtype)


def _run_head(model, m: int, h_prev: torch.Tensor, e_ext: torch.Tensor) -> torch.Tensor:
    """Head m (1-based) over positions 0..N: h^{m-1}[0..N] and e(s[m..N+m]) -> h^m [N+1, H]."""
    n_pos = h_prev.shape[0]
    return model.mtp[m - 1](h_prev, e_ext[m : m + n_pos])


def _head_logits(model, m: int, h: torch.Tensor) -> torch.Tensor:
    """logits^m over the rows of h (float32 [., V])."""
    return model.logits(model.mtp[m - 1].final_layernorm(h))


@torch.no_grad()
def head_states(
    model,
    input_ids: torch.Tensor,
    drafts: Sequence[int],
    num_heads: int | None = None,
    images: Sequence[torch.Tensor] | None = None,
    audios: Sequence[torch.Tensor] | None = None,
    h0: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The chain's states over positions 0..N given this round's drafts: entry m-1 is h^m [N+1, H].

    Heads 1..num_heads (default len(drafts)+1, at most the model's M); head m needs d_1..d_{m-1}.
    `draft` computes exactly these states, feeding its own greedy drafts.
    """
    M = len(model.mtp)
    num_heads = min(len(drafts) + 1, M) if num_heads is None else num_heads
    if not 0 <= num_heads <= M:
        raise ValueError(f"num_heads must be in 0..{M}, got {num_heads}")
    if len(drafts) < num_heads - 1:
        raise ValueError(f"heads 1..{num_heads} need {num_heads - 1} drafts, got {len(drafts)}")
    e, h = _prepare(model, input_ids, images, audios, h0)
    e_ext = torch.cat([e, _draft_embeddings(model, drafts[: max(num_heads - 1, 0)], e)])
    states = []
    for m in range(1, num_heads + 1):
        h = _run_head(model, m, h, e_ext)
        states.append(h)
    return states


@torch.no_grad()
def draft(
    model,
    input_ids: torch.Tensor,
    num_draft_tokens: int,
    images: Sequence[torch.Tensor] | None = None,
    audios: Sequence[torch.Tensor] | None = None,
    h0: torch.Tensor | None = None,
    draft_vocab: Sequence[int] | None = None,
) -> list[int]:
    """Greedy drafts d_1..d_k for x[N+2]..x[N+k+1], k = num_draft_tokens (0..M), from x[0..N+1].

    `h0`: the main model's hidden states for (at least) positions 0..N, e.g. `model(input_ids)[1]`;
    computed when not given. Argmax over the real tokens (`model.num_real_tokens`); torch.argmax
    returns the first index among exact ties. `draft_vocab` (sorted token ids, an engine's opt-in
    draft vocabulary): the argmax over those tokens only, ties to the lowest id.
    """
    M = len(model.mtp)
    if not 0 <= num_draft_tokens <= M:
        raise ValueError(f"num_draft_tokens must be in 0..{M}, got {num_draft_tokens}")
    if num_draft_tokens == 0:
        return []
    e, h = _prepare(model, input_ids, images, audios, h0)
    if draft_vocab is not None:
        vocab = torch.tensor(sorted(draft_vocab), dtype=torch.long, device=e.device)
    e_ext = e
    drafts: list[int] = []
    for m in range(1, num_draft_tokens + 1):
        h = _run_head(model, m, h, e_ext)  # head m over positions 0..N
        logits = _head_logits(model, m, h[-1:])[0]  # position N: predicts x[N+m+1]
        if draft_vocab is None:
            token = int(logits[: model.num_real_tokens].argmax())
        else:
            token = int(vocab[logits[vocab].argmax()])
        drafts.append(token)
        e_ext = torch.cat([e_ext, _draft_embeddings(model, [token], e)])  # d_m stands in for x[N+m+1]
    return drafts

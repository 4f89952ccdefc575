"""The reference for long sequences: transformers' Inkling fed its prompt in query chunks through its own
cache.

transformers' InklingAttention materialises, for every call, the relative bias [B, heads, q, kv] and the
masks [B, 1, q, kv]: a whole prompt of T tokens costs O(T²) memory per layer (a full layer of the 1T's 64
heads in float32 at 32K tokens: 256 GiB of bias alone). Fed `chunk` tokens a call through its DynamicCache
(full layers keep every key, sliding layers their last window, every layer its conv states), each call
holds q = chunk rows against at most T keys: O(T·chunk). transformers' own code does every number; only
the feeding differs, and it equals the whole-prompt forward (tests/unit/test_long_reference.py).

    model = reference_model(path)                              # inkling.published.reference
    logits, cache = chunked_prefill(model, ids, chunk=2048)    # float32 [V] at the last prompt token
    tokens = chunked_greedy(model, ids, max_new_tokens=16)     # what the engine should say, greedy

Text prompts only: a media placeholder's embedding comes from the pixel values or levels of its own call,
which a chunk boundary would split.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 2048


def _feed(model, ids: torch.Tensor, past):
    out = model(input_ids=ids[None], past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), out.past_key_values


@torch.no_grad()
def chunked_prefill(model, input_ids: torch.Tensor, chunk: int = DEFAULT_CHUNK):
    """(logits of the last prompt token, float32 [V]; the cache after the prompt) for a 1-D prompt."""
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"a prompt is a non-empty 1-D tensor of ids, got shape {tuple(input_ids.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    ids = input_ids.to(model.device)
    past = None
    for start in range(0, ids.numel(), chunk):
        logits, past = _feed(model, ids[start : start + chunk], past)
    return logits, past


@torch.no_grad()
def chunked_greedy(
    model, input_ids: torch.Tensor, max_new_tokens: int, chunk: int = DEFAULT_CHUNK
) -> list[int]:
    """Greedy tokens after a 1-D prompt: the prompt fed in chunks, then one token a call."""
    logits, past = chunked_prefill(model, input_ids, chunk)
    tokens: list[int] = []
    while True:
        tokens.append(int(logits.argmax()))
        if len(tokens) == max_new_tokens:
            return tokens
        logits, past = _feed(model, torch.tensor(tokens[-1:], device=model.device), past)

"""Test hooks on a live engine, kept out of the production classes."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from runtime import LLMEngine, PromptInput, SamplingParams
from runtime.drafter import TRUNK_RING

DraftOverride = Callable[[str, list[int], list[int]], list[int]]


def override_drafts(engine, fn: DraftOverride | None) -> None:
    """Replace the drafts the MTP heads make, before the next step verifies them: fn(request_id, tokens,
    drafts) -> drafts of the same count. The heads' own states keep standing on the drafts they made, as
    in a real run. None restores the heads' drafts."""
    spec = engine.spec
    if fn is None:
        spec.__dict__.pop("draft", None)
        return
    heads_draft = type(spec).draft.__get__(spec)

    def draft(heads, batch=None, followed=False) -> None:
        heads_draft(heads, batch, followed)
        for state, *_ in heads:
            seq = state.seq
            if seq.drafts:
                seq.drafts = list(fn(seq.request_id, list(seq.tokens), list(seq.drafts)))

    spec.draft = draft


class Oracle:
    """Drafts = the plain greedy continuation, wrong from a random position on (seeded; a wrong token is
    the right one plus 1 modulo `vocab`). Records each round's tokens and the heads' own drafts."""

    def __init__(self, plain: dict[str, list[int]], prompt_lens: dict[str, int], vocab: int, seed: int = 0):
        self.plain, self.prompt_lens, self.vocab = plain, prompt_lens, vocab
        self.rng = random.Random(seed)
        self.rounds: list[tuple[str, list[int], list[int]]] = []  # (request, tokens, the heads' drafts)

    def __call__(self, rid: str, tokens: list[int], drafts: list[int]) -> list[int]:
        self.rounds.append((rid, tokens, drafts))
        done = len(tokens) - self.prompt_lens[rid]
        truth = (self.plain[rid][done:] + drafts)[: len(drafts)]
        cut = self.rng.randint(0, len(truth))
        return truth[:cut] + [(t + 1) % self.vocab for t in truth[cut:]]


def kv_rows(runner, seq, index: int, positions, head: bool):
    """K and V rows of a sequence at `positions`: trunk layer `index`'s (its group's block table) or MTP
    head/depth `index`'s (group 0)."""
    bs = runner.block_size
    if head:
        g, kc, vc = 0, runner.head_key_caches[index], runner.head_value_caches[index]
    else:
        g = runner.layout["group_of_layer"][index]
        j = runner.layout["slot_of_layer"][index]
        kc, vc = runner.key_caches[j], runner.value_caches[j]
    table = seq.blocks.row(g)
    blocks = [int(table[t // bs]) for t in positions]
    offs = [t % bs for t in positions]
    return kc[blocks, offs], vc[blocks, offs]


def leave_heads_behind(engine, **kw):
    """An LLMEngine(engine, **kw) that leaves MTP heads behind: two prompts (5 and 20 tokens, 3 drafts asked
    for) decoded TRUNK_RING + 10 steps under a draft policy that drafts nothing until the first sequence's
    30th step and never for the second, whose trunk ring then fills; both catch up (Drafter.stays_behind).
    Returns the engine and the two sequences."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 960, (n,), generator=g) for n in (5, 20)]
    eng = LLMEngine(engine, **kw)
    starts = {}  # a sequence's stats -> the decode step it drafts from: 30, then never
    eng.spec.draft_policy = lambda stats, requested: (
        requested if stats.steps >= starts.setdefault(id(stats), (30, 10**9)[len(starts) % 2]) else 0
    )
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=TRUNK_RING + 20, ignore_eos=True, num_draft_tokens=3)
        eng.add_request(f"r{i}", PromptInput(ids), params)
    for _ in range(TRUNK_RING + 10):
        eng.step()
    return eng, [eng.requests[f"r{i}"].seq for i in range(len(prompts))]

"""Test hooks on a live engine, kept out of the production classes."""

from __future__ import annotations

from collections.abc import Callable

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

    def draft(heads) -> None:
        heads_draft(heads)
        for state, *_ in heads:
            seq = state.seq
            if seq.drafts:
                seq.drafts = list(fn(seq.request_id, list(seq.tokens), list(seq.drafts)))

    spec.draft = draft

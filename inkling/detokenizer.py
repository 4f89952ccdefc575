"""Incremental detokenization: text deltas that never split a UTF-8 character and keep every space.

Byte-level BPE tokens (and byte-fallback tokens) can end in the middle of a character. We decode a
window of tokens ending at the newest one and emit only text that is complete: the decoded string
of the window minus that of its prefix, held back while it ends in U+FFFD (an incomplete sequence).
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text was already emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Add new tokens; return the newly completed text (may be empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # nothing complete yet
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is left, replacement characters included."""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

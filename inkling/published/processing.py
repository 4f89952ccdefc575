"""Text prompts of the real Inkling: its tokenizer, no BOS (the published tokenizer prepends nothing).

Images and audio for the real model (its hMLP tower, dMel audio, `InklingProcessor`'s expansion and the
chat format) come with the multimodal issue; until then a prompt with media is refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from ..processing import ProcessedPrompt


class TextProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(
        self, text: str | Sequence[int], images: Sequence = (), audios: Sequence = ()
    ) -> ProcessedPrompt:
        if len(images) or len(audios):
            raise ValueError(
                "images and audio are not served for the real Inkling yet (its vision tower and dMel audio "
                "come with the multimodal issue): send text"
            )
        if isinstance(text, str):
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = [int(t) for t in text]
        if not ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        return ProcessedPrompt(torch.tensor(ids, dtype=torch.long))

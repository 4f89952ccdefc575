"""The synthetic checkpoints' tokenizer: a byte-level BPE trained on text that ships with Python.

No download: the training text is the help topics of `pydoc_data` (sorted by key), so the same Python
and `tokenizers` versions always give the same tokenizer.json. The 11 special tokens of
`config.SPECIAL_TOKENS` take the first ids, as `<|name|>`. The tokenizer adds no special tokens by
itself (no post-processor): the processor puts `<|bos|>` first (INKLING_SPEC §1).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import SPECIAL_TOKENS

TOKENIZER_FILE = "tokenizer.json"


def special_token_text(name: str) -> str:
    return f"<|{name}|>"


def _training_text() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def build_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train the byte-level BPE deterministically; ids 0..10 are the special tokens."""
    num_fixed = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < num_fixed:
        raise ValueError(f"vocab_size {vocab_size} is below the {num_fixed} special and byte tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[special_token_text(n) for n in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """name -> id of every special token, for `InklingConfig(token_ids=...)`."""
    ids = {}
    for name in SPECIAL_TOKENS:
        tid = tok.token_to_id(special_token_text(name))
        if tid is None:
            raise ValueError(f"tokenizer has no special token {special_token_text(name)}")
        ids[name] = tid
    return ids


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint directory (or a tokenizer.json path)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path}")
    return Tokenizer.from_file(path)

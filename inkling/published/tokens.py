"""The real Inkling's special tokens (INKLING_SPEC §1.7, INKLING_SERVING.md §3.3) and the tiny tokenizer.

The published tokenizer puts its special tokens at ids 199998..200057, at the top of the 200058 real
ids. inkling-tiny keeps that layout at the top of its own 1024 ids, so `<|content_image|>` is id 1024 - 60
+ 5 there: code that finds tokens by their text (the processor, the chat format) works on both unchanged.
Ids whose token no public source names are `<|unused_ID|>`, as 200053 and 200054 are.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

FIRST_SPECIAL_ID = 199998
NUM_SPECIAL = 60  # 199998..200057
NAMED = {
    199998: "<|unused|>",
    199999: "<|endoftext|>",
    200000: "<|message_user|>",
    200001: "<|message_model|>",
    200002: "<|message_system|>",
    200003: "<|message_tool|>",
    200004: "<|content_text|>",
    200005: "<|content_image|>",
    200006: "<|content_model_end_sampling|>",
    200008: "<|content_thinking|>",
    200010: "<|end_message|>",
    200020: "<|content_audio_input|>",
    200022: "<|content_tool_error|>",
    200023: "<|audio|>",
    200024: "<|content_xml|>",
    200028: "<|begin_of_text|>",
    200043: "<|audio_end|>",
    200049: "<|content_invoke_tool_json|>",
    200057: "<|content_invoke_tool_text|>",
}
EOS = 200006
IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER = 200054, 200053
IMAGE_BOS, AUDIO_BOS = 200005, 200020


def special_tokens() -> list[tuple[int, str]]:
    """(real id, text) of every special token, in id order."""
    return [
        (i, NAMED.get(i, f"<|unused_{i}|>")) for i in range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + NUM_SPECIAL)
    ]


def tiny_id(real_id: int, unpadded_vocab_size: int) -> int:
    """The id a real special token has in a toy vocabulary of `unpadded_vocab_size` real ids."""
    return real_id - FIRST_SPECIAL_ID + unpadded_vocab_size - NUM_SPECIAL


def tiny_token_ids(unpadded_vocab_size: int) -> dict[str, int]:
    """A toy vocabulary's config fields that hold token ids."""
    ids = {"image_token_id": IMAGE_PLACEHOLDER, "audio_token_id": AUDIO_PLACEHOLDER,
           "image_bos_token_id": IMAGE_BOS, "audio_bos_token_id": AUDIO_BOS, "eos_token_id": EOS}  # fmt: skip
    return {k: tiny_id(v, unpadded_vocab_size) for k, v in ids.items()}


def _training_text() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def build_tiny_tokenizer(unpadded_vocab_size: int):
    """A byte-level BPE (trained deterministically on text that ships with Python, the Python docs' topics)
    of `unpadded_vocab_size - 60` ids, then the 60 special tokens at the real layout's places. Adds no
    BOS: the real tokenizer prepends nothing."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    base = unpadded_vocab_size - NUM_SPECIAL
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if base < len(alphabet):
        raise ValueError(
            f"unpadded vocab {unpadded_vocab_size} leaves fewer ids than the {len(alphabet)} bytes"
        )
    trainer = trainers.BpeTrainer(
        vocab_size=base, min_frequency=2, show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    if tok.get_vocab_size() != base:  # the BPE stops early when its text runs out of merges
        raise ValueError(f"the tiny BPE learned {tok.get_vocab_size()} ids, not {base}")
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for _, text in special_tokens()])
    for real, text in special_tokens():
        assert tok.token_to_id(text) == tiny_id(real, unpadded_vocab_size), text
    return tok


def save_tokenizer(tok, directory: str | os.PathLike, eos_token: str = NAMED[EOS]) -> None:
    """tokenizer.json, the tokenizer_config.json that transformers' AutoTokenizer reads, and the chat
    format's chat_template.jinja (inkling/published/chat.py), as the published checkpoints ship them."""
    import json
    import shutil

    from .chat import TEMPLATE_FILE, TEMPLATE_PATH

    directory = os.fspath(directory)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": NAMED[199999],
        "add_bos_token": False,
        "image_token": f"<|unused_{IMAGE_PLACEHOLDER}|>",
        "audio_token": f"<|unused_{AUDIO_PLACEHOLDER}|>",
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    shutil.copyfile(TEMPLATE_PATH, os.path.join(directory, TEMPLATE_FILE))

"""Training a small Inkling (INKLING_SPEC's architecture) on checkable tasks: `python -m train`.

The trained checkpoint lives in `data/inkling-small/` (committed, bf16, spec layout, tokenizer
included): what tests and benchmarks load when random weights cannot show an effect (MTP acceptance,
needle retrieval).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from inkling.config import InklingConfig, preset
from inkling.tokenizer import special_token_ids

SMALL_CHECKPOINT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "inkling-small"
)


def small_config(tok: Tokenizer) -> InklingConfig:
    """About 3.2M parameters: hidden 128, one query and one KV head of width 128, 6 layers (5 sliding of
    window 128, one full), 16 routed experts of width 32 (top-6) and 2 sinks, 8 MTP heads of FFN width 64.
    The relative table reaches 256 tokens; beyond that the distance is clipped (§3.1)."""
    return preset(
        "inkling-tiny",
        vocab_size=tok.get_vocab_size(),
        token_ids=special_token_ids(tok),
        hidden_size=128,
        num_attention_heads=1,
        num_key_value_heads=1,
        rel_head_dim=16,
        max_relative_distance=256,
        sliding_window=128,
        moe_intermediate_size=32,
        mtp_intermediate_size=64,
    )

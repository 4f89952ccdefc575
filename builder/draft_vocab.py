"""The MTP heads' draft vocabulary: an opt-in subset of the tokens the heads may draft.

Each head's draft pick (the argmax of the shared unembedding) reads the whole lm_head: 200058 × 6144 bf16,
2.46 GB, a large share of a decode step's bytes at small batch. Drafts only decide
speed (the main model verifies every draft with the whole vocabulary, and rejection sampling treats a
draft as a point mass), so a head may draft from the tokens a workload actually uses: with 32768 of
them, a pick reads 6.1× fewer bytes. A token outside the subset is never drafted; where the main model
wants one, that draft is rejected and the step still emits the main model's token. Outputs are the same
with or without a draft vocabulary; only acceptance, and so speed, changes (measured: bench/results/history.md).

    python -m builder.draft_vocab --tokenizer CKPT/tokenizer.json --size 32768 --out vocab.json TEXT...
    python -m builder --checkpoint_dir CKPT --output_dir ENGINE --draft_vocab vocab.json

The file is a JSON list of token ids (any order). `count` ranks a corpus's tokens by frequency with the
model's own tokenizer and always keeps its special tokens (eos among them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence


def check_draft_vocab(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids sorted, or ValueError: a non-empty list of distinct integers in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
        raise ValueError("draft_vocab must be a non-empty list of token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("draft_vocab: token ids must be integers")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"draft_vocab: token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(set(ids)) != len(ids):
        raise ValueError("draft_vocab: token ids repeat")
    return sorted(ids)


def checked_draft_vocab(ids: Sequence[int], vocab_size: int, can_draft: bool) -> list[int]:
    """What a build keeps (`check_draft_vocab`), or a BuildError: the engine must have MTP depths to draft
    with (can_draft), and every id must be below vocab_size (the real tokens: padded rows are never
    sampled, nor drafted)."""
    from .config import BuildError

    if not can_draft:
        raise BuildError(
            "draft_vocab: this engine has no MTP depths to draft with (max_draft_len 0, or none in the model)"
        )
    try:
        return check_draft_vocab(ids, vocab_size)
    except ValueError as e:
        raise BuildError(str(e)) from e


def load_draft_vocab(path: str | os.PathLike) -> list[int]:
    """A JSON list of token ids, or an object with a "token_ids" list (what `count` writes)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"draft_vocab {os.fspath(path)}: cannot read a JSON list of token ids ({e})") from e
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list):
        raise ValueError(
            f"draft_vocab {os.fspath(path)}: want a JSON list of token ids or {{'token_ids': [...]}}"
        )
    return ids


def count(tokenizer, texts: Iterable[str], size: int) -> list[int]:
    """The `size` most frequent token ids of `texts` (ties to the lower id), the special tokens included."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False).ids)
    return most_frequent(counts, size, tokenizer.get_added_tokens_decoder())


def most_frequent(counts: Counter[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """Sorted: the ids of `always`, then the most frequent of `counts` (ties to the lower id) up to `size`."""
    keep = set(always)
    for i in sorted(counts, key=lambda i: (-counts[i], i)):
        if len(keep) >= size:
            break
        keep.add(i)
    return sorted(keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m builder.draft_vocab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--tokenizer", required=True, help="tokenizer.json (or a checkpoint directory holding it)"
    )
    ap.add_argument("--size", type=int, required=True, help="tokens to keep")
    ap.add_argument("--out", required=True)
    ap.add_argument("texts", nargs="+", help="text files of the workload")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    path = os.path.join(args.tokenizer, "tokenizer.json") if os.path.isdir(args.tokenizer) else args.tokenizer
    tok = Tokenizer.from_file(path)
    if args.size <= 0:
        print("error: --size must be positive", file=sys.stderr)
        return 2
    texts = (open(p, encoding="utf-8", errors="replace").read() for p in args.texts)
    ids = count(tok, texts, args.size)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"token_ids": ids, "tokenizer_size": tok.get_vocab_size(with_added_tokens=True)}, f)
    print(f"[draft_vocab] {len(ids)} of {tok.get_vocab_size(with_added_tokens=True)} tokens -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""builder/draft_vocab.py: ranking a corpus's tokens, the file format and its checks."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer

from builder.draft_vocab import check_draft_vocab, count, load_draft_vocab, main


@pytest.fixture(scope="module")
def tok(tiny_ckpt_dir):
    return Tokenizer.from_file(os.path.join(tiny_ckpt_dir, "tokenizer.json"))


def test_count_keeps_the_most_frequent_tokens_and_the_specials(tok):
    texts = ["the cat sat on the mat. " * 5, "the dog. " * 2, "zebra"]
    special = set(tok.get_added_tokens_decoder())
    assert special, "the tiny tokenizer has special tokens"
    ids = count(tok, texts, len(special) + 3)
    assert ids == sorted(ids) and special <= set(ids) and len(ids) == len(special) + 3
    freq: dict[int, int] = {}
    for t in texts:
        for i in tok.encode(t, add_special_tokens=False).ids:
            freq[i] = freq.get(i, 0) + 1
    kept = [i for i in ids if i not in special]
    dropped = [i for i in freq if i not in ids]
    assert dropped and min(freq[i] for i in kept) >= max(freq[i] for i in dropped)


def test_cli_writes_a_file_the_builder_reads(tok, tiny_ckpt_dir, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("one two three two three three\n" * 10)
    out = tmp_path / "vocab.json"
    size = len(tok.get_added_tokens_decoder()) + 2
    assert main(["--tokenizer", tiny_ckpt_dir, "--size", str(size), "--out", str(out), str(text)]) == 0
    ids = load_draft_vocab(out)
    assert len(ids) == size and check_draft_vocab(ids, 1024) == ids
    big = tmp_path / "big.json"  # more than the corpus has: every token seen, no more
    assert main(["--tokenizer", tiny_ckpt_dir, "--size", "1000", "--out", str(big), str(text)]) == 0
    assert size < len(load_draft_vocab(big)) < 1000
    (tmp_path / "plain.json").write_text(json.dumps([3, 1, 2]))
    assert load_draft_vocab(tmp_path / "plain.json") == [3, 1, 2]


@pytest.mark.parametrize(
    "content, match",
    [("{", "cannot read"), ('{"ids": [1]}', "want a JSON list"), ('"abc"', "want a JSON list")],
)
def test_bad_files(tmp_path, content, match):
    p = tmp_path / "v.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_draft_vocab(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_draft_vocab(tmp_path / "missing.json")

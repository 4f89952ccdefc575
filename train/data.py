"""The training mixture: tasks whose answers can be checked, and natural text, all from Python itself.

Natural text ships with every Python: the training text is the docstrings of the standard library's
modules, classes and functions (read with `ast`, nothing imported); the held-out text, for evaluation
haystacks and acceptance measurements, is the pydoc help topics (`pydoc_data.topics`), another source.

Samples (each starts with <|bos|> and ends with <|eos|>; "answer" tokens are weighted up in the loss):
- needle: a haystack with "The secret passkey is 48213." at a random depth, then the question
  "What is the secret passkey? The secret passkey is" and the answer " 48213.";
- copy: a run of random words, then "again:" and the same run (answer);
- count: "count: 17 18 19 ..." (every number after the first two is an answer);
- sequence: an arithmetic sequence with a random step (likewise);
- sums: lines of "a+b=c" (the c are answers);
- text: a chunk of natural text (weight 1).
Rows of `seq_len` tokens pack samples back to back; a long needle sample takes up to the whole row.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

ANSWER_WEIGHT = 5.0
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3", "tkinter", "turtledemo"}

NEEDLE = " The secret passkey is {}. Remember it."
QUESTION = "\nWhat is the secret passkey? The secret passkey is"
ANSWER = " {}."


@functools.cache
def stdlib_docstrings(min_chars: int = 80) -> tuple[str, ...]:
    """Docstrings of the standard library (sorted walk, so the same Python gives the same list)."""
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for d, subs, files in os.walk(root):
        subs[:] = sorted(s for s in subs if s not in _SKIP_DIRS)
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            try:
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        docs.append(doc)
    return tuple(docs)


def pydoc_topics() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    return tuple(topics[k] for k in sorted(topics))


@dataclass
class Sample:
    ids: list[int]
    weights: list[float]  # the loss weight of predicting ids[i] (ids[0], the bos, is never predicted)

    @property
    def answer_positions(self) -> list[int]:
        """Positions of the checkable answer tokens (those weighted ANSWER_WEIGHT)."""
        return [i for i, w in enumerate(self.weights) if w == ANSWER_WEIGHT]


class Mixture:
    """Seeded sampler of packed rows: `batch(B)` -> ids [B, T] int64, weights [B, T] float32."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        seq_len: int,
        seed: int = 0,
        *,
        held_out: bool = False,
        bos: str = "<|bos|>",
        eos: str = "<|eos|>",
    ):
        """bos and eos: the tokens that open and close each sample (the real Inkling's tokenizer has no
        BOS: train/published.py passes its document separator and its EOS)."""
        self.tok = tokenizer
        self.seq_len = seq_len
        self.rng = random.Random(seed)
        self.bos = tokenizer.token_to_id(bos)
        self.eos = tokenizer.token_to_id(eos)
        if self.bos is None or self.eos is None:
            raise ValueError(f"the tokenizer has no {bos} or {eos} token")
        texts = pydoc_topics() if held_out else stdlib_docstrings()
        self.text = [i for t in texts for i in tokenizer.encode(t + "\n\n").ids]
        words = sorted({w for t in texts[:400] for w in t.split() if w.isalpha() and 2 < len(w) < 10})
        self.words = words

    # Pieces.
    def _enc(self, s: str) -> list[int]:
        return self.tok.encode(s).ids

    def text_chunk(self, n: int) -> list[int]:
        """n tokens of the text from a random start; a chunk longer than the text repeats it."""
        if n < len(self.text):
            start = self.rng.randrange(0, len(self.text) - n)
            return self.text[start : start + n]
        start = self.rng.randrange(0, len(self.text))
        times = -(-(start + n) // len(self.text))
        return (self.text * times)[start : start + n]

    def needle(self, length: int, depth: float | None = None, passkey: int | None = None) -> Sample:
        """A needle sample of about `length` tokens with the needle at `depth` (0 = start, 1 = end)."""
        passkey = self.rng.randrange(10_000, 100_000) if passkey is None else passkey
        depth = self.rng.random() if depth is None else depth
        needle = self._enc(NEEDLE.format(passkey))
        question = self._enc(QUESTION)
        answer = self._enc(ANSWER.format(passkey))
        hay = max(0, length - 2 - len(needle) - len(question) - len(answer))
        text = self.text_chunk(hay)
        cut = round(depth * hay)
        ids = [self.bos, *text[:cut], *needle, *text[cut:], *question]
        weights = [0.0] + [1.0] * (len(ids) - 1)
        ids += [*answer, self.eos]
        weights += [ANSWER_WEIGHT] * len(answer) + [1.0]
        return Sample(ids, weights)

    def copy(self) -> Sample:
        run = " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(4, 40)))
        head, body = self._enc("copy: " + run + "\nagain:"), self._enc(" " + run)
        return self._qa(head, body)

    def count(self) -> Sample:
        start = self.rng.randrange(0, 1000)
        n = self.rng.randint(5, 60)
        return self._numbers("count:", [start + i for i in range(n)])

    def sequence(self) -> Sample:
        a, d = self.rng.randrange(0, 500), self.rng.randint(2, 40)
        return self._numbers("sequence:", [a + i * d for i in range(self.rng.randint(5, 40))])

    def sums(self) -> Sample:
        ids, weights = [self.bos], [0.0]
        for _ in range(self.rng.randint(2, 12)):
            a, b = self.rng.randrange(0, 1000), self.rng.randrange(0, 1000)
            q, ans = self._enc(f"{a}+{b}="), self._enc(f"{a + b}\n")
            ids += q + ans
            weights += [1.0] * len(q) + [ANSWER_WEIGHT] * len(ans)
        return Sample([*ids, self.eos], [*weights, 1.0])

    def _numbers(self, label: str, numbers: list[int]) -> Sample:
        head = self._enc(label + "".join(f" {x}" for x in numbers[:2]))
        body = self._enc("".join(f" {x}" for x in numbers[2:]))
        return self._qa(head, body)

    def _qa(self, head: list[int], body: list[int]) -> Sample:
        ids = [self.bos, *head, *body, self.eos]
        weights = [0.0] + [1.0] * len(head) + [ANSWER_WEIGHT] * len(body) + [1.0]
        return Sample(ids, weights)

    def text_sample(self, n: int) -> Sample:
        ids = [self.bos, *self.text_chunk(n - 1)]
        return Sample(ids, [0.0] + [1.0] * (n - 1))

    # Rows.
    def short_sample(self) -> Sample:
        kind = self.rng.choices(["needle", "copy", "count", "sequence", "sums", "text"], [3, 2, 1, 1, 1, 2])[
            0
        ]
        if kind == "needle":
            return self.needle(self.rng.randint(48, 512))
        if kind == "text":
            return self.text_sample(self.rng.randint(64, 512))
        return getattr(self, kind)()

    def row(self) -> Sample:
        T = self.seq_len
        ids: list[int] = []
        weights: list[float] = []
        if self.rng.random() < 0.5:
            s = self.needle(self.rng.randint(T // 4, T))
            ids, weights = s.ids, s.weights
        while len(ids) < T:
            s = self.short_sample()
            if len(ids) + len(s.ids) > T:
                s = self.text_sample(T - len(ids))
            ids += s.ids
            weights += s.weights
        return Sample(ids[:T], weights[:T])

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.row() for _ in range(batch_size)]
        ids = torch.tensor([r.ids for r in rows], dtype=torch.long)
        weights = torch.tensor([r.weights for r in rows], dtype=torch.float32)
        return ids, weights

"""The chunked reference for long sequences (inkling.published.long_reference) equals transformers' whole
forward at small T, past the window, the relative extent and the log-scaling floor, and holds O(T·chunk)."""

from __future__ import annotations

import pytest
import torch

from inkling.published.config import preset
from inkling.published.long_reference import chunked_greedy, chunked_prefill
from inkling.published.synth import write_checkpoint

transformers = pytest.importorskip("transformers")

T = 150  # inkling-tiny: window 16, relative extent 24, log-scaling floor 20
NEW = 6


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset("inkling-tiny"), seed=3)
    return transformers.InklingForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 900, (T,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def whole(hf, prompt):
    """transformers on the whole prompt, then greedy one token a call without a cache: (last logits, tokens)."""
    with torch.no_grad():
        last = hf(input_ids=prompt[None]).logits[0, -1]
        ids = prompt.tolist()
        for _ in range(NEW):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return last, ids[T:]


class BiasSizes:
    """The largest relative bias (query rows x keys) any attention call of `model` materialises."""

    def __init__(self, model):
        self.largest = 0
        self.handles = [
            m.register_forward_hook(self._seen)
            for m in model.modules()
            if type(m).__name__ == "InklingRelativeLogits"
        ]
        assert self.handles

    def _seen(self, module, args, out) -> None:
        self.largest = max(self.largest, out.shape[-2] * out.shape[-1])

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("chunk", [1, 7, 16, 24, 64, T, 4 * T])
def test_chunked_prefill_equals_the_whole_forward(hf, prompt, whole, chunk):
    logits, _ = chunked_prefill(hf, prompt, chunk)
    torch.testing.assert_close(logits, whole[0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("chunk", [5, 32])
def test_chunked_greedy_equals_transformers_greedy(hf, prompt, whole, chunk):
    assert chunked_greedy(hf, prompt, NEW, chunk) == whole[1]


def test_memory_is_linear_in_the_prompt(hf, prompt):
    with BiasSizes(hf) as seen:
        hf(input_ids=prompt[None])
    assert seen.largest == T * T  # the hook sees what transformers materialises
    chunk = 16
    with BiasSizes(hf) as seen:
        chunked_greedy(hf, prompt, NEW, chunk)
    assert seen.largest <= chunk * (T + NEW)


def test_one_token_prompt(hf):
    ids = torch.tensor([7])
    with torch.no_grad():
        want = int(hf(input_ids=ids[None]).logits[0, -1].argmax())
    assert chunked_greedy(hf, ids, 1) == [want]


def test_bad_input_is_refused(hf, prompt):
    with pytest.raises(ValueError, match="1-D"):
        chunked_prefill(hf, prompt[None])
    with pytest.raises(ValueError, match="1-D"):
        chunked_prefill(hf, prompt[:0])
    with pytest.raises(ValueError, match="chunk"):
        chunked_prefill(hf, prompt, 0)

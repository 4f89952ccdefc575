"""The MTP hidden-state ring's slices (runtime/drafter.py): writing and reading positions by one or two
slices equals indexing rows by position modulo the ring's size."""

from __future__ import annotations

import pytest
import torch

from runtime.drafter import HIDDEN_RING, TRUNK_RING, _ring_spans, _split_at


@pytest.mark.parametrize("size", [HIDDEN_RING, TRUNK_RING])
def test_ring_slices_equal_modulo_indexing(size):
    g = torch.Generator().manual_seed(0)
    for start in range(0, 3 * size, 1 if size == HIDDEN_RING else 5):
        for n in range(1, size + 1):
            rows = torch.randn(n, 3, generator=g)
            by_index = torch.zeros(size, 3)
            by_index[torch.arange(start, start + n) % size] = rows
            by_slice = torch.zeros(size, 3)
            for (a, b), part in zip(
                _ring_spans(start, start + n, size), _split_at(rows, start, size), strict=True
            ):
                by_slice[a:b] = part
            assert torch.equal(by_slice, by_index), (start, n)
            read = torch.cat([by_slice[a:b] for a, b in _ring_spans(start, start + n, size)])
            assert torch.equal(read, rows), (start, n)


def test_a_rounds_ring_writes_at_once_equal_one_by_one():
    """An MTP round writes every sequence's rows of a level in one index copy (`_ring_write_many`): the
    rings and their ends equal those of the writes made one by one, with wraps, more rows than the ring
    holds (a prefill), empty and absent rows, and a lone write (which keeps the slice path)."""
    from runtime.drafter import Drafter

    def drafter() -> Drafter:
        d = Drafter.__new__(Drafter)
        d.device = torch.device("cpu")
        d.ring_len = [TRUNK_RING, HIDDEN_RING]  # the trunk's level is deeper
        d.hidden_ring = [torch.zeros(5, n, 3) for n in d.ring_len]
        d.rings = [list(ring.unbind(0)) for ring in d.hidden_ring]
        d.ring_end = [[0] * 5 for _ in range(2)]
        return d

    g = torch.Generator().manual_seed(1)
    rows = lambda n: torch.randn(n, 3, generator=g)  # noqa: E731
    rounds = [
        [(0, 0, rows(3)), (2, 14, rows(4)), (4, 0, rows(HIDDEN_RING + 5)), (1, 5, rows(0)), (3, 9, None)],
        [(2, 18, rows(1))],
        [(0, 3, rows(2)), (2, 19, rows(HIDDEN_RING)), (4, 21, rows(1))],
    ]
    at_once, one_by_one = drafter(), drafter()
    for level, writes in enumerate(rounds):
        at_once._ring_write_many(level % 2, writes)
        for w in writes:
            one_by_one._ring_write(level % 2, *w)
    assert all(torch.equal(a, b) for a, b in zip(at_once.hidden_ring, one_by_one.hidden_ring))
    assert at_once.ring_end == one_by_one.ring_end
    assert all(ring.abs().sum() > 0 for ring in one_by_one.hidden_ring)


def test_a_heads_passes_stay_within_the_programs_bound():
    """A head's passes over many positions are cut into passes of at most max_num_tokens, an item's pieces in
    order and in different passes, every position once. Items catching up (Drafter.stays_behind) end in a
    piece of a verify's positions (draft_stride + 1), which holds the positions that read drafts (the last
    max_draft_len - 1 of a deep head); the positions before it go first, in catch-up passes of up to
    catchup_q positions a sequence and catchup_tokens a pass (the catch-up graphs' shapes)."""
    from runtime.drafter import Drafter

    d = Drafter.__new__(Drafter)
    d.max_pass_tokens, d.draft_stride, d.catchup_q, d.catchup_tokens = 48, 3, 16, 32
    spans = {0: (10, 70), 2: (5, 6), 3: (0, 100), 5: (40, 41)}
    passes = d._passes(spans)
    assert passes[0] == ([(0, 10, 22), (2, 5, 6), (3, 0, 4), (5, 40, 41)], False)
    assert passes[1] == ([(0, 22, 70)], False)

    def check(passes, spans, catching_up=()):
        covered = {i: [] for i in spans}
        for items, catchup in passes:
            assert sum(end - start for _, start, end in items) <= (32 if catchup else 48)
            assert len({i for i, _, _ in items}) == len(items)
            for i, start, end in items:
                assert not catchup or (i in catching_up and end - start <= 16 and end <= spans[i][1] - 4)
                covered[i].append((start, end))
        for i, (start, end) in spans.items():
            pieces = covered[i]
            assert pieces[0][0] == start and pieces[-1][1] == end
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
            if i in catching_up:
                assert pieces[-1] == (max(start, end - 4), end)

    check(passes, spans)
    assert d._passes({1: (3, 4), 4: (7, 9)}) == [([(1, 3, 4), (4, 7, 9)], False)]  # a decode round: one pass
    assert d._passes({0: (0, 10), 1: (5, 30)}, catching_up={0}) == [
        ([(0, 0, 6)], True),
        ([(0, 6, 10), (1, 5, 30)], False),
    ]
    # a sequence left behind for the whole ring (64 positions, then a round of 4): pieces of 16 counted back
    assert d._passes({0: (0, 68)}, catching_up={0}) == [
        ([(0, 0, 16)], True), ([(0, 16, 32)], True), ([(0, 32, 48)], True), ([(0, 48, 64)], True),
        ([(0, 64, 68)], False),
    ]  # fmt: skip
    assert d._passes({0: (7, 9)}, catching_up={0}) == [([(0, 7, 9)], False)]
    # sequences catching up share catch-up passes of 32 positions (2: within a verify's positions of its end)
    spans = {0: (0, 20), 1: (3, 40), 2: (10, 13), 4: (0, 30)}
    passes = d._passes(spans, catching_up={0, 1, 2})
    assert passes[:3] == [([(0, 0, 16), (1, 3, 4)], True), ([(1, 4, 20)], True), ([(1, 20, 36)], True)]
    assert passes[3:] == [([(0, 16, 20), (1, 36, 40), (2, 10, 13), (4, 0, 30)], False)]
    check(passes, spans, {0, 1, 2})

"""The MTP hidden-state ring's slices (runtime/drafter.py): writing and reading positions by one or two
slices equals indexing rows by position % HIDDEN_RING."""

from __future__ import annotations

import torch

from runtime.drafter import HIDDEN_RING, _ring_spans, _split_at


def test_ring_slices_equal_modulo_indexing():
    g = torch.Generator().manual_seed(0)
    for start in range(0, 3 * HIDDEN_RING):
        for n in range(1, HIDDEN_RING + 1):
            rows = torch.randn(n, 3, generator=g)
            by_index = torch.zeros(HIDDEN_RING, 3)
            by_index[torch.arange(start, start + n) % HIDDEN_RING] = rows
            by_slice = torch.zeros(HIDDEN_RING, 3)
            for (a, b), part in zip(_ring_spans(start, start + n), _split_at(rows, start), strict=True):
                by_slice[a:b] = part
            assert torch.equal(by_slice, by_index), (start, n)
            read = torch.cat([by_slice[a:b] for a, b in _ring_spans(start, start + n)])
            assert torch.equal(read, rows), (start, n)


def test_a_rounds_ring_writes_at_once_equal_one_by_one():
    """An MTP round writes every sequence's rows of a level in one index copy (`_ring_write_many`): the
    rings and their ends equal those of the writes made one by one, with wraps, more rows than the ring
    holds (a prefill), empty and absent rows, and a lone write (which keeps the slice path)."""
    from runtime.drafter import Drafter

    def drafter() -> Drafter:
        d = Drafter.__new__(Drafter)
        d.device = torch.device("cpu")
        d.hidden_ring = torch.zeros(2, 5, HIDDEN_RING, 3)
        d.rings = [list(d.hidden_ring[level].unbind(0)) for level in range(2)]
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
    assert torch.equal(at_once.hidden_ring, one_by_one.hidden_ring)
    assert at_once.ring_end == one_by_one.ring_end
    assert one_by_one.hidden_ring.abs().sum() > 0

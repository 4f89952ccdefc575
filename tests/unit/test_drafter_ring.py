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

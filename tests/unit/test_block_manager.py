"""The block pool without torch: allocation, sliding windows, prefix cache, eviction."""

import pytest

from runtime.block_manager import FREED, BlockManager


def manager(num_blocks=24, windows=(0, 32)):
    return BlockManager(num_blocks, 16, list(windows), window_margin=8)


def test_allocate_grows_every_group_and_release_returns_all():
    bm = manager()
    seq = bm.new_sequence()
    bm.allocate(seq, 33)  # 3 blocks in each of 2 groups
    assert [len(t) for t in seq.tables] == [3, 3] and bm.usage()["free_blocks"] == 18
    bm.release(seq)
    assert bm.usage()["free_blocks"] == 24


def test_allocation_is_all_or_nothing():
    bm = manager(num_blocks=4)
    seq = bm.new_sequence()
    with pytest.raises(MemoryError):
        bm.allocate(seq, 48)
    assert bm.usage()["free_blocks"] == 4 and seq.num_blocks() == 0


def test_sliding_groups_free_what_no_query_can_reach():
    bm = manager()
    seq = bm.new_sequence()
    bm.allocate(seq, 100)
    bm.free_behind_windows(seq, 100)  # future queries read keys >= 100 - 8 - 32 + 1 = 61: blocks 0..2 go
    assert seq.tables[1][:4] == [FREED, FREED, FREED, seq.tables[1][3]] and FREED not in seq.tables[0]


def test_prefix_cache_register_lookup_adopt_and_evict():
    bm = manager()
    a = bm.new_sequence()
    bm.allocate(a, 32)
    toks = [list(range(16)), list(range(16, 32))]
    assert bm.register(a, 0, toks[0], b"", want_snapshot=False) is None
    snap = bm.register(a, 1, toks[1], b"", want_snapshot=True)
    assert snap is not None
    bm.release(a)  # the entries keep the blocks alive
    assert bm.usage()["free_blocks"] == 20 and bm.usage()["evictable_blocks"] == 4
    keys, entries = bm.lookup([(toks[0], b""), (toks[1], b"")])
    assert len(entries) == 2 and entries[1].snapshot == snap
    assert bm.lookup([(toks[0], b"image-1")])[1] == []  # media changes the hash
    b = bm.new_sequence()
    bm.adopt(b, keys, entries)
    assert b.tables == [[e.blocks[0] for e in entries], [e.blocks[1] for e in entries]]
    bm.release(b)
    big = bm.new_sequence()
    bm.allocate(big, 16 * 12)  # needs all 24 blocks: both entries are evicted
    assert bm.usage()["cached_entries"] == 0 and bm.stats["evictions"] == 2


def test_evictable_count_matches_a_recount_under_random_use():
    """The O(1) evictable counter against a recount, over random allocations, registrations, adoptions,
    window frees and releases."""
    import random

    rng = random.Random(0)
    bm = manager(num_blocks=64)
    live = []
    for step in range(400):
        op = rng.random()
        if op < 0.4 or not live:
            seq = bm.new_sequence()
            n = rng.randrange(1, 5)
            toks = [[rng.randrange(3) for _ in range(16)] for _ in range(n)]
            keys, entries = bm.lookup([(t, b"") for t in toks])
            k = rng.randrange(len(entries) + 1)
            bm.adopt(seq, keys[:k], entries[:k])
            try:
                bm.allocate(seq, 16 * n)
            except MemoryError:
                bm.release(seq)
                continue
            for i in range(k, n):
                bm.register(seq, i, toks[i], b"", want_snapshot=rng.random() < 0.5)
            live.append(seq)
        elif op < 0.6:
            seq = rng.choice(live)
            bm.free_behind_windows(seq, 16 * seq.num_blocks() + rng.randrange(60))
        else:
            bm.release(live.pop(rng.randrange(len(live))))
        recount = sum(1 for e in bm.cache.values() for b in e.blocks if b != FREED and bm.ref[b] == 1)
        assert bm.num_evictable == recount, step
        assert len(bm.free) + sum(1 for r in bm.ref if r > 0) == bm.num_blocks

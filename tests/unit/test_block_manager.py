"""The block pool without torch: allocation, sliding windows, prefix cache, eviction."""

import random
import time

import pytest

from runtime.block_manager import FREED, BlockManager, fit_pools, peak_blocks


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


def test_groups_draw_from_their_kinds_pools():
    """Full-attention group 0 takes ids from pool 0's range alone, sliding groups from pool 1's: a pool
    that runs dry refuses an allocation though the other has room, and its frees return to it."""
    bm = BlockManager(40, 16, [0, 32, 32], 8, group_pools=[0, 1, 1], pool_sizes=[10, 30])
    a = bm.new_sequence()
    bm.allocate(a, 16 * 8)
    assert all(0 <= b < 10 for b in a.tables[0]) and all(10 <= b < 40 for t in a.tables[1:] for b in t)
    assert bm.num_free(0) == 2 and bm.num_free(1) == 14 and bm.blocks_needed(a, 16 * 11) == [3, 6]
    b = bm.new_sequence()
    assert not bm.can_allocate(b, 16 * 3)  # pool 0 has 2 blocks left; pool 1 has 14
    with pytest.raises(MemoryError, match="per pool"):
        bm.allocate(b, 16 * 3)
    bm.free_behind_windows(a, 16 * 8)  # sliding blocks return to pool 1 only
    assert bm.num_free(0) == 2 and bm.num_free(1) > 14
    assert bm.pool_peaks(16 * 8, 16) == [8, 2 * min(8, -(-(32 + 8 + 16) // 16) + 1)]
    assert bm.sequences_at_once(16 * 8, 16) == 1
    bm.release(a)
    assert bm.num_free(0) == 10 and bm.num_free(1) == 30
    with pytest.raises(ValueError, match="one block per layer group"):
        BlockManager(40, 16, [0, 32, 32], 8, group_pools=[0, 1, 1], pool_sizes=[39, 1])
    with pytest.raises(ValueError, match="do not split"):
        BlockManager(40, 16, [0, 32, 32], 8, group_pools=[0, 1, 1], pool_sizes=[10, 20])


@pytest.mark.parametrize("pooled", [False, True])
def test_evictable_count_matches_a_recount_under_random_use(pooled):
    """The O(1) evictable counters against a recount, over random allocations, registrations, adoptions,
    window frees and releases; with pools, each group's blocks stay in its pool's range."""
    import random

    rng = random.Random(0)
    pools = dict(group_pools=[0, 1], pool_sizes=[24, 40]) if pooled else {}
    bm = BlockManager(64, 16, [0, 32], window_margin=8, **pools)
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
        for p, (start, size) in enumerate(zip(bm.pool_start, bm.pool_sizes)):
            held = [b for e in bm.cache.values() for b in e.blocks if b != FREED and bm.ref[b] == 1]
            assert bm.evictable[p] == sum(start <= b < start + size for b in held), step
        for seq in live:
            for g, table in enumerate(seq.tables):
                start, size = bm.pool_start[bm.group_pools[g]], bm.pool_sizes[bm.group_pools[g]]
                assert all(b == FREED or start <= b < start + size for b in table)
        assert len(bm.free) + sum(1 for r in bm.ref if r > 0) == bm.num_blocks


@pytest.mark.parametrize("pooled", [False, True])
def test_table_mirrors_follow_every_change(pooled):
    """`row(g)`, the int32 mirror a step copies, equals the table after allocations, sliding-window frees,
    rollbacks (truncate), release and a prefix adoption, in any order; with a pool per kind, as ids within
    the group's pool."""
    rng = random.Random(0)
    pools = dict(group_pools=[0, 1], pool_sizes=[3000, 1096]) if pooled else {}
    bm = BlockManager(4096, 16, [0, 64], window_margin=8, **pools)

    def within(seq, g):
        off = bm.pool_start[bm.group_pools[g]]
        return [b if b == FREED else b - off for b in seq.tables[g]]

    seqs = [bm.new_sequence() for _ in range(3)]
    lengths = [0, 0, 0]
    for _ in range(600):
        i = rng.randrange(3)
        seq, op = seqs[i], rng.random()
        if op < 0.6:
            lengths[i] += rng.randint(1, 40)
            bm.allocate(seq, lengths[i])
            bm.free_behind_windows(seq, lengths[i])
        elif op < 0.85 and lengths[i]:
            lengths[i] = max(0, lengths[i] - rng.randint(0, 8))  # a rollback of rejected drafts
            bm.truncate(seq, lengths[i])
        else:
            bm.release(seq)
            lengths[i] = 0
        if rng.random() < 0.5:
            for g in range(2):
                assert seq.row(g).tolist() == within(seq, g)
    for seq in seqs:
        for g in range(2):
            assert seq.row(g).tolist() == within(seq, g)
            assert (
                min(seq.row(g), default=0) >= FREED
                and max(seq.row(g), default=0) < bm.pool_sizes[g if pooled else 0]
            )


def decode_step_seconds(context: int, steps: int = 300) -> float:
    """The host's block work per decode step of one sequence at `context` tokens (a sliding group and a
    full one): allocate the next token, free behind the window, read both tables' mirrors."""
    bm = manager(2 * (context + steps) // 16 + 8, windows=(0, 512))
    seq = bm.new_sequence()
    bm.allocate(seq, context)
    bm.free_behind_windows(seq, context)
    seq.row(0), seq.row(1)
    t0 = time.perf_counter()
    for n in range(context + 1, context + steps + 1):
        bm.allocate(seq, n)
        bm.free_behind_windows(seq, n)
        seq.row(0), seq.row(1)
    return (time.perf_counter() - t0) / steps


def test_host_block_work_per_decode_step_does_not_grow_with_context():
    """The long-context issue: per-step host work O(blocks that changed), never O(context). At 256K
    tokens a walk over the tables (16,384 blocks a group) cost about 60x what it costs at 4K."""
    short = min(decode_step_seconds(4096) for _ in range(3))
    long = min(decode_step_seconds(262144) for _ in range(3))
    assert long < 3 * short + 20e-6, (short, long)


def test_default_pool_holds_a_full_batch_at_max_seq_len():
    """ModelRunner's default pool (max_batch_size x peak_blocks at max_seq_len) is enough for that many
    sequences fed in chunks and decoded to the end at once, a full group and two sliding ones, and is
    far below a whole table per group at long context."""
    windows, margin, bs, batch = [0, 64, 64], 3, 16, 4
    max_seq_len, chunk = 2048, 128
    per_seq = peak_blocks(windows, bs, margin, max_seq_len, chunk)
    assert per_seq == 128 + 2 * (-(-(64 + 3 + 128) // 16) + 1) < 3 * 128
    assert peak_blocks([0, 512], 16, 8, 1 << 20, 2048) == 65536 + 162
    bm = BlockManager(batch * per_seq, bs, windows, window_margin=margin)
    seqs = [bm.new_sequence() for _ in range(batch)]
    prompt = 1000
    for start in range(0, prompt, chunk):  # chunked prefill, the sequences interleaved
        for seq in seqs:
            end = min(prompt, start + chunk)
            bm.allocate(seq, end)
            bm.free_behind_windows(seq, end)
    for n in range(prompt + 1, max_seq_len + 1):  # decode, each step with a draft margin's room
        for seq in seqs:
            bm.allocate(seq, min(max_seq_len, n + margin))
            bm.free_behind_windows(seq, n)
    assert all(len(s.tables[0]) == max_seq_len // bs for s in seqs)


def test_pools_fit_the_memory_left_beside_the_weights():
    """fit_pools: as sized when they fit; else shrunk in proportion, never below one sequence's peak; a
    clear error when not even that fits."""
    sizes, one, cost = [640, 96], [10, 3], [1000, 200]  # 64 sequences; a full block costs 5 sliding ones
    assert fit_pools(sizes, one, cost, 10**9) == sizes
    half = fit_pools(sizes, one, cost, (640 * 1000 + 96 * 200) // 2)
    assert half == [320, 48] and sum(n * b for n, b in zip(half, cost)) <= (640 * 1000 + 96 * 200) // 2
    assert fit_pools(sizes, one, cost, 10 * 1000 + 3 * 200) == one
    with pytest.raises(MemoryError, match="one sequence of max_seq_len needs"):
        fit_pools(sizes, one, cost, 10 * 1000 + 3 * 200 - 1)

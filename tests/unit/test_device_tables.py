"""Block tables kept on the device (runtime/device_tables.py): after any sequence of allocations, window
frees, rollbacks, releases and slot changes, a gather equals the tables built whole on
the host, and a step sends only the entries that changed."""

import random

import numpy as np
import torch

from runtime.block_manager import FREED, BlockManager, kind_pools
from runtime.device_tables import DeviceTables

MB = 40  # max blocks per sequence (640 tokens of 16)


def host_tables(seqs, groups: int) -> np.ndarray:
    """What ModelRunner.step_inputs builds on the host: each row's pool-local ids, FREED after."""
    out = np.full((groups, len(seqs), MB), FREED, dtype=np.int32)
    for b, (_, blocks) in enumerate(seqs):
        for g in range(groups):
            row = blocks.row(g)
            out[g, b, : len(row)] = row
    return out


def test_gathered_tables_equal_the_host_tables_through_a_random_workload():
    windows = [0, 48, 0, 48]
    pools = kind_pools(windows)
    bm = BlockManager(400, 16, windows, window_margin=4, group_pools=pools, pool_sizes=[260, 140])
    tables = DeviceTables(len(windows), 4, MB, torch.device("cpu"))
    rng = random.Random(0)
    live: dict[int, tuple[object, int]] = {}  # slot -> (SeqBlocks, length)
    free_slots = [0, 1, 2, 3]
    parked = []  # preempted sequences (blocks released), to resume in whatever slot is free
    for step in range(600):
        op = rng.random()
        if free_slots and (op < 0.1 or not live):
            slot = free_slots.pop(rng.randrange(len(free_slots)))
            seq = parked.pop() if parked and rng.random() < 0.5 else bm.new_sequence()
            live[slot] = (seq, 0)
        elif op < 0.15 and live:  # preempt or finish: blocks back, slot free
            slot = rng.choice(list(live))
            seq, _ = live.pop(slot)
            bm.release(seq)
            free_slots.append(slot)
            if rng.random() < 0.5:
                parked.append(seq)
        elif op < 0.25 and live:  # a rejected draft: roll back a few tokens
            slot = rng.choice(list(live))
            seq, n = live[slot]
            n = max(0, n - rng.randint(1, 20))
            bm.truncate(seq, n)
            live[slot] = (seq, n)
        else:  # decode or a prefill chunk
            for slot, (seq, n) in list(live.items()):
                n = min(MB * 16, n + (1 if rng.random() < 0.7 else rng.randint(2, 90)))
                bm.allocate(seq, n)
                bm.free_behind_windows(seq, n)
                live[slot] = (seq, n)
        if not live:
            continue
        batch = [(slot, live[slot][0]) for slot in rng.sample(list(live), rng.randint(1, len(live)))]
        got = tables.gather(batch).numpy()
        want = host_tables(batch, len(windows))
        assert np.array_equal(got, want), f"step {step}"
        # group 0's alone (the MTP depths' caches)
        assert np.array_equal(tables.gather(batch, slice(0, 1)).numpy(), want[:1])


def test_a_decode_step_sends_only_what_changed():
    """At a long context a step writes O(blocks that changed): here the new block of each group every 16
    tokens and one freed behind the window, never a whole table."""
    windows = [0, 64]
    bm = BlockManager(6000, 16, windows, window_margin=4)
    tables = DeviceTables(2, 1, 4096, torch.device("cpu"))
    seq = bm.new_sequence()
    bm.allocate(seq, 40000)
    bm.free_behind_windows(seq, 40000)
    tables.gather([(0, seq)])
    sent = []
    put = tables.rows.index_put_

    def counting(indices, values):
        sent.append(len(values))
        return put(indices, values)

    tables.rows.index_put_ = counting
    for n in range(40001, 40001 + 64):
        bm.allocate(seq, n)
        bm.free_behind_windows(seq, n)
        tables.gather([(0, seq)])
    assert len(sent) <= 2 * 64 // 16 + 1 and max(sent) <= 4, sent
    assert np.array_equal(tables.gather([(0, seq)]).numpy(), host_tables_big(seq))


def host_tables_big(seq) -> np.ndarray:
    out = np.full((2, 1, 4096), FREED, dtype=np.int32)
    for g in range(2):
        row = seq.row(g)
        out[g, 0, : len(row)] = row
    return out

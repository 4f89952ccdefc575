"""The torch-free core: Scheduler over a BlockManager, and PrefixCache's policy, without an engine.

A "step" here is what the engine does with the scheduler's output: num_computed advances by the tokens
fed, a sampling sequence gets one output token."""

from __future__ import annotations

import random

import pytest

from runtime.block_manager import FREED, BlockManager
from runtime.params import SamplingParams
from runtime.prefix_cache import PrefixCache
from runtime.scheduler import ScheduledSeq, Scheduler
from runtime.sequence import Sequence, Status

BS = 4  # tokens per block


def seq(rid: str, n: int, max_tokens: int = 8, drafts: int = 0) -> Sequence:
    return Sequence(
        rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, num_draft_tokens=drafts)
    )


def make(num_blocks=64, max_batch=4, budget=16, windows=(0,), margin=0) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, list(windows), margin), max_batch, budget)


def advance(batch: list[ScheduledSeq]) -> None:
    """The engine's side of a step: the caches hold what was fed, samplers emit a token, drafts go."""
    for s in batch:
        s.seq.num_computed += s.num_tokens - s.num_drafts
        if s.samples:
            s.seq.output_ids.append(7)
        s.seq.drafts = []


def test_prefill_chunks_end_on_block_boundaries():
    """A chunk that crosses a block boundary stops at the last boundary it reaches, so its end is a
    prefix-cache restore point; the prompt's last chunk runs to its end."""
    sch = make(budget=10)
    s = seq("a", 23)
    sch.add(s)
    ends = []
    while s.is_prefill or not s.output_ids:
        batch = sch.schedule()
        ends.append(batch[0].start + batch[0].num_tokens)
        advance(batch)
    assert ends == [8, 16, 20, 23]  # 10 -> 8, 18 -> 16, 26 -> 20 (a boundary), then the rest
    assert all(e % BS == 0 for e in ends[:-1])


def test_a_budget_exactly_full():
    """Decodes take one token each, then prefill fills what is left, exactly to the budget."""
    sch = make(budget=8)
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 40)
    for s in (a, b):
        sch.add(s)
    advance(sch.schedule())  # both prefill
    sch.add(c)
    batch = sch.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in batch] == [("a", 1), ("b", 1), ("c", 4)]
    assert sum(s.num_tokens for s in batch) <= 8
    advance(batch)
    batch = sch.schedule()
    assert sum(s.num_tokens for s in batch) == 6 and batch[-1].num_tokens == 4  # 2 decodes, a block of c


def test_a_long_prefill_beside_decodes_keeps_its_chunks_attention_bounded():
    """With max_prefill_pairs, a chunk that shares its step with a decoding sequence keeps tokens x
    (context + tokens) within the limit (never under a block), so it shrinks as the prompt's context
    grows; a prompt alone takes whole chunks; the prompt still completes and its chunks cover it."""
    P = 24 * 24
    sch = Scheduler(BlockManager(256, BS, [0], 0), 4, 64, chunk_size=24, max_prefill_pairs=P)
    short, long = seq("short", 3, max_tokens=1000), seq("long", 200)
    sch.add(long)
    batch = sch.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in batch] == [("long", 24)]  # alone: a whole chunk
    advance(batch)
    sch.add(short)
    advance(sch.schedule())  # short's prompt and long's next chunk
    fed = []
    while long.is_prefill or not long.output_ids:
        batch = sch.schedule()
        assert batch[0].seq is short and batch[0].num_tokens == 1  # short decodes every step
        (chunk,) = [s for s in batch if s.seq is long]
        n, context = chunk.num_tokens, chunk.start
        assert n * (context + n) <= P or n == BS or context + n == len(long), (context, n)
        assert n >= min(BS, len(long) - context)
        fed.append((context, n))
        advance(batch)
    assert fed[-1][0] + fed[-1][1] == len(long.prompt_ids)
    sizes = [n for _, n in fed]
    assert sizes[0] > sizes[-2] and sizes[-2] == BS  # shrinking with context, down to a block
    assert sch.pairs_cap(100) == 5 and sch.pairs_cap(0) == 24  # 5 x 105 <= 576 < 6 x 106


def paced_prefill(slowdown: float | None, decode_s: float = 1.0, mixed_s: float = 4.0, alone: int = 5):
    """A short sequence decoding while a 400-token prompt fills in chunks of 24, on a clock where a step
    with a prefill chunk costs `mixed_s` (it reads every expert) and a decode-only step `decode_s`. Returns
    the short sequence's step times from the prompt's arrival to its first token, and the steps that carried
    a chunk."""
    sch = Scheduler(BlockManager(512, BS, [0], 0), 4, 64, chunk_size=24, decode_slowdown=slowdown)
    short, long = seq("short", 3, max_tokens=10_000), seq("long", 400)
    sch.add(short)
    for _ in range(alone):  # short decodes alone (the pacer learns a decode-only step)
        batch = sch.schedule()
        sch.record_step(batch, decode_s)
        advance(batch)
    sch.add(long)
    if not alone:  # both prompts in one step: nobody decodes yet
        advance(sch.schedule())
    times, chunks = [], 0
    while not long.output_ids:
        batch = sch.schedule()
        assert batch[0].seq is short and batch[0].num_tokens == 1 and not batch[0].prefill  # never waits
        prefill = [s for s in batch if s.prefill]
        assert all(s.seq is long for s in prefill)
        seconds = mixed_s if prefill else decode_s
        sch.record_step(batch, seconds)
        times.append(seconds)
        chunks += bool(prefill)
        advance(batch)
    return times, chunks


def test_paced_prefill_keeps_its_neighbours_mean_step_within_the_slowdown():
    """With decode_slowdown 2, a long prompt's chunks beside a decoding sequence take turns with
    decode-only steps: the neighbour's mean step over the whole prefill stays within 2x a decode-only
    step (plus one chunk's excess, the bound PrefillPacer states); the prompt still completes, every chunk
    whole. Unpaced, the same prompt holds every step (mean 4x); alone it is never held back."""
    unpaced, n = paced_prefill(None)
    assert sum(unpaced) / len(unpaced) == 4.0 and n == len(unpaced) == 17  # 400 tokens: 16 chunks of 24, 16
    for slowdown in (2.0, 1.5, 3.0):
        times, chunks = paced_prefill(slowdown)
        assert chunks == 17  # the same chunks, spread out
        assert sum(times) <= slowdown * 1.0 * len(times) + (4.0 - slowdown * 1.0)
        assert sum(times) / len(times) > slowdown * 0.8  # the prompt uses the share it is given
    # Arriving together, before any decode-only step was measured: the first mixed step owes its whole time.
    times, chunks = paced_prefill(2.0, alone=0)
    assert chunks == 16 and times[:6] == [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
    assert sum(times) <= 2.0 * len(times) + 2.0
    # Alone, a prompt is never paced.
    sch = Scheduler(BlockManager(512, BS, [0], 0), 4, 64, chunk_size=24, decode_slowdown=2.0)
    sch.pacer.decode_s, sch.pacer.balance = 1.0, -100.0
    long = seq("long", 100)
    sch.add(long)
    steps = 0
    while not long.output_ids:
        batch = sch.schedule()
        assert batch and batch[0].prefill
        sch.record_step(batch, 4.0)
        advance(batch)
        steps += 1
    assert steps == 5 and sch.pacer.balance == 0.0
    with pytest.raises(ValueError, match="must exceed 1"):
        Scheduler(BlockManager(16, BS, [0], 0), 4, 64, decode_slowdown=1.0)


def test_preemption_takes_the_newest_running_sequence_first():
    """When a running sequence's next block cannot be had, the newest other running sequence is preempted
    (its blocks freed, its state slot back, queued first to recompute), the oldest goes on."""
    sch = make(num_blocks=6, budget=64)
    seqs = [seq(r, 4, max_tokens=20) for r in "abc"]  # one block each
    for s in seqs:
        sch.add(s)
    advance(sch.schedule())
    assert all(s.status == Status.RUNNING for s in seqs) and len(sch.blocks.free) == 3
    for _ in range(8):  # decode until a third block each (positions 8..) is more than the pool holds
        advance(sch.schedule())
        if sch.num_preemptions:
            break
    assert sch.num_preemptions >= 1
    assert seqs[0].status == Status.RUNNING  # the oldest is never the victim
    victims = [s for s in seqs if s.num_preemptions]
    assert victims[0] is seqs[2] and sch.waiting[0] is victims[-1]
    for v in victims:
        assert v.num_computed == 0 and v.blocks is None and v.slot == -1


def test_waiting_requests_never_preempt_running_ones():
    sch = make(num_blocks=4, budget=64)
    a = seq("a", 12, max_tokens=3)  # three blocks
    sch.add(a)
    advance(sch.schedule())
    b = seq("b", 8)  # two blocks: the pool has one left
    sch.add(b)
    for _ in range(2):
        batch = sch.schedule()
        assert [s.seq.request_id for s in batch] == ["a"] and b.status == Status.WAITING
        advance(batch)
    assert sch.num_preemptions == 0
    sch.finish(a, "length")
    assert sch.schedule()[0].seq is b  # admitted once a's blocks are back


def test_drafts_are_dropped_when_blocks_run_short():
    """A decoding sequence's MTP drafts need blocks past its next token; they get what is left after every
    decoding sequence has its token's blocks, and are dropped rather than cost anyone a preemption."""
    sch = make(num_blocks=3, budget=64)
    a, b = seq("a", 3, drafts=4), seq("b", 4)
    for s in (a, b):
        sch.add(s)
    advance(sch.schedule())  # a holds positions 0..3 (one block), b 0..4: two blocks once it decodes
    a.drafts = [5, 6, 7, 8]  # a would feed positions 3..7: a second block, the one b's token needs
    batch = {s.seq.request_id: s for s in sch.schedule()}
    assert (batch["a"].num_tokens, batch["a"].num_drafts) == (1, 0)
    assert batch["b"].num_tokens == 1 and sch.num_preemptions == 0
    sch.finish(b, "length")
    advance(list(batch.values())[:1])
    a.drafts = [5, 6, 7, 8]  # b's blocks are back: now a drafts
    s = sch.schedule()[0]
    assert (s.num_tokens, s.num_drafts) == (5, 4)


def test_drafts_fit_the_budget():
    sch = make(budget=3)
    a = seq("a", 3, drafts=4)
    sch.add(a)
    advance(sch.schedule())
    a.drafts = [5, 6, 7, 8]
    s = sch.schedule()[0]
    assert (s.num_tokens, s.num_drafts) == (3, 2)


def test_an_isolated_sequence_runs_alone():
    """After a failed batch (LLMEngine._isolate) a sequence marked isolate_until runs alone until it has
    recomputed that far; the others wait, then run together again."""
    sch = make(budget=64)
    seqs = [seq(r, 6) for r in "abc"]
    for s in seqs:
        sch.add(s)
    advance(sch.schedule())
    for s in seqs[1:]:
        s.isolate_until = max(s.num_computed, 1)
        sch.preempt(s)
    batches = []
    while any(s.isolate_until for s in seqs):
        batch = sch.schedule()
        batches.append([s.seq.request_id for s in batch])
        advance(batch)
        for s in batch:
            if s.seq.isolate_until and s.seq.num_computed >= s.seq.isolate_until:
                s.seq.isolate_until = 0
    assert batches == [["c"], ["b"]]  # queued first: the last preempted
    assert sorted(s.seq.request_id for s in sch.schedule()) == ["a", "b", "c"]


def test_random_workloads_keep_the_pool_consistent():
    """Random arrivals, lengths, drafts, finishes and a pool too small for all: every step stays within
    the budget and batch size, no block is held twice, and when all is done every block is free again."""
    rng = random.Random(0)
    sch = make(num_blocks=24, max_batch=4, budget=12, windows=(0, 8), margin=2)
    live: list[Sequence] = []
    for step in range(400):
        if rng.random() < 0.3 and step < 300:
            s = seq(f"r{step}", rng.randint(1, 30), max_tokens=rng.randint(1, 12), drafts=rng.choice([0, 2]))
            sch.add(s)
            live.append(s)
        batch = sch.schedule()
        assert sum(s.num_tokens for s in batch) <= 12 and len(batch) <= 4
        assert len({id(s.seq) for s in batch}) == len(batch)
        advance(batch)
        for s in batch:
            seq_ = s.seq
            seq_.drafts = (
                [1] * rng.randint(0, 2) if seq_.params.num_draft_tokens and not seq_.is_prefill else []
            )
            if len(seq_.output_ids) >= seq_.params.max_tokens:
                sch.finish(seq_, "length")
            else:
                sch.blocks.free_behind_windows(seq_.blocks, seq_.num_computed)
        held = [b for s in sch.running for t in s.blocks.tables for b in t if b >= 0]
        assert len(held) == len(set(held)) and not set(held) & set(sch.blocks.free)
    while sch.has_work():
        batch = sch.schedule()
        advance(batch)
        for s in batch:
            if len(s.seq.output_ids) >= s.seq.params.max_tokens:
                sch.finish(s.seq, "length")
    assert len(sch.blocks.free) == 24 and sorted(sch.free_slots) == [0, 1, 2, 3]


class FakeRunner:
    """What PrefixCache needs of a ModelRunner: the sconv history depth, and a record of snapshots."""

    K1, state_rows = 3, 5

    def __init__(self):
        self.saved = []

    def save_snapshot(self, slot: int, snap: int, back: int) -> None:
        self.saved.append((slot, snap, back))


def test_prefix_cache_registers_settled_blocks_and_starts_a_repeat_on_them():
    blocks = BlockManager(32, BS, [0], window_margin=2)
    runner = FakeRunner()
    cache = PrefixCache(blocks, runner, max_draft_len=2)
    a = seq("a", 14)
    a.blocks = blocks.new_sequence()
    blocks.allocate(a.blocks, 14)
    a.num_computed = 14
    cache.register(a)
    assert len(a.blocks.hashes) == 3  # the prompt's full blocks, at once
    # Restore points: blocks whose end the sconv history still holds (back <= state_rows - K1 = 2).
    assert [snap_back for _, _, snap_back in runner.saved] == [2]
    b = seq("b", 14)  # the same prompt
    b.blocks = blocks.new_sequence()
    cache.lookup(b)
    assert b.num_computed == 12 and b.restore_snapshot is not None  # up to the restore point
    c = seq("c", 14, drafts=2)  # an MTP request: its heads need every position, no cache
    c.blocks = blocks.new_sequence()
    cache.lookup(c)
    assert c.num_computed == 0 and c.restore_snapshot is None
    d = seq("d", 12)  # ends exactly at the restore point: one token must stay to compute
    d.blocks = blocks.new_sequence()
    cache.lookup(d)
    assert d.num_computed < 12


def test_prefix_cache_keys_include_the_media():
    blocks = BlockManager(32, BS, [0], window_margin=0)
    runner = FakeRunner()
    runner.state_rows = 100  # every block a restore point
    cache = PrefixCache(blocks, runner, max_draft_len=0)
    a = seq("a", 9)
    a.mm_digests = {1: b"image-1"}
    a.blocks = blocks.new_sequence()
    blocks.allocate(a.blocks, 9)
    a.num_computed = 9
    cache.register(a)
    b = seq("b", 9)
    b.mm_digests = {1: b"image-2"}  # the same tokens, another image
    b.blocks = blocks.new_sequence()
    cache.lookup(b)
    assert b.num_computed == 0


def test_a_long_cached_prefix_fits_a_pool_sized_for_the_windows():
    """A request that adopts a long cached prefix keeps, in its sliding groups, only what its window reaches
    (the rest stays with the cache, evictable): it is admitted on the prefix in a sliding pool sized for a
    window, where holding the whole prefix there would keep it waiting with nothing running."""
    blocks = BlockManager(64 + 8, BS, [0, 8], 2, group_pools=[0, 1], pool_sizes=[64, 8])
    cache = PrefixCache(blocks, FakeRunner(), max_draft_len=2)
    sch = Scheduler(blocks, 2, 64)
    a = seq("a", 30)
    a.blocks = blocks.new_sequence()
    blocks.allocate(a.blocks, 30)  # all of it in both groups
    a.num_computed = 30
    cache.register(a)
    blocks.release(a.blocks)  # a is done; its 7 full blocks stay cached (a restore point at 28)
    b = Sequence("b", list(range(1, 31)) + [99] * 10, SamplingParams(max_tokens=4))
    sch.add(b)
    batch = sch.schedule(on_admit=cache.lookup)
    assert [(s.seq.request_id, s.start) for s in batch] == [("b", 28)]  # on the cached prefix
    live = [x for x in b.blocks.tables[1] if x != FREED]
    assert len(live) <= -(-(8 + 2) // BS) + 1 + -(-batch[0].num_tokens // BS)

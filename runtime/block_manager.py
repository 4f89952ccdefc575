"""The block pool: one pool of block ids for every layer group, per-sequence block tables, sliding
windows that free what falls behind them, and prefix caching by block content hash.

No torch here: block ids and tables are plain ints (docs/interfaces.md "KV cache"), each table mirrored
as an int32 array that is kept in step entry by entry, so that a step's inputs copy it without a walk
over the whole context in Python.

Pools. Each group draws its blocks from one pool, a range of block ids of its own: the real Inkling's
full-attention groups from the first, its sliding groups from the second. Each pool's caches hold that
pool's blocks alone, indexed by ids within the pool (`SeqBlocks.row`): a full layer's cache and each MTP
depth's (which group 0's ids index) are sized to the full groups' need, a sliding layer's to the windows'.

Prefix cache. When a logical block of a sequence is full of committed tokens, it may be registered
under the chained hash of its tokens (and of the media embedded in it). The entry keeps a reference
on that block's physical block in every group, so the KV survives the sequence; an entry whose end
has a saved sconv state (a "restore point") can start another sequence there. Entries are evicted
least recently used first when the pool runs dry.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

FREED = -1  # a table entry whose block was freed (behind a sliding window) or never allocated
_NO_EDITS = (np.empty(0, np.int64), np.empty(0, np.int32))


@dataclass
class CacheEntry:
    blocks: tuple[int, ...]  # the physical block of each group
    snapshot: int | None = None  # sconv state snapshot slot, when this block's end is a restore point


@dataclass
class SeqBlocks:
    """A sequence's block tables, one list per group, and their int32 mirrors (`row`). Only the
    BlockManager changes the tables. The tables hold block ids; the mirrors the ids within each group's
    pool (id - offsets[g]), which index that pool's caches."""

    tables: list[list[int]]
    offsets: list[int] = field(default_factory=list)  # per group: its pool's first block id
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its registered full blocks
    # Per group: the leading entries that free_behind_windows has passed (every one of them FREED).
    freed: list[int] = field(default_factory=list)
    _rows: list[np.ndarray] = field(default_factory=list, repr=False)  # per group: the mirror's buffer
    _synced: list[int] = field(default_factory=list, repr=False)  # per group: its entries in step
    # Per group, for a copy elsewhere (runtime/device_tables.py): the leading entries it was given, and
    # the indices among or past them that changed since (freed, or taken off the end).
    _pushed: list[int] = field(default_factory=list, repr=False)
    _stale: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        G = len(self.tables)
        self.offsets = self.offsets or [0] * G
        self.freed = self.freed or [0] * G
        self._rows = [np.empty(0, np.int32) for _ in range(G)]
        self._synced = [0] * G
        self._pushed = [0] * G
        self._stale = [[] for _ in range(G)]

    def num_blocks(self) -> int:
        return len(self.tables[0]) if self.tables else 0

    def row(self, g: int) -> np.ndarray:
        """Group g's table as int32 ids within its pool (a view of the mirror: copy it to keep it). Converts
        only the entries appended since the last call."""
        table, done = self.tables[g], self._synced[g]
        if len(table) > len(self._rows[g]):  # grow the buffer geometrically
            grown = np.empty(max(len(table), 2 * len(self._rows[g]), 16), np.int32)
            grown[:done] = self._rows[g][:done]
            self._rows[g] = grown
        if len(table) > done:
            new = self._rows[g][done : len(table)]
            new[:] = table[done:]
            if self.offsets[g]:
                new[new != FREED] -= self.offsets[g]
        self._synced[g] = len(table)
        return self._rows[g][: len(table)]

    def edits(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values): the entries of group g's row (`row`; FREED past the table's end) that changed
        since the last call, for a copy of the row kept elsewhere (runtime/device_tables.py). O(entries
        changed): appended, freed or taken off the end."""
        row, pushed, stale = self.row(g), self._pushed[g], self._stale[g]
        n = len(row)
        if pushed == n and not stale:
            return _NO_EDITS
        index = np.arange(pushed, n, dtype=np.int64)
        if stale:
            index = np.concatenate([np.array(stale, dtype=np.int64), index])
            stale.clear()
        self._pushed[g] = n
        values = np.full(len(index), FREED, dtype=np.int32)
        inside = index < n
        values[inside] = row[index[inside]]
        return index, values

    def repush(self) -> None:
        """The copy elsewhere starts empty (all FREED): the next `edits` give every entry."""
        self._pushed = [0] * len(self.tables)
        self._stale = [[] for _ in self.tables]

    def _set_freed(self, g: int, i: int) -> None:
        self.tables[g][i] = FREED
        if i < self._synced[g]:
            self._rows[g][i] = FREED
        if i < self._pushed[g]:
            self._stale[g].append(i)

    def _truncated(self) -> None:
        """After entries were taken off the tables' ends."""
        for g, table in enumerate(self.tables):
            n = len(table)
            self._synced[g] = min(self._synced[g], n)
            self.freed[g] = min(self.freed[g], n)
            if self._pushed[g] > n:  # the copy's entries past the end go back to FREED
                self._stale[g].extend(range(n, self._pushed[g]))
                self._pushed[g] = n


def chain_hash(parent: bytes, tokens: list[int], media: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    h.update(media)
    return h.digest()


def group_peaks(group_windows: list[int], block_size: int, margin: int, length: int, chunk: int) -> list[int]:
    """Per group (windows; 0 is full attention): the most blocks a sequence of `length` tokens, fed in
    chunks of at most `chunk`, ever holds there (BlockManager.peak_blocks)."""
    full = -(-length // block_size)
    return [
        full if not window else min(full, -(-(window + margin + chunk) // block_size) + 1)
        for window in group_windows
    ]


def peak_blocks(group_windows: list[int], block_size: int, margin: int, length: int, chunk: int) -> int:
    """BlockManager.peak_blocks for a pool of these groups."""
    return sum(group_peaks(group_windows, block_size, margin, length, chunk))


def pool_peaks(
    group_windows: list[int], group_pools: list[int], block_size: int, margin: int, length: int, chunk: int
) -> list[int]:
    """group_peaks summed per pool (group_pools[g]: group g's pool)."""
    peaks = [0] * (max(group_pools, default=0) + 1)
    for p, n in zip(group_pools, group_peaks(group_windows, block_size, margin, length, chunk)):
        peaks[p] += n
    return peaks


def fit_pools(sizes: list[int], one_seq: list[int], block_bytes: list[int], budget: int) -> list[int]:
    """Pools that fit `budget` bytes of KV cache: `sizes` (each pool's blocks for max_batch_size sequences
    at max_seq_len) as they are if they fit, else shrunk in proportion, but never below `one_seq` (one such
    sequence's peak): fewer sequences then run at once and the scheduler preempts the newest when blocks
    run out. block_bytes[p]: what one block of pool p costs over every cache that holds it."""
    want = sum(n * b for n, b in zip(sizes, block_bytes))
    if want <= budget:
        return list(sizes)
    least = sum(n * b for n, b in zip(one_seq, block_bytes))
    if least > budget:
        raise MemoryError(
            f"one sequence of max_seq_len needs {least / 2**30:.2f} GiB of KV cache, and "
            f"{max(budget, 0) / 2**30:.2f} GiB are left for it beside the weights: build with a smaller "
            "max_seq_len, or run on a GPU with more memory"
        )
    scale = budget / want
    return [max(low, int(n * scale)) for n, low in zip(sizes, one_seq)]


def kind_pools(group_windows: list[int]) -> list[int]:
    """The pool of each group by attention kind: group 0's kind is pool 0, the other kind pool 1."""
    first = bool(group_windows[0]) if group_windows else False
    return [int(bool(w) != first) for w in group_windows]


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_windows: list[int],
        window_margin: int,
        num_snapshots: int | None = None,
        group_pools: list[int] | None = None,
        pool_sizes: list[int] | None = None,
    ):
        """group_windows[g]: 0 for full attention, W for sliding; window_margin: tokens a sequence may be
        rolled back by (max_draft_len), kept beyond the window; num_snapshots: sconv snapshot slots for
        restore points (default one per block). group_pools[g]: the pool group g draws from (default: one
        pool); pool_sizes: each pool's blocks, summing to num_blocks: pool p owns the ids from
        sum(pool_sizes[:p]) on."""
        self.group_pools = list(group_pools) if group_pools is not None else [0] * len(group_windows)
        self.pool_sizes = list(pool_sizes) if pool_sizes is not None else [num_blocks]
        if len(self.group_pools) != len(group_windows) or sum(self.pool_sizes) != num_blocks:
            raise ValueError(
                f"pools {self.pool_sizes} of groups {self.group_pools} do not split {num_blocks} blocks "
                f"among {len(group_windows)} groups"
            )
        for p, size in enumerate(self.pool_sizes):
            groups = self.group_pools.count(p)
            if size < groups:
                raise ValueError(f"{size} blocks cannot hold one block per layer group ({groups})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_windows = list(group_windows)
        self.window_margin = window_margin
        self.pool_start = [sum(self.pool_sizes[:p]) for p in range(len(self.pool_sizes))]
        self.pool_free: list[list[int]] = [
            list(range(start + size - 1, start - 1, -1))
            for start, size in zip(self.pool_start, self.pool_sizes)
        ]
        self.ref = [0] * num_blocks
        self.cache: OrderedDict[bytes, CacheEntry] = OrderedDict()  # LRU order: oldest first
        num_snapshots = num_blocks if num_snapshots is None else num_snapshots
        self.snapshots_free: list[int] = list(range(num_snapshots - 1, -1, -1))
        self.cached_blocks: set[int] = set()  # blocks some cache entry holds
        self.evictable = [0] * len(self.pool_sizes)  # per pool: cached blocks only an entry holds (ref 1)
        # prefix_query_tokens: the prompt tokens looked up in the prefix cache (PrefixCache.lookup)
        self.stats = {"prefix_hits": 0, "prefix_hit_tokens": 0, "prefix_query_tokens": 0, "evictions": 0}

    # Pool.
    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def free(self) -> list[int]:
        """Every free block id, all pools."""
        return [b for free in self.pool_free for b in free]

    @property
    def num_evictable(self) -> int:
        return sum(self.evictable)

    def _pool_of(self, b: int) -> int:
        return bisect.bisect_right(self.pool_start, b) - 1

    def num_free(self, pool: int | None = None) -> int:
        """Blocks free now, plus blocks held only by cache entries (evictable): of one pool, or of all."""
        if pool is None:
            return sum(map(len, self.pool_free)) + self.num_evictable
        return len(self.pool_free[pool]) + self.evictable[pool]

    def _incref(self, b: int) -> None:
        if b in self.cached_blocks and self.ref[b] == 1:
            self.evictable[self._pool_of(b)] -= 1
        self.ref[b] += 1

    def _take(self, pool: int) -> int:
        free = self.pool_free[pool]
        while not free and self.cache:
            self._evict_one()
        if not free:
            raise MemoryError(f"block pool {pool} exhausted")
        b = free.pop()
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        if b == FREED:
            return
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.pool_free[self._pool_of(b)].append(b)
        elif self.ref[b] < 0:
            raise RuntimeError(f"block {b} released twice")
        elif self.ref[b] == 1 and b in self.cached_blocks:
            self.evictable[self._pool_of(b)] += 1

    def _evict_one(self) -> None:
        _, entry = self.cache.popitem(last=False)
        for b in entry.blocks:
            self.cached_blocks.discard(b)
            if self.ref[b] == 1:
                self.evictable[self._pool_of(b)] -= 1
            self._release(b)
        if entry.snapshot is not None:
            self.snapshots_free.append(entry.snapshot)
        self.stats["evictions"] += 1

    # Sequences.
    def new_sequence(self) -> SeqBlocks:
        return SeqBlocks([[] for _ in self.group_windows], [self.pool_start[p] for p in self.group_pools])

    def blocks_needed(self, seq: SeqBlocks, length: int) -> list[int]:
        """Per pool: physical blocks to allocate so that `seq` holds `length` tokens."""
        grow = max(0, -(-length // self.block_size) - seq.num_blocks())
        need = [0] * len(self.pool_sizes)
        for p in self.group_pools:
            need[p] += grow
        return need

    def peak_blocks(self, length: int, chunk: int) -> int:
        """The most blocks a sequence of `length` tokens ever holds, fed in chunks of at most `chunk`
        tokens: sliding groups keep only their window, margin and one chunk."""
        return sum(self.pool_peaks(length, chunk))

    def pool_peaks(self, length: int, chunk: int) -> list[int]:
        """peak_blocks per pool."""
        peaks = pool_peaks(
            self.group_windows, self.group_pools, self.block_size, self.window_margin, length, chunk
        )
        return peaks + [0] * (len(self.pool_sizes) - len(peaks))

    def sequences_at_once(self, length: int, chunk: int) -> int:
        """How many sequences of `length` tokens the pools hold at their peaks together."""
        return min(
            size // peak for size, peak in zip(self.pool_sizes, self.pool_peaks(length, chunk)) if peak
        )

    def can_allocate(self, seq: SeqBlocks, length: int) -> bool:
        return all(n <= self.num_free(p) for p, n in enumerate(self.blocks_needed(seq, length)))

    def allocate(self, seq: SeqBlocks, length: int) -> None:
        """Grow every group's table to cover `length` tokens (all or nothing)."""
        need = self.blocks_needed(seq, length)
        if not self.can_allocate(seq, length):
            free = [self.num_free(p) for p in range(len(need))]
            raise MemoryError(f"need {need} blocks per pool, {free} free")
        want = -(-length // self.block_size)
        for table, pool in zip(seq.tables, self.group_pools):
            while len(table) < want:
                table.append(self._take(pool))

    def free_behind_windows(self, seq: SeqBlocks, computed: int) -> None:
        """Sliding groups drop blocks that no future query (rollback margin included) can reach."""
        for g, window in enumerate(self.group_windows):
            if not window:
                continue
            first_needed = computed - self.window_margin - window + 1  # oldest key a future query reads
            end = min(len(seq.tables[g]), max(0, first_needed) // self.block_size)
            for i in range(seq.freed[g], end):  # from where the last call stopped: O(blocks freed now)
                if seq.tables[g][i] != FREED:
                    self._release(seq.tables[g][i])
                    seq._set_freed(g, i)
            seq.freed[g] = max(seq.freed[g], end)

    def truncate(self, seq: SeqBlocks, length: int) -> None:
        """Give back the blocks past `length` tokens (after a rollback)."""
        want = -(-length // self.block_size)
        for table in seq.tables:
            while len(table) > want:
                self._release(table.pop())
        del seq.hashes[want:]
        seq._truncated()

    def release(self, seq: SeqBlocks) -> None:
        for table in seq.tables:
            for b in table:
                self._release(b)
            table.clear()
        seq.hashes.clear()
        seq._truncated()

    # Prefix cache.
    def register(
        self, seq: SeqBlocks, index: int, tokens: list[int], media: bytes, want_snapshot: bool
    ) -> int | None:
        """Register full logical block `index` (its tokens, media bytes). Returns a snapshot slot to fill
        when `want_snapshot` and the entry has none yet, else None."""
        if index != len(seq.hashes):
            raise ValueError(f"blocks are registered in order: next is {len(seq.hashes)}, got {index}")
        parent = seq.hashes[-1] if seq.hashes else b""
        key = chain_hash(parent, tokens, media)
        seq.hashes.append(key)
        entry = self.cache.get(key)
        if entry is None:
            blocks = tuple(t[index] for t in seq.tables)
            if FREED in blocks:
                return None  # a sliding block already freed: nothing complete to keep
            for b in blocks:
                self._incref(b)
                self.cached_blocks.add(b)
            entry = self.cache[key] = CacheEntry(blocks)
        self.cache.move_to_end(key)
        if want_snapshot and entry.snapshot is None and self.snapshots_free:
            entry.snapshot = self.snapshots_free.pop()
            return entry.snapshot
        return None

    def lookup(self, blocks: list[tuple[list[int], bytes]]) -> tuple[list[bytes], list[CacheEntry]]:
        """The cached entries matching a prompt's leading full blocks [(tokens, media)], in order."""
        keys, entries = [], []
        parent = b""
        for tokens, media in blocks:
            key = chain_hash(parent, tokens, media)
            entry = self.cache.get(key)
            if entry is None:
                break
            keys.append(key)
            entries.append(entry)
            parent = key
        return keys, entries

    def adopt(self, seq: SeqBlocks, keys: list[bytes], entries: list[CacheEntry]) -> None:
        """Start `seq` on cached blocks: share their physical blocks (read-only, they are full)."""
        if seq.num_blocks():
            raise ValueError("adopt() starts a fresh sequence")
        for key, entry in zip(keys, entries):
            for g, b in enumerate(entry.blocks):
                self._incref(b)
                seq.tables[g].append(b)
            seq.hashes.append(key)
            self.cache.move_to_end(key)
        self.stats["prefix_hits"] += 1 if entries else 0
        self.stats["prefix_hit_tokens"] += len(entries) * self.block_size

    def usage(self) -> dict[str, int]:
        free = sum(map(len, self.pool_free))
        used = self.num_blocks - free
        return {
            "total_blocks": self.num_blocks,
            "free_blocks": free,
            "used_blocks": used,
            "cached_entries": len(self.cache),
            "evictable_blocks": self.num_evictable,
            **self.stats,
        }

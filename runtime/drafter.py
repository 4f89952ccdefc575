"""The MTP heads' rounds (INKLING_SPEC §5 "Decoding"): after each step, every drafting sequence's heads
catch up over its new positions, and those that draft pick their tokens (the argmax of the shared unembedding).

ModelRunner owns the heads' programs, weights, KV caches and sconv states (and their CUDA graphs,
runtime/step_graphs.py); the Drafter builds each head pass's inputs, keeps the hidden-state ring the
heads read (h^0..h^{M-1} of each sequence's last HIDDEN_RING positions), and holds the draft pick's
lm_head: every real row, or the rows of the engine's draft vocabulary (builder/draft_vocab.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from builder.config import BuildConfig
from builder.contracts import HEAD, HEAD_PICK, HeadInputs, PickInputs
from inkling.published.config import InklingConfig

from .block_manager import FREED
from .device_state import DeviceState
from .device_tables import DeviceTables
from .program_inputs import add_media, cu_seqlens, media_splice, slot_mapping
from .sequence import Sequence
from .step_graphs import on_device, to_device

INPUT_IDS = HEAD.index("input_ids")
HIDDEN_RING = 16  # positions of h^1..h^{M-1} kept per sequence for the heads (>= max_draft_len + 1)
# Positions of h^0 (the trunk's rows) kept per sequence: deep enough that a round drafting nothing can leave
# the heads behind (`Drafter.stays_behind`: they catch up, in catch-up passes and a verify-shaped last one,
# when a sequence drafts again or its h^0 rows would otherwise leave the ring), so steps without drafts cost
# no head passes.
TRUNK_RING = 64
# The most positions of one sequence a catch-up pass takes (its graphs' q bound), and of all its sequences:
# a sequence left behind for TRUNK_RING steps catches up in one such pass a head, not in TRUNK_RING / 9
# verify-shaped ones (each reads the whole depth's weights: about 0.4 ms on an H100 at batch 1).
CATCHUP_PASS_TOKENS = 1024


@dataclass
class HeadWork:
    """One sequence's MTP round: its main-model computed length, the step's hidden states h^0 of
    positions fresh_start.. (rows of tokens fed this step that stay; fresh_offset: where they begin in
    the step's hidden states), and how many heads run and draft."""

    seq: Sequence | SeqView
    computed: int
    fresh_start: int
    fresh_rows: torch.Tensor | None
    num_heads: int
    num_drafts: int
    fresh_offset: int = 0

    def remote(self) -> HeadWork:
        """This work as a tensor-parallel worker takes it (runtime/worker.py): the sequence as a SeqView of
        what the heads read, the fresh rows as their offset in the worker's own step output."""
        return dataclasses.replace(self, seq=SeqView.of(self.seq, self.num_heads), fresh_rows=None)


@dataclass
class _Blocks:
    tables: list[list[int]]

    def row(self, g: int) -> np.ndarray:
        return np.asarray(self.tables[g], dtype=np.int32)


@dataclass
class SeqView:
    """What a round of the heads reads of a Sequence (runtime/sequence.py), for a worker that has no
    scheduler: its slot, the heads' computed positions, its length and tokens from `base` on, the block
    table of group 0, and the image/audio rows at positions from `base` on (host tensors)."""

    slot: int
    head_computed: list[int]
    length: int
    base: int
    tokens: list[int]
    blocks: _Blocks
    mm_positions: list[int]
    mm_embeds: torch.Tensor | None

    @classmethod
    def of(cls, seq: Sequence, num_heads: int) -> SeqView:
        base = min(seq.head_computed[:num_heads], default=len(seq)) + 1  # head m reads tokens from start + m
        base = min(base, len(seq))
        rows = [r for r, p in enumerate(seq.mm_positions) if p >= base]
        embeds = seq.mm_embeds[rows].cpu() if rows else None
        return cls(
            seq.slot, list(seq.head_computed), len(seq), base, seq.token_range(base, len(seq)),
            _Blocks([seq.blocks.row(0).tolist()]), [seq.mm_positions[r] for r in rows], embeds,
        )  # fmt: skip

    def __len__(self) -> int:
        return self.length

    def token_range(self, start: int, end: int) -> list[int]:
        if start < self.base and end > start:
            raise ValueError(f"this view holds tokens from {self.base}, not {start}")
        return self.tokens[start - self.base : end - self.base]


@dataclass
class Heads:
    """What the drafter runs: the head program (one for every head), each head's weights and the draft
    pick's lm_head, on the device whose state (runtime/device_state.py) holds the heads' KV and sconv
    states."""

    program: Any
    weights: list[dict[str, torch.Tensor]]
    lm_head: torch.Tensor
    state: DeviceState
    num_real_tokens: int  # rows of lm_head a draft may pick (its tokenizer's)
    splice_row: torch.Tensor  # the media splice's dummy row [1, H]
    mup: float  # the muP multiplier: a depth's logits are unembed(h / mup), no norm (INKLING_SERVING §1.2)


class Drafter:
    """The MTP heads' rounds. Their CUDA graphs (`head_graphs`, `draft_graphs`: StepGraphs of the head
    program alone and of `head_and_pick`) are set by whoever captures them (ModelRunner); None runs eager."""

    def __init__(
        self,
        heads: Heads,
        config: InklingConfig,
        build: BuildConfig,
        engine_config: dict,
        tables: DeviceTables | None = None,
    ):
        """tables: the sequences' block tables on the device (a one-rank engine's); None: built on the host
        from each sequence's own (a tensor-parallel worker's SeqView)."""
        self.heads, self.tables = heads, tables
        self.device, self.dtype, self.config = heads.splice_row.device, heads.splice_row.dtype, config
        self.num_heads = len(heads.weights)
        self.block_size, self.max_blocks_per_seq = build.tokens_per_block, build.max_blocks_per_seq
        self.max_pass_tokens = build.max_num_tokens  # the head programs' bound
        # catch-up passes (`_passes`): pieces of up to catchup_q positions, passes of up to catchup_tokens
        self.catchup_q = min(TRUNK_RING, build.max_seq_len, build.max_num_tokens)
        self.catchup_tokens = min(
            CATCHUP_PASS_TOKENS,
            build.max_num_tokens,
            build.max_seq_len,
            build.max_batch_size * self.catchup_q,
        )
        self.head_graphs = self.draft_graphs = self.catchup_graphs = None
        slots, H = build.max_batch_size, self.config.hidden_size
        levels = max(self.num_heads, 1)
        self.ring_len = [TRUNK_RING] + [HIDDEN_RING] * (levels - 1)
        self.hidden_ring = [
            torch.zeros(slots, n, H, dtype=self.dtype, device=self.device) for n in self.ring_len
        ]
        # each (level, slot)'s ring as a view made once: a write or read is then one slice, not three
        self.rings = [list(ring.unbind(0)) for ring in self.hidden_ring]
        self.ring_end = [[0] * slots for _ in range(levels)]
        # The draft pick's lm_head: every real row, or the rows of the engine's draft vocabulary (its own
        # copy, so a pick reads only those) and the ids they stand for.
        vocab = engine_config.get("draft_vocab") if self.num_heads else None
        lm_head = heads.lm_head
        self.draft_ids = None if vocab is None else torch.tensor(vocab, dtype=torch.long, device=self.device)
        self.draft_lm_head = lm_head if vocab is None else lm_head[self.draft_ids]
        self.num_draft_rows = heads.num_real_tokens if vocab is None else len(vocab)
        # A round's drafts, on the device: work item i's draft d at i * draft_stride + d. The head passes'
        # graphs read earlier drafts from here (input ids standing for unknown tokens) and write their picks
        # here; the last element takes the picks of rows that do not draft (padding, non-drafting items).
        self.draft_stride = max(build.max_draft_len, 1)
        self.drafted = torch.zeros(slots * self.draft_stride + 1, dtype=torch.long, device=self.device)

    def _fixed_args(self, m: int) -> dict:
        """Head m's fixed arguments: its weights, KV cache and sconv states."""
        state = self.heads.state
        return dict(
            weights=self.heads.weights[m - 1], key_cache=state.head_key_caches[m - 1],
            value_cache=state.head_value_caches[m - 1], conv_states=state.head_conv_states[m - 1],
        )  # fmt: skip

    def template_args(self, m: int, drafting: bool = False) -> list:
        """Head m's pass arguments (with the pick's, drafting) for a sequence of one token that touches
        nothing (no KV write, no state, its pick into the sink): the dtypes and devices of a real pass's,
        for the graphs' capture."""
        mb = self.max_blocks_per_seq
        inputs = HeadInputs(
            h_prev=self.heads.splice_row,
            input_ids=np.zeros(1, dtype=np.int64),
            mm_embeds=self.heads.splice_row,
            mm_positions=torch.tensor([1]),
            cu_seqlens_q=np.array([0, 1], dtype=np.int32),
            seq_lens=np.ones(1, dtype=np.int32),
            block_table=np.zeros((1, mb), dtype=np.int32),
            slot_mapping=np.full(1, -1, dtype=np.int64),
            state_indices=np.full(1, -1, dtype=np.int32),
            q_bound=np.zeros(1, dtype=np.int8),
        )
        fixed = self._fixed_args(m)
        if not drafting:
            return HEAD.arguments(inputs, **fixed)
        pick = PickInputs(
            np.zeros(1, dtype=np.int64), np.full(1, -1, dtype=np.int64), np.full(1, -1, dtype=np.int64)
        )
        return HEAD_PICK.arguments(inputs, pick, **fixed, drafted=self.drafted)

    @torch.no_grad()
    def run(self, work: list[HeadWork]) -> list[list[int]]:
        """Advance the MTP heads of each sequence and draft (INKLING_SPEC §5 "Decoding"); returns the
        drafts of each work item.

        Head m runs over the positions [seq.head_computed[m-1], end) where end is the main model's
        computed length P when the head drafts (m <= num_drafts: position P-1 reads the draft of head
        m-1 in place of the unknown token) and otherwise min(P, K-m), the positions whose inputs are
        all known (K = len(seq)): a head that does not draft stays current without an lm_head
        pass, so it can draft again later. Its input h^{m-1} comes from head m-1's output of this round
        or, for older positions, from the hidden-state ring (h^0: the step's hidden states).

        A work item that drafts nothing may leave its heads behind (`stays_behind`): its h^0 rows go into
        the trunk's ring, and a later round covers their positions.

        The drafts stay on the device until the last head has run: head m reads head m-1's draft from
        there (an input id written on the device), and host inputs travel from pinned memory, so the
        host prepares head m+1 while head m runs and waits once per round, not once per head.
        """
        if len(work) * self.draft_stride >= self.drafted.shape[0]:
            raise ValueError(
                f"an MTP round of {len(work)} sequences, the engine drafts for at most "
                f"{(self.drafted.shape[0] - 1) // self.draft_stride}"
            )
        num_drafts = [0] * len(work)  # drafts made so far, per work item
        fresh = [(w.fresh_start, w.fresh_rows) for w in work]  # level m-1: first position, rows
        # Level m's rows go into its ring once head m + 1 has read the older ones it needs: a write of many
        # rows (a prefill chunk, a catch-up) would drop them.
        unwritten, level = [(w.seq.slot, w.fresh_start, w.fresh_rows) for w in work], 0
        behind = [self.stays_behind(w) for w in work]
        catching_up = {
            i for i, w in enumerate(work) if w.seq.head_computed and w.seq.head_computed[0] < w.fresh_start
        }
        for m in range(1, max((w.num_heads for w in work), default=0) + 1):
            spans = {}
            for i, w in enumerate(work):
                if m > w.num_heads or behind[i]:
                    continue
                start = w.seq.head_computed[m - 1]
                end = w.computed if m <= w.num_drafts else min(w.computed, len(w.seq) - m)
                if end > start:
                    spans[i] = (start, end)
                else:
                    fresh[i] = (end, None)
            parts: dict[int, list[torch.Tensor]] = {i: [] for i in spans}
            passes = self._passes(spans, catching_up)
            for items, catchup in passes:
                drafting = [
                    j for j, (i, _, end) in enumerate(items) if m <= work[i].num_drafts and end == spans[i][1]
                ]
                args, cu = self._head_args(m, work, items, fresh, num_drafts, drafting)
                out = self._head_pass(m, args, bool(drafting), catchup)
                for j in drafting:
                    num_drafts[items[j][0]] += 1
                for j, (i, _, end) in enumerate(items):
                    rows_m = out[int(cu[j]) : int(cu[j + 1])]
                    # a graph's output rows live until head m's next replay: copied where it replays again
                    parts[i].append(rows_m if len(passes) == 1 else rows_m.clone())
                    work[i].seq.head_computed[m - 1] = end
            self._ring_write_many(m - 1, unwritten)
            for i, rows in parts.items():  # level m's rows of this round, for head m + 1
                fresh[i] = (spans[i][0], rows[0] if len(rows) == 1 else torch.cat(rows))
            unwritten = [(work[i].seq.slot, *fresh[i]) for i in parts] if m < self.num_heads else []
            level = m
        self._ring_write_many(level, unwritten)  # the last level run, or level 0 where no head ran
        if not any(num_drafts):
            return [[] for _ in work]
        drafts = self.drafted[: len(work) * self.draft_stride].view(len(work), -1)
        rows = drafts.tolist()  # the round's one wait for the device
        return [rows[i][:n] for i, n in enumerate(num_drafts)]

    def _passes(
        self, spans: dict[int, tuple[int, int]], catching_up: set[int] = frozenset()
    ) -> list[tuple[list[tuple[int, int, int]], bool]]:
        """A head's passes over the positions [start, end) of each work item (`spans`), each with whether it
        is a catch-up pass: each pass within the head programs' max_num_tokens, at most one piece of an
        item in a pass (its sconv state moves through the positions in order), an item's later pieces in
        later passes.

        An item `catching_up` (`stays_behind`) ends in a piece of a verify's positions (max_draft_len + 1),
        which holds every position that reads a draft and runs in the shapes an MTP round runs. The
        positions before it go first, in catch-up passes: pieces of up to catchup_q positions, passes of up
        to catchup_tokens, the shapes of the catch-up graphs (ModelRunner captures them at start-up: a
        pass of a shape not made yet may compile kernels or capture a graph for seconds, as measured on the
        H200). Other items go whole where they fit."""
        budget, size = self.max_pass_tokens, self.draft_stride + 1
        catchup, last = {}, {}
        for i, (start, end) in spans.items():
            if i in catching_up and end - start > size:
                catchup[i] = _cut(start, end - size, self.catchup_q)
                start = end - size
            last[i] = _cut(start, end, budget)
        return [(items, True) for items in _pack(catchup, min(budget, self.catchup_tokens))] + [
            (items, False) for items in _pack(last, budget)
        ]

    def stays_behind(self, w: HeadWork) -> bool:
        """Whether a decoding work item that drafts nothing this round leaves its heads where they are: while
        the trunk's ring still holds h^0 of every position head 1 has yet to cover, the heads catch up later
        (`_passes`), when the sequence drafts again or the ring would drop a row they need. A prompt's
        chunks never leave them behind: their catch-up would be a prefill's size. Steps without drafts then
        run no head pass at all (a pass is a whole Inkling block a depth: at batch 32 on an H100 they made
        such steps cost 2.4 times a plain one)."""
        if w.num_drafts or not w.seq.head_computed or w.seq.is_prefill:
            return False
        return w.computed - w.seq.head_computed[0] <= self.ring_len[0]

    def _head_pass(self, m: int, args: list, drafting: bool, catchup: bool = False) -> torch.Tensor:
        """Head m over `args` (`_head_args`): its rows [T, H]. A drafting pass also fills the ids that stand
        for earlier drafts and writes its picks into `drafted` (`head_and_pick`), all in one CUDA graph
        (draft_graphs) where there are graphs: the host launches nothing else for it. Without
        draft graphs (bench.e2e --eager_pick) the head's graph runs between the two, launched apart.
        A catch-up pass (`_passes`) replays the catch-up graphs."""
        # The rows stay in the graph's output buffer (copy=False): this round reads them before head m
        # replays again (run: the ring and head m + 1 copy them).
        if drafting and self.draft_graphs is not None:
            return self.draft_graphs(args, variant=m, copy=False)[0]
        n = len(HEAD.names)  # the head program's arguments (a drafting pass's pick inputs follow)
        graphs = self.catchup_graphs if catchup else self.head_graphs
        # The graphs stage the ragged arguments from the host themselves (cu_seqlens and seq_lens must stay
        # there); the program without graphs takes them on the device.
        head_args = list(args[:n]) if graphs is not None else [on_device(a, self.device) for a in args[:n]]
        if drafting:
            pick = {
                k: on_device(v, self.device)
                for k, v in HEAD_PICK.by_name(args).items()
                if k not in HEAD.names
            }
            ids = on_device(head_args[INPUT_IDS], self.device)
            head_args[INPUT_IDS] = self._fill_holes(ids, pick["hole_src"], pick["drafted"])
        out = (
            graphs(head_args, variant=m, copy=False)[0]
            if graphs is not None
            else self.heads.program(*head_args)
        )
        if drafting:
            self._store_picks(head_args[0], out, pick["pick_rows"], pick["pick_dst"], pick["drafted"])
        return out

    def head_and_pick(self, *args) -> torch.Tensor:
        """A drafting head pass (what draft_graphs captures; arguments as the HEAD_PICK contract): the input
        ids at rows with hole_src >= 0 are `drafted[hole_src]` (drafts of earlier heads), HeadProgram runs,
        and the draft picked from each sequence's row pick_rows[b] goes to drafted[pick_dst[b]] (pick_dst
        < 0: the buffer's last element, a sink). Returns the head's rows [T, H]."""
        a = HEAD_PICK.by_name(list(args))
        head_args = list(args[: len(HEAD.names)])
        head_args[INPUT_IDS] = self._fill_holes(a["input_ids"], a["hole_src"], a["drafted"])
        out = self.heads.program(*head_args)
        self._store_picks(a["weights"], out, a["pick_rows"], a["pick_dst"], a["drafted"])
        return out

    @staticmethod
    def _fill_holes(ids: torch.Tensor, hole_src: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        return torch.where(hole_src >= 0, drafted[hole_src.clamp(min=0)], ids)

    def _store_picks(self, weights: dict, out, pick_rows, pick_dst, drafted: torch.Tensor) -> None:
        picked = self._pick(weights, out, pick_rows)
        drafted[torch.where(pick_dst >= 0, pick_dst, drafted.shape[0] - 1)] = picked

    def _pick(self, weights: dict, out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The drafts of `out`'s rows `rows`, mapped through the draft vocabulary: the argmax of
        unembed(h / muP) over the real tokens or the draft vocabulary's (as the step's logits, in the
        engine's dtype; INKLING_SERVING §1: no norm). Over every row of the pick's lm_head, then sliced, as
        the step's logits (builder/network.py's `logits`: aligned GEMM rows)."""
        logits = (out[rows] / self.heads.mup @ self.draft_lm_head.T)[:, : self.num_draft_rows]
        picked = logits.float().argmax(-1)
        return picked if self.draft_ids is None else self.draft_ids[picked]

    def _head_args(
        self,
        m: int,
        work: list[HeadWork],
        items: list[tuple[int, int, int]],
        fresh: list[tuple[int, torch.Tensor | None]],
        num_drafts: list[int],
        drafting: list[int],
    ) -> tuple[list, np.ndarray]:
        """Head m's arguments over `items` (work item, first position, end), and its cu_seqlens (host).
        HeadProgram's arguments, the ragged ones on the host (the graphs send them in one copy), ids of
        unknown tokens 0; for a drafting pass (`drafting`: the items that draft) then the HEAD_PICK contract's pick inputs:
        each item's last row and where its draft goes in `drafted` (-1: it does not draft), each row's
        draft to read in place of its id (-1: the id is known), and `drafted`."""
        bs, stride = self.block_size, self.draft_stride
        lens = np.array([end - start for _, start, end in items], dtype=np.int64)
        cu = cu_seqlens(lens)
        T = int(cu[-1])
        ids = np.zeros(T, dtype=np.int64)
        hole_src = np.full(T, -1, dtype=np.int64)
        if self.tables is not None:
            table = self.tables.gather(
                [(work[i].seq.slot, work[i].seq.blocks) for i, _, _ in items], slice(0, 1)
            )[0]
        else:
            table = np.full((len(items), self.max_blocks_per_seq), FREED, dtype=np.int32)
        slots = np.empty(T, dtype=np.int64)
        h_prev, mm_rows, mm_pos = [], [], []
        for j, (i, start, end) in enumerate(items):
            seq, lo = work[i].seq, int(cu[j])
            h_prev.extend(self._head_inputs(m - 1, seq.slot, start, end, *fresh[i]))
            known = seq.token_range(start + m, min(end + m, len(seq)))  # later positions read drafts
            ids[lo : lo + len(known)] = known
            for r in range(len(known), end - start):
                d = start + m + r - len(seq)  # the draft that position start + r reads
                if d >= num_drafts[i] or not drafting:
                    raise RuntimeError(f"MTP head {m} reads draft {d} of a sequence that has {num_drafts[i]}")
                hole_src[lo + r] = i * stride + d
            add_media(seq, start + m, end + m, lo, mm_rows, mm_pos)  # head m at t reads token t + m
            blocks = seq.blocks.row(0)
            if self.tables is None:
                table[j, : len(blocks)] = blocks
            slots[lo : lo + end - start] = slot_mapping(blocks, np.arange(start, end), bs)
        mm_embeds, mm_positions = media_splice(mm_rows, mm_pos, self.heads.splice_row, T)
        # The host arguments as NumPy arrays: the graphs stage them as they are, and only a call without
        # graphs makes tensors of them (step_graphs.on_device).
        inputs = HeadInputs(
            h_prev=h_prev[0] if len(h_prev) == 1 else torch.cat(h_prev),
            input_ids=ids,
            mm_embeds=mm_embeds,
            mm_positions=mm_positions,
            cu_seqlens_q=cu,
            seq_lens=np.array([end for _, _, end in items], dtype=np.int32),
            block_table=table,
            slot_mapping=slots,
            state_indices=np.array([work[i].seq.slot for i, _, _ in items], dtype=np.int32),
            q_bound=np.zeros(int(lens.max()), dtype=np.int8),
        )
        fixed = self._fixed_args(m)
        if not drafting:
            return HEAD.arguments(inputs, **fixed), cu
        dst = np.full(len(items), -1, dtype=np.int64)
        for j in drafting:
            dst[j] = items[j][0] * stride + m - 1
        pick = PickInputs(pick_rows=cu[1:].astype(np.int64) - 1, pick_dst=dst, hole_src=hole_src)
        args = HEAD_PICK.arguments(inputs, pick, **fixed, drafted=self.drafted)
        return args, cu

    def _ring_write_many(self, level: int, writes: list[tuple[int, int, torch.Tensor | None]]) -> None:
        """`_ring_write` of every (slot, start, rows) of a round: one gathered copy into the level's rings
        (a concatenation and an index copy), not one or two copies a sequence (at batch 32 about 150
        launches of 15 µs of host time each, a round, bench/results/gpu-2026-12-06/mtp-batches/)."""
        writes = [w for w in writes if w[2] is not None and w[2].shape[0]]
        if len(writes) <= 1:
            for w in writes:
                self._ring_write(level, *w)
            return
        parts, dst = [], []
        n = self.ring_len[level]
        for slot, start, rows in writes:
            keep = min(rows.shape[0], n)
            end = start + rows.shape[0]
            parts.append(rows[-keep:])
            dst.append(slot * n + np.arange(end - keep, end) % n)
            self.ring_end[level][slot] = end
        index = to_device(torch.from_numpy(np.concatenate(dst)), self.device)
        ring = self.hidden_ring[level]
        ring.view(-1, ring.shape[-1]).index_copy_(0, index, torch.cat(parts).to(ring.dtype))

    def _ring_write(self, level: int, slot: int, start: int, rows: torch.Tensor | None) -> None:
        """Keep the last ring_len[level] rows of h^level for positions start.. (older ones drop out)."""
        if rows is None or rows.shape[0] == 0:
            return
        n = self.ring_len[level]
        keep = min(rows.shape[0], n)
        end = start + rows.shape[0]
        for (a, b), part in zip(_ring_spans(end - keep, end, n), _split_at(rows[-keep:], end - keep, n)):
            self.rings[level][slot][a:b].copy_(part)
        self.ring_end[level][slot] = end

    def _head_inputs(
        self, level: int, slot: int, start: int, end: int, fresh_start: int, fresh_rows: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """h^level at positions [start, end), in parts: the ring's before fresh_start, this round's rows
        from there on."""
        split = min(max(start, fresh_start), end) if fresh_rows is not None else end
        parts = []
        if split > start:
            ring_end, n = self.ring_end[level][slot], self.ring_len[level]
            if start < ring_end - n or split > ring_end:
                raise RuntimeError(
                    f"MTP hidden ring of level {level} holds positions [{ring_end - n}, {ring_end}), "
                    f"head needs [{start}, {split})"
                )
            ring = self.rings[level][slot]
            parts += [ring[a:b] for a, b in _ring_spans(start, split, n)]
        if end > split:
            parts.append(fresh_rows[split - fresh_start : end - fresh_start])
        return parts


def _ring_spans(start: int, end: int, size: int = HIDDEN_RING) -> list[tuple[int, int]]:
    """The rows of a ring of `size` that hold positions [start, end) (at most `size` of them) as one or two
    slices."""
    a, n = start % size, end - start
    if a + n <= size:
        return [(a, a + n)]
    return [(a, size), (0, a + n - size)]


def _split_at(rows: torch.Tensor, start: int, size: int = HIDDEN_RING) -> list[torch.Tensor]:
    """rows of positions start.. split where a ring of `size` wraps (as _ring_spans)."""
    first = size - start % size
    return [rows] if rows.shape[0] <= first else [rows[:first], rows[first:]]


def _cut(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """[start, end) in pieces of at most `step` positions counted back from the end (the first the
    shortest)."""
    cuts = [start, *range(end - (end - start - 1) // step * step, end, step), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _pack(pieces: dict[int, list[tuple[int, int]]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Passes of (item, start, end) within `budget` positions: at most one piece of an item a pass, its
    pieces in order, each pass taking every item's next piece that still fits."""
    pieces = {i: list(p) for i, p in pieces.items() if p}
    passes = []
    while pieces:
        items, left = [], budget
        for i in list(pieces):
            a, b = pieces[i][0]
            if b - a > left:
                continue
            items.append((i, *pieces[i].pop(0)))
            left -= b - a
            if not pieces[i]:
                del pieces[i]
        if not items:
            raise ValueError(f"a piece of {min(b - a for p in pieces.values() for a, b in p[:1])} positions "
                             f"does not fit a pass of {budget}")  # fmt: skip
        passes.append(items)
    return passes

"""LLMEngine: requests in, token and text deltas out, one `step()` at a time.

engine = LLMEngine(Engine.from_dir(path))
engine.add_request("a", PromptInput(input_ids), SamplingParams(max_tokens=32))
while engine.has_unfinished():
    for delta in engine.step(): ...

The engine coordinates; the roles live apart: the Scheduler picks each step's work, the BlockManager and
PrefixCache own the blocks, the ModelRunner the device, the SpeculativeDecoder MTP's drafts and their
verification, the OutputProcessor what a request gets back, and runtime/overlap.py the decode steps
launched ahead. A request that fails while it is served (its step, drafting, sampling, detokenizing) ends
with an error; the others and the engine go on (`_fail`, `_isolate`).
"""

from __future__ import annotations

import logging
import time

import torch
from tokenizers import Tokenizer

from builder.engine import Engine

from .block_manager import BlockManager
from .data_parallel import DataParallelGroup
from .distributed import Workers
from .expert_load import ExpertLoad
from .metrics import EngineStats
from .model_runner import ModelRunner
from .outputs import OutputProcessor, RequestState, StreamDelta
from .overlap import LaunchedStep, make_picks, successor, takes_pick
from .params import SamplingParams
from .prefix_cache import PrefixCache
from .requests import Admission, PromptInput
from .sampler import sample, sample_tokens
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .spec_decode import SpeculativeDecoder

__all__ = ["LLMEngine", "PromptInput", "StreamDelta"]

MAX_FAILURES = 3  # failed batches a request may be in before it is ended, though it never failed alone
log = logging.getLogger("runtime.engine")


class LLMEngine:
    def __init__(
        self,
        engine: Engine,
        num_blocks: int | None = None,
        seed: int = 0,
        device: str | None = None,
        workers: Workers | None = None,
        cuda_graphs: bool | None = None,
        pad_eager: bool = False,
        overlap: bool | None = None,
        compile: bool | None = None,
        max_prefill_pairs: int | None = None,
        decode_slowdown: float | None = None,
        draft_costs: bool | None = None,
        dp: DataParallelGroup | None = None,
    ):
        """workers: the other ranks of a tensor-parallel engine (runtime/distributed.py; LLM starts them).
        cuda_graphs: decode/verify steps and MTP head passes replay CUDA graphs per batch bucket (CUDA
        engines with the Triton plugins; None: on for one such rank, runtime.model_runner.default_cuda_graphs).
        pad_eager (tests): the same padding to the buckets, run eager (runtime/step_graphs.py).
        overlap: launch the next decode step before the host has the current one's tokens, where that
        step is certain (see `step`); None: on for a one-rank CUDA engine (tensor-parallel: opt in).
        compile: torch.compile the programs (None: as the engine was built).
        max_prefill_pairs: beside decoding sequences, a prefill chunk's tokens x (context + tokens) stay
        within this (runtime/scheduler.py), bounding their inter-token latency while a long prompt fills.
        decode_slowdown: beside decoding sequences, prefill chunks are paced so that those sequences' mean
        step stays within this multiple of a decode-only step (runtime/scheduler.py PrefillPacer).
        draft_costs: MTP rounds are timed and their drafts capped where more do not pay at the batch's size
        (runtime/speculative.py RoundCosts); None: on for CUDA engines. Off, a sequence's drafts follow its
        acceptance alone, and seeded sampled requests draw the same tokens whatever the timing.
        dp: this engine is a replica of a data-parallel engine (runtime/data_parallel.py): each `step` runs
        the step program exactly once, a step of padding where it has nothing to run, and never overlaps."""
        self.runner = ModelRunner(engine, num_blocks, device, workers, cuda_graphs, pad_eager, compile, dp)
        # Tensor-parallel ranks opt in (the picks reach the other ranks by a broadcast) until that path has
        # run on GPUs.
        default = self.runner.device.type == "cuda" and workers is None
        self.overlap = (default if overlap is None else overlap) and dp is None  # replicas never overlap
        self.build = bc = engine.build_config
        self.config = engine.model_config
        self.tokenizer = Tokenizer.from_str(engine.tokenizer_json) if engine.tokenizer_json else None
        self.num_real_tokens = self.runner.num_real_tokens
        eos_ids = stop_token_ids(engine)
        self.blocks = BlockManager(
            self.runner.num_blocks,
            bc.tokens_per_block,
            engine.config["cache_layout"]["group_windows"],
            bc.max_draft_len,
            self.runner.num_snapshots,
            self.runner.group_pools,
            self.runner.pool_sizes,
        )
        self.scheduler = Scheduler(
            self.blocks, bc.max_batch_size, bc.max_num_tokens, max_prefill_pairs=max_prefill_pairs,
            decode_slowdown=decode_slowdown,
        )  # fmt: skip
        log.info("%s", self.capacity())
        self.prefix = PrefixCache(self.blocks, self.runner, bc.max_draft_len)
        self.spec = SpeculativeDecoder(self.runner, self.blocks, bc.max_draft_len, self.num_real_tokens)
        if not (self.runner.device.type == "cuda" if draft_costs is None else draft_costs):
            self.spec.round_costs = None
        self.stats = EngineStats()
        layout = engine.config["cache_layout"]
        self.load = ExpertLoad(layout.get("moe_layers", []), layout.get("num_experts", 0), bc.ep_size)
        self.runner.read_expert_load()  # start-up's warm-up and capture runs are nobody's load
        self._load_read_at = float("-inf")
        self._load_summary: dict = {}
        self.outputs = OutputProcessor(self.tokenizer, eos_ids, self.stats)
        self.admission = Admission(
            self.config, bc, self.blocks, self.scheduler, self.runner.num_heads, self.runner.device,
            self.outputs, seed,
        )  # fmt: skip
        self.requests: dict[str, RequestState] = {}
        self._inflight: LaunchedStep | None = None  # an overlapped step not yet completed
        self._held: list[StreamDelta] = []  # deltas of a step completed outside `step` (see `_drain`)
        self._completed: list[ScheduledSeq] | None = None  # the step the current `step` call completed

    # Requests.
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        state = self.admission.admit(request_id, prompt, params)
        self.requests[request_id] = state
        self.scheduler.add(state.seq)

    def validate(self, ids: list[int], params: SamplingParams, prompt: PromptInput) -> None:
        """Raise ValueError with a clear message for a request this engine cannot serve."""
        self.admission.validate(ids, params, prompt)

    def try_add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> StreamDelta | None:
        """add_request for servers: a request the engine refuses comes back as its one delta (finish_reason
        "rejected", the reason in `error`) instead of raising ValueError; None when it was added."""
        try:
            self.add_request(request_id, prompt, params)
        except ValueError as e:
            return StreamDelta(request_id, "", [], "rejected", len(prompt.input_ids), 0, error=str(e))
        return None

    def abort_all(self) -> list[StreamDelta]:
        """Abort every request (abort_request), returning their final deltas."""
        return [d for rid in list(self.requests) if (d := self.abort_request(rid)) is not None]

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Cancel: frees its blocks and slot at once. Returns its final delta (None if unknown)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        return self.outputs.delta(state, [], "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # A step.
    def step(self) -> list[StreamDelta]:
        """Run one step and return its deltas.

        With overlap, a step that gives every sequence one token (no drafts or MTP) leaves its picks
        (argmax or draw) on the device, and the step that must follow it (every running sequence feeds that
        token; nobody waits) is launched before the host reads them: the host builds step n+1's inputs while
        the GPU runs step n. A sequence that then turns out to have finished (eos, a stop string, an abort)
        wasted one token of work in step n+1, whose results for it are dropped; its blocks and slot go back
        at once, and any later use of them is queued behind step n+1 on the same stream."""
        start, steps = time.perf_counter(), self.runner.dp_steps
        self._completed = None
        try:
            return self._step()
        finally:
            if self.runner.dp is not None and self.runner.dp_steps == steps:
                self.runner.idle_step()  # nothing ran (or it failed first): the other replicas' step waits
            seconds = time.perf_counter() - start
            self.stats.step_seconds += seconds
            if self._completed is not None:  # what this call's completed step cost its sequences
                self.scheduler.record_step(self._completed, seconds)

    def _step(self) -> list[StreamDelta]:
        deltas, self._held = self._held, []
        launched, self._inflight = self._inflight, None
        if launched is None or all(s.seq.finished for s in launched.batch):
            batch = self.scheduler.schedule(on_admit=self.prefix.lookup)
            try:
                launched = self._launch(batch)
            except Exception as e:
                return deltas + self._isolate(batch, e, "its step")
        if launched is None:
            return deltas
        failed = None
        if launched.picks is not None and (follow := successor(launched, self.scheduler, self.blocks)):
            batch, rows = follow
            ids = launched.picks
            if rows != list(range(len(launched.batch))):
                ids = ids[self.runner.to_device(torch.tensor(rows))]  # not waiting for the step in flight
            try:
                self._inflight = self._launch(batch, ids)
                self.stats.overlapped_steps += 1
            except Exception as e:  # `launched` is sound: complete it, then isolate the successor's sequences
                failed = (batch, e)
        deltas += self._complete(launched, followed=self._inflight is not None)
        self._completed = launched.batch
        return deltas + (self._isolate(*failed, "its step") if failed else [])

    def _drain(self) -> None:
        """Complete the overlapped step in flight, if any; its deltas come with the next `step`."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._held += self._complete(launched)

    def _launch(
        self, batch: list[ScheduledSeq], input_ids: torch.Tensor | None = None
    ) -> LaunchedStep | None:
        """Start the step of `batch` (input_ids: its tokens on the device, for a successor step). The
        caches will hold its tokens: num_computed counts them from here on."""
        if not batch:
            return None
        for s in batch:
            if s.start == 0:
                self.runner.reset_slot(s.seq.slot)  # a fresh sequence: x[t<0] = 0
            if s.seq.restore_snapshot is not None:
                self.runner.restore_snapshot(s.seq.slot, s.seq.restore_snapshot)
                s.seq.restore_snapshot = None
        logits, out_rows, hidden = self.runner.run(batch, input_ids)
        self.stats.steps += 1
        for s in batch:
            s.seq.num_computed += s.num_tokens
        step = LaunchedStep(batch, logits, out_rows, hidden)
        drafts_next = self._drafts_next(batch, ahead=1 if input_ids is None else 2)
        if self.overlap and all(takes_pick(s, input_ids is not None, drafts_next) for s in batch):
            generators = [self.requests[s.seq.request_id].generator for s in batch]
            make_picks(step, logits[:, : self.num_real_tokens], generators)  # one row per sequence
        return step

    def _drafts_next(self, batch: list[ScheduledSeq], ahead: int) -> bool:
        """Whether the step after this decode step of `batch` may draft (ahead: this step and the one in flight
        before it, if any, not yet recorded): False where no sequence will (`plans_no_drafts`), so that the
        steps of sequences asking for MTP overlap while the policy keeps their drafts off."""
        if not self.overlap:
            return True
        mtp = [s for s in batch if s.seq.params.num_draft_tokens]
        if not mtp or not self.runner.num_heads:
            return False
        if any(s.num_tokens != 1 or s.seq.is_prefill for s in mtp):
            return True
        states = [self.requests[s.seq.request_id] for s in mtp]
        return not self.spec.plans_no_drafts(states, len(batch), ahead)

    def _complete(self, step: LaunchedStep, followed: bool = False) -> list[StreamDelta]:
        """Sample (or take the picks of) a launched step, emit its tokens, settle blocks, run the heads.
        followed: the step after it is already running (overlapped), without drafts."""
        try:
            picks, logprobs = step.host_picks()
            logits, rows = step.logits, step.rows
            # Greedy verification: every row's argmax in one read (not one wait for the device a sequence).
            argmaxes = None
            if picks is None and any(s.samples and s.num_drafts and s.seq.params.greedy for s in step.batch):
                argmaxes = logits[:, : self.num_real_tokens].argmax(-1).tolist()
            sampled = (
                self.spec.verify_sampled(
                    step.batch, logits, rows, lambda seq: self.requests[seq.request_id].draft_generator
                )
                if picks is None
                else {}
            )
            draws = self._draws(step) if picks is None else {}
        except Exception as e:
            return self._isolate(step.batch, e, "sampling")
        deltas, heads = [], []
        offset = 0
        for b, s in enumerate(step.batch):
            seq, lo = s.seq, offset
            offset += s.num_tokens
            if seq.finished:  # finished or aborted while this overlapped step ran: its results are void
                continue
            prompt_part = max(0, min(seq.num_prompt, s.start + s.num_tokens) - s.start)
            self.stats.prefill_tokens += prompt_part
            self.stats.decode_tokens += s.num_tokens - prompt_part
            try:
                delta = None
                if s.samples:
                    pick = None if picks is None else (picks[b], None if logprobs is None else logprobs[b])
                    pick = (draws[b], None) if b in draws else pick
                    targets = None if argmaxes is None else argmaxes[rows[b] : rows[b + 1]]
                    delta = self._sample(s, logits[rows[b] : rows[b + 1]], pick, targets, sampled.get(b))
                if delta is None or delta.finish_reason is None:
                    self.prefix.register(seq)
                    self.blocks.free_behind_windows(seq.blocks, seq.num_computed)
                    if seq.params.num_draft_tokens and self.runner.num_heads:
                        # this step's rows that stay (not those of the overlapped successor's token)
                        kept = min(seq.num_computed, s.start + s.num_tokens) - s.start
                        heads.append(
                            (self.requests[seq.request_id], step.hidden[lo : lo + kept], s.start, lo)
                        )
            except Exception as e:
                deltas.append(self._fail(seq, e, "sampling"))
                continue
            if delta is not None:
                deltas.append(delta)
                if delta.finish_reason is not None:
                    self.requests.pop(seq.request_id, None)
                    self.scheduler.finish(seq, delta.finish_reason)
        self.runner.flush_rollbacks()  # the rejected drafts' sconv rollbacks, all sequences' at once
        if not heads:
            self.spec.no_round()
        else:
            try:
                decode = all(
                    s.num_tokens == s.num_drafts + 1 and s.start >= s.seq.num_prompt for s in step.batch
                )
                self.spec.draft(heads, len(step.batch) if decode else None, followed)
            except Exception as e:
                return deltas + self._isolate([ScheduledSeq(h[0].seq, 0, 0) for h in heads], e, "drafting")
        for s in step.batch:  # an isolated sequence that recomputed alone past where its batch failed
            if s.seq.isolate_until and s.seq.num_computed >= s.seq.isolate_until:
                s.seq.isolate_until = 0
        return deltas

    def _draws(self, step: LaunchedStep) -> dict[int, int]:
        """The token of each sequence of a step not overlapped that samples one row, with no drafts to verify
        and no logprobs asked (batch index -> token), drawn for all of them at once: sampler.sample_tokens,
        the draws row-by-row sampling makes from each request's generator, one filter and softmax a group
        of params, one read. (A step whose sequences want MTP is never overlapped: without this its rows
        were drawn one softmax over the vocabulary at a time.)"""
        rows = [
            b
            for b, s in enumerate(step.batch)
            if s.samples and not s.num_drafts and not s.seq.finished and s.seq.params.logprobs is None
        ]
        if len(rows) < 2:
            return {}
        seqs = [step.batch[b].seq for b in rows]
        logits = step.logits[[step.rows[b] for b in rows], : self.num_real_tokens]
        generators = [self.requests[seq.request_id].generator for seq in seqs]
        return dict(zip(rows, sample_tokens(logits, [seq.params for seq in seqs], generators).tolist()))

    def _sample(
        self,
        s: ScheduledSeq,
        logits: torch.Tensor,
        pick: tuple[int, float | None] | None = None,
        targets: list[int] | None = None,
        sampled: list[int] | None = None,
    ) -> StreamDelta:
        """The sequence's next tokens from its rows of logits: one sample (or `pick`, the token already
        drawn on the device and its logprob), or with MTP drafts their verification (SpeculativeDecoder:
        `targets` the rows' argmaxes, `sampled` the tokens rejection sampling drew), emitting 1..k+1 tokens. Rolls the
        caches back over rejected drafts."""
        seq = s.seq
        state = self.requests[seq.request_id]
        params = seq.params
        real = logits[:, : self.num_real_tokens]
        k = s.num_drafts
        top = None
        if pick is not None:  # never with top logprobs asked (overlap.takes_pick)
            tokens, logprobs = [pick[0]], (None if params.logprobs is None else [pick[1]])
        elif k == 0:
            out = sample(real[0], params, state.generator)
            tokens, logprobs = [out.token], ([out.logprob] if out.logprob is not None else None)
            top = None if out.top_logprobs is None else [out.top_logprobs]
        else:
            tokens, logprobs, top = self.spec.verify(state, k, real, targets, sampled)
        if s.num_tokens - k == 1 and seq.output_ids and params.num_draft_tokens:  # a decode step
            self.spec.record(state, k, len(tokens) - 1)
        seq.drafts = []
        emitted, finish = self.outputs.append(state, tokens)
        if logprobs is not None:
            logprobs = logprobs[: len(emitted)]
        if top is not None:
            top = top[: len(emitted)]
        if finish is None and k:
            self.spec.discard_rejected(seq)
        self.outputs.record_tokens(state, len(emitted))
        return self.outputs.delta(state, emitted, finish, logprobs, top)

    # Failures.
    def _fail(self, seq: Sequence, error: Exception, stage: str) -> StreamDelta:
        """End one request with an error (frees its blocks and slot); nothing else is touched."""
        log.error("request %s failed during %s", seq.request_id, stage, exc_info=error)
        state = self.requests.pop(seq.request_id)
        self.scheduler.finish(seq, "error")
        self.stats.failed_requests += 1
        return self.outputs.failed(state, f"request failed during {stage}: {type(error).__name__}: {error}")

    def _isolate(self, batch: list[ScheduledSeq], error: Exception, stage: str) -> list[StreamDelta]:
        """A failure of work done for a whole batch. Its device state is suspect for every sequence in it, so
        each is preempted (recomputed from its tokens, which is exact) and then runs alone up to where the
        batch failed (Scheduler.isolating): one that fails alone, or in MAX_FAILURES batches, is ended."""
        live = [s for s in batch if not s.seq.finished]
        deltas = []
        for s in live:
            seq = s.seq
            seq.num_failures += 1
            if len(live) == 1 or seq.num_failures >= MAX_FAILURES:
                deltas.append(self._fail(seq, error, stage))
                continue
            seq.isolate_until = max(seq.isolate_until, s.start + s.num_tokens, seq.num_computed, 1)
            self.scheduler.preempt(seq)
        if live and not deltas:
            log.warning(
                "a batch of %d failed during %s (%s): isolating its requests", len(live), stage, error
            )
        return deltas

    # Rollback (tests and tools; MTP verification rolls back through SpeculativeDecoder).
    def rollback(self, request_id: str, n: int) -> None:
        """Drop the last n generated tokens of a running sequence as if it never had them: their KV
        (by length), sliding window and sconv state. At most max_draft_len computed tokens, never
        into the prompt or a registered (shared) block. With an overlapped step in flight, that step is
        completed first and its token, which `step` has not returned yet, is dropped as well (one more
        token of the sconv history)."""
        self._drain()
        if request_id not in self.requests:
            raise ValueError(f"no running request {request_id!r}")
        state = self.requests[request_id]
        seq = state.seq
        unseen = sum(len(d.token_ids) for d in self._held if d.request_id == request_id)
        if not 0 <= n <= len(seq.output_ids) - unseen:
            raise ValueError(f"cannot roll back {n} of {len(seq.output_ids) - unseen} generated tokens")
        n += unseen
        new_len = len(seq) - n
        new_computed = min(seq.num_computed, new_len - 1)
        if new_computed < len(seq.blocks.hashes) * self.blocks.block_size:
            raise ValueError("cannot roll back into a block already shared through the prefix cache")
        self.runner.rollback(seq.slot, seq.num_computed - new_computed)
        self._held = [d for d in self._held if d.request_id != request_id]
        seq.num_computed = new_computed
        self.spec.roll_back_heads(seq, new_len)
        del seq.output_ids[len(seq.output_ids) - n :]
        self.blocks.truncate(seq.blocks, new_len)
        if state.detok is not None:
            state.detok = self.outputs.new_detokenizer()
            state.detok.add(list(seq.output_ids))
            state.emitted = state.stop_checked = min(state.emitted, len(state.detok.text))

    def capacity(self) -> str:
        """What the caches hold, said at start-up: the block pool and its bytes (the MTP depths' apart),
        and how many sequences of max_seq_len it serves at once (a request that can never fit is refused
        at admission; one that cannot fit now waits, or preempts a running one)."""
        state, bc = self.runner.state, self.build
        gib = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**30
        main = gib([*state.key_caches, *state.value_caches])
        heads = gib([*state.head_key_caches, *state.head_value_caches])
        per_seq = self.blocks.peak_blocks(bc.max_seq_len, self.scheduler.chunk_size)
        at_once = self.blocks.sequences_at_once(bc.max_seq_len, self.scheduler.chunk_size)
        pools = (
            ""
            if len(self.blocks.pool_sizes) == 1
            else f" ({'+'.join(map(str, self.blocks.pool_sizes))} by kind)"
        )
        return (
            f"KV cache: {self.blocks.num_blocks} blocks{pools} of {bc.tokens_per_block} tokens, {main:.2f} GiB "
            f"(+ {heads:.2f} GiB for {self.runner.num_heads} MTP depths); {at_once} "
            f"sequences of max_seq_len {bc.max_seq_len} at once ({per_seq} blocks each)"
        )

    # Metrics.
    @property
    def acceptance(self):
        """Acceptance over every MTP step of the engine's life."""
        return self.spec.acceptance

    def cache_stats(self) -> dict:
        return {
            **self.blocks.usage(),
            **self.stats.counters(),
            **self.acceptance.counters(),
            **self.expert_load_stats(refresh=not self.has_unfinished()),  # idle: the read costs nothing
            **self.runner.graph_stats(),  # step and head calls graphed or eager, captures
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }

    LOAD_READ_INTERVAL_S = 1.0  # the expert load's device read (a sync) at most this often

    def expert_load_stats(self, refresh: bool = False) -> dict:
        """The MoE's expert load (runtime/expert_load.py), read from the device at most once a
        LOAD_READ_INTERVAL_S unless `refresh`: `moe_routed_choices` (tokens times top_k over the layers),
        `moe_expert_tokens` and `moe_rank_tokens` (over the engine's life), `moe_expert_imbalance` and
        `moe_rank_imbalance` (max over mean, of the loads between the last two reads that saw tokens: what
        the recent steps report), and `moe_ep_size`."""
        now = time.monotonic()
        if refresh or now - self._load_read_at >= self.LOAD_READ_INTERVAL_S:
            self._load_read_at = now
            self.load.add(self.runner.read_expert_load())
            total, window = self.load.summary(), self.load.window()
            if window.sum() or not self._load_summary:  # an idle window keeps the last busy one's imbalance
                recent = self.load.summary(window)
                self._load_summary["moe_expert_imbalance"] = recent["expert_imbalance"]
                self._load_summary["moe_rank_imbalance"] = recent["rank_imbalance"]
            self._load_summary |= {
                "moe_routed_choices": total["routed_choices"],
                "moe_expert_tokens": total["expert_tokens"],
                "moe_rank_tokens": total["rank_tokens"],
                "moe_ep_size": total["ep_size"],
            }
        return dict(self._load_summary)

    def metrics(self) -> dict[str, float]:
        """Latency means over the engine's life (time to first token, inter-token latency), cache usage."""
        return self.stats.summary(self.blocks.usage(), self.scheduler.num_preemptions, self.acceptance)


def stop_token_ids(engine: Engine) -> set[int]:
    """The ids that end a request: the config's EOS and its generation_config.json's (200006,
    `<|content_model_end_sampling|>`, on the published model)."""
    config = engine.model_config
    ids = {config.eos_token_id} if config.eos_token_id is not None else set()
    eos = (engine.generation_config or {}).get("eos_token_id")
    ids |= set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
    return ids

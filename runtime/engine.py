"""LLMEngine: requests in, token and text deltas out, one `step()` at a time.

engine = LLMEngine(Engine.from_dir(path))
engine.add_request("a", PromptInput(input_ids), SamplingParams(max_tokens=32))
while engine.has_unfinished():
    for delta in engine.step(): ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from builder.engine import Engine

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .distributed import Workers
from .model_runner import HeadWork, ModelRunner
from .params import SamplingParams
from .sampler import filter_logits, make_generator, sample, sample_token
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .speculative import (
    AcceptanceStats,
    accept_targets,
    greedy_accept,
    next_num_drafts,
    one_hot_probs,
    rejection_sample,
)

DRAFT_SEED_SALT = 0x5DEECE66D  # a request's MTP rejection-sampling generator: its seed XOR this


@dataclass
class PromptInput:
    """A processed prompt: token ids, and the embeddings of its image/audio pad tokens (in order)."""

    input_ids: torch.Tensor  # [T] int64
    mm_embeds: torch.Tensor | None = None  # [M, H]
    mm_positions: torch.Tensor | None = None  # [M] positions in input_ids


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    acceptance_length: float = 1.0
    acceptance_rate: float = 0.0
    error: str | None = None
    metrics: dict[str, float] | None = None  # on the final delta: ttft_s, itl_s (mean), e2e_s, tokens_per_s

    def merge(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by `later` of the same request, as one: text and tokens joined, the rest
        (counts, acceptance, finish, metrics) as of `later`."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge deltas of {self.request_id} and {later.request_id}")
        logprobs = (
            None
            if self.logprobs is None and later.logprobs is None
            else (self.logprobs or []) + (later.logprobs or [])
        )
        return dataclasses.replace(
            later, text=self.text + later.text, token_ids=self.token_ids + later.token_ids, logprobs=logprobs
        )


@dataclass
class RequestState:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None  # on the engine's device: sampling
    draft_generator: torch.Generator | None  # on the CPU: MTP rejection sampling
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    emitted: int = 0  # characters of detok.text already streamed
    steps: int = 0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)


@dataclass
class LaunchedStep:
    """A step whose program is on its way (on a GPU it runs while the host goes on): its batch and
    outputs, and, where each sequence takes one token from one row, those picks (argmax or draw) made on
    the device and copied to the host without waiting (`ready` says when they are there)."""

    batch: list[ScheduledSeq]
    logits: torch.Tensor
    rows: list[int]
    hidden: torch.Tensor
    picks: torch.Tensor | None = None  # [B] int64 on the device: the next step's input ids
    picks_host: torch.Tensor | None = None
    logprobs_host: torch.Tensor | None = None  # [B] float32: each pick's logprob (NaN where not asked)
    ready: torch.cuda.Event | None = None


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
    ):
        """workers: the other ranks of a tensor-parallel engine (runtime/distributed.py; LLM starts them).
        cuda_graphs: decode/verify steps and MTP head passes replay CUDA graphs per batch bucket (CUDA
        engines with the Triton plugins; None: on for one such rank, runtime.model_runner.default_cuda_graphs). pad_eager (tests): the same padding
        to the buckets, run eager (runtime/step_graphs.py).
        overlap: launch the next decode step before the host has the current one's tokens, where that
        step is certain (see `step`); None: on for a one-rank CUDA engine (tensor-parallel: opt in)."""
        self.runner = ModelRunner(engine, num_blocks, device, workers, cuda_graphs, pad_eager)
        # Tensor-parallel ranks opt in (the picks reach the other ranks by a broadcast) until that path has
        # run on GPUs.
        self.overlap = self.runner.device.type == "cuda" and workers is None if overlap is None else overlap
        bc = engine.build_config
        self.build = bc
        self.config = engine.model_config
        self.tokenizer = Tokenizer.from_str(engine.tokenizer_json) if engine.tokenizer_json else None
        self.num_real_tokens = (
            self.tokenizer.get_vocab_size(with_added_tokens=True)
            if self.tokenizer
            else self.config.vocab_size
        )
        self.eos_ids = {self.config.token_ids["eos"]} if "eos" in self.config.token_ids else set()
        self.blocks = BlockManager(
            self.runner.num_blocks,
            bc.tokens_per_block,
            engine.config["cache_layout"]["group_windows"],
            bc.max_draft_len,
            self.runner.num_snapshots,
        )
        self.scheduler = Scheduler(self.blocks, bc.max_batch_size, bc.max_num_tokens)
        self.requests: dict[str, RequestState] = {}
        self.seed = seed
        self.num_requests = 0
        # overlapped_steps: steps launched before the previous step's tokens were on the host.
        self.stats = {
            "prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "generated_tokens": 0, "overlapped_steps": 0,
            "step_seconds": 0.0,  # the host's wall time inside step(), over the engine's life
            "first_tokens": 0, "ttft_seconds": 0.0,  # requests that got a first token; their TTFTs, summed
        }  # fmt: skip
        self.latency: dict[str, list[float]] = {"ttft_s": [], "itl_s": []}
        self.acceptance = AcceptanceStats()  # over every MTP step of the engine's life
        # Tests only: replace the heads' drafts before verification, (request_id, tokens, drafts) -> drafts.
        self.draft_override = None
        self._inflight: LaunchedStep | None = None  # an overlapped step not yet completed
        self._held: list[StreamDelta] = []  # deltas of a step completed outside `step` (see `_drain`)

    # Requests.
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = prompt.input_ids.tolist()
        self.validate(ids, params, prompt)
        positions = prompt.mm_positions.tolist() if prompt.mm_positions is not None else []
        embeds = prompt.mm_embeds
        digests = {}
        if positions:
            rows = embeds.detach().to("cpu", torch.float32).contiguous()
            digests = {p: hashlib.sha256(rows[i].numpy().tobytes()).digest() for i, p in enumerate(positions)}
        seq = Sequence(request_id, ids, params, positions, embeds, digests)
        seq.head_computed = [0] * min(params.num_draft_tokens, self.runner.num_heads)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + self.num_requests) % 2**63
        self.num_requests += 1
        generator = None if params.greedy else make_generator(seed, self.runner.device)
        draft_generator = None  # a stream of its own: the same seed would correlate it with `generator`
        if not params.greedy and params.num_draft_tokens:
            draft_generator = make_generator(seed ^ DRAFT_SEED_SALT)
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        self.requests[request_id] = RequestState(seq, detok, generator, draft_generator)
        self.scheduler.add(seq)

    def validate(self, ids: list[int], params: SamplingParams, prompt: PromptInput) -> None:
        """Raise ValueError with a clear message for a request this engine cannot serve."""
        bc = self.build
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > bc.max_input_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, the engine's max_input_len is {bc.max_input_len}"
            )
        if len(ids) + params.max_tokens > bc.max_seq_len:
            raise ValueError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the engine's max_seq_len {bc.max_seq_len}"
            )
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        need = self.blocks.peak_blocks(len(ids) + params.max_tokens, min(self.scheduler.chunk_size, len(ids)))
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need} cache blocks, the pool has {self.blocks.num_blocks}")
        m = 0 if prompt.mm_positions is None else len(prompt.mm_positions)
        if m != (0 if prompt.mm_embeds is None else prompt.mm_embeds.shape[0]):
            raise ValueError("mm_embeds and mm_positions disagree in length")
        if params.num_draft_tokens > self.runner.num_heads:
            raise ValueError(
                f"num_draft_tokens {params.num_draft_tokens} exceeds this engine's {self.runner.num_heads} MTP "
                f"heads (the model's {self.config.num_mtp_heads}, at most max_draft_len "
                f"{self.build.max_draft_len}; none if built without heads)"
            )

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
        return self._delta(state, [], "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # A step.
    def step(self) -> list[StreamDelta]:
        """Run one step and return its deltas.

        With overlap, a step that gives every sequence one token (no drafts or MTP) leaves
        its picks (argmax or draw) on the device, and the step that must follow it (every running
        sequence feeds that token; nobody waits) is launched before the host reads them: the host
        builds step n+1's inputs while the GPU runs step n. A sequence that then turns out to have
        finished (eos, a stop string, an abort) wasted one token of work in step n+1, whose results for
        it are dropped; its blocks and slot go back at once, and any later use of them is queued behind
        step n+1 on the same stream."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats["step_seconds"] += time.perf_counter() - start

    def _step(self) -> list[StreamDelta]:
        held, self._held = self._held, []
        launched, self._inflight = self._inflight, None
        if launched is None or all(s.seq.finished for s in launched.batch):
            launched = self._launch(self.scheduler.schedule(on_admit=self._lookup_prefix))
        if launched is None:
            return held
        if launched.picks is not None:
            self._inflight = self._launch_successor(launched)
        return held + self._complete(launched)

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
        logits, rows, hidden = self.runner.run(batch, input_ids)
        self.stats["steps"] += 1
        for s in batch:
            s.seq.num_computed += s.num_tokens
        step = LaunchedStep(batch, logits, rows, hidden)
        if self.overlap and all(self._takes_pick(s, successor=input_ids is not None) for s in batch):
            real = logits[:, : self.num_real_tokens]  # one row per sequence
            step.picks = self._picks(batch, real)
            logprobs = self._pick_logprobs(batch, real, step.picks)
            if step.picks.is_cuda:
                # Pinned buffers from torch's caching host allocator, which reuses one only after the
                # copy into it has run.
                step.picks_host = torch.empty(len(batch), dtype=torch.long, pin_memory=True)
                step.picks_host.copy_(step.picks, non_blocking=True)
                if logprobs is not None:
                    step.logprobs_host = torch.empty(len(batch), dtype=logprobs.dtype, pin_memory=True)
                    step.logprobs_host.copy_(logprobs, non_blocking=True)
                step.ready = torch.cuda.Event()
                step.ready.record()
            else:
                step.picks_host, step.logprobs_host = step.picks, logprobs
        return step

    @staticmethod
    def _takes_pick(s: ScheduledSeq, successor: bool) -> bool:
        """Whether the sequence's next token is drawn on the device from its one row of this step, with
        nothing for the host to read (a successor's sequences sample, though the token they feed is not
        in `seq.tokens` yet)."""
        samples = s.samples or successor
        return samples and not s.num_drafts and not s.seq.params.num_draft_tokens

    def _picks(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """Each sequence's next token from its row of `logits`, on the device: the argmax, or a draw
        from the request's generator (the draw `_sample` would make, so the tokens are the same)."""
        if all(s.seq.params.greedy for s in batch):
            return logits.argmax(-1)
        return torch.stack(
            [
                sample_token(row, s.seq.params, self.requests[s.seq.request_id].generator)
                for s, row in zip(batch, logits)
            ]
        )

    @staticmethod
    def _pick_logprobs(
        batch: list[ScheduledSeq], logits: torch.Tensor, picks: torch.Tensor
    ) -> torch.Tensor | None:
        """Each pick's logprob where its request asks for logprobs (as `sample` computes it), else NaN;
        None where nobody asks."""
        if all(s.seq.params.logprobs is None for s in batch):
            return None
        nan = torch.full((), float("nan"), device=logits.device)
        return torch.stack(
            [
                torch.log_softmax(row.float(), -1)[pick] if s.seq.params.logprobs is not None else nan
                for s, row, pick in zip(batch, logits, picks)
            ]
        )

    def _launch_successor(self, step: LaunchedStep) -> LaunchedStep | None:
        """The step that follows `step` whatever its tokens turn out to be, launched now; None where the
        scheduler has a choice to make (a request waits, a running sequence sat out `step`, blocks run
        short) or tests override drafts."""
        live = [s for s in step.batch if not s.seq.finished]
        if self.scheduler.waiting or self.draft_override is not None:
            return None
        if {id(s.seq) for s in live} != {id(seq) for seq in self.scheduler.running}:
            return None
        batch, rows = [], []
        # Oldest first, as the scheduler orders decoding sequences: the same batch layout as without
        # overlap (`step` may have put a sequence that finished its prompt last).
        for b, s in sorted(enumerate(step.batch), key=lambda x: x[1].seq.arrival):
            seq = s.seq
            if seq.finished or len(seq.output_ids) + 1 >= seq.params.max_tokens:
                continue  # done, or done with this step's token
            position = s.start + s.num_tokens  # of the token `step` picks
            if not self.blocks.can_allocate(seq.blocks, position + 1):
                return None
            self.blocks.allocate(seq.blocks, position + 1)
            batch.append(ScheduledSeq(seq, position, 1))
            rows.append(b)
        if not batch:
            return None
        ids = step.picks
        if rows != list(range(len(step.batch))):
            ids = ids[self.runner.to_device(torch.tensor(rows))]  # not waiting for the step in flight
        self.stats["overlapped_steps"] += 1
        return self._launch(batch, ids)

    def _complete(self, step: LaunchedStep) -> list[StreamDelta]:
        """Sample (or take the picks of) a launched step, emit its tokens, settle blocks, run the heads."""
        picks = logprobs = None
        if step.picks_host is not None:
            if step.ready is not None:
                step.ready.synchronize()
            picks = step.picks_host.tolist()
            if step.logprobs_host is not None:
                logprobs = step.logprobs_host.tolist()
        logits, rows, hidden = step.logits, step.rows, step.hidden
        # Greedy verification: every row's argmax in one read (not one wait for the device a sequence).
        argmaxes = None
        if picks is None and any(s.samples and s.num_drafts and s.seq.params.greedy for s in step.batch):
            argmaxes = logits[:, : self.num_real_tokens].argmax(-1).tolist()
        verify_probs = self._verify_probs(step.batch, logits, rows) if picks is None else {}
        deltas, heads = [], []
        offset = 0
        for b, s in enumerate(step.batch):
            seq = s.seq
            if seq.finished:  # finished or aborted while this overlapped step ran: its results are void
                offset += s.num_tokens
                continue
            prompt_part = max(0, min(seq.num_prompt, s.start + s.num_tokens) - s.start)
            self.stats["prefill_tokens"] += prompt_part
            self.stats["decode_tokens"] += s.num_tokens - prompt_part
            delta = None
            if s.samples:
                pick = None if picks is None else (picks[b], None if logprobs is None else logprobs[b])
                targets = None if argmaxes is None else argmaxes[rows[b] : rows[b + 1]]
                delta = self._sample(s, logits[rows[b] : rows[b + 1]], pick, targets, verify_probs.get(b))
            if delta is None or delta.finish_reason is None:
                self._register_blocks(seq)
                self.blocks.free_behind_windows(seq.blocks, seq.num_computed)
                if seq.params.num_draft_tokens and self.runner.num_heads:
                    kept = seq.num_computed - s.start
                    heads.append((seq, hidden[offset : offset + kept], s.start, offset))
            if delta is not None:
                deltas.append(delta)
                if delta.finish_reason is not None:
                    self.requests.pop(seq.request_id, None)
                    self.scheduler.finish(seq, delta.finish_reason)
            offset += s.num_tokens
        self.runner.flush_rollbacks()  # the rejected drafts' sconv rollbacks, all sequences' at once
        if heads:
            self._draft(heads)
        return deltas

    def _verify_probs(
        self, batch: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]
    ) -> dict[int, torch.Tensor]:
        """The target distributions of the sampled verifies in `batch` (after temperature, top-k, top-p, over
        the real tokens), on the host in one read rather than one wait for the device a sequence: batch
        index -> [k + 1, V]."""
        want = [
            b
            for b, s in enumerate(batch)
            if s.samples and s.num_drafts and not s.seq.params.greedy and not s.seq.finished
        ]
        if not want:
            return {}
        real = logits[:, : self.num_real_tokens]
        parts = [
            torch.softmax(filter_logits(real[rows[b] : rows[b + 1]], batch[b].seq.params), -1) for b in want
        ]
        return dict(zip(want, torch.cat(parts).cpu().split([len(p) for p in parts])))

    def _sample(
        self,
        s: ScheduledSeq,
        logits: torch.Tensor,
        pick: tuple[int, float | None] | None = None,
        targets: list[int] | None = None,
        probs: torch.Tensor | None = None,
    ) -> StreamDelta:
        """The sequence's next tokens from its rows of logits: one sample (or `pick`, the token already
        drawn on the device and its logprob), or with MTP drafts their verification (greedy: exact match,
        against `targets`, the rows' argmaxes, where given; sampling: rejection sampling against `probs`,
        the rows' target distributions on the host, from `_verify_probs`), emitting 1..k+1 tokens. Rolls the
        caches back over rejected drafts."""
        seq = s.seq
        state = self.requests[seq.request_id]
        params = seq.params
        real = logits[:, : self.num_real_tokens]
        k = s.num_drafts
        decode = s.num_tokens - k == 1 and bool(seq.output_ids)
        if pick is not None:
            tokens, logprobs = [pick[0]], (None if params.logprobs is None else [pick[1]])
        elif k == 0:
            out = sample(real[0], params, state.generator)
            tokens, logprobs = [out.token], ([out.logprob] if out.logprob is not None else None)
        else:
            drafts = seq.drafts[:k]
            if params.greedy:
                tokens, _ = (
                    greedy_accept(drafts, real) if targets is None else accept_targets(drafts, targets)
                )
            else:
                # Heads over a draft vocabulary may pick an id past the tokenizer's: the target gives it
                # probability 0, so it is rejected and nothing after it is read.
                n = next((i for i, d in enumerate(drafts) if d >= self.num_real_tokens), k)
                q = one_hot_probs(drafts[:n], probs.shape[-1])
                tokens = rejection_sample(drafts[:n], q, probs[: n + 1], state.draft_generator)
            logprobs = None
            if params.logprobs is not None:
                logp = torch.log_softmax(real.float(), -1)
                logprobs = [float(logp[i, t]) for i, t in enumerate(tokens)]
        if decode and params.num_draft_tokens:
            state.acceptance.update(k, len(tokens) - 1)
            self.acceptance.update(k, len(tokens) - 1)
        seq.drafts = []
        # Emit up to the first stop (eos, stop token, max_tokens).
        finish = None
        emitted = []
        for token in tokens:
            seq.output_ids.append(token)
            emitted.append(token)
            if token in self.eos_ids and not params.ignore_eos or token in params.stop_token_ids:
                finish = "stop"
            elif len(seq.output_ids) >= params.max_tokens:
                finish = "length"
            if finish:
                break
        if logprobs is not None:
            logprobs = logprobs[: len(emitted)]
        if finish is None and k:
            back = seq.num_computed - (len(seq) - 1)  # rejected drafts fed this step
            self.runner.rollback(seq.slot, back, defer=True)  # applied with the step's others (_complete)
            seq.num_computed -= back
            self.blocks.truncate(seq.blocks, len(seq))
            self._settle_heads(seq, defer=True)
        self.stats["generated_tokens"] += len(emitted)
        now = time.perf_counter()
        if state.first_token_time is None:
            state.first_token_time = now
            self.latency["ttft_s"].append(now - state.arrival_time)
            self.stats["first_tokens"] += 1
            self.stats["ttft_seconds"] += now - state.arrival_time
        else:
            self.latency["itl_s"].extend([(now - state.last_token_time) / len(emitted)] * len(emitted))
        state.last_token_time = now
        delta = self._delta(state, emitted, finish, logprobs)
        if delta.finish_reason is not None:  # length, eos, stop token or stop string
            delta.metrics = self._request_metrics(state)
        return delta

    # MTP drafting.
    def _settle_heads(self, seq: Sequence, defer: bool = False) -> None:
        """After verification: roll each head back to its states whose inputs are all real tokens.

        The heads' last round stood on drafts head_drafts from token index drafts_from on; those that
        equal the tokens now known count as real. Head m's state at position t reads tokens up to t+m,
        so it stays valid iff t + m < drafts_from + (number of head drafts that proved right)."""
        if seq.drafts_from is None:
            return
        known = seq.token_range(seq.drafts_from, len(seq))
        right = 0
        while right < min(len(known), len(seq.head_drafts)) and known[right] == seq.head_drafts[right]:
            right += 1
        counts = []
        for m in range(1, len(seq.head_computed) + 1):
            valid = min(seq.head_computed[m - 1], seq.drafts_from + right - m)
            counts.append(seq.head_computed[m - 1] - valid)
            seq.head_computed[m - 1] = valid
        self.runner.rollback_heads(seq.slot, counts, defer=defer)
        seq.head_drafts, seq.drafts_from = [], None

    def _draft(self, heads: list[tuple[Sequence, torch.Tensor, int, int]]) -> None:
        """Run the MTP heads of the sequences that stepped: catch up over new positions and draft the
        next step's tokens (num_drafts from the acceptance policy)."""
        work = []
        for seq, rows, start, offset in heads:
            state = self.requests[seq.request_id]
            self._settle_heads(seq)
            requested = min(seq.params.num_draft_tokens, self.runner.num_heads)
            num_drafts = 0
            if not seq.is_prefill:  # the next step feeds one token: draft behind it
                remaining = seq.params.max_tokens - len(seq.output_ids) - 1
                num_drafts = min(
                    next_num_drafts(state.acceptance, requested), remaining, self.build.max_draft_len
                )
            work.append(HeadWork(seq, seq.num_computed, start, rows, requested, max(num_drafts, 0), offset))
        drafts = self.runner.run_heads(work)
        for w, d in zip(work, drafts):
            if d:
                w.seq.drafts = list(d)
                w.seq.head_drafts = list(d)
                w.seq.drafts_from = len(w.seq)
            if self.draft_override is not None and d:
                w.seq.drafts = list(self.draft_override(w.seq.request_id, list(w.seq.tokens), list(d)))

    def _delta(
        self, state: RequestState, new: list[int], finish: str | None, logprobs: list[float] | None = None
    ) -> StreamDelta:
        seq = state.seq
        text = ""
        if state.detok is not None:
            if new:
                state.detok.add(new)  # special tokens (eos included) decode to nothing
            if finish is not None:
                state.detok.flush()
            full = state.detok.text
            cut = self._stop_at(full, seq.params.stop)
            if cut is not None:
                full, finish = full[:cut], "stop"
            # Hold back what could still become a stop string.
            hold = 0 if finish is not None else max((len(s) - 1 for s in seq.params.stop), default=0)
            ready = max(state.emitted, len(full) - hold)
            text, state.emitted = full[state.emitted : ready], ready
        acc = state.acceptance
        return StreamDelta(
            seq.request_id, text, new, finish, seq.num_prompt, len(seq.output_ids), logprobs,
            acc.mean_acceptance_length if acc.steps else 1.0, acc.acceptance_rate,
        )  # fmt: skip

    @staticmethod
    def _request_metrics(state: RequestState) -> dict[str, float]:
        n = len(state.seq.output_ids)
        e2e = state.last_token_time - state.arrival_time
        decode = state.last_token_time - state.first_token_time
        return {
            "ttft_s": state.first_token_time - state.arrival_time,
            "itl_s": decode / (n - 1) if n > 1 else 0.0,
            "e2e_s": e2e,
            "tokens_per_s": n / e2e if e2e > 0 else 0.0,
        }

    @staticmethod
    def _stop_at(text: str, stops: tuple[str, ...]) -> int | None:
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        return min(hits) if hits else None

    # Prefix cache.
    def _block_media(self, seq: Sequence, index: int) -> bytes:
        bs = self.blocks.block_size
        return b"".join(seq.mm_digests.get(p, b"") for p in range(index * bs, (index + 1) * bs))

    def _lookup_prefix(self, seq: Sequence) -> None:
        """On admission: start on the longest cached prefix that ends at a restore point, leaving at
        least one token to compute (its logits give the first sample). Not for MTP requests: the prefix
        cache keeps the main model's states only, and the heads need theirs from position 0."""
        if seq.params.num_draft_tokens:
            seq.restore_snapshot = None
            return
        bs = self.blocks.block_size
        tokens = seq.tokens
        full = (len(tokens) - 1) // bs
        keys, entries = self.blocks.lookup(
            [(tokens[i * bs : (i + 1) * bs], self._block_media(seq, i)) for i in range(full)]
        )
        n = max((i + 1 for i, e in enumerate(entries) if e.snapshot is not None), default=0)
        seq.restore_snapshot = None
        if n:
            self.blocks.adopt(seq.blocks, keys[:n], entries[:n])
            seq.num_computed = n * bs
            seq.restore_snapshot = entries[n - 1].snapshot

    def _register_blocks(self, seq: Sequence) -> None:
        """Register the full blocks that can no longer be rolled back: prompt blocks at once, others
        max_draft_len tokens later. A block whose end the sconv history still holds becomes a restore
        point (its sconv inputs are saved). Registered blocks are shared, so they are never rolled back."""
        bs = self.blocks.block_size
        settled = max(min(seq.num_prompt, seq.num_computed), seq.num_computed - self.build.max_draft_len)
        for index in range(len(seq.blocks.hashes), settled // bs):
            back = seq.num_computed - (index + 1) * bs
            restorable = back <= self.runner.state_rows - self.runner.K1
            snap = self.blocks.register(
                seq.blocks,
                index,
                seq.token_range(index * bs, (index + 1) * bs),
                self._block_media(seq, index),
                restorable,
            )
            if snap is not None:
                self.runner.save_snapshot(seq.slot, snap, back)

    # Rollback (MTP verification uses it).
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
        seq.drafts, seq.head_drafts, seq.drafts_from = [], [], None
        counts = []
        for m in range(1, len(seq.head_computed) + 1):  # head m at t reads tokens up to t + m
            valid = max(0, min(seq.head_computed[m - 1], new_len - 1 - m))
            counts.append(seq.head_computed[m - 1] - valid)
            seq.head_computed[m - 1] = valid
        self.runner.rollback_heads(seq.slot, counts)
        del seq.output_ids[len(seq.output_ids) - n :]
        self.blocks.truncate(seq.blocks, new_len)
        if state.detok is not None:
            state.detok = IncrementalDetokenizer(self.tokenizer)
            state.detok.add(list(seq.output_ids))
            state.emitted = min(state.emitted, len(state.detok.text))

    # Metrics.
    def cache_stats(self) -> dict:
        return {
            **self.blocks.usage(),
            **self.stats,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }

    def metrics(self) -> dict[str, float]:
        """Latency means over the engine's life (time to first token, inter-token latency), cache usage."""
        out: dict[str, float] = {}
        for name, values in self.latency.items():
            out[f"mean_{name}"] = sum(values) / len(values) if values else 0.0
        usage = self.blocks.usage()
        out["cache_usage"] = usage["used_blocks"] / usage["total_blocks"]
        out["generated_tokens"] = self.stats["generated_tokens"]
        out["preemptions"] = self.scheduler.num_preemptions
        acc = self.acceptance
        out["mean_acceptance_length"] = acc.mean_acceptance_length if acc.steps else 1.0
        out["acceptance_rate"] = acc.acceptance_rate
        for i, rate in enumerate(acc.acceptance_rates):
            out[f"acceptance_rate_{i + 1}"] = rate
        return out

"""What a request gets back: its tokens up to the first stop, incremental text, stop strings, deltas and
per-request metrics (the engine's output processor)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from inkling.detokenizer import IncrementalDetokenizer

from .metrics import EngineStats
from .sequence import Sequence
from .speculative import AcceptanceStats


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "rejected" (never admitted) or "error"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None  # each token's, where the request asks (SamplingParams.logprobs)
    top_logprobs: list[dict[int, float]] | None = None  # each token's most likely alternatives, where asked
    acceptance_length: float = 1.0
    acceptance_rate: float = 0.0
    error: str | None = None  # why a request was rejected or ended by an error
    metrics: dict[str, float] | None = None  # on the final delta: ttft_s, itl_s (mean), e2e_s, tokens_per_s

    def merge(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by `later` of the same request, as one: text and tokens joined, the rest
        (counts, acceptance, finish, metrics) as of `later`."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge deltas of {self.request_id} and {later.request_id}")
        return dataclasses.replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=_joined(self.logprobs, later.logprobs),
            top_logprobs=_joined(self.top_logprobs, later.top_logprobs),
        )


def _joined(a: list | None, b: list | None) -> list | None:
    return None if a is None and b is None else (a or []) + (b or [])


@dataclass
class RequestState:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None  # on the engine's device: sampling
    draft_generator: torch.Generator | None  # on the CPU: MTP rejection sampling
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    emitted: int = 0  # characters of detok.text already streamed
    stop_checked: int = 0  # characters of detok.text already searched for stop strings
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """The first index of any stop string in `text` that ends past `start` (text before it was searched
    already): a search over the new tail only, not the whole text."""
    hits = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


class OutputProcessor:
    """Turns the tokens a step gives a request into its delta: stops (eos, stop tokens, max_tokens, stop
    strings), incremental detokenizing that never splits a character, text held back while it could
    still become a stop string, and the request's latencies (into the engine's histograms)."""

    def __init__(self, tokenizer: Tokenizer | None, eos_ids: set[int], stats: EngineStats):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stats = stats

    def new_detokenizer(self) -> IncrementalDetokenizer | None:
        return IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None

    def append(self, state: RequestState, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append `tokens` to the request's output up to the first stop (eos, a stop token, max_tokens):
        (the tokens appended, the finish reason or None)."""
        seq, params = state.seq, state.seq.params
        emitted: list[int] = []
        for token in tokens:
            seq.output_ids.append(token)
            emitted.append(token)
            if token in self.eos_ids and not params.ignore_eos or token in params.stop_token_ids:
                return emitted, "stop"
            if len(seq.output_ids) >= params.max_tokens:
                return emitted, "length"
        return emitted, None

    def record_tokens(self, state: RequestState, n: int) -> None:
        """Latency of `n` tokens that arrived now: the first one's time to first token, the rest spread
        evenly over the time since the previous ones (inter-token latency)."""
        now = time.perf_counter()
        if state.first_token_time is None:
            state.first_token_time = now
            ttft = now - state.arrival_time
            self.stats.ttft.observe(ttft)
            self.stats.first_tokens += 1
            self.stats.ttft_seconds += ttft
        elif n:
            self.stats.itl.observe((now - state.last_token_time) / n, n)
        state.last_token_time = now
        self.stats.generated_tokens += n

    def delta(
        self,
        state: RequestState,
        new: list[int],
        finish: str | None,
        logprobs: list[float] | None = None,
        top_logprobs: list[dict[int, float]] | None = None,
    ) -> StreamDelta:
        """The request's delta for tokens `new`; a stop string in the text ends it ("stop")."""
        seq = state.seq
        text = ""
        if state.detok is not None:
            if new:
                state.detok.add(new)  # special tokens (eos included) decode to nothing
            if finish is not None:
                state.detok.flush()
            full = state.detok.text
            cut = find_stop(full, seq.params.stop, state.stop_checked) if seq.params.stop else None
            state.stop_checked = len(full)
            if cut is not None:
                full, finish = full[:cut], "stop"
            # Hold back what could still become a stop string.
            hold = 0 if finish is not None else max((len(s) - 1 for s in seq.params.stop), default=0)
            ready = max(state.emitted, len(full) - hold)
            text, state.emitted = full[state.emitted : ready], ready
        acc = state.acceptance
        delta = StreamDelta(
            seq.request_id, text, new, finish, seq.num_prompt, len(seq.output_ids), logprobs,
            top_logprobs, acc.mean_acceptance_length if acc.steps else 1.0, acc.acceptance_rate,
        )  # fmt: skip
        if finish in ("stop", "length"):
            delta.metrics = self.request_metrics(state)
            self.stats.e2e.observe(delta.metrics["e2e_s"])
        return delta

    @staticmethod
    def failed(state: RequestState, error: str) -> StreamDelta:
        """The last delta of a request ended by an error while it was served."""
        seq = state.seq
        return StreamDelta(
            seq.request_id, "", [], "error", seq.num_prompt, len(seq.output_ids), error=error,
            acceptance_length=state.acceptance.mean_acceptance_length if state.acceptance.steps else 1.0,
            acceptance_rate=state.acceptance.acceptance_rate,
        )  # fmt: skip

    @staticmethod
    def request_metrics(state: RequestState) -> dict[str, float]:
        n = len(state.seq.output_ids)
        e2e = state.last_token_time - state.arrival_time
        decode = state.last_token_time - state.first_token_time
        return {
            "ttft_s": state.first_token_time - state.arrival_time,
            "itl_s": decode / (n - 1) if n > 1 else 0.0,
            "e2e_s": e2e,
            "tokens_per_s": n / e2e if e2e > 0 else 0.0,
        }

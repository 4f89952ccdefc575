"""inkling: the runtime's engine loop behind Triton (decoupled, in-flight batching).

execute() only parses and submits. The engine steps every request in flight together, in a process of
its own (runtime.engine_process, its child runtime.engine_child), so that this stub's Python work never holds up a step; parameter
`engine_process` "0" runs it on a thread of the stub instead. It hands each delta to `on_delta`, which
queues it; one sender thread turns deltas into responses, so the engine never waits on Triton. Where
the sender falls behind, the deltas of a request queued by then go out as one response (never a
request's first delta: the first token goes out alone); a request with `stream` false gets one
response at its end (and, when its request parameter `ack` is true, an empty one first: a BLS caller's
exec() returns on the first response, and the pipeline's wait must stay free to see its client cancel). The sender also notices cancelled requests (client cancel or disconnect) and
aborts them in the runtime, which frees their cache blocks at once, and publishes the cache statistics
as gauges on Triton's metrics endpoint. If the engine process dies, its requests in flight end with an
error and another one is started; until it serves, execute() answers UNAVAILABLE. An engine built with
tp_size N runs on N ranks: the LLM inside the engine is rank 0 and starts the other N-1 as worker
processes (runtime/distributed.py); `finalize` stops them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from builder.engine import read_engine_config
from model_repo.tensors import (
    RequestError,
    error,
    get,
    load_model_config,
    parameter,
    scalar,
    string_tensor,
    strings,
    tensor,
    text,
)
from runtime import EngineLoop, PromptInput, SamplingParams, StreamDelta
from runtime.data_parallel_front import start_engine
from runtime.engine_process import EngineGone

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
CANCEL_CHECK_S = 0.05  # how often a stream's cancellation is polled (an IPC round trip)
METRICS_PERIOD_S = 0.1
RESTART_TRIES, RESTART_BACKOFF_S = 3, 2.0  # a dead engine process: new ones tried, seconds between (× try)
CACHE_GAUGES = ("free_blocks", "used_blocks", "evictable_blocks", "total_blocks")
REQUEST_GAUGES = ("running", "waiting")
# The engine's running totals: its steps, the host's seconds inside them, the tokens they computed,
# the requests that got a first token and their times to it (from arrival in the engine), summed; the
# prefix cache's queried and hit tokens, preemptions, and MTP's drafting steps, drafts and acceptances.
ENGINE_GAUGES = (
    "steps",
    "step_seconds",
    "prefill_tokens",
    "decode_tokens",
    "generated_tokens",
    "overlapped_steps",
    "first_tokens",
    "ttft_seconds",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "preemptions",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    *(f"spec_accepted_{i}" for i in range(1, 9)),  # per draft position (AcceptanceStats.counters)
)

# The MoE's expert load (runtime/expert_load.py): routed choices (tokens times top_k over the MoE layers), the
# recent expert and rank imbalance (max over mean), the expert-parallel size the ranks are counted at; and
# per expert and per rank the tokens routed there over the engine's life (summed over the MoE layers).
MOE_GAUGES = ("moe_routed_choices", "moe_expert_imbalance", "moe_rank_imbalance", "moe_ep_size")
MOE_LISTS = {"moe_expert_tokens": "expert", "moe_rank_tokens": "rank"}


@dataclass
class InFlight:
    sender: Any
    triton_id: str
    stream: bool = True
    pending: StreamDelta | None = None  # not streamed: the deltas so far, merged
    checked_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    responded: bool = False  # a response has gone out


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = load_model_config(args)
        engine_dir = parameter(cfg, "engine_dir")
        engine = read_engine_config(engine_dir)
        pretrained = engine["pretrained_config"]  # the real Inkling's nests its text model's sizes
        self.hidden_size = int(pretrained.get("text_config", pretrained)["hidden_size"])
        self.dtype = getattr(torch, engine["dtype"])
        num_blocks = int(parameter(cfg, "num_blocks", "0")) or None
        num_threads = int(parameter(cfg, "num_threads", "0"))
        switch = {"auto": None, "1": True, "0": False}
        options = dict(
            num_blocks=num_blocks,
            cuda_graphs=switch[parameter(cfg, "cuda_graphs", "auto")],
            overlap=switch[parameter(cfg, "overlap", "auto")],
            max_prefill_pairs=int(parameter(cfg, "max_prefill_pairs", "0")) or None,
            decode_slowdown=float(parameter(cfg, "decode_slowdown", "0")) or None,
        )
        self.finalizing = False
        if parameter(cfg, "engine_process", "1") == "1":
            self.new_engine = functools.partial(
                start_engine, engine_dir, num_threads=num_threads, on_exit=self._engine_exited, **options
            )
            self.loop = self.new_engine()
        else:
            if num_threads:
                torch.set_num_threads(num_threads)
            self.loop = EngineLoop(engine_dir, **options)
        self.in_flight: dict[str, InFlight] = {}
        self.lock = threading.Lock()
        self.outbox: queue.Queue[StreamDelta | None] = queue.Queue()
        self.started: set[str] = set()  # requests whose first delta was drained (sender thread only)
        self._init_metrics()
        self.sender = threading.Thread(target=self._send_loop, name="inkling-sender", daemon=True)
        self.sender.start()

    # Requests in.
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            acked = False
            try:
                abort_ids = strings(request, "abort_request_id")
                if abort_ids:
                    self._abort(text(abort_ids[0], "abort_request_id"))
                    sender.send(flags=FINAL)
                    continue
                prompt, params = self._parse(request)
                stream = bool(scalar(request, "stream", True, bool))
                if not stream and _wants_ack(request):
                    # An empty response now: a BLS caller's exec() returns on the first response, and one
                    # that waits for an unstreamed answer must stay free to notice its client's cancel.
                    sender.send(pb_utils.InferenceResponse(output_tensors=[]))
                    acked = True
                rid = uuid.uuid4().hex
                with self.lock:
                    self.in_flight[rid] = InFlight(sender, request.request_id(), stream, responded=acked)
                try:
                    self.loop.submit(rid, prompt, params, self.outbox.put)
                except BaseException:
                    with self.lock:
                        self.in_flight.pop(rid, None)
                    raise
            except (RequestError, ValueError) as e:
                _fail(sender, acked, str(e), "rejected")
            except EngineGone as e:  # a new engine process is on its way (_engine_exited)
                _fail(sender, acked, f"{e}; restarting it", "error", pb_utils.TritonError.UNAVAILABLE)
            except Exception as e:  # a bad request must never take the model down
                _fail(sender, acked, f"inkling failed: {type(e).__name__}: {e}", "error")
        return None

    def _parse(self, request: Any) -> tuple[PromptInput, SamplingParams]:
        ids = get(request, "input_ids")
        if ids is None or ids.size == 0:
            raise RequestError("input_ids is required and must not be empty")
        if ids.ndim != 1:
            raise RequestError(f"input_ids must be 1-D, got shape {list(ids.shape)}")
        embeds, positions = get(request, "mm_embeds"), get(request, "mm_positions")
        prompt = PromptInput(torch.from_numpy(ids.astype(np.int64)))
        if embeds is not None or positions is not None:
            prompt = self._media(prompt, embeds, positions)
        stop = [text(s, "stop_words") for s in strings(request, "stop_words")]
        seed = scalar(request, "random_seed", None, int)
        params = SamplingParams(
            max_tokens=scalar(request, "max_tokens", SamplingParams.max_tokens, int),
            temperature=scalar(request, "temperature", SamplingParams.temperature, float),
            top_k=scalar(request, "top_k", SamplingParams.top_k, int),
            top_p=scalar(request, "top_p", SamplingParams.top_p, float),
            seed=seed,
            stop=tuple(s for s in stop if s),
            num_draft_tokens=scalar(request, "num_draft_tokens", SamplingParams.num_draft_tokens, int),
            ignore_eos=bool(scalar(request, "ignore_eos", False, bool)),
            logprobs=_num_logprobs(request),
        )
        return prompt, params

    def _media(
        self, prompt: PromptInput, embeds: np.ndarray | None, positions: np.ndarray | None
    ) -> PromptInput:
        if embeds is None or positions is None:
            raise RequestError("mm_embeds and mm_positions come together")
        if embeds.ndim != 2 or (embeds.shape[0] and embeds.shape[1] != self.hidden_size):
            raise RequestError(f"mm_embeds must be [M, {self.hidden_size}], got {list(embeds.shape)}")
        if positions.ndim != 1 or positions.shape[0] != embeds.shape[0]:
            raise RequestError(
                f"mm_positions must be [M] with M = {embeds.shape[0]} rows of mm_embeds, got {list(positions.shape)}"
            )
        if not embeds.shape[0]:
            return prompt
        T = prompt.input_ids.shape[0]
        if positions.min() < 0 or positions.max() >= T or len(np.unique(positions)) != len(positions):
            raise RequestError(f"mm_positions must be distinct positions in [0, {T})")
        if not np.isfinite(embeds).all():
            raise RequestError("mm_embeds hold non-finite values")
        rows = torch.from_numpy(np.ascontiguousarray(embeds, dtype=np.float32)).to(self.dtype)
        return PromptInput(prompt.input_ids, rows, torch.from_numpy(positions.astype(np.int64)))

    def _engine_exited(self, reason: str) -> None:
        """The engine process died (its requests in flight have had their errors): start another, on a
        thread of its own, while execute() answers UNAVAILABLE. A few tries, then the model stays down."""
        pb_utils.Logger.log_error(f"inkling: the engine process exited ({reason}); starting another")

        def restart() -> None:
            for attempt in range(1, RESTART_TRIES + 1):
                if self.finalizing:
                    return
                try:
                    old, self.loop = self.loop, self.new_engine()
                    old.shutdown(timeout=1)
                    pb_utils.Logger.log_info(f"inkling: a new engine process is serving (try {attempt})")
                    return
                except Exception as e:  # noqa: BLE001
                    pb_utils.Logger.log_error(f"inkling: restart {attempt} of {RESTART_TRIES} failed: {e}")
                    time.sleep(RESTART_BACKOFF_S * attempt)

        threading.Thread(target=restart, name="inkling-restart", daemon=True).start()

    def _abort(self, triton_id: str) -> None:
        with self.lock:
            rids = [rid for rid, r in self.in_flight.items() if r.triton_id == triton_id]
        for rid in rids:
            self.loop.abort(rid)

    # Responses out.
    def _send_loop(self) -> None:
        next_metrics = 0.0
        while True:
            try:
                first = self.outbox.get(timeout=CANCEL_CHECK_S)
            except queue.Empty:
                first = False
            if first is None:
                return
            deltas, stop = self._drain(first) if first else ([], False)
            try:
                for delta in deltas:
                    self._send(delta)
                if stop:
                    return
                self._check_cancelled()
                if time.monotonic() >= next_metrics:
                    self._publish_metrics()
                    next_metrics = time.monotonic() + METRICS_PERIOD_S
            except Exception as e:  # keep sending to the other requests
                pb_utils.Logger.log_error(f"inkling sender: {type(e).__name__}: {e}")

    def _drain(self, first: StreamDelta) -> tuple[list[StreamDelta], bool]:
        """`first` and the deltas already queued behind it, a request's later deltas merged into one (in
        order: a request's final delta is its last; its first delta stays alone); and whether the loop
        was told to stop."""
        out: list[StreamDelta] = []
        mergeable: dict[str, int] = {}  # request -> its entry in `out` that later deltas join
        d: StreamDelta | None = first
        while True:
            rid = d.request_id
            if rid in mergeable:
                out[mergeable[rid]] = out[mergeable[rid]].merge(d)
            else:
                if rid in self.started:
                    mergeable[rid] = len(out)
                out.append(d)
            self.started.add(rid)
            if d.finish_reason is not None:
                self.started.discard(rid)
                mergeable.pop(rid, None)
            try:
                d = self.outbox.get_nowait()
            except queue.Empty:
                return out, False
            if d is None:
                return out, True

    def _send(self, d: StreamDelta) -> None:
        with self.lock:
            req = self.in_flight.get(d.request_id)
            if req is not None and d.finish_reason is not None:
                del self.in_flight[d.request_id]
        if req is None or (req.cancelled and d.finish_reason is None):
            return
        if not req.stream:
            d = d if req.pending is None else req.pending.merge(d)
            if d.finish_reason is None:
                req.pending = d
                return
        if d.finish_reason is None:
            req.sender.send(self._response(d))
            req.responded = True
        elif req.cancelled or req.sender.is_cancelled():
            req.sender.send(flags=FINAL)  # the client is gone: nothing to say
        elif d.finish_reason in ("rejected", "error") and req.responded:
            # After responses have gone out (deltas, or an unstreamed request's empty first one), an error
            # response does not reach a BLS caller (Triton 2.51: the `ensemble` relay waited for it
            # forever), so the stream ends with a response whose finish_reason is "error" or "rejected"
            # and whose text_output is the reason; the pipeline turns it into an error for its client.
            reason = d.error or ("request rejected" if d.finish_reason == "rejected" else "generation failed")
            req.sender.send(self._response(dataclasses.replace(d, text=reason)), flags=FINAL)
        elif d.finish_reason == "rejected":  # a request the engine cannot serve
            req.sender.send(error(d.error or "request rejected"), flags=FINAL)
        elif d.finish_reason == "error":
            req.sender.send(error(d.error or "generation failed", pb_utils.TritonError.INTERNAL), flags=FINAL)
        else:
            req.sender.send(self._response(d), flags=FINAL)

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        with self.lock:
            due = [
                (rid, r)
                for rid, r in self.in_flight.items()
                if not r.cancelled and now - r.checked_at >= CANCEL_CHECK_S
            ]
        for rid, r in due:
            r.checked_at = now
            if r.sender.is_cancelled():
                r.cancelled = True
                self.loop.abort(rid)

    @staticmethod
    def _response(d: StreamDelta) -> Any:
        top = d.top_logprobs or []
        shape = (len(top), len(top[0]) if top else 0)
        return pb_utils.InferenceResponse(
            output_tensors=[
                string_tensor("text_output", d.text),
                tensor("output_ids", d.token_ids, np.int64),
                string_tensor("finish_reason", d.finish_reason or ""),
                tensor("prompt_tokens", [d.prompt_tokens], np.int32),
                tensor("completion_tokens", [d.completion_tokens], np.int32),
                tensor("acceptance_length", [d.acceptance_length], np.float32),
                tensor("acceptance_rate", [d.acceptance_rate], np.float32),
                tensor("num_input_tokens", [d.prompt_tokens], np.int32),
                tensor("num_output_tokens", [d.completion_tokens], np.int32),
                tensor("output_log_probs", d.logprobs or [], np.float32),
                tensor("top_logprob_ids", np.array([list(t) for t in top]).reshape(shape), np.int64),
                tensor("top_logprobs", np.array([list(t.values()) for t in top]).reshape(shape), np.float32),
            ]
        )

    # Metrics: TensorRT-LLM's kv_cache_block_type labels, on Triton's /metrics.
    def _init_metrics(self) -> None:
        blocks = pb_utils.MetricFamily(
            name="inkling_kv_cache_blocks",
            description="KV cache blocks of the inkling engine loop, by kind",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        requests = pb_utils.MetricFamily(
            name="inkling_requests",
            description="Requests in the inkling engine loop, by state",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        engine = pb_utils.MetricFamily(
            name="inkling_engine_stats",
            description="Running totals of the inkling engine: steps, seconds inside them, tokens",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        moe = pb_utils.MetricFamily(
            name="inkling_moe_load",
            description="The MoE's expert load: routed choices, recent expert and rank imbalance (max / mean)",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        per = {
            key: pb_utils.MetricFamily(
                name=f"inkling_{key}",
                description=f"Tokens routed to each {label} over the engine's life, summed over the MoE layers",
                kind=pb_utils.MetricFamily.GAUGE,
            )
            for key, label in MOE_LISTS.items()
        }
        self.metric_families = (blocks, requests, engine, moe, *per.values())
        self.gauges = {
            k: blocks.Metric(labels={"kv_cache_block_type": k.removesuffix("_blocks")}) for k in CACHE_GAUGES
        }
        self.gauges |= {k: requests.Metric(labels={"request_state": k}) for k in REQUEST_GAUGES}
        self.gauges |= {k: engine.Metric(labels={"stat": k}) for k in ENGINE_GAUGES}
        self.gauges |= {k: moe.Metric(labels={"stat": k.removeprefix("moe_")}) for k in MOE_GAUGES}
        stats = self.loop.cache_stats()
        self.list_gauges = {
            key: [per[key].Metric(labels={label: str(i)}) for i in range(len(stats.get(key, [])))]
            for key, label in MOE_LISTS.items()
        }
        self._publish_metrics()

    def _publish_metrics(self) -> None:
        stats = self.loop.cache_stats()
        for key, gauge in self.gauges.items():
            gauge.set(float(stats.get(key, 0)))
        for key, gauges in self.list_gauges.items():
            for gauge, value in zip(gauges, stats.get(key, [])):
                gauge.set(float(value))

    def finalize(self) -> None:
        self.finalizing = True
        self.loop.shutdown()
        self.outbox.put(None)
        self.sender.join(5)
        self.gauges.clear()
        self.list_gauges.clear()
        self.metric_families = ()


def _fail(sender: Any, acked: bool, message: str, reason: str, code: Any = None) -> None:
    """End a request that failed in execute(): an error response, or after an ack (which a BLS caller has
    received, so an error response would not reach it) a final response with finish_reason `reason`."""
    if not acked:
        sender.send(error(message, code), flags=FINAL)
        return
    response = pb_utils.InferenceResponse(
        output_tensors=[string_tensor("text_output", message), string_tensor("finish_reason", reason)]
    )
    sender.send(response, flags=FINAL)


def _num_logprobs(request: Any) -> int | None:
    """SamplingParams.logprobs: `num_logprobs` (N alternatives per token), or 0 for TensorRT-LLM's
    `return_log_probs` true; None (none returned) otherwise."""
    n = scalar(request, "num_logprobs", None, int)
    if n is None and scalar(request, "return_log_probs", False, bool):
        n = 0
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise RequestError(f"num_logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
    return n


def _wants_ack(request: Any) -> bool:
    """The request's parameter "ack" (a BLS caller's, see model_repo/pipeline.py): true asks for an empty
    response before an unstreamed answer."""
    try:
        return bool(json.loads(request.parameters() or "{}").get("ack", False))
    except (ValueError, AttributeError):
        return False

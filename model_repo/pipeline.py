"""The `ensemble` and `ensemble_unary` models: preprocessing -> image_encoder / audio_encoder ->
inkling, as BLS (business logic scripting) in Python rather than a Triton ensemble.

An ensemble's steps are fixed tensors to fixed models; a request here may carry no image, one or
several, so the encoders are called only for the media a request has, and the decoupled `inkling`
model's stream is either forwarded delta by delta (`ensemble`, decoupled, `stream` true) or gathered
into one response (`stream` false, and always in `ensemble_unary`, the non-decoupled twin that
HTTP/gRPC unary calls and the `generate` endpoint need). Each request is served on its own worker
thread, so one instance carries any number of concurrent streams; `inkling` batches them.

A chat request (`messages` instead of `text_input`) is rendered by preprocessing; its answer is parsed
here as it streams (inkling/published/chat_output.py): `text_output` carries the visible text,
`reasoning_output` the thinking and `tool_calls` the completed tool calls as JSON. Other requests get
an empty `reasoning_output` and `tool_calls` "[]".

A stream's relay forwards inkling's response tensors as they are, merges the deltas that arrived while
it was sending (`_relay`), and its cost is on Triton's /metrics: `inkling_relay_responses_total` and
`inkling_relay_seconds_total` (wall time from a response's first delta arriving from `inkling` to its
send, by model; published in batches).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from model_repo.tensors import (
    RequestError,
    error,
    error_code,
    load_model_config,
    parameter,
    scalar,
    string_tensor,
    strings,
    tensor,
    text,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PARAMS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "random_seed",
    "stop_words",
    "num_draft_tokens",
    "ignore_eos",
    "num_logprobs",
    "return_log_probs",
)
MEDIA = ("image_data_input", "audio_data_input")
PROMPT = ("text_input", "messages", "tools", "reasoning_effort", *MEDIA)
OUTPUTS = (
    "text_output",
    "output_ids",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "acceptance_length",
    "acceptance_rate",
    "num_input_tokens",
    "num_output_tokens",
    "output_log_probs",
    "top_logprob_ids",
    "top_logprobs",
)
COUNTS = OUTPUTS[3:-3]  # one value a response, the request's so far
TOKEN_ROWS = OUTPUTS[-3:]  # a row a generated token (empty where the request asks for no logprobs)
CANCEL_CHECK_S = 0.05
METRICS_PERIOD_S = 0.25


class StepError(Exception):
    """A step model answered with an error: its message goes to the client as it is."""

    def __init__(self, message: str, code: Any):
        super().__init__(message)
        self.code = code


@dataclass
class Delta:
    text: str
    output_ids: np.ndarray
    finish_reason: str
    counts: dict[str, np.ndarray]  # COUNTS
    rows: dict[str, np.ndarray]  # TOKEN_ROWS
    reasoning: str = ""  # a chat request's thinking
    tool_calls: list = dataclasses.field(default_factory=list)  # a chat request's completed tool calls

    @classmethod
    def from_response(cls, r: Any) -> Delta:
        out = {name: pb_utils.get_output_tensor_by_name(r, name).as_numpy() for name in OUTPUTS}
        return cls(
            text=_str(out["text_output"]),
            output_ids=out["output_ids"].astype(np.int64),
            finish_reason=_str(out["finish_reason"]),
            counts={k: out[k] for k in COUNTS},
            rows={k: out[k] for k in TOKEN_ROWS},
        )

    def merge(self, d: Delta) -> Delta:
        ids = np.concatenate([self.output_ids, d.output_ids])
        rows = {k: _stacked(v, d.rows[k]) for k, v in self.rows.items()}
        return Delta(self.text + d.text, ids, d.finish_reason, d.counts, rows, self.reasoning + d.reasoning,
                     self.tool_calls + d.tool_calls)  # fmt: skip

    def echoed(self, text: str, ids: np.ndarray) -> Delta:
        """The prompt (`text`, its `ids`) before the answer: TensorRT-LLM's exclude_input_in_output false."""
        return dataclasses.replace(
            self, text=text + self.text, output_ids=np.concatenate([ids, self.output_ids])
        )

    def chat(self, parser: Any) -> Delta:
        """This delta of a chat request's answer, parsed: the visible text, thinking and tool calls."""
        c = parser.feed(self.output_ids.tolist())
        if self.finish_reason:
            c += parser.finish()
        calls = [t.to_dict() for t in c.tool_calls]
        return dataclasses.replace(self, text=c.content, reasoning=c.thinking, tool_calls=calls)

    @classmethod
    def joined(cls, responses: list) -> Delta:
        """inkling's responses (in order, at least one) as one delta."""
        return functools.reduce(cls.merge, map(cls.from_response, responses))

    def response(self) -> Any:
        return pb_utils.InferenceResponse(
            output_tensors=[
                string_tensor("text_output", self.text),
                tensor("output_ids", self.output_ids, np.int64),
                string_tensor("finish_reason", self.finish_reason),
                *(tensor(k, v, v.dtype.type) for k, v in (self.counts | self.rows).items()),
                *chat_tensors(self.reasoning, self.tool_calls),
            ]
        )


def chat_tensors(reasoning: str = "", tool_calls: list = ()) -> list:
    return [
        string_tensor("reasoning_output", reasoning),
        string_tensor("tool_calls", json.dumps(list(tool_calls), ensure_ascii=False)),
    ]


def _stacked(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two responses' token rows, one after the other (a response without tokens has [0] or [0, 0])."""
    return b if not a.shape[0] else a if not b.shape[0] else np.concatenate([a, b])


def _str(x: np.ndarray) -> str:
    v = x.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


class PipelineModel:
    """TritonPythonModel of `ensemble` (decoupled) and `ensemble_unary` (not)."""

    def initialize(self, args: dict) -> None:
        cfg = load_model_config(args)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.workers = ThreadPoolExecutor(
            max_workers=int(parameter(cfg, "max_concurrency", "64")), thread_name_prefix="pipeline"
        )
        labels = {"model": args["model_name"]}
        self.metric_families = tuple(
            pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
            for name, text in (
                ("inkling_relay_responses_total", "Streamed responses relayed from inkling to clients"),
                ("inkling_relay_seconds_total", "Wall time from a relayed response's arrival to its send"),
            )
        )
        self.relayed, self.relay_s = (family.Metric(labels=labels) for family in self.metric_families)
        tokenizer = os.path.join(parameter(cfg, "engine_dir"), "tokenizer.json")
        self.tokenizer = None
        if os.path.exists(tokenizer):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(tokenizer)
        self.metrics_lock = threading.Lock()  # the backend's metric calls are not thread-safe (it crashed)
        self.pending_relayed, self.pending_relay_s, self.metrics_due = 0, 0.0, 0.0

    def execute(self, requests: list) -> None:
        for request in requests:
            self.workers.submit(self._serve, request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        self.workers.shutdown(wait=True, cancel_futures=True)
        self.relayed = self.relay_s = None
        self.metric_families = ()

    def _serve(self, request: Any, sender: Any) -> None:
        try:
            stream = self.decoupled and bool(scalar(request, "stream", False, bool))
            prompt = self._prepare(request)
            echo = None  # exclude_input_in_output false: the prompt's text and ids, before the answer
            if not stream and not scalar(request, "exclude_input_in_output", True, bool):
                texts = strings(request, "text_input")
                if texts:
                    echo = (text(texts[0], "text_input"), prompt[0].as_numpy())
            parser = None
            if pb_utils.get_input_tensor_by_name(request, "messages") is not None:
                from inkling.published.chat_output import ChatOutputParser

                parser = ChatOutputParser(self.tokenizer)
            self._generate(request, sender, prompt, stream, parser, echo)
        except StepError as e:
            sender.send(error(str(e), e.code), flags=FINAL)
        except RequestError as e:
            sender.send(error(str(e)), flags=FINAL)
        except Exception as e:  # a bad request must never take the model down
            sender.send(error(f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL), flags=FINAL)

    def _prepare(self, request: Any) -> list:
        """preprocessing, then the encoders a request needs -> inkling's prompt inputs."""
        inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in PROMPT) if t is not None]
        pre = _call("preprocessing", inputs, ["INPUT_IDS", "IMAGE_PATCHES", "AUDIO_LEVELS", "MM_POSITIONS"])
        ids, patches, levels, positions = (
            pre[k] for k in ("INPUT_IDS", "IMAGE_PATCHES", "AUDIO_LEVELS", "MM_POSITIONS")
        )
        embeds = []  # an encoder runs only for media it has: empty inputs have no elements in either layout
        if patches.size:
            embeds.append(
                _call("image_encoder", [tensor("IMAGE_PATCHES", patches, np.float32)], ["IMAGE_EMBEDS"])
            )
        if levels.size:
            embeds.append(
                _call("audio_encoder", [tensor("AUDIO_LEVELS", levels, np.int64)], ["AUDIO_EMBEDS"])
            )
        prompt = [tensor("input_ids", ids, np.int64)]
        if embeds:
            rows = np.concatenate([next(iter(e.values())) for e in embeds])  # image pads, then audio pads
            if rows.shape[0] != positions.shape[0]:
                raise StepError(
                    f"encoders gave {rows.shape[0]} embeddings for {positions.shape[0]} pad tokens",
                    pb_utils.TritonError.INTERNAL,
                )
            prompt += [tensor("mm_embeds", rows, np.float32), tensor("mm_positions", positions, np.int64)]
        return prompt

    def _generate(
        self, request: Any, sender: Any, prompt: list, stream: bool, parser: Any, echo: tuple | None
    ) -> None:
        params = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in PARAMS) if t is not None]
        rid = uuid.uuid4().hex
        mode = [tensor("stream", [stream], np.bool_)]  # not streamed: inkling sends one response at the end
        # exec() returns once inkling's first response is in. Unstreamed, that is its answer at the end, so
        # inkling first sends an empty "accepted" response (parameter ack), and the wait below can poll.
        responses = pb_utils.InferenceRequest(
            model_name="inkling",
            inputs=prompt + params + mode,
            requested_output_names=list(OUTPUTS),
            request_id=rid,
            parameters={"ack": not stream},
        ).exec(decoupled=True)
        if stream:
            self._relay(responses, sender, rid, parser)
            return
        # One response at the end. The wait polls the client's cancellation (inkling's answer may be
        # minutes away): a cancelled call gets inkling's request aborted, which frees its cache blocks.
        inbox = _read_in_background(responses)
        got, cancelled = [], False
        while True:
            try:
                item = inbox.get(timeout=CANCEL_CHECK_S)
            except queue.Empty:
                if not cancelled and sender.is_cancelled():
                    cancelled = True
                    _abort(rid)
                continue
            if item is None:
                break
            r = item[1]
            if isinstance(r, Exception):
                raise r
            if r.has_error():
                raise StepError(r.error().message(), error_code(r.error()))
            if r.output_tensors():  # else a bare final flag
                _raise_if_failed(r)
                got.append(r)
        if cancelled:
            raise StepError("the request was cancelled by its client", pb_utils.TritonError.CANCELLED)
        if not got:
            raise StepError("inkling ended the stream without a response", pb_utils.TritonError.INTERNAL)
        answer = Delta.joined(got)
        answer = answer.chat(parser) if parser else answer
        sender.send((answer.echoed(*echo) if echo else answer).response(), flags=FINAL)

    def _relay(self, responses: Any, sender: Any, rid: str, parser: Any) -> None:
        """Forward inkling's deltas to the client. A reader thread takes them off inkling's stream as they
        come; each send carries every delta that arrived while the previous send was under way, merged
        into one response (so a relay that falls behind sends fewer, larger responses, and one that keeps
        up adds no delay). A client that cancels gets inkling's request aborted."""
        inbox = _read_in_background(responses)
        cancelled, checked_at, ended = False, time.monotonic(), False
        while not ended:
            batch = [inbox.get()]
            while True:
                try:
                    batch.append(inbox.get_nowait())
                except queue.Empty:
                    break
            got, arrived = [], None
            for item in batch:
                if item is None:
                    ended = True
                    break
                t, r = item
                if isinstance(r, Exception):
                    raise r
                if r.has_error():
                    raise StepError(r.error().message(), error_code(r.error()))
                if r.output_tensors():  # else a bare final flag
                    _raise_if_failed(r)
                    got.append(r)
                    if arrived is None:
                        arrived = t
            if not cancelled and time.monotonic() - checked_at >= CANCEL_CHECK_S:
                checked_at = time.monotonic()
                if sender.is_cancelled():
                    cancelled = True
                    _abort(rid)
            if not got or cancelled:
                continue
            if len(got) == 1 and parser is None:  # the usual case: inkling's tensors go on as they are
                response = pb_utils.InferenceResponse(output_tensors=got[0].output_tensors() + chat_tensors())
                final = bool(_str(pb_utils.get_output_tensor_by_name(got[0], "finish_reason").as_numpy()))
            else:
                merged = Delta.joined(got)
                merged = merged.chat(parser) if parser else merged
                response, final = merged.response(), bool(merged.finish_reason)
            sender.send(response, flags=FINAL if final else 0)
            self._count_relay(arrived, flush=final)
            if final:
                return
        self._count_relay(None, flush=True)
        sender.send(flags=FINAL)  # cancelled, or the stream ended without a final delta

    def _count_relay(self, arrived: float | None, flush: bool) -> None:
        """Count a relayed response. The counters reach Triton's metrics in batches: at a stream's end and
        at most every METRICS_PERIOD_S otherwise, since each metric call is a round trip to the server
        process (two per response had cost as much as the relay's own send)."""
        with self.metrics_lock:
            if arrived is not None:
                self.pending_relayed += 1
                self.pending_relay_s += time.monotonic() - arrived
            if self.pending_relayed and (flush or time.monotonic() >= self.metrics_due):
                self.relayed.increment(self.pending_relayed)
                self.relay_s.increment(self.pending_relay_s)
                self.pending_relayed, self.pending_relay_s = 0, 0.0
                self.metrics_due = time.monotonic() + METRICS_PERIOD_S


def _read_in_background(responses: Any) -> queue.SimpleQueue:
    """A thread takes inkling's responses off its BLS stream as they come: (arrival time, response or the
    exception that ended the stream) items, then None."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            for r in responses:
                inbox.put((time.monotonic(), r))
        except Exception as e:  # noqa: BLE001  (handed to the waiting thread)
            inbox.put((time.monotonic(), e))
        inbox.put(None)

    threading.Thread(target=read, name="pipeline-read", daemon=True).start()
    return inbox


def _raise_if_failed(r: Any) -> None:
    """inkling ends a stream that failed after its first response with finish_reason "error" (or "rejected":
    a request it cannot serve) and the reason as its text (an error response there would not reach this
    BLS): an error for the client."""
    reason = _str(pb_utils.get_output_tensor_by_name(r, "finish_reason").as_numpy())
    if reason in ("error", "rejected"):
        text = _str(pb_utils.get_output_tensor_by_name(r, "text_output").as_numpy())
        if reason == "rejected":
            raise StepError(text or "request rejected", pb_utils.TritonError.INVALID_ARG)
        raise StepError(text or "generation failed", pb_utils.TritonError.INTERNAL)


def _call(model: str, inputs: list, outputs: list[str]) -> dict[str, np.ndarray]:
    r = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs).exec()
    if r.has_error():
        raise StepError(r.error().message(), error_code(r.error()))
    return {name: pb_utils.get_output_tensor_by_name(r, name).as_numpy() for name in outputs}


def _abort(rid: str) -> None:
    """Ask inkling to abort request `rid` (a BLS request cannot be cancelled from here otherwise)."""
    control = pb_utils.InferenceRequest(
        model_name="inkling", inputs=[string_tensor("abort_request_id", rid)], requested_output_names=[]
    )
    for _ in control.exec(decoupled=True):
        pass

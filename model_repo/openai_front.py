"""An OpenAI-compatible API in front of the Triton deployment: `make serve` starts it beside Triton.

    python -m model_repo.openai_front --triton 127.0.0.1:8001 --port 8080 --model inkling

Every request becomes requests to Triton's decoupled `ensemble`, each on a gRPC stream of its own
(tritonclient.grpc.aio), so Triton stays the engine's host and its batching, limits and metrics apply; the
ensemble renders chat messages in the model's own format (inkling/published/chat.py: text, `image_url`
data URLs, `input_audio` parts, tools, the thinking effort) and parses what the model writes back into
content, thinking and tool calls.

Endpoints: GET /v1/models, GET /health, GET /metrics, POST /v1/chat/completions, POST /v1/completions.
Options: max_tokens / max_completion_tokens, temperature, top_p, top_k, seed, stop, n, stream with
stream_options.include_usage, logprobs / top_logprobs, reasoning_effort, tools; the extensions
num_draft_tokens (MTP drafts) and ignore_eos (vLLM's). Chat media come as data: URLs; http(s) URLs are
fetched only with --allow-remote-media. Errors have OpenAI's shape ({"error": {"message", "type",
"param", "code"}}): 400 for a request the model refuses or a bad value, 404 for another model's name, 413
for a body over the limit, 422 for a body of the wrong shape, 503 when Triton cannot be reached, 500 for
a fault of ours. A client that disconnects cancels its Triton requests, which frees their cache blocks.
/metrics serves vLLM's metric names (latencies as clients see them here, the engine's gauges read off
Triton) followed by Triton's own.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .refusal import is_refusal

MAX_N = 8  # completions per request (`n`)
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5
STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "RESOURCE_EXHAUSTED": 503}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        code = {404: "model_not_found", 413: "request_too_large", 503: "service_unavailable"}.get(self.status)
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}


# The request: OpenAI's fields -> the ensemble's inputs.


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number here
        raise APIError(422, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}", name)
    if not isinstance(value, kinds):
        raise APIError(422, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}", name)
    return value


@dataclass
class Sampling:
    """A request's sampling options, checked; `inputs` turns them into the ensemble's tensors."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    num_draft_tokens: int | None = None
    num_logprobs: int | None = None  # None: no logprobs; N: each token's and its N most likely alternatives
    ignore_eos: bool = False  # vLLM's and TensorRT-LLM's extension: max_tokens past end-of-sequence

    @classmethod
    def of(cls, body: dict, default_max_tokens: int, chat: bool) -> Sampling:
        max_tokens = _field(body, "max_completion_tokens", (int,), None)
        max_tokens = _field(body, "max_tokens", (int,), max_tokens)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise APIError(400, "'stop' must be a non-empty string or a list of at most 4 of them", "stop")
        s = cls(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=_field(body, "temperature", (int, float)),
            top_p=_field(body, "top_p", (int, float)),
            top_k=_field(body, "top_k", (int,)),
            seed=_field(body, "seed", (int,)),
            stop=stop,
            num_draft_tokens=_field(body, "num_draft_tokens", (int,)),
            num_logprobs=_num_logprobs(body, chat),
            ignore_eos=_field(body, "ignore_eos", (bool,), False),
        )
        if s.temperature is not None and not 0 <= s.temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {s.temperature}", "temperature")
        if s.top_p is not None and not 0 < s.top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {s.top_p}", "top_p")
        if s.top_k is not None and s.top_k < 0:
            raise APIError(400, f"top_k must be >= 0, got {s.top_k}", "top_k")
        if s.seed is not None and not 0 <= s.seed < 2**63:
            raise APIError(400, f"seed must be in [0, 2^63), got {s.seed}", "seed")
        return s

    def inputs(self, index: int) -> dict[str, tuple[np.ndarray, str]]:
        """The ensemble's sampling inputs for completion `index` of `n` (a seed advances per completion)."""
        out = {"max_tokens": (np.array([self.max_tokens], np.int32), "INT32")}
        if self.temperature is not None:
            out["temperature"] = (np.array([self.temperature], np.float32), "FP32")
        if self.top_p is not None:
            out["top_p"] = (np.array([self.top_p], np.float32), "FP32")
        if self.top_k is not None:
            out["top_k"] = (np.array([self.top_k], np.int32), "INT32")
        if self.seed is not None:
            out["random_seed"] = (np.array([self.seed + index], np.uint64), "UINT64")
        if self.stop:
            out["stop_words"] = (np.array([s.encode() for s in self.stop], np.object_), "BYTES")
        if self.num_draft_tokens is not None:
            out["num_draft_tokens"] = (np.array([self.num_draft_tokens], np.int32), "INT32")
        if self.ignore_eos:
            out["ignore_eos"] = (np.array([True]), "BOOL")
        if self.num_logprobs is not None:
            out["num_logprobs"] = (np.array([self.num_logprobs], np.int32), "INT32")
        return out


def _num_logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs` true and `top_logprobs` 0..20; completions: `logprobs` 0..5 (OpenAI's limits)."""
    if chat:
        top = _field(body, "top_logprobs", (int,))
        if not _field(body, "logprobs", (bool,), False):
            if top is not None:
                raise APIError(400, "top_logprobs needs logprobs true", "top_logprobs")
            return None
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        return top or 0
    n = _field(body, "logprobs", (int,))
    if n is not None and not 0 <= n <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS}, got {n}", "logprobs")
    return n


def _string(value: str) -> tuple[np.ndarray, str]:
    return np.array([value.encode()], np.object_), "BYTES"


def chat_inputs(body: dict) -> dict[str, tuple[np.ndarray, str]]:
    """messages, tools and reasoning_effort as the ensemble takes them (JSON text; the chat format checks
    their content and refuses what it cannot render, with a 400)."""
    messages = _field(body, "messages", (list,))
    if not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = {"messages": _string(json.dumps(messages, ensure_ascii=False))}
    tools = _field(body, "tools", (list,))
    if tools:
        if body.get("tool_choice") not in (None, "auto"):
            raise APIError(400, "only tool_choice 'auto' is supported", "tool_choice")
        out["tools"] = _string(json.dumps(tools, ensure_ascii=False))
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, (str, int, float)) or isinstance(effort, bool):
            raise APIError(422, "'reasoning_effort' must be a level name or a number", "reasoning_effort")
        out["reasoning_effort"] = _string(str(effort))
    return out


def completion_inputs(body: dict) -> dict[str, tuple[np.ndarray, str]]:
    prompt = _field(body, "prompt", (str, list))
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise APIError(
                400, "'prompt' must be one string (batches of prompts are not supported)", "prompt"
            )
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "'prompt' must be a non-empty string", "prompt")
    return {"text_input": _string(prompt)}


# Triton: one request on its own gRPC stream.


@dataclass
class Piece:
    """One response of the ensemble."""

    text: str
    reasoning: str
    tool_calls: list[dict]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's, where the request asks
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # each token's alternatives


def _piece(result: Any) -> Piece:
    def s(name: str) -> str:
        x = result.as_numpy(name)
        return "" if x is None or not x.size else x.reshape(-1)[0].decode("utf-8", "replace")

    def i(name: str) -> int:
        x = result.as_numpy(name)
        return 0 if x is None or not x.size else int(x.reshape(-1)[0])

    def rows(name: str) -> list:
        x = result.as_numpy(name)
        return [] if x is None else x.tolist()

    top = [list(zip(ids, lps)) for ids, lps in zip(rows("top_logprob_ids"), rows("top_logprobs"))]
    return Piece(s("text_output"), s("reasoning_output"), json.loads(s("tool_calls") or "[]"),
                 s("finish_reason"), i("prompt_tokens"), i("completion_tokens"), rows("output_ids"),
                 rows("output_log_probs"), top)  # fmt: skip


OUTPUTS = (
    "text_output",
    "reasoning_output",
    "tool_calls",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "output_ids",
    "output_log_probs",
    "top_logprob_ids",
    "top_logprobs",
)


class Triton:
    """The ensemble over gRPC streaming: `generate(inputs)` yields its responses until the final one."""

    def __init__(self, url: str, model: str = "ensemble"):
        import tritonclient.grpc.aio as grpcclient

        self.grpc = grpcclient
        self.url, self.model = url, model
        self._client = None

    @property
    def client(self) -> Any:
        """Made on first use, inside the server's event loop (a gRPC aio channel belongs to one loop)."""
        if self._client is None:
            self._client = self.grpc.InferenceServerClient(self.url)
        return self._client

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except Exception:
            return False

    async def generate(self, inputs: dict[str, tuple[np.ndarray, str]]) -> AsyncIterator[Piece]:
        tensors = []
        for name, (array, dtype) in {**inputs, "stream": (np.array([True]), "BOOL")}.items():
            t = self.grpc.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            tensors.append(t)
        outputs = [self.grpc.InferRequestedOutput(n) for n in OUTPUTS]
        done = asyncio.Event()

        async def requests():  # one request; the stream stays open until its final response
            yield {
                "model_name": self.model,
                "inputs": tensors,
                "outputs": outputs,
                "request_id": uuid.uuid4().hex,
            }
            await done.wait()

        try:
            call = self.client.stream_infer(requests())
        except Exception as e:
            raise APIError(503, f"Triton at {self.url} cannot be reached: {e}") from e
        try:
            try:
                async for result, error in call:
                    if error is not None:
                        raise _api_error(error)
                    piece = _piece(result)
                    yield piece
                    if piece.finish_reason:
                        return
            except (APIError, asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:  # the channel's own failure (no server there, a broken connection)
                raise _api_error(e) from e
            raise APIError(500, "Triton closed the stream before the request finished")
        finally:
            done.set()
            call.cancel()  # a client gone or an error: Triton cancels the request and frees its blocks


def _api_error(error: Any) -> APIError:
    status = str(getattr(error, "status", lambda: "")() or "")
    message = error.message() if hasattr(error, "message") else str(error)
    if is_refusal(message):  # a stream's error responses carry no status: the refusal's mark tells
        return APIError(400, message)
    for name, code in STATUS.items():
        if name in status:
            return APIError(code, message)
    if "UNAVAILABLE" in message or "failed to connect" in message.lower():
        return APIError(503, f"Triton cannot be reached: {message}")
    return APIError(500, message)


# Logprobs: token text and bytes.


def _byte_chars() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's map: printable bytes stand for themselves, the
    others for 256 + n): a vocabulary entry spells its token's bytes in these characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Vocab:
    """Each token's text and UTF-8 bytes (OpenAI's `token` and `bytes`), from the engine's tokenizer.json:
    a token that ends inside a character has its own bytes, and its text shows the incomplete character
    as U+FFFD. Special tokens are their names."""

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.special = set(self.tokenizer.get_added_tokens_decoder())
        self.byte_of = _byte_chars()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self.cache:
            entry = self.tokenizer.id_to_token(token_id)
            if entry is None:
                raw = f"<|token_{token_id}|>".encode()
            elif token_id in self.special or any(c not in self.byte_of for c in entry):
                raw = entry.encode()
            else:
                raw = bytes(self.byte_of[c] for c in entry)
            if len(self.cache) < 1 << 18:
                self.cache[token_id] = (raw.decode("utf-8", "replace"), list(raw))
            else:
                return raw.decode("utf-8", "replace"), list(raw)
        return self.cache[token_id]

    def chat_logprobs(self, c: Completion, start: int = 0) -> dict:
        """OpenAI's chat `logprobs` object for the completion's tokens from `start` on."""

        def entry(token_id: int, lp: float) -> dict:
            text, raw = self.token(token_id)
            return {"token": text, "logprob": lp, "bytes": raw}

        content = [
            {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
            for t, lp, top in zip(c.token_ids[start:], c.logprobs[start:], c.tops(start))
        ]
        return {"content": content, "refusal": None}

    def completion_logprobs(self, c: Completion, start: int = 0, offset: int = 0) -> dict:
        """The completions API's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset) for
        the tokens from `start` on, their text starting at character `offset`."""
        tokens = [self.token(t)[0] for t in c.token_ids[start:]]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops = [{self.token(a)[0]: alp for a, alp in top} for top in c.tops(start)]
        return {"tokens": tokens, "token_logprobs": c.logprobs[start:], "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip


# The responses.


def _now() -> int:
    return int(time.time())


def _finish(piece: Piece, calls: list) -> str:
    return (
        "tool_calls"
        if calls
        else (piece.finish_reason if piece.finish_reason in ("stop", "length") else "stop")
    )


@dataclass
class Completion:
    """One completion accumulated from its pieces."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def add(self, p: Piece) -> None:
        self.text += p.text
        self.reasoning += p.reasoning
        self.tool_calls += p.tool_calls
        if p.finish_reason:
            self.finish_reason = _finish(p, self.tool_calls)
        self.prompt_tokens = max(self.prompt_tokens, p.prompt_tokens)
        self.completion_tokens = max(self.completion_tokens, p.completion_tokens)
        self.token_ids += p.token_ids
        self.logprobs += p.logprobs
        self.top += p.top

    def tops(self, start: int) -> list[list[tuple[int, float]]]:
        """Each token's alternatives from `start` on (empty lists where none were asked)."""
        return self.top[start:] or [[] for _ in self.logprobs[start:]]


def usage(done: list[Completion]) -> dict:
    prompt = max((c.prompt_tokens for c in done), default=0)
    completion = sum(c.completion_tokens for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# Metrics: vLLM's names, so dashboards and tools built for vLLM read ours.


class EngineMetrics:
    """A Prometheus collector that reads the engine's gauges off Triton's /metrics (model_repo/templates/
    inkling: inkling_requests, inkling_kv_cache_blocks, inkling_engine_stats) at each scrape and gives them
    vLLM's names."""

    def __init__(self, triton_metrics_url: str, model_name: str):
        self.url, self.labels = triton_metrics_url, {"model_name": model_name}
        self.text = ""  # Triton's own metrics as last read (served beside ours)

    def read(self) -> dict[tuple[str, str], float]:
        """(family, label value) -> value of the inkling_* gauges; empty if Triton does not answer."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                self.text = r.read().decode()
        except OSError:
            self.text = ""
            return {}
        out = {}  # each inkling_* family has one label: request_state, kv_cache_block_type or stat
        for family in text_string_to_metric_families(self.text):
            if family.name.startswith("inkling_"):
                for sample in family.samples:
                    out[family.name, next(iter(sample.labels.values()), "")] = sample.value
        return out

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        got = self.read()
        if not got:
            return
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, text, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, text: str, stat: str) -> CounterMetricFamily:
            c = CounterMetricFamily(name, text, labels=names)
            c.add_metric(values, got.get(("inkling_engine_stats", stat), 0.0))
            return c

        yield gauge("vllm:num_requests_running", "Requests in model execution batches",
                    got.get(("inkling_requests", "running"), 0.0))  # fmt: skip
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed",
                    got.get(("inkling_requests", "waiting"), 0.0))  # fmt: skip
        total = got.get(("inkling_kv_cache_blocks", "total"), 0.0)
        used = got.get(("inkling_kv_cache_blocks", "used"), 0.0)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", used / total if total else 0.0
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_query_tokens"
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_hit_tokens"
        )
        yield counter("vllm:num_preemptions", "Preemptions (recomputation) by the scheduler", "preemptions")
        yield counter("vllm:spec_decode_num_drafts", "Steps that drafted MTP tokens", "spec_drafts")
        yield counter("vllm:spec_decode_num_draft_tokens", "MTP draft tokens proposed", "spec_draft_tokens")
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "MTP draft tokens accepted", "spec_accepted_tokens"
        )
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "MTP draft tokens accepted, by draft position", labels=[*names, "position"])  # fmt: skip
        for i in range(8):
            per_pos.add_metric(
                [*values, str(i)], got.get(("inkling_engine_stats", f"spec_accepted_{i + 1}"), 0.0)
            )
        yield per_pos


class Metrics:
    """What /metrics serves: the request latencies as clients see them through this server (vLLM's
    histogram names and buckets), token and request counters, the engine's gauges (EngineMetrics), and
    Triton's own metrics (nv_*, inkling_*) after them."""

    def __init__(self, model_name: str, triton_metrics_url: str | None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        from runtime.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

        self.registry = CollectorRegistry()
        self.model_name, labels, r = model_name, ["model_name"], self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=r).labels(
            model_name
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(model_name)  # fmt: skip
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason",
                               [*labels, "finished_reason"], registry=r)  # fmt: skip
        self.engine = None
        if triton_metrics_url:
            self.engine = EngineMetrics(triton_metrics_url, model_name)
            self.registry.register(self.engine)

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        ours = generate_latest(self.registry)
        return ours + (self.engine.text.encode() if self.engine else b"")


class RequestTimer:
    """One Triton request's latencies into the histograms as its pieces arrive."""

    def __init__(self, metrics: Metrics):
        self.m, self.start, self.last, self.tokens = metrics, time.monotonic(), None, 0

    def piece(self, p: Piece) -> None:
        """A piece arrived: its first token's time to first token, or its tokens' share of the time since
        the previous piece (a piece of several tokens, MTP's or merged, spreads it evenly)."""
        new = p.completion_tokens - self.tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.m.ttft.observe(now - self.start)
        else:
            for _ in range(new):
                self.m.itl.observe((now - self.last) / new)
        self.last, self.tokens = now, p.completion_tokens

    def finished(self, p: Piece | None) -> None:
        self.m.e2e.observe(time.monotonic() - self.start)
        if p is not None:
            self.m.prompt_tokens.inc(p.prompt_tokens)
            self.m.generation_tokens.inc(p.completion_tokens)
            self.m.success.labels(self.m.model_name, p.finish_reason or "stop").inc()


# Remote media, fetched only where the server allows it (--allow-remote-media).


def _remote_parts(messages: list) -> list[tuple[dict, str, str]]:
    """(part, key, URL) of every image/audio part whose URL is http(s)."""
    from inkling.published.chat import AUDIO_PARTS, IMAGE_PARTS

    found = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PARTS | AUDIO_PARTS:
                continue
            holder, key = part, kind
            if isinstance(part.get(kind), dict):
                holder, key = part[kind], "url" if "url" in part[kind] else "data"
            url = holder.get(key)
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                found.append((holder, key, url))
    return found


def _fetch(url: str, max_bytes: int) -> str:
    """The file at `url` as a data: URL, or a 400."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            data = r.read(max_bytes + 1)
    except (OSError, ValueError) as e:
        raise APIError(400, f"cannot fetch {url}: {e}", "messages") from e
    if len(data) > max_bytes:
        raise APIError(413, f"{url} is over the {max_bytes}-byte limit on fetched media", "messages")
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


class Front:
    """The API's logic, apart from the web framework (tests drive it through the real server)."""

    def __init__(
        self,
        triton: Triton,
        model_name: str,
        default_max_tokens: int = 256,
        vocab: Vocab | None = None,
        metrics: Metrics | None = None,
        allow_remote_media: bool = False,
        max_media_bytes: int = 16 << 20,
    ):
        self.triton, self.model_name, self.default_max_tokens = triton, model_name, default_max_tokens
        self.vocab, self.metrics = vocab, metrics or Metrics(model_name, None)
        self.allow_remote_media, self.max_media_bytes = allow_remote_media, max_media_bytes

    def models(self) -> dict:
        return {"object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "inkling-engine"}]}  # fmt: skip

    def check(self, body: Any, chat: bool) -> tuple[int, Sampling, bool, bool]:
        """(n, sampling, stream, include_usage) of a request body, or an APIError."""
        if not isinstance(body, dict):
            raise APIError(422, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}", "model"
            )
        n = _field(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be in 1..{MAX_N}, got {n}", "n")
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {})
        sampling = Sampling.of(body, self.default_max_tokens, chat)
        if sampling.num_logprobs is not None and self.vocab is None:
            raise APIError(400, "logprobs need the engine's tokenizer, which this server was started without")
        return n, sampling, stream, bool(options.get("include_usage"))

    async def merged(self, inputs: list[dict]) -> AsyncIterator[tuple[int, Piece]]:
        """The pieces of n requests as they come, tagged with their index; all cancelled on leaving early."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(i: int, x: dict) -> None:
            timer, last = self.metrics.request(), None
            try:
                async for piece in self.triton.generate(x):
                    timer.piece(piece)
                    last = piece
                    await queue.put((i, piece))
                await queue.put((i, None))
            except BaseException as e:  # an APIError, or the cancellation of a client gone
                await queue.put((i, e))
            finally:
                timer.finished(last if last is not None and last.finish_reason else None)

        tasks = [asyncio.create_task(run(i, x)) for i, x in enumerate(inputs)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def requests(self, body: dict, chat: bool, n: int, sampling: Sampling) -> list[dict]:
        """The ensemble's inputs for each of the n completions (remote media fetched first, where allowed)."""
        if chat and self.allow_remote_media and isinstance(body.get("messages"), list):
            body = {**body, "messages": copy.deepcopy(body["messages"])}
            for holder, key, url in _remote_parts(body["messages"]):
                holder[key] = await asyncio.to_thread(_fetch, url, self.max_media_bytes)
        prompt = chat_inputs(body) if chat else completion_inputs(body)
        return [{**prompt, **sampling.inputs(i)} for i in range(n)]

    def _logprobs(self, c: Completion, chat: bool, start: int = 0, offset: int = 0) -> dict | None:
        if not c.logprobs[start:] or self.vocab is None:
            return None
        return (
            self.vocab.chat_logprobs(c, start) if chat else self.vocab.completion_logprobs(c, start, offset)
        )

    async def complete(self, requests: list[dict], chat: bool) -> dict:
        done = [Completion() for _ in requests]
        async for i, piece in self.merged(requests):
            done[i].add(piece)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if chat:
            choices = []
            for i, c in enumerate(done):
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": c.text or (None if c.tool_calls else ""),
                }
                if c.reasoning:
                    message["reasoning_content"] = c.reasoning
                if c.tool_calls:
                    message["tool_calls"] = c.tool_calls
                choices.append({"index": i, "message": message, "logprobs": self._logprobs(c, chat),
                                "finish_reason": c.finish_reason})  # fmt: skip
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": c.text, "logprobs": self._logprobs(c, chat),
                        "finish_reason": c.finish_reason} for i, c in enumerate(done)]  # fmt: skip
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": _now(), "model": self.model_name, "choices": choices,
                "usage": usage(done)}  # fmt: skip

    async def events(self, requests: list[dict], chat: bool, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of each completion, the usage chunk if asked, [DONE]."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": _now(),
                "model": self.model_name}  # fmt: skip
        done = [Completion() for _ in requests]
        if chat:
            for i in range(len(requests)):
                yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})  # fmt: skip
        try:
            async for i, piece in self.merged(requests):
                c = done[i]
                calls, tokens, chars = len(c.tool_calls), len(c.token_ids), len(c.text)
                c.add(piece)
                finish = c.finish_reason or None
                logprobs = self._logprobs(c, chat, tokens, chars)
                if chat:
                    delta: dict[str, Any] = {}
                    if piece.text:
                        delta["content"] = piece.text
                    if piece.reasoning:
                        delta["reasoning_content"] = piece.reasoning
                    if piece.tool_calls:
                        delta["tool_calls"] = [
                            {**call, "index": calls + k} for k, call in enumerate(piece.tool_calls)
                        ]
                    if not delta and not finish and not logprobs:
                        continue
                    choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                else:
                    if not piece.text and not finish and not logprobs:
                        continue
                    choice = {"index": i, "text": piece.text, "logprobs": logprobs, "finish_reason": finish}
                yield _sse({**head, "choices": [choice]})
        except APIError as e:  # after the first byte an error can only be an event of the stream
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage(done)})
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# The web application.


def create_app(front: Front, max_body_bytes: int = 64 << 20) -> FastAPI:
    # (FastAPI reads the handlers' annotations by name: Request must be a module global)
    app = FastAPI(title="Inkling (OpenAI-compatible)")

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise APIError(413, f"the request body is {size} bytes, over the limit of {max_body_bytes}")
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise APIError(413, f"the request body is {len(raw)} bytes, over the limit of {max_body_bytes}")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not JSON: {e}") from e

    async def serve(request: Request, chat: bool):
        try:
            body = await body_of(request)
            n, sampling, stream, include_usage = front.check(body, chat)
            requests = await front.requests(body, chat, n, sampling)
            if stream:  # the request's own errors are plain responses, before the stream's first byte
                return StreamingResponse(
                    front.events(requests, chat, include_usage), media_type="text/event-stream"
                )
            task = asyncio.create_task(front.complete(requests, chat))
            while not task.done():  # a client that goes away cancels its requests
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await request.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return JSONResponse({}, status_code=499)
            return JSONResponse(task.result())
        except APIError as e:
            return error(e)
        except Exception as e:  # a fault of ours: the server answers and stays up
            return error(APIError(500, f"{type(e).__name__}: {e}"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return front.models()

    @app.get("/health")
    async def health():
        if await front.triton.ready():
            return {"status": "ok"}
        return error(APIError(503, f"Triton at {front.triton.url} is not ready"))

    @app.get("/metrics")
    async def metrics():
        text = await asyncio.to_thread(front.metrics.exposition)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_repo.openai_front", description=__doc__.split("\n")[0])
    p.add_argument("--triton", default="127.0.0.1:8001", help="Triton's gRPC address")
    p.add_argument("--triton-metrics", default="http://127.0.0.1:8002/metrics",
                   help="Triton's metrics URL (the engine's gauges under vLLM's names; '' for none)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, help="the engine's tokenizer.json (logprobs' token text)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model", default="inkling", help="the model name clients send and /v1/models lists")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20)
    p.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s) image and audio URLs in chat messages (refused otherwise)")  # fmt: skip
    p.add_argument("--max-media-bytes", type=int, default=16 << 20, help="the limit on one fetched file")
    args = p.parse_args(argv)
    import uvicorn

    front = Front(
        Triton(args.triton),
        args.model,
        args.default_max_tokens,
        vocab=Vocab(args.tokenizer) if args.tokenizer else None,
        metrics=Metrics(args.model, args.triton_metrics or None),
        allow_remote_media=args.allow_remote_media,
        max_media_bytes=args.max_media_bytes,
    )
    uvicorn.run(create_app(front, args.max_body_bytes), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

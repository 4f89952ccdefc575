"""The Python API: `LLM` (generate, stream) and `EngineLoop` (a background engine thread for servers).

from runtime import LLM, SamplingParams
llm = LLM("build/engine-tiny")
out = llm.generate(["Hello", {"text": "What is <|image|>?", "images": [png_bytes]}], SamplingParams(max_tokens=8))
async for delta in llm.stream("Hello", SamplingParams(max_tokens=8)): print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from builder.engine import Engine, read_engine_config, world_size_of
from inkling.published.chat import ChatRenderer
from inkling.published.processing import PreprocessorSettings, Processor, Prompt

from .data_parallel import join_replicas
from .distributed import Workers
from .engine import LLMEngine, PromptInput, StreamDelta
from .params import SamplingParams

PromptLike = str | dict | Prompt | PromptInput
log = logging.getLogger("runtime.llm")


@dataclass
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None  # where SamplingParams.logprobs > 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # finish_reason "error": why the request was ended while it was served
    message: Any = None  # from LLM.chat: the answer parsed (inkling.published.chat_output.ChatDelta)


class LLM:
    def __init__(
        self,
        engine: str | os.PathLike | Engine,
        num_blocks: int | None = None,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        pad_eager: bool = False,
        overlap: bool | None = None,
        max_prefill_pairs: int | None = None,
        decode_slowdown: float | None = None,
        dp: tuple[int, str] | None = None,
    ):
        """engine: a directory, or an Engine in memory (one rank only). A tensor-parallel engine (tp_size N)
        is loaded here as rank 0, and its other N-1 ranks are started as worker processes (stop them with
        `shutdown()`; they also stop when this process exits). A data-parallel engine (dp_size N) runs as N
        replica processes behind a router (runtime/data_parallel_front.py); this process holds none of it.
        cuda_graphs: replay decode/verify steps and
        MTP drafting from CUDA graphs per (batch, tokens) bucket, on every rank (a CUDA engine). None (the
        default): on for a one-rank CUDA engine with the Triton plugins, off otherwise
        (runtime.model_runner.default_cuda_graphs). pad_eager (tests): the same buckets and padding, run eagerly (runtime/step_graphs.py).
        overlap: launch each decode step before the host has read the previous one's tokens
        (LLMEngine.step); None: on for a one-rank CUDA engine. max_prefill_pairs: a prefill chunk beside
        decoding sequences keeps tokens x (context + tokens) within it (runtime/scheduler.py).
        decode_slowdown: prefill chunks beside decoding sequences are paced so that those sequences' mean
        step stays within this multiple of a decode-only step (runtime/scheduler.py PrefillPacer).
        dp: (rank, store address): this process is that replica of a data-parallel engine (started by
        DataParallelEngine through runtime.engine_child)."""
        self.workers = self.dp = None
        if isinstance(engine, Engine):
            if engine.world_size > 1:
                raise ValueError(
                    f"a multi-rank engine (tp_size {engine.tp_size}, ep_size {engine.ep_size}) runs from its "
                    "directory, where each rank loads its own part: save it and pass the path"
                )
        else:
            config = read_engine_config(os.fspath(engine))
            world_size = world_size_of(config)
            if dp is None and config.get("mapping", {}).get("dp_size", 1) > 1:
                self._front(os.fspath(engine), config, num_blocks, seed, cuda_graphs, overlap, pad_eager)
                return
            rank = 0
            if dp is not None:
                rank, store = dp
                self.dp = join_replicas(store, rank, world_size, config)
            elif world_size > 1:
                graphs = "cuda" if cuda_graphs else ("pad_eager" if pad_eager else "off")
                self.workers = Workers(os.fspath(engine), config, num_blocks, graphs)
                weakref.finalize(self, self.workers.shutdown)
            try:
                engine = Engine.from_dir(engine, rank=rank, world_size=world_size)
            except BaseException:
                self.shutdown()
                raise
        self.engine = LLMEngine(
            engine, num_blocks, seed, workers=self.workers, cuda_graphs=cuda_graphs, pad_eager=pad_eager,
            overlap=overlap, max_prefill_pairs=max_prefill_pairs, decode_slowdown=decode_slowdown, dp=self.dp,
        )  # fmt: skip
        self._init_prompts(engine.config)

    def _init_prompts(self, engine_config: dict) -> None:
        """The processor and chat renderer of `self.engine`'s tokenizer (none without one), the preprocessor
        settings from its engine's config.json `engine_config`, and the request ids."""
        self.processor = self.chat_renderer = None
        if self.engine.tokenizer:
            settings = PreprocessorSettings.from_dict(engine_config.get("preprocessor", {}))
            self.processor = Processor(self.engine.config, self.engine.tokenizer, settings)
            self.chat_renderer = ChatRenderer(self.engine.tokenizer)
        self._ids = itertools.count()

    def _front(
        self, engine_dir: str, config: dict, num_blocks, seed, cuda_graphs, overlap, pad_eager
    ) -> None:
        """A data-parallel engine's front: its replicas behind their router (runtime/data_parallel_front.py) as
        `self.engine`, and this process's tokenizer and processor for the prompts."""
        from tokenizers import Tokenizer

        from builder.engine import model_config_of

        from .data_parallel_front import DataParallelEngine

        self.engine = DataParallelEngine(
            engine_dir,
            seed,
            num_blocks=num_blocks,
            cuda_graphs=cuda_graphs,
            overlap=overlap,
            pad_eager=pad_eager,
        )
        weakref.finalize(self, self.engine.shutdown)
        self.engine.config = model_config_of(config)
        path = os.path.join(engine_dir, "tokenizer.json")
        self.engine.tokenizer = Tokenizer.from_file(path) if os.path.exists(path) else None
        self._init_prompts(config)

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine, or the replicas of a data-parallel one
        (nothing to do for one rank)."""
        from .data_parallel_front import DataParallelEngine

        if isinstance(getattr(self, "engine", None), DataParallelEngine):
            self.engine.shutdown()
        elif self.workers is not None:
            self.engine.runner.drop_graphs()
            self.workers.shutdown()
        elif self.dp is not None:
            if hasattr(self, "engine"):
                self.engine.runner.drop_graphs()
            self.dp.leave()
            self.dp = None

    # Prompts.
    def prepare(self, prompt: PromptLike) -> PromptInput:
        """Text (with <|image|>/<|audio|> placeholders) and raw media -> token ids and pad embeddings."""
        if isinstance(prompt, PromptInput):
            return prompt
        if isinstance(prompt, str):
            prompt = {"text": prompt}
        if isinstance(prompt, dict) and "messages" in prompt:
            if self.chat_renderer is None:
                raise ValueError("the chat form needs an engine of the real Inkling with its tokenizer")
            chat = self.chat_renderer.render(
                prompt["messages"], tools=prompt.get("tools"), reasoning_effort=prompt.get("reasoning_effort")
            )
            prompt = self.processor.chat(chat, prompt.get("images", ()), prompt.get("audios", ()))
        elif isinstance(prompt, dict):
            if self.processor is None:
                raise ValueError("this engine has no tokenizer: give token ids (PromptInput)")
            prompt = self.processor(
                prompt.get("text", ""), prompt.get("images", ()), prompt.get("audios", ())
            )
        return self.embed_media(prompt)

    def embed_media(self, prompt) -> PromptInput:
        c = self.engine.config
        ids = prompt.input_ids  # inkling.published.processing.Prompt
        if not prompt.pixel_values and not prompt.audio_levels:
            return PromptInput(ids)
        # a data-parallel engine's front embeds the media itself (runtime/data_parallel_front.py)
        encoder = self.engine.runner if hasattr(self.engine, "runner") else self.engine
        rows = encoder.encode_media(prompt.pixel_values, prompt.audio_levels)
        positions = torch.cat(
            [(ids == c.image_token_id).nonzero().flatten(), (ids == c.audio_token_id).nonzero().flatten()]
        )
        return PromptInput(ids, rows, positions)

    # Generation.
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, batched together; outputs in the order of the prompts. A request that
        fails while it is served comes back with finish_reason "error" and its `error`; the others are
        unaffected. Should the engine itself fail, these requests are aborted before the error propagates,
        so the LLM stays usable."""
        if isinstance(prompts, (str, dict, Prompt, PromptInput)):
            prompts = [prompts]
        params_list = (
            list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        )
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, self.prepare(prompt), p)
                ids.append(rid)
            merged: dict[str, StreamDelta | None] = dict.fromkeys(ids)
            while any(merged[rid] is None or merged[rid].finish_reason is None for rid in ids):
                for d in self.engine.step():
                    if d.finish_reason == "rejected":  # refused where it was routed (a data-parallel replica)
                        raise ValueError(d.error)
                    if d.request_id in merged:
                        so_far = merged[d.request_id]
                        merged[d.request_id] = d if so_far is None else so_far.merge(d)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [_output(merged[rid]) for rid in ids]

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict] | None = None,
        reasoning_effort: str | float | None = None,
    ) -> list[RequestOutput]:
        """Conversations (each a list of OpenAI-style messages; one list alone is one conversation) in
        the real Inkling's chat format; each output's `message` holds the answer's visible text, thinking
        and tool calls (inkling/published/chat.py, chat_output.py)."""
        from inkling.published.chat_output import parse_output

        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            {"messages": c, "tools": tools, "reasoning_effort": reasoning_effort} for c in conversations
        ]
        outs = self.generate(prompts, params)
        for o in outs:
            o.message = parse_output(self.engine.tokenizer, o.token_ids)
        return outs

    async def stream(
        self, prompt: PromptLike, params: SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Text deltas of one request as they come (drives the engine itself; for many concurrent
        streams use EngineLoop)."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, self.prepare(prompt), params or SamplingParams())
        try:
            while True:
                for d in self.engine.step():
                    if d.request_id == rid:
                        yield d
                        if d.finish_reason is not None:
                            return
                await asyncio.sleep(0)
        finally:
            self.engine.abort_request(rid)  # a consumer that stops early, or an engine failure


def _output(d: StreamDelta) -> RequestOutput:
    """A request's deltas, merged (StreamDelta.merge), as its output."""
    return RequestOutput(
        d.request_id, d.text, d.token_ids, d.finish_reason, d.prompt_tokens, d.completion_tokens,
        d.logprobs, d.top_logprobs, d.metrics or {}, d.error,
    )  # fmt: skip


class EngineLoop:
    """The engine stepping in a background thread; requests come and go from any thread.

    on_delta callbacks run on the engine thread: keep them short (e.g. hand off to a queue)."""

    def __init__(
        self,
        engine: str | os.PathLike | Engine,
        num_blocks: int | None = None,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        overlap: bool | None = None,
        max_prefill_pairs: int | None = None,
        decode_slowdown: float | None = None,
    ):
        self.llm = LLM(
            engine, num_blocks, seed, cuda_graphs, overlap=overlap, max_prefill_pairs=max_prefill_pairs,
            decode_slowdown=decode_slowdown,
        )  # fmt: skip
        self.engine = self.llm.engine
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callable[[StreamDelta], Any]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="inkling-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt: PromptLike,
        params: SamplingParams,
        on_delta: Callable[[StreamDelta], Any],
    ) -> None:
        """Queue a request; invalid ones raise ValueError here, in the caller's thread."""
        prepared = self.llm.prepare(prompt)
        self.engine.validate(prepared.input_ids.tolist(), params, prepared)
        self._inbox.put(("add", request_id, prepared, params, on_delta))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def cache_stats(self) -> dict:
        with self._lock:
            return self.engine.cache_stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.llm.shutdown()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, rid, prompt, params, cb = item
                rejected = self.engine.try_add_request(rid, prompt, params)
                if rejected is None:
                    self._callbacks[rid] = cb
                else:
                    cb(rejected)
            else:
                delta = self.engine.abort_request(item[1])
                cb = self._callbacks.pop(item[1], None)
                if delta is not None and cb is not None:
                    cb(delta)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._drain_inbox()
                busy = self.engine.has_unfinished()
                try:
                    deltas = self.engine.step() if busy else []
                except Exception as e:  # the engine's own fault, not one request's: end what runs, go on
                    log.exception("engine step failed")
                    deltas = [
                        dataclasses.replace(d, finish_reason="error", error=f"engine failure: {e}")
                        for d in self.engine.abort_all()
                    ]
            for d in deltas:
                cb = self._callbacks.get(d.request_id)
                if d.finish_reason is not None:
                    self._callbacks.pop(d.request_id, None)
                if cb is not None:
                    try:
                        cb(d)
                    except Exception:  # a broken callback (client gone) must not stop the engine
                        self.abort(d.request_id)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
        with self._lock:
            self.engine.abort_all()


def time_generation(llm: LLM, prompts: Sequence[PromptLike], params: SamplingParams) -> dict[str, float]:
    """Tokens/s of a batch through the in-process API (for benchmarks)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(o.completion_tokens for o in outs)
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}

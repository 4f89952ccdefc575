"""The OpenAI-compatible API (model_repo/openai_front.py) in front of a real Triton server on the real
Inkling's float32 tiny engine, driven by the official `openai` client, sync, async and streaming.

What it answers equals the in-process runtime's (LLM.generate, LLM.chat) for every endpoint and option:
completions and chat, text with images and audio as data URLs, streaming with usage, stop strings, seeds,
n, tools and a tool-call round trip, the thinking effort; errors have OpenAI's shape and codes; a client
that disconnects frees its blocks.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("tritonclient.grpc")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton is not installed (make venv)", allow_module_level=True)

from inkling.demo import demo_png, demo_wav  # noqa: E402
from model_repo.serve import OpenAIServer, ServeConfig, free_port  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

from .test_serving import wait_held, wait_released  # noqa: E402

MODEL = "inkling-tiny"
TEXT = "The history of the printing press"
IMAGE_URL = "data:image/png;base64," + base64.b64encode(demo_png(50, 30)).decode()
AUDIO = base64.b64encode(demo_wav(0.3)).decode()
MEDIA_MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        {"type": "input_audio", "input_audio": {"data": AUDIO, "format": "wav"}},
    ]},
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look something up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
# A tool-call round trip as a client sends its second turn: the model's call, the tool's result.
ROUND_TRIP = [
    {"role": "user", "content": "Find the printing press's year."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "look", "arguments": "{\"q\": \"printing press\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "1440"},
]  # fmt: skip


@pytest.fixture(scope="module")
def front(server):
    with OpenAIServer(server.cfg, free_port(), MODEL) as f:
        yield f


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(engine_f32):
    return LLM(engine_f32[1])


def in_process_chat(llm, messages, max_tokens=8, **kw):
    (out,) = llm.chat(messages, SamplingParams(max_tokens=max_tokens), **kw)
    m = out.message
    return m.content, m.thinking, [c.to_dict() for c in m.tool_calls], out


def test_models_and_health(client, front):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(front.url.removesuffix("/v1") + "/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


def test_completion_equals_in_process(client, llm):
    want = llm.generate(TEXT, SamplingParams(max_tokens=8))[0]
    got = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0)
    (choice,) = got.choices
    assert choice.text == want.text and choice.finish_reason == want.finish_reason == "length"
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == 8
    assert got.usage.total_tokens == want.prompt_tokens + 8 and got.object == "text_completion"


def test_completion_stream_with_usage(client, llm):
    want = llm.generate(TEXT, SamplingParams(max_tokens=8))[0]
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_with_image_and_audio_equals_in_process(client, llm):
    content, thinking, calls, out = in_process_chat(llm, MEDIA_MESSAGES, tools=TOOLS, reasoning_effort="low")
    got = client.chat.completions.create(model=MODEL, messages=MEDIA_MESSAGES, tools=TOOLS, max_tokens=8,
                                         temperature=0, reasoning_effort="low")  # fmt: skip
    (choice,) = got.choices
    assert (choice.message.content or "") == content and choice.message.role == "assistant"
    assert getattr(choice.message, "reasoning_content", None) in (thinking or None, thinking)
    assert [c.model_dump() for c in choice.message.tool_calls or []] == calls
    assert got.usage.prompt_tokens == out.prompt_tokens and got.usage.completion_tokens == len(out.token_ids)


def test_chat_stream_equals_unary(client):
    kw = dict(model=MODEL, messages=MEDIA_MESSAGES, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_tool_call_round_trip_renders_as_in_process(client, llm):
    """The second turn of a tool call (the model's call, the tool's answer) through the chat format."""
    content, _, _, out = in_process_chat(llm, ROUND_TRIP, tools=TOOLS)
    got = client.chat.completions.create(
        model=MODEL, messages=ROUND_TRIP, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert (got.choices[0].message.content or "") == content
    assert got.usage.prompt_tokens == out.prompt_tokens


def test_stop_seed_and_n(client, llm):
    full = llm.generate(TEXT, SamplingParams(max_tokens=10))[0].text
    piece = full[len(full) // 2 : len(full) // 2 + 2]
    if piece.strip():
        cut = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=10, temperature=0, stop=[piece])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(piece)]
    sampled = dict(model=MODEL, prompt=TEXT, max_tokens=8, temperature=1.0, top_p=0.9)
    a = client.completions.create(**sampled, seed=1234)
    b = client.completions.create(**sampled, seed=1234)
    c = client.completions.create(**sampled, seed=99)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    two = client.completions.create(**sampled, seed=1234, n=2)
    assert [ch.index for ch in two.choices] == [0, 1] and two.choices[0].text == a.choices[0].text
    assert two.usage.completion_tokens == 16


def test_logprobs_equal_in_process(client, llm, engine_f32):
    """Chat logprobs (each token's and its top 3) and completions logprobs, unary and streamed, equal the
    runtime's; token text and bytes are the tokenizer's."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{engine_f32[1]}/tokenizer.json")
    (out,) = llm.chat(MEDIA_MESSAGES, SamplingParams(max_tokens=8, logprobs=3))
    kw = dict(
        model=MODEL, messages=MEDIA_MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    got = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in got]
    assert [t.logprob for t in got] == pytest.approx(out.logprobs, abs=1e-5)
    for t, token_id, top in zip(got, out.token_ids, out.top_logprobs):
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(list(top.values()), abs=1e-5)
        assert t.top_logprobs[0].token == t.token  # greedy: the token is its row's most likely
        if token_id not in tokenizer.get_added_tokens_decoder():  # a byte-level token: its bytes decode as it
            assert tokenizer.decode([token_id]) == bytes(t.bytes).decode("utf-8", "replace")
    want = llm.generate(TEXT, SamplingParams(max_tokens=8, logprobs=2))[0]
    lp = (
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0, logprobs=2)
        .choices[0]
        .logprobs
    )
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5) and len(lp.tokens) == 8
    assert [len(t) for t in lp.top_logprobs] == [2] * 8 and lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(7))


def metric(text: str, name: str, **labels) -> float:
    """The value of a Prometheus sample in exposition `text` (0.0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def prefix_cacheable(client, llm, engine_f32) -> str:
    """A prompt whose second request finds the first's blocks in the prefix cache: its length ends one
    token past a block (a cached prefix ends where the short-convolution history can restore it)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{engine_f32[1]}/tokenizer.json")
    bs = llm.engine.blocks.block_size
    extra = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage.prompt_tokens - len(
        tokenizer.encode(TEXT).ids
    )
    words = " ".join([TEXT] * 16).split()
    for n in range(len(words), 0, -1):
        prompt = " ".join(words[:n])
        length = len(tokenizer.encode(prompt).ids) + extra
        if length > 2 * bs and length % bs == 1:
            return prompt
    raise AssertionError("no prompt of the right length")


def test_metrics_under_vllm_names(client, front, llm, engine_f32):
    """/metrics: vLLM's names for what the requests did (latency histograms, token counters, the engine's
    prefix-cache and MTP counters and gauges), then Triton's own."""

    def scrape() -> str:
        with urllib.request.urlopen(front.url.removesuffix("/v1") + "/metrics", timeout=10) as r:
            return r.read().decode()

    long = prefix_cacheable(client, llm, engine_f32)
    before = scrape()
    a = client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0, stream=True)
    list(b)
    mtp = client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0,
                                    extra_body={"num_draft_tokens": 2})  # fmt: skip
    m = {"model_name": MODEL}
    # The engine's counters and gauges reach Triton's metrics a moment after the answer (the model
    # publishes them at most every 0.1 s, after sending): scrape until the last request's drafts show.
    deadline = time.monotonic() + 10
    while True:
        after = scrape()
        settled = metric(after, "vllm:spec_decode_num_drafts_total", **m) > metric(
            before, "vllm:spec_decode_num_drafts_total", **m
        ) and not metric(after, "vllm:num_requests_running", **m)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("vllm:time_to_first_token_seconds_count", **m) == 3
    assert grew("vllm:e2e_request_latency_seconds_count", **m) == 3
    assert grew("vllm:inter_token_latency_seconds_count", **m) >= 5  # a request's tokens after its first
    assert (
        grew("vllm:generation_tokens_total", **m)
        == a.usage.completion_tokens * 2 + mtp.usage.completion_tokens
    )
    assert grew("vllm:prompt_tokens_total", **m) == 3 * a.usage.prompt_tokens
    assert grew("vllm:request_success_total", finished_reason="length", **m) == 3
    assert grew("vllm:prefix_cache_queries_total", **m) >= 2 * a.usage.prompt_tokens  # MTP skips the cache
    assert grew("vllm:prefix_cache_hits_total", **m) > 0  # the second request's prompt was cached
    drafts = grew("vllm:spec_decode_num_draft_tokens_total", **m)
    assert drafts > 0 and 0 <= grew("vllm:spec_decode_num_accepted_tokens_total", **m) <= drafts
    assert grew("vllm:spec_decode_num_drafts_total", **m) > 0
    assert 0 <= metric(after, "vllm:kv_cache_usage_perc", **m) <= 1
    assert metric(after, "vllm:num_requests_running", **m) == 0 and "vllm:num_requests_waiting" in after
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in after
    assert "nv_inference_request_success" in after and "inkling_kv_cache_blocks" in after  # Triton's own


def test_remote_media_fetched_only_where_allowed(server, llm, tmp_path):
    """With --allow-remote-media an http image URL is fetched and answers as its data: URL does; without,
    it is refused (test_bad_requests_get_openai_errors), and a URL that fails is a 400."""
    import functools
    import http.server
    import threading

    (tmp_path / "p.png").write_bytes(demo_png(50, 30))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}"

    def ask(image_url: str):
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                                 {"type": "image_url", "image_url": {"url": image_url}}]}]  # fmt: skip
        return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)

    try:
        with OpenAIServer(server.cfg, free_port(), MODEL, extra=("--allow-remote-media",)) as remote:
            c = openai.OpenAI(base_url=remote.url, api_key="unused", max_retries=0)
            fetched, inline = ask(f"{url}/p.png"), ask(IMAGE_URL)
            assert fetched.choices[0].message.content == inline.choices[0].message.content
            assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
            with pytest.raises(openai.BadRequestError, match="cannot fetch"):
                ask(f"{url}/missing.png")
    finally:
        files.shutdown()


def test_ignore_eos(client, llm):
    want = llm.generate(TEXT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    got = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 24


def test_async_streams_at_once_equal_in_process(front, llm):
    prompts = [TEXT, "def fibonacci(n):", "Hello there", "A long time ago"]
    want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=6))]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        aclient = openai.AsyncOpenAI(base_url=front.url, api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == want


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(model="gpt-4"), openai.NotFoundError, "does not exist"),
        (dict(temperature=5), openai.BadRequestError, "temperature"),
        (dict(n=99), openai.BadRequestError, "n must be in"),
        (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
        (dict(max_tokens=100_000), openai.BadRequestError, "max_seq_len"),  # the engine's refusal
        (dict(logprobs=True, top_logprobs=21), openai.BadRequestError, "top_logprobs"),
        (dict(top_logprobs=2), openai.BadRequestError, "needs logprobs"),
        (dict(messages=[]), openai.BadRequestError, "messages"),
        (dict(messages=[{"role": "robot", "content": "x"}]), openai.BadRequestError, "role"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]),
         openai.BadRequestError, "remote image URLs are not fetched"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
         openai.BadRequestError, "cannot decode image"),
        (dict(reasoning_effort="extreme"), openai.BadRequestError, "reasoning_effort"),
        (dict(temperature="hot"), openai.UnprocessableEntityError, "temperature"),
    ],
    ids=["unknown model", "temperature", "n", "max_tokens 0", "beyond the engine", "top_logprobs",
         "top_logprobs alone", "no messages",
         "bad role", "remote image", "undecodable image", "effort", "wrong type"],
)  # fmt: skip
def test_bad_requests_get_openai_errors(client, kwargs, error, words):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    with pytest.raises(error, match=words) as e:
        client.chat.completions.create(**{**args, **kwargs})
    assert e.value.status_code in (400, 404, 422)


def test_malformed_and_oversized_bodies(front, server):
    def post(data: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(f"{front.url}/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, body = post(b"{not json")
    assert code == 400 and "not JSON" in body["error"]["message"]
    code, body = post(b"[1, 2]")
    assert code == 422
    with OpenAIServer(server.cfg, free_port(), MODEL, extra=("--max-body-bytes", "1000")) as small:
        req = urllib.request.Request(f"{small.url}/chat/completions", data=b"{" + b" " * 2000 + b"}",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 413


def test_triton_down_is_503(server, tmp_path):
    cfg = ServeConfig(engine_dir=server.cfg.engine_dir, work_dir=str(tmp_path), grpc_port=free_port())
    with OpenAIServer(cfg, free_port(), MODEL) as dead:
        c = openai.OpenAI(base_url=dead.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503


def test_a_client_that_disconnects_frees_its_blocks(client, server):
    wait_released(server)
    stream = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    assert wait_held(server) > 0
    stream.close()  # the connection drops with most of the 200 tokens still to come
    assert wait_released(server) == {"held": 0, "running": 0}
    assert (
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"
    )

"""A real Triton server on the float32 tiny engine, real clients (DESIGN.md "Serving").

One server for the module, on free localhost ports. Greedy outputs through every door (HTTP and
gRPC unary on `ensemble_unary`, gRPC streaming on `ensemble`, the generate endpoints) equal the
in-process runtime's; bad requests get clear errors and the server keeps serving.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import wave

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton is not installed (make venv)", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from inkling.demo import demo_png, demo_wav  # noqa: E402
from model_repo.serve import ServeConfig, TritonServer, free_port  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

from .conftest import LIMITS  # noqa: E402

MAX_TOKENS = 8
PNG, WAV = demo_png(40, 24), demo_wav(0.5)
IMG, AUD = (
    "<|content_image|><|unused_200054|>",
    "<|content_audio_input|><|unused_200053|>",
)  # the real placeholders
PROMPTS = [
    {"text": "Hello there, how are you?"},
    {"text": f"A picture {IMG} described:", "images": [PNG]},
    {"text": f"A sound {AUD} transcribed:", "audios": [WAV]},
    {
        "text": f"{IMG} and {AUD} and {IMG}",
        "images": [demo_png(16, 16), demo_png(50, 33)],
        "audios": [WAV],
    },
]


@pytest.fixture(scope="module")
def expected(engine_f32):
    """Greedy outputs of the in-process runtime for PROMPTS."""
    outs = LLM(engine_f32[1]).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    return [(o.text, o.token_ids, o.finish_reason) for o in outs]


def inputs(
    mod, prompt: dict, max_tokens: int = MAX_TOKENS, stream: bool | None = None, b64: bool = False
) -> list:
    def add(name, array, dtype):
        x = mod.InferInput(name, list(array.shape), dtype)
        x.set_data_from_numpy(array)
        out.append(x)

    out: list = []
    if "text" in prompt:
        add("text_input", np.array([prompt["text"].encode()], dtype=np.object_), "BYTES")
    for name in ("messages", "tools", "reasoning_effort"):  # the chat form
        if name in prompt:
            value = prompt[name] if isinstance(prompt[name], str) else json.dumps(prompt[name])
            add(name, np.array([value.encode()], dtype=np.object_), "BYTES")
    for key, name in (("images", "image_data_input"), ("audios", "audio_data_input")):
        if prompt.get(key):
            values = [base64.b64encode(v) if b64 else v for v in prompt[key]]
            add(name, np.array(values, dtype=np.object_), "BYTES")
    add("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")
    if stream is not None:
        add("stream", np.array([stream]), "BOOL")
    return out


def result(r) -> tuple[str, list[int], str]:
    return (
        r.as_numpy("text_output")[0].decode(),
        r.as_numpy("output_ids").tolist(),
        r.as_numpy("finish_reason")[0].decode(),
    )


def grpc_stream(url: str, requests: list[tuple[str, list]], timeout: float = 120.0) -> dict[str, list]:
    """Send requests on one gRPC stream to `ensemble`; the responses of each, by request id."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    done = 0
    try:
        for rid, ins in requests:
            client.async_stream_infer("ensemble", ins, request_id=rid)
        out: dict[str, list] = {rid: [] for rid, _ in requests}
        deadline = time.monotonic() + timeout
        while done < len(requests):
            res, err = got.get(timeout=max(0.1, deadline - time.monotonic()))
            assert err is None, err
            rid = res.get_response().id
            out[rid].append(res)
            done += bool(res.as_numpy("finish_reason")[0])
        return out
    finally:
        # After a failure, cancel what is still pending: closing the stream otherwise waits for every
        # request to finish, and once hung the whole suite (a stuck stream seen once, on a loaded machine)
        client.stop_stream(cancel_requests=done < len(requests))
        client.close()


def join(deltas: list) -> tuple[str, list[int], str]:
    parts = [result(r) for r in deltas]
    return "".join(p[0] for p in parts), [t for p in parts for t in p[1]], parts[-1][2]


METRICS_LAG_S = 0.3  # `inkling` publishes its gauges every 0.1 s


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.cfg.metrics_url, timeout=5) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^(inkling_\w+\{\w+="\w+"\}) (\S+)$', text, re.M)} | {
        "_text": text
    }


def cache(server) -> dict[str, float]:
    m = metrics(server)
    get = lambda kind: m[f'inkling_kv_cache_blocks{{kv_cache_block_type="{kind}"}}']
    return {
        "held": get("used") - get("evictable"),  # blocks no finished request could give back
        "running": m['inkling_requests{request_state="running"}']
        + m['inkling_requests{request_state="waiting"}'],
    }


def wait_cache(server, done, timeout: float = 10.0) -> dict[str, float]:
    """The cache statistics once `done(stats)` holds or the timeout passes (the gauges update asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        c = cache(server)
        if done(c) or time.monotonic() > deadline:
            return c
        time.sleep(0.1)


def wait_released(server) -> dict[str, float]:
    return wait_cache(server, lambda c: c["held"] == 0 and c["running"] == 0)


def wait_held(server) -> float:
    """Blocks held by running requests, once the metrics show some."""
    return wait_cache(server, lambda c: c["held"] > 0)["held"]


def generate(server, model: str, body: dict, stream: bool = False):
    route = "generate_stream" if stream else "generate"
    req = urllib.request.Request(
        f"http://{server.cfg.http_url}/v2/models/{model}/{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    if not stream:
        return json.loads(raw)
    return [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]


def as_list(x) -> list:
    """The generate endpoints write a one-element tensor as a scalar."""
    return x if isinstance(x, list) else [x]


def body(prompt: dict, **extra) -> dict:
    b = {"text_input": prompt["text"], "max_tokens": MAX_TOKENS, **extra}
    for key, name in (("images", "image_data_input"), ("audios", "audio_data_input")):
        if prompt.get(key):
            b[name] = [base64.b64encode(v).decode() for v in prompt[key]]
    return b


def assert_serving(server) -> None:
    assert server.process.poll() is None, server.log_tail()
    client = httpclient.InferenceServerClient(server.cfg.http_url)
    try:
        assert client.is_server_ready()
        r = client.infer("ensemble_unary", inputs(httpclient, PROMPTS[0], max_tokens=2))
        assert r.as_numpy("completion_tokens")[0] == 2
    finally:
        client.close()


# Correctness through every door.
def test_http_unary_equals_in_process(server, expected):
    client = httpclient.InferenceServerClient(server.cfg.http_url)
    try:
        for prompt, want in zip(PROMPTS, expected):
            assert result(client.infer("ensemble_unary", inputs(httpclient, prompt))) == want
    finally:
        client.close()


def test_engine_on_a_stub_thread_equals_in_process(engine_f32, tmp_path, expected):
    """`--no-engine-process`: the engine loop on a thread of the `inkling` stub, as before EngineProcess."""
    cfg = ServeConfig(
        engine_dir=str(engine_f32[1]), work_dir=str(tmp_path), http_port=free_port(), grpc_port=free_port(),
        metrics_port=free_port(), engine_process=False, **LIMITS,
    )  # fmt: skip
    with TritonServer(cfg) as s:
        client = httpclient.InferenceServerClient(s.cfg.http_url)
        try:
            for prompt, want in zip(PROMPTS[:2], expected):
                assert result(client.infer("ensemble_unary", inputs(httpclient, prompt))) == want
        finally:
            client.close()


def test_grpc_unary_equals_in_process(server, expected):
    client = grpcclient.InferenceServerClient(server.cfg.grpc_url)
    try:
        for prompt, want in zip(PROMPTS, expected):
            r = client.infer("ensemble_unary", inputs(grpcclient, prompt, b64=True))
            assert result(r) == want
            assert r.as_numpy("completion_tokens")[0] == len(want[1])
    finally:
        client.close()


def test_grpc_streaming_equals_in_process(server, expected):
    relayed = 'inkling_relay_responses_total{model="ensemble"}'
    before = metrics(server).get(relayed, 0.0)
    out = grpc_stream(
        server.cfg.grpc_url, [(f"r{i}", inputs(grpcclient, p, stream=True)) for i, p in enumerate(PROMPTS)]
    )
    for i, want in enumerate(expected):
        assert len(out[f"r{i}"]) > 1, "streamed as one response"
        assert join(out[f"r{i}"]) == want
    # the relay counts each response it sent (merged deltas are one) once the send returns, which may be
    # just after the client has it
    sent = sum(len(v) for v in out.values())
    deadline = time.monotonic() + 10
    while (m := metrics(server))[relayed] - before < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m[relayed] - before == sent
    assert m['inkling_relay_seconds_total{model="ensemble"}'] > 0


def test_generate_endpoints_equal_in_process(server, expected):
    for prompt, want in zip(PROMPTS, expected):
        r = generate(server, "ensemble_unary", body(prompt))
        assert (r["text_output"], as_list(r["output_ids"]), r["finish_reason"]) == want
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] == len(want[1])
        deltas = generate(server, "ensemble", body(prompt, stream=True), stream=True)
        ids = [t for d in deltas for t in as_list(d["output_ids"])]
        assert ("".join(d["text_output"] for d in deltas), ids, deltas[-1]["finish_reason"]) == want


def test_16_concurrent_streams_mixed_modalities(server, expected):
    reqs = [
        (f"c{i}", inputs(grpcclient, PROMPTS[i % len(PROMPTS)], stream=True, b64=i % 2 == 1))
        for i in range(16)
    ]
    out = grpc_stream(server.cfg.grpc_url, reqs)
    for i in range(16):
        assert join(out[f"c{i}"]) == expected[i % len(PROMPTS)], f"request c{i}"
    assert wait_released(server) == {"held": 0, "running": 0}


# Cancellation frees the cache.
LONG = 200  # tokens: several seconds on the CPU, far longer than the time to cancel


def test_cancelled_stream_frees_its_blocks(server):
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.cfg.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("ensemble", inputs(grpcclient, PROMPTS[1], max_tokens=LONG, stream=True))
    for _ in range(3):
        res, err = got.get(timeout=60)
        assert err is None and not res.as_numpy("finish_reason")[0]
    assert wait_held(server) > 0
    t0 = time.monotonic()
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_released(server) == {"held": 0, "running": 0}
    assert time.monotonic() - t0 < 10


def test_cancelled_unary_call_frees_its_blocks(server):
    """A unary call (ensemble_unary: inkling answers once, at the end) cancelled by its client: the BLS
    notices while it waits and aborts inkling's request, long before its LONG tokens. (Before 2026-12-01
    a known gap: the BLS's exec() returns on inkling's first response, which unstreamed was the answer at
    the end, so nothing polled the cancel; inkling now sends an empty response first when asked.)"""
    stat = lambda: metrics(server)['inkling_engine_stats{stat="generated_tokens"}']  # noqa: E731
    time.sleep(METRICS_LAG_S)
    before = stat()
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.cfg.grpc_url)
    try:
        ctx = client.async_infer(
            "ensemble_unary",
            inputs(grpcclient, PROMPTS[0], max_tokens=LONG),
            lambda result, error: got.put((result, error)),
        )
        assert wait_held(server) > 0
        ctx.cancel()
        res, err = got.get(timeout=30)
        assert res is None and "cancel" in str(err).lower()
        assert wait_released(server) == {"held": 0, "running": 0}
    finally:
        client.close()
    time.sleep(METRICS_LAG_S)
    assert stat() - before < LONG / 2  # aborted, not run to its end


CLIENT = """
import sys, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient(sys.argv[1])
def cb(result, error):
    print("delta" if error is None else error, flush=True)
c.start_stream(callback=cb)
x = g.InferInput("text_input", [1], "BYTES"); x.set_data_from_numpy(np.array([b"Tell me a long story"], dtype=object))
m = g.InferInput("max_tokens", [1], "INT32"); m.set_data_from_numpy(np.array([{long}], dtype=np.int32))
s = g.InferInput("stream", [1], "BOOL"); s.set_data_from_numpy(np.array([True]))
c.async_stream_infer("ensemble", [x, m, s])
import time; time.sleep(600)
"""


def test_disconnected_client_frees_its_blocks(server):
    code = textwrap.dedent(CLIENT).replace("{long}", str(LONG))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, server.cfg.grpc_url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "delta"
        assert wait_held(server) > 0
    finally:
        proc.send_signal(signal.SIGKILL)  # no goodbye: the connection just drops
        proc.wait()
    assert wait_released(server) == {"held": 0, "running": 0}


# Bad requests: clear errors, and the server keeps serving.
def big_png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()


def raw_input(name: str, array: np.ndarray, dtype: str) -> tuple:
    """An input as sent, for either client (`made`)."""
    return name, array, dtype


def made(mod, spec: tuple):
    name, array, dtype = spec
    x = mod.InferInput(name, list(array.shape), dtype)
    x.set_data_from_numpy(array)
    return x


def text_in(value: bytes = f"Hi {IMG}".encode(), shape=(1,)):
    return raw_input(
        "text_input", np.array([value] * int(np.prod(shape)), dtype=np.object_).reshape(shape), "BYTES"
    )


BAD = {
    "no text": ([raw_input("max_tokens", np.array([4], dtype=np.int32), "INT32")], "text_input"),
    "wrong dtype": (
        [text_in(b"Hi"), raw_input("max_tokens", np.array([4.0], dtype=np.float32), "FP32")],
        "max_tokens",
    ),
    "wrong shape": ([text_in(b"Hi", shape=(2,))], "text_input"),
    "empty prompt": ([text_in(b"")], "empty"),
    "undecodable image": (
        [
            text_in(),
            raw_input("image_data_input", np.array([b"\x89PNG not really"], dtype=np.object_), "BYTES"),
        ],
        "cannot decode image",
    ),
    "not base64": (
        [
            text_in(),
            raw_input("image_data_input", np.array([b"%%% not an image %%%"], dtype=np.object_), "BYTES"),
        ],
        "neither an image or audio file nor valid base64",
    ),
    "undecodable audio": (
        [
            text_in(f"Hi {AUD}".encode()),
            raw_input("audio_data_input", np.array([b"RIFF\0\0\0\0junk"], dtype=np.object_), "BYTES"),
        ],
        "WAV",
    ),
    "image over the byte limit": (
        [
            text_in(),
            raw_input(
                "image_data_input", np.array([b"\x89PNG" + b"\0" * 300_000], dtype=np.object_), "BYTES"
            ),
        ],
        "over the limit of 200000",
    ),
    "text over the byte limit": (
        [text_in(b"Hi " * 1500)],
        "text_input is 4500 bytes, over the limit of 4096",
    ),
    "too many images": (
        [
            text_in(f"{IMG} {IMG} {IMG}".encode()),
            raw_input("image_data_input", np.array([PNG] * 3, dtype=np.object_), "BYTES"),
        ],
        "3 images, over the limit of 2 per request",
    ),
    "too many audios": (
        [
            text_in(f"{AUD} {AUD} {AUD}".encode()),
            raw_input("audio_data_input", np.array([WAV] * 3, dtype=np.object_), "BYTES"),
        ],
        "3 audios, over the limit of 2 per request",
    ),
    "image over the byte limit, as base64": (  # refused by its length, before it is decoded
        [text_in(), raw_input("image_data_input", np.array([b"A" * 300_000], dtype=np.object_), "BYTES")],
        "300000 bytes of base64, over the limit of 200000",
    ),
    "image over the pixel limit": (
        [text_in(), raw_input("image_data_input", np.array([big_png(1024)], dtype=np.object_), "BYTES")],
        "more than the limit of 262144",
    ),
    "audio over the byte limit": (
        [
            text_in(f"Hi {AUD}".encode()),
            raw_input("audio_data_input", np.array([wav(13.0)], dtype=np.object_), "BYTES"),
        ],
        "over the limit of 400000",
    ),
    "audio over the duration limit": (
        [
            text_in(f"Hi {AUD}".encode()),
            raw_input("audio_data_input", np.array([wav(9.0, 8000)], dtype=np.object_), "BYTES"),
        ],
        "more than the limit of 8.0 s",
    ),
    "placeholder without image": (
        [text_in()],
        "the prompt has 1 image placeholders (<|unused_200054|>) for 0 images",
    ),
    "max_tokens beyond the engine": (
        [text_in(b"Hi"), raw_input("max_tokens", np.array([100_000], dtype=np.int32), "INT32")],
        "max_seq_len",
    ),
    "max_tokens zero": (
        [text_in(b"Hi"), raw_input("max_tokens", np.array([0], dtype=np.int32), "INT32")],
        "max_tokens",
    ),
    "bad top_p": ([text_in(b"Hi"), raw_input("top_p", np.array([1.5], dtype=np.float32), "FP32")], "top_p"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_a_clear_error(server, case):
    """Over HTTP a refusal is a 400, over gRPC an INVALID_ARGUMENT (not the 500 / INTERNAL that Triton's
    reset of a composing model's error code gave: model_repo/refusal.py)."""
    ins, message = BAD[case]
    for mod, url, status in (
        (httpclient, server.cfg.http_url, "400"),
        (grpcclient, server.cfg.grpc_url, "StatusCode.INVALID_ARGUMENT"),
    ):
        client = mod.InferenceServerClient(url)
        try:
            with pytest.raises(InferenceServerException, match=re.escape(message)) as e:
                client.infer("ensemble_unary", [made(mod, x) for x in ins])
            assert e.value.status() == status, (e.value.status(), str(e.value))
        finally:
            client.close()


def test_server_keeps_serving_after_bad_requests(server):
    assert_serving(server)
    assert wait_released(server) == {"held": 0, "running": 0}


BAD_STREAMS = {  # a prompt and max_tokens, and the error's words (the engine's, then preprocessing's)
    "max_tokens beyond the engine": ({"text": "Hi"}, 100_000, "max_seq_len"),
    "undecodable image": (
        {"text": f"Hi {IMG}", "images": [b"\x89PNG not really"]},
        4,
        "cannot decode image",
    ),
    "too many images": ({"text": IMG * 3, "images": [PNG] * 3}, 4, "3 images, over the limit of 2"),
    "audio over the duration limit": ({"text": AUD, "audios": [wav(9.0, 8000)]}, 4, "limit of 8.0 s"),
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
def test_bad_streaming_request_ends_its_stream_with_an_error(server, case):
    """On gRPC's stream, a bad request's only response is its error, and the stream and server go on."""
    prompt, max_tokens, message = BAD_STREAMS[case]
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.cfg.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs(grpcclient, prompt, max_tokens=max_tokens, stream=True))
        res, err = got.get(timeout=30)
        assert res is None and message in str(err), (res, err)
        # the same stream then serves a good request to its end
        client.async_stream_infer("ensemble", inputs(grpcclient, {"text": "Hi"}, max_tokens=2, stream=True))
        while True:  # until a response carries the finish reason
            res, err = got.get(timeout=60)
            assert err is None, err
            if res.as_numpy("finish_reason")[0]:
                break
    finally:
        client.stop_stream()
        client.close()
    assert_serving(server)


def test_metrics_endpoint(server):
    """Triton's own counters, and the engine's: a request of 2 tokens moves its step and token totals."""
    stat = lambda m, name: m[f'inkling_engine_stats{{stat="{name}"}}']  # noqa: E731
    time.sleep(METRICS_LAG_S)  # the gauges are published every 0.1 s: the last test's tokens are in
    before = metrics(server)
    assert_serving(server)
    deadline = time.monotonic() + 10
    while stat(metrics(server), "generated_tokens") < stat(before, "generated_tokens") + 2:
        assert time.monotonic() < deadline, "the engine's totals did not move"
        time.sleep(0.05)
    time.sleep(METRICS_LAG_S)
    m = metrics(server)
    assert 'nv_inference_request_success{model="ensemble_unary",version="1"}' in m["_text"]
    assert 'inkling_kv_cache_blocks{kv_cache_block_type="total"}' in m["_text"]
    assert stat(m, "first_tokens") == stat(before, "first_tokens") + 1
    assert stat(m, "generated_tokens") == stat(before, "generated_tokens") + 2
    assert stat(m, "steps") >= stat(before, "steps") + 2 and stat(m, "step_seconds") > stat(
        before, "step_seconds"
    )


def test_metrics_report_the_expert_load(server):
    """The MoE's expert load on /metrics: routed choices grow with the tokens served, and the per-expert and
    per-rank gauges add up to them (one rank here); imbalance is max over mean, at least 1."""
    load = lambda m, name: m[f'inkling_moe_load{{stat="{name}"}}']  # noqa: E731
    time.sleep(METRICS_LAG_S)
    before = load(metrics(server), "routed_choices")
    assert_serving(server)  # the engine reads its counters when it goes idle
    deadline = time.monotonic() + 10
    while load(m := metrics(server), "routed_choices") <= before:
        assert time.monotonic() < deadline, "the expert load did not move"
        time.sleep(0.05)
    experts = [v for k, v in m.items() if k.startswith("inkling_moe_expert_tokens{")]
    ranks = [v for k, v in m.items() if k.startswith("inkling_moe_rank_tokens{")]
    assert len(experts) > 1 and sum(experts) == load(m, "routed_choices") == sum(ranks) and len(ranks) == 1
    assert load(m, "expert_imbalance") >= 1.0 and load(m, "rank_imbalance") == 1.0 and load(m, "ep_size") == 1


def test_repository_carries_the_engine_options(engine_f32, tmp_path):
    """`--cuda-graphs`, `--overlap` and the engine's other options reach the `inkling` model's parameters."""
    from model_repo.serve import fill_repository

    for graphs, want in ((False, "0"), (True, "1")):
        cfg = ServeConfig(
            engine_dir=str(engine_f32[1]), work_dir=str(tmp_path), cuda_graphs=graphs, overlap=not graphs,
            num_blocks=77,
        )  # fmt: skip
        text = (fill_repository(cfg, tmp_path / "repo") / "inkling" / "config.pbtxt").read_text()
        assert f'key: "cuda_graphs" value: {{ string_value: "{want}" }}' in text
        assert f'key: "overlap" value: {{ string_value: "{"1" if want == "0" else "0"}" }}' in text
        assert 'key: "num_blocks" value: { string_value: "77" }' in text
        assert 'key: "engine_process" value: { string_value: "1" }' in text  # the default
    cfg = ServeConfig(engine_dir=str(engine_f32[1]), work_dir=str(tmp_path), engine_process=False)
    text = (fill_repository(cfg, tmp_path / "repo2") / "inkling" / "config.pbtxt").read_text()
    assert 'key: "engine_process" value: { string_value: "0" }' in text
    assert 'key: "decode_slowdown" value: { string_value: "0.0" }' in text  # unpaced by default
    cfg = ServeConfig(engine_dir=str(engine_f32[1]), work_dir=str(tmp_path), max_prefill_pairs=4096,
                      decode_slowdown=2.0)  # fmt: skip
    text = (fill_repository(cfg, tmp_path / "repo3") / "inkling" / "config.pbtxt").read_text()
    assert 'key: "max_prefill_pairs" value: { string_value: "4096" }' in text
    assert 'key: "decode_slowdown" value: { string_value: "2.0" }' in text


def test_the_engine_process_passes_the_scheduling_options(engine_f32):
    """EngineProcess's command line for its child carries max_prefill_pairs and decode_slowdown to the child's
    LLM (unset: None), and an LLM made with them schedules with them."""
    from runtime import LLM
    from runtime.engine_child import parse_args
    from runtime.engine_process import child_argv

    _, kw = parse_args(child_argv(engine_f32[1], 3))
    assert kw["max_prefill_pairs"] is None and kw["decode_slowdown"] is None
    _, kw = parse_args(child_argv(engine_f32[1], 3, max_prefill_pairs=4096, decode_slowdown=2.5))
    assert kw["max_prefill_pairs"] == 4096 and kw["decode_slowdown"] == 2.5
    llm = LLM(**kw)
    assert llm.engine.scheduler.max_prefill_pairs == 4096 and llm.engine.scheduler.pacer.slowdown == 2.5


# The engine process dies: its requests end with an error, a new one serves (keep this test last: it
# restarts the module's engine).
def engine_processes(server) -> list[int]:
    """The pids of `runtime.engine_child` children under this server's process tree."""

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"runtime.engine_child" not in f.read():
                    continue
            pid = up = int(entry)
            while up > 1 and up != server.process.pid:
                up = parent(up)
        except (OSError, ValueError, IndexError):
            continue
        if up == server.process.pid:
            found.append(pid)
    return found


def test_a_dead_engine_process_is_replaced(server, expected):
    (pid,) = engine_processes(server)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.cfg.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs(grpcclient, PROMPTS[0], max_tokens=LONG, stream=True))
        res, err = got.get(timeout=60)
        assert err is None
        os.kill(pid, signal.SIGKILL)
        while err is None:  # the stream's remaining deltas, then its error
            res, err = got.get(timeout=60)
        assert "engine process exited" in str(err)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    deadline = time.monotonic() + 120
    while True:  # UNAVAILABLE until the new engine serves
        http = httpclient.InferenceServerClient(server.cfg.http_url)
        try:
            out = result(http.infer("ensemble_unary", inputs(httpclient, PROMPTS[0])))
            break
        except InferenceServerException as e:
            assert "restarting" in str(e), e
            assert time.monotonic() < deadline, "no new engine process within 120 s"
            time.sleep(1)
        finally:
            http.close()
    assert out == expected[0]
    assert engine_processes(server) not in ([], [pid]) and server.process.poll() is None


def _outward_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_make_serve_binds_localhost_and_stops_cleanly(engine_f32, tmp_path):
    """`make serve`'s command line as a user runs it (no --host): every endpoint, the OpenAI API's too, on
    127.0.0.1 only (an outward address of this machine refuses the connection), ready, and on Ctrl-C
    (SIGINT) the server stops and the command exits 0."""
    ports = [free_port() for _ in range(4)]
    cmd = [sys.executable, "-m", "model_repo.serve", "--engine", str(engine_f32[1]), "--work-dir", str(tmp_path),
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # until it says it is ready (or exits)
            lines.append(line)
            if line.startswith("OpenAI-compatible API at"):
                break
        assert lines and lines[-1].startswith("OpenAI-compatible API at"), "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/v1/models", timeout=5) as r:
            assert json.loads(r.read())["data"][0]["id"] == "inkling"
        outward = _outward_address()
        for port in ports if outward else ():
            with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                s.settimeout(5)
                s.connect((outward, port))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        # a failed check: Ctrl-C all the same, so the command stops its server (in a session of its own)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0 and "Triton stopped" in rest, rest

"""The real Inkling behind a real Triton server: text, images and audio through gRPC streaming and HTTP
equal the in-process runtime (and so transformers, tests/e2e/test_published_engine.py); a bad image gets
a clear error and the server keeps serving."""

from __future__ import annotations

import base64
import importlib.util
import json

import pytest

pytest.importorskip("tritonclient.grpc")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton is not installed (make venv)", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from builder.build import build  # noqa: E402
from builder.config import BuildConfig  # noqa: E402
from inkling.demo import demo_png, demo_wav  # noqa: E402
from inkling.published.config import preset  # noqa: E402
from inkling.published.synth import write_checkpoint  # noqa: E402
from model_repo.serve import ServeConfig, TritonServer, free_port  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from tests.e2e.test_serving import grpc_stream, inputs, join, result  # noqa: E402

TEXTS = ["The history of the printing press", "def fibonacci(n):"]
MEDIA = {
    "text": "see <|unused_200054|> hear <|unused_200053|>",
    "images": [demo_png(50, 30)],
    "audios": [demo_wav(0.3)],
}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", preset("inkling-tiny"), seed=7)
    out = tmp_path_factory.mktemp("engine") / "tiny"
    bc = BuildConfig(
        dtype="float32", device="cpu", max_batch_size=4, max_input_len=160, max_seq_len=192, max_num_tokens=64
    )
    build(ckpt, bc, echo=False).save(out)
    return out


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    cfg = ServeConfig(
        engine_dir=str(engine_dir), work_dir=str(tmp_path_factory.mktemp("serve")), http_port=free_port(),
        grpc_port=free_port(), metrics_port=free_port(),
    )  # fmt: skip
    with TritonServer(cfg) as s:
        yield s


def test_text_through_triton_equals_in_process(engine_dir, server):
    outs = LLM(engine_dir).generate([*TEXTS, MEDIA], SamplingParams(max_tokens=8))
    want = [(o.text, o.token_ids, o.finish_reason) for o in outs]
    prompts = [{"text": t} for t in TEXTS] + [MEDIA]
    requests = [(f"r{i}", inputs(grpcclient, p, stream=True)) for i, p in enumerate(prompts)]
    streams = grpc_stream(server.cfg.grpc_url, requests)
    assert [join(streams[f"r{i}"]) for i in range(len(prompts))] == want
    client = httpclient.InferenceServerClient(server.cfg.http_url)
    try:
        assert result(client.infer("ensemble_unary", inputs(httpclient, {"text": TEXTS[0]}))) == want[0]
        assert result(client.infer("ensemble_unary", inputs(httpclient, MEDIA))) == want[2]
        bad = {"text": "a picture <|unused_200054|>", "images": [b"\x89PNG not really"]}
        with pytest.raises(InferenceServerException, match="cannot decode image"):
            client.infer("ensemble_unary", inputs(httpclient, bad))
        assert result(client.infer("ensemble_unary", inputs(httpclient, {"text": TEXTS[1]}))) == want[1]
    finally:
        client.close()
    assert server.process.poll() is None  # the refused request harmed nothing


CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(demo_png(50, 30)).decode()
                    },
                },
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(demo_wav(0.3)).decode(), "format": "wav"},
                },
            ],
        },  # fmt: skip
    ],
    "tools": [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}],
    "reasoning_effort": "low",
}


def chat_result(r) -> tuple[str, str, list, list[int], str]:
    return (
        r.as_numpy("text_output")[0].decode(),
        r.as_numpy("reasoning_output")[0].decode(),
        json.loads(r.as_numpy("tool_calls")[0].decode()),
        r.as_numpy("output_ids").tolist(),
        r.as_numpy("finish_reason")[0].decode(),
    )


def test_chat_through_triton_equals_in_process(engine_dir, server):
    """The chat form (messages with inline image and audio, tools, a thinking effort) rendered and parsed
    by the server as by LLM.chat; bad chat requests get clear errors and the server keeps serving."""
    (out,) = LLM(engine_dir).chat(
        CHAT["messages"], SamplingParams(max_tokens=8), tools=CHAT["tools"], reasoning_effort="low"
    )
    m = out.message
    want = (m.content, m.thinking, [c.to_dict() for c in m.tool_calls], out.token_ids, out.finish_reason)
    streams = grpc_stream(server.cfg.grpc_url, [("c", inputs(grpcclient, CHAT, stream=True))])
    parts = [chat_result(r) for r in streams["c"]]
    streamed = ("".join(p[0] for p in parts), "".join(p[1] for p in parts), [c for p in parts for c in p[2]],
                [t for p in parts for t in p[3]], parts[-1][4])  # fmt: skip
    assert streamed == want
    client = httpclient.InferenceServerClient(server.cfg.http_url)
    try:
        assert chat_result(client.infer("ensemble_unary", inputs(httpclient, CHAT))) == want
        for bad, why in (
            ({**CHAT, "messages": "[{oops"}, "not valid JSON"),
            ({**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
            ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
            ({**CHAT, "text": "both"}, "not both"),
        ):
            with pytest.raises(InferenceServerException, match=why):
                client.infer("ensemble_unary", inputs(httpclient, bad))
        plain = result(client.infer("ensemble_unary", inputs(httpclient, {"text": TEXTS[0]})))
        assert chat_result(client.infer("ensemble_unary", inputs(httpclient, {"text": TEXTS[0]})))[1:3] == (
            "",
            [],
        )
        assert plain[0]  # text requests unchanged beside the chat ones
    finally:
        client.close()
    assert server.process.poll() is None

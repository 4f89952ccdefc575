"""The real Inkling behind a real Triton server: text, images and audio through gRPC streaming and HTTP
equal the in-process runtime (and so transformers, tests/e2e/test_published_engine.py); a bad image gets
a clear error and the server keeps serving."""

from __future__ import annotations

import base64
import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
if importlib.util.find_spec("pytriton") is None:
    pytest.skip("nvidia-pytriton is not installed (make venv)", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from inkling.demo import demo_png, demo_wav  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from tests.e2e.test_serving import grpc_stream, inputs, join, result  # noqa: E402

TEXTS = ["The history of the printing press", "def fibonacci(n):"]
MEDIA = {
    "text": "see <|unused_200054|> hear <|unused_200053|>",
    "images": [demo_png(50, 30)],
    "audios": [demo_wav(0.3)],
}


@pytest.fixture(scope="module")
def engine_dir(engine_f32):
    return engine_f32[1]


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


def tensorrt_llm_inputs(mod, prompt: dict, stream: bool | None = None, **flags) -> list:
    """`inputs` with TensorRT-LLM backend's optional tensors: BOOL flags and an INT32 num_logprobs."""
    out = inputs(mod, prompt, stream=stream)
    for name, value in flags.items():
        dtype, np_type = ("INT32", np.int32) if name == "num_logprobs" else ("BOOL", np.bool_)
        x = mod.InferInput(name, [1], dtype)
        x.set_data_from_numpy(np.array([value], dtype=np_type))
        out.append(x)
    return out


def test_tensorrt_llm_options_and_logprobs(engine_dir, server):
    """The options a TensorRT-LLM backend's client sends work unchanged: exclude_input_in_output false puts
    the prompt before the answer, num_input/output_tokens are the counts, return_log_probs gives each
    token's logprob; num_logprobs adds the alternatives. All equal the in-process runtime's, over HTTP
    unary and a gRPC stream."""
    (want,) = LLM(engine_dir).generate([TEXTS[0]], SamplingParams(max_tokens=8, logprobs=3))
    client = httpclient.InferenceServerClient(server.cfg.http_url)
    try:
        r = client.infer("ensemble_unary", tensorrt_llm_inputs(
            httpclient, {"text": TEXTS[0]}, exclude_input_in_output=False, return_num_input_tokens=True,
            return_num_output_tokens=True, return_log_probs=True))  # fmt: skip
        assert r.as_numpy("text_output")[0].decode() == TEXTS[0] + want.text
        ids = r.as_numpy("output_ids").tolist()
        assert len(ids) == want.prompt_tokens + 8 and ids[-8:] == want.token_ids
        assert int(r.as_numpy("num_input_tokens")[0]) == want.prompt_tokens
        assert int(r.as_numpy("num_output_tokens")[0]) == want.completion_tokens == 8
        assert r.as_numpy("output_log_probs").tolist() == pytest.approx(want.logprobs, abs=1e-5)
        assert r.as_numpy("top_logprobs").size == 0  # no alternatives asked
        plain = client.infer("ensemble_unary", tensorrt_llm_inputs(httpclient, {"text": TEXTS[0]},
                                                                   exclude_input_in_output=True))  # fmt: skip
        assert result(plain)[0] == want.text and plain.as_numpy("output_log_probs").size == 0
    finally:
        client.close()
    streams = grpc_stream(server.cfg.grpc_url, [("s", tensorrt_llm_inputs(grpcclient, {"text": TEXTS[0]},
                                                                          stream=True, num_logprobs=3))])  # fmt: skip
    deltas = streams["s"]
    assert [t for d in deltas for t in d.as_numpy("output_ids").tolist()] == want.token_ids
    assert [x for d in deltas for x in d.as_numpy("output_log_probs").tolist()] == pytest.approx(
        want.logprobs, abs=1e-5
    )
    ids = [row for d in deltas for row in d.as_numpy("top_logprob_ids").tolist()]
    values = [row for d in deltas for row in d.as_numpy("top_logprobs").tolist()]
    assert ids == [list(t) for t in want.top_logprobs]
    assert np.allclose(values, [list(t.values()) for t in want.top_logprobs], atol=1e-5)
    assert [row[0] for row in ids] == want.token_ids  # greedy: each token is its row's most likely

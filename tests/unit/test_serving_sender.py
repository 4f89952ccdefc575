"""The `inkling` Triton model's sender coalescing (model_repo/templates/inkling/1/model.py), outside Triton:
the module is loaded with a stand-in for triton_python_backend_utils, which only the server provides."""

from __future__ import annotations

import importlib.util
import queue
import sys
import types
from pathlib import Path

import pytest

from runtime import StreamDelta

MODEL = Path(__file__).resolve().parents[2] / "model_repo" / "templates" / "inkling" / "1" / "model.py"


@pytest.fixture(scope="module")
def model_class():
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        spec = importlib.util.spec_from_file_location("inkling_triton_model", MODEL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return module.TritonPythonModel


def delta(rid: str, token: int, final: bool = False) -> StreamDelta:
    return StreamDelta(rid, f"<{token}>", [token], "length" if final else None, 5, token)


def test_queued_deltas_merge_per_request_but_a_first_token_goes_alone(model_class):
    model = object.__new__(model_class)  # no initialize(): only the sender's state
    model.outbox, model.started = queue.Queue(), set()
    for d in (delta("a", 1), delta("b", 1), delta("a", 2), delta("a", 3), delta("b", 2, final=True)):
        model.outbox.put(d)
    first = model.outbox.get()
    out, stop = model._drain(first)
    assert not stop
    assert [(d.request_id, d.token_ids, d.text) for d in out] == [
        ("a", [1], "<1>"),  # first deltas alone: time to first token is not traded
        ("b", [1], "<1>"),
        ("a", [2, 3], "<2><3>"),  # later ones of a request: one response
        ("b", [2], "<2>"),
    ]
    assert out[3].finish_reason == "length" and model.started == {"a"}  # b is done
    model.outbox.put(delta("a", 4))
    model.outbox.put(delta("a", 5, final=True))
    model.outbox.put(None)  # the loop's stop signal, after what is queued
    out, stop = model._drain(model.outbox.get())
    assert stop and [(d.token_ids, d.finish_reason) for d in out] == [([4, 5], "length")]
    assert model.started == set()

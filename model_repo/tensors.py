"""Helpers the Python-backend models share: reading optional inputs, building outputs and errors.

Imported only inside Triton's Python backend stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from .refusal import REFUSAL, is_refusal


class RequestError(ValueError):
    """A request that cannot be served as sent: its message goes back to the client verbatim."""


def get(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def require(request: Any, name: str) -> np.ndarray:
    x = get(request, name)
    if x is None:
        raise RequestError(f"input {name!r} is required")
    return x


def scalar(request: Any, name: str, default: Any, cast: Callable[[Any], Any]) -> Any:
    """An optional scalar input sent as [1] (or [1, 1] by batching clients)."""
    x = get(request, name)
    if x is None:
        return default
    if x.size != 1:
        raise RequestError(f"input {name!r} must hold one value, got shape {list(x.shape)}")
    try:
        return cast(x.reshape(-1)[0])
    except (TypeError, ValueError, OverflowError) as e:
        raise RequestError(f"input {name!r}: {e}") from e


def strings(request: Any, name: str) -> list[bytes]:
    """An optional TYPE_STRING input of any shape -> its elements as bytes (empty when absent)."""
    x = get(request, name)
    if x is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode() for v in x.reshape(-1)]


def text(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"input {name!r} is not UTF-8 text: {e}") from e


def string_tensor(name: str, value: str | bytes | list) -> Any:
    values = value if isinstance(value, list) else [value]
    data = [v.encode() if isinstance(v, str) else v for v in values]
    return pb_utils.Tensor(name, np.array(data, dtype=np.object_))


def tensor(name: str, value: Any, dtype: type) -> Any:
    return pb_utils.Tensor(name, np.ascontiguousarray(np.asarray(value, dtype=dtype)))


def error(message: str, code: Any = None) -> Any:
    """An error response: a refusal (TritonError.INVALID_ARG, the default; its message marked REFUSAL,
    model_repo/refusal.py) or a fault with its own `code`."""
    err_code = pb_utils.TritonError.INVALID_ARG if code is None else code
    if err_code == pb_utils.TritonError.INVALID_ARG and not message.startswith(REFUSAL):
        message = REFUSAL + message
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, err_code))


def fault(message: str) -> Any:
    """An error response for a fault of ours (TritonError.INTERNAL: HTTP 500), not the request's."""
    return error(message, pb_utils.TritonError.INTERNAL)


def error_code(err: Any) -> Any:
    """The code of a composing model's error as it sent it (see REFUSAL)."""
    return pb_utils.TritonError.INVALID_ARG if is_refusal(err.message()) else err.code()


def parameter(model_config: dict, key: str, default: str | None = None) -> str:
    """A `parameters { key: ... value: { string_value: ... } }` entry of config.pbtxt."""
    params = model_config.get("parameters", {})
    if key in params:
        return params[key]["string_value"]
    if default is None:
        raise RuntimeError(f"config.pbtxt of {model_config.get('name')} lacks parameter {key!r}")
    return default


def load_model_config(args: dict) -> dict:
    return json.loads(args["model_config"])

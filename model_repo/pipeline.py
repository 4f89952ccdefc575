"""The `ensemble` and `ensemble_unary` models: preprocessing -> image_encoder / audio_encoder ->
inkling, as BLS (business logic scripting) in Python rather than a Triton ensemble.

An ensemble's steps are fixed tensors to fixed models; a request here may carry no image, one or
several, so the encoders are called only for the media a request has, and the decoupled `inkling`
model's stream is either forwarded delta by delta (`ensemble`, decoupled, `stream` true) or gathered
into one response (`stream` false, and always in `ensemble_unary`, the non-decoupled twin that
HTTP/gRPC unary calls and the `generate` endpoint need). Each request is served on its own worker
thread, so one instance carries any number of concurrent streams; `inkling` batches them.
"""

from __future__ import annotations

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
    load_model_config,
    parameter,
    scalar,
    string_tensor,
    tensor,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "random_seed", "stop_words", "num_draft_tokens")
MEDIA = ("image_data_input", "audio_data_input")
OUTPUTS = (
    "text_output",
    "output_ids",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "acceptance_length",
    "acceptance_rate",
)
CANCEL_CHECK_S = 0.05


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
    counts: dict[str, np.ndarray]  # prompt_tokens, completion_tokens, acceptance_*

    @classmethod
    def from_response(cls, r: Any) -> Delta:
        out = {name: pb_utils.get_output_tensor_by_name(r, name).as_numpy() for name in OUTPUTS}
        return cls(
            text=_str(out["text_output"]),
            output_ids=out["output_ids"].astype(np.int64),
            finish_reason=_str(out["finish_reason"]),
            counts={k: out[k] for k in OUTPUTS[3:]},
        )

    def merge(self, d: Delta) -> Delta:
        ids = np.concatenate([self.output_ids, d.output_ids])
        return Delta(self.text + d.text, ids, d.finish_reason, d.counts)

    def response(self) -> Any:
        return pb_utils.InferenceResponse(
            output_tensors=[
                string_tensor("text_output", self.text),
                tensor("output_ids", self.output_ids, np.int64),
                string_tensor("finish_reason", self.finish_reason),
                *(tensor(k, v, v.dtype.type) for k, v in self.counts.items()),
            ]
        )


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

    def execute(self, requests: list) -> None:
        for request in requests:
            self.workers.submit(self._serve, request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        self.workers.shutdown(wait=True, cancel_futures=True)

    def _serve(self, request: Any, sender: Any) -> None:
        try:
            stream = self.decoupled and bool(scalar(request, "stream", False, bool))
            prompt = self._prepare(request)
            self._generate(request, sender, prompt, stream)
        except StepError as e:
            sender.send(error(str(e), e.code), flags=FINAL)
        except RequestError as e:
            sender.send(error(str(e)), flags=FINAL)
        except Exception as e:  # a bad request must never take the model down
            sender.send(error(f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL), flags=FINAL)

    def _prepare(self, request: Any) -> list:
        """preprocessing, then the encoders a request needs -> inkling's prompt inputs."""
        inputs = [
            t
            for t in (pb_utils.get_input_tensor_by_name(request, n) for n in ("text_input", *MEDIA))
            if t is not None
        ]
        pre = _call("preprocessing", inputs, ["INPUT_IDS", "IMAGE_PATCHES", "AUDIO_LEVELS", "MM_POSITIONS"])
        ids, patches, levels, positions = (
            pre[k] for k in ("INPUT_IDS", "IMAGE_PATCHES", "AUDIO_LEVELS", "MM_POSITIONS")
        )
        embeds = []
        if patches.shape[0]:
            embeds.append(
                _call("image_encoder", [tensor("IMAGE_PATCHES", patches, np.float32)], ["IMAGE_EMBEDS"])
            )
        if levels.shape[1]:
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

    def _generate(self, request: Any, sender: Any, prompt: list, stream: bool) -> None:
        params = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in PARAMS) if t is not None]
        rid = uuid.uuid4().hex
        mode = [tensor("stream", [stream], np.bool_)]  # not streamed: inkling sends one response at the end
        responses = pb_utils.InferenceRequest(
            model_name="inkling",
            inputs=prompt + params + mode,
            requested_output_names=list(OUTPUTS),
            request_id=rid,
        ).exec(decoupled=True)
        total, cancelled, checked_at = None, False, time.monotonic()
        for r in responses:
            if r.has_error():
                raise StepError(r.error().message(), r.error().code())
            if not r.output_tensors():
                continue  # a bare final flag
            if not cancelled and time.monotonic() - checked_at >= CANCEL_CHECK_S:
                checked_at = time.monotonic()
                if sender.is_cancelled():
                    cancelled = True
                    _abort(rid)
            if cancelled:
                continue
            d = Delta.from_response(r)
            if stream:
                sender.send(d.response(), flags=FINAL if d.finish_reason else 0)
                if d.finish_reason:
                    return
            else:
                total = d if total is None else total.merge(d)
        if cancelled or (stream and total is None):
            sender.send(flags=FINAL)
        elif total is not None:
            sender.send(total.response(), flags=FINAL)
        else:
            sender.send(
                error("inkling ended the stream without a response", pb_utils.TritonError.INTERNAL),
                flags=FINAL,
            )


def _call(model: str, inputs: list, outputs: list[str]) -> dict[str, np.ndarray]:
    r = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs).exec()
    if r.has_error():
        raise StepError(r.error().message(), r.error().code())
    return {name: pb_utils.get_output_tensor_by_name(r, name).as_numpy() for name in outputs}


def _abort(rid: str) -> None:
    """Ask inkling to abort request `rid` (a BLS request cannot be cancelled from here otherwise)."""
    control = pb_utils.InferenceRequest(
        model_name="inkling", inputs=[string_tensor("abort_request_id", rid)], requested_output_names=[]
    )
    for _ in control.exec(decoupled=True):
        pass

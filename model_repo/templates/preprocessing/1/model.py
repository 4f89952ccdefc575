"""preprocessing: prompt text and encoded media -> token ids, encoder inputs and pad positions.

A prompt is either `text_input` (text with placeholders, media in `image_data_input` and
`audio_data_input` in placeholder order) or the chat form: `messages`, a JSON list of OpenAI-style
messages (optional `tools`, a JSON list, and `reasoning_effort`, a level name or number), rendered in
the real Inkling's chat format (inkling/published/chat.py); its image and audio parts carry their data
as data: URLs or base64, or take it, in order, from the media inputs.

Media arrive as raw bytes or as base64 text (the generate endpoints carry JSON): a value that starts
with a PNG, JPEG or RIFF signature is taken as the file itself, any other value is base64-decoded.
Every limit is checked before the expensive step it guards (sizes before decoding, the pixel count
from the image header, the duration from the WAV header).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from builder.engine import read_engine_config
from inkling.processing import ProcessingError
from inkling.processing.audio import COMPRESSED
from inkling.published.chat import ChatPrompt, ChatRenderer
from inkling.published.config import InklingConfig
from inkling.published.processing import PreprocessorSettings, Processor
from model_repo.tensors import (
    RequestError,
    error,
    fault,
    get,
    load_model_config,
    parameter,
    require,
    strings,
    tensor,
    text,
)

SIGNATURES = (b"\x89PNG", b"\xff\xd8\xff", b"RIFF", *COMPRESSED)  # WebP is RIFF too; FLAC, MP3, Ogg


def decode_media(value: bytes, name: str, index: int, max_bytes: int) -> bytes:
    """Raw file bytes, or base64 text of them; the size limit applies to both forms."""
    if value.startswith(SIGNATURES):
        data = value
    else:
        if len(value) > max_bytes * 4 // 3 + 4:
            raise RequestError(
                f"{name}[{index}] is {len(value)} bytes of base64, over the limit of {max_bytes}"
            )
        try:
            data = base64.b64decode(b"".join(value.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestError(
                f"{name}[{index}] is neither an image or audio file nor valid base64: {e}"
            ) from e
    if not data:
        raise RequestError(f"{name}[{index}] is empty")
    if len(data) > max_bytes:
        raise RequestError(f"{name}[{index}] is {len(data)} bytes, over the limit of {max_bytes}")
    return data


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = load_model_config(args)
        engine_dir = parameter(cfg, "engine_dir")
        engine = read_engine_config(engine_dir)
        self.config = config = InklingConfig.from_dict(engine["pretrained_config"], "engine config.json")
        self.max_input_len = int(engine["build_config"]["max_input_len"])
        self.max_text_bytes = int(parameter(cfg, "max_text_bytes"))
        self.max_images = int(parameter(cfg, "max_images"))
        self.max_audios = int(parameter(cfg, "max_audios"))
        self.max_image_bytes = int(parameter(cfg, "max_image_bytes"))
        self.max_audio_bytes = int(parameter(cfg, "max_audio_bytes"))
        tokenizer = Tokenizer.from_file(os.path.join(engine_dir, "tokenizer.json"))
        settings = PreprocessorSettings.from_dict(engine.get("preprocessor", {}))
        self.processor = Processor(
            config, tokenizer, settings, max_image_bytes=self.max_image_bytes,
            max_image_pixels=int(parameter(cfg, "max_image_pixels")), max_audio_bytes=self.max_audio_bytes,
            max_audio_seconds=float(parameter(cfg, "max_audio_seconds")),
        )  # fmt: skip
        self.chat_renderer = ChatRenderer(tokenizer)
        self.num_mels = config.audio.n_mel_bins
        torch.set_num_threads(1)

    def execute(self, requests: list) -> list:
        return [self._run(r) for r in requests]

    def _run(self, request: Any) -> Any:
        try:
            return self._process(request)
        except (RequestError, ProcessingError) as e:
            return error(str(e))
        except Exception as e:  # a bad input must never take the model down
            return fault(f"preprocessing failed: {type(e).__name__}: {e}")

    def _process(self, request: Any) -> Any:
        chat = self._chat(request)
        prompt = None if chat else self._prompt(require(request, "text_input"))
        images = strings(request, "image_data_input")
        audios = strings(request, "audio_data_input")
        if len(images) > self.max_images:
            raise RequestError(f"{len(images)} images, over the limit of {self.max_images} per request")
        if len(audios) > self.max_audios:
            raise RequestError(f"{len(audios)} audios, over the limit of {self.max_audios} per request")
        images = [decode_media(v, "image_data_input", i, self.max_image_bytes) for i, v in enumerate(images)]
        audios = [decode_media(v, "audio_data_input", i, self.max_audio_bytes) for i, v in enumerate(audios)]
        out = self.processor.chat(chat, images, audios) if chat else self.processor(prompt, images, audios)
        num_tokens = len(out.input_ids)
        if num_tokens > self.max_input_len:
            raise RequestError(
                f"prompt is {num_tokens} tokens (media included), over the engine's max_input_len {self.max_input_len}"
            )
        c, ids = self.config, out.input_ids
        v = c.vision
        empty = torch.zeros(0, v.temporal_patch_size, v.patch_size, v.patch_size, 3)
        pixels = torch.cat(out.pixel_values) if out.pixel_values else empty  # [N, 2, 40, 40, 3]
        levels = (
            torch.cat(out.audio_levels)
            if out.audio_levels
            else torch.zeros(0, self.num_mels, dtype=torch.int64)
        )  # [F, mel_bins]
        positions = torch.cat(
            [(ids == c.image_token_id).nonzero().flatten(), (ids == c.audio_token_id).nonzero().flatten()]
        )
        import triton_python_backend_utils as pb_utils

        return pb_utils.InferenceResponse(
            output_tensors=[
                tensor("INPUT_IDS", ids.numpy(), np.int64),
                tensor("IMAGE_PATCHES", pixels.numpy(), np.float32),
                tensor("AUDIO_LEVELS", levels.numpy(), np.int64),
                tensor("MM_POSITIONS", positions.numpy(), np.int64),
            ]
        )

    def _chat(self, request: Any) -> ChatPrompt | None:
        """The chat form's messages rendered, or None for a `text_input` request."""
        raw = get(request, "messages")
        if raw is None:
            for name in ("tools", "reasoning_effort"):
                if get(request, name) is not None:
                    raise RequestError(f"{name} belongs to the chat form: send messages with it")
            return None
        if get(request, "text_input") is not None:
            raise RequestError("send text_input or messages, not both")
        # the messages may carry their media inline, as base64
        media = self.max_images * self.max_image_bytes + self.max_audios * self.max_audio_bytes
        messages = self._json(raw, "messages", self.max_text_bytes + media * 4 // 3)
        tools = get(request, "tools")
        tools = None if tools is None else self._json(tools, "tools", self.max_text_bytes)
        effort = get(request, "reasoning_effort")
        effort = None if effort is None else self._string(effort, "reasoning_effort", 64)
        chat = self.chat_renderer.render(messages, tools=tools, reasoning_effort=effort)
        if len(chat.images) > self.max_images:
            raise RequestError(f"{len(chat.images)} images, over the limit of {self.max_images} per request")
        if len(chat.audios) > self.max_audios:
            raise RequestError(f"{len(chat.audios)} audios, over the limit of {self.max_audios} per request")
        return chat

    def _string(self, value: np.ndarray, name: str, max_bytes: int) -> str:
        if value.size != 1:
            raise RequestError(f"{name} must hold one value, got shape {list(value.shape)}")
        raw = value.reshape(-1)[0]
        raw = raw if isinstance(raw, bytes) else str(raw).encode()
        if len(raw) > max_bytes:
            raise RequestError(f"{name} is {len(raw)} bytes, over the limit of {max_bytes}")
        return text(raw, name)

    def _json(self, value: np.ndarray, name: str, max_bytes: int) -> Any:
        try:
            return json.loads(self._string(value, name, max_bytes))
        except json.JSONDecodeError as e:
            raise RequestError(f"{name} is not valid JSON: {e}") from e

    def _prompt(self, value: np.ndarray) -> str:
        if value.size != 1:
            raise RequestError(f"text_input must hold one prompt, got shape {list(value.shape)}")
        raw = value.reshape(-1)[0]
        raw = raw if isinstance(raw, bytes) else str(raw).encode()
        if len(raw) > self.max_text_bytes:
            raise RequestError(f"text_input is {len(raw)} bytes, over the limit of {self.max_text_bytes}")
        prompt = text(raw, "text_input")
        if not prompt.strip():
            raise RequestError("text_input is empty: send a prompt")
        return prompt

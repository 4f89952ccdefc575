"""The prompt processor: text (or token ids) plus images and audio -> token ids with expanded
media placeholders, and the media tensors their encoders take (INKLING_SPEC §6, §7)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from PIL import Image

from inkling.config import InklingConfig
from inkling.processing.audio import (
    DEFAULT_MAX_AUDIO_BYTES,
    DEFAULT_MAX_AUDIO_SECONDS,
    check_levels,
    num_audio_tokens,
    preprocess_audio,
)
from inkling.processing.errors import ProcessingError
from inkling.processing.image import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    check_pixels,
    num_image_tokens,
    preprocess_image,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ImageInput = bytes | bytearray | memoryview | Image.Image | torch.Tensor
AudioInput = bytes | bytearray | memoryview | torch.Tensor
_ENCODED = bytes | bytearray | memoryview


@dataclass
class ProcessedPrompt:
    input_ids: torch.Tensor  # [T] int64, <|bos|> first, placeholders expanded
    images: list[torch.Tensor] = field(default_factory=list)  # each [Hpx, Wpx, 3] float32, prompt order
    audios: list[torch.Tensor] = field(default_factory=list)  # each [num_mels, F_pad] int64, prompt order


@dataclass(frozen=True)
class MediaTokens:
    """The special token ids of one modality."""

    placeholder: int  # <|image|>, what the user writes
    start: int
    pad: int  # replaced by one encoder embedding each
    end: int


class Processor:
    """Tokenizes a prompt, preprocesses its media and expands each `<|image|>` / `<|audio|>` to
    `<|x_start|>` + N x `<|x_pad|>` + `<|x_end|>`, N the number of tokens of that medium."""

    def __init__(
        self,
        config: InklingConfig,
        tokenizer: Tokenizer,
        *,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
        max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self.max_audio_bytes = max_audio_bytes
        self.max_audio_seconds = max_audio_seconds
        self.bos_id = self._special_id("bos")
        self.image_tokens = MediaTokens(
            *(self._special_id(n) for n in ("image", "image_start", "image_pad", "image_end"))
        )
        self.audio_tokens = MediaTokens(
            *(self._special_id(n) for n in ("audio", "audio_start", "audio_pad", "audio_end"))
        )
        # Only the processor writes these: a prompt holding them would misplace the media embeddings.
        self._reserved = {t.start: f"<|{m}_start|>" for m, t in self._media()}
        self._reserved |= {t.pad: f"<|{m}_pad|>" for m, t in self._media()}
        self._reserved |= {t.end: f"<|{m}_end|>" for m, t in self._media()}

    def _special_id(self, name: str) -> int:
        token_id = self.config.token_id(name)
        text = f"<|{name}|>"
        if self.tokenizer.token_to_id(text) != token_id:
            raise ProcessingError(
                f"tokenizer maps {text} to {self.tokenizer.token_to_id(text)}, "
                f"but config.json has {name}_token_id = {token_id}"
            )
        return token_id

    def _media(self) -> tuple[tuple[str, MediaTokens], ...]:
        return (("image", self.image_tokens), ("audio", self.audio_tokens))

    def __call__(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        images: Sequence[ImageInput] = (),
        audios: Sequence[AudioInput] = (),
    ) -> ProcessedPrompt:
        ids = self.tokenize(prompt)
        self._check_counts(ids, len(images), len(audios))
        pixels = [self.process_image(x) for x in images]
        levels = [self.process_audio(x) for x in audios]
        frame_stack = self.config.audio.frame_stack
        input_ids = self.expand(
            ids, [num_image_tokens(p) for p in pixels], [num_audio_tokens(lv, frame_stack) for lv in levels]
        )
        return ProcessedPrompt(torch.tensor(input_ids, dtype=torch.int64), pixels, levels)

    def tokenize(self, prompt: str | Sequence[int] | torch.Tensor) -> list[int]:
        """Text -> <|bos|> + its tokens; token ids -> themselves, <|bos|> put first when missing."""
        if isinstance(prompt, str):
            ids = [self.bos_id, *self.tokenizer.encode(prompt, add_special_tokens=False).ids]
        elif isinstance(prompt, torch.Tensor | Sequence) and not isinstance(prompt, _ENCODED):
            if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:
                raise ProcessingError(f"token ids must be 1-D, got shape {list(prompt.shape)}")
            ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ProcessingError(
                    f"token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})"
                )
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        else:
            raise TypeError(f"a prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
        reserved = sorted({self._reserved[t] for t in ids if t in self._reserved})
        if reserved:
            raise ProcessingError(f"prompt contains {reserved}, which only the processor may insert")
        return ids

    def _check_counts(self, ids: Sequence[int], num_images: int, num_audios: int) -> None:
        for (name, tokens), given in zip(self._media(), (num_images, num_audios)):
            found = sum(1 for t in ids if t == tokens.placeholder)
            if found != given:
                raise ProcessingError(
                    f"prompt has {found} <|{name}|> placeholder(s) but {given} {name}(s) were given"
                )

    def expand(
        self, ids: Sequence[int], image_counts: Sequence[int], audio_counts: Sequence[int]
    ) -> list[int]:
        """Replace the i-th <|image|> by start + image_counts[i] pads + end; likewise audio."""
        self._check_counts(ids, len(image_counts), len(audio_counts))
        counts = {
            self.image_tokens.placeholder: iter(image_counts),
            self.audio_tokens.placeholder: iter(audio_counts),
        }
        tokens = {
            self.image_tokens.placeholder: self.image_tokens,
            self.audio_tokens.placeholder: self.audio_tokens,
        }
        out: list[int] = []
        for t in ids:
            if t in tokens:
                m = tokens[t]
                out += [m.start, *[m.pad] * next(counts[t]), m.end]
            else:
                out.append(t)
        return out

    def process_image(self, image: ImageInput) -> torch.Tensor:
        if isinstance(image, torch.Tensor):
            return check_pixels(image, self.config.vision)
        if isinstance(image, Image.Image | _ENCODED):
            return preprocess_image(
                image, self.config.vision, max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels
            )
        raise TypeError(f"an image must be encoded bytes, a PIL.Image or pixels, got {type(image).__name__}")

    def process_audio(self, audio: AudioInput) -> torch.Tensor:
        if isinstance(audio, torch.Tensor):
            return check_levels(audio, self.config.audio)
        if isinstance(audio, _ENCODED):
            return preprocess_audio(
                audio, self.config.audio, max_bytes=self.max_audio_bytes, max_seconds=self.max_audio_seconds
            )
        raise TypeError(f"audio must be WAV bytes or dMel levels, got {type(audio).__name__}")

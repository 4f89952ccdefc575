"""Prompts of the real Inkling: text, images and audio -> token ids, pixel values and dMel levels.

    processor = Processor(config, tokenizer)      # PreprocessorSettings.from_pretrained(dir) for the file's
    prompt = processor("A cat <|unused_200054|> and a sound <|unused_200053|>", [png], [wav])

As `InklingProcessor` defines it (INKLING_SPEC §4–6): each image placeholder (`<|unused_200054|>`) is
replaced by that image's patch count of placeholders, each audio placeholder (`<|unused_200053|>`) by
its clip's frame count, left to right; the marker tokens (`<|content_image|>`, `<|content_audio_input|>`)
and `<|audio_end|>` belong to the text or the chat format, and no BOS is added.

- Images (§4.1): PNG, JPEG or WebP, decoded with Pillow, grey expanded and transparency composited on
  white; the published upscale (long edge x `rescale_image_frac` toward a cap, never shrinking) with
  Pillow's LANCZOS (transformers uses torchvision's, which is within one intensity level of it: the only
  place the two may differ); 40x40 patches over ceil(H/40) rows and floor(W/40)+1 columns, padded with
  the raw value -1, CLIP-normalised, duplicated in time: pixel values [N, 2, 40, 40, 3] float32.
- Audio (§5): WAV at any rate, channel count and sample width (and FLAC, MP3, Ogg where soundfile is
  installed), averaged to mono and resampled to 16 kHz (inkling.processing.audio); then transformers'
  own `InklingFeatureExtractor` (log10 Slaney mel, hop 800) and the processor's dMel levels (nearest of 16 centres over [-7, 2]): levels [F, 80] int64.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer

from ..processing.audio import DEFAULT_MAX_AUDIO_BYTES, DEFAULT_MAX_AUDIO_SECONDS, load_audio, resample_to
from ..processing.errors import ProcessingError
from ..processing.image import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, open_image
from .config import InklingConfig

SAMPLE_RATE = 16_000
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PAD_VALUE = -1.0  # raw value of padded pixels, before normalisation
PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class PreprocessorSettings:
    """What the published preprocessor_config.json sets (INKLING_SPEC §4.1, §5.2); transformers'
    defaults differ (no upscale): a checkpoint's file decides."""

    rescale_image_frac: float | None = 2.0
    rescale_image_max_upscaled_long_edge: int | None = 2048
    num_dmel_bins: int = 16
    dmel_min_value: float = -7.0
    dmel_max_value: float = 2.0

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> PreprocessorSettings:
        file = os.path.join(os.fspath(path), PREPROCESSOR_FILE)
        if not os.path.exists(file):
            return cls()
        with open(file) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> PreprocessorSettings:
        """The settings a preprocessor_config.json (or an engine config's copy) holds; other keys ignored."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return {
            "processor_class": "InklingProcessor", "image_processor_type": "InklingImageProcessor",
            "feature_extractor_type": "InklingFeatureExtractor", "feature_size": 80, "sampling_rate": SAMPLE_RATE,
            **{k: getattr(self, k) for k in self.__dataclass_fields__},
        }  # fmt: skip


@dataclass
class Prompt:
    """A processed prompt: token ids (placeholders expanded), and the media in prompt order."""

    input_ids: torch.Tensor  # [T] int64
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # each [N_i, 2, 40, 40, 3] float32
    audio_levels: list[torch.Tensor] = field(default_factory=list)  # each [F_i, 80] int64


def to_rgb(img: Image.Image) -> Image.Image:
    """Grey to three channels; any transparency composited onto white (as transformers' convert_rgb)."""
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def upscaled_size(height: int, width: int, frac: float | None, cap: int | None) -> tuple[int, int]:
    """The size after the published rescale: the long edge times frac, capped (the cap only limits growth)."""
    if frac is None:
        return height, width
    long_edge = max(height, width)
    target = long_edge * frac
    if cap is not None:
        target = min(target, max(cap, long_edge))
    ratio = target / long_edge
    if ratio == 1.0:
        return height, width
    return math.floor(height * ratio + 0.5), math.floor(width * ratio + 0.5)


def image_pixel_values(
    img: Image.Image, settings: PreprocessorSettings, patch: int = 40, time: int = 2
) -> torch.Tensor:
    """An RGB image -> pixel values [N, time, patch, patch, 3], N = ceil(H/patch) * (floor(W/patch) + 1)."""
    h, w = upscaled_size(
        img.height, img.width, settings.rescale_image_frac, settings.rescale_image_max_upscaled_long_edge
    )
    if (h, w) != (img.height, img.width):
        img = img.resize((w, h), Image.LANCZOS)
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float()  # [3, H, W]
    rows, cols = -(-h // patch), w // patch + 1
    canvas = torch.full((3, rows * patch, cols * patch), PAD_VALUE)
    canvas[:, :h, :w] = x
    patches = (
        canvas.reshape(3, rows, patch, cols, patch)
        .permute(1, 3, 0, 2, 4)
        .reshape(rows * cols, 3, patch, patch)
    )
    # transformers fuses rescale (1/255) into the normalisation, (x - 255 mean) / (255 std), the products
    # taken in float32: so here, bit for bit
    mean = (torch.tensor(CLIP_MEAN) * (1.0 / (1 / 255))).view(1, 3, 1, 1)
    std = (torch.tensor(CLIP_STD) * (1.0 / (1 / 255))).view(1, 3, 1, 1)
    patches = (patches - mean) / std
    return patches[..., None].repeat(1, 1, 1, 1, time).permute(0, 4, 2, 3, 1).contiguous()


def dmel_levels(features: torch.Tensor, settings: PreprocessorSettings) -> torch.Tensor:
    """log10 mel features -> the nearest of num_dmel_bins centres (ties to the lower), int64."""
    centres = torch.linspace(
        settings.dmel_min_value, settings.dmel_max_value, settings.num_dmel_bins, dtype=torch.float64
    ).float()
    clamped = features.clamp(min=settings.dmel_min_value, max=settings.dmel_max_value)
    return (clamped.unsqueeze(-1) - centres).abs().argmin(dim=-1).long()


class Processor:
    def __init__(
        self,
        config: InklingConfig,
        tokenizer: Tokenizer,
        settings: PreprocessorSettings | None = None,
        *,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
        max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    ):
        self.config, self.tokenizer, self.settings = config, tokenizer, settings or PreprocessorSettings()
        self.limits = dict(image_bytes=max_image_bytes, image_pixels=max_image_pixels, audio_bytes=max_audio_bytes,
                           audio_seconds=max_audio_seconds)  # fmt: skip
        self.image_token = self._token_text(config.image_token_id, "image placeholder")
        self.audio_token = self._token_text(config.audio_token_id, "audio placeholder")
        self._extractor = None

    def _token_text(self, token_id: int, what: str) -> str:
        text = self.tokenizer.id_to_token(token_id)
        if text is None or self.tokenizer.encode(text, add_special_tokens=False).ids != [token_id]:
            raise ValueError(f"the tokenizer does not encode the {what} (id {token_id}) as one token")
        return text

    @property
    def extractor(self):
        """transformers' InklingFeatureExtractor (80 Slaney mel bins at 16 kHz), made on first use."""
        if self._extractor is None:
            from transformers import InklingFeatureExtractor

            self._extractor = InklingFeatureExtractor(
                feature_size=self.config.audio.n_mel_bins, sampling_rate=SAMPLE_RATE
            )
        return self._extractor

    def image(self, data) -> torch.Tensor:
        """Encoded bytes (PNG, JPEG, WebP) or a PIL image -> pixel values [N, 2, 40, 40, 3]."""
        limits = dict(max_bytes=self.limits["image_bytes"], max_pixels=self.limits["image_pixels"])
        img = to_rgb(open_image(data, **limits, rgb=False))
        v = self.config.vision
        return image_pixel_values(img, self.settings, v.patch_size, v.temporal_patch_size)

    def audio(self, data) -> torch.Tensor:
        if isinstance(data, (bytes, bytearray, memoryview)):
            wave, rate = load_audio(
                data, max_bytes=self.limits["audio_bytes"], max_seconds=self.limits["audio_seconds"]
            )
            wave = resample_to(wave, rate, SAMPLE_RATE)
        else:
            wave = np.asarray(data, dtype=np.float32)
        if wave.size == 0:
            raise ProcessingError("audio has no samples")
        features = self.extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="pt")["input_features"][0]
        return dmel_levels(features, self.settings)  # [F, 80]

    def __call__(self, text: str | Sequence[int], images: Sequence = (), audios: Sequence = ()) -> Prompt:
        pixel_values = [self.image(x) for x in images]
        levels = [self.audio(x) for x in audios]
        if not isinstance(text, str):
            ids = [int(t) for t in text]
            counts = {
                "image": ids.count(self.config.image_token_id),
                "audio": ids.count(self.config.audio_token_id),
            }
            want = {"image": sum(p.shape[0] for p in pixel_values), "audio": sum(a.shape[0] for a in levels)}
            if counts != want:
                raise ProcessingError(f"token ids hold {counts} placeholders for media needing {want}")
        else:
            for kind, token, media in (
                ("image", self.image_token, pixel_values),
                ("audio", self.audio_token, levels),
            ):
                if text.count(token) != len(media):
                    raise ProcessingError(
                        f"the prompt has {text.count(token)} {kind} placeholders ({token}) for {len(media)} {kind}s"
                    )
            text = self._expand(text, [p.shape[0] for p in pixel_values], [a.shape[0] for a in levels])
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        return Prompt(torch.tensor(ids, dtype=torch.long), pixel_values, levels)

    def chat(self, prompt, images: Sequence = (), audios: Sequence = ()) -> Prompt:
        """A rendered conversation (inkling.published.chat.ChatPrompt: one placeholder per media item)
        -> the processed prompt. Items the messages carried come from the prompt; the others, in order,
        from `images` and `audios` (media sent beside the messages)."""
        image_data = _fill(prompt.images, list(images), "image")
        audio_data = _fill(prompt.audios, list(audios), "audio")
        pixel_values = [self.image(x) for x in image_data]
        levels = [self.audio(x) for x in audio_data]
        image_counts, audio_counts = (
            iter([p.shape[0] for p in pixel_values]),
            iter([a.shape[0] for a in levels]),
        )
        ids = []
        for t in prompt.input_ids:
            if t == self.config.image_token_id:
                ids += [t] * next(image_counts)
            elif t == self.config.audio_token_id:
                ids += [t] * next(audio_counts)
            else:
                ids.append(t)
        return Prompt(torch.tensor(ids, dtype=torch.long), pixel_values, levels)

    def _expand(self, text: str, image_counts: list[int], audio_counts: list[int]) -> str:
        """Each placeholder -> its item's count of placeholders, left to right (as InklingProcessor)."""
        out, images, audios, i = [], iter(image_counts), iter(audio_counts), 0
        while i < len(text):
            if text.startswith(self.image_token, i):
                out.append(self.image_token * next(images))
                i += len(self.image_token)
            elif text.startswith(self.audio_token, i):
                out.append(self.audio_token * next(audios))
                i += len(self.audio_token)
            else:
                out.append(text[i])
                i += 1
        return "".join(out)


def _fill(items: list, extra: list, kind: str) -> list:
    """A conversation's media items: its own data, or the next of `extra` where it carried none."""
    out, rest = [], iter(extra)
    for item in items:
        if item is None:
            item = next(rest, None)
            if item is None:
                raise ProcessingError(
                    f"the messages have more {kind} parts without data than {kind}s sent beside them"
                )
        out.append(item)
    if next(rest, None) is not None:
        raise ProcessingError(f"{len(extra)} {kind}s sent beside messages whose {kind} parts need fewer")
    return out

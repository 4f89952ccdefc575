"""Prompt and media preprocessing (INKLING_SPEC §6, §7): what the `preprocessing` model and the
runtime's Python API run before the encoders and the decoder.

image.py: PNG/JPEG -> pixels.  audio.py: WAV -> dMel levels.  prompt.py: `Processor`, which tokenizes
and expands the media placeholders.
"""

from inkling.processing.audio import (
    DEFAULT_MAX_AUDIO_BYTES,
    DEFAULT_MAX_AUDIO_SECONDS,
    check_levels,
    dmel_levels,
    load_wav,
    mel_filterbank,
    num_audio_tokens,
    preprocess_audio,
    resample_to,
)
from inkling.processing.errors import ProcessingError
from inkling.processing.image import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    IMAGE_FORMATS,
    check_pixels,
    image_patches,
    num_image_tokens,
    open_image,
    preprocess_image,
)
from inkling.processing.prompt import MediaTokens, ProcessedPrompt, Processor

__all__ = [
    "DEFAULT_MAX_AUDIO_BYTES",
    "DEFAULT_MAX_AUDIO_SECONDS",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_FORMATS",
    "MediaTokens",
    "ProcessedPrompt",
    "ProcessingError",
    "Processor",
    "check_levels",
    "check_pixels",
    "dmel_levels",
    "load_wav",
    "mel_filterbank",
    "num_audio_tokens",
    "image_patches",
    "num_image_tokens",
    "open_image",
    "preprocess_audio",
    "preprocess_image",
    "resample_to",
]

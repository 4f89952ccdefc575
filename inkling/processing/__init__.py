"""Media decoding with limits, before any model's preprocessing: encoded images (PNG, JPEG, WebP) to
PIL images, audio files (WAV; FLAC, MP3 and Ogg through soundfile) to mono float32 samples, and resampling.
Bad input raises ProcessingError (a ValueError), which the servers answer with 400.

The real Inkling's processor (inkling.published.processing) turns these into pixel values and dMel levels
as transformers' InklingProcessor does.
"""

from inkling.processing.audio import (
    DEFAULT_MAX_AUDIO_BYTES,
    DEFAULT_MAX_AUDIO_SECONDS,
    load_audio,
    load_wav,
    resample_to,
)
from inkling.processing.errors import ProcessingError
from inkling.processing.image import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, open_image

__all__ = [
    "DEFAULT_MAX_AUDIO_BYTES",
    "DEFAULT_MAX_AUDIO_SECONDS",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ProcessingError",
    "load_audio",
    "load_wav",
    "open_image",
    "resample_to",
]

"""Image decoding: encoded PNG, JPEG or WebP -> a PIL image, its size checked from the header first."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from inkling.processing.errors import ProcessingError

DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
"""Formats Pillow may decode: a serving endpoint should expose as few decoders as it needs."""


def open_image(
    data: bytes | bytearray | memoryview | Image.Image,
    *,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    rgb: bool = True,
) -> Image.Image:
    """Decode `data` to an RGB image (rgb=False: in its own mode, alpha kept), checking the byte size and,
    from the header before decoding the pixel data, the pixel count (a small file may declare a huge
    image)."""
    if isinstance(data, Image.Image):
        _check_pixels(data.width, data.height, max_pixels)
        return data if data.mode == "RGB" or not rgb else data.convert("RGB")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"an image must be encoded bytes or a PIL.Image, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProcessingError(f"image is {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning fires in open(); our pixel limit decides just below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:
        raise ProcessingError(f"image rejected as a decompression bomb: {e}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise _undecodable(data, e) from e
    _check_pixels(img.width, img.height, max_pixels)
    try:
        img.load()
        return img.convert("RGB") if rgb else img
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise _undecodable(data, e) from e


def _undecodable(data: bytes | bytearray | memoryview, e: Exception) -> ProcessingError:
    return ProcessingError(f"cannot decode image ({len(data)} bytes; formats {list(IMAGE_FORMATS)}): {e}")


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ProcessingError(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ProcessingError(
            f"image is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}"
        )

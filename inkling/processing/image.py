"""Image preprocessing (INKLING_SPEC §6): encoded PNG/JPEG -> normalised, padded pixels [Hpx, Wpx, 3]."""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image

from inkling.config import VisionConfig
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


def resize_to_limit(img: Image.Image, max_side: int) -> Image.Image:
    """Scale so the longer side is `max_side` when it is longer (bicubic); never upscale."""
    width, height = img.size
    longer = max(width, height)
    if longer <= max_side:
        return img
    s = max_side / longer
    size = (max(1, round(width * s)), max(1, round(height * s)))
    return img.resize(size, Image.BICUBIC)


def normalize_and_pad(img: Image.Image, patch_size: int = 16) -> torch.Tensor:
    """RGB uint8 -> float32 (v/255 - 0.5)/0.5, zero-padded right and bottom to multiples of the patch."""
    rgb = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # [H, W, 3]
    height, width, _ = rgb.shape
    pixels = torch.zeros(_ceil_to(height, patch_size), _ceil_to(width, patch_size), 3, dtype=torch.float32)
    pixels[:height, :width] = (rgb.to(torch.float32) / 255.0 - 0.5) / 0.5
    return pixels


def preprocess_image(
    data: bytes | bytearray | memoryview | Image.Image,
    vision_cfg: VisionConfig,
    *,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> torch.Tensor:
    """Encoded image bytes (or a PIL image) -> pixels [Hpx, Wpx, 3] float32, Hpx and Wpx multiples of 16."""
    img = open_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
    img = resize_to_limit(img, vision_cfg.max_image_side)
    return normalize_and_pad(img, vision_cfg.patch_size)


def num_image_tokens(pixels: torch.Tensor, patch_size: int = 16) -> int:
    """One token per 16x16 patch of the padded image."""
    return (pixels.shape[0] // patch_size) * (pixels.shape[1] // patch_size)


def image_patches(pixels: torch.Tensor, patch_size: int = 16) -> torch.Tensor:
    """[Hpx, Wpx, C] -> [N, patch, patch, C]: the 16x16 patches in raster order, one per image token."""
    Hp, Wp, C = pixels.shape
    if Hp % patch_size or Wp % patch_size:
        raise ProcessingError(f"image sides must be multiples of {patch_size}, got {Hp}x{Wp}")
    grid = pixels.reshape(Hp // patch_size, patch_size, Wp // patch_size, patch_size, C).transpose(1, 2)
    return grid.reshape(-1, patch_size, patch_size, C)


def check_pixels(pixels: torch.Tensor, vision_cfg: VisionConfig) -> torch.Tensor:
    """Validate an already-preprocessed image tensor; raise ProcessingError if it is not one."""
    p = vision_cfg.patch_size
    max_padded = _ceil_to(vision_cfg.max_image_side, p)
    if pixels.dtype != torch.float32 or pixels.dim() != 3 or pixels.shape[2] != 3:
        raise ProcessingError(
            f"pixels must be float32 [Hpx, Wpx, 3], got {pixels.dtype} {list(pixels.shape)}"
        )
    height, width, _ = pixels.shape
    if not (0 < height <= max_padded and 0 < width <= max_padded) or height % p or width % p:
        raise ProcessingError(
            f"pixels of shape {list(pixels.shape)}: sides must be positive multiples of {p}, at most {max_padded}"
        )
    return pixels


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

"""Media decoding with limits (inkling/processing): images and audio files, bad input refused with a
ProcessingError that names what is wrong, resampling."""

from __future__ import annotations

import io
import math
import struct
import wave
import zlib

import numpy as np
import pytest
from PIL import Image

from inkling.processing import ProcessingError, load_wav, open_image, resample_to


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode)


def encode(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def pcm_wav(samples: np.ndarray, sample_rate: int, sample_width: int) -> bytes:
    """PCM WAV written by the stdlib; `samples` are integers [frames, channels] (uint8 for width 1)."""
    samples = samples[:, None] if samples.ndim == 1 else samples
    if sample_width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in samples.reshape(-1))
    else:
        raw = samples.astype({1: "u1", 2: "<i2", 4: "<i4"}[sample_width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(sample_width)
        w.setframerate(sample_rate)
        w.writeframes(raw)
    return buf.getvalue()


def riff(fmt_body: bytes, data: bytes, extra_chunks: bytes = b"") -> bytes:
    chunks = b"fmt " + struct.pack("<I", len(fmt_body)) + fmt_body + extra_chunks
    chunks += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def float_wav(samples: np.ndarray, sample_rate: int, dtype: str = "<f4") -> bytes:
    samples = samples[:, None] if samples.ndim == 1 else samples
    channels, width = samples.shape[1], np.dtype(dtype).itemsize
    fmt = struct.pack(
        "<HHIIHH", 3, channels, sample_rate, sample_rate * channels * width, channels * width, width * 8
    )
    # A fact chunk and an odd-sized LIST chunk (with its pad byte) before the data: chunks must be walked.
    extra = b"fact" + struct.pack("<II", 4, len(samples)) + b"LIST" + struct.pack("<I", 3) + b"abc\x00"
    return riff(fmt, samples.astype(dtype).tobytes(), extra)


def sine(freq: float, sample_rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(sample_rate * seconds))) / sample_rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_other_modes_and_jpeg_decode_to_rgb():
    for img in (random_image(30, 20, "RGBA"), random_image(30, 20, "L")):
        got = open_image(encode(img))
        assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(img.convert("RGB")))
    assert open_image(encode(random_image(30, 20, "RGBA")), rgb=False).mode == "RGBA"
    jpeg = encode(random_image(30, 20), "JPEG")
    decoded = Image.open(io.BytesIO(jpeg)).convert("RGB")
    assert np.array_equal(np.asarray(open_image(jpeg)), np.asarray(decoded))


def test_image_byte_limit():
    data = encode(random_image(40, 40))
    open_image(data, max_bytes=len(data))
    with pytest.raises(ProcessingError, match="bytes"):
        open_image(data, max_bytes=len(data) - 1)


def test_image_pixel_limit():
    img = random_image(200, 100)
    open_image(encode(img), max_pixels=20_000)
    with pytest.raises(ProcessingError, match="20000 pixels"):
        open_image(encode(img), max_pixels=19_999)
    with pytest.raises(ProcessingError, match="pixels"):
        open_image(img, max_pixels=19_999)


def _png_declaring(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR is rewritten to claim width x height (CRC fixed up)."""
    png = bytearray(encode(random_image(8, 8)))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


def test_decompression_bomb_is_refused_from_the_header():
    bomb = _png_declaring(10_000, 9_000)  # 90 Mpx declared in a file of a few hundred bytes
    assert len(bomb) < 1000
    with pytest.raises(ProcessingError, match="more than the limit"):
        open_image(bomb)
    with pytest.raises(ProcessingError):
        open_image(_png_declaring(50_000, 50_000))  # Pillow's own bomb limit


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"definitely not an image",
        encode(random_image(40, 40))[:60],  # truncated PNG
        encode(random_image(10, 10), "GIF"),  # a format we do not decode
        _png_declaring(40, 40),  # header larger than the pixel data
    ],
)
def test_undecodable_image(data):
    with pytest.raises(ProcessingError, match="cannot decode image"):
        open_image(data)


def test_image_of_wrong_type():
    with pytest.raises(TypeError):
        open_image("image.png")


# ---------------------------------------------------------------- WAV decoding


def test_wav_int16():
    wav = pcm_wav(np.array([-32768, 0, 16384, 32767]), 16000, 2)
    x, sr = load_wav(wav)
    assert sr == 16000 and x.dtype == np.float32
    np.testing.assert_array_equal(x, [-1.0, 0.0, 0.5, 32767 / 32768])


def test_wav_int32():
    x, _ = load_wav(pcm_wav(np.array([-(2**31), 0, 2**30, 2**31 - 1]), 8000, 4))
    np.testing.assert_array_equal(x, np.array([-1.0, 0.0, 0.5, (2**31 - 1) / 2**31], dtype=np.float32))


def test_wav_uint8():
    x, _ = load_wav(pcm_wav(np.array([0, 128, 192, 255]), 8000, 1))
    np.testing.assert_array_equal(x, [-1.0, 0.0, 0.5, 127 / 128])


def test_wav_int24():
    x, _ = load_wav(pcm_wav(np.array([-(2**23), -1, 0, 2**22, 2**23 - 1]), 8000, 3))
    np.testing.assert_array_equal(x, np.array([-1.0, -(2**-23), 0.0, 0.5, 1 - 2**-23], dtype=np.float32))


@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
def test_wav_float(dtype):
    samples = np.array([-1.0, -0.25, 0.0, 0.125, 1.5], dtype=np.float32)  # float is taken as is, even > 1
    x, sr = load_wav(float_wav(samples, 22050, dtype))
    assert sr == 22050
    np.testing.assert_array_equal(x, samples)


def test_wav_extensible_pcm():
    data = np.array([1000, -2000], dtype="<i2").tobytes()
    subformat = struct.pack("<H", 1) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    fmt = struct.pack("<HHIIHHHHI", 0xFFFE, 1, 16000, 32000, 2, 16, 22, 16, 4) + subformat
    x, _ = load_wav(riff(fmt, data))
    np.testing.assert_array_equal(x, np.array([1000, -2000], dtype=np.float32) / 32768)


def test_stereo_is_averaged():
    stereo = np.array([[16384, 0], [0, -16384], [32767, 32767]])
    x, _ = load_wav(pcm_wav(stereo, 16000, 2))
    np.testing.assert_array_equal(x, np.array([0.25, -0.25, 32767 / 32768], dtype=np.float32))
    x, _ = load_wav(float_wav(np.array([[1.0, 0.5, 0.0], [0.0, 0.0, -0.75]]), 16000))
    np.testing.assert_allclose(x, [0.5, -0.25], rtol=1e-7)


def _no_data_chunk() -> bytes:
    wav = pcm_wav(np.zeros(4), 16000, 2)
    return wav[: wav.index(b"data")]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "RIFF"),
        (b"ID3\x03 definitely not a wav file", "RIFF"),
        (encode(random_image(4, 4)), "RIFF"),
        (_no_data_chunk(), "no data chunk"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no fmt chunk"),
        (riff(struct.pack("<HHIIHH", 2, 1, 8000, 4000, 1, 4), b"\x00" * 8), "unsupported"),  # ADPCM
        (riff(struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 12), b"\x00" * 8), "unsupported"),
        (riff(struct.pack("<HHIIHH", 1, 2, 8000, 16000, 2, 16), b"\x00" * 8), "block_align"),
        (riff(struct.pack("<HHIIHH", 1, 1, 0, 0, 2, 16), b"\x00" * 8), "sample rate"),
        (pcm_wav(np.zeros(0), 16000, 2), "no samples"),
        (float_wav(np.array([0.0, np.nan]), 16000), "non-finite"),
    ],
)
def test_undecodable_wav(data, message):
    with pytest.raises(ProcessingError, match=message):
        load_wav(data)


def test_audio_limits():
    wav = pcm_wav(np.zeros(16000), 16000, 2)  # 1 s
    load_wav(wav, max_bytes=len(wav), max_seconds=1.0)
    with pytest.raises(ProcessingError, match="bytes"):
        load_wav(wav, max_bytes=len(wav) - 1)
    with pytest.raises(ProcessingError, match="1.0 s long"):
        load_wav(wav, max_seconds=0.5)
    with pytest.raises(TypeError):
        load_wav("audio.wav")


# ---------------------------------------------------------------- resampling


def _peak_hz(x: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * sample_rate / len(x)


def test_resample_441k_to_16k_keeps_the_tone():
    tone = sine(1000.0, 44100, 1.0)
    out = resample_to(tone, 44100, 16000)
    assert out.dtype == np.float32 and len(out) == 16000
    assert abs(_peak_hz(out, 16000) - 1000.0) <= 1.0
    assert abs(np.sqrt(np.mean(out[1000:-1000] ** 2)) - 0.5 / math.sqrt(2)) < 0.01  # amplitude kept


def test_resample_same_rate_is_identity_and_wav_path_resamples():
    tone = sine(440.0, 16000, 0.1)
    assert resample_to(tone, 16000, 16000) is tone
    samples, rate = load_wav(pcm_wav(np.zeros(22050, dtype=np.int16), 22050, 2))  # 1 s at 22.05 kHz
    assert len(resample_to(samples, rate, 16000)) == 16000

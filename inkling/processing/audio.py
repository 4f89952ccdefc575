"""Audio decoding: WAV bytes -> mono float32 samples and their rate; resampling to the model's rate.

`load_audio` also takes FLAC, MP3 and Ogg (Vorbis, Opus), decoded by libsndfile through the
`soundfile` package where it is installed (the CPU venv has it); WAV never needs it.

WAV files are parsed here rather than with the stdlib `wave`: `wave` refuses IEEE float data
(format tag 3) on every Python version and WAVE_FORMAT_EXTENSIBLE before 3.12, and one parser
keeps the two Pythons we support identical.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from inkling.processing.errors import ProcessingError

DEFAULT_MAX_AUDIO_BYTES = 256 * 2**20
DEFAULT_MAX_AUDIO_SECONDS = 1200.0
MAX_SAMPLE_RATE = 384_000
"""Above this a prime rate would make resample_poly build a filter of many millions of taps."""

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"  # KSDATAFORMAT_SUBTYPE_*
_SUPPORTED = {(_PCM, 8), (_PCM, 16), (_PCM, 24), (_PCM, 32), (_FLOAT, 32), (_FLOAT, 64)}


@dataclass(frozen=True)
class WavFormat:
    format_tag: int  # 1 PCM, 3 IEEE float (the sub-format of an extensible file)
    num_channels: int
    sample_rate: int
    block_align: int
    bits_per_sample: int


def load_wav(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
) -> tuple[np.ndarray, int]:
    """WAV bytes -> (mono float32 samples, sample rate). PCM 8/16/24/32-bit and float 32/64-bit;
    channels averaged. The duration is checked from the header, before decoding."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"audio must be WAV bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProcessingError(f"audio is {len(data)} bytes, more than the limit of {max_bytes}")
    fmt, raw = _parse_riff(memoryview(data).cast("B"))
    num_frames = len(raw) // fmt.block_align
    if num_frames == 0:
        raise ProcessingError("WAV has no samples")
    seconds = num_frames / fmt.sample_rate
    if seconds > max_seconds:
        raise ProcessingError(f"audio is {seconds:.1f} s long, more than the limit of {max_seconds} s")
    samples = _decode_samples(fmt, raw[: num_frames * fmt.block_align])  # [n, channels]
    if not np.isfinite(samples).all():
        raise ProcessingError("WAV holds non-finite float samples (NaN or infinity)")
    mono = samples[:, 0] if fmt.num_channels == 1 else samples.mean(axis=1, dtype=np.float32)
    return np.array(mono, dtype=np.float32), fmt.sample_rate


COMPRESSED = {b"fLaC": "FLAC", b"ID3": "MP3", b"\xff\xfb": "MP3", b"\xff\xf3": "MP3", b"\xff\xf2": "MP3",
              b"OggS": "Ogg"}  # fmt: skip
"""Signatures of the compressed files libsndfile decodes (an MP3 opens with an ID3 tag or a frame sync)."""


def audio_kind(data: bytes | bytearray | memoryview) -> str | None:
    """ "WAV", "FLAC", "MP3" or "Ogg" by the file's signature; None for anything else."""
    head = bytes(data[:4])
    if head == b"RIFF":
        return "WAV"
    return next((kind for sig, kind in COMPRESSED.items() if head.startswith(sig)), None)


def load_audio(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
) -> tuple[np.ndarray, int]:
    """WAV, FLAC, MP3 or Ogg bytes -> (mono float32 samples, sample rate), channels averaged; the size
    and the duration (from the header) are checked before decoding."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"audio must be file bytes, got {type(data).__name__}")
    kind = audio_kind(data)
    if kind in (None, "WAV"):
        return load_wav(data, max_bytes=max_bytes, max_seconds=max_seconds)
    if len(data) > max_bytes:
        raise ProcessingError(f"audio is {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        import soundfile
    except ImportError:
        raise ProcessingError(f"{kind} audio needs the soundfile package here; send WAV") from None
    import io

    try:
        with soundfile.SoundFile(io.BytesIO(bytes(data))) as f:
            if not 1 <= f.samplerate <= MAX_SAMPLE_RATE:
                raise ProcessingError(f"{kind} sample rate {f.samplerate} outside [1, {MAX_SAMPLE_RATE}]")
            if f.frames > 0 and f.frames / f.samplerate > max_seconds:
                raise ProcessingError(
                    f"audio is {f.frames / f.samplerate:.1f} s long, more than the limit of {max_seconds} s"
                )
            samples = f.read(frames=int(max_seconds * f.samplerate) + 1, dtype="float32", always_2d=True)
            rate = f.samplerate
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise ProcessingError(f"cannot decode {kind} audio: {e}") from e
    if samples.shape[0] == 0:
        raise ProcessingError(f"{kind} audio has no samples")
    if samples.shape[0] > max_seconds * rate:
        raise ProcessingError(f"audio is longer than the limit of {max_seconds} s")
    mono = samples[:, 0] if samples.shape[1] == 1 else samples.mean(axis=1, dtype=np.float32)
    return np.array(mono, dtype=np.float32), rate


def _parse_riff(data: memoryview) -> tuple[WavFormat, memoryview]:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ProcessingError("not a WAV file: no RIFF/WAVE header")
    fmt = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = bytes(data[pos : pos + 4])
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = pos + 8
        if chunk_id == b"fmt ":
            fmt = _parse_fmt(data[body : body + size])
        elif chunk_id == b"data":
            if fmt is None:
                raise ProcessingError("WAV data chunk comes before its fmt chunk")
            # A streaming writer may leave the size at 0xFFFFFFFF: take what is there.
            return fmt, data[body : min(body + size, len(data))]
        pos = body + size + (size & 1)  # chunks are word-aligned
    raise ProcessingError("WAV has no fmt chunk" if fmt is None else "WAV has no data chunk")


def _parse_fmt(body: memoryview) -> WavFormat:
    if len(body) < 16:
        raise ProcessingError(f"WAV fmt chunk is {len(body)} bytes, expected at least 16")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", body)
    if tag == _EXTENSIBLE:
        if len(body) < 40 or bytes(body[26:40]) != _GUID_TAIL:
            raise ProcessingError("WAV extensible fmt chunk without a known sub-format")
        tag = int.from_bytes(body[24:26], "little")
    if (tag, bits) not in _SUPPORTED:
        kind = {_PCM: "PCM", _FLOAT: "float"}.get(tag, f"format tag {tag:#x}")
        raise ProcessingError(
            f"unsupported WAV encoding: {kind}, {bits} bits (supported: PCM 8/16/24/32, float 32/64)"
        )
    if channels < 1:
        raise ProcessingError("WAV declares 0 channels")
    if not 1 <= rate <= MAX_SAMPLE_RATE:
        raise ProcessingError(f"WAV sample rate {rate} outside [1, {MAX_SAMPLE_RATE}]")
    if block_align != channels * bits // 8:
        raise ProcessingError(f"WAV block_align {block_align} != {channels} channels x {bits // 8} bytes")
    return WavFormat(tag, channels, rate, block_align, bits)


def _decode_samples(fmt: WavFormat, raw: memoryview) -> np.ndarray:
    """Interleaved samples -> float32 [frames, channels]: int16/32768, int32/2^31, uint8 (v-128)/128,
    int24/2^23, float as is."""
    bits = fmt.bits_per_sample
    if fmt.format_tag == _FLOAT:
        x = np.frombuffer(raw, dtype="<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128) / 128
    elif bits == 16:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768
    elif bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = ((v ^ 0x800000) - 0x800000).astype(np.float32) / 2**23  # sign-extend 24 -> 32 bits
    else:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2**31
    return x.reshape(-1, fmt.num_channels)


def resample_to(wave: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Polyphase resampling (scipy's default Kaiser window), up/down reduced by their gcd.

    scipy is imported here, not at module level: 16 kHz audio never needs it, and a Triton Python
    stub's environment may hold a NumPy that the installed scipy does not support."""
    import scipy.signal

    if orig_sr == target_sr:
        return wave
    g = math.gcd(orig_sr, target_sr)
    return scipy.signal.resample_poly(wave, target_sr // g, orig_sr // g).astype(np.float32, copy=False)

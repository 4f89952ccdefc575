"""Image, audio and prompt preprocessing (INKLING_SPEC §6, §7)."""

from __future__ import annotations

import io
import math
import re
import struct
import wave
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inkling.config import SPECIAL_TOKENS, AudioConfig, VisionConfig, preset
from inkling.processing import (
    ProcessingError,
    Processor,
    dmel_levels,
    load_wav,
    mel_filterbank,
    num_audio_tokens,
    num_image_tokens,
    preprocess_audio,
    preprocess_image,
    resample_to,
)

VISION = VisionConfig(hmlp_dims=(32, 64), max_image_side=64)
AUDIO = AudioConfig()


# ---------------------------------------------------------------- helpers


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode)


def encode(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def expected_pixels(img: Image.Image) -> torch.Tensor:
    """§6 normalisation of an RGB image, without padding."""
    return (torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32)) / 255 - 0.5) / 0.5


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


def reference_fbank(n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int) -> np.ndarray:
    """Triangles over HTK-mel-spaced points, one bin and one filter at a time, in float64."""
    mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)
    hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    m_lo, m_hi = mel(f_min), mel(f_max)
    pts = [hz(m_lo + (m_hi - m_lo) * i / (n_mels + 1)) for i in range(n_mels + 2)]
    out = np.zeros((n_freqs, n_mels))
    for k in range(n_freqs):
        f = (sample_rate // 2) * k / (n_freqs - 1)
        for m in range(n_mels):
            left, centre, right = pts[m], pts[m + 1], pts[m + 2]
            if left <= f <= centre:
                out[k, m] = (f - left) / (centre - left)
            elif centre < f <= right:
                out[k, m] = (right - f) / (right - centre)
    return out


# ---------------------------------------------------------------- images


@pytest.mark.parametrize(
    "size, resized",
    [
        ((200, 100), (64, 32)),  # s = 0.32
        ((100, 37), (64, 24)),  # 37 * 0.64 = 23.68 -> 24
        ((37, 100), (24, 64)),  # portrait
        ((1000, 3), (64, 1)),  # max(1, round(0.192)) = 1
        ((64, 64), (64, 64)),  # at the limit: untouched
    ],
)
def test_resize_rule_and_bicubic_match_pil(size, resized):
    img = random_image(*size)
    pixels = preprocess_image(encode(img), VISION)
    width, height = resized
    ref = img if resized == size else img.resize(resized, Image.BICUBIC)
    assert pixels.dtype == torch.float32
    assert pixels.shape == (math.ceil(height / 16) * 16, math.ceil(width / 16) * 16, 3)
    assert torch.equal(pixels[:height, :width], expected_pixels(ref))


def test_small_image_is_not_upscaled_and_pads_with_zero():
    img = random_image(20, 10)
    pixels = preprocess_image(img, VISION)  # a PIL image is accepted too
    assert pixels.shape == (16, 32, 3)
    assert torch.equal(pixels[:10, :20], expected_pixels(img))
    assert torch.all(pixels[10:] == 0.0) and torch.all(pixels[:, 20:] == 0.0)
    assert num_image_tokens(pixels) == 2


def test_normalisation_values():
    data = np.array([[[0, 128, 255], [255, 0, 1]]], dtype=np.uint8)  # 2x1 RGB
    pixels = preprocess_image(encode(Image.fromarray(data, "RGB")), VISION)
    expected = torch.tensor([[[-1.0, (128 / 255 - 0.5) / 0.5, 1.0], [1.0, -1.0, (1 / 255 - 0.5) / 0.5]]])
    assert torch.allclose(pixels[:1, :2], expected, rtol=0, atol=1e-7)
    assert pixels.shape == (16, 16, 3) and pixels[1:].abs().sum() == 0 and pixels[:, 2:].abs().sum() == 0


def test_patch_grid_size():
    assert num_image_tokens(torch.zeros(48, 64, 3)) == 3 * 4
    assert num_image_tokens(preprocess_image(random_image(33, 17), VISION)) == 2 * 3
    big = VisionConfig(max_image_side=1024)
    assert num_image_tokens(preprocess_image(random_image(2000, 1000), big)) == (512 // 16) * (1024 // 16)


def test_other_modes_and_jpeg_decode_to_rgb():
    rgba = random_image(30, 20, "RGBA")
    assert torch.equal(preprocess_image(encode(rgba), VISION)[:20, :30], expected_pixels(rgba.convert("RGB")))
    gray = random_image(30, 20, "L")
    assert torch.equal(preprocess_image(encode(gray), VISION)[:20, :30], expected_pixels(gray.convert("RGB")))
    jpeg = encode(random_image(30, 20), "JPEG")
    decoded = Image.open(io.BytesIO(jpeg)).convert("RGB")
    assert torch.equal(preprocess_image(jpeg, VISION)[:20, :30], expected_pixels(decoded))


def test_image_byte_limit():
    data = encode(random_image(40, 40))
    preprocess_image(data, VISION, max_bytes=len(data))
    with pytest.raises(ProcessingError, match="bytes"):
        preprocess_image(data, VISION, max_bytes=len(data) - 1)


def test_image_pixel_limit():
    img = random_image(200, 100)
    preprocess_image(encode(img), VISION, max_pixels=20_000)
    with pytest.raises(ProcessingError, match="20000 pixels"):
        preprocess_image(encode(img), VISION, max_pixels=19_999)
    with pytest.raises(ProcessingError, match="pixels"):
        preprocess_image(img, VISION, max_pixels=19_999)


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
        preprocess_image(bomb, VISION)
    with pytest.raises(ProcessingError):
        preprocess_image(_png_declaring(50_000, 50_000), VISION)  # Pillow's own bomb limit


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
        preprocess_image(data, VISION)


def test_image_of_wrong_type():
    with pytest.raises(TypeError):
        preprocess_image("image.png", VISION)


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
        preprocess_audio(wav, AUDIO, max_seconds=0.5)
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
    levels = preprocess_audio(pcm_wav(np.zeros(22050, dtype=np.int16), 22050, 2), AUDIO)  # 1 s at 22.05 kHz
    assert levels.shape == (80, 104)  # 16000 samples after resampling -> F = 101 -> 104


# ---------------------------------------------------------------- mel filterbank


def test_mel_filterbank_matches_a_straightforward_loop():
    fb = mel_filterbank()
    assert fb.shape == (201, 80) and fb.dtype == torch.float32
    np.testing.assert_allclose(fb.numpy(), reference_fbank(201, 0.0, 8000.0, 80, 16000), rtol=0, atol=2e-5)
    assert fb.min() >= 0 and fb.max() <= 1
    assert torch.all(fb.max(dim=0).values > 0)  # no empty filter at 80 mels / 201 bins
    other = mel_filterbank(257, 100.0, 7000.0, 40, 16000)
    np.testing.assert_allclose(
        other.numpy(), reference_fbank(257, 100.0, 7000.0, 40, 16000), rtol=0, atol=2e-5
    )


def test_mel_filters_are_triangles_peaking_at_one_at_their_htk_centres():
    fb = mel_filterbank(n_freqs=8001).numpy()  # 1 Hz bins: each triangle is sampled finely
    m_max = 2595.0 * math.log10(1.0 + 8000.0 / 700.0)
    centres = [700.0 * (10.0 ** (m_max * (i + 1) / 81 / 2595.0) - 1.0) for i in range(80)]
    for m, centre in enumerate(centres):
        col = fb[:, m]
        support = np.nonzero(col)[0]
        peak = int(np.argmax(col))
        left_width = centre - (centres[m - 1] if m else 0.0)
        assert abs(peak - centre) <= 0.5  # the bin nearest the centre (bins are at whole Hz)
        assert 1.0 - 0.5 / left_width - 1e-5 <= col[peak] <= 1.0
        assert np.all(np.diff(col[support[0] : peak + 1]) > 0)  # rises to the centre
        assert np.all(np.diff(col[peak : support[-1] + 1]) < 0)  # then falls
        assert np.all(np.diff(support) == 1)  # one contiguous triangle


# ---------------------------------------------------------------- dMel levels


def test_dmel_levels_of_a_pure_tone():
    levels = dmel_levels(torch.from_numpy(sine(1000.0, 16000, 1.0)), AUDIO)
    assert levels.dtype == torch.int64
    assert levels.shape == (80, 104)  # F = 1 + 16000 // 160 = 101, padded to 104
    assert torch.all(levels[:, 101:] == 0)
    # 1 kHz is FFT bin 25; the Hann window spreads it over bins 24..26 only.
    fb = mel_filterbank()
    hit = fb[24:27].sum(dim=0) > 0
    interior = levels[:, 2:99]  # frames 0, 1, 99, 100 reach into the reflect padding (a kink)
    assert torch.all(interior[hit] == AUDIO.num_levels - 1)  # log power 7.8 clamps to log_max
    assert torch.all(interior[~hit] == 0)
    tone_bins = set(torch.nonzero(hit).flatten().tolist())
    assert {m for m in range(80) if fb[25, m] > 0} <= tone_bins and len(tone_bins) <= 6


def test_dmel_levels_match_a_numpy_float64_pipeline():
    rng = np.random.default_rng(0)
    wave_ = (rng.standard_normal(8000) * np.geomspace(1e-4, 1.0, 8000)).astype(np.float32)  # levels 0..15
    levels = dmel_levels(torch.from_numpy(wave_), AUDIO).numpy()
    padded = np.pad(wave_.astype(np.float64), 200, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)  # periodic Hann
    frames = np.stack([padded[i * 160 : i * 160 + 400] * window for i in range(1 + 8000 // 160)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # [F, 201]
    mel = (power @ reference_fbank(201, 0.0, 8000.0, 80, 16000)).T
    m = np.clip(np.log(np.maximum(mel, 1e-10)), -11.5, 2.0)
    expected = np.round((m - -11.5) / 13.5 * 15)
    assert levels.shape == (80, 52) and np.all(levels[:, 51:] == 0)
    assert len(np.unique(expected)) == 16
    assert np.abs(levels[:, :51] - expected).max() <= 1
    assert np.mean(levels[:, :51] == expected) > 0.995  # float32 vs float64 only flips ties


@pytest.mark.parametrize(
    "samples, frames", [(0, 3), (1, 3), (399, 3), (400, 3), (480, 4), (640, 5), (16159, 101)]
)
def test_dmel_frame_count_and_padding(samples, frames):
    levels = dmel_levels(torch.zeros(samples), AUDIO)
    assert levels.shape == (80, math.ceil(frames / 4) * 4)
    assert num_audio_tokens(levels) == math.ceil(frames / 4)
    assert torch.all(levels == 0)  # log(1e-10) = -23 < log_min: level 0 everywhere


def test_dmel_rejects_non_1d():
    with pytest.raises(ProcessingError, match="1-D"):
        dmel_levels(torch.zeros(2, 400), AUDIO)


# ---------------------------------------------------------------- prompt


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[f"<|{name}|>" for name in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["look at this picture and listen to the sound, then describe both"] * 20, trainer
    )
    return tok


@pytest.fixture(scope="module")
def processor(tokenizer) -> Processor:
    token_ids = {name: tokenizer.token_to_id(f"<|{name}|>") for name in SPECIAL_TOKENS}
    return Processor(preset("inkling-tiny", token_ids=token_ids), tokenizer)


def test_prompt_expansion_with_two_images_and_one_audio(processor, tokenizer):
    ids = {name: tokenizer.token_to_id(f"<|{name}|>") for name in SPECIAL_TOKENS}
    images = [encode(random_image(40, 20)), encode(random_image(200, 100))]  # 2x3 and 2x4 patches
    audio = pcm_wav((sine(440.0, 16000, 1.0) * 32767).astype(np.int16), 16000, 2)  # 104 frames: 26 tokens
    text = ["look", " at <|image|> and", "<|image|>", ", listen to <|audio|>", " then describe both"]
    out = processor("".join(text), images=images, audios=[audio])

    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False).ids

    def media(kind: str, n: int) -> list[int]:
        return [ids[f"{kind}_start"], *[ids[f"{kind}_pad"]] * n, ids[f"{kind}_end"]]

    expected = [ids["bos"], *enc("look at "), *media("image", 6), *enc(" and"), *media("image", 8)]
    expected += [*enc(", listen to "), *media("audio", 26), *enc(" then describe both")]
    assert out.input_ids.dtype == torch.int64
    assert out.input_ids.tolist() == expected
    assert [p.shape for p in out.images] == [(32, 48, 3), (32, 64, 3)]
    assert [a.shape for a in out.audios] == [(80, 104)]
    assert ids["image"] not in expected and ids["audio"] not in expected

    # Token ids (with or without <|bos|>) and already-processed media give the same prompt.
    again = processor(out.input_ids.tolist()[:1] + enc("look at <|image|>"), images=out.images[:1])
    assert again.input_ids.tolist() == expected[: len(again.input_ids)]
    ids_prompt = [
        *enc("look at "),
        ids["image"],
        *enc(" and"),
        ids["image"],
        *enc(", listen to "),
        ids["audio"],
    ]
    ids_prompt += enc(" then describe both")
    same = processor(torch.tensor(ids_prompt), images=out.images, audios=out.audios)
    assert same.input_ids.tolist() == expected


def test_text_only_prompt_gets_bos(processor, tokenizer):
    out = processor("describe")
    assert out.input_ids.tolist() == [tokenizer.token_to_id("<|bos|>"), *tokenizer.encode("describe").ids]
    assert out.images == [] and out.audios == []


@pytest.mark.parametrize(
    "text, num_images, num_audios, message",
    [
        ("look <|image|>", 0, 0, "1 <|image|> placeholder"),
        ("look <|image|>", 2, 0, "but 2 image"),
        ("look", 1, 0, "0 <|image|>"),
        ("<|audio|><|audio|>", 0, 1, "2 <|audio|>"),
        ("listen", 0, 1, "0 <|audio|>"),
    ],
)
def test_mismatched_placeholder_count(processor, text, num_images, num_audios, message):
    images = [torch.zeros(16, 16, 3)] * num_images
    audios = [torch.zeros(80, 4, dtype=torch.int64)] * num_audios
    with pytest.raises(ProcessingError, match=re.escape(message)):
        processor(text, images=images, audios=audios)


def test_reserved_tokens_in_the_prompt_are_refused(processor, tokenizer):
    with pytest.raises(ProcessingError, match="only the processor"):
        processor("look <|image_pad|>")
    with pytest.raises(ProcessingError, match="only the processor"):
        processor([tokenizer.token_to_id("<|audio_start|>")])


def test_bad_prompts_and_media(processor):
    with pytest.raises(ProcessingError, match="outside the vocabulary"):
        processor([5, 100_000])
    with pytest.raises(ProcessingError, match="1-D"):
        processor(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError):
        processor(b"bytes are not a prompt")
    with pytest.raises(ProcessingError, match="multiples of 16"):
        processor("<|image|>", images=[torch.zeros(20, 16, 3)])
    with pytest.raises(ProcessingError, match="levels"):
        processor("<|audio|>", audios=[torch.zeros(80, 5, dtype=torch.int64)])
    with pytest.raises(ProcessingError, match="cannot decode image"):
        processor("<|image|>", images=[b"junk"])
    with pytest.raises(TypeError):
        processor("<|image|>", images=["image.png"])


def test_tokenizer_and_config_must_agree(tokenizer):
    token_ids = {name: tokenizer.token_to_id(f"<|{name}|>") for name in SPECIAL_TOKENS}
    token_ids["image_pad"], token_ids["image_end"] = token_ids["image_end"], token_ids["image_pad"]
    with pytest.raises(ProcessingError, match=re.escape("maps <|image_pad|> to")):
        Processor(preset("inkling-tiny", token_ids=token_ids), tokenizer)

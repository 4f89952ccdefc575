"""The real Inkling's processor: images as INKLING_SPEC §4.1 defines them, audio equal to transformers'
InklingFeatureExtractor and InklingProcessor's dMel levels, placeholders expanded as InklingProcessor does."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from inkling.processing.errors import ProcessingError
from inkling.published.config import preset
from inkling.published.processing import (
    CLIP_MEAN,
    CLIP_STD,
    PreprocessorSettings,
    Processor,
    dmel_levels,
    image_pixel_values,
    upscaled_size,
)
from inkling.published.tokens import build_tiny_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def processor():
    return Processor(preset("inkling-tiny"), build_tiny_tokenizer(1024))


def png(w: int, h: int, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr.squeeze(-1) if mode == "L" else arr, mode).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float, rate: int, channels: int = 1, width: int = 2) -> bytes:
    n = int(seconds * rate)
    t = np.arange(n) / rate
    x = 0.5 * np.sin(2 * np.pi * 440 * t)[:, None].repeat(channels, 1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(
            (x * (2 ** (8 * width - 1) - 1)).astype({1: np.uint8, 2: np.int16, 4: np.int32}[width]).tobytes()
            if width != 1
            else ((x + 1) * 127.5).astype(np.uint8).tobytes()
        )
    return buf.getvalue()


@pytest.mark.parametrize(
    "size, frac, tokens",
    [((40, 40), None, 2), ((90, 130), None, 12), ((768, 1024), None, 520), ((40, 40), 2.0, 6), ((90, 130), 2.0, 35),
     ((768, 1024), 2.0, 2028), ((2000, 3000), 2.0, 3800)],
)  # fmt: skip
def test_tokens_per_image_follow_the_published_table(size, frac, tokens):
    """INKLING_SPEC §4.5's table: rows ceil(H/40), columns floor(W/40)+1 after the upscale."""
    h, w = upscaled_size(*size, frac, 2048)
    assert -(-h // 40) * (w // 40 + 1) == tokens


def test_pixel_values_are_padded_normalised_patches_duplicated_in_time():
    img = Image.fromarray(np.full((50, 41, 3), 200, dtype=np.uint8))
    pv = image_pixel_values(img, PreprocessorSettings(rescale_image_frac=None))
    assert pv.shape == (2 * 2, 2, 40, 40, 3)  # rows ceil(50/40) = 2, columns floor(41/40)+1 = 2
    assert torch.equal(pv[:, 0], pv[:, 1])
    value = [(200 - 255 * m) / (255 * s) for m, s in zip(CLIP_MEAN, CLIP_STD)]
    pad = [(-1 - 255 * m) / (255 * s) for m, s in zip(CLIP_MEAN, CLIP_STD)]
    torch.testing.assert_close(pv[0, 0, 0, 0], torch.tensor(value))
    torch.testing.assert_close(pv[1, 0, 0, 0], torch.tensor(value))  # column 40 of the image
    torch.testing.assert_close(pv[1, 0, 0, 1], torch.tensor(pad))  # past its width: padding
    torch.testing.assert_close(pv[3, 0, 10, 0], torch.tensor(pad))  # row 50: padding
    torch.testing.assert_close(pv[2, 0, 9, 0], torch.tensor(value))  # row 49: the image


def test_transparency_is_composited_on_white(processor):
    arr = np.zeros((40, 40, 4), dtype=np.uint8)  # black, fully transparent
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG")
    pv = processor.image(buf.getvalue())
    white = [(255 - 255 * m) / (255 * s) for m, s in zip(CLIP_MEAN, CLIP_STD)]
    torch.testing.assert_close(pv[0, 0, 0, 0], torch.tensor(white))


@pytest.mark.parametrize(
    "seconds, rate, channels, width",
    [(0.37, 16000, 1, 2), (1.0, 16000, 2, 2), (0.5, 44100, 1, 4), (0.05, 8000, 1, 1)],
)
def test_audio_levels_equal_transformers(processor, seconds, rate, channels, width):
    from inkling.processing.audio import load_wav, resample_to

    data = wav(seconds, rate, channels, width)
    levels = processor.audio(data)
    samples, sr = load_wav(data)
    samples = resample_to(samples, sr, 16000)
    fe = transformers.InklingFeatureExtractor(feature_size=80, sampling_rate=16000)
    feats = fe(samples, sampling_rate=16000, return_tensors="pt")
    assert levels.shape == (-(-len(samples) // 800), 80)  # 20 tokens a second
    # InklingProcessor's dMel: nearest of 16 centres over [-7, 2]
    centres = torch.linspace(-7.0, 2.0, 16, dtype=torch.float64).float()
    want = (feats["input_features"][0].clamp(-7, 2)[..., None] - centres).abs().argmin(-1)
    assert torch.equal(levels, want)
    assert torch.equal(dmel_levels(feats["input_features"][0], PreprocessorSettings()), want)


def test_placeholders_expand_to_the_media_token_counts(processor):
    c = preset("inkling-tiny")
    img, snd = png(90, 60), wav(0.3, 16000)
    p = processor("look <|unused_200054|> and hear <|unused_200053|>.", [img], [snd])
    assert int((p.input_ids == c.image_token_id).sum()) == p.pixel_values[0].shape[0]
    assert int((p.input_ids == c.audio_token_id).sum()) == p.audio_levels[0].shape[0] == 6
    with pytest.raises(ProcessingError, match="1 image placeholders .* for 2 images"):
        processor("one <|unused_200054|>", [img, img])
    with pytest.raises(ProcessingError, match="cannot decode image"):
        processor("bad <|unused_200054|>", [b"not an image"])


@pytest.mark.parametrize(
    "size, mode",
    [((40, 40), "RGB"), ((50, 41), "RGB"), ((33, 77), "L"), ((64, 80), "RGBA"), ((2100, 700), "RGB")],
)
def test_image_processor_equals_transformers(size, mode):
    """Bit for bit without the upscale; with it, Pillow's LANCZOS (ours, the original model's) and
    torchvision's differ by up to 2 intensity levels, 0.03 after normalisation. Below torchvision 0.27
    transformers itself falls back to BICUBIC for the upscale (it warns so): not compared there.

    transformers' image processor needs torchvision, which the CPU venv cannot hold: the one wheel for
    its torch 2.13 here is a CUDA build whose import fails, and transformers then fails to import its
    Inkling model too. So this runs where torchvision is (the GPU host; a venv of torch 2.14.1 with
    torchvision 0.29.1)."""
    from packaging.version import Version

    torchvision = pytest.importorskip("torchvision")
    lanczos = Version(torchvision.__version__.split("+")[0]) >= Version("0.27")
    rng = np.random.default_rng(0)
    h, w = size
    arr = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    img = Image.fromarray(arr.squeeze(-1) if mode == "L" else arr, mode)
    for frac in (None, 2.0) if lanczos else (None,):
        want = transformers.InklingImageProcessor(rescale_image_frac=frac)(images=[img], return_tensors="pt")[
            "pixel_values"
        ]
        from inkling.published.processing import to_rgb

        got = image_pixel_values(to_rgb(img), PreprocessorSettings(rescale_image_frac=frac))
        assert got.shape == want.shape
        if frac is None or max(h, w) >= 2048:
            assert torch.equal(got, want)
        else:
            assert float((got - want).abs().max()) < 0.05


def test_flac_mp3_and_ogg_decode_as_their_wav(processor):
    """FLAC is lossless: its levels equal the WAV's; MP3 and Ogg are lossy: the same length and a close
    waveform. Broken or unknown bytes are clear errors."""
    sf = pytest.importorskip("soundfile")
    from inkling.processing.audio import load_audio, load_wav

    data = wav(0.7, 44100, channels=2)
    samples, rate = load_wav(data)
    stereo = (
        np.frombuffer(data[44:], dtype="<i2").reshape(-1, 2) / 32768
    )  # soundfile scales int16 MP3 input oddly

    def encoded(fmt: str, subtype: str | None = None) -> bytes:
        buf = io.BytesIO()
        sf.write(buf, stereo, 44100, format=fmt, subtype=subtype)
        return buf.getvalue()

    flac = encoded("FLAC", "PCM_16")
    got, got_rate = load_audio(flac)
    assert got_rate == rate and np.array_equal(got, samples)
    assert torch.equal(processor.audio(flac), processor.audio(data))
    for fmt, subtype in (("MP3", None), ("OGG", "VORBIS")):
        lossy, lossy_rate = load_audio(encoded(fmt, subtype))
        assert lossy_rate == rate
        assert abs(len(lossy) - len(samples)) <= 0.05 * rate  # encoder padding only
        n = min(len(lossy), len(samples)) - 3000
        best = max(np.corrcoef(lossy[k : k + n], samples[:n])[0, 1] for k in range(3000))  # the codec's delay
        assert best > 0.95, (fmt, best)
        assert abs(processor.audio(encoded(fmt, subtype)).shape[0] - processor.audio(data).shape[0]) <= 1
    with pytest.raises(ProcessingError, match="cannot decode FLAC"):
        load_audio(flac[:40])
    with pytest.raises(ProcessingError, match="limit of 0.5 s"):
        load_audio(flac, max_seconds=0.5)

"""The real Inkling's vision tower and audio embedding equal transformers' modules, float32."""

from __future__ import annotations

import pytest
import torch

from inkling.published.checkpoint import PublishedCheckpoint
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from inkling.published.towers import AudioEmbedding, VisionTower

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("towers") / "tiny", preset("inkling-tiny"), seed=2)
    with PublishedCheckpoint(d) as ckpt:
        weights = {
            n: ckpt.get(n).float() for n in ckpt.keys() if n.startswith(("model.visual.", "model.audio."))
        }
    hf = transformers.InklingForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    return weights, hf


def test_vision_tower_equals_transformers(tiny):
    weights, hf = tiny
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(5, 2, 40, 40, 3, generator=g)
    pixels[:, 1] = pixels[:, 0]  # the processor duplicates each patch in time
    with torch.no_grad():
        want = hf.model.get_image_features(pixels, return_dict=True).pooler_output.reshape(5, -1)
        got = VisionTower(preset("inkling-tiny"))(weights, pixels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each patch alone: no mixing between patches
    torch.testing.assert_close(
        VisionTower(preset("inkling-tiny"))(weights, pixels[2:3]), got[2:3], rtol=1e-5, atol=1e-5
    )


def test_audio_embedding_equals_transformers(tiny):
    weights, hf = tiny
    levels = torch.randint(0, 16, (2, 7, 80), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False  # a shorter second clip: only its valid frames are embedded
    with torch.no_grad():
        want = hf.model.get_audio_features(levels, mask).last_hidden_state
        got = AudioEmbedding(preset("inkling-tiny"))(weights, levels[mask])
    assert got.shape == (11, preset("inkling-tiny").hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

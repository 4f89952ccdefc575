"""The GPU tests' shared checkpoint."""

from __future__ import annotations

import pytest

from inkling.published.config import preset
from inkling.published.synth import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """inkling-tiny in the published layout (BF16, seed 11)."""
    return write_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", preset("inkling-tiny"), seed=11)

"""Opening a checkpoint in the published layout, validated before any tensor is read.

    with PublishedCheckpoint(path) as ckpt:
        ckpt.config                 # inkling.published.config.InklingConfig (hf_quant_config.json included)
        ckpt.get("model.llm.embed.weight")

Checks config.json (and hf_quant_config.json), every shard's header and size, and that the tensors are
exactly `layout.checkpoint_tensors(config)` with their shapes and dtypes, naming the file and tensor of
whatever is wrong. A checkpoint without any `model.mtp.*` tensor (what transformers' `save_pretrained`
writes: it drops MTP on load) opens as one without MTP depths.
"""

from __future__ import annotations

import os

from ..checkpoint import CheckpointError, CheckpointReader
from .config import ConfigError, InklingConfig, MTPConfig
from .layout import checkpoint_tensors


class PublishedCheckpoint(CheckpointReader):
    def __init__(self, path: str | os.PathLike) -> None:  # noqa: D107 (the base class's checks, another layout)
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        try:
            config = InklingConfig.from_pretrained(self.path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from e
        self._info = self._read_headers()
        self.dropped_mtp = config.mtp.num_layers > 0 and not any(
            n.startswith("model.mtp.") for n in self._info
        )
        if self.dropped_mtp:
            config = config.replace(mtp=MTPConfig())
        self.config = config
        expected = checkpoint_tensors(config)
        self._check_against(expected)
        self._order = list(expected)
        self._handles: dict[str, int] = {}

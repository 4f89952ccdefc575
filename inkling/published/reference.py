"""transformers' InklingForConditionalGeneration on any published checkpoint: the numerical reference.

    model = reference_model(path)            # BF16 or NVFP4 checkpoint directory, float32 by default

A BF16 checkpoint loads as transformers loads it. transformers 5.23.0 refuses pre-quantized NVFP4, so an
NVFP4 checkpoint is first copied to a float32 one in the same layout, each quantized stack dequantized
(`convert.published.dequantize_stack`): the reference then computes with exactly the weights the engine's
NVFP4 experts stand for. That copy holds the whole model in float32: for small models (tests, the demo).
"""

from __future__ import annotations

import os
import tempfile

import torch

from ..checkpoint import ShardedWriter
from .checkpoint import PublishedCheckpoint
from .layout import checkpoint_tensors


def dequantized_copy(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the float32, unquantized twin of the NVFP4 checkpoint at `path` to `out`."""
    from convert.published import dequantize_stack

    with PublishedCheckpoint(path) as ckpt:
        config = ckpt.config.replace(quant=None, dtype="float32")
        config.save(out)
        for side in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
        ):
            if os.path.exists(os.path.join(path, side)):
                with open(os.path.join(path, side), "rb") as src, open(os.path.join(out, side), "wb") as dst:
                    dst.write(src.read())
        with ShardedWriter(out, checkpoint_tensors(config)) as writer:
            for name in checkpoint_tensors(config):
                if ckpt.dtype(name) == torch.uint8:
                    writer.write(
                        name, dequantize_stack(*(ckpt.get(name + s) for s in ("", ".scale", ".scale2")))
                    )
                else:
                    writer.write(name, ckpt.get(name).float())


def reference_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    import transformers

    path = os.fspath(path)
    with PublishedCheckpoint(path) as ckpt:
        quantized = ckpt.config.is_quantized
    if not quantized:
        return transformers.InklingForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    with tempfile.TemporaryDirectory(prefix="inkling-dequantized-") as tmp:
        dequantized_copy(path, tmp)
        return transformers.InklingForConditionalGeneration.from_pretrained(tmp, dtype=dtype).eval()

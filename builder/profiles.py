"""What every build shares: the build log with its timed phases, and the programs' dynamic dimensions
bounded by the BuildConfig (our optimization profiles)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch.export import Dim

from .config import BuildConfig

MAX_BLOCKS_DIM = 1 << 22


class BuildLog:
    def __init__(self, echo: bool = True):
        self.lines: list[str] = []
        self.echo = echo

    def __call__(self, msg: str) -> None:
        self.lines.append(msg)
        if self.echo:
            print(f"[build] {msg}", flush=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self(f"phase {name}: {time.perf_counter() - start:.2f} s")


def program_batch(bc: BuildConfig) -> int:
    """The largest batch the step and head programs take: max_batch_size sequences plus one, the padding
    sequence a CUDA-graph bucket adds beside a full batch (runtime/step_graphs.py)."""
    return bc.max_batch_size + 1


def export_dims(bc: BuildConfig) -> dict[str, Dim]:
    """The programs' dynamic dimensions (the contracts' names), bounded by the BuildConfig: our
    optimization profiles."""
    B = Dim("batch", min=1, max=program_batch(bc))
    return {
        "num_tokens": Dim("num_tokens", min=1, max=bc.max_num_tokens),
        "batch": B,
        "batch+1": B + 1,
        "num_logits": Dim("num_logits", min=1, max=bc.max_num_tokens),
        "num_mm": Dim("num_mm", min=1, max=bc.max_num_tokens + 1),
        "num_blocks": Dim("num_blocks", min=2, max=MAX_BLOCKS_DIM),
        "max_q": Dim("max_q", min=1, max=bc.max_num_tokens),
    }

"""`--compile`: the step program compiled at build time, its compiler cache artifacts carried by the engine."""

from __future__ import annotations

import io
from collections.abc import Callable

import torch

from .engine import Engine
from .profiles import BuildLog


def compile_step(engine: Engine, example: Callable[[int, int], dict]) -> bytes | None:
    """torch.compile the step program on example inputs of the shapes a runtime meets first (a prefill
    of one and of two sequences, a decode step of one and of two; sizes 1 specialise the compiled code)
    and return the compiler's cache artifacts, which the engine carries to every load. example(num_seqs,
    q) -> the step's inputs but its weights, by name."""
    bc = engine.build_config
    device = torch.device(bc.device)
    # Compile the program as a load will see it (after save and load), so the cache keys match.
    buf = io.BytesIO()
    torch.export.save(engine.programs["step"], buf)
    buf.seek(0)
    step = torch.compile(torch.export.load(buf).module(), dynamic=True)
    # Sorted: the runtime hands the compiled graph its weights sorted by name (runtime/model_runner.py).
    weights = {k: engine.weights[k].to(device) for k in sorted(engine.weights) if not k.startswith("mtp.")}
    prefill = max(2, min(19, bc.max_num_tokens // 2, bc.max_seq_len))
    with torch.no_grad():
        for num_seqs, q in ((2, prefill), (2, 1), (1, prefill), (1, 1)):
            step(weights, *example(num_seqs, q).values())
    artifacts = torch.compiler.save_cache_artifacts()
    return None if artifacts is None else artifacts[0]


def compile_into(engine: Engine, example: Callable[[int, int], dict], log: BuildLog) -> None:
    """The build's compile phase: the step compiled on `example`'s shapes, its artifacts in the engine."""
    with log.phase("compile"):
        engine.compile_cache = compile_step(engine, example)
        log(f"compiler cache artifacts: {len(engine.compile_cache or b'') / 1e6:.2f} MB")

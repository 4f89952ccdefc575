"""Shared fixtures: synthetic tiny checkpoints, written once per test session.

Without a GPU, Triton kernels run in the CPU interpreter. Triton 3.6 picks interpreted or compiled
when a `@triton.jit` function is *defined*, so TRITON_INTERPRET is set here, in the root conftest,
before any test module imports a plugin's kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from inkling.synth import synthesize

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`python -m inkling.synth --preset inkling-tiny --seed 0`: the bf16 tiny checkpoint (read-only)."""
    out = tmp_path_factory.mktemp("ckpt") / "inkling-tiny"
    synthesize(out, "inkling-tiny", TINY_SEED)
    return str(out)


@pytest.fixture(scope="session")
def tiny_nvfp4_ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same with `--nvfp4`: routed experts in the NVFP4 layout of INKLING_SPEC §9 (read-only)."""
    out = tmp_path_factory.mktemp("ckpt") / "inkling-tiny-nvfp4"
    synthesize(out, "inkling-tiny", TINY_SEED, nvfp4=True)
    return str(out)

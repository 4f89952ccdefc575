"""Shared helpers for the Triton tier of the plugins."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # a CPU install without triton: the reference impls still work
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), as in CI."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_run_triton(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on this tensor's device here."""
    return HAS_TRITON and (t.is_cuda or interpreting())

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


# The longest CPU cases, run by `make test-slow` rather than in CI's `make test` (2 cores, 20 minutes):
# each has a faster sibling in CI that covers the same code path (as measured: `pytest --durations`).
SLOW = {
    # torch.compile of the earlier model's step on the CPU (125 s); the compiled GPU path is
    # tests/gpu, and eager equals the reference in CI
    "tests/e2e/test_engine.py::test_compiled_engine_equals_eager",
    # the Triton interpreter on 9-token MoE decode tiles (50-73 s each); T = 1, 2, 3 and a 9-token case
    # with 4-row blocks stay in CI
    "tests/kernels/test_moe.py::test_triton_bd_matches_reference[9-2-128-1.0-True-False-False-False]",
    "tests/kernels/test_moe.py::test_triton_bd_matches_reference[9-2-128-1.0-False-False-True-True]",
    "tests/kernels/test_moe.py::test_triton_gemv_matches_reference[9-triton-4]",
    # 21-23 s each in the interpreter; chunk-1 and chunk-3-64x64-clipped cover the chunked shear in CI
    "tests/kernels/test_attention.py::test_split_kv[chunk-3-split-clipped]",
    "tests/kernels/test_attention.py::test_split_kv[chunk-4-sliding-split]",
    "tests/kernels/test_attention.py::test_split_kv[chunk-4-sliding-split-all-masked]",
    "tests/kernels/test_attention.py::test_bfloat16_relative_table[chunk]",
    # benchmark scripts' smoke runs of the load and tensor-parallel benches (18 and 15 s)
    "tests/e2e/test_bench_smoke.py::test_load_benchmark_smoke",
    "tests/e2e/test_bench_smoke.py::test_tp_benchmark_smoke",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)

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

from inkling.published.config import preset
from inkling.published.synth import write_checkpoint

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`python -m inkling.published.synth --preset inkling-tiny --seed 0`: a BF16 checkpoint in the published
    layout with its trained toy tokenizer (read-only); the NVFP4 one the engines build from is
    tests/e2e/conftest.py's."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "inkling-tiny", preset("inkling-tiny"), TINY_SEED
    )


# The longest CPU cases, run by `make test-slow` rather than in CI's `make test` (2 cores, 20 minutes):
# each has a faster sibling in CI that covers the same code path (as measured: `pytest --durations`).
SLOW = {
    # torch.compile of the step and the MTP depths on the CPU (80 s); eager equals transformers in CI
    "tests/e2e/test_engine.py::test_compiled_engine_equals_eager",
    # the Triton interpreter on multi-row MoE decode tiles (25-64 s each); the 1- to 3-token cases (every
    # kernel option among them, split K included) stay in CI
    "tests/kernels/test_moe.py::test_block_diagonal_decode[9-2-128-1.0-True-False-False-False-1-False]",
    "tests/kernels/test_moe.py::test_block_diagonal_decode[9-2-128-1.0-False-False-True-True-1-False]",
    "tests/kernels/test_moe.py::test_block_diagonal_decode[9-4-256-131072.0-True-True-True-False-1-False]",
    "tests/kernels/test_moe.py::test_block_diagonal_decode[3-4-64-131072.0-False-False-False-False-1-False]",
    "tests/kernels/test_moe.py::test_gemv[9-triton-4]",
    "tests/kernels/test_moe.py::test_gemv[3-torch-1]",
    # scale_w on 32-row blocks of 70 tokens (24 s); 33 rows on 16-row blocks (stacked, 2^17) and 5 rows
    # (split K, perm_a) stay in CI
    "tests/kernels/test_moe.py::test_scaled_weight_decode[70-rows-32]",
    # 13-20 s: every token on the same experts; test_default_tiles_match_the_math (70 tokens on 16 experts)
    # keeps crowded multi-row blocks in CI
    "tests/kernels/test_moe.py::test_every_token_on_the_same_experts",
    # 16-23 s each in the interpreter; the other split_kv cases (chunk-1 and chunk-3-64x64-clipped for the
    # chunked shear, scratch-shear and its 64x64 variant, the decode and verify GEMVs) stay in CI
    "tests/kernels/test_attention.py::test_split_kv[chunk-3-split-far]",
    "tests/kernels/test_attention.py::test_split_kv[chunk-4-sliding-split]",
    "tests/kernels/test_attention.py::test_split_kv[chunk-4-sliding-split-all-masked]",
    "tests/kernels/test_attention.py::test_split_kv[scratch-shear-sliding-split]",
    "tests/kernels/test_attention.py::test_split_kv[gather-no-far-test-sliding]",
    "tests/kernels/test_attention.py::test_split_kv[scratch-no-far-test]",
    "tests/kernels/test_attention.py::test_bfloat16_relative_table[chunk]",
    "tests/kernels/test_attention.py::test_probe_without_the_relative_term",
    # benchmark scripts' smoke runs (14-39 s; the GPU sessions run the scripts themselves): the MTP, host,
    # sm90 decode and tp benches' smoke runs stay in CI (bench.tp's needs GPUs that are seldom lent: its
    # JSON once broke unseen here)
    "tests/e2e/test_bench_smoke.py::test_load_benchmark_smoke",
    "tests/e2e/test_bench_smoke.py::test_e2e_benchmark_parts_and_merge",
    "tests/e2e/test_bench_smoke.py::test_sm90_moe_report_smoke",
    # ONNX export with external weights (18 s); the export with weights as inputs, through the CLI, stays in CI
    "tests/e2e/test_onnx_export.py::test_external_weights",
    # Triton serving variants that start servers of their own (20-26 s): `make serve`'s binding and stop,
    # and the engine on a stub thread; the module's server (engine in its own process) stays in CI
    "tests/e2e/test_serving.py::test_make_serve_binds_localhost_and_stops_cleanly",
    "tests/e2e/test_serving.py::test_engine_on_a_stub_thread_equals_in_process",
    # soaks (27-58 s): test_runtime's random soak with cancellations and the overlapped steps' equality test
    # stay in CI
    "tests/e2e/test_soak.py::test_short_requests_leave_nothing_behind",
    "tests/e2e/test_overlap.py::test_soak_with_overlap",
    # the Triton MoE on ep 4 shares (3-4 s each); the ep 2 shares, every block form, stay in CI
    "tests/kernels/test_sigmoid_moe.py::test_triton_on_an_expert_parallel_share[4-gemv]",
    "tests/kernels/test_sigmoid_moe.py::test_triton_on_an_expert_parallel_share[4-mma-16]",
    "tests/kernels/test_sigmoid_moe.py::test_triton_on_an_expert_parallel_share[4-mma-16-shared-torch]",
    # the ONNX graph's functional program against the engine's (20 s: a second re-trace of the program)
    "tests/e2e/test_onnx_export.py::test_functional_program_matches_in_place_program",
    # bench.long_context's smoke run (11 s); the GPU session runs the script itself
    "tests/e2e/test_bench_smoke.py::test_long_context_benchmark_smoke",
    # tensor parallelism over gloo (16-24 s): Triton serving of a tp 2 engine; the tp 2
    # LLM's tokens and logits against tp 1 stay in CI
    "tests/e2e/test_tp.py::test_triton_serves_a_tp2_engine",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    # A renamed test or parameter would drop out of SLOW silently and run in CI again (it did once, with
    # 270 s of interpreter cases): every entry of a collected file must name a collected test. (A run that
    # names single tests, path::test, collects only those: nothing to check there.)
    if any("::" in arg for arg in config.args):
        return
    ids = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in ids}
    stale = sorted(s for s in SLOW if s.split("::")[0] in files and s not in ids)
    if stale:
        raise pytest.UsageError("tests/conftest.py SLOW names tests that do not exist: " + ", ".join(stale))

"""The engine as an artifact (the real Inkling's tiny NVFP4 engine): reloaded in a fresh process, self-describing,
refused with a clear error when damaged, compiled. Its numbers against transformers are
tests/e2e/test_published_engine.py's and test_published_step.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from builder import ENGINE_FORMAT_VERSION, BuildConfig, Engine, EngineError, build

from ..engine_runner import EngineRunner
from ..hooks import override_drafts
from .conftest import SMALL


def test_engine_reloaded_in_a_fresh_process_gives_the_same_logits(engine_f32, prompts, tmp_path):
    engine, path = engine_f32
    _, logits = EngineRunner(engine).generate(prompts[:2], 2, return_logits=True)
    script = (
        "import sys, torch; from builder import Engine; from tests.engine_runner import EngineRunner\n"
        "from inkling.published.processing import Prompt\n"
        "ids = torch.load(sys.argv[2])\n"
        "_, logits = EngineRunner(Engine.from_dir(sys.argv[1])).generate([Prompt(i) for i in ids], 2, return_logits=True)\n"
        "torch.save(logits, sys.argv[3])\n"
    )
    torch.save([p.input_ids for p in prompts[:2]], tmp_path / "ids.pt")
    subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        check=True,
    )
    for a, b in zip(logits, torch.load(tmp_path / "out.pt")):
        assert torch.equal(a, b)


def test_runner_weights_are_in_one_order_whatever_their_source(engine_f32):
    """torch.compile's graph takes the weights in the dict's order and its FX graph cache keys on it: the
    build (weights in memory, arrangement order) and a load (the safetensors file's order) must hand the
    program the same order, or the compiler cache the engine carries misses (measured: it did)."""
    engine, path = engine_f32
    loaded = Engine.from_dir(path)
    assert list(engine.weights) != list(loaded.weights)  # the two sources do order them differently
    assert (
        list(EngineRunner(engine).weights)
        == list(EngineRunner(loaded).weights)
        == sorted(k for k in engine.weights if not k.startswith("mtp."))
    )


def test_engine_is_self_describing(engine_f32):
    _, path = engine_f32
    config = json.loads((path / "config.json").read_text())
    assert (
        config["version"] == ENGINE_FORMAT_VERSION
        and config["device"] == "cpu"
        and config["dtype"] == "float32"
    )
    assert (
        config["model_type"] == "inkling_mm_model"
        and config["plugin_config"]["ops"]["bank_attention"]["version"] == 2
    )
    assert config["quantization"]["quantization"]["quant_algo"] == "NVFP4"
    assert set(config["files"]) >= {"rank0.safetensors", "rank0.step.pt2", "tokenizer.json"}
    assert "phase export" in (path / "build.log").read_text()


def _copy(path, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(path, dst)
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: _edit_config(p, version=99), "format version 99"),
        (lambda p: _edit_config(p, model_type="inkling"), "earlier, invented model, which is retired"),
        (
            lambda p: _edit_config(p, plugin_config__ops__bank_attention__version=0),
            "plugin bank_attention version 0",
        ),
        (
            lambda p: _edit_config(p, plugin_config__ops__sigmoid_sink_moe__weight_layout_version=7),
            "weight layout 7",
        ),
        (lambda p: _edit_config(p, device="cuda"), "built for cuda"),
        (lambda p: (p / "rank0.step.pt2").unlink(), "missing rank0.step.pt2"),
        (lambda p: (p / "config.json").unlink(), "no config.json"),
        (lambda p: (p / "config.json").write_text("{"), "corrupt"),
        (lambda p: os.truncate(p / "rank0.safetensors", 100), "truncated"),
        (lambda p: _flip_byte(p / "rank0.safetensors"), "sha256 mismatch"),
    ],
)
def test_load_time_errors(engine_f32, tmp_path, damage, message):
    path = _copy(engine_f32[1], tmp_path)
    damage(path)
    with pytest.raises(EngineError, match=message):
        Engine.from_dir(path, device="cpu")


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_cuda_engine_refused_without_cuda(engine_f32, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EngineError, match="cannot run on cuda|no CUDA device"):
        Engine.from_dir(engine_f32[1], device="cuda")


def test_save_refuses_to_overwrite(engine_f32):
    engine, path = engine_f32
    with pytest.raises(EngineError, match="exists"):
        engine.save(path)


def test_compiled_engine_equals_eager(pub_ckpt_dir, engine_f32, prompts, tmp_path):
    """--compile: the step program compiled at build (its cache artifacts saved in the engine) and at
    load gives the eager engine's tokens and logits."""
    eager_out, eager_logits = EngineRunner(engine_f32[0]).generate(prompts[:2], 3, return_logits=True)
    engine = build(pub_ckpt_dir, BuildConfig(dtype="float32", compile=True, **SMALL), echo=False)
    assert engine.compile_cache and "phase compile" in "\n".join(engine.build_log)
    engine.save(tmp_path / "compiled")
    loaded = Engine.from_dir(tmp_path / "compiled")
    assert loaded.compile_cache == engine.compile_cache
    out, logits = EngineRunner(loaded).generate(prompts[:2], 3, return_logits=True)
    assert out == eager_out
    for a, b in zip(logits, eager_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    # The MTP depths' programs are compiled too: their drafts of every round equal the eager engine's.
    from runtime import LLMEngine, PromptInput, SamplingParams

    def drafts_of(engine) -> list[list[int]]:
        eng, seen = LLMEngine(engine), []
        override_drafts(eng, lambda rid, tokens, drafts: seen.append(list(drafts)) or drafts)
        eng.add_request(
            "r",
            PromptInput(prompts[0].input_ids),
            SamplingParams(max_tokens=6, ignore_eos=True, num_draft_tokens=3),
        )
        while eng.has_unfinished():
            eng.step()
        # a torch.compile'd module wraps each depth kind's program
        return seen, all(hasattr(p, "_orig_mod") for p in eng.runner.head.programs.values())

    compiled, is_compiled = drafts_of(loaded)
    eager, is_eager_compiled = drafts_of(engine_f32[0])
    assert is_compiled and not is_eager_compiled
    assert compiled and compiled == eager

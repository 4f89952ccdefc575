"""The NVFP4 converter (INKLING_SPEC §9): layout, ModelOpt equality, copies, configs, calibration, errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from convert import ConvertError, convert
from convert.calibrate import input_scales
from convert.cli import main as convert_main
from convert.quantize import ExpertQuantizer
from inkling import nvfp4
from inkling.checkpoint import INDEX_FILE, CheckpointError, CheckpointReader
from inkling.tensors import NVFP4_EXCLUDE_MODULES, PROJS, is_excluded, routed_expert_module
from inkling.tokenizer import load_tokenizer

NVFP4QTensor = pytest.importorskip("modelopt.torch.quantization.qtensor").NVFP4QTensor

CALIB_TEXT = "a"  # <|bos|> plus one token: 6 of 16 experts per layer are reached, the rest are not
SIDE_FILES = ("tokenizer.json", "generation_config.json")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _routed_modules(reader: CheckpointReader) -> list[str]:
    c = reader.config
    return [
        f"model.layers.{i}.mlp.experts.{e}.{p}"
        for i in range(c.num_hidden_layers)
        for e in range(c.num_routed_experts)
        for p in PROJS
    ]


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CALIB_TEXT + "\n\n")
    return str(path)


@pytest.fixture(scope="module")
def calibrated_dir(tiny_ckpt_dir: str, calib_file: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Through the Python API: calibrated, two quantizing threads."""
    out = str(tmp_path_factory.mktemp("convert") / "tiny-nvfp4")
    result = convert(tiny_ckpt_dir, out, quant="nvfp4", calib=4, calib_data=calib_file, workers=2)
    assert result.calibrated and result.num_quantized == len(_routed_modules(CheckpointReader(tiny_ckpt_dir)))
    return out


@pytest.fixture(scope="module")
def uncalibrated_dir(tiny_ckpt_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Through the CLI: --calib 0, one thread, several shards."""
    out = str(tmp_path_factory.mktemp("convert") / "tiny-nvfp4-nocalib")
    args = ["--model_dir", tiny_ckpt_dir, "--output_dir", out, "--quant", "nvfp4", "--calib", "0"]
    assert convert_main([*args, "--workers", "1", "--max_shard_size", "4MB", "--no_progress"]) == 0
    return out


# The format.


def test_packed_layout_dtypes_and_shapes(tiny_ckpt_dir: str, calibrated_dir: str) -> None:
    src, out = (
        CheckpointReader(tiny_ckpt_dir),
        CheckpointReader(calibrated_dir),
    )  # the reader checks the plan too
    for module in _routed_modules(src):
        n_out, n_in = src.shape(f"{module}.weight")
        assert out.dtype(f"{module}.weight") == torch.uint8 and out.shape(f"{module}.weight") == (
            n_out,
            n_in // 2,
        )
        assert out.dtype(f"{module}.weight_scale") == torch.float8_e4m3fn
        assert out.shape(f"{module}.weight_scale") == (n_out, n_in // 16)
        for scalar in ("weight_scale_2", "input_scale"):
            assert out.dtype(f"{module}.{scalar}") == torch.float32 and out.shape(f"{module}.{scalar}") == ()
        # Each linear has its own global scale: amax(|W|) / (6 * 448).
        expected = src.get(f"{module}.weight").abs().amax().float() / (6.0 * 448.0)
        assert torch.equal(out.get(f"{module}.weight_scale_2"), expected)


def test_nibble_order_and_code_layout() -> None:
    # One block: column 0 is the amax (6 -> code 7), column 1 is -1 (code 8|2), column 2 is 0.5 (code 1).
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -1.0, 0.5
    weight, weight_scale, weight_scale_2 = nvfp4.quantize(w)
    assert weight[0, 0].item() == (0xA << 4) | 0x7  # low nibble = even column
    assert weight[0, 1].item() == 0x1
    assert weight_scale.float().item() == 448.0 and weight_scale_2.item() == pytest.approx(6.0 / 2688.0)
    assert torch.equal(nvfp4.unpack_codes(weight)[0, :3], torch.tensor([7, 10, 1], dtype=torch.uint8))
    assert torch.equal(nvfp4.pack_codes(nvfp4.unpack_codes(weight)), weight)


def _hard_weights(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g)
    w[3, 16:32] = 0.0  # a zero block
    w[5] = 0.0  # a zero row
    w[7, 40] = 300.0  # a large outlier: its block saturates, the global scale grows
    w[9, 64:80] *= 1e-6  # a block far below the others: its fp8 scale clamps at 2**-9
    w[11, 100:116] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 2)  # rounding ties
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_dequantize_match_modelopt_bit_for_bit(dtype: torch.dtype) -> None:
    w = _hard_weights(dtype)
    qtensor, ref_scale, ref_scale_2 = NVFP4QTensor.quantize(w, 16)
    for quantize in (nvfp4.quantize, ExpertQuantizer(1), ExpertQuantizer(2)):
        weight, weight_scale, weight_scale_2 = quantize(w)
        assert torch.equal(weight, qtensor._quantized_data)
        assert torch.equal(_bits(weight_scale), _bits(ref_scale))
        assert torch.equal(weight_scale_2, ref_scale_2.float().reshape(()))
    kwargs = {"scale": ref_scale, "double_scale": ref_scale_2, "block_sizes": {-1: 16}}
    for out_dtype in (torch.float32, torch.bfloat16):
        ours = nvfp4.dequantize(weight, weight_scale, weight_scale_2, dtype=out_dtype)
        theirs = qtensor.dequantize(dtype=out_dtype, **kwargs)
        assert ours.dtype == out_dtype and torch.equal(_bits(ours), _bits(theirs))
    assert (nvfp4.dequantize(weight, weight_scale, weight_scale_2)[3, 16:32] == 0).all()


def test_all_zero_weight_quantizes_to_zero() -> None:
    weight, weight_scale, weight_scale_2 = nvfp4.quantize(torch.zeros(4, 32))
    assert weight_scale_2.item() == 0.0 and (weight == 0).all() and (weight_scale.float() == 1.0).all()
    assert (nvfp4.dequantize(weight, weight_scale, weight_scale_2) == 0).all()


def test_relative_error_on_gaussian_weights() -> None:
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    err = (nvfp4.dequantize(*nvfp4.quantize(w)) - w).norm() / w.norm()
    print(f"NVFP4 relative weight error on N(0,1) weights: {err:.4f}")
    assert err <= 0.12


def test_converted_experts_are_close_to_the_input(tiny_ckpt_dir: str, calibrated_dir: str) -> None:
    src, out = CheckpointReader(tiny_ckpt_dir), CheckpointReader(calibrated_dir)
    worst = 0.0
    for module in _routed_modules(src):
        w = src.get(f"{module}.weight").float()
        wq = nvfp4.dequantize(
            *(out.get(f"{module}.{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
        )
        worst = max(worst, float((wq - w).norm() / w.norm()))
    print(f"worst relative weight error over the tiny model's experts: {worst:.4f}")
    assert worst <= 0.12


def test_nvfp4_linear() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    lin = nvfp4.NVFP4Linear.from_weight(w, input_scale=torch.tensor(0.5))
    assert list(lin.state_dict()) == ["weight", "weight_scale", "weight_scale_2", "input_scale"]
    dense = nvfp4.dequantize(lin.weight, lin.weight_scale, lin.weight_scale_2)
    assert torch.equal(lin(x), x @ dense.T)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    cached = nvfp4.NVFP4Linear(64, 32, cache=True)
    cached.load_state_dict(lin.state_dict())
    assert torch.equal(cached(x), lin(x)) and torch.equal(cached(x), lin(x))
    cached.weight = torch.zeros_like(cached.weight)  # a new buffer invalidates the cache
    assert (cached(x) == 0).all()


# Everything else is copied.


def test_non_expert_tensors_bit_identical(tiny_ckpt_dir: str, calibrated_dir: str) -> None:
    src, out = CheckpointReader(tiny_ckpt_dir), CheckpointReader(calibrated_dir)
    copied = [n for n in src.keys() if routed_expert_module(n) is None]
    assert len(copied) > 100
    for name in copied:
        a, b = src.get(name), out.get(name)
        assert b.dtype == torch.bfloat16 and b.shape == a.shape and torch.equal(_bits(a), _bits(b)), name


def test_quantization_config_files(tiny_ckpt_dir: str, calibrated_dir: str, uncalibrated_dir: str) -> None:
    import modelopt

    with open(os.path.join(tiny_ckpt_dir, "config.json")) as f:
        src_config = json.load(f)
    for out, calibrated in ((calibrated_dir, True), (uncalibrated_dir, False)):
        quantization = {
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "calibrated": calibrated,
            "exclude_modules": list(NVFP4_EXCLUDE_MODULES),
        }
        with open(os.path.join(out, "hf_quant_config.json")) as f:
            assert json.load(f) == {
                "producer": {"name": "modelopt", "version": modelopt.__version__},
                "quantization": quantization,
            }
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        assert config.pop("quantization_config") == {"quant_method": "modelopt", **quantization}
        assert config == src_config  # every other field unchanged
        for name in SIDE_FILES:
            with open(os.path.join(tiny_ckpt_dir, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
                assert a.read() == b.read(), name


def test_exclude_patterns_match_exactly_the_bf16_linears(calibrated_dir: str) -> None:
    reader = CheckpointReader(calibrated_dir)
    patterns = reader.config.quantization_config["exclude_modules"]
    quantized = {n.rsplit(".", 1)[0] for n in reader.keys() if n.endswith(".weight_scale")}
    bf16_linears = {  # 2-D weights except the depthwise convolutions, which are no linears
        n.rsplit(".", 1)[0]
        for n in reader.keys()
        if n.endswith(".weight") and ".sconv_" not in n and len(reader.shape(n)) == 2
    } - quantized
    assert quantized == set(_routed_modules(reader))
    assert "lm_head" in bf16_linears and "model.layers.0.mlp.shared_experts.0.up_proj" in bf16_linears
    assert [m for m in bf16_linears if not is_excluded(m, patterns)] == []
    assert [m for m in quantized if is_excluded(m, patterns)] == []


def test_manifest_matches_files(calibrated_dir: str, uncalibrated_dir: str) -> None:
    for out in (calibrated_dir, uncalibrated_dir):
        with open(os.path.join(out, "manifest.json")) as f:
            manifest = json.load(f)
        assert set(manifest) == set(os.listdir(out)) - {"manifest.json"}
        for name, entry in manifest.items():
            with open(os.path.join(out, name), "rb") as f:
                data = f.read()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    with open(os.path.join(uncalibrated_dir, INDEX_FILE)) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1  # --max_shard_size 4MB made shards


def test_threads_and_shards_do_not_change_the_codes(calibrated_dir: str, uncalibrated_dir: str) -> None:
    a, b = CheckpointReader(calibrated_dir), CheckpointReader(uncalibrated_dir)
    for name in a.keys():
        if not name.endswith("input_scale"):
            assert torch.equal(_bits(a.get(name)), _bits(b.get(name))), name


# Calibration.


@torch.no_grad()
def test_input_scale_is_recorded_amax_over_6x448(tiny_ckpt_dir: str, calibrated_dir: str) -> None:
    from inkling.model import InklingReference

    model = InklingReference.from_pretrained(tiny_ckpt_dir, dtype=torch.float32)
    config = model.config
    ids = torch.tensor([config.token_ids["bos"], *load_tokenizer(tiny_ckpt_dir).encode(CALIB_TEXT).ids])
    seen: dict[str, float] = {}
    modules = _routed_modules(CheckpointReader(tiny_ckpt_dir))
    hooks = [
        model.get_submodule(m).register_forward_pre_hook(
            lambda _mod, args, m=m: seen.__setitem__(m, max(seen.get(m, 0.0), args[0].abs().max().item()))
        )
        for m in modules
    ]
    model(ids)
    for h in hooks:
        h.remove()
    out = CheckpointReader(calibrated_dir)
    unreached = 0
    for i in range(config.num_hidden_layers):
        for proj in PROJS:
            names = [f"model.layers.{i}.mlp.experts.{e}.{proj}" for e in range(config.num_routed_experts)]
            expected = {
                n: torch.tensor(seen[n], dtype=torch.float32) / (6.0 * 448.0) for n in names if n in seen
            }
            assert 0 < len(expected) < len(names)
            layer_max = max(expected.values())
            for n in names:
                assert torch.equal(out.get(f"{n}.input_scale"), expected.get(n, layer_max)), n
                unreached += n not in expected
    assert unreached > 0


def test_unreached_experts_take_the_layer_max_per_projection() -> None:
    from inkling.config import preset

    config = preset("inkling-tiny", num_hidden_layers=1)
    p = "model.layers.0.mlp.experts"
    amax = {
        f"{p}.0.gate_proj": torch.tensor(2688.0),
        f"{p}.1.gate_proj": torch.tensor(5376.0),
        f"{p}.2.gate_proj": torch.tensor(0.0),  # all-zero inputs count as unreached
        f"{p}.0.up_proj": torch.tensor(26.88),
        f"{p}.3.down_proj": torch.tensor(268.8),
    }
    scales = input_scales(config, amax)
    assert scales[f"{p}.0.gate_proj"].item() == 1.0 and scales[f"{p}.1.gate_proj"].item() == 2.0
    assert scales[f"{p}.2.gate_proj"].item() == 2.0 and scales[f"{p}.15.gate_proj"].item() == 2.0
    assert all(scales[f"{p}.{e}.up_proj"].item() == pytest.approx(0.01) for e in range(16))
    assert all(scales[f"{p}.{e}.down_proj"].item() == pytest.approx(0.1) for e in range(16))
    with pytest.raises(ConvertError, match="reached no expert"):
        input_scales(config, {})


def test_calibration_prompts_start_with_bos_and_drop_media_placeholders(tiny_ckpt_dir: str) -> None:
    from convert.calibrate import calibration_prompts

    config = CheckpointReader(tiny_ckpt_dir).config
    text_ids = load_tokenizer(tiny_ckpt_dir).encode(CALIB_TEXT).ids
    (ids,) = calibration_prompts(tiny_ckpt_dir, config, [f"<|image_pad|>{CALIB_TEXT}<|audio|>"], 4)
    assert ids.tolist() == [config.token_ids["bos"], *text_ids]


def test_calib_0_writes_unit_input_scales(uncalibrated_dir: str) -> None:
    reader = CheckpointReader(uncalibrated_dir)
    assert reader.config.quantization_config["calibrated"] is False
    for module in _routed_modules(reader):
        assert torch.equal(reader.get(f"{module}.input_scale"), torch.tensor(1.0))


# The quantized model.


@torch.no_grad()
def test_quantized_logits_close_to_bf16(tiny_ckpt_dir: str, calibrated_dir: str) -> None:
    from inkling.model import InklingReference

    ref = InklingReference.from_pretrained(tiny_ckpt_dir, dtype=torch.float32)
    quant = InklingReference.from_pretrained(calibrated_dir, dtype=torch.float32)
    text = "The history of the printing press is a story of small improvements in ink and type."
    ids = torch.tensor([ref.config.token_ids["bos"], *load_tokenizer(tiny_ckpt_dir).encode(text).ids])
    logits, _ = ref(ids)
    qlogits, _ = quant(ids)
    rel = float((qlogits - logits).norm() / logits.norm())
    top1 = float((qlogits.argmax(-1) == logits.argmax(-1)).float().mean())
    print(
        f"NVFP4 tiny vs bf16 tiny, float32, {len(ids)} tokens: relative logit error {rel:.4f}, top-1 agreement {top1:.3f}"
    )
    assert rel < 0.1 and top1 >= 0.9  # measured: 0.039 and 1.0 (33 tokens)


# Errors.


def _copy(src: str, tmp_path, name: str = "ckpt") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _convert(src: str, out: str, **kwargs) -> None:
    convert(src, out, calib=0, workers=1, **kwargs)


def test_refuses_a_non_inkling_checkpoint(tiny_ckpt_dir: str, tmp_path, capsys) -> None:
    src = _copy(tiny_ckpt_dir, tmp_path)
    path = os.path.join(src, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["model_type"] = "llama"
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match="not an Inkling config"):
        _convert(src, str(tmp_path / "out"))
    assert convert_main(["--model_dir", src, "--output_dir", str(tmp_path / "out"), "--calib", "0"]) == 1
    assert "not an Inkling config" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_refuses_an_already_quantized_checkpoint(
    calibrated_dir: str, tiny_nvfp4_ckpt_dir: str, tmp_path
) -> None:
    for src in (calibrated_dir, tiny_nvfp4_ckpt_dir):
        with pytest.raises(ConvertError, match="already quantized"):
            _convert(src, str(tmp_path / "out"))
    # NVFP4 tensors under a config that does not say so.
    src = _copy(calibrated_dir, tmp_path)
    os.remove(os.path.join(src, "hf_quant_config.json"))
    path = os.path.join(src, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ConvertError, match="already quantized"):
        _convert(src, str(tmp_path / "out"))


def test_refuses_missing_or_truncated_shards(tiny_ckpt_dir: str, tmp_path) -> None:
    src = _copy(tiny_ckpt_dir, tmp_path)
    with open(os.path.join(src, INDEX_FILE)) as f:
        shard = os.path.join(src, sorted(set(json.load(f)["weight_map"].values()))[-1])
    os.truncate(shard, os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        _convert(src, str(tmp_path / "out"))
    os.remove(shard)
    with pytest.raises(CheckpointError, match="does not exist"):
        _convert(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_refuses_unknown_quant(tiny_ckpt_dir: str, tmp_path, capsys) -> None:
    with pytest.raises(ConvertError, match=r"unknown --quant 'int4'; expected one of \['nvfp4'\]"):
        convert(tiny_ckpt_dir, str(tmp_path / "out"), quant="int4")
    assert (
        convert_main(["--model_dir", tiny_ckpt_dir, "--output_dir", str(tmp_path / "o"), "--quant", "fp8"])
        == 1
    )
    assert "expected one of ['nvfp4']" in capsys.readouterr().err


def test_calibration_errors(tiny_ckpt_dir: str, tmp_path, monkeypatch) -> None:
    from convert import calibrate

    with pytest.raises(ConvertError, match="calib_data .* does not exist"):
        convert(tiny_ckpt_dir, str(tmp_path / "out"), calib=1, calib_data=str(tmp_path / "none.txt"))
    monkeypatch.setattr(calibrate, "available_memory_bytes", lambda: 10**6)
    with pytest.raises(ConvertError, match=r"needs about .* GB .* Use --calib 0"):
        convert(tiny_ckpt_dir, str(tmp_path / "out"), calib=1)
    assert not os.path.exists(tmp_path / "out")


def test_existing_output_needs_force(tiny_ckpt_dir: str, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ConvertError, match="already exists: pass --force"):
        _convert(tiny_ckpt_dir, str(out))
    assert (out / "stale.txt").exists()
    _convert(tiny_ckpt_dir, str(out), force=True)
    assert not (out / "stale.txt").exists() and CheckpointReader(str(out)).config.is_quantized
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp dir left behind
    with pytest.raises(ConvertError, match="would overwrite the input"):
        _convert(tiny_ckpt_dir, tiny_ckpt_dir, force=True)

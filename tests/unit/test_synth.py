"""The synthetic checkpoint tool, its tokenizer and the scale of the weights it draws."""

from __future__ import annotations

import json
import math

import pytest
import torch

from inkling.checkpoint import CheckpointReader
from inkling.config import SPECIAL_TOKENS
from inkling.synth import (
    hf_quant_config,
    iter_synthetic_tensors,
    main,
    nvfp4_quantization_config,
    synth_config,
    synthesize,
)
from inkling.tensors import NVFP4_EXCLUDE_MODULES, expected_tensors, nvfp4_tensors, routed_expert_module
from inkling.tokenizer import build_tokenizer, load_tokenizer, special_token_ids

# Tokenizer.


def test_tokenizer_is_deterministic():
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!  def f(x):\n\treturn x ** 2  # done",
        "日本語のテキストと中文字符，한국어",
        "emoji 🦀🎉 and a family 👩\u200d👩\u200d👧, e\u0301 combining",
        "  leading spaces and trailing  \n",
    ],
)
def test_tokenizer_round_trip(text):
    tok = build_tokenizer()
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_specials():
    tok = build_tokenizer()
    ids = special_token_ids(tok)
    assert list(ids) == list(SPECIAL_TOKENS)
    assert list(ids.values()) == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() == 1024
    assert tok.encode("hi").ids[0] != ids["bos"]  # nothing added by the tokenizer itself
    assert tok.encode("<|bos|>hi<|image|>").ids[0] == ids["bos"]
    assert tok.encode("<|bos|>hi<|image|>").ids[-1] == ids["image"]


# Configs.


def test_tiny_config_takes_the_tokenizer(tiny_ckpt_dir):
    config = CheckpointReader(tiny_ckpt_dir).config
    tok = load_tokenizer(tiny_ckpt_dir)
    assert tok.to_str() == build_tokenizer().to_str()
    assert config.vocab_size == tok.get_vocab_size()
    assert config.token_ids == special_token_ids(tok)
    assert config.quantization_config is None


def test_slice_configs():
    config, depth = synth_config("inkling-bench", layers=1, mtp_heads=0, nvfp4=True)
    assert depth == 6
    assert config.vocab_size == 200192 and config.num_hidden_layers == 1 and config.num_mtp_heads == 0
    assert config.layer_types == ("sliding_attention",)
    assert config.token_ids == special_token_ids(build_tokenizer())
    total = sum(math.prod(s) * d.itemsize for s, d in expected_tensors(config).values())
    assert 13e9 < total < 16e9
    config, _ = synth_config("inkling-tiny", layers=6)
    assert config.layer_types[5] == "full_attention"


# Determinism.


def _small_config(**kw):
    return synth_config("inkling-tiny", layers=1, mtp_heads=1, **kw)


def _bytes(tensors):
    return {name: t.reshape(-1).view(torch.uint8).clone() for name, t in tensors}


def test_same_seed_same_bytes_other_seed_other_bytes():
    config, depth = _small_config(nvfp4=True)
    a = _bytes(iter_synthetic_tensors(config, seed=3, residual_depth=depth))
    b = _bytes(iter_synthetic_tensors(config, seed=3, residual_depth=depth))
    c = _bytes(iter_synthetic_tensors(config, seed=4, residual_depth=depth))
    assert list(a) == list(expected_tensors(config))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert not torch.equal(a["mtp.0.eh_proj.weight"], c["mtp.0.eh_proj.weight"])


def test_slices_equal_the_full_model(tiny_ckpt_dir):
    """A tensor's bytes depend only on (seed, name): not on --layers, --mtp-heads or the order."""
    small, depth = synth_config("inkling-tiny", layers=2, mtp_heads=1)
    sliced = _bytes(iter_synthetic_tensors(small, seed=0, residual_depth=depth))
    with CheckpointReader(tiny_ckpt_dir) as full:
        for name, data in sliced.items():
            assert torch.equal(full.get(name).reshape(-1).view(torch.uint8), data), name


def test_nvfp4_and_bf16_share_the_other_tensors(tiny_ckpt_dir, tiny_nvfp4_ckpt_dir):
    with CheckpointReader(tiny_ckpt_dir) as bf16, CheckpointReader(tiny_nvfp4_ckpt_dir) as fp4:
        for name in bf16.keys():
            if routed_expert_module(name) is None:
                assert torch.equal(bf16.get(name), fp4.get(name)), name


# The tool.


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        synthesize(out, layers=1, mtp_heads=0)
    assert (out / "keep.txt").read_text() == "mine"
    main(["--out", str(out), "--layers", "1", "--mtp-heads", "0", "--force", "--seed", "1"])
    assert "peak RSS" in capsys.readouterr().out
    assert not (out / "keep.txt").exists()
    assert CheckpointReader(out).config.num_hidden_layers == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dir left beside it


# NVFP4.

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _dequant(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """§9: low nibble = even column; W = E2M1[code] * (float32(scale) * scale_2)."""
    values = torch.stack([E2M1[(codes & 0xF).long()], E2M1[(codes >> 4).long()]], dim=-1).flatten(-2)
    block = (scale.float() * scale_2.float()).repeat_interleave(16, dim=-1)
    return values * block


def test_nvfp4_layout(tiny_nvfp4_ckpt_dir):
    reader = CheckpointReader(tiny_nvfp4_ckpt_dir)
    config = reader.config
    assert config.quantization_config == nvfp4_quantization_config()
    assert config.quantization_config == {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "calibrated": False,
        "exclude_modules": list(NVFP4_EXCLUDE_MODULES),
    }
    with open(f"{tiny_nvfp4_ckpt_dir}/hf_quant_config.json") as f:
        hf = json.load(f)
    assert hf == hf_quant_config(config.quantization_config)
    assert hf["producer"] == {"name": "modelopt", "version": "0.47.0"}
    assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["calibrated"] is False
    H, I = config.hidden_size, config.moe_intermediate_size
    module = "model.layers.2.mlp.experts.5.down_proj"
    expected = [f"{module}.{s}" for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")]
    assert [n for n, _, _ in nvfp4_tensors(module, (H, I))] == expected
    assert reader.shape(f"{module}.weight") == (H, I // 2) and reader.dtype(f"{module}.weight") == torch.uint8
    assert reader.shape(f"{module}.weight_scale") == (H, I // 16)
    assert reader.dtype(f"{module}.weight_scale") == torch.float8_e4m3fn
    assert (
        reader.shape(f"{module}.weight_scale_2") == ()
        and reader.dtype(f"{module}.weight_scale_2") == torch.float32
    )
    assert reader.get(f"{module}.input_scale").item() == 1.0
    assert reader.dtype("model.layers.2.mlp.shared_experts.1.down_proj.weight") == torch.bfloat16


def test_nvfp4_dequantized_std_matches_bf16(tiny_ckpt_dir, tiny_nvfp4_ckpt_dir):
    with CheckpointReader(tiny_ckpt_dir) as bf16, CheckpointReader(tiny_nvfp4_ckpt_dir) as fp4:
        for layer in (0, 5):
            for e in (0, 15):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    m = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    scale_2 = fp4.get(f"{m}.weight_scale_2")
                    w = _dequant(fp4.get(f"{m}.weight"), fp4.get(f"{m}.weight_scale"), scale_2)
                    ref = bf16.get(f"{m}.weight").float()
                    assert w.shape == ref.shape
                    assert w.mean().abs() < 0.1 * ref.std()
                    assert w.std() == pytest.approx(ref.std().item(), rel=0.1), m
                    # ModelOpt's convention: weight_scale_2 = amax / (6 * 448), block scales ≤ 448.
                    assert w.abs().max() <= 6 * 448 * scale_2 * (1 + 1e-6)
                    assert w.abs().max() >= 0.5 * 6 * 448 * scale_2


# Scale of the activations in the reference model.


def test_tiny_model_activations_are_order_one(tiny_ckpt_dir):
    from inkling.model import InklingReference

    model = InklingReference.from_pretrained(tiny_ckpt_dir, dtype=torch.float32)
    tok = load_tokenizer(tiny_ckpt_dir)
    text = "def area(r):\n    return 3.14159 * r * r  # the quick brown fox jumps over the lazy dog. " * 2
    ids = torch.tensor([model.config.token_ids["bos"], *tok.encode(text).ids])
    rms = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: rms.append(out.pow(2).mean(-1).sqrt()))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        logits, hidden = model(ids)
    for h in hooks:
        h.remove()
    assert len(rms) == model.config.num_hidden_layers
    for i, r in enumerate(rms):
        assert torch.isfinite(r).all() and 0.1 < r.min() and r.max() < 10, (
            f"layer {i}: rms {r.min()}..{r.max()}"
        )
    assert torch.isfinite(logits).all()
    spread = logits.std(-1)
    assert 0.3 < spread.min() and spread.max() < 30
    assert logits.argmax(-1).unique().numel() > 1

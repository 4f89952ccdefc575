"""The real Inkling's config, checkpoint layout and synthetic checkpoints, checked against transformers 5.23.0."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from inkling.checkpoint import CheckpointError, shard_name
from inkling.published import layout
from inkling.published.checkpoint import PublishedCheckpoint
from inkling.published.config import (
    PRESETS,
    ConfigError,
    InklingConfig,
    QuantConfig,
    preset,
)
from inkling.published.synth import write_checkpoint
from inkling.published.tokens import NAMED, tiny_id

transformers = pytest.importorskip("transformers")


def hf_config(d: dict):
    return transformers.InklingConfig.from_dict(json.loads(json.dumps(d)))


def derived(hc) -> dict:
    """What transformers derives from a config.json, in our terms."""
    t = hc.text_config
    return {
        "layer_types": tuple(t.layer_types),
        "mlp_layer_types": tuple(t.mlp_layer_types),
        "dense": t.intermediate_size,
        "experts": t.moe_intermediate_size,
        "context": t.max_position_embeddings,
        "kernel": t.conv_kernel_size,
        "window": t.sliding_window_size,
        "floor": t.log_scaling_n_floor,
        "unpadded": t.unpadded_vocab_size,
        "mtp": tuple(t.mtp_layer_types or ()),
        "vision_layers": hc.vision_config.num_hidden_layers,
        "mel_levels": hc.audio_config.mel_vocab_size,
        "image": hc.image_token_id,
        "audio": hc.audio_token_id,
    }


def ours(c: InklingConfig) -> dict:
    t = c.text
    return {
        "layer_types": t.layer_types,
        "mlp_layer_types": t.mlp_layer_types,
        "dense": t.intermediate_size,
        "experts": t.moe_intermediate_size,
        "context": t.max_position_embeddings,
        "kernel": t.conv_kernel_size,
        "window": t.sliding_window_size,
        "floor": t.log_scaling_n_floor,
        "unpadded": t.unpadded_vocab_size,
        "mtp": c.mtp.layer_types,
        "vision_layers": c.vision.n_layers,
        "mel_levels": c.audio.mel_vocab_size,
        "image": c.image_token_id,
        "audio": c.audio_token_id,
    }


@pytest.mark.parametrize("name", list(PRESETS))
def test_published_spelling_reads_as_transformers_reads_it(name):
    c = preset(name)
    d = c.to_dict()
    assert "dense_mlp_idx" in d["text_config"] and "dense_intermediate_size" in d["text_config"]
    assert ours(c) == derived(hf_config(d))
    assert InklingConfig.from_dict(d) == c


@pytest.mark.parametrize("name", list(PRESETS))
def test_save_pretrained_spelling_reads_the_same(name):
    c = preset(name)
    saved = hf_config(c.to_dict()).to_dict()  # what save_pretrained writes
    assert "dense_mlp_idx" not in saved["text_config"] and "mlp_layer_types" in saved["text_config"]
    assert InklingConfig.from_dict(saved) == c


def test_the_published_1t_config():
    """INKLING_SERVING §3.1's config.json, as published (only the fields it lists)."""
    text = {
        "model_max_length": 1048576, "torch_dtype": "bfloat16", "hidden_size": 6144, "num_hidden_layers": 66,
        "vocab_size": 201024, "unpadded_vocab_size": 200058, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 16, "swa_head_dim": 128,
        "sliding_window_size": 512, "local_layer_ids": [i for i in range(66) if i % 6 != 5], "d_rel": 16,
        "rel_extent": 1024, "log_scaling_n_floor": 128000, "log_scaling_alpha": 0.1, "q_bias": False,
        "o_bias": False, "rms_norm_eps": 1e-6, "use_embed_norm": True, "use_sconv": True, "sconv_kernel_size": 4,
        "dense_mlp_idx": 2, "dense_intermediate_size": 24576, "intermediate_size": 3072, "n_routed_experts": 256,
        "num_experts_per_tok": 6, "n_shared_experts": 2, "shared_expert_sink": True, "gate_activation": "sigmoid",
        "use_gate_bias": True, "norm_after_topk": True, "use_global_scale": True, "route_scale": 8.0,
        "logits_mup_width_multiplier": 24.0, "final_logit_softcapping": None, "hidden_act": "silu",
    }  # fmt: skip
    d = {
        "architectures": ["InklingForConditionalGeneration"], "model_type": "inkling_mm_model",
        "eos_token_id": 200006, "text_config": text,
        "vision_config": {"vision_encoder_type": "hmlp", "decoder_dmodel": 6144, "patch_size": 40,
                          "temporal_patch_size": 2, "n_channels": 3, "n_layers": 4},
        "audio_config": {"audio_mode": "dmel", "decoder_dmodel": 6144, "n_mel_bins": 80, "mel_vocab_size": 16,
                         "dmel_min_value": -7.0, "dmel_max_value": 2.0},
        "mtp_config": {"num_nextn_predict_layers": 8, "chain_hidden_post_norm": False,
                       "local_layer_ids": [0, 2, 4, 5, 6, 7]},
    }  # fmt: skip
    c = InklingConfig.from_dict(d)
    assert c == preset("inkling-1t")
    assert ours(c) == derived(hf_config(d))
    t = c.text
    assert [i for i in range(66) if not t.is_sliding(i)] == list(range(5, 66, 6))
    assert (t.attention(0).num_kv_heads, t.attention(5).num_kv_heads) == (16, 8)
    assert (t.attention(0).rel_extent, t.attention(5).rel_extent) == (512, 1024)
    assert t.attention(0).log_scaling_n_floor is None and t.attention(5).log_scaling_n_floor == 128000
    assert [c.mtp_attention(d).is_sliding for d in range(8)] == [
        True,
        False,
        True,
        False,
        True,
        True,
        True,
        True,
    ]
    assert c.eos_token_id == 200006 and t.num_real_tokens == 200058
    # The 1T's published parameter count (INKLING_SPEC §2.5: 947.1 B with the towers, without MTP)
    n = sum(
        torch.Size(s).numel() for name, (s, _) in layout.checkpoint_tensors(c).items() if "mtp" not in name
    )
    assert round(n / 1e9, 1) == 947.1


def _published(**text_changes) -> dict:
    d = preset("inkling-tiny").to_dict()
    d["text_config"].update(text_changes)
    return d


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(model_type="inkling"), "model_type is 'inkling', expected 'inkling_mm_model'"),
        (lambda d: d.pop("vision_config"), "vision_config is missing"),
        (lambda d: d.pop("text_config"), "text_config is missing"),
        (lambda d: d["text_config"].update(sconv_kernel_size=3, conv_kernel_size=4), "sconv_kernel_size (3) and conv_kernel_size (4) disagree"),
        (lambda d: d["text_config"].update(gate_activation="softmax"), "gate_activation = 'softmax' is not supported"),
        (lambda d: d["text_config"].update(num_key_value_heads=3), "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
        (lambda d: d["text_config"].update(hidden_size=0), "text_config: hidden_size must be a positive integer"),
        (lambda d: d["text_config"].update(local_layer_ids="all"), "local_layer_ids must be a list of integers"),
        (lambda d: d["vision_config"].update(n_layers=24), "n_layers must lie in 1..5"),
        (lambda d: d.update(image_token_id=5000), "image_token_id 5000 lies outside the vocabulary"),
        (lambda d: d["mtp_config"].update(local_layer_ids=[9]), "mtp_config: local_layer_ids [9] lie outside the 8 depths"),
    ],
)  # fmt: skip
def test_bad_configs_name_the_file_and_field(tmp_path, change, message):
    d = _published()
    change(d)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        InklingConfig.from_pretrained(tmp_path)
    assert str(path) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"producer": {}}, "has no 'quantization' object"),
        ({"quantization": {"quant_algo": "FP8", "group_size": 16}}, "quant_algo must be 'NVFP4', got 'FP8'"),
        ({"quantization": {"quant_algo": "NVFP4", "group_size": 32}}, "group_size must be 16, got 32"),
        ({"quantization": {"quant_algo": "NVFP4"}}, "quantization.group_size is missing"),
        ({"quantization": {"quant_algo": "NVFP4", "group_size": 16, "modelopt_quant_config": {"quant_cfg": {
            "*weight_quantizer": {"num_bits": [4, 3], "block_sizes": {"scale_bits": [4, 3]}}}}}}, "is not NVFP4"),
    ],
)  # fmt: skip
def test_bad_hf_quant_configs(tmp_path, quant, message):
    preset("inkling-tiny").save(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(ConfigError) as e:
        InklingConfig.from_pretrained(tmp_path)
    assert "hf_quant_config.json" in str(e.value) and message in str(e.value)


def test_nvfp4_quantizes_routed_experts_after_the_first_moe_layer():
    c = preset("inkling-1t", nvfp4=True)
    assert [i for i in range(66) if c.experts_quantized(i)] == list(range(3, 66))
    assert InklingConfig.from_dict(c.to_dict(), quant=QuantConfig.from_dict(c.quant.to_dict("0.47.0"))) == c
    specs = layout.checkpoint_tensors(c)
    w13 = "model.llm.layers.3.mlp.experts.w13_weight"
    assert specs[w13] == ((256, 6144, 3072), torch.uint8)
    assert specs[w13 + ".scale"] == ((256, 6144, 384), torch.float8_e4m3fn)
    assert specs[w13 + ".scale2"] == ((256,), torch.float32)
    assert specs[w13 + ".input_amax"] == ((1,), torch.bfloat16)
    assert specs["model.llm.layers.3.mlp.experts.w2_weight.scale"] == ((256, 6144, 192), torch.float8_e4m3fn)
    assert specs["model.llm.layers.2.mlp.experts.w13_weight"] == ((256, 6144, 6144), torch.bfloat16)
    assert not any(n.startswith("model.mtp.") and s[1] != torch.bfloat16 for n, s in specs.items())
    assert sum(n.startswith("model.mtp.") for n in specs) == 160  # 20 per depth (INKLING_SERVING §1.3)


def test_tiny_special_tokens_keep_the_real_layout():
    c = preset("inkling-tiny")
    assert c.eos_token_id == tiny_id(200006, 1024) == 1024 - 60 + 8
    assert (c.image_token_id, c.audio_token_id) == (tiny_id(200054, 1024), tiny_id(200053, 1024))
    assert NAMED[200006] == "<|content_model_end_sampling|>"


# Checkpoints.


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset("inkling-tiny"), seed=1)


def test_transformers_loads_our_synthetic_checkpoint(tiny_dir):
    model, info = transformers.InklingForConditionalGeneration.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    ids = torch.randint(0, 900, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 48, 1024) and torch.isfinite(logits).all()
    assert 0.2 < float(logits.std()) < 5  # activations stay O(1) through every layer
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.convert_tokens_to_ids("<|content_model_end_sampling|>") == preset("inkling-tiny").eos_token_id
    assert tok("hello world")["input_ids"][0] != tok.bos_token_id or tok.bos_token_id is None


def test_our_reader_opens_what_transformers_saves(tmp_path):
    """transformers' own save_pretrained of a random model: its names are the published layout's."""
    hc = hf_config(preset("inkling-tiny").to_dict())
    torch.manual_seed(0)
    model = transformers.InklingForConditionalGeneration(hc)
    model.save_pretrained(tmp_path)
    with PublishedCheckpoint(tmp_path) as ckpt:
        assert ckpt.dropped_mtp and ckpt.config.mtp.num_layers == 0  # transformers keeps no MTP
        assert ckpt.config.text == preset("inkling-tiny").text
        # the interleaved w13 of a routed stack, re-interleaved on save
        w13 = ckpt.get("model.llm.layers.4.mlp.experts.w13_weight")
        gate_up = model.model.language_model.layers[4].mlp.experts.gate_up_proj.detach()
        I = hc.text_config.moe_intermediate_size
        assert torch.equal(w13[:, 0::2].float(), gate_up[:, :I].float())
        assert torch.equal(w13[:, 1::2].float(), gate_up[:, I:].float())


def test_nvfp4_synthetic_checkpoint_layout(tmp_path):
    c = preset("inkling-tiny", nvfp4=True)
    d = write_checkpoint(tmp_path / "fp4", c)
    with PublishedCheckpoint(d) as ckpt:
        assert ckpt.config == c
        assert ckpt.dtype("model.llm.layers.2.mlp.experts.w13_weight") == torch.bfloat16
        assert ckpt.dtype("model.llm.layers.3.mlp.experts.w13_weight") == torch.uint8
        assert ckpt.get("model.llm.layers.3.mlp.experts.w2_weight.original_shape").tolist() == [16, 64, 32]
    q = json.loads((tmp_path / "fp4" / "hf_quant_config.json").read_text())
    assert "model.llm.layers.2.mlp.experts" in q["quantization"]["exclude_modules"]
    assert not any(m.startswith("model.mtp") for m in q["quantization"]["exclude_modules"])


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_bad_checkpoints_name_the_file_and_tensor(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "truncated")
    shard = os.path.join(d, shard_name(0, 1))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated"):
        PublishedCheckpoint(d)

    d = _copy(tiny_dir, tmp_path / "shape")
    cfg = json.loads(open(os.path.join(d, "config.json")).read())
    cfg["text_config"]["d_rel"] = 8  # every rel_logits_proj and wr_du now has the wrong shape
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"wrong shape or dtype: model\.llm\.layers\.0\.attn\.wr_du\.weight"
    ):
        PublishedCheckpoint(d)

    d = _copy(tiny_dir, tmp_path / "no-audio")
    cfg["text_config"]["d_rel"] = 4
    cfg.pop("audio_config")
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: audio_config is missing"):
        PublishedCheckpoint(d)


# The converter to the published NVFP4 layout.


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    from convert.published import convert

    out = tmp_path_factory.mktemp("fp4") / "tiny-nvfp4"
    config = convert(tiny_dir, str(out), calibration_prompts_n=2)
    return str(out), config


def test_converter_writes_the_published_nvfp4_layout(converted, tiny_dir):
    out, config = converted
    expected = layout.checkpoint_tensors(preset("inkling-tiny", nvfp4=True))
    with PublishedCheckpoint(out) as ckpt, PublishedCheckpoint(tiny_dir) as src:
        assert ckpt.config == config == preset("inkling-tiny", nvfp4=True)
        assert {n: (ckpt.shape(n), ckpt.dtype(n)) for n in ckpt.keys()} == expected
        for name in src.keys():  # everything but the quantized stacks is copied byte for byte
            if expected[name][1] != torch.uint8:
                assert torch.equal(ckpt.get(name).view(torch.uint8), src.get(name).view(torch.uint8)), name
        w13 = "model.llm.layers.3.mlp.experts.w13_weight"
        assert ckpt.get(w13 + ".original_shape").tolist() == [16, 64, 64]
        amax = ckpt.get(w13 + ".input_amax")
        assert amax.dtype == torch.bfloat16 and 0 < float(amax) < 100  # calibrated, raw amax (not 6 x 448)


def test_converted_experts_dequantize_as_modelopt_does(converted, tiny_dir):
    """ModelOpt's own dequantization of each expert's (codes, block scales, scale2) equals ours, and
    both are close to the BF16 weight."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from convert.published import dequantize_stack

    out, _ = converted
    name = "model.llm.layers.5.mlp.experts.w2_weight"
    with PublishedCheckpoint(out) as ckpt, PublishedCheckpoint(tiny_dir) as src:
        codes, scale, scale2 = (ckpt.get(name + s) for s in ("", ".scale", ".scale2"))
        ours = dequantize_stack(codes, scale, scale2)
        for e in range(codes.shape[0]):
            q = NVFP4QTensor(torch.Size(ours.shape[1:]), torch.float32, codes[e])
            theirs = q.dequantize(
                dtype=torch.float32, scale=scale[e], double_scale=scale2[e], block_sizes={-1: 16}
            )
            assert torch.equal(ours[e], theirs)
        w = src.get(name).float()
        assert float((ours - w).norm() / w.norm()) < 0.15  # E2M1 with E4M3 block scales: ~10% error


def test_converter_refuses_a_quantized_input(converted, tmp_path):
    from convert.errors import ConvertError
    from convert.published import convert

    with pytest.raises(ConvertError, match="already quantized"):
        convert(converted[0], str(tmp_path / "again"), calibration_prompts_n=0)


def test_converter_can_quantize_the_first_moe_layer(tiny_dir, tmp_path):
    from convert.published import convert

    config = convert(tiny_dir, str(tmp_path / "all"), quantize_first_moe=True, calibration_prompts_n=0)
    assert [i for i in range(8) if config.experts_quantized(i)] == [2, 3, 4, 5, 6, 7]
    with PublishedCheckpoint(tmp_path / "all") as ckpt:
        assert ckpt.dtype("model.llm.layers.2.mlp.experts.w13_weight") == torch.uint8
        assert float(ckpt.get("model.llm.layers.2.mlp.experts.w13_weight.input_amax")) == 6 * 448


def test_converter_refuses_bad_inputs_and_outputs_and_loses_nothing(converted, tiny_dir, tmp_path, capsys):
    """`python -m convert`: an existing output without --force, an output over the input, a checkpoint
    that is not the real Inkling and a truncated shard each end with one clear error, and leave no output
    (a failed conversion removes its temp dir)."""
    import json
    import shutil

    from convert.published import main as convert_main

    def refused(model_dir, out, match, *flags):
        assert convert_main(["--model_dir", str(model_dir), "--output_dir", str(out), "--calibration_prompts",
                             "0", *flags]) == 1  # fmt: skip
        assert match in capsys.readouterr().err

    out = tmp_path / "out"
    out.mkdir()
    refused(tiny_dir, out, "already exists: pass --force")
    refused(tiny_dir, tiny_dir, "would overwrite the input", "--force")
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    refused(other, tmp_path / "o1", "model_type")
    (other / "config.json").write_text(json.dumps(config))
    shard = sorted(other.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    refused(other, tmp_path / "o2", shard.name)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

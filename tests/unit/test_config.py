import json

import pytest

from inkling.config import FULL, SLIDING, ConfigError, InklingConfig, preset


def test_presets_follow_the_spec():
    big = preset("inkling-1t")
    assert (
        big.num_hidden_layers == 66
        and big.layer_types.count(FULL) == 11
        and big.layer_types.count(SLIDING) == 55
    )
    assert all((t == FULL) == (i % 6 == 5) for i, t in enumerate(big.layer_types))
    assert (big.num_routed_experts, big.num_experts_per_tok, big.num_shared_experts, big.num_mtp_heads) == (
        256,
        6,
        2,
        8,
    )
    bench = preset("inkling-bench")
    assert bench.num_hidden_layers == 6 and bench.hidden_size == 7168 and bench.layer_types[5] == FULL
    tiny = preset("inkling-tiny")
    assert (tiny.hidden_size, tiny.vision.hmlp_dims, tiny.audio.embed_dim) == (256, (32, 64), 32)


def test_parameter_count_of_inkling_1t():
    """§1: about 0.96T parameters, 930B of them routed experts, about 41B active per token."""
    from inkling.tensors import bf16_tensors

    c = preset("inkling-1t")
    total = routed = 0
    for name, shape in bf16_tensors(c):
        n = 1
        for s in shape:
            n *= s
        total += n
        routed += n if ".mlp.experts." in name else 0
    assert 0.93e12 < total < 0.99e12
    assert 0.90e12 < routed < 0.95e12


def test_round_trip_through_json(tmp_path):
    c = preset("inkling-tiny", token_ids={"bos": 0, "eos": 1, "image_pad": 6})
    c.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert (
        data["model_type"] == "inkling"
        and data["bos_token_id"] == 0
        and data["vision"]["hmlp_dims"] == [32, 64]
    )
    assert InklingConfig.from_json(tmp_path) == c


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "not divisible by num_key_value_heads"),
        ({"layer_types": ["full_attention"] * 5}, "layer_types has 5 entries for 6 layers"),
        ({"layer_types": ["full_attention"] * 5 + ["global"]}, "unknown layer_types"),
        ({"num_experts_per_tok": 17}, "exceeds num_routed_experts"),
        ({"head_dim": 64}, "head_dim must be 128"),
        ({"hidden_size": 0}, "hidden_size must be positive"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"bos_token_id": 5000}, "outside the vocabulary"),
        ({"vision": {"patch_size": 14}}, "patch_size must be 16"),
        ({"audio": {"log_min": 3.0}}, "must exceed log_min"),
        ({"model_type": "llama"}, "not an Inkling config"),
    ],
)
def test_invalid_configs_get_clear_errors(change, message):
    d = preset("inkling-tiny").to_dict()
    for k, v in change.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ConfigError, match=message):
        InklingConfig.from_dict(d)


def test_missing_field_and_bad_json(tmp_path):
    d = preset("inkling-tiny").to_dict()
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="missing"):
        InklingConfig.from_dict(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        InklingConfig.from_json(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        InklingConfig.from_json(tmp_path / "nowhere")


def test_config_is_frozen():
    c = preset("inkling-tiny")
    with pytest.raises(AttributeError):
        c.hidden_size = 3
    assert c.replace(num_hidden_layers=12).layer_types.count("full_attention") == 2
    odd = c.replace(layer_types=["full_attention"] * 6)
    with pytest.raises(ConfigError, match="layer_types has 6 entries for 2 layers"):
        odd.replace(num_hidden_layers=2)


def test_builder_cli_plugin_flags():
    """An op's impl is --NAME_plugin, a plugin setting is --NAME with its own type."""
    from builder.__main__ import parse_args

    args = parse_args(
        ["--checkpoint_dir", "c", "--output_dir", "o", "--expert_sink_moe_plugin", "reference",
         "--tune", "false", "--tune_max_tokens", "8"]
    )  # fmt: skip
    assert (args.expert_sink_moe_plugin, args.tune, args.tune_max_tokens) == ("reference", False, 8)

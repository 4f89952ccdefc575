"""`--export_onnx`: the step program as ONNX, every plugin call one node of the domain `inkling.plugins`."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter

import onnx
import pytest
import torch

import plugins
from builder import __main__ as cli
from builder.build import export_step
from builder.network import CacheLayout
from builder.onnx_export import PLUGIN_DOMAIN, PLUGIN_DOMAIN_VERSION, export_onnx


def attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def plugin_nodes(model: onnx.ModelProto, op_type: str | None = None) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == PLUGIN_DOMAIN and op_type in (None, n.op_type)]


def dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def engine_bf16(tiny_nvfp4_ckpt_dir):
    """The earlier model's bf16 engine: the ONNX export is not written for the real Inkling's programs yet."""
    from builder import BuildConfig, build

    from .conftest import SMALL

    return build(tiny_nvfp4_ckpt_dir, BuildConfig(dtype="bfloat16", **SMALL), echo=False)


@pytest.fixture(scope="module")
def fused_onnx(engine_bf16, tiny_nvfp4_ckpt_dir, tmp_path_factory):
    """Through the CLI (`build` patched to hand back the session's engine): PATH without a directory
    lands in the engine's output_dir."""
    out = tmp_path_factory.mktemp("onnx") / "engine"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "build", lambda *a, **k: engine_bf16)
        argv = [
            "--checkpoint_dir",
            tiny_nvfp4_ckpt_dir,
            "--output_dir",
            str(out),
            "--export_onnx",
            "step.onnx",
        ]
        assert cli.main(argv) == 0
    path = out / "step.onnx"
    return onnx.load(path), path


@pytest.fixture(scope="module")
def unfused_onnx(engine_bf16, tmp_path_factory):
    """The same engine with sconv_k, sconv_v and kv_cache_write as three ops; weights as initializers."""
    bc = engine_bf16.build_config
    bc = dataclasses.replace(
        bc, plugin_config=dataclasses.replace(bc.plugin_config, fuse_sconv_kv_write=False)
    )
    program = export_step(
        engine_bf16.model_config, bc, engine_bf16.config["plugin_config"]["impls"], engine_bf16.step_weights,
        torch.device("cpu"), torch.bfloat16,
    )  # fmt: skip
    engine = dataclasses.replace(engine_bf16, programs={"step": program})
    path = tmp_path_factory.mktemp("onnx") / "unfused" / "step.onnx"
    export_onnx(engine, path, weights="external")
    return onnx.load(path, load_external_data=False), path


def test_fused_plugin_nodes(engine_bf16, fused_onnx):
    model, path = fused_onnx
    onnx.checker.check_model(str(path), full_check=True)
    c = engine_bf16.model_config
    L = c.num_hidden_layers
    counts = Counter(n.op_type for n in plugin_nodes(model))
    assert counts == {"sheared_bias_attention": L, "sconv_kv_write": L, "sconv": 2 * L, "expert_sink_moe": L}
    assert {o.domain: o.version for o in model.opset_import}[PLUGIN_DOMAIN] == PLUGIN_DOMAIN_VERSION
    impls = engine_bf16.config["plugin_config"]["impls"]

    layout = CacheLayout.of(c)
    for layer, node in enumerate(plugin_nodes(model, "sheared_bias_attention")):
        a = attrs(node)
        assert a["window"] == layout.group_windows[layout.group_of_layer[layer]]
        assert a["scale"] == pytest.approx(1 / math.sqrt(c.head_dim))
        assert a["impl"] == impls["sheared_bias_attention"]
        assert a["version"] == plugins.get("sheared_bias_attention").version
        assert len(node.input) == 9 and len(node.output) == 1  # 8 tensors + max_seqlen_q (int64 scalar)
    assert {a["window"] for a in map(attrs, plugin_nodes(model, "sheared_bias_attention"))} == {
        0,
        c.sliding_window,
    }
    for node in plugin_nodes(model, "expert_sink_moe"):
        assert attrs(node) == {
            "num_routed": c.num_routed_experts,
            "top_k": c.num_experts_per_tok,
            "tile_configs": "",
            "impl": impls["expert_sink_moe"],
            "version": plugins.get("expert_sink_moe").version,
            "weight_layout_version": plugins.get("expert_sink_moe").weight_layout_version,
        }
    for node in plugin_nodes(model, "sconv") + plugin_nodes(model, "sconv_kv_write"):
        assert attrs(node) == {"impl": impls["sconv"], "version": plugins.get(node.op_type).version}
    for node in plugin_nodes(model, "sconv_kv_write"):
        assert (len(node.input), len(node.output)) == (11, 6)  # k, v, then state_k, state_v, key/value cache

    # The attention reads the cache the write produced (the in-place order is explicit data flow).
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in plugin_nodes(model, "sheared_bias_attention"):
        for cache in node.input[3:5]:
            assert producer[cache].op_type == "sconv_kv_write"

    # Weights are graph inputs; dynamic dims keep their names; caches and states come back as outputs.
    inputs = {i.name: i for i in model.graph.input}
    assert sum(name.startswith("weights_") for name in inputs) == len(engine_bf16.step_weights)
    assert (
        sum(
            onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * math.prod(t.dims)
            for t in model.graph.initializer
        )
        < 1 << 16
    )
    assert dims(inputs["input_ids"]) == ["num_tokens"]
    assert dims(inputs["seq_lens"]) == ["batch"]
    assert dims(inputs["key_caches_0"])[0] == "num_blocks"
    outputs = [o.name for o in model.graph.output]
    assert outputs[:2] == ["logits", "hidden"]
    assert dims(model.graph.output[0]) == ["num_logits", c.vocab_size]
    pool = layout.pool_size
    assert sorted(outputs[2:]) == sorted(
        [f"key_caches_{j}_out" for j in range(pool)]
        + [f"value_caches_{j}_out" for j in range(pool)]
        + [f"conv_states_{i}_out" for i in range(4 * L)]
    )
    assert model.metadata_props and os.path.getsize(path) < 1 << 20


def test_unfused_plugin_nodes_and_external_weights(engine_bf16, unfused_onnx):
    model, path = unfused_onnx
    onnx.checker.check_model(str(path))
    L = engine_bf16.model_config.num_hidden_layers
    counts = Counter(n.op_type for n in plugin_nodes(model))
    assert counts == {"sheared_bias_attention": L, "kv_cache_write": L, "sconv": 4 * L, "expert_sink_moe": L}
    for node in plugin_nodes(model, "kv_cache_write"):
        assert (len(node.input), len(node.output)) == (5, 2)  # -> key_cache_out, value_cache_out
        assert attrs(node) == {
            "impl": engine_bf16.config["plugin_config"]["impls"]["sheared_bias_attention"],
            "version": plugins.get("kv_cache_write").version,
        }
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in plugin_nodes(model, "sheared_bias_attention"):
        assert producer[node.input[3]].op_type == "kv_cache_write"
    assert not any(i.name.startswith("weights_") for i in model.graph.input)
    names = {t.name for t in model.graph.initializer}
    assert set(engine_bf16.step_weights) <= names
    assert os.path.exists(f"{path}.data")


def test_functional_program_matches_in_place_program(engine_bf16):
    """The twins' program (what the ONNX graph is made from) computes what the engine's in-place program
    does: same outputs, and its cache/state outputs equal the caches/states the engine wrote."""
    from builder.build import step_example
    from builder.onnx_export import functionalize

    program = engine_bf16.programs["step"]
    functional = functionalize(program)
    example = step_example(engine_bf16.model_config, engine_bf16.build_config, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    example["input_ids"] = torch.randint(11, 1000, (5,), generator=g)
    example["conv_states"] = [torch.randn(s.shape, generator=g).to(s.dtype) for s in example["conv_states"]]
    before = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in example.items()}
    with torch.no_grad():
        logits, hidden = program.module()(engine_bf16.step_weights, *example.values())  # writes in place
        out = functional.module()(engine_bf16.step_weights, *before.values())  # returns the new values
    assert torch.equal(out[0], logits) and torch.equal(out[1], hidden)
    written = {
        f"{kind}_{i}": t
        for kind in ("key_caches", "value_caches", "conv_states")
        for i, t in enumerate(example[kind])
    }
    targets = [s.target for s in functional.graph_signature.output_specs[2:]]
    assert sorted(targets) == sorted(written)
    for target, value in zip(targets, out[2:], strict=True):
        assert torch.equal(value, written[target]), target
    assert not torch.equal(before["key_caches"][0], example["key_caches"][0])  # the step wrote something

"""`--export_onnx` on the real Inkling's tiny engine: the step program as ONNX, every plugin call one node of the
domain `inkling.plugins`, the caches and states threaded through the graph."""

from __future__ import annotations

import math
import os
from collections import Counter

import onnx
import pytest
import torch

import plugins
from builder import __main__ as cli
from builder.build import cache_layout
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
def step_onnx(engine_bf16, pub_ckpt_dir, tmp_path_factory):
    """Through the CLI (`build` patched to hand back the session's engine): PATH without a directory lands in
    the engine's output_dir."""
    out = tmp_path_factory.mktemp("onnx") / "engine"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "build", lambda *a, **k: engine_bf16)
        argv = ["--checkpoint_dir", pub_ckpt_dir, "--output_dir", str(out), "--export_onnx", "step.onnx"]
        assert cli.main(argv) == 0
    path = out / "step.onnx"
    return onnx.load(path), path


def test_plugin_nodes_and_their_attributes(engine_bf16, step_onnx):
    model, path = step_onnx
    onnx.checker.check_model(str(path), full_check=True)
    c = engine_bf16.model_config
    t = c.text
    L = t.num_hidden_layers
    moe = [layer for layer in range(L) if not t.is_dense(layer)]
    counts = Counter(n.op_type for n in plugin_nodes(model))
    assert counts == {"bank_attention": L, "kv_cache_write": L, "sconv": 4 * L, "sigmoid_sink_moe": len(moe)}
    assert {o.domain: o.version for o in model.opset_import}[PLUGIN_DOMAIN] == PLUGIN_DOMAIN_VERSION
    impls = engine_bf16.config["plugin_config"]["impls"]

    # Each layer's attention with its kind's window, scale and log-scaling floor (full layers only).
    for layer, node in enumerate(plugin_nodes(model, "bank_attention")):
        a, shape = attrs(node), t.attention(layer)
        assert a["window"] == (shape.window or 0)
        assert a["scale"] == pytest.approx(1 / shape.head_dim)
        assert a["log_floor"] == (shape.log_scaling_n_floor or 0)
        assert a["log_alpha"] == pytest.approx(shape.log_scaling_alpha)
        assert (a["impl"], a["version"]) == (impls["bank_attention"], plugins.get("bank_attention").version)
        assert len(node.input) == 9 and len(node.output) == 1  # 8 tensors + max_seqlen_q (int64 scalar)
    windows = {attrs(n)["window"] for n in plugin_nodes(model, "bank_attention")}
    assert windows == {0, t.sliding_window_size}
    assert {attrs(n)["log_floor"] for n in plugin_nodes(model, "bank_attention")} == {
        0,
        t.log_scaling_n_floor,
    }
    for node in plugin_nodes(model, "sigmoid_sink_moe"):
        assert attrs(node) == {
            "top_k": t.num_experts_per_tok,
            "route_scale": pytest.approx(t.route_scale),
            "ep_size": 1,  # left at its default in the graph, still an attribute of the node
            "tile_configs": "",
            "impl": impls["sigmoid_sink_moe"],
            "version": plugins.get("sigmoid_sink_moe").version,
        }
    for node in plugin_nodes(model, "sconv"):
        assert attrs(node) == {"impl": impls["sconv"], "version": plugins.get("sconv").version}
        assert (len(node.input), len(node.output)) == (5, 2)  # -> y, the state it wrote

    # The attention reads the caches its layer's write produced (the in-place order is explicit data flow).
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in plugin_nodes(model, "bank_attention"):
        for cache in node.input[3:5]:
            assert producer[cache].op_type == "kv_cache_write"

    # Weights are graph inputs; dynamic dims keep their names; caches and states come back as outputs.
    inputs = {i.name: i for i in model.graph.input}
    assert sum(name.startswith("weights_") for name in inputs) == len(engine_bf16.step_weights)
    assert dims(inputs["input_ids"]) == ["num_tokens"]
    assert dims(inputs["seq_lens"]) == ["batch"]
    assert dims(inputs["cu_seqlens_q"]) == ["batch + 1"]
    assert dims(inputs["q_bound"]) == ["max_seqlen_q"]
    lay = cache_layout(c)
    pools = len(lay["cache_kv_heads"])
    assert [dims(inputs[f"key_caches_{j}"])[0] for j in range(pools)] == [
        f"num_blocks_{j}" for j in range(pools)
    ]
    outputs = [o.name for o in model.graph.output]
    assert outputs[:2] == ["logits", "hidden"]
    assert dims(model.graph.output[0])[0] == "num_logits"
    assert sorted(outputs[2:]) == sorted(
        [f"key_caches_{j}_out" for j in range(pools)]
        + [f"value_caches_{j}_out" for j in range(pools)]
        + [f"conv_states_{i}_out" for i in range(len(lay["conv_channels"]))]
        + [f"expert_load_{i}_out" for i in range(len(lay["moe_layers"]))]
    )
    assert model.metadata_props and os.path.getsize(path) < 1 << 20


def test_external_weights(engine_bf16, tmp_path):
    """weights="external": the engine's weights are initializers in `<file>.data`, none a graph input."""
    path = tmp_path / "step.onnx"
    model = export_onnx(engine_bf16, path, weights="external")
    onnx.checker.check_model(str(path))
    assert not any(i.name.startswith("weights_") for i in model.graph.input)
    assert set(engine_bf16.step_weights) <= {t.name for t in model.graph.initializer}
    stored = sum(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * math.prod(t.dims)
        for t in model.graph.initializer
    )
    assert stored >= sum(w.numel() * w.element_size() for w in engine_bf16.step_weights.values())
    assert os.path.getsize(f"{path}.data") >= stored // 2


def test_functional_program_matches_in_place_program(engine_bf16):
    """The twins' program (what the ONNX graph is made from) computes what the engine's in-place program
    does: the same outputs, and its cache and state outputs equal what the engine wrote."""
    from builder.build import step_example
    from builder.contracts import STEP
    from builder.onnx_export import functionalize

    program = engine_bf16.programs["step"]
    functional = functionalize(program)
    example = step_example(engine_bf16.model_config, engine_bf16.build_config, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    example["input_ids"] = torch.randint(11, 900, example["input_ids"].shape, generator=g)
    example["conv_states"] = [torch.randn(s.shape, generator=g).to(s.dtype) for s in example["conv_states"]]
    before = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in example.items()}
    names = [n for n in STEP.names if n != "weights"]
    with torch.no_grad():
        logits, hidden = program.module()(engine_bf16.step_weights, *[example[n] for n in names])  # in place
        out = functional.module()(engine_bf16.step_weights, *[before[n] for n in names])  # returns new values
    assert torch.equal(out[0], logits) and torch.equal(out[1], hidden)
    written = {
        f"{kind}_{i}": t
        for kind in ("key_caches", "value_caches", "conv_states", "expert_load")
        for i, t in enumerate(example[kind])
    }
    targets = [s.target for s in functional.graph_signature.output_specs[2:]]
    assert sorted(targets) == sorted(written)
    for target, value in zip(targets, out[2:], strict=True):
        assert torch.equal(value, written[target]), target
    assert not torch.equal(before["key_caches"][0], example["key_caches"][0])  # the step wrote something

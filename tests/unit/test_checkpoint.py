"""Checkpoint I/O: the streaming sharded writer and the validating reader, on checkpoints of the real
Inkling's published layout (inkling.published.checkpoint)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from inkling.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    ShardedWriter,
    load_generation_config,
    plan_shards,
    read_header,
)
from inkling.published.checkpoint import PublishedCheckpoint as CheckpointReader
from inkling.published.config import preset
from inkling.published.layout import checkpoint_tensors
from inkling.published.synth import iter_tensors, write_checkpoint

ALL_DTYPES = (
    torch.bfloat16,
    torch.float32,
    torch.float16,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float8_e4m3fn,
)


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture
def sample_tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for i, dtype in enumerate(ALL_DTYPES):
        tensors[f"t.{i}.matrix"] = _random_tensor((7 + i, 5), dtype, i)
        tensors[f"t.{i}.scalar"] = _random_tensor((), dtype, 100 + i)
        tensors[f"t.{i}.vector"] = _random_tensor((3,), dtype, 200 + i)
    return tensors


def _write(out, tensors, max_shard_bytes=2 * 10**9, order=None):
    specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    with ShardedWriter(out, specs, max_shard_bytes) as writer:
        for name in order or tensors:
            writer.write(name, tensors[name])
    return writer


# Writer.


@pytest.mark.parametrize("max_shard_bytes", [2 * 10**9, 200])
def test_writer_round_trip_bit_exact(tmp_path, sample_tensors, max_shard_bytes):
    order = sorted(sample_tensors, reverse=True)  # out of plan order: each tensor lands at its offset
    writer = _write(tmp_path, sample_tensors, max_shard_bytes, order)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(sample_tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.itemsize for t in sample_tensors.values())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [s.file_name for s in writer.shards]
    if max_shard_bytes == 200:
        assert len(shards) > 3
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded = {}
    for shard in shards:
        loaded.update(load_file(tmp_path / shard))  # safetensors' own reader agrees
        with safe_open(tmp_path / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        with open(tmp_path / shard, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        assert header_len % 8 == 0
    assert set(loaded) == set(sample_tensors)
    for name, t in sample_tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(_bits(loaded[name]), _bits(t)), name
        assert index["weight_map"][name] in shards


def test_plan_shards_respects_the_limit():
    specs = {f"w{i}": ((10, 10), torch.float32) for i in range(10)}  # 400 bytes each
    specs["big"] = ((100, 10), torch.float32)  # 4000 bytes: alone in its shard
    plans = plan_shards(specs, max_shard_bytes=1000)
    assert [p.names for p in plans][:2] == [["w0", "w1"], ["w2", "w3"]]
    assert plans[-1].names == ["big"]
    assert [n for p in plans for n in p.names] == list(specs)
    for p in plans[:-1]:
        assert p.size - len(p.header) <= 1000


def test_writer_checks_against_the_plan(tmp_path):
    specs = {"a": ((2, 3), torch.bfloat16), "b": ((4,), torch.float32)}
    writer = ShardedWriter(tmp_path, specs)
    with pytest.raises(CheckpointError, match=r"'a': planned \[2, 3\] torch.bfloat16, got \[3, 2\]"):
        writer.write("a", torch.zeros(3, 2, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"planned \[2, 3\] torch.bfloat16, got \[2, 3\] torch.float32"):
        writer.write("a", torch.zeros(2, 3))
    with pytest.raises(CheckpointError, match="'c' is not in the plan"):
        writer.write("c", torch.zeros(4))
    writer.write("a", torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match="written twice"):
        writer.write("a", torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match="1 planned tensors not written: b"):
        writer.close()
    assert not (tmp_path / INDEX_FILE).exists()


def test_writer_rejects_unsupported_dtypes(tmp_path):
    with pytest.raises(CheckpointError, match="not supported"):
        ShardedWriter(tmp_path, {"x": ((2,), torch.complex64)})


# Reader on a synthetic inkling-tiny checkpoint.


def test_reader_matches_synth(tmp_path):
    config = preset("inkling-tiny", nvfp4=True)
    out = write_checkpoint(tmp_path / "tiny", config, seed=0)
    with CheckpointReader(out) as reader:
        specs = checkpoint_tensors(reader.config)
        assert set(reader.keys()) == set(specs)
        for name, tensor in iter_tensors(config, seed=0):
            assert reader.shape(name) == specs[name][0]
            assert reader.dtype(name) == specs[name][1]
            assert reader.nbytes(name) == tensor.numel() * tensor.itemsize
            assert reader.shard_of(name).endswith(".safetensors")
            assert torch.equal(_bits(reader.get(name)), _bits(tensor)), name
    gen = load_generation_config(out)
    assert gen["eos_token_id"] == config.eos_token_id and gen["max_new_tokens"] > 0


def test_reader_validates_without_reading_data(tmp_path):
    """inkling-bench's shards as sparse files of the right size: opening reads only headers."""
    config = preset("inkling-bench", nvfp4=True)
    config.save(tmp_path)
    specs = checkpoint_tensors(config)
    plans = plan_shards(specs)
    for p in plans:
        with open(tmp_path / p.file_name, "wb") as f:
            f.write(p.header)
            f.truncate(p.size)
    index = {"metadata": {}, "weight_map": {n: p.file_name for p in plans for n in p.names}}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    reader = CheckpointReader(tmp_path)
    assert reader.total_bytes > 13e9
    layer = config.text.num_hidden_layers - 1
    assert reader.dtype(f"model.llm.layers.{layer}.mlp.experts.w2_weight.scale") == torch.float8_e4m3fn


# Reader errors. A small checkpoint written with one thing wrong.


@pytest.fixture(scope="module")
def small_models():
    """inkling-tiny in BF16 and NVFP4: (config, {name: tensor}) each."""
    out = {}
    for nvfp4 in (False, True):
        config = preset("inkling-tiny", nvfp4=nvfp4)
        out[nvfp4] = config, dict(iter_tensors(config, seed=0))
    return out


@pytest.fixture
def small(tmp_path, small_models):
    """small(mutate=None, nvfp4=False) writes the small checkpoint, with `mutate` applied to its tensors."""

    def write(mutate=None, nvfp4=False):
        config, tensors = small_models[nvfp4]
        tensors = dict(tensors)
        if mutate:
            mutate(tensors)
        out = tmp_path / "ckpt"
        _write(out, tensors, max_shard_bytes=400_000)
        config.save(out)
        return out

    return write


def test_small_checkpoint_is_valid(tmp_path, small):
    out = small()
    reader = CheckpointReader(out)
    assert reader.config.text.num_hidden_layers == 8
    assert len({reader.shard_of(n) for n in reader.keys()}) > 1


def test_missing_tensor(tmp_path, small):
    out = small(lambda t: t.pop("model.llm.layers.0.attn.rel_logits_proj.proj"))
    with pytest.raises(
        CheckpointError, match=r"1 missing tensors: model\.llm\.layers\.0\.attn\.rel_logits_proj\.proj"
    ):
        CheckpointReader(out)


def test_many_missing_tensors_are_listed_briefly(tmp_path, small):
    def drop_experts(t):
        for name in [n for n in t if ".mlp.experts." in n]:
            del t[name]

    out = small(drop_experts)  # w13 and w2 of 6 MoE layers
    with pytest.raises(CheckpointError, match=r"12 missing tensors: .*\.\.\. \(7 more\)"):
        CheckpointReader(out)


def test_extra_tensor(tmp_path, small):
    out = small(lambda t: t.update({"model.llm.layers.8.attn_norm.weight": torch.ones(64)}))
    with pytest.raises(
        CheckpointError, match=r"1 unexpected tensors: model\.llm\.layers\.8\.attn_norm\.weight"
    ):
        CheckpointReader(out)


def test_wrong_shape(tmp_path, small):
    name = "model.llm.layers.3.mlp.gate.weight"
    out = small(lambda t: t.update({name: t[name][:17]}))
    with pytest.raises(
        CheckpointError,
        match=rf"{name}: expected \[18, 64\] torch.bfloat16, found \[17, 64\] torch.bfloat16",
    ):
        CheckpointReader(out)


def test_wrong_dtype(tmp_path, small):
    name = "model.llm.norm.weight"
    out = small(lambda t: t.update({name: t[name].float()}))
    with pytest.raises(
        CheckpointError, match=rf"{name}: expected \[64\] torch.bfloat16, found \[64\] torch.float32"
    ):
        CheckpointReader(out)


def test_wrong_dtype_nvfp4(tmp_path, small):
    name = "model.llm.layers.3.mlp.experts.w13_weight.scale"
    out = small(lambda t: t.update({name: t[name].to(torch.bfloat16)}), nvfp4=True)
    with pytest.raises(CheckpointError, match=rf"{name}: expected \[16, 64, 4\] torch.float8_e4m3fn, found"):
        CheckpointReader(out)


def test_truncated_shard(tmp_path, small):
    out = small()
    shard = sorted(out.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated"):
        CheckpointReader(out)


def test_shard_cut_inside_its_header(tmp_path, small):
    out = small()
    shard = sorted(out.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(20)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: header length \d+ does not fit"):
        CheckpointReader(out)


def test_missing_shard_file(tmp_path, small):
    out = small()
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard file .*{shard.name} does not exist"):
        CheckpointReader(out)


def test_corrupt_index(tmp_path, small):
    out = small()
    (out / INDEX_FILE).write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE} is not valid JSON"):
        CheckpointReader(out)


def test_index_disagrees_with_shards(tmp_path, small):
    out = small()
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.llm.norm.weight"] = (
        shards[0] if index["weight_map"]["model.llm.norm.weight"] != shards[0] else shards[1]
    )
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not hold: model.llm.norm.weight"):
        CheckpointReader(out)


def test_index_shard_outside_the_directory(tmp_path, small):
    out = small()
    index = json.loads((out / INDEX_FILE).read_text())
    index["weight_map"]["model.llm.norm.weight"] = "../model-00001-of-00002.safetensors"
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file name in the directory"):
        CheckpointReader(out)


def test_config_not_inkling(tmp_path, small):
    out = small()
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = "llama"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not an Inkling config: model_type is 'llama'"):
        CheckpointReader(out)


def test_config_missing(tmp_path, small):
    out = small()
    (out / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        CheckpointReader(out)


def test_config_other_shape(tmp_path, small):
    """A config.json that does not describe the weights (more layers): the missing layer is named."""
    out = small()
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    text.update(num_hidden_layers=9)  # layer 8 full, as local_layer_ids does not name it
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.llm\.layers\.8\.attn_norm\.weight"):
        CheckpointReader(out)


def test_single_file_checkpoint(tmp_path, small):
    """A single model.safetensors (no index) is read too."""
    out = small()
    shutil.rmtree(tmp_path / "single", ignore_errors=True)
    single = tmp_path / "single"
    single.mkdir()
    tensors = {}
    for shard in out.glob("model-*.safetensors"):
        tensors.update(load_file(shard))
    from safetensors.torch import save_file

    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(out / "config.json", single / "config.json")
    reader = CheckpointReader(single)
    assert reader.shard_of("model.llm.norm.weight") == "model.safetensors"
    assert torch.equal(_bits(reader.get("model.llm.norm.weight")), _bits(tensors["model.llm.norm.weight"]))


def test_no_weights(tmp_path, small):
    out = small()
    for f in out.glob("model*"):
        f.unlink()
    with pytest.raises(
        CheckpointError, match="has neither model.safetensors.index.json nor model.safetensors"
    ):
        CheckpointReader(out)


def test_read_header_rejects_garbage(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((16).to_bytes(8, "little") + b"not json at all!")
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        read_header(str(bad))

"""The engine: everything the runtime needs and nothing else, saved atomically and checked at load.

An engine directory holds (TensorRT-LLM's layout, DESIGN.md "Engine"):

    config.json                 version, pretrained_config, build_config, plugin_config, mapping,
                                quantization, device, dtype, programs, rank_programs, files (size and sha256)
    rank{r}.safetensors         rank r's weights in the layout the plugin ops read (sharded when tp_size > 1)
    rank{r}.<program>.pt2       programs exported with torch.export (weights are inputs): rank 0 has every
                                program (`programs`), the other ranks the step only (`rank_programs`)
    rank0.compile_cache.bin     torch.compile's cache artifacts for the step program (when built with compile)
    tokenizer.json, generation_config.json
    build.log

Loading needs neither the checkpoint nor the model's Python code (only `plugins`, which registers the
custom ops the programs call).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import plugins
from inkling.published.config import MODEL_TYPE, InklingConfig, QuantConfig

from .config import BuildConfig

# 2: the step and head programs take q_bound. 3: tensor-parallel ranks split lm_head by vocabulary and
# each hold their share of the MTP heads (builder/sharding.py).
ENGINE_FORMAT_VERSION = 3
VERIFY_SHA256_BELOW = 1 << 30  # files larger than this are checked by size only (unless verify="full")


class EngineError(ValueError):
    """An engine directory that this version cannot load."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class RankShard:
    """One rank's part of a tensor-parallel engine."""

    weights: dict[str, torch.Tensor]
    programs: dict[str, torch.export.ExportedProgram]


@dataclass
class Engine:
    """One rank's view of an engine (rank 0 unless loaded with `from_dir(rank=r)`): its weights and programs,
    and what every rank shares. A tensor-parallel engine built in memory also holds the other ranks' parts
    (`other_ranks`), which `save` writes beside rank 0's; a loaded one holds its own rank only."""

    config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    programs: dict[str, torch.export.ExportedProgram]
    tokenizer_json: str | None = None
    generation_config: dict[str, Any] | None = None
    build_log: list[str] = field(default_factory=list)
    compile_cache: bytes | None = None  # torch.compiler cache artifacts of the step program, from the build
    rank: int = 0
    other_ranks: dict[int, RankShard] = field(default_factory=dict)

    @property
    def step_weights(self) -> dict[str, torch.Tensor]:
        """The step program's weights: all but the MTP heads' (`mtp.*`, the head program's)."""
        return {k: v for k, v in self.weights.items() if not k.startswith("mtp.")}

    @property
    def model_config(self) -> InklingConfig:
        """The model's config (its published config.json, with the NVFP4 description if quantized)."""
        return model_config_of(self.config)

    @property
    def build_config(self) -> BuildConfig:
        return BuildConfig.from_dict(self.config["build_config"])

    @property
    def device(self) -> str:
        return self.config["device"]

    @property
    def tp_size(self) -> int:
        return self.config.get("mapping", {}).get("tp_size", 1)

    @property
    def ep_size(self) -> int:
        return self.config.get("mapping", {}).get("ep_size", 1)

    @property
    def dp_size(self) -> int:
        return self.config.get("mapping", {}).get("dp_size", 1)

    @property
    def world_size(self) -> int:
        """The ranks the engine runs on (BuildConfig.world_size)."""
        return world_size_of(self.config)

    def ranks(self) -> dict[int, RankShard]:
        """The ranks' parts this object holds: its own and, built in memory, the others'."""
        return {self.rank: RankShard(self.weights, self.programs), **self.other_ranks}

    # Saving.
    def save(self, out_dir: str | os.PathLike, force: bool = False) -> None:
        """Write atomically: into a temp dir beside `out_dir`, then rename."""
        out_dir = os.path.abspath(os.fspath(out_dir))
        if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
            raise EngineError(f"{out_dir} exists and is not empty (use force=True / --force to replace it)")
        parent = os.path.dirname(out_dir)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".engine-", dir=parent)
        try:
            self._write(tmp)
            if os.path.exists(out_dir):
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write(self, d: str) -> None:
        ranks = self.ranks()
        if sorted(ranks) != list(range(self.world_size)):
            raise EngineError(
                f"saving needs every rank's part: have ranks {sorted(ranks)} of {self.world_size}"
            )
        files = {}
        for rank, part in sorted(ranks.items()):
            fname = f"rank{rank}.safetensors"
            save_file({k: v.contiguous().cpu() for k, v in part.weights.items()}, os.path.join(d, fname))
            files[fname] = None
            for name, program in part.programs.items():
                fname = f"rank{rank}.{name}.pt2"
                torch.export.save(program, os.path.join(d, fname))
                files[fname] = None
        if self.compile_cache is not None:
            with open(os.path.join(d, "rank0.compile_cache.bin"), "wb") as f:
                f.write(self.compile_cache)
            files["rank0.compile_cache.bin"] = None
        if self.tokenizer_json is not None:
            with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
                f.write(self.tokenizer_json)
            files["tokenizer.json"] = None
        if self.generation_config is not None:
            with open(os.path.join(d, "generation_config.json"), "w") as f:
                json.dump(self.generation_config, f, indent=2)
            files["generation_config.json"] = None
        with open(os.path.join(d, "build.log"), "w") as f:
            f.write("\n".join(self.build_log) + "\n")
        config = dict(self.config)
        config["programs"] = sorted(ranks[0].programs)
        config["rank_programs"] = [sorted(part.programs) for _, part in sorted(ranks.items())]
        paths = [os.path.join(d, name) for name in files]
        with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:  # hashlib releases the GIL
            digests = list(pool.map(_sha256, paths))
        config["files"] = {
            name: {"size": os.path.getsize(path), "sha256": digest}
            for name, path, digest in zip(files, paths, digests)
        }
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        self.config = config

    # Loading.
    @classmethod
    def from_dir(
        cls,
        engine_dir: str | os.PathLike,
        device: str | None = None,
        verify: str = "auto",
        rank: int = 0,
        world_size: int | None = None,
    ) -> Engine:
        """Load and check rank `rank`'s part of an engine: format version, plugin versions, device kind,
        files (sizes and hashes), and that `world_size` (the ranks launched; None: not checked) is the
        engine's tp_size."""
        engine_dir = os.fspath(engine_dir)
        config = read_engine_config(engine_dir)
        check_compatible(config, device)
        check_mapping(engine_dir, config, rank, world_size)
        check_files(engine_dir, config, verify)
        weights = {}
        target = device or config["device"]
        with safe_open(
            os.path.join(engine_dir, f"rank{rank}.safetensors"), framework="pt", device=str(target)
        ) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # safetensors places tensors at 8-byte offsets. On the CPU, kernels (oneDNN's, NumPy's under
                # the Triton interpreter) pick their vector loops by alignment, so an 8-byte aligned weight
                # rounded differently (~1e-6 in float32 logits) than the same weight built in memory: a copy
                # in a 64-byte aligned allocation gives the built engine's logits bit for bit.
                weights[name] = t.clone() if t.device.type == "cpu" and t.data_ptr() % 64 else t
        programs = {}
        for name in config.get("rank_programs", [config["programs"]])[rank]:
            try:
                programs[name] = torch.export.load(os.path.join(engine_dir, f"rank{rank}.{name}.pt2"))
            except Exception as e:  # a corrupt archive: say which file
                raise EngineError(f"cannot load program {name!r} of engine {engine_dir}: {e}") from e
        tok_path = os.path.join(engine_dir, "tokenizer.json")
        gen_path = os.path.join(engine_dir, "generation_config.json")
        cache_path = os.path.join(engine_dir, "rank0.compile_cache.bin")
        return cls(
            rank=rank,
            compile_cache=open(cache_path, "rb").read()
            if rank == 0 and "rank0.compile_cache.bin" in config["files"]
            else None,
            config=config,
            weights=weights,
            programs=programs,
            tokenizer_json=open(tok_path, encoding="utf-8").read() if os.path.exists(tok_path) else None,
            generation_config=json.load(open(gen_path, encoding="utf-8"))
            if os.path.exists(gen_path)
            else None,
        )


def read_engine_config(engine_dir: str) -> dict[str, Any]:
    path = os.path.join(engine_dir, "config.json")
    if not os.path.isdir(engine_dir):
        raise EngineError(f"no engine directory at {engine_dir}")
    if not os.path.exists(path):
        raise EngineError(f"{engine_dir} is not an engine: no config.json (a partial or interrupted build?)")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise EngineError(f"{path} is corrupt: {e}") from e
    for key in (
        "version",
        "pretrained_config",
        "build_config",
        "plugin_config",
        "device",
        "dtype",
        "programs",
        "files",
    ):
        if key not in config:
            raise EngineError(f"{path} lacks {key!r}: not an engine of this tool, or a partial build")
    return config


def check_compatible(config: dict[str, Any], device: str | None) -> None:
    if config.get("model_type") != MODEL_TYPE:
        raise EngineError(
            "this engine computes the earlier, invented model, which is retired: rebuild it from a real "
            "Inkling checkpoint (`make engine`; python -m inkling.published.synth makes a synthetic one)"
        )
    if config["version"] != ENGINE_FORMAT_VERSION:
        raise EngineError(
            f"engine format version {config['version']} cannot be loaded by this version "
            f"(format {ENGINE_FORMAT_VERSION}): rebuild the engine with `make engine`"
        )
    for name, recorded in config["plugin_config"]["ops"].items():
        try:
            spec = plugins.get(name)
        except KeyError:
            raise EngineError(f"engine uses plugin {name!r}, which this installation does not have") from None
        if (
            recorded["version"] != spec.version
            or recorded.get("weight_layout_version") != spec.weight_layout_version
        ):
            raise EngineError(
                f"engine built with plugin {name} version {recorded['version']} "
                f"(weight layout {recorded.get('weight_layout_version')}), this installation has version "
                f"{spec.version} (weight layout {spec.weight_layout_version}): rebuild the engine"
            )
    want = device or config["device"]
    if config["device"] != want:
        raise EngineError(
            f"engine was built for {config['device']}, cannot run on {want}: rebuild it for {want}"
        )
    if want == "cuda" and not torch.cuda.is_available():
        raise EngineError("engine was built for cuda but no CUDA device is available here")
    if config["dtype"] not in ("bfloat16", "float32"):
        raise EngineError(f"engine dtype {config['dtype']!r} is not supported")
    if config.get("draft_vocab") is not None:
        from .draft_vocab import check_draft_vocab

        try:
            vocab_size = config["pretrained_config"]["text_config"]["vocab_size"]
            check_draft_vocab(config["draft_vocab"], vocab_size)
        except ValueError as e:
            raise EngineError(f"engine config is corrupt: {e}") from e


def model_config_of(config: dict[str, Any]) -> InklingConfig:
    """An engine's model config from its config.json (the published config, with the NVFP4 description if
    quantized)."""
    q = config.get("quantization")
    quant = QuantConfig.from_dict(q, "engine config.json: quantization") if q else None
    return InklingConfig.from_dict(config["pretrained_config"], "engine config.json", quant)


def world_size_of(config: dict[str, Any]) -> int:
    """The ranks an engine (its config.json) runs on: its mapping's world_size (BuildConfig.world_size)."""
    mapping = config.get("mapping", {})
    return mapping.get("world_size", mapping.get("tp_size", 1))


def check_mapping(engine_dir: str, config: dict[str, Any], rank: int, world_size: int | None) -> None:
    """The ranks launched must be the ranks the engine was built for."""
    mapping = config.get("mapping", {})
    n = world_size_of(config)
    split = f"tp_size {mapping.get('tp_size', 1)}, ep_size {mapping.get('ep_size', 1)}"
    if mapping.get("dp_size", 1) > 1:
        split += f", dp_size {mapping['dp_size']}"
    if world_size is not None and world_size != n:
        raise EngineError(
            f"engine {engine_dir} was built for {split} and runs on exactly {n} ranks, not {world_size}: "
            f"launch {n} ranks or rebuild it for {world_size}"
        )
    if not 0 <= rank < n:
        raise EngineError(f"engine {engine_dir} has ranks 0..{n - 1} ({split}), not rank {rank}")


def check_files(engine_dir: str, config: dict[str, Any], verify: str = "auto") -> None:
    """Every file the engine lists exists with its size; hashes checked for small files ("auto") or all ("full")."""
    for name, meta in config["files"].items():
        path = os.path.join(engine_dir, name)
        if not os.path.exists(path):
            raise EngineError(f"engine {engine_dir} is missing {name} (a partial copy?)")
        size = os.path.getsize(path)
        if size != meta["size"]:
            raise EngineError(
                f"engine file {name} has {size} bytes, expected {meta['size']} (truncated or replaced)"
            )
        if verify == "full" or (verify == "auto" and size < VERIFY_SHA256_BELOW):
            if _sha256(path) != meta["sha256"]:
                raise EngineError(f"engine file {name} is corrupt (sha256 mismatch)")

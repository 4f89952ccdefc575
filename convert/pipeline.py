"""The conversion: a validated bf16 checkpoint in, an NVFP4 checkpoint out, one tensor at a time.

Every tensor is read, converted if it is a routed expert linear, and written at its planned offset
before the next is read, so memory holds one input tensor and its outputs, never a layer. Every
other tensor is copied as read: the same bytes, never through another dtype.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from inkling.checkpoint import CONFIG_FILE, INDEX_FILE, CheckpointError, CheckpointReader, ShardedWriter
from inkling.config import InklingConfig
from inkling.tensors import expected_tensors, routed_expert_module

from . import output
from .calibrate import DEFAULT_NUM_PROMPTS, calibrate
from .errors import ConvertError
from .quantize import ExpertQuantizer, flat_quant_config, hf_quant_config, modelopt_version

HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
QUANT_METHODS = ("nvfp4",)
DEFAULT_MAX_SHARD_SIZE = "2GB"


@dataclass(frozen=True)
class ConvertResult:
    output_dir: str
    input_bytes: int
    output_bytes: int
    num_quantized: int
    calibrated: bool
    seconds: float

    @property
    def input_gb_per_s(self) -> float:
        return self.input_bytes / 1e9 / max(self.seconds, 1e-9)


def _looks_quantized(model_dir: str) -> bool:
    """A checkpoint that holds NVFP4 tensors or says it is quantized, whatever its config.json says."""
    if os.path.exists(os.path.join(model_dir, HF_QUANT_CONFIG_FILE)):
        return True
    try:
        with open(os.path.join(model_dir, INDEX_FILE)) as f:
            names = json.load(f).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return False
    return any(n.endswith((".weight_scale", ".weight_scale_2", ".input_scale")) for n in names)


def open_bf16_checkpoint(model_dir: str) -> CheckpointReader:
    """The input, validated: an Inkling checkpoint, complete, and not quantized yet."""
    try:
        reader = CheckpointReader(model_dir)
    except CheckpointError as e:
        if _looks_quantized(model_dir):
            raise ConvertError(f"{model_dir} is already quantized (it holds NVFP4 tensors): {e}") from e
        raise
    quantized = [n for n in reader.keys() if reader.dtype(n) != torch.bfloat16]
    if reader.config.is_quantized or quantized or _looks_quantized(model_dir):
        reader.close()
        if reader.config.is_quantized:
            what = "config.json has a quantization_config"
        else:
            what = "it holds non-bf16 tensors" if quantized else f"it has {HF_QUANT_CONFIG_FILE}"
        raise ConvertError(f"{model_dir} is already quantized ({what}): convert a bf16 checkpoint")
    return reader


def _write_configs(model_dir: str, out_dir: str, calibrated: bool) -> InklingConfig:
    """config.json as read plus quantization_config (every other field untouched), and hf_quant_config.json."""
    hf = hf_quant_config(calibrated)
    with open(os.path.join(model_dir, CONFIG_FILE)) as f:
        raw = json.load(f)
    raw["quantization_config"] = flat_quant_config(hf)
    output.write_json(os.path.join(out_dir, CONFIG_FILE), raw)
    output.write_json(os.path.join(out_dir, HF_QUANT_CONFIG_FILE), hf)
    return InklingConfig.from_dict(raw)


def _note_in_readme(out_dir: str, calibrated: bool) -> None:
    """A copied README describes the input: say what the conversion changed."""
    path = os.path.join(out_dir, "README.md")
    if os.path.isfile(path):
        how = "calibrated input scales" if calibrated else "uncalibrated (every input_scale 1.0)"
        with open(path, "a") as f:
            f.write(
                "\n## Converted to NVFP4\n\nThe routed experts were quantized to NVFP4 with ModelOpt by "
                f"`python -m convert` ({how}); every other tensor is the input's, bit for bit.\n"
            )


def _stream_tensors(
    reader: CheckpointReader,
    writer: ShardedWriter,
    quantizer: ExpertQuantizer,
    input_scales: dict[str, torch.Tensor] | None,
    progress: bool,
) -> int:
    num_quantized = 0
    bar = tqdm(total=reader.total_bytes, unit="B", unit_scale=True, desc="nvfp4", disable=not progress)
    with bar:
        for name in reader.keys():
            tensor = reader.get(name)
            module = routed_expert_module(name)
            if module is None:
                writer.write(name, tensor)
            else:
                weight, weight_scale, weight_scale_2 = quantizer(tensor)
                writer.write(f"{module}.weight", weight)
                writer.write(f"{module}.weight_scale", weight_scale)
                writer.write(f"{module}.weight_scale_2", weight_scale_2)
                scale = torch.ones((), dtype=torch.float32) if input_scales is None else input_scales[module]
                writer.write(f"{module}.input_scale", scale.float().reshape(()))
                num_quantized += 1
            del tensor
            bar.update(reader.nbytes(name))
    return num_quantized


def convert(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    quant: str = "nvfp4",
    calib: int = DEFAULT_NUM_PROMPTS,
    calib_data: str | os.PathLike | None = None,
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    workers: int = 2,
    progress: bool = False,
) -> ConvertResult:
    """Quantize the routed experts of a bf16 Inkling checkpoint to NVFP4 (INKLING_SPEC §9).

    calib: number of calibration prompts (the built-in texts or the lines of `calib_data`); 0 skips
    calibration (every input_scale 1.0, "calibrated": false). workers: threads quantizing each expert.
    """
    model_dir, output_dir = os.fspath(model_dir), os.fspath(output_dir)
    if quant not in QUANT_METHODS:
        raise ConvertError(f"unknown --quant {quant!r}; expected one of {list(QUANT_METHODS)}")
    if calib < 0:
        raise ConvertError(f"--calib must be >= 0 prompts, got {calib}")
    max_shard_bytes = output.parse_size(max_shard_size)
    modelopt_version()  # fail now, not after calibrating, when ModelOpt is missing
    output.check_output_path(model_dir, output_dir, force)
    start = time.perf_counter()
    with open_bf16_checkpoint(model_dir) as reader, ExpertQuantizer(workers) as quantizer:
        input_scales = calibrate(model_dir, reader.config, calib, calib_data)[0] if calib > 0 else None
        with output.atomic_output_dir(output_dir, force) as tmp:
            config = _write_configs(model_dir, tmp, calibrated=input_scales is not None)
            with ShardedWriter(tmp, expected_tensors(config), max_shard_bytes) as writer:
                num_quantized = _stream_tensors(reader, writer, quantizer, input_scales, progress)
            CheckpointReader(tmp).close()  # the output validates before it is published
            output.copy_side_files(
                model_dir, tmp, skip={CONFIG_FILE, INDEX_FILE, HF_QUANT_CONFIG_FILE, output.MANIFEST_FILE}
            )
            _note_in_readme(tmp, calibrated=input_scales is not None)
            output.write_manifest(tmp, num_threads=max(workers, 1))
            output_bytes = writer.total_bytes
    return ConvertResult(
        output_dir=output_dir,
        input_bytes=reader.total_bytes,
        output_bytes=output_bytes,
        num_quantized=num_quantized,
        calibrated=input_scales is not None,
        seconds=time.perf_counter() - start,
    )

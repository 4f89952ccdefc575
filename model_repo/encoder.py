"""The image_encoder and audio_encoder models: run one of the engine's exported encoder programs,
replayed from CUDA graphs per shape bucket when a GPU is present (eager on the CPU), on what
`preprocessing` produced; the output rows are the embeddings of the pad tokens of that modality, in
placeholder order."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.export.passes import move_to_device_pass

import plugins  # noqa: F401  (the programs may call torch.ops.inkling.*)
from builder.engine import read_engine_config
from model_repo.tensors import RequestError, error, fault, load_model_config, parameter, require, tensor
from runtime.encoder_graphs import GraphedEncoder


class EncoderModel:
    """TritonPythonModel for one encoder program, named by the `program` parameter."""

    def initialize(self, args: dict) -> None:
        cfg = load_model_config(args)
        engine_dir = parameter(cfg, "engine_dir")
        self.program_name = parameter(cfg, "program")
        self.input_name = cfg["input"][0]["name"]
        self.output_name = cfg["output"][0]["name"]
        engine = read_engine_config(engine_dir)
        self.dtype = getattr(torch, engine["dtype"])
        # The towers' inputs: pixel values [N, 2, 40, 40, 3], dMel levels [F, mel_bins]
        audio, vision = (
            engine["pretrained_config"]["audio_config"],
            engine["pretrained_config"]["vision_config"],
        )
        self.num_mels, self.num_levels = audio["n_mel_bins"], audio["mel_vocab_size"]
        self.patch_shape = (vision["temporal_patch_size"], vision["patch_size"], vision["patch_size"], 3)
        path = os.path.join(engine_dir, f"rank0.{self.program_name}.pt2")
        # An indexed device: the programs assert their input's device, and cuda != cuda:0.
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        program = torch.export.load(path)
        if engine["device"] != self.device.type:  # e.g. a CPU engine served on a GPU host
            program = move_to_device_pass(program, self.device)
        self.program = GraphedEncoder(
            program.module(), self.program_name, self.device, self.dtype, engine_config=engine
        )
        self.program.warmup()  # capture every bucket now, not on the first requests
        torch.set_num_threads(1)

    def execute(self, requests: list) -> list:
        return [self._run(r) for r in requests]

    @torch.no_grad()
    def _run(self, request: Any) -> Any:
        try:
            x = torch.from_numpy(np.ascontiguousarray(require(request, self.input_name)))
            self._check(x)
            if x.shape[0] == 0:
                out = torch.zeros(0, 0)
            else:
                out = self.program(x.to(self.device, self.dtype if x.is_floating_point() else x.dtype))
            return _response(self.output_name, out)
        except RequestError as e:
            return error(str(e))
        except Exception as e:  # a bad input must never take the model down
            return fault(f"{self.program_name} encoder failed: {type(e).__name__}: {e}")

    def _check(self, x: torch.Tensor) -> None:
        if self.program_name == "vision":
            if tuple(x.shape[1:]) != self.patch_shape:
                shape = ", ".join(map(str, self.patch_shape))
                raise RequestError(f"image patches must be [N, {shape}], got {list(x.shape)}")
            if not torch.isfinite(x).all():
                raise RequestError("image patches hold non-finite values")
            return
        if x.dim() != 2 or x.shape[1] != self.num_mels:
            raise RequestError(f"audio levels must be [F, {self.num_mels}], got {list(x.shape)}")
        if x.numel() and (x.min() < 0 or x.max() >= self.num_levels):
            raise RequestError(f"audio levels must lie in [0, {self.num_levels})")


def _response(name: str, out: torch.Tensor) -> Any:
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(output_tensors=[tensor(name, out.float().cpu().numpy(), np.float32)])

"""NVFP4 for the routed experts: ModelOpt's quantizer on a few threads, and the quantization config (§9)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from inkling import nvfp4
from inkling.tensors import NVFP4_BLOCK, NVFP4_EXCLUDE_MODULES

from .errors import ConvertError

QUANT_ALGO = "NVFP4"
# Enough row blocks per thread that the threads finish together, large enough to amortise the calls.
_CHUNKS_PER_THREAD = 8
_MIN_CHUNK_ROWS = 16


def modelopt_version() -> str:
    try:
        import modelopt
    except ImportError as e:
        raise ConvertError(
            "NVFP4 conversion needs NVIDIA ModelOpt (nvidia-modelopt): pip install .[convert]"
        ) from e
    return modelopt.__version__


def hf_quant_config(calibrated: bool) -> dict[str, Any]:
    """hf_quant_config.json, ModelOpt's own description of the checkpoint."""
    return {
        "producer": {"name": "modelopt", "version": modelopt_version()},
        "quantization": {
            "quant_algo": QUANT_ALGO,
            "group_size": NVFP4_BLOCK,
            "kv_cache_quant_algo": None,
            "calibrated": calibrated,
            "exclude_modules": list(NVFP4_EXCLUDE_MODULES),
        },
    }


def flat_quant_config(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's quantization_config: hf_quant_config's "quantization", flattened, with quant_method."""
    return {"quant_method": "modelopt", **hf["quantization"]}


class ExpertQuantizer:
    """Quantizes one weight at a time with ModelOpt, split into row blocks over `num_threads` threads.

    ModelOpt's CPU quantization is single-threaded torch ops that release the GIL; with the global scale
    computed once for the whole tensor, each row block quantizes exactly as inside the whole tensor,
    so the result is bit-identical to one `NVFP4QTensor.quantize` call.
    """

    def __init__(self, num_threads: int = 1) -> None:
        if num_threads < 1:
            raise ConvertError(f"--workers must be at least 1, got {num_threads}")
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="nvfp4") if num_threads > 1 else None

    def __call__(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """weight [out, in] -> (weight uint8 [out, in/2], weight_scale fp8 [out, in/16], weight_scale_2 f32 [])."""
        scale_2 = nvfp4.global_scale(weight)
        rows = weight.shape[0]
        chunk = max(_MIN_CHUNK_ROWS, math.ceil(rows / (self.num_threads * _CHUNKS_PER_THREAD)))
        if self._pool is None or rows <= chunk:
            return nvfp4.quantize(weight, scale_2)
        parts = list(
            self._pool.map(lambda r: nvfp4.quantize(weight[r : r + chunk], scale_2), range(0, rows, chunk))
        )
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), scale_2

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> ExpertQuantizer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

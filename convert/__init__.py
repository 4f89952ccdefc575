"""Checkpoint -> checkpoint: NVFP4 quantization of the routed experts with ModelOpt (INKLING_SPEC §9).

    python -m convert --model_dir build/inkling-tiny --output_dir build/inkling-tiny-nvfp4 --quant nvfp4

    from convert import convert
    result = convert("build/inkling-tiny", "build/inkling-tiny-nvfp4", quant="nvfp4", calib=8)

Modules: `pipeline` (the streaming conversion), `quantize` (experts through ModelOpt, the quantization
config), `calibrate` (input scales from the reference model), `output` (atomic output dir, manifest).
"""

from .errors import ConvertError
from .pipeline import QUANT_METHODS, ConvertResult, convert

__all__ = ["QUANT_METHODS", "ConvertError", "ConvertResult", "convert"]

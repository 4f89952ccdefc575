"""A BF16 checkpoint of the real Inkling in, the published NVFP4 layout out, with ModelOpt (convert/published.py).

    python -m convert --model_dir BF16_DIR --output_dir NVFP4_DIR [--quantize_first_moe]

    from convert import convert
    config = convert("build/inkling-tiny", "build/inkling-tiny-nvfp4", calibration_prompts_n=8)

Modules: `published` (the conversion and its calibration), `output` (the atomic output directory and the
side files), `errors`.
"""

from .errors import ConvertError
from .published import convert

__all__ = ["ConvertError", "convert"]

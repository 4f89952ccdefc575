"""`python -m convert --model_dir IN --output_dir OUT --quant nvfp4 [--calib N] [--calib_data FILE] ...`"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from inkling.checkpoint import CheckpointError
from inkling.config import ConfigError

from .calibrate import DEFAULT_NUM_PROMPTS
from .errors import ConvertError
from .pipeline import DEFAULT_MAX_SHARD_SIZE, QUANT_METHODS, convert


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m convert",
        description="Quantize the routed experts of a bf16 Inkling checkpoint to NVFP4 with ModelOpt.",
    )
    p.add_argument("--model_dir", required=True, help="the bf16 checkpoint")
    p.add_argument("--output_dir", required=True, help="where to write the quantized checkpoint")
    p.add_argument("--quant", default="nvfp4", help=f"quantization: one of {', '.join(QUANT_METHODS)}")
    p.add_argument(
        "--calib",
        type=int,
        default=DEFAULT_NUM_PROMPTS,
        help="calibration prompts for input_scale: the first N built-in texts or --calib_data lines "
        "(runs the float32 reference model on the CPU); 0 skips calibration: input_scale 1.0",
    )
    p.add_argument("--calib_data", default=None, help="a text file, one calibration prompt per line")
    p.add_argument("--force", action="store_true", help="replace an existing --output_dir")
    p.add_argument("--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE, help="e.g. 2GB, 500MB, 4GiB")
    p.add_argument(
        "--workers", type=int, default=min(2, os.cpu_count() or 1), help="threads quantizing each expert"
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # A terminated conversion unwinds like an interrupted one, so its temp dir is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        result = convert(
            args.model_dir,
            args.output_dir,
            quant=args.quant,
            calib=args.calib,
            calib_data=args.calib_data,
            force=args.force,
            max_shard_size=args.max_shard_size,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except (ConvertError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {result.output_dir}: {result.num_quantized} NVFP4 expert linears, "
        f"{result.input_bytes / 1e9:.2f} GB -> {result.output_bytes / 1e9:.2f} GB in {result.seconds:.1f} s "
        f"({result.input_gb_per_s:.3f} GB/s of input), calibrated: {str(result.calibrated).lower()}"
    )
    return 0

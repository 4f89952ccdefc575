"""`python -m builder`: a trtllm-build-like CLI for Inkling engines.

    python -m builder --checkpoint_dir build/inkling-tiny-nvfp4 --output_dir build/engine-tiny \
        [--max_batch_size 8 --max_seq_len 2048 --max_num_tokens 2048 --tp_size 1 --dtype bfloat16 --device cpu]
        [--export_onnx step.onnx [--onnx_weights inputs|external]] [--draft_vocab vocab.json]

--export_onnx PATH also writes the step program as ONNX, plugins as nodes of the domain inkling.plugins
(builder/onnx_export.py); a PATH without a directory goes into the engine's output_dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .build import build
from .config import BuildConfig, PluginConfig
from .engine import EngineError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m builder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--force", action="store_true", help="replace an existing output_dir")
    ap.add_argument("--export_onnx", metavar="PATH", help="also write the step program as ONNX")
    ap.add_argument(
        "--onnx_weights",
        choices=("inputs", "external"),
        default="inputs",
        help="ONNX weights as graph inputs, or as initializers in PATH.data",
    )
    ap.add_argument(
        "--draft_vocab",
        metavar="FILE",
        help="JSON list of the token ids the MTP heads may draft (python -m builder.draft_vocab makes one)",
    )
    for f in dataclasses.fields(BuildConfig):
        if f.name == "plugin_config":
            continue
        if f.name == "compile":
            ap.add_argument(
                "--compile", action="store_true", help="torch.compile at build and save the compiler caches"
            )
            continue
        ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    for f in dataclasses.fields(PluginConfig):  # an op's impl is --NAME_plugin; a setting is --NAME
        kind = (
            (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(f.default, bool) else type(f.default)
        )
        ap.add_argument(_plugin_flag(f), type=kind, default=f.default)
    return ap.parse_args(argv)


def _plugin_flag(f: dataclasses.Field) -> str:
    return f"--{f.name}_plugin" if isinstance(f.default, str) else f"--{f.name}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plugin = PluginConfig(
        **{f.name: getattr(args, _plugin_flag(f)[2:]) for f in dataclasses.fields(PluginConfig)}
    )
    fields = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(BuildConfig) if f.name != "plugin_config"
    }
    start = time.perf_counter()
    try:
        draft_vocab = None
        if args.draft_vocab:
            from .draft_vocab import load_draft_vocab

            draft_vocab = load_draft_vocab(args.draft_vocab)
        engine = build(
            args.checkpoint_dir, BuildConfig(**fields, plugin_config=plugin), draft_vocab=draft_vocab
        )
        engine.save(args.output_dir, force=args.force)
        if args.export_onnx:
            from .onnx_export import export_onnx

            onnx_path = args.export_onnx
            if not os.path.dirname(onnx_path):
                onnx_path = os.path.join(args.output_dir, onnx_path)
            export_onnx(engine, onnx_path, weights=args.onnx_weights)
            print(f"[build] ONNX written to {onnx_path}")
    except (ValueError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[build] engine written to {args.output_dir} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

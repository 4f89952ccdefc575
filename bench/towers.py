"""Benchmark: the real Inkling's vision tower and audio embedding at batch 1, eager vs CUDA graphs.

    python -m bench.towers                                   # the H200 run, bf16
    python -m bench.towers --device cpu --out build/towers   # CPU smoke (padded eager, tiny shapes)

The towers of inkling-tiny are the real ones (the presets keep the towers at their published widths), so
the engine built from a synthetic inkling-tiny checkpoint runs exactly the full model's encoder programs.
The runner's encoders (runtime/encoder_graphs.py GraphedEncoder around the exported programs) are timed
against their own programs called eager. Workloads at batch 1: images of 448x448 and 1024x1024 pixels
(one row per 40x40 patch: 121 and 625 rows), audio of 5 s and 30 s (20 tokens a second). Each is checked
first (graphed against eager), then timed: the median over single calls of
CUDA-event time from an idle device to the call's last kernel (the host's launches included) and wall
time to synchronize. Writes towers.json and towers.md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from builder import BuildConfig, build
from inkling.published.config import preset
from inkling.published.synth import write_checkpoint
from runtime.model_runner import ModelRunner

WARMUP = 10


def latency_ms(fn, x: torch.Tensor, device: torch.device, reps: int) -> tuple[float, float]:
    """Median (device ms, wall ms) of single calls fn(x), each started on an idle device."""
    for _ in range(WARMUP):
        fn(x)
    gpu, wall = [], []
    cuda = device.type == "cuda"
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        if cuda:
            start.record()
        fn(x)
        if cuda:
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(gpu or wall), statistics.median(wall)


def workloads(image_sides: list[int], audio_seconds: list[float], patch: int) -> list[tuple[str, str, int]]:
    out = [(f"image {s}x{s}", "vision", (s // patch) ** 2) for s in image_sides]
    out += [(f"audio {s:g} s", "audio", int(s * 20)) for s in audio_seconds]
    return out


def make_input(config, kind: str, rows: int, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "vision":
        v = config.vision
        shape = (rows, v.temporal_patch_size, v.patch_size, v.patch_size, v.num_channels)
        return torch.randn(shape, generator=g, device=device).to(dtype)
    a = config.audio
    return torch.randint(0, a.mel_vocab_size, (rows, a.n_mel_bins), generator=g, device=device)


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = preset("inkling-tiny")
    rows_needed = max(
        r for _, _, r in workloads(args.image_sides, args.audio_seconds, config.vision.patch_size)
    )
    with tempfile.TemporaryDirectory(prefix="bench-towers-") as tmp:
        write_checkpoint(os.path.join(tmp, "ckpt"), config, seed=args.seed)
        bc = BuildConfig(
            dtype=args.dtype, device=args.device, max_batch_size=1, max_input_len=max(rows_needed, 64),
            max_seq_len=max(rows_needed, 64) + 16, max_num_tokens=64,
        )  # fmt: skip
        engine = build(os.path.join(tmp, "ckpt"), bc, echo=False)
    runner = ModelRunner(engine, cuda_graphs=False, pad_eager=device.type == "cpu")
    if device.type == "cpu":  # the padded eager path: a smoke run of the script, not a measurement
        for enc in (runner.vision, runner.audio):
            enc.pad_eager = True
    print(f"[bench] the real towers on {device}, {args.dtype}", flush=True)
    out = []
    for i, (name, kind, rows) in enumerate(
        workloads(args.image_sides, args.audio_seconds, config.vision.patch_size)
    ):
        enc = runner.vision if kind == "vision" else runner.audio
        x = make_input(config, kind, rows, dtype, device, args.seed + i)
        with torch.no_grad():
            t0 = time.perf_counter()
            got = enc(x)  # a bucket's first call captures its graph
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_ms = (time.perf_counter() - t0) * 1e3
            diff = (got.float() - enc.program(x).float()).abs().max().item()
            eager_ms, eager_wall = latency_ms(enc.program, x, device, args.reps)
            graphed_ms, graphed_wall = latency_ms(enc, x, device, args.reps)
        row = dict(
            name=name, kind=kind, input=list(x.shape), rows=rows, bucket=enc.bucket(x), eager_ms=eager_ms,
            graphed_ms=graphed_ms, eager_wall_ms=eager_wall, graphed_wall_ms=graphed_wall,
            speedup=eager_ms / graphed_ms, first_call_ms=first_ms, max_abs_diff=diff,
        )  # fmt: skip
        print(f"[bench] {name}: eager {eager_ms:.3f} ms, graphed {graphed_ms:.3f} ms ({row['speedup']:.2f}x), "
              f"max |diff| {diff:.3g}", flush=True)  # fmt: skip
        out.append(row)
    return {
        "command": "python -m bench.towers " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "dtype": args.dtype,
        "reps": args.reps,
        "workloads": out,
    }


def write_table(r: dict, path: str) -> None:
    lines = [
        "# The real towers at batch 1: eager vs CUDA graphs",
        "",
        f"Command: `{r['command']}`; device {r['device']}; torch {r['torch']}; date {r['date']}; {r['dtype']}; "
        f"median of {r['reps']} single calls after warm-up, input on the device.",
        "",
        "| workload | input | bucket | eager ms | graphed ms | speedup | eager / graphed wall ms | first call ms "
        "| max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in r["workloads"]:
        lines.append(
            f"| {w['name']} | {w['input']} | {w['bucket']} | {w['eager_ms']:.3f} | {w['graphed_ms']:.3f} "
            f"| {w['speedup']:.2f}x | {w['eager_wall_ms']:.3f} / {w['graphed_wall_ms']:.3f} "
            f"| {w['first_call_ms']:.1f} | {w['max_abs_diff']:.3g} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.towers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--image-sides", default=None, help="pixels, comma-separated (default 448,1024; CPU 80)")
    ap.add_argument("--audio-seconds", default=None, help="comma-separated (default 5,30; CPU 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 200; CPU 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default bench/results on CUDA, build/towers on the CPU")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.argv = sys.argv[1:] if argv is None else argv
    args.image_sides = [int(s) for s in (args.image_sides or ("80" if cpu else "448,1024")).split(",")]
    args.audio_seconds = [float(s) for s in (args.audio_seconds or ("1" if cpu else "5,30")).split(",")]
    args.reps = args.reps or (3 if cpu else 200)
    args.out = args.out or ("build/towers" if cpu else "bench/results")
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "towers.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_table(results, os.path.join(args.out, "towers.md"))
    print(open(os.path.join(args.out, "towers.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())

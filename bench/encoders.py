"""Benchmark: the image and audio encoders at batch 1, eager vs CUDA graphs (runtime/encoder_graphs.py).

    python -m bench.encoders                                            # the H200 run, inkling-bench, bf16
    python -m bench.encoders --device cpu --out build/bench-encoders    # CPU smoke: inkling-tiny, tiny shapes

Only the vision.* and audio.* tensors of the synthetic checkpoint are drawn (inkling.synth seeds each
tensor by its name, so they are the full model's), then exported as the build does
(builder.build.export_encoders). Workloads at batch 1: one image of 448x448 and one of 1024x1024
pixels (784 and 4096 patches), audio of 5 s and 30 s (126 and 751 tokens). Each is verified first
(graphed output against eager), then timed on random inputs already on the device: the median over
single calls of CUDA-event time from an idle GPU to the call's last kernel, which includes the host's
launch time (the cost graphs remove; triton's do_bench would hide it behind its L2 flush), and the
wall time of the same calls up to synchronize. On the CPU, "graphed" is the bucketed path (padded,
eager): the smoke run checks the script, not speed. Writes encoders.json and encoders.md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

from builder.build import export_encoders
from builder.config import BuildConfig
from inkling.synth import _bf16_tensor, _generator, synth_config
from inkling.tensors import encoder_tensors
from runtime.encoder_graphs import GraphedEncoder

WARMUP = 10
GOAL = 2.0  # graphed at least 2x lower latency than eager


def synth_encoders(config, seed: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The synthetic checkpoint's vision.* and audio.* tensors (the same bytes as inkling.synth's)."""
    return {
        name: _bf16_tensor(name, shape, config, _generator(seed, name, device), device, 1.0).to(dtype)
        for name, shape in encoder_tensors(config)
    }


def workloads(config, image_sides: list[int], audio_seconds: list[float]) -> list[tuple[str, str, int]]:
    """(name, kind, rows): patches of one image, tokens of one clip (F = 1 + samples // hop, padded
    to a multiple of frame_stack, as inkling.processing.audio.dmel_levels)."""
    out = [(f"image {s}x{s}", "vision", (s // 16) ** 2) for s in image_sides]
    a = config.audio
    for seconds in audio_seconds:
        frames = 1 + max(int(seconds * a.sample_rate), a.n_fft) // a.hop_length
        out.append((f"audio {seconds:g} s", "audio", -(-frames // a.frame_stack)))
    return out


def make_input(config, kind: str, rows: int, dtype: torch.dtype, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "vision":  # normalised pixels
        return torch.randn(rows, 16, 16, 3, generator=g, device=device).to(dtype)
    a = config.audio
    return torch.randint(0, a.num_levels, (a.num_mels, rows * a.frame_stack), generator=g, device=device)


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


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config, _ = synth_config(args.preset)
    bc = BuildConfig(dtype=args.dtype, device=args.device)
    print(f"[bench] {args.preset} encoders on {device}, {args.dtype}", flush=True)
    with torch.no_grad():
        programs = export_encoders(
            config, bc, synth_encoders(config, args.seed, device, dtype), device, dtype
        )
    engine_config = {"pretrained_config": config.to_dict(), "build_config": bc.to_dict()}
    eager = {k: p.module() for k, p in programs.items()}
    graphed = {
        k: GraphedEncoder(m, k, device, dtype, engine_config=engine_config, pad_eager=device.type == "cpu")
        for k, m in eager.items()
    }
    rows_out = []
    for i, (name, kind, rows) in enumerate(workloads(config, args.image_sides, args.audio_seconds)):
        x = make_input(config, kind, rows, dtype, device, args.seed + i)
        enc = graphed[kind]
        with torch.no_grad():
            t0 = time.perf_counter()
            out = enc(x)  # the first call of a bucket captures its graph
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_ms = (time.perf_counter() - t0) * 1e3
            diff = (out.float() - eager[kind](x).float()).abs().max().item()
            eager_ms, eager_wall = latency_ms(eager[kind], x, device, args.reps)
            graphed_ms, graphed_wall = latency_ms(enc, x, device, args.reps)
        row = dict(
            name=name, kind=kind, input=list(x.shape), rows=rows, bucket=enc.bucket(x),
            eager_ms=eager_ms, graphed_ms=graphed_ms, eager_wall_ms=eager_wall,
            graphed_wall_ms=graphed_wall, speedup=eager_ms / graphed_ms, first_call_ms=first_ms,
            max_abs_diff=diff,
        )  # fmt: skip
        print(
            f"[bench] {name}: eager {eager_ms:.3f} ms, graphed {graphed_ms:.3f} ms "
            f"({row['speedup']:.2f}x), max |diff| {diff:.3g}",
            flush=True,
        )
        rows_out.append(row)
    return {
        "command": "python -m bench.encoders " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "preset": args.preset,
        "dtype": args.dtype,
        "reps": args.reps,
        "goal_speedup": GOAL,
        "workloads": rows_out,
    }


def write_table(r: dict, path: str) -> None:
    lines = [
        "# Encoders at batch 1: eager vs CUDA graphs",
        "",
        f"Command: `{r['command']}`; device {r['device']}; torch {r['torch']}; date {r['date']}; "
        f"preset {r['preset']}, {r['dtype']}; median of {r['reps']} single calls after warm-up, input on "
        f"the device. Goal: graphed at least {r['goal_speedup']:g}x lower latency than eager.",
        "",
        *(
            ["On the CPU 'graphed' is the padded eager path (no graphs): a smoke run, not a measurement.", ""]
            if r["device"] == "cpu"
            else []
        ),  # fmt: skip
        "| workload | input | rows | bucket | eager ms | graphed ms | speedup | eager / graphed wall ms "
        "| first call (capture) ms | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in r["workloads"]:
        lines.append(
            f"| {w['name']} | {w['input']} | {w['rows']} | {w['bucket']} | {w['eager_ms']:.3f} "
            f"| {w['graphed_ms']:.3f} | {w['speedup']:.2f}x | {w['eager_wall_ms']:.3f} / {w['graphed_wall_ms']:.3f} "
            f"| {w['first_call_ms']:.1f} | {w['max_abs_diff']:.3g} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.encoders",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="default: inkling-bench on CUDA, inkling-tiny on the CPU")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--image-sides", default=None, help="pixels, comma-separated (default 448,1024; CPU 32,64)"
    )
    ap.add_argument("--audio-seconds", default=None, help="comma-separated (default 5,30; CPU 0.5,2)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 200; CPU 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=None, help="default bench/results on CUDA, build/bench-encoders on the CPU"
    )
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.argv = sys.argv[1:] if argv is None else argv
    args.preset = args.preset or ("inkling-tiny" if cpu else "inkling-bench")
    args.image_sides = [int(s) for s in (args.image_sides or ("32,64" if cpu else "448,1024")).split(",")]
    args.audio_seconds = [float(s) for s in (args.audio_seconds or ("0.5,2" if cpu else "5,30")).split(",")]
    args.reps = args.reps or (5 if cpu else 200)
    args.out = args.out or ("build/bench-encoders" if cpu else "bench/results")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "encoders.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_table(results, os.path.join(args.out, "encoders.md"))
    print(open(os.path.join(args.out, "encoders.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())

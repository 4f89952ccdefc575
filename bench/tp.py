"""Tensor parallelism on the GPU host: the real Inkling's greedy tokens and decode speed of tp_size N
against tp_size 1 (builder/tensor_parallel.py).

    python -m bench.tp --preset inkling-bench --tp 2 --work /tmp/tp --out DIR [--cuda_graphs]   # 2 GPUs
    python -m bench.tp --preset inkling-bench --layers 2 ...   # its last 2 layers (one full): saved sooner
    python -m bench.tp --preset inkling-tiny --device cpu --tp 2 --context 64 --tokens 4 --work DIR --out DIR

One prompt of `--context` random tokens, greedy, batch 1:
- tp_size 1: the engine built in memory on the first GPU;
- tp_size N: built in memory, saved to `--work` (a tensor-parallel engine runs from its directory: each
  rank loads its part), run by an LLM that starts its N-1 worker processes, one GPU per rank.
Each decode step is timed once the prompt is in (bench.e2e.decode_run). The bound per GPU is the bytes
a rank reads per step (bench/bound.py with tp_size: the router and the relative banks are read whole by
every rank) over GPU.md's bandwidth; the collectives' latency (four per layer) is not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import shutil
import sys
import time

import torch

from builder import BuildConfig, PluginConfig
from builder.build import build_from_tensors
from builder.profiles import BuildLog
from inkling.published.config import preset
from inkling.published.synth import iter_tensors
from runtime import LLM

from .bound import decode_step_bytes
from .e2e import decode_run, random_prompt, timed


def bench_config(name: str, layers: int | None):
    """The preset with NVFP4 experts, cut to its last `layers` layers (inkling-bench's last is full)."""
    c = preset(name, nvfp4=True)
    if not layers:
        return c
    t = c.text
    text = dataclasses.replace(
        t,
        num_hidden_layers=layers,
        layer_types=t.layer_types[-layers:],
        mlp_layer_types=t.mlp_layer_types[-layers:],
    )
    return c.replace(text=text)


def build_engine(args: argparse.Namespace, config, tp_size: int):
    bc = BuildConfig(
        max_batch_size=1, max_input_len=args.context, max_seq_len=args.context + args.tokens,
        max_num_tokens=args.context, dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device, tp_size=tp_size,
        plugin_config=PluginConfig(
            tune=args.device == "cuda", tune_max_tokens=args.tune_max_tokens, collectives=args.collectives
        ),
    )  # fmt: skip
    tensors = iter_tensors(config, args.seed, args.device)
    return timed(lambda: build_from_tensors(config, tensors, bc, BuildLog(echo=False), has_mtp=False))


def run(llm: LLM, prompt: torch.Tensor, args: argparse.Namespace) -> tuple[dict, list[int]]:
    decode = argparse.Namespace(output_len=args.tokens, decode_budget_s=args.decode_budget_s)
    figures, tokens = decode_run(llm, [prompt], decode)
    figures.pop("expert_loads")  # the routing's counts, which bench.e2e turns into its bound; not used here
    if args.cuda_graphs:
        figures["graph_stats"] = llm.engine.runner.graph_stats()
    return figures, tokens[0]


def run_tp(args: argparse.Namespace, config, n: int, prompt: torch.Tensor) -> tuple[list[int], dict]:
    """Build tp_size n in memory, save it, run it from its directory with its workers; then remove it."""
    engine, build_s = build_engine(args, config, n)
    _log(f"tp {n}: built in {build_s:.1f} s, saving")
    path = os.path.join(args.work, f"tp{n}")
    start = time.perf_counter()
    engine.save(path, force=True)
    save_s = time.perf_counter() - start
    del engine
    _free(args.device)
    _log(f"tp {n}: saved in {save_s:.1f} s, loading (rank 0 here, the others as workers)")
    llm, load_s = timed(lambda: LLM(path, cuda_graphs=args.cuda_graphs, overlap=args.tp_overlap or None))
    _log(f"tp {n}: loaded in {load_s:.1f} s, running")
    try:
        figures, tokens = run(llm, prompt, args)
    finally:
        llm.shutdown()
        shutil.rmtree(path, ignore_errors=True)
    del llm
    _free(args.device)
    return tokens, {"build_s": build_s, "save_s": save_s, "load_s": load_s, **figures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="inkling-bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", default="2", help="tensor-parallel sizes to compare with tp_size 1")
    ap.add_argument(
        "--layers", type=int, help="fewer layers than the preset (a smaller engine to save and load)"
    )
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--decode_budget_s", type=float, default=60.0)
    ap.add_argument("--cuda_graphs", action="store_true")
    ap.add_argument(
        "--tp_overlap",
        action="store_true",
        help="overlapped steps for tp_size > 1 too (tp_size 1 has them by default on the GPU)",
    )
    ap.add_argument(
        "--collectives", default="auto", help="auto (NCCL/gloo) or triton (the Lamport kernel, CUDA)"
    )
    ap.add_argument(
        "--tune_max_tokens",
        type=int,
        default=8,
        help="tune the MoE tiles of decode-sized buckets only (batch 1 here; prefill keeps the defaults)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--work", required=True, help="where the tensor-parallel engines are saved (then removed)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda":  # a stall (a collective, a load) says where it is, once a minute
        faulthandler.dump_traceback_later(60, repeat=True)
    config = bench_config(args.preset, args.layers)
    prompt = random_prompt(config, args.context, args.seed)
    results: dict = {
        "command": " ".join(["python", "-m", "bench.tp", *(sys.argv[1:] if argv is None else argv)]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset + (f" with {args.layers} layers" if args.layers else ""),
        "cuda_graphs": args.cuda_graphs,
        "collectives": args.collectives,
        "runs": {},
    }
    engine, build_s = build_engine(args, config, 1)
    _log(f"tp 1: built in memory in {build_s:.1f} s, running")
    llm = LLM(engine, cuda_graphs=args.cuda_graphs)
    figures, want = run(llm, prompt, args)
    results["runs"][1] = {"build_s": build_s, **figures}
    print(f"[bench] tp 1: {figures}", flush=True)
    del llm, engine
    _free(args.device)
    for n in (int(x) for x in args.tp.split(",")):
        if args.device == "cuda" and n > torch.cuda.device_count():
            results["runs"][n] = {"skipped": f"{torch.cuda.device_count()} GPUs"}
            continue
        (got, results["runs"][n]) = run_tp(args, config, n, prompt)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        results["runs"][n].update(
            tokens_equal_tp1=got == want, first_divergence=None if got == want else same
        )
        print(f"[bench] tp {n}: {results['runs'][n]}", flush=True)
    kv_len = args.context + args.tokens // 2
    for n, r in results["runs"].items():
        if "step_s_median" in r:
            bound = decode_step_bytes(config, kv_len, tp_size=n)
            r["bound_bytes_per_gpu"] = bound.total
            r["bound_tokens_per_s"] = 1 / bound.seconds
            r["fraction_of_bound"] = bound.seconds / r["step_s_median"]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_table(results, os.path.join(args.out, "results.md"))
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


def _log(message: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {message}", flush=True)


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def write_table(r: dict, path: str) -> None:
    lines = [
        f"Command: `{r['command']}`; device {r['device']}; date {r['date']}; preset {r['preset']}; "
        f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}; collectives {r['collectives']}; batch 1.",
        "",
        "| tp_size | greedy tokens = tp 1 | tokens | step median (p10–p90) | tokens/s per user | "
        "bound per GPU (bytes; tokens/s) | fraction of bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, x in r["runs"].items():
        if "skipped" in x:
            lines.append(f"| {n} | skipped: {x['skipped']} | | | | | |")
            continue
        same = (
            "reference"
            if int(n) == 1
            else ("yes" if x["tokens_equal_tp1"] else f"first {x['first_divergence']}")
        )
        lines.append(
            f"| {n} | {same} | {x['tokens_per_request']} | {x['step_s_median'] * 1e3:.2f} ms "
            f"({x['step_s_p10'] * 1e3:.2f}–{x['step_s_p90'] * 1e3:.2f}) | {x['tokens_per_s_per_user']:.1f} | "
            f"{x['bound_bytes_per_gpu'] / 1e9:.2f} GB; {x['bound_tokens_per_s']:.0f} | {x['fraction_of_bound']:.1%} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

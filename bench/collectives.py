"""Benchmark: Lamport one-shot reduce-scatter / all-gather against NCCL, one process per GPU.

    python -m bench.collectives --world_size N --out DIR

Shapes: T = 1, 8, 64 tokens x 7168 channels, bf16 (a TP layer's close at decode and verify). Each rank
first checks every path against plugins.collectives.reference on random data, then times it: a CUDA
graph of `--inner` back-to-back collectives replayed `--reps` times (median replay / inner: the
latency a CUDA-graph decode step sees), and one collective per iteration eager (`--iters`, median).
Event times are per rank; the figure is the slowest rank's median. Paths:

- lamport: LamportCommunicator (the one-shot Triton kernel);
- nccl: ProcessGroupCommunicator("nccl"), the contract's exact sum (all-to-all, float32 sum in rank
  order) and all_gather_into_tensor;
- nccl native: NCCL's own bf16 reduce_scatter_tensor / all_gather_into_tensor (its best form; its
  bf16 sum is not the contract's for N > 2).

With fewer GPUs than --world_size and --world_size 2, both ranks share GPU 0 (CUDA IPC, time-sliced):
correctness and a latency labelled shared-GPU, which measures the GPU's time slicing, not the kernel;
NCCL is skipped there (it refuses two ranks on one GPU). Writes results.json and results.md to DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

CHANNELS = 7168
TOKENS = (1, 8, 64)
DTYPE = torch.bfloat16
OPS = ("reduce_scatter", "all_gather")


def log(*a) -> None:
    print(*a, flush=True)


def _native(op: str, group):
    """NCCL's own collective on [T, C] / [T, C/N] bf16 (no layout copies beyond what it needs)."""
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = dist.get_world_size(group)

    def reduce_scatter(x):
        send = x.view(x.shape[0], n, -1).transpose(0, 1).contiguous()
        out = x.new_empty((x.shape[0], x.shape[1] // n))
        rs(out, send, group=group)
        return out

    def all_gather(x):
        out = x.new_empty((n * x.shape[0], x.shape[1]))
        ag(out, x, group=group)
        return out.view(n, x.shape[0], -1).transpose(0, 1).reshape(x.shape[0], -1)

    return reduce_scatter if op == "reduce_scatter" else all_gather


def _inputs(
    num_tokens: int, op: str, rank: int, n: int, seed: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's input (CPU) and the expected result on this rank."""
    from plugins.collectives import reference

    g = torch.Generator().manual_seed(seed)
    width = CHANNELS if op == "reduce_scatter" else CHANNELS // n
    xs = [torch.randn(num_tokens, width, generator=g).to(DTYPE) for _ in range(n)]
    want = reference.reduce_scatter(xs, rank) if op == "reduce_scatter" else reference.all_gather(xs)
    return xs, want


def _check(fn, num_tokens: int, op: str, rank: int, n: int, device) -> dict:
    worst, exact = 0.0, True
    for seed in range(5):
        xs, want = _inputs(num_tokens, op, rank, n, seed)
        got = fn(xs[rank].to(device)).cpu()
        exact &= torch.equal(got, want)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return dict(exact=bool(exact), max_abs_diff=worst)


def _time(fn, x: torch.Tensor, iters: int, inner: int, reps: int) -> dict:
    """Median µs per collective: eager (events around each call) and CUDA graph (inner calls per replay)."""
    for _ in range(10):
        fn(x)
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn(x)
        end.record()
    torch.cuda.synchronize()
    out = dict(eager_us=statistics.median(s.elapsed_time(e) for s, e in events) * 1e3)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn(x)
        graph.replay()
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        out["graph_us"] = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / inner
    except Exception as exc:  # noqa: BLE001  (a path that cannot be captured: every rank fails alike)
        out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def _rank_main(rank: int, args: argparse.Namespace, init_file: str, shared: bool, queue) -> None:
    try:
        queue.put(dict(rank=rank, rows=_bench_rank(rank, args, init_file, shared)))
    except Exception:  # noqa: BLE001  (reported by the parent)
        queue.put(dict(rank=rank, error=traceback.format_exc()))


def _bench_rank(rank: int, args: argparse.Namespace, init_file: str, shared: bool) -> list[dict]:
    import plugins  # noqa: F401
    from plugins import collectives

    n = args.world_size
    device = torch.device("cuda", 0 if shared else rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo" if shared else "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=300),
        **({} if shared else dict(device_id=device)),
    )
    paths = {"lamport": collectives.init_communicator("lamport", rank=rank, world_size=n, device=device)}
    if not shared:
        paths["nccl"] = collectives.init_communicator("nccl", rank=rank, world_size=n, device=device)
    rows = []
    for num_tokens in TOKENS:
        for op in OPS:
            fns = {name: getattr(comm, op) for name, comm in paths.items()}
            if not shared:
                fns["nccl native"] = _native(op, None)
            xs, _ = _inputs(num_tokens, op, rank, n, seed=100)
            x = xs[rank].to(device)
            for name, fn in fns.items():
                row = dict(op=op, tokens=num_tokens, path=name, **_check(fn, num_tokens, op, rank, n, device))
                row.update(_time(fn, x, args.iters, args.inner, args.reps))
                rows.append(row)
                dist.barrier()
    dist.barrier()
    paths["lamport"].close()
    dist.destroy_process_group()
    return rows


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """The slowest rank's figures; exact only if exact on every rank."""
    rows = []
    for same in zip(*per_rank):
        row = dict(same[0])
        row["exact"] = all(r["exact"] for r in same)
        row["max_abs_diff"] = max(r["max_abs_diff"] for r in same)
        for key in ("eager_us", "graph_us"):
            if all(key in r for r in same):
                row[key] = max(r[key] for r in same)
                row[f"{key}_per_rank"] = [round(r[key], 2) for r in same]
        rows.append(row)
    return rows


def write_results(rows: list[dict], meta: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    label = " (two ranks sharing one GPU: time-sliced, not a kernel latency)" if meta["shared_gpu"] else ""
    lines = [
        f"# Collectives: Lamport vs NCCL, {meta['world_size']} ranks{label}",
        "",
        f"Command: `{meta['command']}`; GPU: {meta['gpu']} x {meta['num_gpus_used']}; date: {meta['date']}; "
        f"torch {meta['torch']}, triton {meta['triton']}. {CHANNELS} channels, bf16. Median µs per "
        "collective, slowest rank: CUDA graph of back-to-back calls (graph) and one call per iteration (eager).",
        "",
        "| op | tokens | path | graph µs | eager µs | exact vs reference | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        graph = f"{r['graph_us']:.1f}" if "graph_us" in r else "n/a"
        lines.append(
            f"| {r['op']} | {r['tokens']} | {r['path']} | {graph} | {r['eager_us']:.1f} | "
            f"{'yes' if r['exact'] else 'no'} | {r['max_abs_diff']:.3g} |"
        )
    if meta.get("skipped"):
        lines += ["", f"Skipped: {meta['skipped']}"]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world_size", type=int, default=2)
    p.add_argument(
        "--out", default="bench/results/collectives", help="directory for results.json, results.md"
    )
    p.add_argument("--iters", type=int, default=0, help="eager iterations (0: 300, 40 on a shared GPU)")
    p.add_argument("--inner", type=int, default=0, help="collectives per graph (0: 20, 4 on a shared GPU)")
    p.add_argument("--reps", type=int, default=0, help="graph replays (0: 50, 10 on a shared GPU)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.collectives needs CUDA")
    num_gpus = torch.cuda.device_count()
    shared = num_gpus < args.world_size
    if shared and args.world_size != 2:
        raise SystemExit(f"--world_size {args.world_size} needs {args.world_size} GPUs (found {num_gpus})")
    args.iters = args.iters or (40 if shared else 300)
    args.inner = args.inner or (4 if shared else 20)
    args.reps = args.reps or (10 if shared else 50)
    started = datetime.datetime.now().isoformat(timespec="minutes")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_rank_main, args=(rank, args, os.path.join(tmp, "pg"), shared, queue), daemon=True
            )
            for rank in range(args.world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            reports = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    errors = [r for r in reports if "error" in r]
    if errors:
        raise SystemExit("\n".join(f"rank {r['rank']} failed:\n{r['error']}" for r in errors))
    import triton

    meta = dict(
        command=f"python -m bench.collectives --world_size {args.world_size} --out {args.out}",
        gpu=torch.cuda.get_device_name(0),
        num_gpus_used=1 if shared else args.world_size,
        world_size=args.world_size,
        shared_gpu=shared,
        date=started,
        torch=torch.__version__,
        triton=triton.__version__,
        iters=args.iters,
        inner=args.inner,
        reps=args.reps,
        skipped="NCCL (it refuses two ranks on one GPU)" if shared else "",
    )
    write_results(_merge([r["rows"] for r in reports]), meta, args.out)


if __name__ == "__main__":
    main()

"""torch.profiler tables the benchmarks write beside their results (bench.e2e, bench.mtp)."""

from __future__ import annotations

import torch


def write_profile(fn, count: int, path: str, what: str, device: str) -> None:
    """A torch.profiler table of `count` calls of fn into path: by device time on the GPU (host time on
    the CPU), then by host time. The file's first line is "{count} {what}, by {key}"."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(count):
            fn()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    with open(path, "w") as f:
        f.write(f"{count} {what}, by {key}\n")
        f.write(table.table(sort_by=key, row_limit=40) + "\n\nby self_cpu_time_total\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    print(f"[bench] profile of {count} {what} written to {path}", flush=True)

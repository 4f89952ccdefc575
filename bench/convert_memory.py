"""Peak memory and throughput of `python -m convert` on a one-layer slice of inkling-bench.

    python -m bench.convert_memory --synth --cleanup          # about 34 GB in, 14 GB out of /tmp

Synthesizes (with --synth) the bf16 slice `inkling-bench --layers 1 --mtp-heads 0` (the full model's
per-layer shapes: 256 routed experts of 2560 x 7168, embeddings of 200192 x 7168), converts it with
`--calib 0` in a child process and reads that child's peak RSS from wait4(). Also times one expert
linear through ModelOpt with 1 and 2 threads. Writes the figures, with the command, machine and date,
to bench/results/convert.md. Not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from convert.quantize import ExpertQuantizer
from inkling.checkpoint import CheckpointReader
from inkling.config import preset
from inkling.tensors import expected_tensors

RESULTS = os.path.join(os.path.dirname(__file__), "results", "convert.md")


def _nbytes(specs: dict) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs.values())


def slice_bytes() -> tuple[int, int]:
    """(bf16 input, NVFP4 output) bytes of the one-layer, no-MTP slice."""
    config = preset("inkling-bench", num_hidden_layers=1, num_mtp_heads=0)
    quantized = config.replace(quantization_config={"quant_algo": "NVFP4"})
    return _nbytes(expected_tensors(config)), _nbytes(expected_tensors(quantized))


def synthesize(model_dir: str) -> None:
    need_in, need_out = slice_bytes()
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(model_dir))).free
    if free < need_in + need_out + 5e9:
        raise SystemExit(
            f"need {(need_in + need_out) / 1e9:.0f} GB free beside {model_dir}, have {free / 1e9:.0f} GB"
        )
    cmd = [sys.executable, "-m", "inkling.synth", "--preset", "inkling-bench", "--layers", "1"]
    subprocess.run([*cmd, "--mtp-heads", "0", "--seed", "0", "--out", model_dir], check=True)


def time_one_expert(threads: int, repeats: int = 3) -> float:
    """Median seconds to quantize one 2560 x 7168 bf16 expert linear."""
    w = torch.randn(2560, 7168, generator=torch.Generator().manual_seed(0)).bfloat16()
    with ExpertQuantizer(threads) as quantize:
        quantize(w)  # warm-up: imports ModelOpt
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            quantize(w)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def drop_from_page_cache(model_dir: str) -> None:
    """Evict the input's pages (only this checkpoint's files), so that the conversion reads from disk."""
    for name in os.listdir(model_dir):
        fd = os.open(os.path.join(model_dir, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_convert(model_dir: str, output_dir: str, workers: int) -> tuple[list[str], float, Any, str]:
    """(command, wall seconds, rusage, its summary line) of one conversion in a child process."""
    drop_from_page_cache(model_dir)
    cmd = [sys.executable, "-m", "convert", "--model_dir", model_dir, "--output_dir", output_dir]
    cmd += ["--quant", "nvfp4", "--calib", "0", "--force", "--workers", str(workers), "--no_progress"]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    out = child.stdout.read().strip() if child.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"conversion failed ({status}): {out}")
    return cmd, wall, usage, out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()}-core CPU ({cpu}), {mem:.0f} GiB RAM, no GPU"


def report(
    args: argparse.Namespace,
    cmd: list[str],
    wall: float,
    usage: Any,
    load: tuple[float, float],
    summary: str,
    t1: float,
    t2: float,
) -> str:
    rss = usage.ru_maxrss * 1024  # KiB on Linux
    cpu = usage.ru_utime + usage.ru_stime
    input_bytes = CheckpointReader(args.model_dir).total_bytes
    output_bytes = sum(os.path.getsize(os.path.join(args.output_dir, f)) for f in os.listdir(args.output_dir))
    largest = max(CheckpointReader(args.model_dir).nbytes(n) for n in CheckpointReader(args.model_dir).keys())
    import modelopt

    cmd_text = " ".join(["python", *cmd[1:]])
    return f"""# NVFP4 conversion: peak memory and throughput

- Command: `{cmd_text}` (run by `python -m bench.convert_memory`)
- Input: `python -m inkling.synth --preset inkling-bench --layers 1 --mtp-heads 0` (bf16, {input_bytes / 1e9:.1f} GB;
  768 routed expert linears of 2560 x 7168, the rest copied)
- Machine: {machine()}; torch {torch.__version__}, modelopt {modelopt.__version__}
- Date: {datetime.date.today().isoformat()}

| figure | value |
|---|---|
| peak RSS of the converter process (wait4 ru_maxrss) | {rss / 2**30:.2f} GiB |
| largest single input tensor (embed_tokens / lm_head) | {largest / 2**30:.2f} GiB |
| wall time (process start to exit, incl. ModelOpt import and manifest hashing) | {wall:.0f} s |
| CPU time of the converter (user + system) | {cpu:.0f} s ({cpu / wall:.2f} cores busy on average) |
| throughput | {input_bytes / 1e9 / wall:.3f} GB/s of input |
| load average before / after (other jobs shared the 2 cores) | {load[0]:.2f} / {load[1]:.2f} |
| output on disk | {output_bytes / 1e9:.2f} GB |
| one expert linear (2560 x 7168) through ModelOpt, 1 thread | {t1:.2f} s |
| the same, 2 threads (row blocks, `--workers 2`) | {t2:.2f} s |

The converter's own summary: `{summary}`

Peak memory is one input tensor plus its outputs plus the interpreter, torch and ModelOpt
({(rss - largest) / 2**30:.2f} GiB above the largest tensor): the largest tensors are the embedding and
lm_head, copied one at a time; no layer is ever held. Tensors are read with plain reads, not mmap, so
the RSS counts no page cache.
Time is ModelOpt's CPU quantization ({t2:.2f} s per linear on 2 threads x 768 linears per layer): the
full inkling-bench (6 layers) would take about 6x as long, the 66-layer model about 66x.
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.convert_memory", description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default="/tmp/bench1-bf16")
    p.add_argument("--output_dir", default="/tmp/bench1-nvfp4")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--synth", action="store_true", help="synthesize --model_dir first if it is missing")
    p.add_argument("--cleanup", action="store_true", help="delete the output (and a synthesized input) after")
    p.add_argument("--results", default=RESULTS)
    args = p.parse_args(argv)
    synthesized = args.synth and not os.path.exists(args.model_dir)
    if synthesized:
        synthesize(args.model_dir)
    try:
        t1, t2 = time_one_expert(1), time_one_expert(2)
        load_before = os.getloadavg()[0]
        cmd, wall, usage, summary = run_convert(args.model_dir, args.output_dir, args.workers)
        text = report(args, cmd, wall, usage, (load_before, os.getloadavg()[0]), summary, t1, t2)
    finally:
        if args.cleanup:
            shutil.rmtree(args.output_dir, ignore_errors=True)
            if synthesized:
                shutil.rmtree(args.model_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()

"""Benchmark: generated tokens/s through Triton against the in-process runtime (CPU or GPU engine).

    .venv/bin/python -m bench.serving --engine build/engine-tiny --out bench/results/serving.md

The same text prompts, greedy, `--max-tokens` each (EOS ignored by neither side: a request that stops
early counts the tokens it made). In-process: `LLM.generate` on all prompts at once (one batch, no
transport). Triton: all prompts at once as concurrent streams on one gRPC connection to `ensemble`
(preprocessing -> inkling, streamed deltas), and the same as unary HTTP calls to `ensemble_unary`
from as many threads; tokens/s counts completion tokens over the wall time of the whole burst, and
time to first token is measured on the streams. A figure, not a test: it never fails on speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import queue
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from model_repo.serve import ServeConfig, TritonServer, free_port
from runtime import LLM, SamplingParams


def prompts(n: int) -> list[str]:
    return [f"Request {i}: tell me about the number {i * 7} and what follows it." for i in range(n)]


def in_process(llm: LLM, texts: list[str], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(max_tokens=max_tokens))
    wall = time.perf_counter() - t0
    tokens = sum(o.completion_tokens for o in outs)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": None}


def grpc_inputs(mod, text: str, max_tokens: int, stream: bool) -> list:
    out = []
    for name, array, dtype in (
        ("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        ("stream", np.array([stream]), "BOOL"),
    ):
        x = mod.InferInput(name, list(array.shape), dtype)
        x.set_data_from_numpy(array)
        out.append(x)
    return out


def triton_streams(url: str, texts: list[str], max_tokens: int) -> dict:
    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((time.perf_counter(), result, error)))
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        client.async_stream_infer(
            "ensemble", grpc_inputs(grpcclient, text, max_tokens, True), request_id=str(i)
        )
    first: dict[str, float] = {}
    tokens, done, responses = 0, 0, 0
    while done < len(texts):
        t, res, err = got.get(timeout=600)
        if err is not None:
            raise RuntimeError(err)
        responses += 1
        rid = res.get_response().id
        first.setdefault(rid, t - t0)
        if res.as_numpy("finish_reason")[0]:
            done += 1
            tokens += int(res.as_numpy("completion_tokens")[0])
    wall = time.perf_counter() - t0
    client.stop_stream()
    client.close()
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_s": statistics.median(first.values()),
        "responses": responses,
    }


def relay_counters(metrics_url: str) -> tuple[float, float]:
    """(responses, seconds) the `ensemble` BLS has relayed so far, from Triton's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    got = {}
    for line in text.splitlines():
        for name in ("inkling_relay_responses_total", "inkling_relay_seconds_total"):
            if line.startswith(name + "{") and 'model="ensemble"' in line:
                got[name] = float(line.rsplit(" ", 1)[1])
    return got.get("inkling_relay_responses_total", 0.0), got.get("inkling_relay_seconds_total", 0.0)


def relayed(metrics_url: str, run):
    """run() -> its result, with the relay's cost per response during it (µs) when it streamed."""
    n0, s0 = relay_counters(metrics_url)
    r = run()
    n1, s1 = relay_counters(metrics_url)
    if r is not None and n1 > n0:
        r["relay_us"] = (s1 - s0) / (n1 - n0) * 1e6
    return r


def triton_unary(url: str, texts: list[str], max_tokens: int) -> dict | None:
    try:
        import tritonclient.http as httpclient
    except (ImportError, RuntimeError):  # no geventhttpclient (the GPU host carries the gRPC client only)
        return None

    def one(text: str) -> int:
        client = httpclient.InferenceServerClient(url)
        try:
            r = client.infer("ensemble_unary", grpc_inputs(httpclient, text, max_tokens, False))
            return int(r.as_numpy("completion_tokens")[0])
        finally:
            client.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        tokens = sum(pool.map(one, texts))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="build/engine-tiny")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine, both sides")
    p.add_argument("--out", default="bench/results/serving.md")
    p.add_argument("--server-log", default=None, help="where tritonserver's log goes (default: a temp dir)")
    args = p.parse_args()
    rows = []
    torch.set_num_threads(args.threads)
    llm = LLM(args.engine)
    llm.generate(prompts(1), SamplingParams(max_tokens=2))  # warm-up
    with tempfile.TemporaryDirectory() as work:
        cfg = ServeConfig(
            engine_dir=args.engine,
            work_dir=work,
            http_port=free_port(),
            grpc_port=free_port(),
            metrics_port=free_port(),
            engine_threads=args.threads,
        )
        t0 = time.perf_counter()
        with TritonServer(cfg, log_path=args.server_log) as server:
            startup = time.perf_counter() - t0
            triton_streams(cfg.grpc_url, prompts(1), 2)  # warm-up
            for n in args.requests:
                texts = prompts(n)
                for name, run in (
                    ("in-process LLM.generate", lambda t=texts: in_process(llm, t, args.max_tokens)),
                    (
                        "Triton gRPC streams (ensemble)",
                        lambda t=texts: triton_streams(cfg.grpc_url, t, args.max_tokens),
                    ),
                    (
                        "Triton HTTP unary (ensemble_unary)",
                        lambda t=texts: triton_unary(cfg.http_url, t, args.max_tokens),
                    ),
                ):
                    r = run()  # untimed: the first run of a batch size compiles its kernels (Triton JIT)
                    r = r and relayed(cfg.metrics_url, run)
                    if r is None:
                        print(f"{n:3d} requests  {name:36s} skipped: its client is not installed", flush=True)
                        continue
                    rows.append((n, name, r))
                    print(
                        f"{n:3d} requests  {name:36s} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens']} tokens, {r['wall_s']:.2f} s)"
                        + (f", relay {r['relay_us']:.0f} us/response" if "relay_us" in r else ""),
                        flush=True,
                    )
            server_log = server.log_path
    write(args, rows, startup, server_log)


def write(args: argparse.Namespace, rows: list, startup: float, server_log: object) -> None:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    lines = [
        f"# Serving: tokens/s through Triton vs in-process ({'GPU' if gpu else 'CPU'}, tiny engine)",
        "",
        f"Command: `.venv/bin/python -m bench.serving --engine {args.engine} --max-tokens {args.max_tokens} "
        f"--requests {' '.join(map(str, args.requests))} --threads {args.threads}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other work: load average "
        f"{os.getloadavg()[0]:.1f}), {args.threads} engine thread(s) on both sides, {gpu or 'no GPU'}; "
        f"torch {torch.__version__}. Date: {datetime.date.today().isoformat()}. Triton start-up: {startup:.1f} s.",
        "",
        f"Greedy, {args.max_tokens} new tokens per request, all requests sent at once. Completion tokens over the "
        "wall time of the burst; TTFT is the median time to a stream's first delta. Each path runs twice per "
        "batch size and the second run is timed (the first compiles Triton kernels for new shapes)."
        + (
            ""
            if gpu
            else " With torch's default of 2 threads on this shared 2-core machine OpenMP oversubscription made "
            "the in-process runtime 10x slower (1.2 vs 15.8 tok/s for one request), hence one thread each."
        ),
        "",
        "Streams: responses per token is what reached the client (below 1 when `inkling`'s sender merged",
        "deltas it had queued); relay µs is the `ensemble` BLS's wall time per response, from its arrival",
        "from `inkling` to its send (`inkling_relay_seconds_total` / `inkling_relay_responses_total`).",
        "",
        "| requests | path | tokens | wall (s) | tokens/s | median TTFT (s) | responses per token | relay µs per response |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, name, r in rows:
        ttft = "" if r["ttft_s"] is None else f"{r['ttft_s']:.3f}"
        per_token = f"{r['responses'] / r['tokens']:.2f}" if r.get("responses") else ""
        relay = f"{r['relay_us']:.0f}" if "relay_us" in r else ""
        lines.append(
            f"| {n} | {name} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {ttft} | {per_token} | {relay} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Benchmark: generated tokens/s through Triton against the in-process runtime (CPU or GPU engine).

    .venv/bin/python -m bench.serving --engine build/engine-tiny --out bench/results/serving.md

The same text prompts, greedy, `--max-tokens` each (EOS ignored by neither side: a request that stops
early counts the tokens it made). In-process: `LLM.generate` on all prompts at once (one batch, no
transport). Triton: all prompts at once as concurrent streams on one gRPC connection to `ensemble`
(preprocessing -> inkling, streamed deltas), and the same as unary HTTP calls to `ensemble_unary`
from as many threads; tokens/s counts completion tokens over the wall time of the whole burst, and
time to first token is measured on the streams; and, where the OpenAI front's packages are installed,
the same burst as streamed completions through the OpenAI-compatible API (model_repo/openai_front.py)
with the official `openai` client. With `--aiperf BIN`, AIPerf then loads the OpenAI API at each
`--requests` concurrency (`make bench-serving` installs it in a venv of its own). A figure, not a test:
it never fails on speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import platform
import queue
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from model_repo.serve import OpenAIServer, ServeConfig, TritonServer, free_port
from runtime import LLM, SamplingParams

MODEL = "inkling"
has_openai = all(importlib.util.find_spec(m) for m in ("openai", "fastapi", "uvicorn"))


def prompts(n: int) -> list[str]:
    return [f"Request {i}: tell me about the number {i * 7} and what follows it." for i in range(n)]


def in_process(llm: LLM, texts: list[str], max_tokens: int) -> dict:
    before = {k: float(getattr(llm.engine.stats, k)) for k in ENGINE_STATS}
    t0 = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(max_tokens=max_tokens))
    wall = time.perf_counter() - t0
    tokens = sum(o.completion_tokens for o in outs)
    after = {k: float(getattr(llm.engine.stats, k)) for k in ENGINE_STATS}
    ttft = statistics.median(o.metrics["ttft_s"] for o in outs)  # from arrival in the engine
    r = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": ttft}
    return engine_figures(r, before, after)


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


ENGINE_STATS = ("steps", "step_seconds", "generated_tokens", "first_tokens", "ttft_seconds")
METRICS_LAG_S = 0.3  # `inkling` publishes its engine's totals every 0.1 s


def counters(metrics_url: str) -> dict[str, float]:
    """From Triton's /metrics: the responses and seconds the `ensemble` BLS has relayed, and the served
    engine's totals (steps, the host's seconds inside them, generated tokens)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    got = dict.fromkeys(("relay_responses", "relay_seconds", *ENGINE_STATS), 0.0)
    for line in text.splitlines():
        for name in ("responses", "seconds"):
            if line.startswith(f"inkling_relay_{name}_total{{") and 'model="ensemble"' in line:
                got[f"relay_{name}"] = float(line.rsplit(" ", 1)[1])
        for stat in ENGINE_STATS:
            if line.startswith(f'inkling_engine_stats{{stat="{stat}"}}'):
                got[stat] = float(line.rsplit(" ", 1)[1])
    return got


def engine_figures(r: dict, before: dict, after: dict) -> dict:
    """r with the engine's figures over the run: steps, host ms per step, tokens per step, and the share
    of the wall time the engine spent inside steps."""
    steps = after["steps"] - before["steps"]
    if steps > 0:
        seconds = after["step_seconds"] - before["step_seconds"]
        r["steps"] = int(steps)
        r["step_ms"] = seconds / steps * 1e3
        r["tokens_per_step"] = (after["generated_tokens"] - before["generated_tokens"]) / steps
        r["engine_busy"] = seconds / r["wall_s"]
    firsts = after["first_tokens"] - before["first_tokens"]
    if firsts > 0:
        r["engine_ttft_s"] = (after["ttft_seconds"] - before["ttft_seconds"]) / firsts
    return r


def measured(metrics_url: str, run):
    """run() -> its result, with the relay's cost per response during it (µs) when it streamed and the
    served engine's figures (engine_figures)."""
    time.sleep(METRICS_LAG_S)
    before = counters(metrics_url)
    r = run()
    time.sleep(METRICS_LAG_S)
    after = counters(metrics_url)
    if r is None:
        return None
    if after["relay_responses"] > before["relay_responses"]:
        r["relay_us"] = (
            (after["relay_seconds"] - before["relay_seconds"])
            / (after["relay_responses"] - before["relay_responses"])
            * 1e6
        )
    return engine_figures(r, before, after)


def openai_streams(url: str, model: str, texts: list[str], max_tokens: int) -> dict:
    """All prompts at once as streamed completions through the OpenAI-compatible front, with the official
    client from as many threads (its sync client: the async one failed on the GPU host, with that host's
    own aiohttp and event loop packages beside ours): tokens/s over the burst and the median time to a
    first token."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    def one(text: str) -> tuple[float | None, int]:
        first, tokens = None, 0
        stream = client.completions.create(model=model, prompt=text, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(one, texts))
    wall = time.perf_counter() - t0
    client.close()
    tokens = sum(n for _, n in got)
    firsts = [f for f, _ in got if f is not None]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_s": statistics.median(firsts) if firsts else None}  # fmt: skip


def aiperf(
    binary: str, url: str, model: str, tokenizer: str, concurrency: int, max_tokens: int, out: str
) -> dict:
    """AIPerf (NVIDIA's load generator, pip `aiperf`) against the OpenAI front: `concurrency` streams kept
    busy over 4 × concurrency requests (at least 8) of synthetic 128-token prompts and `max_tokens`
    outputs (ignore_eos); its TTFT, inter-token latency and throughputs from its JSON export."""
    cmd = [binary, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--concurrency", str(concurrency), "--request-count", str(max(8, 4 * concurrency)),
           "--synthetic-input-tokens-mean", "128", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(max_tokens), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--tokenizer", tokenizer, "--ui-type", "none",
           "--artifact-dir", out]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=1800)
    with open(os.path.join(out, "profile_export_aiperf.json")) as f:
        d = json.load(f)
    return {
        "concurrency": concurrency,
        "requests": d["request_count"]["avg"],
        "ttft_ms": (d["time_to_first_token"]["p50"], d["time_to_first_token"]["p99"]),
        "itl_ms": (d["inter_token_latency"]["p50"], d["inter_token_latency"]["p99"]),
        "tokens_per_s": d["output_token_throughput"]["avg"],
        "per_user": d["output_token_throughput_per_user"]["avg"],
        "command": " ".join(cmd),
    }


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
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine, both sides")
    p.add_argument("--out", default="bench/results/serving.md")
    p.add_argument("--server-log", default=None, help="where tritonserver's log goes (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the median is reported")
    p.add_argument(
        "--aiperf", default=None, help="AIPerf's executable: also run it at each --requests concurrency"
    )
    p.add_argument(
        "--engine-modes",
        nargs="+",
        choices=["process", "thread"],
        default=["process"],
        help="where the served engine steps: its own process (the default) or a thread of the `inkling` stub; "
        "one server per mode",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.engine)
    llm.generate(prompts(1), SamplingParams(max_tokens=2))  # warm-up
    startup = {}
    with contextlib.ExitStack() as stack:
        paths = {  # name -> (batch size -> one timed run)
            "in-process LLM.generate": lambda n: functools.partial(
                in_process, llm, prompts(n), args.max_tokens
            )
        }
        for mode in args.engine_modes:  # every server up at once; an idle one takes no CPU
            cfg = ServeConfig(
                engine_dir=args.engine,
                work_dir=stack.enter_context(tempfile.TemporaryDirectory()),
                http_port=free_port(),
                grpc_port=free_port(),
                metrics_port=free_port(),
                engine_threads=args.threads,
                engine_process=mode == "process",
            )
            log_path = args.server_log and f"{args.server_log}.{mode}"
            t0 = time.perf_counter()
            stack.enter_context(TritonServer(cfg, log_path=log_path))
            startup[mode] = time.perf_counter() - t0
            triton_streams(cfg.grpc_url, prompts(1), 2)  # warm-up
            front = None
            if has_openai:
                front_log = args.server_log and f"{args.server_log}.openai.{mode}"
                front = stack.enter_context(OpenAIServer(cfg, free_port(), MODEL, log_path=front_log))
            paths |= served_paths(cfg, mode, args.max_tokens, front)
        rows = []
        for n in args.requests:
            runs = {name: make(n) for name, make in paths.items()}
            for name, run in list(runs.items()):
                if run() is None:  # untimed: the first run of a batch size compiles its kernels (Triton JIT)
                    print(f"{n:3d} requests  {name:50s} skipped: its client is not installed", flush=True)
                    del runs[name]
            # The paths take turns, `repeats` rounds: a host that slows down for a while (a neighbour on a
            # shared machine) slows all of them alike, not the one that happened to run then.
            results: dict[str, list[dict]] = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    results[name].append(run())
            rows += [(n, name, report(n, name, median(got))) for name, got in results.items()]
        loads = []
        if args.aiperf and front is not None:
            for n in args.requests:
                out = stack.enter_context(tempfile.TemporaryDirectory())
                loads.append(aiperf(args.aiperf, front.url.removesuffix("/v1"), MODEL,
                                    args.engine, n, args.max_tokens, out))  # fmt: skip
                print(f"AIPerf {n:3d} streams: {loads[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    write(args, rows, startup, loads)


def served_paths(
    cfg: ServeConfig, mode: str, max_tokens: int, front: OpenAIServer | None
) -> dict[str, Callable[[int], Callable]]:
    """One server's paths: name -> (batch size -> one timed run, with the relay's and engine's figures)."""

    def streams(n: int) -> Callable:
        return functools.partial(
            measured, cfg.metrics_url, functools.partial(triton_streams, cfg.grpc_url, prompts(n), max_tokens)
        )

    def unary(n: int) -> Callable:
        return functools.partial(
            measured, cfg.metrics_url, functools.partial(triton_unary, cfg.http_url, prompts(n), max_tokens)
        )

    def openai(n: int) -> Callable:
        return functools.partial(
            measured,
            cfg.metrics_url,
            functools.partial(openai_streams, front.url, MODEL, prompts(n), max_tokens),
        )

    paths = {
        f"Triton gRPC streams (ensemble), engine {mode}": streams,
        f"Triton HTTP unary (ensemble_unary), engine {mode}": unary,
    }
    if front is not None:
        paths[f"OpenAI API streams (front -> ensemble), engine {mode}"] = openai
    return paths


def median(runs: list[dict]) -> dict:
    """The run of median tokens/s (with the spread of all of them)."""
    runs.sort(key=lambda r: r["tokens_per_s"])
    r = runs[len(runs) // 2]
    r["spread"] = (runs[0]["tokens_per_s"], runs[-1]["tokens_per_s"])
    return r


def report(n: int, name: str, r: dict) -> dict:
    print(
        f"{n:3d} requests  {name:50s} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens']} tokens, {r['wall_s']:.2f} s)"
        + (f", relay {r['relay_us']:.0f} us/response" if "relay_us" in r else ""),
        flush=True,
    )
    return r


def write(args: argparse.Namespace, rows: list, startup: dict[str, float], loads: list[dict]) -> None:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    lines = [
        f"# Serving: tokens/s through Triton vs in-process ({'GPU' if gpu else 'CPU'}, tiny engine)",
        "",
        f"Command: `.venv/bin/python -m bench.serving --engine {args.engine} --max-tokens {args.max_tokens} "
        f"--requests {' '.join(map(str, args.requests))} --threads {args.threads} "
        f"--repeats {args.repeats} --engine-modes {' '.join(args.engine_modes)}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other work: load average "
        f"{os.getloadavg()[0]:.1f}), {args.threads} engine thread(s) on both sides, {gpu or 'no GPU'}; "
        f"torch {torch.__version__}. Date: {datetime.date.today().isoformat()}. Triton start-up: "
        + ", ".join(f"{t:.1f} s (engine {mode})" for mode, t in startup.items())
        + ".",
        "",
        f"Greedy, {args.max_tokens} new tokens per request, all requests sent at once. Completion tokens over the "
        "wall time of the burst; TTFT is the median time to a stream's first delta. Each path runs once "
        f"untimed per batch size (the first run compiles Triton kernels for new shapes), then {args.repeats} times, "
        "the paths taking turns (every server is up throughout; an idle one takes no CPU): the table has the run of median tokens/s, and the lowest and highest tokens/s of the runs."
        + (
            ""
            if gpu
            else " With torch's default of 2 threads on this shared 2-core machine OpenMP oversubscription made "
            "the in-process runtime 10x slower (1.2 vs 15.8 tok/s for one request), hence one thread each."
        ),
        "",
        "Engine process: the served engine steps in a process of its own (runtime.engine_process), apart",
        "from the `inkling` stub's GIL; engine thread: on a thread of the stub, sharing its GIL.",
        "",
        "Streams: responses per token is what reached the client (below 1 when `inkling`'s sender merged",
        "deltas it had queued); relay µs is the `ensemble` BLS's wall time per response, from its arrival",
        "from `inkling` to its send (`inkling_relay_seconds_total` / `inkling_relay_responses_total`).",
        "Engine: the steps the engine took during the run, tokens generated per step, the host's wall time",
        "per step (inside LLMEngine.step), and the share of the run's wall time spent inside steps (served:",
        "`inkling_engine_stats` on /metrics); the mean TTFT in the engine runs from a request's arrival in",
        "the engine (the median TTFT is the client's, from sending).",
        "",
        "| requests | path | tokens | wall (s) | tokens/s | (lowest–highest) | median TTFT (s) | responses per token "
        "| relay µs per response | engine steps | tokens per step | host ms per step | engine busy "
        "| mean TTFT in the engine (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, name, r in rows:
        ttft = "" if r["ttft_s"] is None else f"{r['ttft_s']:.3f}"
        per_token = f"{r['responses'] / r['tokens']:.2f}" if r.get("responses") else ""
        relay = f"{r['relay_us']:.0f}" if "relay_us" in r else ""
        spread = "{:.0f}–{:.0f}".format(*r["spread"])
        engine = (
            f"{r['steps']} | {r['tokens_per_step']:.1f} | {r['step_ms']:.2f} | {r['engine_busy']:.0%} "
            f"| {r.get('engine_ttft_s', float('nan')):.3f}"
            if "steps" in r
            else " | | | | "
        )
        lines.append(
            f"| {n} | {name} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {spread} | {ttft} | {per_token} | {relay} | {engine} |"
        )
    if loads:
        lines += [
            "",
            "## AIPerf against the OpenAI API",
            "",
            f"`{loads[0]['command']}` (and the same at each concurrency): synthetic 128-token prompts, "
            f"{args.max_tokens} output tokens (ignore_eos), streamed; TTFT and inter-token latency p50 / p99 "
            "as AIPerf measures them at the client.",
            "",
            "| concurrency | requests | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | output tokens/s | tokens/s per user |",
            "|---|---|---|---|---|---|",
        ]
        for r in loads:
            lines.append(
                f"| {r['concurrency']} | {r['requests']:.0f} | {r['ttft_ms'][0]:.1f} / {r['ttft_ms'][1]:.1f} "
                f"| {r['itl_ms'][0]:.2f} / {r['itl_ms'][1]:.2f} | {r['tokens_per_s']:.1f} | {r['per_user']:.1f} |"
            )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

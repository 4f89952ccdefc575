"""`python -m bench.long_context`: the real Inkling's long path on one GPU, in one run of at most ten minutes.

    python -m bench.long_context --out build/bench-long                 # the H200 run (inkling-bench)
    python -m bench.long_context --preset inkling-tiny --device cpu --contexts 256,1024 --users_context 512 \\
        --neighbour_context 512 --chunk 64 --output_len 4 --out DIR                          # a smoke run

inkling-bench (six NVFP4 MoE layers of the 1T at full width: five sliding, one full) is synthesized where it
runs and built in memory, decode steps replayed from CUDA graphs. Prompts are random token ids, each its own
(no prefix-cache hits). Measured, saved after each phase (a run cut short keeps what it measured):

- contexts: for each length, one request alone: time to first token against its FLOP bound (790 TFLOP/s)
  and the median inter-token latency of its next `--output_len` tokens against the byte bound of a step at
  that context (weights + KV + the relative bank, 4.35 TB/s; bench/bound.py);
- neighbour: a short request decoding alone, then a prompt of `--neighbour_context` tokens arriving beside
  it: the short one's inter-token latency idle and while the long prompt fills, with whole chunks, with the
  scheduler's `max_prefill_pairs` (a chunk beside decodes keeps tokens x (context + tokens) within chunk x
  chunk), and with those chunks paced by `--decode_slowdown` (the short one's mean step within that multiple
  of its idle step: runtime/scheduler.py PrefillPacer);
- users: `--users` requests of `--users_context` tokens together: their first tokens, then the batch's
  inter-token latency against the bound of a step of that batch;
- a torch.profiler table of decode steps at the longest context (host and device time by op).

Writes results.json, results.md and long_context.png (latency against context, with the bounds) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from builder import BuildConfig, PluginConfig
from builder.build import build_from_tensors
from builder.profiles import BuildLog
from inkling.published.config import preset
from inkling.published.synth import iter_tensors
from runtime import LLM, PromptInput, SamplingParams
from runtime.scheduler import PrefillPacer

from .bound import BANDWIDTH, decode_batch_seconds, decode_step_bytes, prefill_flops
from .e2e import random_prompt, timed
from .profiling import write_profile

FLOPS = 790e12
SHORT_PROMPT = 512  # the neighbour's prompt


class Driver:
    """Steps an LLMEngine and stamps every token of every request with the time its step returned (with
    overlapped steps, the time between returns is what a streaming user sees)."""

    def __init__(self, llm: LLM):
        self.eng = llm.engine
        self.stamps: dict[str, list[float]] = {}
        self.added: dict[str, float] = {}

    def add(self, rid: str, ids: torch.Tensor, max_tokens: int) -> None:
        self.eng.add_request(rid, PromptInput(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.stamps[rid], self.added[rid] = [], time.perf_counter()

    def step(self) -> None:
        deltas = self.eng.step()
        now = time.perf_counter()
        for d in deltas:
            self.stamps[d.request_id] += [now] * len(d.token_ids)

    def until(self, done) -> None:
        while self.eng.has_unfinished() and not done():
            self.step()

    def ttft(self, rid: str) -> float:
        return self.stamps[rid][0] - self.added[rid]

    def gaps(self, rid: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        t = [s for s in self.stamps[rid] if since <= s <= until]
        return [b - a for a, b in zip(t, t[1:])]

    def abort(self) -> None:
        self.eng.abort_all()
        self.stamps.clear()
        self.added.clear()


def spread(xs: list[float]) -> dict:
    if not xs:
        nan = float("nan")
        return {"median": nan, "mean": nan, "p10": nan, "p90": nan, "max": nan, "n": 0}
    tenths = statistics.quantiles(xs, n=10) if len(xs) > 1 else xs * 9
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "p10": tenths[0],
        "p90": tenths[-1],
        "max": max(xs),
        "n": len(xs),
    }


def one_context(drv: Driver, config, ctx: int, args, seed: int) -> dict:
    drv.add("long", random_prompt(config, ctx, seed), args.output_len + 1)
    drv.until(lambda: False)
    itl = spread(drv.gaps("long"))
    ttft = drv.ttft("long")
    drv.abort()
    step_bound = decode_step_bytes(config, ctx)
    prefill_bound = prefill_flops(config, ctx) / FLOPS
    return {
        "context": ctx,
        "ttft_s": ttft,
        "ttft_bound_s": prefill_bound,
        "ttft_of_bound": prefill_bound / ttft,
        "itl_s": itl,
        "itl_bound_s": step_bound.seconds,
        "itl_of_bound": step_bound.seconds / itl["median"],
        "step_bytes": {"weights": step_bound.weights, "kv": step_bound.kv, "rel": step_bound.rel_embed},
    }


def neighbour(
    drv: Driver,
    config,
    ctx: int,
    pairs: int | None,
    seed: int,
    slowdown: float | None = None,
    idle_steps: int = 40,
) -> dict:
    """A short request decodes alone for `idle_steps` steps; then a prompt of `ctx` tokens arrives beside it,
    its chunks cut by `pairs` (max_prefill_pairs) and paced by `slowdown` (decode_slowdown)."""
    drv.eng.scheduler.max_prefill_pairs = pairs
    drv.eng.scheduler.pacer = None if slowdown is None else PrefillPacer(slowdown)
    n = min(SHORT_PROMPT, drv.eng.build.max_seq_len // 4)
    drv.add("short", random_prompt(config, n, seed), drv.eng.build.max_seq_len - n)
    drv.until(lambda: len(drv.stamps["short"]) >= idle_steps + 1)
    idle = spread(drv.gaps("short")[idle_steps // 5 :])
    arrived = time.perf_counter()
    drv.add("long", random_prompt(config, ctx, seed + 1), 1)
    drv.until(lambda: bool(drv.stamps["long"]))
    first = drv.stamps["long"][0]
    during = spread(drv.gaps("short", since=arrived, until=first))
    out = {"pairs": pairs, "slowdown": slowdown, "idle_itl_s": idle, "itl_during_prefill_s": during,
           "long_ttft_s": first - arrived}  # fmt: skip
    out["worst_of_idle"] = during["max"] / idle["median"]
    out["median_of_idle"] = during["median"] / idle["median"]
    out["mean_of_idle"] = during["mean"] / idle["mean"]
    drv.abort()
    drv.eng.scheduler.max_prefill_pairs, drv.eng.scheduler.pacer = None, None
    return out


def users(drv: Driver, config, ctx: int, n: int, args, seed: int) -> dict:
    rids = [f"user{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        drv.add(rid, random_prompt(config, ctx, seed + i), args.output_len + 1)
    drv.until(lambda: all(drv.stamps[r] for r in rids))
    together = max(drv.stamps[r][0] for r in rids)
    drv.until(lambda: False)
    gaps = [g for r in rids for g in drv.gaps(r, since=together)]
    out = {
        "context": ctx,
        "users": n,
        "ttft_s": [drv.ttft(r) for r in rids],
        "ttft_bound_s": n * prefill_flops(config, ctx) / FLOPS,
        "itl_s": spread(gaps),
        "itl_bound_s": decode_batch_seconds(config, ctx, n),
    }
    out["itl_of_bound"] = out["itl_bound_s"] / out["itl_s"]["median"]
    drv.abort()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="inkling-bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--contexts", default="8192,131072,262144,1048448", help="prompt lengths, one request each"
    )
    ap.add_argument("--output_len", type=int, default=64, help="tokens decoded after each first token")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (the engine's max_num_tokens)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--users_context", type=int, default=262144)
    ap.add_argument("--neighbour_context", type=int, default=262144)
    ap.add_argument("--decode_slowdown", type=float, default=2.0,
                    help="the neighbour's third run paces the long prompt's chunks to this (PrefillPacer)")  # fmt: skip
    ap.add_argument(
        "--phases",
        default="contexts,neighbour,users",
        help="which phases, in this order (longest context last)",
    )
    ap.add_argument(
        "--attention_plugin",
        default="auto",
        help="the engine's attention impl (builder --attention_plugin): auto takes the Gluon prefill launches on "
        "Hopper, triton the `tl` kernel alone",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    phases = args.phases.split(",")
    config = preset(args.preset, nvfp4=True)
    cuda = args.device == "cuda"
    longest = max(contexts + [args.users_context, args.neighbour_context])
    bc = BuildConfig(
        max_batch_size=max(args.users, 2), max_input_len=longest, max_seq_len=longest + args.output_len + 1,
        max_num_tokens=args.chunk, dtype="bfloat16" if cuda else "float32", device=args.device,
        plugin_config=PluginConfig(attention=args.attention_plugin, tune=cuda, tune_max_tokens=64), max_draft_len=0,
    )  # fmt: skip
    results: dict = {
        "command": " ".join(["python", "-m", "bench.long_context", *argv]),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "model": "the real Inkling (transformers 5.23.0's architecture), NVFP4 routed experts",
        "chunk": args.chunk,
        "bandwidth": BANDWIDTH,
        "flops": FLOPS,
    }

    def save() -> None:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        write_table(results, os.path.join(args.out, "results.md"))

    print(f"[bench] synthesizing {args.preset} on {args.device}, building for {longest} tokens", flush=True)
    engine, results["build_s"] = timed(
        lambda: build_from_tensors(
            config, iter_tensors(config, args.seed, args.device), bc, BuildLog(echo=True)
        )
    )
    llm = LLM(engine, cuda_graphs=cuda)
    results["capacity"] = llm.engine.capacity()
    drv = Driver(llm)
    # Warm-up: the kernels compile for a whole-chunk prefill, decoding, and decodes beside a prefill chunk
    # (in the H200 run without it, the first 8K prompt took 3.1 s and one neighbour step 15.6 s).
    one_context(drv, config, min(contexts), argparse.Namespace(output_len=8), args.seed + 99)
    neighbour(drv, config, min(2 * args.chunk, longest), None, args.seed + 98, idle_steps=4)
    seed = args.seed

    def measure_contexts(lengths: list[int]) -> None:
        nonlocal seed
        for ctx in lengths:
            seed += 10
            r = one_context(drv, config, ctx, args, seed)
            results.setdefault("contexts", []).append(r)
            print(f"[bench] context {ctx}: {r}", flush=True)
            if ctx == max(contexts):
                drv.add("profiled", random_prompt(config, ctx, seed + 5), args.output_len)
                drv.until(lambda: len(drv.stamps["profiled"]) >= 4)
                write_profile(
                    drv.step, 4, os.path.join(args.out, f"profile_decode_{ctx}.txt"),
                    f"decode steps at {ctx} tokens of context", args.device,
                )  # fmt: skip
                drv.abort()
            save()

    # The contexts up to the users' first, the longest after the other phases (a run cut short by its time
    # limit then loses the fewest figures).
    if "contexts" in phases:
        measure_contexts(sorted(c for c in contexts if c <= args.users_context))
    if "neighbour" in phases:
        results["neighbour"] = []
        pairs = args.chunk * args.chunk
        for cut, slowdown in ((None, None), (pairs, None), (pairs, args.decode_slowdown)):
            seed += 10
            r = neighbour(drv, config, args.neighbour_context, cut, seed, slowdown)
            results["neighbour"].append(r)
            print(f"[bench] neighbour, max_prefill_pairs {cut}, decode_slowdown {slowdown}: {r}", flush=True)
            save()
    if "users" in phases:
        seed += 10
        results["users"] = users(drv, config, args.users_context, args.users, args, seed)
        print(f"[bench] users: {results['users']}", flush=True)
        save()
    if "contexts" in phases:
        measure_contexts(sorted(c for c in contexts if c > args.users_context))
    save()
    if results.get("contexts"):
        plot(results, os.path.join(args.out, "long_context.png"))
    return 0


def write_table(r: dict, path: str) -> None:
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    lines = [
        f"# Long context: {r['preset']} on {r['device']}, {r['date']}",
        "",
        f"`{r['command']}`; prefill chunks of {r['chunk']} tokens; {r.get('capacity', '')}",
        "",
    ]
    if r.get("contexts"):
        lines += [
            "| context | time to first token | its FLOP bound | of bound | inter-token latency (p10-p90) | its byte bound | of bound |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in r["contexts"]:
            i = c["itl_s"]
            lines.append(
                f"| {c['context']:,} | {c['ttft_s']:.2f} s | {c['ttft_bound_s']:.2f} s | {c['ttft_of_bound']:.0%} "
                f"| {ms(i['median'])} ({ms(i['p10'])}-{ms(i['p90'])}) | {ms(c['itl_bound_s'])} | {c['itl_of_bound']:.0%} |"
            )
    if r.get("neighbour"):
        lines += [
            "",
            "| a short request beside a long prompt | its idle latency: median / mean | during the prefill: median / mean / p90 / max | mean over idle mean | long prompt's first token |",
            "|---|---|---|---|---|",
        ]
        for n in r["neighbour"]:
            d, i = n["itl_during_prefill_s"], n["idle_itl_s"]
            how = "whole chunks" if n["pairs"] is None else f"max_prefill_pairs {n['pairs']:,}"
            if n.get("slowdown"):
                how += f", decode_slowdown {n['slowdown']:g}"
            lines.append(
                f"| {how} | {ms(i['median'])} / {ms(i.get('mean', float('nan')))} | {ms(d['median'])} / "
                f"{ms(d.get('mean', float('nan')))} / {ms(d['p90'])} / {ms(d['max'])} "
                f"| {n.get('mean_of_idle', float('nan')):.2f}x | {n['long_ttft_s']:.2f} s |"
            )
    if r.get("users"):
        u = r["users"]
        lines += [
            "",
            f"{u['users']} users at {u['context']:,} tokens: first tokens "
            + ", ".join(f"{t:.2f}" for t in u["ttft_s"])
            + f" s (all {u['users']} prefills' FLOP bound {u['ttft_bound_s']:.2f} s); inter-token latency "
            f"{ms(u['itl_s']['median'])} against a bound of {ms(u['itl_bound_s'])} ({u['itl_of_bound']:.0%}).",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = r["contexts"]
    x = [c["context"] for c in cs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    left.plot(x, [c["itl_s"]["median"] * 1e3 for c in cs], marker="o", label="measured")
    left.plot(x, [c["itl_bound_s"] * 1e3 for c in cs], "--", color="gray", label="byte bound")
    left.set_ylabel("inter-token latency, ms")
    right.plot(x, [c["ttft_s"] for c in cs], marker="o", label="measured")
    right.plot(x, [c["ttft_bound_s"] for c in cs], "--", color="gray", label="FLOP bound")
    right.set_ylabel("time to first token, s")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context, tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{r['preset']} on {r['device']}, batch 1")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

"""`make bench`: the end-to-end workload users compare with vLLM's (8K prompt in, 1K tokens out), on the
real Inkling (inkling-bench: six NVFP4 MoE layers of the 1T at full width, its embedding, unembedding and
8 MTP depths).

    python -m bench.e2e --preset inkling-bench --device cuda --out build/bench-e2e     # the H200 run
    python -m bench.e2e --preset inkling-tiny --device cpu --prompt_len 128 --output_len 8 --batches 1,2 --out DIR

The weights are synthesized where they run (inkling.published.synth.iter_tensors: inkling-bench is about
27 GB, NVFP4 experts and BF16 MTP depths) and the engine is built in memory. Prompts are random token ids
(the synthetic model has no tokenizer; a random router routes them much as it would text), one prompt a
user. `--cuda_graphs` replays the decode steps from CUDA graphs. Measured, in one run: time to first token
for three prompts; for each batch size, the decode steps once every request has its first token (each step
timed: median and spread, tokens/s per user, throughput; a batch stops after `--output_len` tokens or
`--decode_budget_s` seconds of decoding, whichever comes first, and the table says how many tokens it ran);
optionally a torch.profiler table of a few decode steps at `--profile_batch` or of a prefill; and the bound
of bench/bound.py. Writes results.json, results.md and e2e.png into --out. The peers (vLLM, SGLang,
TokenSpeed) do not run on the GPU host: BENCHMARKS.md sets their published figures beside ours.

`make bench` runs the workload in two parts of at most ten minutes each on the H200 (`make bench-decode`,
`bench-mtp`, each into its own directory), then `--merge` joins them into one table and plot:

    python -m bench.e2e ... --out OUT/decode            # first tokens and decode batches, no MTP
    python -m bench.e2e ... --num_draft_tokens 3 --fixed_drafts --out OUT/mtp
    python -m bench.e2e --merge --out OUT               # OUT/results.md, results.json, e2e.png

A part that ended before its last batches is completed by a run of those batches alone into OUT/PART-2
(`--batches 32,64`); the merge takes each batch from the first run that measured it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
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

from .bound import decode_batch_seconds, decode_step_bytes, prefill_flops, routed_distinct_experts
from .profiling import write_profile

DEFAULT_BATCHES = "1,8,32,64"  # the decode batches: batch 1, then throughput at 8, 32 and 64 (issue 12)


SPECIAL_MARGIN = 64  # the special tokens sit at the top of the unpadded vocabulary: prompts stay below


def random_prompt(config, length: int, seed: int) -> torch.Tensor:
    """`length` random ordinary token ids (no BOS: the real Inkling has none)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.text.num_real_tokens - SPECIAL_MARGIN, (length,), generator=g)


def user_prompts(config, length: int, batch: int, seed: int) -> list[torch.Tensor]:
    """One random prompt a user, so that no two users decode the same tokens and route to the same experts."""
    return [random_prompt(config, length, seed + 1000 + i) for i in range(batch)]


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="inkling-bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt_len", type=int, default=8192)
    ap.add_argument("--output_len", type=int, default=1024)
    ap.add_argument("--batches", default=DEFAULT_BATCHES, help="batch sizes of the decode throughput runs")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the decode batches (0: greedy; a seed per user). Greedy batches of "
        "32 and 64 on synthetic weights sped up after their first steps, past the bound of uniform routing "
        "(most likely their users' tokens converged: the table's distinct tokens a step will say); "
        "sampled batches did not",
    )
    ap.add_argument(
        "--num_draft_tokens",
        type=int,
        default=0,
        help="MTP drafts per step (the preset's 8 heads synthesized)",
    )
    ap.add_argument(
        "--fixed_drafts",
        action="store_true",
        help="draft num_draft_tokens every step (the runtime's adaptive policy off: random heads accept "
        "nothing, so it would soon stop drafting); times a whole MTP round as the runtime runs it",
    )
    ap.add_argument(
        "--draft_vocab_size",
        type=int,
        default=0,
        help="the depths draft from N token ids only (builder/draft_vocab.py; here the first N ordinary "
        "ids: random depths and prompts make any N alike); 0: every real token",
    )
    ap.add_argument(
        "--eager_pick",
        action="store_true",
        help="fill a drafting head pass's draft ids and make its pick outside the head's graph, launched "
        "apart (the runtime before runner.draft_graphs; an A/B of the MTP round)",
    )
    ap.add_argument(
        "--tune_max_tokens",
        type=int,
        default=1 << 30,
        help="tune the MoE tiles of token buckets up to N only (the rest keep default tiles: a decode-only run "
        "skips the prefill buckets' two minutes; time to first token then runs untuned tiles)",
    )
    ap.add_argument(
        "--decode_budget_s", type=float, default=120.0, help="decoding time per batch size at most"
    )
    ap.add_argument(
        "--profile_batch",
        type=int,
        default=0,
        help="torch.profiler table of decode steps at this batch",
    )
    ap.add_argument(
        "--profile_prefill",
        action="store_true",
        help="torch.profiler table of one prefill of the mixed prompt (and its first token)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="join the parts under --out (decode/, mtp/: make bench's) into one table and plot",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cuda_graphs",
        action="store_true",
        help="decode steps replayed from CUDA graphs (LLM(cuda_graphs=True))",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the step program in the runtime (Inductor fuses the small ops; graphs still capture)",
    )
    ap.add_argument(
        "--attention_plugin",
        default="auto",
        help="the engine's attention impl (builder --attention_plugin): auto takes the Gluon prefill launches on "
        "Hopper, triton the `tl` kernel alone",
    )
    ap.add_argument(
        "--overlap_off_batches",
        default="",
        help="batch sizes to decode again with overlapped steps off (LLMEngine.step), for comparison",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        return merge(args.out)
    config = preset(args.preset, nvfp4=True)
    results: dict = {
        "command": " ".join(["python", "-m", "bench.e2e", *argv]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "model": "the real Inkling (transformers 5.23.0's architecture), NVFP4 routed experts",
        "cuda_graphs": args.cuda_graphs,
        "compile": args.compile,
        "num_draft_tokens": args.num_draft_tokens,
        "fixed_drafts": args.fixed_drafts,
        "eager_pick": args.eager_pick,
        "tune_max_tokens": args.tune_max_tokens if args.tune_max_tokens < 1 << 30 else None,
        "decode_prompts": "random token ids, one prompt a user",
        "temperature": args.temperature,
        "batches": [int(b) for b in args.batches.split(",")],
    }
    kv_len = decode_kv_len(args)
    bound = decode_step_bytes(config, kv_len)
    results["bound"] = {
        "decode_bytes_per_step": bound.total,
        "decode_step_s": bound.seconds,
        "tokens_per_s_per_user": 1 / bound.seconds,
        "prefill_s": prefill_flops(config, args.prompt_len) / 790e12,
        # per batch size: a decode step of that many distinct sequences (bound.decode_batch_seconds)
        "decode_batch_step_s": {str(b): decode_batch_seconds(config, kv_len, b) for b in results["batches"]},
    }

    def save() -> None:  # after each phase: a run cut short keeps what it measured
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)

    measure_engine(args, config, results, save)
    save()
    write_table(results, os.path.join(args.out, "results.md"))
    plot({"this run": results}, os.path.join(args.out, "e2e.png"))
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


PARTS = ("decode", "mtp")  # make bench's parts, each a directory under its --out


def merge(out: str) -> int:
    """One table and plot from make bench's parts under `out` (PARTS; mtp may be missing): the
    decode part's first tokens and batches, the MTP part's batches and acceptance
    the decode part's smallest batch. Writes results.json (the parts whole, under "parts"), results.md and
    e2e.png into `out`."""
    parts = {}
    for name in PARTS:
        # a part may be completed by later runs in NAME-2, NAME-3, ... (a run that ended before its last batches)
        paths = [os.path.join(out, name, "results.json")]
        paths += sorted(glob.glob(os.path.join(out, f"{name}-*", "results.json")))
        runs = [load(path) for path in paths if os.path.exists(path)]
        if runs:
            parts[name] = join_runs(runs)
    if "decode" not in parts:
        raise SystemExit(
            f"bench.e2e --merge: no {os.path.join(out, 'decode', 'results.json')} (make bench-decode)"
        )
    merged = {**parts["decode"], "parts": parts}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(merged, f, indent=2)
    write_table(merged, os.path.join(out, "results.md"), mtp=parts.get("mtp"))
    runs = {"no MTP": parts["decode"]}
    if "mtp" in parts:
        runs[f"MTP, {parts['mtp']['num_draft_tokens']} drafts a step"] = parts["mtp"]
    plot(runs, os.path.join(out, "e2e.png"))
    print(open(os.path.join(out, "results.md")).read())
    return 0


def join_runs(runs: list[dict]) -> dict:
    """One part from several runs of it: the first run's results, each later run adding the decode batches
    the runs before it did not measure. "runs" lists each run's command, device, date and the batches it
    gave."""
    if len(runs) == 1:
        return runs[0]
    joined = {**runs[0], "decode": {}, "runs": []}
    for run in runs:
        added = {b: d for b, d in run.get("decode", {}).items() if b not in joined["decode"]}
        joined["decode"].update(added)
        joined["runs"].append(
            {k: run[k] for k in ("command", "device", "date")} | {"gave": [int(b) for b in added]}
        )
    joined["batches"] = sorted({b for run in runs for b in _requested_batches(run)})
    return joined


def decode_kv_len(args: argparse.Namespace) -> int:
    """The context a decode step's bound assumes: midway through the output."""
    return args.prompt_len + args.output_len // 2


def decode_run(
    llm: LLM, prompts: list[torch.Tensor], args: argparse.Namespace, profile: bool = False
) -> tuple[dict, list[list[int]]]:
    """Batch `prompts` with greedy decoding; time each step once every request has its first token (the
    prompts' prefills are not decode steps). Stops after output_len tokens or decode_budget_s seconds.
    With `profile`, a few steps after the eighth are profiled (and not timed). Returns the figures and
    each request's tokens."""
    eng = llm.engine
    drafts = getattr(args, "num_draft_tokens", 0)
    temperature = getattr(args, "temperature", 0.0)
    names = [f"b{i}" for i in range(len(prompts))]
    for i, (name, ids) in enumerate(zip(names, prompts)):
        params = SamplingParams(
            max_tokens=args.output_len, ignore_eos=True, num_draft_tokens=drafts,
            temperature=temperature, seed=args.seed + i if temperature else None,
        )  # fmt: skip
        eng.add_request(name, PromptInput(ids), params)
    tokens: dict[str, list[int]] = {name: [] for name in names}

    def step() -> None:
        for d in eng.step():
            tokens[d.request_id] += d.token_ids

    accepted_before = (eng.acceptance.steps, eng.acceptance.tokens)
    preempted_before = eng.scheduler.num_preemptions
    steps: list[float] = []
    distinct: list[int] = []  # distinct last tokens across the batch after each timed step
    capture_steps: list[float] = []  # steps that captured a CUDA graph (a one-time cost): not timed
    verified: list[int] = []  # drafts each timed step verified, all sequences together (MTP)
    decoded = 0  # tokens of the timed steps, all requests (with MTP, up to 1 + drafts per step each)
    decoding_since = None
    while eng.has_unfinished():
        if profile and len(steps) == 8:
            profile_steps(step, args)
            profile = False
        before = sum(len(t) for t in tokens.values())
        captures = _captures(eng.runner)
        proposed = sum(eng.acceptance.proposed)
        # No device sync around a step: with overlapped steps the next one is already running when
        # step() returns, and the time between returns is what a streaming user sees.
        start = time.perf_counter()
        step()
        dt = time.perf_counter() - start
        if decoding_since is None:
            if all(tokens.values()):
                eng.runner.read_expert_load()  # the prefills' routing is not the decode's
                decoding_since = time.perf_counter()
            continue
        if _captures(eng.runner) > captures:
            capture_steps.append(dt)
            continue
        steps.append(dt)
        verified.append(sum(eng.acceptance.proposed) - proposed)
        distinct.append(len({t[-1] for t in tokens.values()}))
        decoded += sum(len(t) for t in tokens.values()) - before
        # The budget counts decoding, not the one-time captures (with --compile a capture step compiles
        # the program for its bucket: 18 s for the MTP heads' first bucket on the H200).
        if time.perf_counter() - decoding_since - sum(capture_steps) > args.decode_budget_s:
            for name in names:
                eng.abort_request(name)
            break
    loads = eng.runner.read_expert_load()  # the decode steps' routing, timed or not
    median = statistics.median(steps)
    tenths = statistics.quantiles(steps, n=10) if len(steps) > 1 else [median] * 9
    figures = {
        "decode_steps_timed": len(steps),
        "tokens_per_request": min(len(t) for t in tokens.values()),
        "step_s_median": median,
        "step_s_p10": tenths[0],
        "step_s_p90": tenths[-1],
        "step_s_first": steps[:8],
        # The tail: every timed step over twice the median, as (index among the timed steps, seconds, drafts
        # it verified), so that a mean far from the median says which steps made it so
        "step_s_slow": [(i, dt, verified[i]) for i, dt in enumerate(steps) if dt > 2 * median],
        # A batch whose users emit the same tokens routes like fewer tokens: fewer experts than its bound's
        "distinct_tokens_median": statistics.median(distinct),
        "distinct_tokens_first_last": [distinct[0], distinct[-1]],
        "capture_steps_s": capture_steps,
        # Tokens over the timed steps' total time: 1 / mean step without MTP.
        "tokens_per_s_per_user": decoded / len(prompts) / sum(steps),
        "throughput_tokens_per_s": decoded / sum(steps),
        # Sequences recomputed because the KV cache ran out (a GPU whose cache holds fewer than the batch)
        "preemptions": eng.scheduler.num_preemptions - preempted_before,
        "expert_loads": loads,  # [MoE layers, E] tokens each expert received in the decode steps
    }
    if drafts:  # this run's MTP steps: tokens per step, bonus included
        mtp_steps = eng.acceptance.steps - accepted_before[0]
        figures["acceptance_length"] = (eng.acceptance.tokens - accepted_before[1]) / max(mtp_steps, 1)
        figures["mtp_steps"] = mtp_steps  # per sequence: a step of b drafting sequences counts b
    return figures, list(tokens.values())


def _captures(runner) -> int:
    """CUDA graphs captured so far by the runner's step and head graphs."""
    graphs = (runner.step_graphs, runner.head_graphs, runner.draft_graphs)
    return sum(g.stats.captures for g in graphs if g is not None)


def profile_steps(step, args: argparse.Namespace, count: int = 4) -> None:
    """A torch.profiler table of `count` decode steps, by device time and by host time, into --out."""
    path = os.path.join(args.out, f"profile_batch{args.profile_batch}.txt")
    write_profile(step, count, path, f"decode steps at batch {args.profile_batch}", args.device)


def measure_engine(args: argparse.Namespace, config, results: dict, save) -> None:
    """Build the engine in memory; time first tokens and decoding per batch size."""
    batches = [int(b) for b in args.batches.split(",")]
    bc = BuildConfig(
        max_batch_size=max(batches), max_input_len=args.prompt_len, max_seq_len=args.prompt_len + args.output_len,
        max_num_tokens=max(args.prompt_len, max(batches)), dtype="bfloat16", device=args.device,
        plugin_config=PluginConfig(
            attention=args.attention_plugin, tune=args.device == "cuda", tune_max_tokens=args.tune_max_tokens
        ),
        max_draft_len=args.num_draft_tokens,
    )  # fmt: skip
    print(
        f"[bench] synthesizing {args.preset} with NVFP4 experts on {args.device}, building in memory",
        flush=True,
    )
    tensors = iter_tensors(config, args.seed, args.device)
    log = BuildLog(echo=True)
    vocab = list(range(args.draft_vocab_size)) if args.draft_vocab_size else None
    results["draft_vocab_size"] = args.draft_vocab_size or None
    engine, results["build_s"] = timed(
        lambda: build_from_tensors(config, tensors, bc, log, draft_vocab=vocab)
    )
    if args.compile:
        # What `--compile` at build gives a runtime, without build's compile step: that would warm a second
        # runner (its own KV caches) beside this one, and its cache artifacts matter only for a later load.
        engine.config["build_config"]["compile"] = True
    llm = LLM(engine, cuda_graphs=args.cuda_graphs)
    results["capacity"] = llm.engine.capacity()
    print(f"[bench] {results['capacity']}", flush=True)
    if args.fixed_drafts:
        llm.engine.spec.fix_drafts()
    if args.eager_pick:
        llm.engine.runner.draft_graphs = None
    prompts = {f"prompt {i + 1}": random_prompt(config, args.prompt_len, args.seed + i) for i in range(3)}
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    first = next(iter(prompts.values()))
    for warm in (first[:64], first):  # warm-up: kernels compile for short and long
        llm.generate(PromptInput(warm), greedy)
    results["ttft_s"] = {
        name: timed(lambda ids=ids: llm.generate(PromptInput(ids), greedy))[1]
        for name, ids in prompts.items()
    }
    if args.profile_prefill:
        write_profile(
            lambda: llm.generate(PromptInput(first), greedy), 1, os.path.join(args.out, "profile_prefill.txt"),
            f"prefill of {args.prompt_len} tokens (its first token included)", args.device,
        )  # fmt: skip
    results["decode"] = {}
    for batch in batches:
        reqs = user_prompts(config, args.prompt_len, batch, args.seed)
        results["decode"][batch], _ = decode_run(llm, reqs, args, profile=batch == args.profile_batch)
        # The batch's bound again with the experts its routing touched (uniform routing's are the bound's)
        distinct = routed_distinct_experts(
            results["decode"][batch].pop("expert_loads"), config.text.num_experts_per_tok, batch
        )
        if distinct is not None:
            results["decode"][batch]["routed_distinct_experts"] = distinct
            results["decode"][batch]["step_bound_routed_s"] = decode_batch_seconds(
                config, decode_kv_len(args), batch, distinct
            )
        if args.cuda_graphs:
            results["decode"][batch]["graph_stats"] = llm.engine.runner.graph_stats()
        results["decode"][batch]["overlap"] = llm.engine.overlap
        print(f"[bench] batch {batch}: {results['decode'][batch]}", flush=True)
        if str(batch) in args.overlap_off_batches.split(",") and llm.engine.overlap:
            llm.engine.overlap = False
            off, _ = decode_run(llm, reqs, args)
            llm.engine.overlap = True
            results.setdefault("decode_overlap_off", {})[batch] = off
            print(f"[bench] batch {batch}, overlap off: {off}", flush=True)
        save()


def plot(runs: dict[str, dict], path: str) -> None:
    """Decode tokens/s per user and throughput against batch size, one line per run (results.json
    dicts), with the batch-1 bound.

        python -c "from bench.e2e import plot, load; plot({'eager': load('A'), 'graphs': load('B')}, 'e2e.png')"
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    for label, r in runs.items():
        batches = sorted(r["decode"], key=int)
        x = [int(b) for b in batches]
        left.plot(x, [r["decode"][b]["tokens_per_s_per_user"] for b in batches], marker="o", label=label)
        right.plot(x, [r["decode"][b]["throughput_tokens_per_s"] for b in batches], marker="o", label=label)
    bound = next(iter(runs.values()))["bound"]["tokens_per_s_per_user"]
    left.axhline(bound, color="gray", linestyle="--", label=f"bound, batch 1 ({bound:.0f})")
    for ax, what in ((left, "decode tokens/s per user"), (right, "throughput tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (8K-token prompts)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    first = next(iter(runs.values()))
    fig.suptitle(f"{first['preset']} on {first['device']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _requested_batches(r: dict) -> list[int]:
    """The decode batches a run was asked for: recorded since 2026-12-02, else read from its command."""
    if "batches" in r:
        return r["batches"]
    m = re.search(r"--batches[ =](\S+)", r["command"])
    return [int(b) for b in (m.group(1) if m else DEFAULT_BATCHES).split(",")]


def write_table(r: dict, path: str, mtp: dict | None = None) -> None:
    """results.md of one run (results.json's dict), or of make bench's merged parts: then `mtp`, the MTP
    part's results, adds its decode rows."""
    b = r["bound"]
    lines = [
        f"Command: `{r['command']}`; device {r['device']}; date {r['date']}; preset {r['preset']} "
        f"({r.get('model', 'the earlier, invented model')}); "  # results before 2026-12-03 name none
        + (f"build in memory {r['build_s']:.1f} s; " if "build_s" in r else "")
        + f"CUDA graphs {'on' if r.get('cuda_graphs') else 'off'}; "
        f"torch.compile {'on' if r.get('compile') else 'off'}; MTP drafts per step {r.get('num_draft_tokens', 0)}; "
        f"decode batches' prompts: {r.get('decode_prompts', 'one a user')}; "
        f"{_sampling(r)}.",
    ]
    for name, part in r.get("parts", {}).items():
        for run in part.get("runs", [part]):
            gave = f": batches {', '.join(map(str, run['gave']))}" if "gave" in run else ""
            lines.append(f"- part {name}: `{run['command']}` ({run['device']}, {run['date']}){gave}")
        missing = [str(b) for b in _requested_batches(part) if str(b) not in part.get("decode", {})]
        if missing:
            lines[-1] += (
                f"; batches {', '.join(missing)} not measured (the run ended before them: see its log)"
            )
    lines += ["", "| measure | ours | bound | fraction of bound |", "|---|---|---|---|"]
    for name, s in r.get("ttft_s", {}).items():
        lines.append(
            f"| time to first token, {name} | {s:.3f} s | {b['prefill_s']:.3f} s | {b['prefill_s'] / s:.1%} |"
        )
    lines += _decode_rows(r, "")
    if mtp:
        every = " (every step)" if mtp.get("fixed_drafts") else ""
        vocab = f" from {mtp['draft_vocab_size']} tokens" if mtp.get("draft_vocab_size") else ""
        label = f"with {mtp['num_draft_tokens']} MTP drafts a step{every}{vocab}, "
        lines += _decode_rows(mtp, label)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _sampling(r: dict) -> str:
    t = r.get("temperature", 0.0)
    return f"sampled at temperature {t:g}, a seed per user" if t else "greedy"


def _decode_rows(r: dict, label: str) -> list[str]:
    """The table's rows of r's decode batches (tokens/s per user and throughput against their bounds)."""
    b, lines = r["bound"], []
    for batch, d in r.get("decode", {}).items():
        per_user = d["tokens_per_s_per_user"]
        distinct = ""
        if "distinct_tokens_median" in d and int(batch) > 1:
            first, last = d["distinct_tokens_first_last"]
            distinct = f"; distinct tokens a step: median {d['distinct_tokens_median']:g}, first {first}, last {last}"
        lines.append(
            f"| {label}decode tokens/s per user, batch {batch} ({d['tokens_per_request']} tokens each{distinct}; step median "
            f"{d['step_s_median'] * 1e3:.1f} ms, p10–p90 {d['step_s_p10'] * 1e3:.1f}–{d['step_s_p90'] * 1e3:.1f} ms) | "
            f"{per_user:.1f} | {b['tokens_per_s_per_user']:.0f} (batch 1) | {per_user / b['tokens_per_s_per_user']:.1%} |"
        )
        step_bound = b.get("decode_batch_step_s", {}).get(str(batch))
        if step_bound and int(batch) > 1 and not r.get("num_draft_tokens"):
            # the batch's own bound: the experts its distinct sequences touch, and their KV
            fraction = d["throughput_tokens_per_s"] * step_bound / int(batch)
            # Above it, the batch read fewer experts than uniform routing gives its users (the 2026-12-01
            # greedy batches, bench/results/history.md, end-to-end run 17): the row is not a figure of the engine
            above = (
                " (above the bound: the batch routed like fewer users; not a figure)" if fraction > 1 else ""
            )
            lines.append(
                f"| {label}throughput tokens/s, batch {batch} | {d['throughput_tokens_per_s']:.1f} | "
                f"{int(batch) / step_bound:.0f} (step {step_bound * 1e3:.3g} ms) | {fraction:.1%}{above} |"
            )
            routed = d.get("step_bound_routed_s")
            if routed:  # the same against the experts the measured routing touches
                lines.append(
                    f"| {label}throughput tokens/s, batch {batch}, against the bound of its measured routing "
                    f"({d['routed_distinct_experts']:.0f} experts a layer) | {d['throughput_tokens_per_s']:.1f} | "
                    f"{int(batch) / routed:.0f} (step {routed * 1e3:.3g} ms) | "
                    f"{d['throughput_tokens_per_s'] * routed / int(batch):.1%} |"
                )
        else:
            lines.append(
                f"| {label}throughput tokens/s, batch {batch} | {d['throughput_tokens_per_s']:.1f} | | |"
            )
        if "acceptance_length" in d:
            lines.append(
                f"| {label}MTP acceptance length, batch {batch} | {d['acceptance_length']:.2f} | | |"
            )
        off = r.get("decode_overlap_off", {}).get(batch)
        if off:
            lines.append(
                f"| the same, overlapped steps off: tokens/s per user (step median {off['step_s_median'] * 1e3:.1f} ms) | "
                f"{off['tokens_per_s_per_user']:.1f} | | {off['tokens_per_s_per_user'] / b['tokens_per_s_per_user']:.1%} |"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())

"""MTP step components on the GPU (INKLING_SPEC §5; GPU.md "Bytes per decode step").

    python -m bench.mtp --device cuda --out bench/results        # the H200 run (inkling-bench)
    python -m bench.mtp --preset inkling-tiny --device cpu --context 64 --out DIR     # smoke

Synthesizes the preset with its 8 heads and NVFP4 experts where it runs, builds the engine in memory,
prefills one sequence of `--context` tokens through the runtime and then times, with the engine's
own programs and inputs the runtime built (CUDA events, median of repeats; with `--cuda_graphs` also
replayed from the runtime's CUDA graphs, runtime/step_graphs.py):
- the main step with 1 + k tokens (decode k = 0, verify k = 1, 3, 8), counting the distinct routed
  experts per layer it touches;
- one head pass at one position (the head program) and the draft pick (`inkling::mtp_draft`).
Tokens/s per user for k drafts = tokens per step / (verify(k) + k · (head + draft)). Tokens per step
needs the acceptance of a trained model, which synthetic heads do not have: the table uses an
ASSUMED per-position acceptance (geometric, fitted to vLLM's published mean acceptance length 4.5
at 8 drafts), labelled as such. inkling-1t figures are a PROJECTION: the verify step's bytes per GPU of
inkling-1t on 4 GPUs (builder/sharding.py's split) at the efficiency measured here (bound time / measured
time), plus k head passes and picks: inkling-bench's heads are inkling-1t's, each rank reads its share of
a head pass (`head_pass_bytes`) at the measured head pass's speed and makes the whole pick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from builder import BuildConfig, PluginConfig, build
from inkling.config import preset
from inkling.synth import iter_synthetic_tensors, synth_config
from runtime import LLMEngine, PromptInput, SamplingParams
from runtime.scheduler import ScheduledSeq
from runtime.step_graphs import HEAD_ARGS, STEP_ARGS, StepGraphs, batch_buckets, q_buckets, token_buckets

from .bound import BF16, decode_step_bytes
from .profiling import write_profile

DRAFTS = (0, 1, 3, 8)


def median_time(fn, repeats: int, device: str) -> float:
    """Median seconds of fn() over `repeats` calls (CUDA events on the GPU), after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


class Recorder:
    """Wraps a callable, keeping the arguments of its last call (to replay a program's inputs)."""

    def __init__(self, fn):
        self.fn, self.args = fn, None

    def __call__(self, *args):
        self.args = args
        return self.fn(*args)


def count_experts(config):
    """Patch the MoE op's reference and Triton paths to record distinct routed experts per call."""
    seen: list[int] = []
    E, k = config.num_routed_experts, config.num_experts_per_tok

    def routed(x, router_weight):
        probs = torch.softmax((x.float() @ router_weight.float().T), -1)
        seen.append(int(probs[:, :E].topk(k, -1).indices.unique().numel()))

    from plugins.moe import launcher, reference

    originals = {}
    for module in (launcher, reference):
        fn = module.expert_sink_moe
        originals[module] = fn

        def wrapped(x, router_weight, *rest, _fn=fn, **kw):
            routed(x, router_weight)
            return _fn(x, router_weight, *rest, **kw)

        module.expert_sink_moe = wrapped
    return seen, originals


def replay_only(graphs: StepGraphs, args: list):
    """The replay of the graph that `graphs(args)` runs (its inputs as the last call left them), or None."""
    bucket = graphs.bucket(args)
    entry = graphs.buckets.get((None, *bucket)) if bucket is not None else None
    return None if entry is None or entry.graph is None else entry.graph.replay


def acceptance_model(mean_at_8: float = 4.5) -> float:
    """Per-position acceptance a with (1 - a^9) / (1 - a) = mean_at_8 (bisection)."""
    lo, hi = 0.0, 0.9999
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a**9) / (1 - a) < mean_at_8:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="inkling-bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cuda_graphs",
        action="store_true",
        help="also time the step and head pass replayed from CUDA graphs (on the CPU: padded into the "
        "graphs' buckets, run eagerly)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the step and head programs (what an engine built with --compile runs)",
    )
    ap.add_argument(
        "--draft_vocab_size",
        type=int,
        default=0,
        help="build with a draft vocabulary of N tokens (ids 0..N-1: synthetic weights have no token "
        "frequencies, and a pick's cost depends only on N); the full-vocabulary pick is timed beside it",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler tables of the head pass and of the k=3 verify step",
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    config, _ = synth_config(args.preset, nvfp4=True)
    results: dict = {
        "command": " ".join(["python", "-m", "bench.mtp", *(sys.argv[1:] if argv is None else argv)]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "context": args.context,
        "compile": args.compile,
        "draft_vocab_size": args.draft_vocab_size or None,
    }
    bc = BuildConfig(
        max_batch_size=2, max_input_len=args.context, max_seq_len=args.context + 64,
        max_num_tokens=args.context, dtype="bfloat16", device=args.device,
        plugin_config=PluginConfig(tune=False),
    )  # fmt: skip
    print(f"[bench.mtp] synthesizing {args.preset} (8 heads, NVFP4 experts) on {args.device}", flush=True)
    vocab = list(range(args.draft_vocab_size)) if args.draft_vocab_size else None
    engine = build(
        iter_synthetic_tensors(config, args.seed, args.device),
        bc,
        config=config,
        echo=False,
        draft_vocab=vocab,
    )
    if args.compile:  # as bench.e2e: what --compile at build gives a runtime, without compile_step's warm-up
        engine.config["build_config"]["compile"] = True
    # Eager steps and no overlap: the expert counting below reads the routing on the host (no capture),
    # and the CUDA-graph times come from the bench's own StepGraphs over the same programs.
    eng = LLMEngine(engine, cuda_graphs=False, overlap=False)
    runner = eng.runner
    runner.step = step = Recorder(runner.step)
    # The drafter runs the head program it was given (runtime/drafter.py Heads), not the runner's attribute.
    runner.head = runner.drafter.heads.program = head = Recorder(runner.head)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(11, config.vocab_size - 1, (args.context,), generator=g)
    eng.add_request(
        "r", PromptInput(prompt), SamplingParams(max_tokens=40, ignore_eos=True, num_draft_tokens=8)
    )
    seq = eng.requests["r"].seq
    while seq.is_prefill or not seq.drafts:
        eng.step()
    seen, originals = count_experts(config)
    out: dict = {"verify": {}, "head": {}}
    step_graphs = head_graphs = None
    recorded: dict[int, list] = {}  # k -> the step's inputs
    if args.cuda_graphs:  # the runtime's graphs over the same programs, fed the recorded inputs
        buckets = (
            batch_buckets(bc.max_batch_size),
            token_buckets(bc.max_batch_size, 9, bc.max_num_tokens),
            q_buckets(9),
        )
        dev = torch.device(args.device)
        # On the CPU the buckets run eagerly, padded as the graphs are (the smoke test's check of the staging)
        mode = {"use_graphs": True} if dev.type == "cuda" else {"use_graphs": False, "pad_eager": True}
        step_graphs = StepGraphs(step.fn, STEP_ARGS, dev, *buckets, **mode)
        head_graphs = StepGraphs(head.fn, HEAD_ARGS, dev, *buckets, **mode, pool=step_graphs.pool)
    for k in DRAFTS:
        seq.drafts = seq.drafts[:k] if k <= len(seq.drafts) else seq.drafts + [11] * (k - len(seq.drafts))
        batch = [ScheduledSeq(seq, seq.num_computed, 1 + k, k)]
        eng.blocks.allocate(seq.blocks, len(seq) + k)
        seen.clear()
        runner.run(batch)  # records the step's inputs; the caches past num_computed are scratch
        distinct = sum(seen) / max(len(seen), 1)
        seconds = median_time(lambda: step.fn(*step.args), args.repeats, args.device)
        out["verify"][k] = {"seconds": seconds, "distinct_experts_per_layer": distinct}
        recorded[k] = list(step.args)
        print(
            f"[bench.mtp] main step with {1 + k} tokens: {seconds * 1e3:.3f} ms, {distinct:.1f} experts/layer",
            flush=True,
        )
    for module, fn in originals.items():
        module.expert_sink_moe = fn
    if step_graphs is not None:  # without the expert counting (its host sync cannot be captured)
        for k, a in recorded.items():
            v = out["verify"][k]
            v["eager_seconds"] = median_time(lambda a=a: step.fn(*a), args.repeats, args.device)
            a = with_host_shape(a, STEP_ARGS)
            recorded[k] = a
            v["graphed_seconds"] = median_time(lambda a=a: step_graphs(a), args.repeats, args.device)
            print(
                f"[bench.mtp] main step with {1 + k} tokens, no expert counting: eager "
                f"{v['eager_seconds'] * 1e3:.3f} ms, CUDA graph {v['graphed_seconds'] * 1e3:.3f} ms",
                flush=True,
            )
    # One head pass at one position, and the draft pick; replayed with the last head call's inputs.
    seq.drafts = []
    eng.step()
    w, h_prev, ids, _, _, _, seq_lens, block_table, slots, state, _, kc, vc, conv = head.args
    dev = h_prev.device
    one = (
        w, h_prev[-1:], ids[-1:], torch.zeros(1, config.hidden_size, dtype=h_prev.dtype, device=dev),
        torch.tensor([1], device=dev), torch.tensor([0, 1], dtype=torch.int32, device=dev), seq_lens[:1],
        block_table[:1], slots[-1:], state[:1], torch.zeros(1, dtype=torch.int8, device=dev), kc, vc, conv,
    )  # fmt: skip
    out["head"]["tokens"] = 1
    out["head"]["seconds"] = median_time(lambda: head.fn(*one), args.repeats, args.device)
    if head_graphs is not None:
        one = tuple(with_host_shape(list(one), HEAD_ARGS))
        out["head"]["graphed_seconds"] = median_time(
            lambda: head_graphs(list(one)), args.repeats, args.device
        )
        # The graph's replay alone: the difference is the host work around it (padding, input copies)
        replay = replay_only(head_graphs, list(one))
        if replay is not None:
            out["head"]["replay_only_seconds"] = median_time(replay, args.repeats, args.device)
    if args.profile:
        replay_head = (lambda: head_graphs(list(one))) if head_graphs is not None else (lambda: head.fn(*one))
        write_profile(
            replay_head, 5, os.path.join(args.out, "profile_head.txt"), "calls of the head pass, one position",
            args.device,
        )  # fmt: skip
        if step_graphs is not None and 3 in recorded:
            write_profile(
                lambda: step_graphs(recorded[3]), 5, os.path.join(args.out, "profile_verify3.txt"),
                "calls of the main step with 4 tokens (k=3)", args.device,
            )  # fmt: skip
    rows = torch.zeros(1, config.hidden_size, dtype=runner.dtype, device=args.device)

    def pick(lm_head, num_rows, ids=None):
        picked = torch.ops.inkling.mtp_draft(
            rows, runner.head_weights[0]["final_layernorm.weight"], lm_head, num_rows, config.rms_norm_eps,
            runner.drafter.draft_impl,
        )  # fmt: skip
        return picked if ids is None else ids[picked]  # as Drafter.run

    drafter = runner.drafter
    out["head"]["draft_seconds"] = median_time(
        lambda: pick(drafter.draft_lm_head, drafter.num_draft_rows, drafter.draft_ids),
        args.repeats,
        args.device,
    )
    out["head"]["draft_rows"] = drafter.num_draft_rows
    if drafter.draft_ids is not None:
        out["head"]["full_vocab_draft_seconds"] = median_time(
            lambda: pick(runner.lm_head, runner.num_real_tokens), args.repeats, args.device
        )
    results.update(out)
    results["table"] = table(config, out, args.context)
    with open(os.path.join(args.out, "mtp.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_md(results, os.path.join(args.out, "mtp.md"))
    print(open(os.path.join(args.out, "mtp.md")).read())
    return 0


def with_host_shape(args: list, spec) -> list:
    """A program's recorded inputs as a graphed call takes them: cu_seqlens_q and seq_lens on the host (the
    runtime builds them there; StepGraphs pads the batch from them without reading the device)."""
    out = list(args)
    out[spec.cu], out[spec.seq_lens] = out[spec.cu].cpu(), out[spec.seq_lens].cpu()
    return out


def head_pass_bytes(c, tp_size: int = 1) -> float:
    """Weight bytes of one head pass at one position on one of `tp_size` ranks (builder/sharding.py):
    eh_proj and the norms whole, the attention projections and the dense FFN split. The draft pick is
    apart (every rank makes it whole)."""
    H = c.hidden_size
    split = c.qkvr_size * H + H * c.q_size + 3 * c.mtp_intermediate_size * H
    return (2 * H * H + split / tp_size) * BF16


def table(config, out: dict, context: int) -> dict:
    a = acceptance_model()
    # The runtime replays CUDA graphs where it has them: their times when measured, else the eager ones.
    graphed = "graphed_seconds" in out["head"]
    head_pass, pick = out["head"]["graphed_seconds" if graphed else "seconds"], out["head"]["draft_seconds"]
    head = head_pass + pick
    big = preset("inkling-1t")
    # inkling-bench's heads are inkling-1t's (the same sizes). On 4 GPUs each rank reads its share of a
    # head pass (builder/sharding.py) at the efficiency measured here, and makes the whole pick itself.
    big_head = head_pass * head_pass_bytes(big, 4) / head_pass_bytes(big, 1) + pick
    rows = {}
    for k in DRAFTS:
        v = out["verify"][k]
        verify = v["graphed_seconds" if graphed else "seconds"]
        tokens = (1 - a ** (k + 1)) / (1 - a)
        step = verify + k * head
        experts = round(v["distinct_experts_per_layer"])
        efficiency = decode_step_bytes(config, context, distinct_experts=experts).seconds / verify
        # inkling-1t on 4 GPUs: the verify step's bytes per GPU (builder/sharding.py's split) at this
        # efficiency, and k head passes and picks.
        big_verify = decode_step_bytes(big, context, distinct_experts=experts, tp_size=4).seconds / efficiency
        big_step = big_verify + k * big_head
        rows[k] = {
            "assumed_tokens_per_step": tokens,
            "step_s": step,
            "tokens_per_s_per_user": tokens / step,
            "verify_fraction_of_bound": efficiency,
            "projected_1t_tokens_per_s_per_user": tokens / big_step,
        }
    return {"assumed_acceptance_per_position": a, "cuda_graphs": graphed, "rows": rows}


def write_md(r: dict, path: str) -> None:
    t = r["table"]
    lines = [
        f"# MTP step components: {r['preset']}, context {r['context']}",
        "",
        f"`{r['command']}` on {r['device']}, {r['date']}.",
        "",
        f"One head pass at {r['head']['tokens']} position(s): {r['head']['seconds'] * 1e3:.3f} ms; draft pick "
        f"(`mtp_draft`, {r['head'].get('draft_rows', 'all')} lm_head rows): {r['head']['draft_seconds'] * 1e3:.3f} ms"
        + (
            f" (the whole vocabulary: {r['head']['full_vocab_draft_seconds'] * 1e3:.3f} ms)"
            if "full_vocab_draft_seconds" in r["head"]
            else ""
        )
        + f". torch.compile: {'yes' if r.get('compile') else 'no'}.",
        "",
        *(
            [
                "CUDA graphs (`--cuda_graphs`): head pass "
                f"{r['head']['graphed_seconds'] * 1e3:.3f} ms"
                + (
                    f" (its graph's replay alone {r['head']['replay_only_seconds'] * 1e3:.3f} ms)"
                    if "replay_only_seconds" in r["head"]
                    else ""
                )
                + "; main step with 1+k tokens "
                + ", ".join(
                    f"k={k}: {v['graphed_seconds'] * 1e3:.3f} ms (eager {v['eager_seconds'] * 1e3:.3f} ms)"
                    for k, v in r["verify"].items()
                )
                + " (padded to the bucket, input copies included; eager without the expert counting).",
                "",
            ]
            if "graphed_seconds" in r["head"]
            else []
        ),
        f"The table's step times: {'CUDA graph replays' if t.get('cuda_graphs') else 'eager'}.",
        "",
        "| drafts k | main step (1+k tokens) ms | distinct experts/layer | of bound | ASSUMED tokens/step | tokens/s/user | PROJECTED inkling-1t tokens/s/user (4 GPUs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, row in t["rows"].items():
        v = r["verify"][k]
        lines.append(
            f"| {k} | {v['graphed_seconds' if t.get('cuda_graphs') else 'seconds'] * 1e3:.3f} | "
            f"{v['distinct_experts_per_layer']:.1f} | "
            f"{row['verify_fraction_of_bound']:.0%} | {row['assumed_tokens_per_step']:.2f} | "
            f"{row['tokens_per_s_per_user']:.1f} | {row['projected_1t_tokens_per_s_per_user']:.1f} |"
        )
    lines += [
        "",
        f"ASSUMED: per-position acceptance {t['assumed_acceptance_per_position']:.3f} (geometric, mean acceptance "
        "length 4.5 at 8 drafts as vLLM published); synthetic heads accept nothing. PROJECTED: inkling-1t's verify "
        "bytes per GPU (4 GPUs) at the efficiency measured here, plus each rank's share of the heads as measured; "
        "not a measurement.",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())

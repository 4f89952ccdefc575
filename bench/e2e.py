"""`make bench`: the end-to-end workload users compare with vLLM's (8K prompt in, 1K tokens out).

    python -m bench.e2e --preset inkling-bench --device cuda --out build/bench-e2e     # the H200 run
    python -m bench.e2e --preset inkling-tiny --device cpu --prompt_len 128 --output_len 8 --batches 1,2 --out DIR

The weights are synthesized where they run (inkling-bench is 67 GB with NVFP4 experts, more than the
GPU host's free disk) and the engine is built in memory. Prompts come in three entropy tiers, from
text that ships with Python: low (source code and sorted numbers), mixed (the pydoc topics), high
(prose: the license text). `--cuda_graphs` replays the decode steps from CUDA graphs (off by default).
Measured, in one run: time to first token for one prompt, decode tokens/s
per user at batch 1, throughput at larger batches; the reference model as a user would otherwise run
it (eager, no cache: it recomputes the sequence for each token) on a few tokens; and the bound of
bench/bound.py. Writes results.json, results.md and a plot into --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch

from builder import BuildConfig, PluginConfig, build
from inkling.model import InklingReference
from inkling.synth import iter_synthetic_tensors, synth_config
from runtime import LLM, PromptInput, SamplingParams

from .bound import decode_step_bytes, prefill_flops


def tier_texts() -> dict[str, str]:
    """Text of three entropy tiers, from files every Python installation has."""
    import json as json_module
    import pydoc_data.topics

    code = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    numbers = " ".join(str(i) for i in range(100_000))
    topics = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    license_path = os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")
    prose = open(license_path, encoding="utf-8").read() if os.path.exists(license_path) else topics[::-1]
    return {"low": code + numbers, "mixed": topics, "high": prose}


def tier_prompts(tokenizer, bos: int, length: int) -> dict[str, torch.Tensor]:
    """One prompt of exactly `length` tokens per tier (text repeated if short)."""
    out = {}
    for tier, text in tier_texts().items():
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        while len(ids) < length:
            ids = ids + ids
        out[tier] = torch.tensor([bos] + ids[: length - 1])
    return out


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
    ap.add_argument("--batches", default="1,8,32,64", help="batch sizes of the decode throughput runs")
    ap.add_argument("--reference_tokens", type=int, default=2, help="tokens the eager reference generates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cuda_graphs",
        action="store_true",
        help="decode steps replayed from CUDA graphs (LLM(cuda_graphs=True))",
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    config, _ = synth_config(args.preset, mtp_heads=0, nvfp4=True)
    results: dict = {
        "command": " ".join(["python", "-m", "bench.e2e", *(sys.argv[1:] if argv is None else argv)]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "cuda_graphs": args.cuda_graphs,
    }
    prompts = measure_engine(args, config, results)  # the engine is freed on return
    bound = decode_step_bytes(config, args.prompt_len + args.output_len // 2)
    results["bound"] = {
        "decode_bytes_per_step": bound.total,
        "decode_step_s": bound.seconds,
        "tokens_per_s_per_user": 1 / bound.seconds,
        "prefill_s": prefill_flops(config, args.prompt_len) / 790e12,
    }
    ref = InklingReference.from_tensors(config, iter_synthetic_tensors(config, args.seed, args.device))
    ids = prompts["mixed"].to(args.device)
    with torch.no_grad():
        _, ref_s = timed(lambda: ref.generate(ids, args.reference_tokens, stop_ids=[]))
    results["reference_eager_s_per_token"] = ref_s / args.reference_tokens
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    write_table(results, os.path.join(args.out, "results.md"))
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


def measure_engine(args: argparse.Namespace, config, results: dict) -> dict[str, torch.Tensor]:
    """Build the engine in memory; time first tokens per tier and decoding per batch size."""
    from inkling.tokenizer import build_tokenizer

    batches = [int(b) for b in args.batches.split(",")]
    bc = BuildConfig(
        max_batch_size=max(batches), max_input_len=args.prompt_len, max_seq_len=args.prompt_len + args.output_len,
        max_num_tokens=max(args.prompt_len, max(batches)), dtype="bfloat16", device=args.device,
        plugin_config=PluginConfig(tune=args.device == "cuda"),
    )  # fmt: skip
    print(
        f"[bench] synthesizing {args.preset} with NVFP4 experts on {args.device}, building in memory",
        flush=True,
    )
    tensors = iter_synthetic_tensors(config, args.seed, args.device)
    engine, results["build_s"] = timed(lambda: build(tensors, bc, config=config))
    tokenizer = build_tokenizer()
    engine.tokenizer_json = tokenizer.to_str()
    llm = LLM(engine, cuda_graphs=args.cuda_graphs)
    prompts = tier_prompts(tokenizer, config.token_id("bos"), args.prompt_len)
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(PromptInput(prompts["low"][:64]), greedy)  # warm-up: kernels compile
    results["ttft_s"] = {
        tier: timed(lambda ids=ids: llm.generate(PromptInput(ids), greedy))[1]
        for tier, ids in prompts.items()
    }
    results["decode"] = {}
    long = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for batch in batches:
        reqs = [PromptInput(prompts[list(prompts)[i % 3]]) for i in range(batch)]
        outs, seconds = timed(lambda reqs=reqs: llm.generate(reqs, long))
        itl = sum(o.metrics["itl_s"] for o in outs) / len(outs)
        results["decode"][batch] = {
            "seconds": seconds,
            "itl_s": itl,
            "tokens_per_s_per_user": 1 / itl if itl else 0.0,
            "throughput_tokens_per_s": sum(o.completion_tokens for o in outs) / seconds,
        }
        print(f"[bench] batch {batch}: {results['decode'][batch]}", flush=True)
    return prompts


def write_table(r: dict, path: str) -> None:
    b = r["bound"]
    lines = [
        f"Command: `{r['command']}`; device {r['device']}; date {r['date']}; preset {r['preset']}; "
        f"build in memory {r['build_s']:.1f} s; CUDA graphs {'on' if r.get('cuda_graphs') else 'off'}.",
        "",
        "| measure | ours | bound | fraction of bound |",
        "|---|---|---|---|",
    ]
    for tier, s in r["ttft_s"].items():
        lines.append(
            f"| time to first token, {tier} prompt | {s:.3f} s | {b['prefill_s']:.3f} s | {b['prefill_s'] / s:.1%} |"
        )
    for batch, d in r["decode"].items():
        per_user = d["tokens_per_s_per_user"]
        lines.append(f"| decode tokens/s per user, batch {batch} | {per_user:.1f} | {b['tokens_per_s_per_user']:.0f} (batch 1) | "
                     f"{per_user / b['tokens_per_s_per_user']:.1%} |")  # fmt: skip
        lines.append(f"| throughput tokens/s, batch {batch} | {d['throughput_tokens_per_s']:.1f} | | |")
    lines.append(
        f"| reference model, eager, s per token (recomputes the sequence) | {r['reference_eager_s_per_token']:.2f} | | |"
    )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

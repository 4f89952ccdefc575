"""Start-up cost of the CUDA graphs: every reachable bucket of the step and the MTP heads is captured when
the runner starts (docs/interfaces.md "CUDA graphs"); this times that and its memory, then serves a
ragged MTP batch and checks that no call waited for a capture.

    python -m bench.startup --checkpoint DIR [--max_batch_size 16 --max_draft_len 8] --out DIR

A figure, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from builder import BuildConfig, PluginConfig, build
from runtime import LLMEngine, PromptInput, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--max_batch_size", type=int, default=16)
    p.add_argument("--max_draft_len", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="build/startup")
    args = p.parse_args(argv)
    bc = BuildConfig(
        dtype=args.dtype, device="cuda", max_batch_size=args.max_batch_size, max_draft_len=args.max_draft_len,
        max_seq_len=256, max_input_len=256, max_num_tokens=512, plugin_config=PluginConfig(tune=False),
    )  # fmt: skip
    engine = build(args.checkpoint, bc, echo=False)
    out = {}
    for attempt in ("first", "second"):  # the first start compiles the kernels; the second meets them cached
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        eng = LLMEngine(engine)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        graphs = {
            "step": eng.runner.step_graphs,
            "head": eng.runner.head_graphs,
            "draft": eng.runner.draft_graphs,
        }
        out[attempt] = {
            "start_s": seconds,
            "buckets": {k: len(g.buckets) for k, g in graphs.items() if g is not None},
            "capture_s": {k: g.stats.capture_seconds for k, g in graphs.items() if g is not None},
            "memory_mb": (torch.cuda.memory_allocated() - before) / 2**20,
        }
        print(f"[startup] {attempt}: {out[attempt]}", flush=True)
        del eng
    g = torch.Generator().manual_seed(1)
    eng = LLMEngine(engine)
    lens = (90, 3, 40, 17, 5, 64, 33, 12)
    for i, n in enumerate(lens):
        k = (0, 1, 3, args.max_draft_len)[i % 4] if eng.runner.num_heads else 0
        params = SamplingParams(max_tokens=24, ignore_eos=True, num_draft_tokens=min(k, eng.runner.num_heads))
        eng.add_request(str(i), PromptInput(torch.randint(11, 1000, (n,), generator=g)), params)
    start = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    graphs = [eng.runner.step_graphs, eng.runner.head_graphs, eng.runner.draft_graphs]
    out["serve"] = {
        "seconds": time.perf_counter() - start,
        "graphed": sum(g.stats.graphed for g in graphs if g),
        "eager": sum(g.stats.eager for g in graphs if g),
        "captures_while_serving": sum(g.stats.captures_while_serving for g in graphs if g),
    }
    print(f"[startup] serving a ragged MTP batch of {len(lens)}: {out['serve']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 1 if out["serve"]["captures_while_serving"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

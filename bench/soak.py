"""Soak: many short requests through `LLM` on one engine, watching resident memory and the block pool.

    python -m bench.soak --engine build/engine-tiny --requests 20000 --out DIR

Requests come in batches (`LLM.generate`): random prompts of 1-24 tokens, 1-8 new tokens, greedy and
seeded sampling, stop strings, some with MTP drafts where the engine has heads, repeats that hit the
prefix cache. After each thousand requests it records the process's resident memory (VmRSS) and checks
that no request left anything behind: every block free or held only by prefix-cache entries, every state
slot free, no request state. A figure, not a test (tests/e2e/test_soak.py is the CI-sized check).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import time

from runtime import LLM, PromptInput, SamplingParams


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def trim() -> None:
    """Give the C allocator's free memory back to the system (glibc malloc_trim), so that resident memory
    reads what is live rather than what the allocator keeps for reuse."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def leftovers(llm: LLM) -> dict[str, int]:
    """What requests left behind (all zero when nothing leaked)."""
    eng = llm.engine
    usage = eng.blocks.usage()
    return {
        "held_blocks": usage["used_blocks"] - usage["evictable_blocks"],
        "busy_slots": eng.build.max_batch_size - len(eng.scheduler.free_slots),
        "requests": len(eng.requests),
        "running": len(eng.scheduler.running),
        "waiting": len(eng.scheduler.waiting),
    }


def workload(rng: random.Random, n: int, vocab: int, drafts: int) -> list[tuple[PromptInput, SamplingParams]]:
    import torch

    out = []
    for _ in range(n):
        ids = [rng.randrange(11, vocab) for _ in range(rng.randint(1, 24))]
        if rng.random() < 0.2:
            ids = [11, 12, 13, 14, 15, 16, 17, 18, 19][: rng.randint(1, 9)]  # repeats: prefix-cache hits
        params = SamplingParams(
            max_tokens=rng.randint(1, 8),
            temperature=rng.choice([0.0, 0.0, 1.0]),
            top_k=rng.choice([0, 5]),
            seed=rng.randrange(2**31),
            stop=("e",) if rng.random() < 0.2 else (),
            ignore_eos=rng.random() < 0.5,
            num_draft_tokens=drafts if drafts and rng.random() < 0.3 else 0,
        )
        out.append((PromptInput(torch.tensor(ids)), params))
    return out


def soak(
    llm: LLM, requests: int, batch: int, seed: int = 0, every: int = 1000, log=print, trimmed: bool = False
) -> dict:
    rng = random.Random(seed)
    vocab = min(llm.engine.num_real_tokens, 1000)
    drafts = min(2, llm.engine.runner.num_heads)
    samples, failures, done = [], [], 0
    t0 = time.perf_counter()
    while done < requests:
        n = min(batch, requests - done)
        items = workload(rng, n, vocab, drafts)
        outs = llm.generate([p for p, _ in items], [s for _, s in items])
        failures += [o.error for o in outs if o.finish_reason == "error"]
        done += n
        if done % every < n or done == requests:
            gc.collect()
            if trimmed:
                trim()
            left = leftovers(llm)
            samples.append(
                {"requests": done, "rss_mb": rss_mb(), "seconds": time.perf_counter() - t0, **left}
            )
            log(f"[soak] {done} requests: RSS {samples[-1]['rss_mb']:.1f} MB, left behind {left}")
    after_warmup = [s["rss_mb"] for s in samples[1:]] or [samples[0]["rss_mb"]]
    return {
        "requests": requests,
        "batch": batch,
        "trimmed": trimmed,
        "samples": samples,
        "rss_after_warmup_mb": after_warmup[0],
        "rss_final_mb": samples[-1]["rss_mb"],
        "rss_growth_after_warmup_mb": max(after_warmup) - after_warmup[0],
        "failed_requests": failures,
        "leaked": any(
            s[k] for s in samples for k in ("held_blocks", "busy_slots", "requests", "running", "waiting")
        ),
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="build/engine-tiny")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="build/soak")
    p.add_argument(
        "--trim",
        action="store_true",
        help="malloc_trim before each reading: live memory, not the allocator's",
    )
    args = p.parse_args(argv)
    llm = LLM(args.engine)
    result = soak(llm, args.requests, args.batch, args.seed, trimmed=args.trim)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"[soak] {args.requests} requests in {result['seconds']:.0f} s: RSS {result['rss_after_warmup_mb']:.1f} MB "
        f"after the first thousand, {result['rss_final_mb']:.1f} MB at the end "
        f"(growth {result['rss_growth_after_warmup_mb']:.1f} MB); leaked: {result['leaked']}; "
        f"failed requests: {len(result['failed_requests'])}"
    )
    return 1 if result["leaked"] or result["failed_requests"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

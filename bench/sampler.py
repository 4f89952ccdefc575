"""`python -m bench.sampler`: a step's sampling over the real Inkling's 200,058 tokens, row by row (as the
runtime drew until 2026-12-06) against batched (runtime.sampler.sample_tokens, target_probs), at temperature 1
with a generator per request, on the device, each timed as the mean over repeats after a warm-up.

    python -m bench.sampler --out build/sampler          # the GPU run (about 20 s)
    python -m bench.sampler --device cpu --batches 1,8 --out DIR

Two workloads: a decode step (one row a sequence: make_picks' draws) and an MTP verify with 3 drafts (4 rows a
sequence: verify_sampled's target distributions). Both ways must give the same tokens and probabilities; the
run checks that before timing. Writes results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from runtime.params import SamplingParams
from runtime.sampler import filter_logits, make_generator, sample_tokens, target_probs

VOCAB = 200_058


def row_by_row_picks(logits, params, generators) -> torch.Tensor:
    picks = []
    for row, p, g in zip(logits, params, generators):
        probs = torch.softmax(filter_logits(row, p), -1)
        picks.append(torch.argmax(probs / torch.empty_like(probs).exponential_(generator=g)))
    return torch.stack(picks)


def row_by_row_probs(logits, spans, params) -> torch.Tensor:
    return torch.cat([torch.softmax(filter_logits(logits[a:b], p), -1) for (a, b), p in zip(spans, params)])


def timed(fn, device: str, repeats: int) -> float:
    """Mean seconds of fn() over `repeats` calls after three warm-ups."""
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def measure(B: int, device: str, repeats: int) -> dict:
    """One batch's row: the two ways checked equal, then each timed."""
    params = [SamplingParams(temperature=1.0)] * B
    logits = torch.randn(4 * B, VOCAB, device=device) * 4
    picks, spans = logits[:B], [(4 * i, 4 * i + 4) for i in range(B)]
    gens = [[make_generator(i, device) for i in range(B)] for _ in range(4)]
    if not torch.equal(row_by_row_picks(picks, params, gens[0]), sample_tokens(picks, params, gens[1])):
        raise AssertionError("the batched draws differ from row-by-row ones")
    if not torch.equal(row_by_row_probs(logits, spans, params), target_probs(logits, spans, params)):
        raise AssertionError("the batched verify distributions differ from row-by-row ones")
    return {
        "batch": B,
        "decode_row_by_row_ms": 1e3
        * timed(lambda: row_by_row_picks(picks, params, gens[2]), device, repeats),
        "decode_batched_ms": 1e3 * timed(lambda: sample_tokens(picks, params, gens[3]), device, repeats),
        "verify_row_by_row_ms": 1e3 * timed(lambda: row_by_row_probs(logits, spans, params), device, repeats),
        "verify_batched_ms": 1e3 * timed(lambda: target_probs(logits, spans, params), device, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        rows.append(measure(B, args.device, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": device, "vocab": VOCAB, "temperature": 1.0, "rows": rows}, f, indent=1)
    print(f"\n{device}, vocabulary {VOCAB}, temperature 1, a generator per request")
    print(
        "| batch | decode draws: row by row / batched (ms) | verify of 4 rows a sequence: row by row / batched (ms) |"
    )
    print("|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['decode_row_by_row_ms']:.3f} / {r['decode_batched_ms']:.3f} | "
            f"{r['verify_row_by_row_ms']:.3f} / {r['verify_batched_ms']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

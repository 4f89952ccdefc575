"""`python -m bench.unembed`: the real Inkling's unembedding (logits = h / 24 @ W[:200058].T, W 201,024 × 6,144
bf16) at decode and verify sizes on the GPU, two ways, against W's bytes over the bandwidth:

- `sliced`: cuBLAS on the unpadded rows (the engine's form before this benchmark): the logits' rows are
  200,058 wide, so their leading dimension is not a multiple of 8 elements;
- `padded`: cuBLAS on all 201,024 rows, the logits sliced after (0.5% more bytes, aligned rows), as
  transformers computes them and as the engine does since this benchmark's first run (H100, 2026-12-07:
  820 against 896 µs at one row, 863 against 1,262 at 128). A Triton swap-AB kernel on the unpadded rows
  (the retired mtp_draft's form, writing logits) ran 800–1,830 µs there and was dropped.

Each is checked against `sliced` (bf16: equal within a bf16 step of the largest logit) and timed by CUDA-graph
replays (median), W (2.47 GB) far larger than L2. Writes results.json and prints a table.

    python -m bench.unembed --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton.testing

from bench.bound import BANDWIDTH

H, V_REAL, V_PADDED, MUP = 6144, 200_058, 201_024, 24.0
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def forms(w: torch.Tensor) -> dict:
    return {
        "sliced": lambda x: x / MUP @ w[:V_REAL].T,
        "padded": lambda x: (x / MUP @ w.T)[:, :V_REAL],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    w = (torch.randn(V_PADDED, H, device="cuda") * 0.02).to(torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "rows": {}}
    print("| rows | form | µs | TB/s (W's bytes) | of 4.35 TB/s | max diff vs sliced |")
    print("|---|---|---|---|---|---|")
    for n in map(int, args.rows.split(",")):
        x = torch.randn(n, H, device="cuda").to(torch.bfloat16) * 3
        truth = forms(w)["sliced"](x).float()
        row = {}
        for name, fn in forms(w).items():
            diff = (fn(x).float() - truth).abs().max().item()
            ms = triton.testing.do_bench_cudagraph(lambda fn=fn, x=x: fn(x), rep=100, return_mode="median")
            bytes_per_s = (V_PADDED if name == "padded" else V_REAL) * H * 2 / (ms * 1e-3)
            row[name] = {"us": ms * 1e3, "tb_s": bytes_per_s / 1e12, "max_diff": diff}
            print(f"| {n} | {name} | {ms * 1e3:.1f} | {bytes_per_s / 1e12:.2f} | {bytes_per_s / BANDWIDTH:.1%} "
                  f"| {diff:.3g} |", flush=True)  # fmt: skip
        results["rows"][n] = row
        scale = truth.abs().max().item()
        for name, r in row.items():
            if r["max_diff"] > scale / 64:  # a bf16 step at the largest logit, twice over
                raise SystemExit(
                    f"unembed {name} at {n} rows differs by {r['max_diff']} (logits up to {scale})"
                )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

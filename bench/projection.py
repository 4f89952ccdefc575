"""`python -m bench.projection`: inkling-1t's tokens/s per user at batch 1 on N H200s, plain and with MTP,
projected from the bytes each GPU reads. A projection, not a measurement: no run of the 1T stands behind it.

    python -m bench.projection --out DIR [--gpus 4,8] [--context 8192] [--efficiency 0.515] [--mtp_efficiency ...]

The model of a step (bench/bound.py's bytes, on inkling-1t with the published NVFP4 experts):
- every GPU reads 1/N of the attention projections, the dense layers, the shared experts, the unembedding
  and the KV (heads split), and its own routed experts: experts are spread E/N to a GPU, and a layer waits
  for its busiest GPU, the expected largest share of the step's distinct experts (sampled without
  replacement, seeded); the router and the norms are replicated;
- two collectives a layer (after attention and after the MoE), --collective_us each;
- the step takes bytes / 4.35 TB/s at the bound, and bound / efficiency at our measured efficiency (the
  fraction of its byte bound our engine reached on inkling-bench, one GPU, batch 1: 51.5%, H200,
  2026-12-04, BENCHMARKS.md);
- an MTP round of k drafts: the verify of k + 1 tokens (their distinct experts), then k depth passes, each
  one Inkling block with its dense MLP (intermediate_size) and input_proj, its KV, and the draft pick over
  the unembedding (or --draft_vocab rows); tokens per round = the acceptance length a (the small trained
  model's 3.45 at k = 3, CPU, BENCHMARKS.md; vLLM's published 4.5 at k = 8), and the round runs at
  --mtp_efficiency of its bound (default 28.7%: inkling-bench's round of 3 drafts at batch 1 took 17.0 ms
  on one H200, 2026-12-04, against 4.87 ms by this same model of its bytes).
It also says whether the weights fit: the 1T's bytes over N H200s of 141 GB (KV, activations and graphs
need room beside them).

Writes projection.json and projection.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from inkling.published.config import preset

from .bound import BANDWIDTH, BF16, NVFP4, decode_step_bytes

H200_BYTES = 141e9
PEERS = {"vLLM (4x GB200), MTP": 380.0, "TokenSpeed (4x B200), MTP": 354.6, "vLLM, no MTP": 140.0}


def busiest_share(distinct: int, experts: int, gpus: int, samples: int = 4000, seed: int = 0) -> float:
    """The expected largest number of a layer's `distinct` routed experts (uniform, without replacement)
    that land on one GPU when `experts` are spread evenly over `gpus`."""
    rng = random.Random(seed)
    per = experts // gpus
    total = 0
    for _ in range(samples):
        counts = [0] * gpus
        for e in rng.sample(range(experts), distinct):
            counts[min(e // per, gpus - 1)] += 1
        total += max(counts)
    return total / samples


def distinct_experts(k: int, tokens: int, experts: int) -> int:
    """Distinct experts of `tokens` tokens routed uniformly, k each (rounded)."""
    return round(experts * (1 - (1 - k / experts) ** tokens))


def step_seconds(c, context: int, gpus: int, tokens: int, collective_s: float) -> tuple[float, float]:
    """(bytes on the busiest GPU, seconds at the bound) of a trunk step of `tokens` tokens at batch 1."""
    t = c.text
    distinct = distinct_experts(t.num_experts_per_tok, tokens, t.n_routed_experts)
    one = decode_step_bytes(c, context, distinct_experts=distinct)
    # The routed experts' bytes apart: one expert of an MoE layer, summed over the layers.
    routed_one = sum(
        3 * t.moe_intermediate_size * t.hidden_size * (NVFP4 if c.experts_quantized(layer) else BF16)
        for layer in range(t.num_hidden_layers)
        if not t.is_dense(layer)
    )
    routed = routed_one * distinct
    router = sum((t.n_routed_experts + t.n_shared_experts) * t.hidden_size * BF16
                 for layer in range(t.num_hidden_layers) if not t.is_dense(layer))  # fmt: skip
    split = (one.weights - routed - router + one.rel_embed + one.kv + one.lm_head) / gpus
    busiest = routed_one * busiest_share(distinct, t.n_routed_experts, gpus) if gpus > 1 else routed
    nbytes = split + busiest + router
    return nbytes, nbytes / BANDWIDTH + 2 * t.num_hidden_layers * collective_s * (gpus > 1)


def depth_bytes(c, context: int, depth: int, draft_rows: int) -> float:
    """Bytes one MTP depth pass reads at batch 1 (one GPU): input_proj, its attention projections and KV,
    its dense MLP, the draft pick's unembedding rows."""
    t, a = c.text, c.mtp_attention(depth)
    H = t.hidden_size
    keys = min(context, a.window or context)
    proj = ((a.q_size + 2 * a.kv_size + a.r_size) * H + H * a.q_size) * BF16
    mlp = 3 * t.intermediate_size * H * BF16
    return 2 * H * H * BF16 + proj + mlp + 2 * keys * a.kv_size * BF16 + draft_rows * H * BF16


def total_weight_bytes(c) -> float:
    """The engine's weights: every expert, the trunk, the embedding and unembedding, the 8 depths."""
    t = c.text
    every = decode_step_bytes(c, 0, distinct_experts=t.n_routed_experts)
    depths = sum(depth_bytes(c, 0, d, 0) for d in range(c.mtp.num_layers))
    return every.weights + 2 * t.num_real_tokens * t.hidden_size * BF16 + depths


def project(args: argparse.Namespace) -> dict:
    c = preset("inkling-1t", nvfp4=True)
    draft_rows = args.draft_vocab or c.text.num_real_tokens
    collective = args.collective_us * 1e-6
    rows = []
    for n in args.gpus:
        _, plain = step_seconds(c, args.context, n, 1, collective)
        row = {
            "gpus": n,
            "weights_gb_per_gpu": total_weight_bytes(c) / n / 1e9,
            "fits": total_weight_bytes(c) / n < H200_BYTES,
            "plain": {"bound_tps": 1 / plain, "projected_tps": args.efficiency / plain},
            "mtp": [],
        }
        for k, accept, source in ((3, 3.45, "small trained model, measured"), (8, 4.5, "vLLM, published")):
            _, verify = step_seconds(c, args.context, n, k + 1, collective)
            depths = sum(depth_bytes(c, args.context, d, draft_rows) for d in range(k)) / n / BANDWIDTH
            depths += 2 * k * collective * (n > 1)
            round_s = verify + depths
            row["mtp"].append({
                "drafts": k, "acceptance_length": accept, "acceptance_from": source,
                "round_bound_ms": round_s * 1e3, "bound_tps": accept / round_s,
                "projected_tps": accept * args.mtp_efficiency / round_s,
            })  # fmt: skip
        rows.append(row)
    return {"context": args.context, "efficiency": args.efficiency, "mtp_efficiency": args.mtp_efficiency,
            "collective_us": args.collective_us, "draft_rows": draft_rows, "rows": rows, "peers": PEERS}  # fmt: skip


def table(p: dict) -> str:
    lines = [
        "# inkling-1t on N H200s, batch 1: a projection from bytes per GPU, not a measurement",
        "",
        f"Context {p['context']} tokens; two collectives a layer at {p['collective_us']} µs; the draft pick reads "
        f"{p['draft_rows']} unembedding rows; projected = bound × {p['efficiency']:.1%} (plain) and × "
        f"{p['mtp_efficiency']:.1%} (MTP), the fraction of its bound our engine measured on one H200.",
        "",
        "| GPUs | weights per GPU | plain: bound / projected tokens/s | MTP k = 3, a = 3.45: bound / projected "
        "| MTP k = 8, a = 4.5: bound / projected |",
        "|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        fits = "" if r["fits"] else " (does not fit: over 141 GB)"
        mtp = " | ".join(f"{m['bound_tps']:.0f} / {m['projected_tps']:.0f}" for m in r["mtp"])
        lines.append(
            f"| {r['gpus']} | {r['weights_gb_per_gpu']:.0f} GB{fits} | "
            f"{r['plain']['bound_tps']:.0f} / {r['plain']['projected_tps']:.0f} | {mtp} |"
        )
    lines += [
        "",
        "Peers, measured on their hardware: " + "; ".join(f"{k} {v}" for k, v in p["peers"].items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--efficiency", type=float, default=0.515, help="plain steps' measured fraction of bound")
    ap.add_argument("--mtp_efficiency", type=float, default=0.287, help="MTP rounds' fraction of bound")
    ap.add_argument("--collective_us", type=float, default=10.0)
    ap.add_argument(
        "--draft_vocab", type=int, default=0, help="rows the draft pick reads; 0: every real token"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    p = project(args)
    write(args.out, "projection", p, table(p))
    return 0


def write(out: str, name: str, p: dict, text: str) -> None:
    """A projection's figures as out/NAME.json and its table as out/NAME.md, the table printed too."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(p, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m bench.parallel_projection`: inkling-1t's decode step on 8 H200s under three layouts, from the
bytes each GPU reads and the bytes it exchanges. A projection, not a measurement: no run of the 1T stands
behind it.

    python -m bench.parallel_projection --out DIR [--gpus 8] [--batches 1,8,64,256] [--context 8192]

The layouts (B users in all, one token each a step, context --context):
- tp: tensor parallelism, every GPU 1/N of everything, each routed expert sliced by width (today's
  earlier-model engine). Every GPU reads 1/N of the step's distinct experts. Two all-reduces of [B, H] a
  layer (after attention, after the MoE).
- attn-tp/ep: attention (and the dense layers, the shared experts, the unembedding) split by tensor
  parallelism, routed experts whole, E/N a GPU (TokenSpeed's attn_tp × moe_ep). After the attention's
  all-reduce every GPU holds every token, so the dispatch is local; the MoE's parts meet in a second
  all-reduce. A layer waits for its busiest GPU: the expected largest share of the distinct experts
  (bench/projection.busiest_share).
- dp/ep: data-parallel attention, each GPU its B/N users with the whole attention, dense layers, shared
  experts and unembedding, routed experts E/N a GPU. Tokens go to their experts' GPUs and back by two
  all-to-alls a MoE layer: each token's hidden state to each of its top-k experts' GPUs other than its own.
  (Not built: the engine's dispatch is the next layout's.)
- dp/ep gather: data-parallel attention as built (runtime/data_parallel.py): the shared experts sliced by
  width as the routed experts are placed, and every GPU's rows all-gathered to every GPU and the sums
  reduce-scattered back, a MoE layer (fixed shapes, CUDA-graph safe; the all-to-all's bytes grow with top-k,
  these with N).
Collective bytes are what one GPU sends: a ring all-reduce of S bytes sends 2 (N-1)/N S. Time at the
bound: bytes read over 4.35 TB/s, plus bytes sent over --link_gbs (NVLink, one direction), plus
--collective_us a collective. The logits (vocabulary-parallel sampling in every layout) and the MTP depths
are left out.

Writes parallel_projection.json and parallel_projection.md into --out.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

from inkling.published.config import preset

from .bound import BANDWIDTH, BF16, NVFP4, expected_distinct_experts
from .projection import H200_BYTES, busiest_share, total_weight_bytes, write

LAYOUTS = ("tp", "attn-tp/ep", "dp/ep", "dp/ep gather")


@dataclass(frozen=True)
class Parts:
    """inkling-1t's decode bytes by part (one GPU, every layer)."""

    attention: float  # q/k/v/r and output projections
    dense: float  # the dense layers' MLPs
    router: float
    shared: float  # the shared experts
    expert: float  # one routed expert of every MoE layer
    unembed: float
    kv_per_user: float  # KV and relative-bank rows one user's step reads at the context
    moe_layers: int
    layers: int
    hidden: int


def parts_of(c, context: int) -> Parts:
    t = c.text
    H, I = t.hidden_size, t.moe_intermediate_size
    p = dict(attention=0.0, dense=0.0, router=0.0, shared=0.0, expert=0.0, kv=0.0)
    for layer in range(t.num_hidden_layers):
        a = t.attention(layer)
        keys = min(context, a.window or context)
        p["attention"] += ((a.q_size + 2 * a.kv_size + a.r_size) * H + H * a.q_size) * BF16
        p["kv"] += 2 * keys * a.kv_size * BF16 + a.d_rel * min(keys, a.rel_extent) * BF16
        if t.is_dense(layer):
            p["dense"] += 3 * t.intermediate_size * H * BF16
        else:
            p["router"] += (t.n_routed_experts + t.n_shared_experts) * H * BF16
            p["shared"] += t.n_shared_experts * 3 * I * H * BF16
            p["expert"] += 3 * I * H * (NVFP4 if c.experts_quantized(layer) else BF16)
    moe = sum(not t.is_dense(i) for i in range(t.num_hidden_layers))
    return Parts(
        p["attention"], p["dense"], p["router"], p["shared"], p["expert"], t.num_real_tokens * H * BF16,
        p["kv"], moe, t.num_hidden_layers, H,
    )  # fmt: skip


def layout_step(c, parts: Parts, layout: str, gpus: int, batch: int) -> dict:
    """The busiest GPU's bytes read and bytes sent in one decode step of `batch` users."""
    t, n = c.text, gpus
    distinct = round(expected_distinct_experts(c, batch))
    busiest = busiest_share(distinct, t.n_routed_experts, n) if n > 1 else distinct
    token = parts.hidden * BF16  # one token's hidden state
    all_reduce = 2 * (n - 1) / n * batch * token
    if layout == "tp":
        read = (parts.attention + parts.dense + parts.shared + parts.unembed + distinct * parts.expert) / n
        read += parts.router + batch * parts.kv_per_user / n
        sent, collectives = 2 * parts.layers * all_reduce, 2 * parts.layers
    elif layout == "attn-tp/ep":
        read = (parts.attention + parts.dense + parts.shared + parts.unembed) / n + busiest * parts.expert
        read += parts.router + batch * parts.kv_per_user / n
        sent, collectives = 2 * parts.layers * all_reduce, 2 * parts.layers
    elif layout == "dp/ep":
        local = math.ceil(batch / n)
        read = parts.attention + parts.dense + parts.shared + parts.unembed + parts.router
        read += busiest * parts.expert + local * parts.kv_per_user
        # each token to its top-k experts' GPUs other than its own, and back
        away = t.num_experts_per_tok * (n - 1) / n
        sent, collectives = 2 * parts.moe_layers * local * away * token, 2 * parts.moe_layers
    elif layout == "dp/ep gather":
        local = math.ceil(batch / n)
        read = parts.attention + parts.dense + parts.shared / n + parts.unembed + parts.router
        read += busiest * parts.expert + local * parts.kv_per_user
        # a ring all-gather of the N * local rows, and a ring reduce-scatter of their sums
        sent, collectives = 2 * parts.moe_layers * (n - 1) * local * token, 2 * parts.moe_layers
    else:
        raise ValueError(f"unknown layout {layout!r}: one of {LAYOUTS}")
    return {"read_bytes": read, "sent_bytes": sent, "collectives": collectives, "distinct_experts": distinct}


def weights_per_gpu(c, parts: Parts, layout: str, gpus: int) -> float:
    """Weight bytes on the fullest GPU (MTP depths and towers split evenly: they are small beside the rest)."""
    whole = total_weight_bytes(c)
    if not layout.startswith("dp/ep"):
        return whole / gpus
    split = parts.expert * c.text.n_routed_experts + (parts.shared if layout == "dp/ep gather" else 0)
    return (whole - split) + split / gpus  # everything but the routed (and split shared) experts on every GPU


def project(args: argparse.Namespace) -> dict:
    c = preset("inkling-1t", nvfp4=True)
    parts = parts_of(c, args.context)
    rows = []
    for batch in args.batches:
        for layout in LAYOUTS:
            step = layout_step(c, parts, layout, args.gpus, batch)
            seconds = (
                step["read_bytes"] / BANDWIDTH
                + step["sent_bytes"] / (args.link_gbs * 1e9)
                + step["collectives"] * args.collective_us * 1e-6
            )
            memory = weights_per_gpu(c, parts, layout, args.gpus)
            rows.append({
                "batch": batch, "layout": layout, **step, "step_bound_ms": seconds * 1e3,
                "tokens_per_s_per_user": 1 / seconds, "throughput": batch / seconds,
                "weights_gb_per_gpu": memory / 1e9, "fits": memory < H200_BYTES,
            })  # fmt: skip
    return {"gpus": args.gpus, "context": args.context, "link_gbs": args.link_gbs,
            "collective_us": args.collective_us, "parts": asdict(parts), "rows": rows}  # fmt: skip


def table(p: dict) -> str:
    lines = [
        f"# inkling-1t on {p['gpus']} H200s, decode at {p['context']} tokens of context: a projection, not a "
        "measurement",
        "",
        f"Bytes read over 4.35 TB/s, bytes sent over {p['link_gbs']:.0f} GB/s, {p['collective_us']:.0f} µs a "
        "collective; the busiest GPU. tp: every expert sliced; attn-tp/ep: attention split, experts whole; "
        "dp/ep: attention per GPU for its own users, experts whole, all-to-all dispatch (not built); dp/ep gather: "
        "the same with the engine's all-gather dispatch and width-split shared experts.",
        "",
        "| users | layout | weights per GPU | read per GPU | sent per GPU | step bound | tokens/s per user | "
        "tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        fits = "" if r["fits"] else " (over 141 GB)"
        lines.append(
            f"| {r['batch']} | {r['layout']} | {r['weights_gb_per_gpu']:.0f} GB{fits} | "
            f"{r['read_bytes'] / 1e9:.2f} GB | {r['sent_bytes'] / 1e6:.1f} MB | {r['step_bound_ms']:.2f} ms | "
            f"{r['tokens_per_s_per_user']:.0f} | {r['throughput']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--link_gbs", type=float, default=450.0, help="NVLink GB/s one direction (H200: 450)")
    ap.add_argument("--collective_us", type=float, default=10.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    p = project(args)
    write(args.out, "parallel_projection", p, table(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

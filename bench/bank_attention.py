"""The real Inkling's attention kernel (`inkling::bank_attention`, Triton) on the real shapes, beside its peers
and the bound (GPU.md): one H200, bf16, paged KV (16 tokens a block).

    python -m bench.bank_attention --out build/bank-attention

Workloads (issue 40's anchors): causal prefill of 8K tokens on a full layer (64 query / 8 KV heads, the
relative term within 1024 tokens, log scaling on) and on a sliding one (64 / 16 heads, window 512); decode of
one query at 64K and 128K keys, and of 32 sequences at 8K, on a full layer; decode on a sliding layer.
Peers: SDPA's flash kernel without the relative term (causal prefill; decode on contiguous KV), the floor our
kernel would reach if the term were free; for prefill also FlexAttention with the term as a score_mod that
gathers a precomputed [H, T, X] table (the form vLLM serves on Hopper). Each is timed with CUDA-graph
replays (do_bench_cudagraph, median) after a check of ours against the model's math on a slice.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton.testing

import plugins  # noqa: F401  (registers the ops)
from inkling.published.ops import bank_attention as bank_math

BANDWIDTH, FLOPS = 4.35e12, 790e12  # GPU.md
PAGE = 16
D, DREL = 128, 16
FULL = dict(hq=64, hkv=8, extent=1024, window=0, log_floor=4096)  # a floor the 8K+ positions pass
SLIDING = dict(hq=64, hkv=16, extent=512, window=512, log_floor=0)


def paged(k: torch.Tensor, v: torch.Tensor, seqs: int, seq_len: int):
    """K/V [seqs * seq_len, Hkv, D] into a shuffled paged cache: (key_cache, value_cache, block_table)."""
    blocks = seqs * math.ceil(seq_len / PAGE)
    perm = torch.randperm(blocks, device=k.device)
    kc = torch.empty(blocks, PAGE, *k.shape[1:], dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    pad = blocks * PAGE - k.shape[0]
    kc[perm] = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(blocks, PAGE, *k.shape[1:])
    vc[perm] = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(blocks, PAGE, *k.shape[1:])
    table = perm.view(seqs, -1).to(torch.int32)
    return kc, vc, table


def workload(layer: dict, seqs: int, seq_len: int, q_len: int):
    """The op's arguments for `seqs` sequences of `seq_len` tokens, the last `q_len` of each new."""
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(seqs * seq_len, layer["hkv"], D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(seqs * q_len, layer["hq"], D, device=dev, dtype=dt)
    r = torch.randn(seqs * q_len, layer["hq"], DREL, device=dev, dtype=dt)
    bank = torch.randn(DREL, layer["extent"], device=dev, dtype=dt) * 0.25
    kc, vc, table = paged(k, v, seqs, seq_len)
    cu = torch.arange(0, seqs + 1, device=dev, dtype=torch.int32) * q_len
    lens = torch.full((seqs,), seq_len, device=dev, dtype=torch.int32)
    args = (q, r, bank, kc, vc, table, cu, lens, q_len, layer["window"], 1.0 / D, layer["log_floor"], 0.1)
    return args, (q, k, v, r, bank)


def check(args, raw, layer, seq_len, q_len) -> float:
    """Relative error of ours against the model's math (float32) on the first sequence's last 64 queries."""
    q, k, v, r, bank = raw
    n = min(64, q_len)
    out = torch.ops.inkling.bank_attention(*args, "triton")[q_len - n : q_len].float()
    pos = torch.arange(seq_len, device="cuda")
    want = bank_math(
        q[q_len - n : q_len].float(), k[:seq_len].float(), v[:seq_len].float(), r[q_len - n : q_len].float(),
        bank.float(), pos[seq_len - n :], pos, layer["window"] or None, 1.0 / D, layer["log_floor"] or None, 0.1,
    )  # fmt: skip
    return float((out - want).norm() / want.norm())


def time_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def sdpa_prefill(layer: dict, T: int):
    q = torch.randn(1, layer["hq"], T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, layer["hkv"], T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_decode(layer: dict, seqs: int, kv: int):
    q = torch.randn(seqs, layer["hq"], 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seqs, layer["hkv"], kv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def flex_prefill(layer: dict, T: int):
    """FlexAttention with the relative term as a score_mod reading a precomputed table [H, T, X] = r·P."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    H, X, W = layer["hq"], layer["extent"], layer["window"]
    q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, layer["hkv"], T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r = torch.randn(H, T, DREL, device="cuda", dtype=torch.bfloat16)
    bank = torch.randn(DREL, X, device="cuda", dtype=torch.bfloat16)
    table = torch.einsum("htd,dx->htx", r, bank).contiguous()  # 1 GB at 8K on a full layer

    def score_mod(score, b, h, qi, ki):
        dist = qi - ki
        near = dist < X
        return score + torch.where(near, table[h, qi, torch.clamp(dist, 0, X - 1)], 0.0)

    def mask(b, h, qi, ki):
        return (qi >= ki) & ((qi - ki < W) if W else True)

    block_mask = create_block_mask(mask, 1, 1, T, T, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda: fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0 / D, enable_gqa=True)


def prefill_flops(layer: dict, T: int) -> float:
    W = layer["window"] or T
    pairs = sum(min(i + 1, W) for i in range(0, T, 64)) * 64
    return pairs * layer["hq"] * 4 * D


def decode_bytes(layer: dict, seqs: int, kv: int) -> float:
    keys = min(kv, layer["window"] or kv)
    return seqs * 2 * keys * layer["hkv"] * D * 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--no-flex", action="store_true", help="leave FlexAttention out (its compile takes a while)"
    )
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    cases = [
        ("prefill 8K, full layer", FULL, 1, 8192, 8192),
        ("prefill 8K, sliding layer", SLIDING, 1, 8192, 8192),
        ("decode B=1, KV 64K, full", FULL, 1, 65536, 1),
        ("decode B=1, KV 128K, full", FULL, 1, 131072, 1),
        ("decode B=32, KV 8K, full", FULL, 32, 8192, 1),
        ("decode B=1, KV 8K, sliding", SLIDING, 1, 8192, 1),
        ("verify 4 queries, B=8, KV 8K, full", FULL, 8, 8192, 4),
    ]
    for name, layer, seqs, seq_len, q_len in cases:
        t0 = time.perf_counter()
        op_args, raw = workload(layer, seqs, seq_len, q_len)
        err = check(op_args, raw, layer, seq_len, q_len)
        ours = time_ms(lambda a=op_args: torch.ops.inkling.bank_attention(*a, "triton"))
        row = {"work": name, "ours_ms": ours, "rel_err": err}
        if q_len > 1 and seqs == 1:
            row["bound_ms"] = prefill_flops(layer, seq_len) / FLOPS * 1e3
            row["sdpa_no_term_ms"] = time_ms(sdpa_prefill(layer, seq_len)) if not layer["window"] else None
            if not args.no_flex:
                try:
                    row["flex_term_ms"] = time_ms(flex_prefill(layer, seq_len))
                except Exception as e:  # a peer that does not compile here is reported, not fatal
                    row["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            row["bound_ms"] = decode_bytes(layer, seqs, seq_len) / BANDWIDTH * 1e3
            if q_len == 1 and not layer["window"]:
                row["sdpa_no_term_ms"] = time_ms(sdpa_decode(layer, seqs, seq_len))
        row["wall_s"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        rows.append(row)
        del op_args, raw
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bank_attention.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=2)  # fmt: skip
    print(
        "\n| work | ours (ms) | bound (ms) | of bound | SDPA, no term (ms) | FlexAttention with the term (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        sdpa = f"{r['sdpa_no_term_ms']:.3f}" if r.get("sdpa_no_term_ms") else ""
        flex = f"{r['flex_term_ms']:.3f}" if r.get("flex_term_ms") else r.get("flex_error", "")[:40]
        print(f"| {r['work']} | {r['ours_ms']:.3f} | {r['bound_ms']:.3f} | {r['bound_ms'] / r['ours_ms']:.0%} "
              f"| {sdpa} | {flex} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

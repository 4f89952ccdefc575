"""The real Inkling's attention kernel (`inkling::bank_attention`, Triton) on the real shapes, beside its peers
and the bound (GPU.md): one H200, bf16, paged KV (16 tokens a block).

    python -m bench.bank_attention --out build/bank-attention
    python -m bench.bank_attention --out build/bank-attention --variants   # the prefill tiles instead

Workloads (issue 40's anchors): causal prefill of 8K tokens on a full layer (64 query / 8 KV heads, the
relative term within 1024 tokens, log scaling on) and on a sliding one (64 / 16 heads, window 512); decode of
one query at 64K and 128K keys, and of 32 sequences at 8K, on a full layer; decode on a sliding layer.
Peers: SDPA's flash kernel without the relative term (causal prefill; decode on contiguous KV), the floor our
kernel would reach if the term were free; for prefill also FlexAttention with the term as a score_mod that
gathers a precomputed [H, T, X] table (the form vLLM serves on Hopper). Each is timed with CUDA-graph
replays (do_bench_cudagraph, median) after a check of ours against the model's math on a slice.

`--variants` times the prefill launches' other tiles (PREFILL_VARIANTS: larger query and key tiles, eight
warps, three stages, the relative table's chunk and element type) on an 8K prefill of each layer kind and
on an 8K chunk at the end of 128K keys (the long prompt's chunks: almost every KV tile past the extent),
each checked against the model's math first; `relative=False` rows are the kernel's floor without the
term, not the op. Beside them, `paged_flash`: a minimal causal flash kernel on the same paged cache without
the term, the log scaling or the window (checked against SDPA), what Triton itself reaches on these tiles;
and SDPA itself on the 8K cases (causal; the sliding one with its window as a mask).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import torch
import triton
import triton.language as tl
import triton.testing

import plugins  # noqa: F401  (registers the ops)
from bench.sm90 import short
from inkling.published.ops import bank_attention as bank_math
from plugins.attention.launcher import AttentionConfig, bank_attention, choose_config

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


def check(args, raw, layer, seq_len, q_len, config: AttentionConfig | None = None) -> float:
    """Relative error of ours (the op, or the launch with `config`) against the model's math (float32) on
    the first sequence's last 64 queries."""
    q, k, v, r, bank = raw
    n = min(64, q_len)
    if config is None:
        out = torch.ops.inkling.bank_attention(*args, "triton")
    else:
        out = bank_attention(*args, config=config)
    out = out[q_len - n : q_len].float()
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


def sdpa_window(layer: dict, T: int):
    """SDPA over a sliding window given as a boolean mask (no term; K/V repeated to the query heads)."""
    q = torch.randn(1, layer["hq"], T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, layer["hq"], T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dist = torch.arange(T, device="cuda")[:, None] - torch.arange(T, device="cuda")
    mask = (dist >= 0) & (dist < layer["window"])
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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


def prefill_flops(layer: dict, T: int, q_len: int | None = None) -> float:
    """FLOPs of the last q_len (default T) queries of T tokens: QK^T and PV over the keys each may see."""
    W = layer["window"] or T
    pairs = sum(min(i + 1, W) for i in range(T - (q_len or T), T, 64)) * 64
    return pairs * layer["hq"] * 4 * D


def _tiles(block_q: int, block_n: int, warps: int, stages: int = 2, **kw) -> AttentionConfig:
    return AttentionConfig(
        heads=1, block_q=block_q, block_n=block_n, num_splits=1, num_warps=warps, num_stages=stages, **kw
    )


# Prefill launches beside the launcher's (one head a program, the chunked relative table). Compiled for
# sm_90 on the CPU (bench.sm90) every one holds 255 registers and spills; 128 x 128 serializes its wgmma.
PREFILL_VARIANTS = [
    _tiles(64, 64, 4, 3, shear="chunk"),
    _tiles(64, 64, 4, shear="chunk", chunk_tiles=2),
    _tiles(64, 64, 4, shear="chunk", chunk_tiles=5),
    _tiles(64, 64, 4, shear="chunk", chunk_tiles=9),  # a sliding layer's window and diagonal in one table
    _tiles(64, 64, 4, shear="chunk", table_dtype="bfloat16"),
    _tiles(64, 64, 4, shear="chunk", far_launch=True),  # full layers: the far tiles in their own launch
    _tiles(64, 64, 4, 3, shear="chunk", far_launch=True),
    # the far launch on Hopper's wgmma through Gluon (plugins/attention/gluon_attention.py), 2 and 3 K/V slots
    _tiles(64, 64, 4, shear="chunk", far_launch=True, far_impl="gluon"),
    _tiles(64, 64, 4, 3, shear="chunk", far_launch=True, far_impl="gluon"),
    _tiles(64, 64, 4, shear="chunk", far_launch=True, far_impl="gluon", far_q_in_registers=True),
    _tiles(64, 64, 4, 3, shear="chunk", far_launch=True, far_impl="gluon", far_q_in_registers=True),
    # two warpgroups of 64 query rows sharing each K/V tile (128 registers, 96 KB: two programs an SM)
    _tiles(128, 64, 8, shear="chunk", far_launch=True, far_impl="gluon"),
    # the near launch through Gluon too (the relative band on wgmma, sheared through shared memory), after the
    # `tl` or the Gluon far launch; on a sliding layer every tile. Its band in bf16 with Q in registers: two
    # programs an SM instead of one
    _tiles(64, 64, 4, shear="chunk", far_launch=True, near_impl="gluon"),
    _tiles(64, 64, 4, shear="chunk", far_launch=True, far_impl="gluon", near_impl="gluon"),
    _tiles(
        64,
        64,
        4,
        shear="chunk",
        far_launch=True,
        far_impl="gluon",
        near_impl="gluon",
        table_dtype="bfloat16",
        far_q_in_registers=True,
    ),  # fmt: skip
    _tiles(64, 64, 4, shear="scratch"),
    _tiles(64, 128, 4, shear="chunk", chunk_tiles=2),
    _tiles(128, 64, 8, shear="chunk"),
    _tiles(128, 64, 8, 3, shear="chunk"),
    _tiles(128, 64, 8, shear="chunk", chunk_tiles=5),
    _tiles(128, 128, 8, shear="chunk", chunk_tiles=2),
    _tiles(64, 64, 4, shear="chunk", relative=False),
    _tiles(128, 64, 8, shear="chunk", relative=False),
    _tiles(128, 128, 8, shear="chunk", relative=False),
]


@triton.jit
def _paged_flash_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, o_ptr, seq_len, q_len, stride_qt, stride_kb, stride_ks, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """Causal attention of the last q_len queries of one sequence over its paged K/V, one head a program:
    the unmasked tiles in one loop, then the diagonal's masked ones. No relative term."""
    qt = tl.program_id(0)
    h = tl.program_id(1)
    a = qt * BQ + tl.arange(0, BQ)
    d = tl.arange(0, D)
    row_ok = a < q_len
    q = tl.load(q_ptr + a[:, None] * stride_qt + h * D + d[None, :], mask=row_ok[:, None], other=0.0)
    first = seq_len - q_len + qt * BQ
    pos = first + tl.arange(0, BQ)
    last = tl.minimum(first + BQ, seq_len) - 1
    kv = (h // GROUP) * D
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    unmasked = (first + 1) // BN * BN
    for j0 in range(0, unmasked, BN):
        n = j0 + tl.arange(0, BN)
        off = tl.load(table_ptr + n // PAGE).to(tl.int64) * stride_kb + (n % PAGE) * stride_ks + kv
        s = tl.dot(q, tl.load(k_ptr + off[None, :] + d[:, None])) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), tl.load(v_ptr + off[:, None] + d[None, :]))
        m_i = m_new
    for j0 in range(unmasked, last + 1, BN):
        n = j0 + tl.arange(0, BN)
        ok = n <= last
        off = (
            tl.load(table_ptr + n // PAGE, mask=ok, other=0).to(tl.int64) * stride_kb
            + (n % PAGE) * stride_ks
            + kv
        )
        s = tl.dot(q, tl.load(k_ptr + off[None, :] + d[:, None], mask=ok[None, :], other=0.0)) * qk_scale
        s = tl.where(pos[:, None] >= n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(
        o_ptr + a[:, None] * stride_qt + h * D + d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_flash(
    q, key_cache, value_cache, table, seq_len: int, block_q: int, block_n: int, warps: int, stages: int
):
    """The minimal kernel's launch for one sequence: q [q_len, Hq, D] (the last q_len of seq_len tokens)."""
    q_len, hq, d = q.shape
    out = torch.empty_like(q)
    _paged_flash_kernel[(triton.cdiv(q_len, block_q), hq)](
        q, key_cache, value_cache, table, out, seq_len, q_len, q.stride(0), key_cache.stride(0),
        key_cache.stride(1), 1.0 / d, GROUP=hq // key_cache.shape[2], D=d, BQ=block_q, BN=block_n,
        PAGE=key_cache.shape[1], num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


FLOOR_TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]


def time_floor(op_args, raw, layer, seq_len: int, q_len: int, name: str, bound: float) -> list[dict]:
    """paged_flash's tiles on a full layer's case, checked against SDPA (causal, no term)."""
    q, k, v, _, _ = raw
    kc, vc, table = op_args[3], op_args[4], op_args[5]
    n = min(64, q_len)
    qs = q[q_len - n :].transpose(0, 1)[None].float()
    mask = torch.arange(seq_len - n, seq_len, device="cuda")[:, None] >= torch.arange(seq_len, device="cuda")
    want = torch.nn.functional.scaled_dot_product_attention(
        qs, k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float(), attn_mask=mask, scale=1.0 / D,
        enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    rows = []
    for bq, bn, warps, stages in FLOOR_TILES:
        row = {
            "work": name,
            "variant": f"paged_flash {bq}x{bn} {warps}w {stages}s (no term)",
            "default": False,
        }
        row["bound_ms"] = bound
        try:
            run = functools.partial(paged_flash, q, kc, vc, table[0], seq_len, bq, bn, warps, stages)
            row["rel_err"] = float((run()[q_len - n :].float() - want).norm() / want.norm())
            row["ms"] = time_ms(run)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def time_variants(out: str, variants: list[AttentionConfig] = PREFILL_VARIANTS, floor: bool = True) -> int:
    """Each prefill case with the launcher's tiles, then `variants`, then (floor) the minimal flash kernel's
    tiles on full layers, and SDPA: a table in variants.md."""
    cases = [  # the sliding layer last: the far launch's variants change nothing there
        ("prefill 8K, full layer", FULL, 8192, 8192),
        ("8K chunk at 128K, full layer", FULL, 131072, 8192),
        ("prefill 8K, sliding layer", SLIDING, 8192, 8192),
    ]
    rows = []
    for name, layer, seq_len, q_len in cases:
        op_args, raw = workload(layer, 1, seq_len, q_len)
        default = choose_config(
            1,
            layer["hq"],
            layer["hkv"],
            q_len,
            seq_len,
            torch.cuda.get_device_properties(0).multi_processor_count,
            window=layer["window"],
        )
        bound = prefill_flops(layer, seq_len, q_len) / FLOPS * 1e3
        for config in [default] + [c for c in variants if c != default]:
            t0 = time.perf_counter()
            row = {"work": name, "variant": short(config), "default": config == default, "bound_ms": bound}
            try:
                row["rel_err"] = check(op_args, raw, layer, seq_len, q_len, config)
                row["ms"] = time_ms(lambda a=op_args, c=config: bank_attention(*a, config=c))
            except Exception as e:  # a launch that does not compile or fit is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["wall_s"] = time.perf_counter() - t0
            print(json.dumps(row), flush=True)
            rows.append(row)
        if floor and not layer["window"]:
            rows += time_floor(op_args, raw, layer, seq_len, q_len, name, bound)
        del op_args, raw
        if q_len == seq_len:  # the peer in the same run: plain attention, no term
            peer, label = (
                (sdpa_window, "SDPA, the window as a mask (no term)")
                if layer["window"]
                else (sdpa_prefill, "SDPA causal (no term)")
            )
            row = {"work": name, "variant": label, "default": False, "bound_ms": bound}
            try:
                row["ms"] = time_ms(peer(layer, seq_len))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    with open(os.path.join(out, "variants.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=2)  # fmt: skip
    lines = ["| work | variant | ms | of the FLOP bound | error |", "|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")[:60]
        frac = f"{r['bound_ms'] / r['ms']:.0%}" if "ms" in r else ""
        mark = " (launcher's)" if r["default"] else ""
        lines.append(
            f"| {r['work']} | {r['variant']}{mark} | {ms} | {frac} | {r.get('rel_err', float('nan')):.2e} |"
        )
    with open(os.path.join(out, "variants.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def decode_bytes(layer: dict, seqs: int, kv: int) -> float:
    keys = min(kv, layer["window"] or kv)
    return seqs * 2 * keys * layer["hkv"] * D * 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--no-flex", action="store_true", help="leave FlexAttention out (its compile takes a while)"
    )
    ap.add_argument(
        "--variants", action="store_true", help="time the prefill tiles (PREFILL_VARIANTS) instead"
    )
    ap.add_argument(
        "--launcher-only",
        action="store_true",
        help="with --variants: the launcher's tiles alone, beside SDPA and the minimal flash kernel",
    )
    ap.add_argument("--only", default="", help="with --variants: the variants whose repr contains this")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.variants:
        chosen = [] if args.launcher_only else [c for c in PREFILL_VARIANTS if args.only in repr(c)]
        return time_variants(args.out, chosen, floor=not args.only)  # --only: those variants, in little time
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

"""Benchmark: the real Inkling's MoE (`inkling::sigmoid_sink_moe`, NVFP4 W4A16 Triton) and sconv at the
real shapes, on the GPU.

    PYTHONPATH=. python3 bench/moe.py --out DIR

Tunes the MoE tile table (launcher.tune, as the builder would), checks the Triton op against the
reference and the bf16 peer, then times (CUDA-graph replays, median): the Triton op, its bound
(bytes of the experts actually touched + shared + router + activations over 4.35 TB/s, or FLOPs
over 790 TFLOP/s, whichever is larger), the reference op, and bf16 grouped GEMMs on pre-dequantized
weights (torch._grouped_mm) behind the same sigmoid router. Then a layer's four sconvs (k and v on a
full layer's 8 KV heads, the attention and MLP outputs on H channels) against its MoE. Writes moe.md,
moe.json, moe_tune.json and moe.png to DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import plugins  # noqa: F401  (registers the ops)
from inkling.published.ops import sigmoid_route
from plugins.moe import launcher as moe_launcher
from plugins.moe import moe
from plugins.nvfp4 import dequantize_nvfp4, random_nvfp4

H, I, E, S, TOP_K, ROUTE_SCALE = 6144, 3072, 256, 2, 6, 8.0  # the real layer (INKLING_SPEC §3.6)
HKV, D, K_CONV, MAX_DRAFT = 8, 128, 4, 8
MEM_BW, TC_RATE = 4.35e12, 790e12
TOKENS = (1, 8, 64, 512, 4096)
PARTS_MAX_T = 64  # the per-launch breakdown for decode-sized T
DEV = "cuda"


def log(*a):
    print(*a, flush=True)


def make_layer(seed=0):
    """The op's weights as an engine holds a layer (the published NVFP4 layout, gate and up de-interleaved):
    {"gate", "bias", "scale", "w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2", "shared_w13",
    "shared_w2"}."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13, s13, g13 = random_nvfp4(2 * I, H, batch=(E,), device=DEV, generator=g)
    w2, s2, g2 = random_nvfp4(H, I, batch=(E,), device=DEV, generator=g)
    return {
        "gate": torch.randn(E + S, H, device=DEV, generator=g, dtype=torch.bfloat16) * H**-0.5,
        "bias": torch.randn(E, device=DEV, generator=g) * 0.3,
        "scale": torch.tensor([1.3], device=DEV),
        "w13": w13, "w13_scale": s13, "w13_scale_2": g13, "w2": w2, "w2_scale": s2, "w2_scale_2": g2,
        "shared_w13": torch.randn(S, 2 * I, H, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02,
        "shared_w2": torch.randn(S, H, I, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02,
    }  # fmt: skip


WEIGHTS = ("gate", "bias", "scale", "w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2",
           "shared_w13", "shared_w2")  # fmt: skip


def dequantized_bf16(layer):
    """Pre-dequantized routed experts for the bf16 peer: w13 [E, 2I, H], w2 [E, H, I]."""
    w13 = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.bfloat16)
    w2 = torch.empty(E, H, I, device=DEV, dtype=torch.bfloat16)
    for e in range(E):
        w13[e] = dequantize_nvfp4(layer["w13"][e], layer["w13_scale"][e], layer["w13_scale_2"][e])
        w2[e] = dequantize_nvfp4(layer["w2"][e], layer["w2_scale"][e], layer["w2_scale_2"][e])
    return w13, w2


def peer_moe(x, layer, w13, w2):
    """The best plain-torch path: the sigmoid router in float32, then bf16 grouped GEMMs (torch._grouped_mm),
    sync-free."""
    T = x.shape[0]
    shared_w13, shared_w2 = layer["shared_w13"], layer["shared_w2"]
    w_top, idx, w_shared = sigmoid_route(x, layer["gate"], layer["bias"], layer["scale"], ROUTE_SCALE, TOP_K)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // TOP_K
    counts = torch.zeros(E, dtype=torch.int32, device=DEV).scatter_add_(
        0, flat.int(), torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h13 = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    h = F.silu(h13[:, :I]) * h13[:, I:]
    o = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs) * w_top.flatten()[order, None].to(x.dtype)
    y = torch.zeros(T, H, device=DEV, dtype=torch.float32).index_add_(0, tok, o.float())
    hs = (x @ shared_w13.view(S * 2 * I, H).T).view(T, S, 2 * I)
    hs = (F.silu(hs[..., :I]) * hs[..., I:]) * w_shared[..., None].to(x.dtype)
    y += torch.bmm(hs.transpose(0, 1), shared_w2.transpose(1, 2)).float().sum(0)
    return y.to(x.dtype)


def bench(fn, graph=True):
    """Median ms of CUDA-graph replays (eager do_bench when capture is impossible)."""
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"), "graph"
        except Exception as exc:  # noqa: BLE001
            log(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:120]})")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), "eager"


def bound_us(T, n_experts):
    nvfp4_expert = 3 * I * H * 0.5625
    bytes_ = n_experts * nvfp4_expert + S * 3 * I * H * 2 + (E + S) * H * 2 + 2 * T * H * 2
    flops = T * (TOP_K + S) * 6 * I * H + 2 * T * H * (E + S)
    return max(bytes_ / MEM_BW, flops / TC_RATE) * 1e6, bytes_, flops


def op_args(layer, T: int, seed: int | None = None) -> tuple:
    """sigmoid_sink_moe's arguments (without tile_configs and impl) for `layer` (make_layer's) and T random
    tokens."""
    g = None if seed is None else torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=g)
    return (x, *[layer[n] for n in WEIGHTS], ROUTE_SCALE, TOP_K)


def experts_touched(args) -> int:
    """The distinct routed experts the tokens of op_args' `args` pick."""
    _, idx, _ = sigmoid_route(*args[:4], ROUTE_SCALE, TOP_K)
    return int(torch.unique(idx).numel())


def reference(args):
    return moe(*args, impl="reference")


def moe_section(out_dir, tokens=TOKENS):
    layer = make_layer()

    def inputs(T, seed=1):
        return op_args(layer, T, seed)

    t0 = time.time()
    # tune the buckets up to the one the largest measured T falls in (all four by default)
    buckets = []
    for b, t in zip((16, 128, 1024, 1 << 30), (1, 64, 512, 4096)):
        buckets.append((b, t))
        if b >= max(tokens):
            break
    table = moe_launcher.tune(inputs, *zip(*buckets), log=log)
    log(f"tuned in {time.time() - t0:.0f} s: {json.dumps(table)}")
    with open(os.path.join(out_dir, "moe_tune.json"), "w") as f:
        json.dump(table, f, indent=1)
    tile_configs = json.dumps(table)

    log("dequantizing the bf16 peer's weights ...")
    w13_bf16, w2_bf16 = dequantized_bf16(layer)
    rows = []
    for T in tokens:
        args = inputs(T, seed=T)
        x = args[0]
        tri = lambda: moe(*args, tile_configs=tile_configs)  # noqa: B023, E731
        ref = lambda: reference(args)  # noqa: B023, E731
        peer = lambda: peer_moe(x, layer, w13_bf16, w2_bf16)  # noqa: B023, E731
        y_tri, y_ref = tri(), ref()
        err_ref = ((y_tri.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        try:
            y_peer = peer()
            err_peer = ((y_peer.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        except Exception as exc:  # noqa: BLE001
            log(f"  bf16 peer failed: {type(exc).__name__}: {str(exc)[:200]}")
            peer, err_peer = None, float("nan")
        n_exp = experts_touched(args)
        b_us, b_bytes, flops = bound_us(T, n_exp)
        t_tri, mode = bench(tri)
        t_peer, peer_mode = bench(peer) if peer else (float("nan"), "-")
        torch.cuda.synchronize()
        t_ref = triton.testing.do_bench(ref, warmup=1, rep=1, return_mode="median")
        row = dict(T=T, experts=n_exp, bound_us=b_us, triton_us=t_tri * 1e3, peer_us=t_peer * 1e3, ref_us=t_ref * 1e3,
                   err_vs_ref=err_ref, peer_err_vs_ref=err_peer, tflops=flops / (t_tri * 1e-3) / 1e12,
                   tbps=b_bytes / (t_tri * 1e-3) / 1e12, mode=mode, peer_mode=peer_mode,
                   config=moe_launcher.select_config(table, T))  # fmt: skip
        if T <= PARTS_MAX_T:
            row["parts"] = parts(args, n_exp, moe_launcher.select_config(table, T))
        rows.append(row)
        log(f"T={T:5d} experts={n_exp:3d} bound {b_us:8.1f} us | triton {row['triton_us']:8.1f} us "
            f"({row['triton_us'] / b_us:.2f}x bound, {row['tflops']:.0f} TFLOP/s, {row['tbps']:.2f} TB/s) | "
            f"peer {row['peer_us']:8.1f} us | ref {row['ref_us']:9.1f} us | err {err_ref:.1e} peer err {err_peer:.1e}")  # fmt: skip
    return rows, table


def part_bytes(name: str, T: int, n_experts: int) -> float:
    """Bytes a launch of the MoE op must move (weights touched, activations in and out)."""
    nvfp4 = 0.5 + 1 / 16  # codes and fp8 block scales per weight
    x = T * H * 2
    return {
        "route": (E + S) * H * 2 + x + T * (E + S) * 4,  # the gate, x, the float32 logits
        "gemm1 routed": n_experts * 2 * I * H * nvfp4 + x + T * TOP_K * I * 2,
        "gemm1 shared": S * 2 * I * H * 2 + x + T * S * I * 2,
        "gemm2 routed": n_experts * H * I * nvfp4 + T * TOP_K * (I + H) * 2,
        "gemm2 shared": S * H * I * 2 + T * S * (I + H) * 2,
        "shared (cuBLAS)": S * 3 * I * H * 2 + x + T * S * H * 2,
        "combine": T * (TOP_K + S) * H * 2 + x,
    }[name]


def parts(args, n_experts: int, tuned: dict) -> list[dict]:
    """Each kernel launch of the op timed alone (CUDA-graph replays), for the tuned config and for the
    same tiles with the other shared-expert path, against its own bytes over the bandwidth: where a
    decode-sized MoE spends its time."""
    other = {**tuned, "shared": "torch" if tuned.get("shared", "triton") == "triton" else "triton"}
    T = args[0].shape[0]
    out = []
    for label, cfg in (("tuned", tuned), ("other shared path", other)):
        _, launches, _ = moe_launcher.sigmoid_launches(*args, config=cfg)
        for _, run in launches:  # fill every buffer once: a part replays on its inputs
            run()
        for name, run in launches:
            ms, _ = bench(run)
            b = part_bytes(name, T, n_experts)
            out.append(dict(config=label, part=name, us=ms * 1e3, bytes=b, bound_us=b / MEM_BW * 1e6))
            log(f"  T={T} [{label}] {name:16s} {ms * 1e3:8.1f} us, bound {b / MEM_BW * 1e6:6.1f} us "
                f"({b / MEM_BW * 1e6 / (ms * 1e3):.0%} of the bandwidth)")  # fmt: skip
    return out


def sconv_section(moe_rows):
    rows = []
    for T, B in ((1, 1), (8, 8), (64, 64), (512, 1), (4096, 1)):
        moe_us = next((r["triton_us"] for r in moe_rows if r["T"] == T), float("nan"))
        r = sconv_case(T, B, moe_us)
        rows.append(r)
        log(
            f"sconv T={T:5d} B={B:3d}: C=KV {r['sconv_kv_us']:.1f} us | "
            f"C=H {r['sconv_h_us']:.1f} us ({r['sconv_h_tbps']:.2f} TB/s) | layer sconvs "
            f"{r['layer_sconv_us']:.1f} us = {100 * r['share_of_moe']:.1f}% of the MoE"
        )
    return rows


def sconv_case(T, B, moe_us):
    """A layer's sconvs at T tokens in B sequences: k and v over a full layer's KV channels, the attention
    and MLP outputs over H (states of K - 1 + MAX_DRAFT rows, as an engine drafting 8 keeps them)."""
    S_rows = K_CONV - 1 + MAX_DRAFT
    C_kv = HKV * D
    g = torch.Generator(device=DEV).manual_seed(T)

    def rnd(*shape):
        return torch.randn(*shape, device=DEV, dtype=torch.bfloat16, generator=g)

    q_lens = [T // B] * B
    cu = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(B)], dtype=torch.int32, device=DEV)
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    x_kv, w_kv, st_kv = rnd(T, C_kv), rnd(C_kv, K_CONV), rnd(B, S_rows, C_kv)
    xh, wh, st_h = rnd(T, H), rnd(H, K_CONV), rnd(B, S_rows, H)
    t_kv, _ = bench(lambda: torch.ops.inkling.sconv(x_kv, w_kv, st_kv, slots, cu, "triton"))
    t_h, _ = bench(lambda: torch.ops.inkling.sconv(xh, wh, st_h, slots, cu, "triton"))
    layer_sconv = 2 * t_kv * 1e3 + 2 * t_h * 1e3
    bytes_h = 2 * T * H * 2
    return dict(
        T=T, B=B, sconv_kv_us=t_kv * 1e3, sconv_h_us=t_h * 1e3, sconv_h_tbps=bytes_h / (t_h * 1e-3) / 1e12,
        layer_sconv_us=layer_sconv, moe_us=moe_us, share_of_moe=layer_sconv / moe_us,
    )  # fmt: skip


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ts = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
    for key, label in (
        ("bound_us", "bound"),
        ("triton_us", "Triton NVFP4 W4A16"),
        ("peer_us", "bf16 _grouped_mm"),
        ("ref_us", "reference op"),
    ):
        ax.plot(Ts, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("time per MoE layer (us)")
    ax.set_title(f"sigmoid_sink_moe, real shapes, {torch.cuda.get_device_name()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def write_md(moe_rows, sconv_rows, path):
    gpu = torch.cuda.get_device_name()
    lines = [
        "# The real MoE (sigmoid_sink_moe) and sconv on the GPU",
        "",
        f"Command: `PYTHONPATH=. python3 bench/moe.py --out $OUT`; GPU: {gpu}; date: {datetime.date.today()}; "
        f"torch {torch.__version__}, triton {triton.__version__}. Medians of CUDA-graph replays (reference: eager).",
        "",
        f"The real MoE layer: H {H}, I {I}, E {E} NVFP4 routed top-{TOP_K}, S {S} bf16 shared, the sigmoid router; "
        "random data, bf16 activations.",
        "",
        "| T | experts touched | bound (us) | Triton (us) | x bound | TFLOP/s | TB/s | bf16 peer (us) | reference (us) | rel. err vs ref |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in moe_rows:
        lines.append(
            f"| {r['T']} | {r['experts']} | {r['bound_us']:.1f} | {r['triton_us']:.1f} | {r['triton_us'] / r['bound_us']:.2f} | "
            f"{r['tflops']:.0f} | {r['tbps']:.2f} | {r['peer_us']:.1f} | {r['ref_us']:.0f} | {r['err_vs_ref']:.1e} |"
        )
    part_rows = [(r["T"], p) for r in moe_rows for p in r.get("parts", [])]
    if part_rows:
        lines += ["", "Per launch (each replayed alone; bound = its bytes over 4.35 TB/s):", "",
                  "| T | config | launch | us | bound (us) | of bandwidth |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {T} | {p['config']} | {p['part']} | {p['us']:.1f} | {p['bound_us']:.1f} | {p['bound_us'] / p['us']:.0%} |"
            for T, p in part_rows
        ]
    lines += ["", "| T | B | sconv C=KV (us) | sconv C=H (us) | layer's four sconvs (us) | % of MoE |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in sconv_rows:
        lines.append(
            f"| {r['T']} | {r['B']} | {r['sconv_kv_us']:.1f} | {r['sconv_h_us']:.1f} | "
            f"{r['layer_sconv_us']:.1f} | {100 * r['share_of_moe']:.1f} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def launch_only(T: int) -> None:
    """The op at T tokens, three calls after a warm-up, for a profiler to capture (`ncu --kernel-name
    regex:moe_ ...`; bench/results/gpu-2026-12-01/s17c/): at decode sizes (T <= 16) in the default
    tensor-core config and in the GEMV one; above, in tune()'s last candidate without a register cap (at
    prefill sizes, the GEMM 1 and GEMM 2 tile pair, shared experts through cuBLAS: what s17c profiled)."""
    args = op_args(make_layer(), T)
    gemv = {"block_m": 1, "kernel": "gemv", "shared": "triton",
            "gemm1": {"block_n": 32, "block_k": 512, "num_warps": 4, "num_stages": 2},
            "gemm2": {"block_n": 32, "block_k": 512, "num_warps": 4, "num_stages": 2}}  # fmt: skip
    if T <= 16:
        configs = (("tensor cores", moe_launcher.select_config(None, T)), ("GEMV", gemv))
    else:
        cfg = next(c for c in reversed(moe_launcher._candidates(T)) if "maxnreg" not in c["gemm1"])
        configs = (("tune()'s last uncapped candidate", cfg),)
    for name, cfg in configs:
        moe_launcher.sigmoid_sink_moe(*args, config=cfg)  # compiles
        torch.cuda.synchronize()
        for _ in range(3):
            moe_launcher.sigmoid_sink_moe(*args, config=cfg)
        torch.cuda.synchronize()
        log(f"launched {name}: {json.dumps(cfg)}")


def launch_times(args: tuple, cfg: dict, want: torch.Tensor, keep) -> tuple[float, dict[str, float]]:
    """The op with `cfg`: its relative error against `want` (the reference's float32 output), and the
    launches whose names `keep` accepts, each timed alone (µs, CUDA-graph replays). Every launch runs once
    in order first, so that each can then be replayed alone."""
    y = moe_launcher.sigmoid_sink_moe(*args, config=cfg).float()
    err = float((y - want).norm() / want.norm())
    _, launches, _ = moe_launcher.sigmoid_launches(*args, config=cfg)
    for _, run in launches:
        run()
    return err, {name: bench(run)[0] * 1e3 for name, run in launches if keep(name)}


# tune()'s pick at T = 64 in the 2026-12-01 e2e build (bench/results/gpu-2026-12-01/bench-decode/, 3.68 ms):
# the default tiles of T = 64's bucket, the shared experts through cuBLAS on the side stream
BATCH_MMA = {**moe_launcher.MMA_16, "shared": "torch", "overlap": True}


def decode_kernels(out_dir: str, tokens=(1, 8)) -> None:
    """Every block-diagonal (bd) decode candidate of tune() (shared experts on the Triton path) at T tokens,
    as decode_sweep times them. Writes decode_kernels.json. (The mma and GEMV candidates were 1.3-2.7x
    slower in an earlier run of this, bench/results/history.md.)"""

    def configs(T: int) -> list[tuple[str, dict]]:
        bd = [c for c in moe_launcher._candidates(T) if c.get("kernel") == "bd" and c["shared"] == "triton"]
        named = [(json.dumps({k: v for k, v in c.items() if k != "block_m" or T > 16}), c) for c in bd]
        if T > 16:  # beside them, the tensor-core tiles tune() chose for T = 64 (the 2026-12-01 e2e build)
            named.append(("mma " + json.dumps(BATCH_MMA), BATCH_MMA))
        return named

    decode_sweep(configs, tokens, os.path.join(out_dir, "decode_kernels.json"))


def decode_sweep(configs, tokens, path: str) -> None:
    """For each T and each (name, config) of configs(T): the op's error against the reference, its routed
    GEMMs timed alone against their bytes over the bandwidth, and the whole op as tune() times it (with
    its side stream), CUDA-graph replays. Writes the rows as JSON to `path`."""
    layer = make_layer()
    rows = []
    for T in tokens:
        args = op_args(layer, T, seed=T)
        want = reference(args).float()
        n_exp = experts_touched(args)
        for name, cfg in configs(T):
            try:
                err, times = launch_times(args, cfg, want, lambda part: "routed" in part)
                op_us = moe_launcher._time(moe_launcher.sigmoid_sink_moe, args, cfg) * 1e3
            except Exception as exc:  # noqa: BLE001
                log(f"T={T} {name}: failed {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row = dict(T=T, variant=name, config=cfg, err=err, op_us=op_us, bound_us=bound_us(T, n_exp)[0])
            for part, us in times.items():
                row[part.replace(" ", "_") + "_us"] = us
                row[part.replace(" ", "_") + "_bw"] = part_bytes(part, T, n_exp) / MEM_BW * 1e6 / us
            rows.append(row)
            log(
                f"T={T} {name:38s} err {err:.1e} | op {op_us:6.1f} us (bound {row['bound_us']:.1f}) | gemm1 "
                f"{times['gemm1 routed']:6.1f} us ({row['gemm1_routed_bw']:.0%}) | gemm2 {times['gemm2 routed']:6.1f}"
                f" us ({row['gemm2_routed_bw']:.0%})"
            )
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


# GEMM tiles (block_m, block_n, block_k, warps, stages[, more config keys]) for prefill-sized T: tune()'s
# (launcher._candidates) and others, timed per GEMM (bench/results/gpu-2026-12-01/s16/: the 8K prefill's MoE
# was 66% of its GPU time). The NVFP4 decode is by byte lookups unless a tile says {"prmt": False}.
# The register-capped tiles tried first were slower (s18-decode) and are gone.
PREFILL_TILES = [
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4),  # tune()'s
    (128, 64, 64, 4, 4, {"prmt": False}), (128, 128, 64, 4, 4, {"prmt": False}),  # the float32 decode
    (128, 64, 64, 4, 5), (128, 128, 64, 4, 5), (128, 64, 128, 4, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
    (128, 256, 32, 8, 4), (128, 256, 64, 8, 3),
]  # fmt: skip


def prefill_tiles(out_dir: str, T: int) -> None:
    """The MoE op's GEMM launches at T tokens (shared experts on Triton) for every PREFILL_TILES tile, one
    GEMM's tile varied at a time (launches are timed alone, so the other's tile does not matter): CUDA-graph
    replays, TFLOP/s against 790, the whole op's error against the reference. Writes prefill_tiles.json."""
    layer = make_layer()
    args = op_args(layer, T, seed=T)
    want = reference(args).float()
    flops = {"gemm1 routed": 2 * T * TOP_K * 2 * I * H, "gemm2 routed": 2 * T * TOP_K * I * H,
             "gemm1 shared": 2 * T * S * 2 * I * H, "gemm2 shared": 2 * T * S * I * H}  # fmt: skip
    rows = []
    for m, n, k, warps, stages, *more in PREFILL_TILES:
        extra = more[0] if more else {}  # config keys beyond the tile, e.g. {"prmt": False}
        g = {"block_n": n, "block_k": k, "num_warps": warps, "num_stages": stages, **extra}
        label = f"T={T} m{m} n{n} k{k} w{warps} s{stages}" + "".join(
            f" {key}={v}" for key, v in extra.items()
        )
        cfg = {"block_m": m, "shared": "triton", "gemm1": g, "gemm2": dict(g)}
        try:
            err, times = launch_times(args, cfg, want, lambda name: name in flops)
        except Exception as exc:  # noqa: BLE001
            log(f"{label}: failed {type(exc).__name__}: {str(exc)[:200]}")
            continue
        row = dict(T=T, config=cfg, err=err, us=times)
        row["tflops"] = {name: flops[name] / (us * 1e-6) / 1e12 for name, us in times.items()}
        rows.append(row)
        log(
            f"{label}: err {err:.1e} | "
            + " | ".join(
                f"{name} {us:8.1f} us ({row['tflops'][name]:.0f} TF/s)" for name, us in times.items()
            )
        )
    for name in flops:
        timed = [r for r in rows if name in r["us"]]
        if timed:
            best = min(timed, key=lambda r: r["us"][name])
            log(
                f"best {name}: {best['us'][name]:.1f} us, {best['tflops'][name]:.0f} TF/s, {json.dumps(best['config']['gemm1'])} m{best['config']['block_m']}"
            )
    with open(os.path.join(out_dir, "prefill_tiles.json"), "w") as f:
        json.dump(rows, f, indent=1)


# Variants of the decode config (T <= 16) against the default: (name, changes to the whole config, to GEMM 1's,
# to GEMM 2's). Programs per SM from bench.sm90_moe --bd (registers, shared memory): GEMM 2 at T = 1 has 672
# programs (6 experts x 112 N tiles) and 4 fit an SM at (64, 256, 4 warps, 3 stages), 528 at once on 132 SMs,
# so a second, 27%-full round; at block_k 128 (72 registers) or under an 80-register cap 6-7 fit, one round.
DECODE_VARIANTS = [
    ("default", {}, {}, {}),
    ("gemm2 block_k 128", {}, {}, {"block_k": 128}),
    ("gemm2 maxnreg 80", {}, {}, {"maxnreg": 80}),
    ("gemm2 maxnreg 96", {}, {}, {"maxnreg": 96}),
    ("gemm1 block_k 128", {}, {"block_k": 128}, {}),
    ("gemm1 block_n 32", {}, {"block_n": 32}, {}),
    ("shared cuBLAS", {"shared": "torch"}, {}, {}),
    # the reduction split over programs (launcher._candidates has the measurements)
    ("gemm1 split 2", {}, {"split_k": 2}, {}),
    ("gemm1 split 3", {}, {"split_k": 3}, {}),
    ("gemm1 split 4", {}, {"split_k": 4}, {}),
    ("gemm2 split 2", {}, {}, {"split_k": 2}),
    ("splits 3 / 2", {}, {"split_k": 3}, {"split_k": 2}),
    ("splits 4 / 2", {}, {"split_k": 4}, {"split_k": 2}),
    ("gemm1 block_n 32 split 2", {}, {"block_n": 32, "split_k": 2}, {}),
    ("gemm1 block_n 32 split 3", {}, {"block_n": 32, "split_k": 3}, {}),
    ("gemm1 block_n 32, splits 2 / 2", {}, {"block_n": 32, "split_k": 2}, {"split_k": 2}),
    ("gemm1 block_n 32, gemm2 split 2", {}, {"block_n": 32}, {"split_k": 2}),
    # one_dot's activations a step ahead (PREFETCH_A)
    ("gemm1 prefetch", {}, {"prefetch_a": True}, {}),
    ("gemm1 prefetch split 2", {}, {"prefetch_a": True, "split_k": 2}, {}),
    ("gemm1 block_n 32 prefetch split 2", {}, {"block_n": 32, "prefetch_a": True, "split_k": 2}, {}),
    ("gemm2 one_dot prefetch", {}, {}, {"k_major_a": False, "one_dot": True, "prefetch_a": True}),
    (
        "gemm2 one_dot prefetch split 2",
        {},
        {},
        {"k_major_a": False, "one_dot": True, "prefetch_a": True, "split_k": 2},
    ),
    (
        "gemm1 block_n 32 prefetch split 2, gemm2 maxnreg 96",
        {},
        {"block_n": 32, "prefetch_a": True, "split_k": 2},
        {"maxnreg": 96},
    ),
]  # a 2026-12-01 run also timed the routed branch on a stream of higher priority: no gain (launcher._candidates)


def batch_tiles(out_dir: str, tokens=(4, 8, 16, 32, 64)) -> None:
    """The decode kernel's scale_w form (launcher.SW_TILES) beside the forms the batch buckets used before it
    (1-row bd blocks, the tensor-core tiles), as decode_sweep times them; at T = 1, batch 1's default with
    perm_a. Writes batch_tiles.json."""
    bd = {"block_m": 1, "kernel": "bd", "shared": "triton", "overlap": True, **moe_launcher.BD_GEMMS}

    def configs(T: int) -> list[tuple[str, dict]]:
        base = moe_launcher.select_config(None, T)
        if T == 1:  # batch 1's default with activations stored in ONE_DOT's K order (perm_a)
            perm = {"perm_a": True}
            return [
                ("default", base),
                ("gemm1 perm_a", {**base, "gemm1": {**base["gemm1"], **perm}}),
                ("gemm2 perm_a", {**base, "gemm2": {**base["gemm2"], **perm}}),
                (
                    "both perm_a",
                    {**base, "gemm1": {**base["gemm1"], **perm}, "gemm2": {**base["gemm2"], **perm}},
                ),
            ]
        out = [("default", base), ("bd 1-row", bd), ("mma", BATCH_MMA)]
        for g1, g2 in moe_launcher.SW_TILES:
            name = f"scale_w g1 {g1['block_n']}x{g1['block_k']} g2 {g2['block_n']}x{g2['block_k']}"
            name += f" g1 {g1['num_stages']} stages" if "num_stages" in g1 else ""
            name += f" maxnreg {g1['maxnreg']}" if "maxnreg" in g1 else ""
            out.append((name, moe_launcher.sw_config(g1, g2)))
        gathered = {"perm_a": False}  # the activations gathered in the kernel's K order instead
        out.append(("scale_w default, gathered", moe_launcher.sw_config(gathered, gathered)))
        return out

    decode_sweep(configs, tokens, os.path.join(out_dir, "batch_tiles.json"))


def decode_tiles(out_dir: str, tokens=(1, 4, 8)) -> None:
    """DECODE_VARIANTS at T tokens, as decode_sweep times them. Writes decode_tiles.json."""

    def configs(T: int) -> list[tuple[str, dict]]:
        base = moe_launcher.select_config(None, T)
        return [
            (name, {**base, **top, "gemm1": {**base["gemm1"], **g1}, "gemm2": {**base["gemm2"], **g2}})
            for name, top, g1, g2 in DECODE_VARIANTS
        ]

    decode_sweep(configs, tokens, os.path.join(out_dir, "decode_tiles.json"))


def overlap(out_dir: str, tokens=(1, 8, 64)) -> None:
    """The whole op at T tokens, serial and with the shared experts on a side stream ("overlap"), for the
    default tiles of T's bucket with the shared experts on Triton and on cuBLAS: CUDA-graph replays (as
    tune() times them) and the outputs' largest difference (the same kernels: 0 expected). Writes
    overlap.json."""
    layer = make_layer()
    rows = []
    for T in tokens:
        args = op_args(layer, T, seed=T)
        for shared in ("triton", "torch"):
            base = {**moe_launcher.select_config(None, T), "shared": shared}
            row = dict(T=T, shared=shared, kernel=base.get("kernel", "mma"))
            ys = {}
            for mode, cfg in (("serial", base), ("overlap", {**base, "overlap": True})):
                ys[mode] = moe_launcher.sigmoid_sink_moe(*args, config=cfg)
                row[f"{mode}_us"] = moe_launcher._time(moe_launcher.sigmoid_sink_moe, args, cfg) * 1e3
            row["max_abs_diff"] = float((ys["serial"].float() - ys["overlap"].float()).abs().max())
            rows.append(row)
            log(
                f"T={T} {row['kernel']} shared={shared}: serial {row['serial_us']:.1f} us, overlap "
                f"{row['overlap_us']:.1f} us, max |diff| {row['max_abs_diff']:.1e}"
            )
    with open(os.path.join(out_dir, "overlap.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/bench-moe")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-sconv", action="store_true")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="the MoE section's T values")
    ap.add_argument(
        "--launch-only", type=int, metavar="T",
        help="run the op at T tokens a few times in each decode config and exit (for ncu: no timing)",
    )  # fmt: skip
    ap.add_argument(
        "--decode-kernels", metavar="T,T", help="time every decode candidate's routed GEMMs and exit"
    )
    ap.add_argument(
        "--decode-tiles", metavar="T,T", help="time DECODE_VARIANTS (the op and its routed GEMMs) and exit"
    )
    ap.add_argument(
        "--batch-tiles",
        metavar="T,T",
        help="time the scale_w decode tiles beside the earlier forms, and exit",
    )
    ap.add_argument(
        "--overlap", metavar="T,T", help="time the op serial and with the shared experts overlapped, and exit"
    )
    ap.add_argument(
        "--prefill-tiles", type=int, metavar="T", help="time the GEMMs over PREFILL_TILES, and exit"
    )
    args = ap.parse_args()
    if args.prefill_tiles:
        os.makedirs(args.out, exist_ok=True)
        prefill_tiles(args.out, args.prefill_tiles)
        return
    if args.decode_tiles:
        os.makedirs(args.out, exist_ok=True)
        decode_tiles(args.out, tuple(int(t) for t in args.decode_tiles.split(",")))
        return
    if args.batch_tiles:
        os.makedirs(args.out, exist_ok=True)
        batch_tiles(args.out, tuple(int(t) for t in args.batch_tiles.split(",")))
        return
    if args.overlap:
        os.makedirs(args.out, exist_ok=True)
        overlap(args.out, tuple(int(t) for t in args.overlap.split(",")))
        return
    if args.decode_kernels:
        os.makedirs(args.out, exist_ok=True)
        decode_kernels(args.out, tuple(int(t) for t in args.decode_kernels.split(",")))
        return
    if args.launch_only:
        launch_only(args.launch_only)
        return
    os.makedirs(args.out, exist_ok=True)
    tokens = tuple(int(t) for t in args.tokens.split(","))
    moe_rows, table = ([], None) if args.skip_moe else moe_section(args.out, tokens)
    if moe_rows:
        plot(moe_rows, os.path.join(args.out, "moe.png"))
    sconv_rows = [] if args.skip_sconv else sconv_section(moe_rows)
    with open(os.path.join(args.out, "moe.json"), "w") as f:
        json.dump({"moe": moe_rows, "sconv": sconv_rows, "tune": table}, f, indent=1)
    write_md(moe_rows, sconv_rows, os.path.join(args.out, "moe.md"))
    with open(os.path.join(args.out, "moe.md")) as f:
        log(f.read())


if __name__ == "__main__":
    main()

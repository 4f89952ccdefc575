"""Benchmark: mtp_draft (Triton, norm + lm_head GEMV + argmax fused) at inkling-bench decode shapes.

    python -m bench.mtp_draft [--out bench/results]

Shapes: H 7168, V 163840, bf16, N in (1, 8, 32) rows. Memory-bound: a draft reads lm_head's real
rows once, so the figure of merit is (real lm_head rows + hidden + norm weight) bytes over the time,
against the H200's 4.35 TB/s (bench/bound.py). Each N: the Triton drafts are checked against the
reference op (equal, or a float64 near-tie), then timed (median of CUDA-graph replays, eager where
capture fails) next to a few tile variants of the launcher, the torch path an eager engine takes
(norm, bf16 cuBLAS matmul, argmax over [N, V] logits) and the reference op. Writes mtp_draft.json
and mtp_draft.md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import triton

import plugins  # noqa: F401  (registers the ops)
from bench.bound import BANDWIDTH
from bench.moe import bench, log
from inkling.ops import rms_norm
from plugins.mtp import launcher
from plugins.mtp.launcher import MtpConfig

H, V = 7168, 163840
NS = (1, 8, 32)
EPS = 1e-6
DT = torch.bfloat16
DEV = "cuda"
COMMAND = "python -m bench.mtp_draft"


def make_inputs(N: int, H: int, V: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = torch.randn(N, H, device=DEV, dtype=DT, generator=g)
    norm_weight = (torch.rand(H, device=DEV, generator=g) + 0.5).to(DT)
    lm_head = torch.randn(V, H, device=DEV, dtype=DT, generator=g) * H**-0.5
    return hidden, norm_weight, lm_head


def variants(N: int, H: int) -> list[MtpConfig]:
    """The launcher's choice and its neighbours: tiles at its stages and warps, then stages and warps
    at its tiles."""
    base = launcher.choose_config(N, H, DT)
    out = [base]
    cands = [(bv, bk, base.num_warps, base.num_stages) for bv in (32, 64, 128) for bk in (64, 128, 256)]
    cands += [(base.block_v, base.block_k, w, s) for w, s in ((4, 3), (4, 5), (8, 4), (8, 3))]
    for block_v, block_k, num_warps, num_stages in cands:
        cfg = MtpConfig(base.block_n, block_v, block_k, num_warps, num_stages)
        smem = num_stages * (block_v + base.block_n) * block_k * 2  # bf16 w + x per stage
        if cfg not in out and smem <= 200 * 1024:
            out.append(cfg)
    return out


def drafts_agree(got, want, hidden, norm_weight, lm_head, num_real: int, chunk: int = 16384) -> dict:
    """Count of differing drafts and of those that are not float64 near-ties (1e-4 of the max)."""
    normed = rms_norm(hidden, norm_weight, EPS).double()  # [N, H]
    best = torch.full((hidden.shape[0],), float("-inf"), dtype=torch.float64, device=DEV)
    for v0 in range(0, num_real, chunk):
        logits = normed @ lm_head[v0 : min(v0 + chunk, num_real)].double().T  # [N, chunk]
        best = torch.maximum(best, logits.max(dim=-1).values)
    picked = (normed * lm_head[got].double()).sum(dim=-1)
    far = best - picked > 1e-4 * best.abs().clamp(min=1.0)
    return dict(differ=int((got != want).sum()), not_near_tie=int(far.sum()))


def run_case(N: int, h: int, v: int, num_real: int, sweep: bool) -> dict:
    hidden, norm_weight, lm_head = make_inputs(N, h, v, seed=N)
    nbytes = (num_real + N + 1) * h * lm_head.element_size()
    args = (hidden, norm_weight, lm_head, num_real, EPS)

    def triton_op():
        return torch.ops.inkling.mtp_draft(*args, "triton")

    def reference_op():
        return torch.ops.inkling.mtp_draft(*args, "reference")

    def torch_eager():
        return torch.argmax(rms_norm(hidden, norm_weight, EPS) @ lm_head[:num_real].T, dim=-1)

    row = dict(N=N, H=h, V=v, num_real_tokens=num_real, bytes=nbytes)
    row["config"] = repr(launcher.choose_config(N, h, DT))
    row["check"] = drafts_agree(triton_op(), reference_op(), *args[:3], num_real)
    times, modes = {}, {}
    for name, fn in (("triton", triton_op), ("torch bf16", torch_eager), ("reference op", reference_op)):
        times[name], modes[name] = bench(fn)
    row["ms"], row["mode"] = times, modes
    row["variants"] = {}
    if sweep:
        for cfg in variants(N, h):
            try:
                ms, _ = bench(lambda cfg=cfg: launcher.mtp_draft(*args, config=cfg))
                row["variants"][repr(cfg)] = ms
            except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory)
                row["variants"][repr(cfg)] = f"{type(exc).__name__}: {str(exc)[:120]}"
    timed = {k: t for k, t in row["variants"].items() if isinstance(t, float)}
    best_cfg = min(timed, key=timed.get) if timed else row["config"]
    row["best_variant"], row["best_variant_ms"] = best_cfg, timed.get(best_cfg, times["triton"])
    for key, ms in (("triton", times["triton"]), ("best_variant", row["best_variant_ms"])):
        row[f"{key}_gbps"] = nbytes / ms / 1e6
        row[f"{key}_of_peak"] = nbytes / (ms * 1e-3) / BANDWIDTH
    log(
        f"N={N:3d}: triton {times['triton']:.4f} ms ({row['triton_gbps']:.0f} GB/s, "
        f"{100 * row['triton_of_peak']:.1f}% of peak) | best variant {row['best_variant_ms']:.4f} ms "
        f"{best_cfg} | torch bf16 {times['torch bf16']:.4f} ms | reference {times['reference op']:.4f} ms "
        f"| drafts differ {row['check']['differ']} (not near-ties {row['check']['not_near_tie']})"
    )
    torch.cuda.empty_cache()
    return row


def write_results(rows: list[dict], out_dir: str, started: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    meta = dict(command=COMMAND, gpu=gpu, date=started, torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(out_dir, "mtp_draft.json"), "w") as f:
        json.dump(dict(meta=meta, peak_bytes_per_s=BANDWIDTH, rows=rows), f, indent=1)
    lines = [
        "# mtp_draft: MTP head close (RMSNorm + lm_head + argmax) on the GPU",
        "",
        f"Command: `{COMMAND}`; GPU: {gpu}; date: {started}; torch {torch.__version__}, "
        f"triton {triton.__version__}. Median ms of CUDA-graph replays. GB/s: (real lm_head rows + "
        f"hidden + norm weight) bytes over the time; peak {BANDWIDTH / 1e12:.2f} TB/s.",
        "",
        "| N | H | V real | Triton ms | GB/s | % of peak | best variant ms | % of peak | torch bf16 ms "
        "| reference ms | Triton vs torch | drafts differ (not near-ties) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["ms"]
        lines.append(
            f"| {r['N']} | {r['H']} | {r['num_real_tokens']} | {t['triton']:.4f} | {r['triton_gbps']:.0f} "
            f"| {100 * r['triton_of_peak']:.1f} | {r['best_variant_ms']:.4f} | {100 * r['best_variant_of_peak']:.1f} "
            f"| {t['torch bf16']:.4f} | {t['reference op']:.4f} | {t['torch bf16'] / t['triton']:.2f}x "
            f"| {r['check']['differ']} ({r['check']['not_near_tie']}) |"
        )
    lines += ["", "Launcher's tiles and the best variant per N:", ""]
    lines += [f"- N={r['N']}: chosen {r['config']}; best {r['best_variant']}" for r in rows]
    with open(os.path.join(out_dir, "mtp_draft.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results", help="directory for mtp_draft.json and mtp_draft.md")
    p.add_argument("--ns", default=",".join(map(str, NS)), help="comma-separated row counts N")
    p.add_argument("--hidden-size", type=int, default=H)
    p.add_argument("--vocab", type=int, default=V, help="lm_head rows (padded vocabulary)")
    p.add_argument("--num-real-tokens", type=int, default=0, help="real vocabulary rows (0: all of --vocab)")
    p.add_argument("--no-sweep", action="store_true", help="time the launcher's tiles only, no variants")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.mtp_draft needs a CUDA GPU")
    num_real = a.num_real_tokens or a.vocab
    started = datetime.datetime.now().isoformat(timespec="minutes")
    rows = [run_case(int(n), a.hidden_size, a.vocab, num_real, not a.no_sweep) for n in a.ns.split(",")]
    write_results(rows, a.out, started)


if __name__ == "__main__":
    main()

"""What the MoE grouped GEMM's main loop compiles to on an H200 (sm_90), read on a machine without a GPU.

    python -m bench.sm90_moe --out DIR [--tile 128,128,64,8,3[,maxnreg]] [--float32-decode]
    python -m bench.sm90_moe --out DIR --bd [--tile 1,64,256,4,3]     # the decode kernel at T = 1
    python -m bench.sm90_moe --out DIR --sw                           # its scale_w form, batches' default

Compiles `moe_gemm_kernel` (plugins/moe/kernels.py) for sm_90 at a prefill tile (block_m, block_n, block_k,
warps, stages, and optionally a register cap per thread; tune()'s choice at T = 4096 on the H200 by default) as three launches of the real layer's
MoE: the routed NVFP4 GEMM 1 (gate and up) and GEMM 2, and the bf16 shared GEMM 1. Disassembles the
cubin with the nvdisasm Triton bundles and counts the SASS instructions of the K loop's body (the block
that ends in the loop's backward branch), by opcode. Per K step and thread, that is the work the
dequantization adds next to the tensor-core instructions (HGMMA) it feeds.

The 2026-12-01 runs measured the routed GEMMs at 205 TFLOP/s against 549 for the bf16 shared GEMM 1 in this kernel
(bench/moe.py --prefill-tiles 4096); this says where the difference goes. Writes sm90_moe.json and .md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton

from bench.sm90 import compile_sm90, ptxas_report

H, I, E, TOP_K, S = 6144, 3072, 256, 6, 2  # the real MoE layer (bench/moe.py)
LAUNCHES = {  # name: (NVFP4, GATED, N, K)
    "gemm1 routed (NVFP4)": (True, True, I, H),
    "gemm2 routed (NVFP4)": (True, False, H, I),
    "gemm1 shared (bf16)": (False, True, I, H),
}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _launch_signature(nvfp4: bool, gated: bool, N: int, K: int, num_tokens: int) -> tuple[dict, dict]:
    """The pointer types and integer arguments of one GEMM launch of the op (the MoE kernels share their
    argument list): routed NVFP4 or shared bf16 weights, gate and up rows stacked when gated."""
    pointers = {
        "a_ptr": "*bf16", "w_ptr": "*u8" if nvfp4 else "*bf16", "ws_ptr": "*fp8e4nv", "wg_ptr": "*fp32",
        "out_ptr": "*bf16", "sorted_rows_ptr": "*i32", "expert_ids_ptr": "*i32", "block_rows_ptr": "*i32",
        "route_w_ptr": "*fp32",
    }  # fmt: skip
    w_row = K // 2 if nvfp4 else K
    rows = 2 * N if gated else N
    ints = dict(
        stride_at=K, stride_we=rows * w_row, stride_wn=w_row, stride_wse=rows * (K // 16), stride_wsn=K // 16,
        stride_ot=N, num_tokens=num_tokens, N=N,
    )  # fmt: skip
    return pointers, ints


def compile_gemm(nvfp4: bool, gated: bool, N: int, K: int, tile: tuple[int, ...], prmt: bool = False):
    """moe_gemm_kernel compiled for sm_90 as one GEMM launch of the op (routed NVFP4 or shared bf16)."""
    from plugins.moe import kernels

    m, n, k, warps, stages, *maxnreg = tile
    pointers, ints = _launch_signature(nvfp4, gated, N, K, num_tokens=4096)
    constexprs = dict(
        K=K, TOP_K=TOP_K, KS=TOP_K + S, ROUTED=nvfp4, NVFP4=nvfp4, GATED=gated, IEEE=False,
        BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, N_FIRST=nvfp4, PRMT=prmt and nvfp4,
    )  # fmt: skip
    return compile_sm90(
        kernels.moe_gemm_kernel,
        pointers,
        ints,
        (),
        constexprs,
        warps,
        stages,
        maxnreg[0] if maxnreg else None,
    )


# The decode kernel's launches at batch 1 (`--bd`): tune()'s choice on the H200 (stack_gu + one_dot for GEMM 1,
# k_major_a for GEMM 2; launcher._candidates, bench/results/gpu-2026-12-01/s18-decode/)
BD_LAUNCHES = {  # name: (GATED, N, K, flags)
    "gemm1 routed (bd, T = 1)": (True, I, H, {"STACK_GU": True, "ONE_DOT": True}),
    "gemm2 routed (bd, T = 1)": (False, H, I, {"K_MAJOR_A": True}),
}


def compile_bd(gated: bool, N: int, K: int, tile: tuple[int, ...], flags: dict):
    """moe_bd_kernel compiled for sm_90 as one routed launch of the op at T = 1 (1-row blocks)."""
    from plugins.moe import decode_kernels

    m, n, k, warps, stages = tile[:5]
    pointers, ints = _launch_signature(True, gated, N, K, num_tokens=1)
    pointers["part_ptr"] = "*fp32"  # the split reduction's partial sums (SPLIT_K > 1)
    ints["stride_ps"] = 8 * (2 * N if gated else N)
    constexprs = dict(
        K=K, TOP_K=TOP_K, KS=TOP_K + S, ROUTED=True, NVFP4=True, GATED=gated, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k,
        **{"SPLIT_K": 1, **flags},
    )  # fmt: skip
    return compile_sm90(decode_kernels.moe_bd_kernel, pointers, ints, (), constexprs, warps, stages)


def sw_launches() -> dict:
    """The batch buckets' default (launcher.SW_DEFAULT, the decode kernel's scale_w form on 16-row blocks) as
    {name: (GATED, N, K, tile, flags)}."""
    from plugins.moe import launcher

    cfg = launcher.SW_DEFAULT
    out = {}
    for name, gated, N, K in (("gemm1", True, I, H), ("gemm2", False, H, I)):
        g = cfg[name]
        tile = (cfg["block_m"], g["block_n"], g["block_k"], g["num_warps"], g["num_stages"])
        out[f"{name} routed (scale_w, 16 rows)"] = (gated, N, K, tile, launcher.bd_flags(g))
    return out


def programs_per_sm(registers: int, shared_bytes: int, warps: int) -> int:
    """How many programs an H100/H200 SM holds at once: 64K registers (allocated per warp in blocks of 256,
    i.e. per thread in multiples of 8), 228 KB of shared memory (1 KB of it reserved per program), 64 warps."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = 233472 // (shared_bytes + 1024)
    return min(by_registers, by_shared, 64 // warps, 32)


def loop_body_mix(cubin: bytes) -> tuple[collections.Counter, int]:
    """SASS opcodes in the K loop's body: from the label a backward branch jumps to, to that branch (the
    longest such block: the main loop). Returns the counts and the whole kernel's instruction count."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run(
            [os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    opcode = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"(\.L_x_\d+):", line))}
    best = (0, 0)
    for i, line in enumerate(sass):
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if target and target.group(1) in labels and labels[target.group(1)] < i:
            start = labels[target.group(1)]
            best = max(best, (start, i + 1), key=lambda span: span[1] - span[0])
    body = collections.Counter(m.group(1) for line in sass[best[0] : best[1]] if (m := opcode.match(line)))
    total = sum(1 for line in sass if opcode.match(line))
    return body, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--tile", help="block_m,block_n,block_k,warps,stages (default 128,128,64,8,3; with --bd 1,64,256,4,3)"
    )
    ap.add_argument("--bd", action="store_true", help="the decode kernel moe_bd_kernel's launches at T = 1")
    ap.add_argument("--sw", action="store_true", help="the decode kernel's scale_w launches (batch default)")
    ap.add_argument(
        "--float32-decode",
        action="store_true",
        help='the NVFP4 launches with the float32 decode (config "prmt": False), not the byte lookups',
    )
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the tests' interpreted kernels cannot be compiled
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run(
            [sys.executable, "-m", "bench.sm90_moe", *argv], env=env, check=False
        ).returncode
    args.tile = args.tile or ("1,64,256,4,3" if args.bd else "128,128,64,8,3")
    tile = tuple(int(v) for v in args.tile.split(","))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    if args.sw:  # name: (tile, compile)
        launches = {
            name: (t, lambda g=g, N=N, K=K, t=t, f=f: compile_bd(g, N, K, t, f))
            for name, (g, N, K, t, f) in sw_launches().items()
        }
    elif args.bd:
        launches = {
            name: (tile, lambda g=g, N=N, K=K, f=f: compile_bd(g, N, K, tile, f))
            for name, (g, N, K, f) in BD_LAUNCHES.items()
        }
    else:
        launches = {
            name: (
                tile,
                lambda nv=nv, g=g, N=N, K=K: compile_gemm(nv, g, N, K, tile, prmt=not args.float32_decode),
            )
            for name, (nv, g, N, K) in LAUNCHES.items()
        }
    for name, (tile, compile_launch) in launches.items():
        compiled = compile_launch()
        body, total = loop_body_mix(compiled.asm["cubin"])
        row = {"launch": name, "tile": tile, "shared_bytes": compiled.metadata.shared, "sass_total": total}
        row.update(ptxas_report(compiled.asm["ptx"]))
        row["programs_per_sm"] = programs_per_sm(row["registers"], row["shared_bytes"], tile[3])
        row["loop_body"] = sum(body.values())
        row["loop_mix"] = dict(body.most_common())
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "loop_mix"}), flush=True)
    with open(os.path.join(args.out, "sm90_moe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [
        f"# {'moe_bd_kernel' if args.bd or args.sw else 'moe_gemm_kernel'} compiled for sm_90 (`python -m bench.sm90_moe "
        f"--tile {args.tile}{' --bd' if args.bd else ''}{' --sw' if args.sw else ''}{' --float32-decode' if args.float32_decode else ''}`): "
        "the K loop",
        "",
        "SASS instructions per thread in one K step (the loop body), the most frequent opcodes first.",
        "",
        "| launch | registers | spill bytes | shared bytes | programs per SM | loop body | HGMMA | opcodes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mix = ", ".join(f"{k} {v}" for k, v in list(r["loop_mix"].items())[:12])
        lines.append(
            f"| {r['launch']} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} "
            f"| {r['programs_per_sm']} | {r['loop_body']} "
            f"| {r['loop_mix'].get('HGMMA', 0)} | {mix} |"
        )
    with open(os.path.join(args.out, "sm90_moe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

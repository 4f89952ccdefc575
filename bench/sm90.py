"""What the attention kernel compiles to on an H200 (sm_90), read on a machine without a GPU.

    python -m bench.sm90 --out DIR [--seq 8192] [--only SUBSTRING]
    python -m bench.sm90 --out DIR --decode 131072   # a batch-1 decode over that many keys instead

Triton compiles for a named target without a device, and its bundled ptxas reports registers, spills and
barriers. For each prefill variant (PREFILL_VARIANTS, the launcher's tiles first) this writes a table of:
- registers per thread and spill bytes (stores + loads to local memory);
- shared memory per program;
- counts in the PTX of `cp.async` (the loads Triton's software pipeline issues ahead of their use: a loop
  without them waits for each K/V tile), `wgmma`, barriers (`bar.sync`) and warp shuffles (`shfl`).

For a decode (`--decode KV`: one query, batch 1, the launcher's split count) the table adds how many
programs fit on an SM by registers and by shared memory (H100/H200: 64K registers, 228 KB).

These say whether a variant can run well, not how fast it runs: only the GPU says that (bench/bank_attention.py).
It was how we found that the scratch shear's barriers left its tile loop without a pipeline.
The kernel is compiled as the launcher would launch it (`launcher.kernel_constexprs`), bf16, with the
pointers and strides that are multiples of 16 marked so (as Triton's launch specialises them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from plugins.attention import kernels
from plugins.attention.launcher import AttentionConfig, choose_config, kernel_constexprs, table_dtype

# the real full layer: Hq 64, Hkv 8, D 128, d_rel 16, the bank's table of X + 1 = 1025 rows shared by the
# heads (stride 0), 16-token pages
HQ, HKV, D, DR, R, PAGE = 64, 8, 128, 16, 1025, 16
POINTERS = {
    "q_ptr": "*bf16", "r_ptr": "*bf16", "e_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
    "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
}  # fmt: skip
PTX_COUNTS = {
    "cp.async": r"cp\.async\.c[ag]\.",
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "bar.sync": r"\bbar\.sync|\bbarrier\.sync",
    "shfl": r"shfl\.sync",
}


def _gluon(**kw) -> AttentionConfig:
    return AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", **kw)


GLUON_VARIANTS = [
    _gluon(far_launch=True, far_impl="gluon"),
    _gluon(far_launch=True, far_impl="gluon", num_stages=3),
    _gluon(far_launch=True, far_impl="gluon", far_q_in_registers=True),
    # two warpgroups of 64 query rows sharing each K/V tile
    AttentionConfig(
        heads=1,
        block_q=128,
        block_n=64,
        num_splits=1,
        num_warps=8,
        shear="chunk",
        far_launch=True,
        far_impl="gluon",
    ),  # fmt: skip
    # the near launch on Gluon: after the far launch, and alone (every tile, as on a sliding layer)
    _gluon(far_launch=True, near_impl="gluon"),
    _gluon(near_impl="gluon"),
    _gluon(far_launch=True, near_impl="gluon", table_dtype="bfloat16"),  # the band in bf16: half its bytes
    # and Q in registers: two programs an SM (252 registers, 100 KB)
    _gluon(far_launch=True, near_impl="gluon", table_dtype="bfloat16", far_q_in_registers=True),
]


PREFILL_VARIANTS = [
    # the relative band sheared through a scratch per tile (the earlier default), and the chunk form's settings
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="scratch"),
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="scratch", table_dtype="bfloat16"),
    # a bf16 table: half the bytes written and read per chunk (the term rounded to bf16)
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", table_dtype="bfloat16"),
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, num_stages=3, shear="chunk"),
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", chunk_tiles=7),
    AttentionConfig(
        heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", chunk_tiles=7, table_dtype="bfloat16"
    ),
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="chunk", unmasked_chunks=False),
    AttentionConfig(
        heads=1, block_q=64, block_n=128, num_splits=1, num_warps=8, shear="chunk", chunk_tiles=2
    ),
    # the kernel's floor without the relative term (not the op's math): the default's tiles, and larger ones
    AttentionConfig(heads=1, block_q=64, block_n=64, num_splits=1, shear="scratch", relative=False),
    AttentionConfig(
        heads=1, block_q=128, block_n=64, num_splits=1, num_warps=8, shear="scratch", relative=False
    ),
    # the far launch's kernel on Gluon (wgmma, cp.async; plugins/attention/gluon_attention.py), 2 and 3 K/V
    # slots, Q in shared memory or in registers
    *GLUON_VARIANTS,
]


def int_args(seq: int, num_splits: int) -> dict[str, int]:
    """The kernel's integer arguments for one sequence of `seq` tokens (values decide divisibility only)."""
    kv_row = HKV * D
    return dict(
        stride_qt=HQ * D, stride_qh=D, stride_rt=HQ * DR, stride_rh=DR, stride_eh=0, stride_er=DR,
        stride_kb=PAGE * kv_row, stride_ks=kv_row, stride_kh=D, stride_vb=PAGE * kv_row, stride_vs=kv_row,
        stride_vh=D, stride_bt=-(-seq // PAGE), stride_ot=HQ * D, stride_oh=D, num_tokens=seq, num_q_heads=HQ,
        num_splits=num_splits, R=R, window=1 << 30,
    )  # fmt: skip


def compile_sm90(kernel, pointers: dict, ints: dict, floats: tuple, constexprs: dict, num_warps: int,
                 num_stages: int, maxnreg: int | None = None, gluon: bool = False):  # fmt: skip
    """`kernel` compiled for sm_90 as a launch would specialise it: `pointers` (name -> Triton pointer type)
    and the `ints` whose values are multiples of 16 marked so, the `floats` named fp32, every other argument
    a constexpr from `constexprs`; `maxnreg` caps the registers per thread as the launch option does."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ints:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    else:
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon(config: AttentionConfig, d: int = D):
    """A Gluon launch of `config` (plugins/attention/gluon_attention.py) compiled for sm_90 as the launcher
    launches it on the real full layer (or with heads of `d`: the tiny model's 16): the near kernel where
    near_impl is "gluon" (joining a far launch where far_launch is set), else the far kernel."""
    from plugins.attention import gluon_attention

    near = config.near_impl == "gluon"
    kernel = gluon_attention.near_attention_kernel if near else gluon_attention.far_attention_kernel
    pointers = {name: POINTERS[name] for name in POINTERS if near or name not in ("r_ptr", "out_ptr")}
    pointers["table_ptr"] = POINTERS["e_ptr"]
    ints = {
        "stride_qt": HQ * d, "stride_qh": d, "stride_rt": HQ * DR, "stride_rh": DR, "stride_tr": DR,
        "stride_kb": PAGE * HKV * d, "stride_ks": HKV * d, "stride_kh": d, "stride_vb": PAGE * HKV * d,
        "stride_vs": HKV * d, "stride_vh": d, "stride_bt": 4096, "stride_ot": HQ * d, "stride_oh": d,
        "num_q_heads": HQ, "R": R, "window": 1 << 30,
    }  # fmt: skip
    constexprs = {"D": d, "GROUP": HQ // HKV, "BLOCK_Q": config.block_q, "BLOCK_N": config.block_n, "PAGE": PAGE,
                  "STAGES": max(2, config.num_stages), "LOG_SCALE": True,
                  "Q_IN_REGISTERS": config.far_q_in_registers}  # fmt: skip
    if near:
        constexprs |= {"DR": DR, "JOIN": config.far_launch, "BAND_BF16": config.table_dtype == "bfloat16"}
    return compile_sm90(
        kernel, pointers, ints, ("scale", "log_floor", "log_alpha"), constexprs, config.num_warps,
        config.num_stages, gluon=True,
    )  # fmt: skip


def compile_attention(config: AttentionConfig, seq: int, kv: int | None = None, d: int = D):
    """The attention kernel compiled for sm_90 as a prefill of `seq` tokens with `config` would launch it,
    or (kv given) a decode of one query over `kv` keys; a Gluon config, its Gluon kernel (compile_gluon) with
    heads of `d` (the `tl` kernel: the real layer's only)."""
    if "gluon" in (config.far_impl, config.near_impl):
        return compile_gluon(config, d)
    if d != D:
        raise ValueError(f"bench.sm90: only the Gluon launches take a head dimension other than {D}")
    constexprs = kernel_constexprs(
        config, 1 if kv else seq, HQ // HKV, D, DR, PAGE, torch.bfloat16, log_scale=True
    )
    constexprs["INTERPRET"] = False
    scratch = "*bf16" if table_dtype(config) == torch.bfloat16 else "*fp32"
    ints = int_args(kv or seq, config.num_splits)
    if kv:
        ints["num_tokens"] = 1
    return compile_sm90(
        kernels.bank_attention_kernel, {**POINTERS, "scratch_ptr": scratch},
        ints, ("scale", "log_floor", "log_alpha"), constexprs, config.num_warps, config.num_stages,
    )  # fmt: skip


def ptxas_report(ptx: str) -> dict[str, int]:
    """Registers and spill bytes from ptxas -v on the PTX (sm_90a, as Triton assembles it)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(regs.group(1)) if regs else -1,
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0,
        "wgmma_serialized": int("wgmma.mma_async instructions are serialized" in log),
    }


SM_REGISTERS, SM_SHARED = 65536, 228 * 1024  # per SM, H100 and H200


def report(config: AttentionConfig, seq: int, kv: int | None = None, d: int = D) -> dict:
    compiled = compile_attention(config, seq, kv, d)
    ptx = compiled.asm["ptx"]
    row = {"variant": short(config), "config": repr(config), "shared_bytes": compiled.metadata.shared}
    row.update(ptxas_report(ptx))
    row.update({name: len(re.findall(pattern, ptx)) for name, pattern in PTX_COUNTS.items()})
    # programs an SM: registers are allocated per warp in units of 256 (8 a thread)
    per_warp = -(-max(row["registers"], 1) // 8) * 8 * 32
    row["programs_by_registers"] = SM_REGISTERS // (per_warp * config.num_warps)
    row["programs_by_shared"] = SM_SHARED // max(row["shared_bytes"], 1)
    return row


def decode_variants(kv: int) -> list[AttentionConfig]:
    """The launcher's choice for a batch-1 decode over `kv` keys, then its other forms: the relative term as
    a dot or a GEMV, block_n 64 and 128, two and three stages; the GEMV reducing 4 or 8 of d_rel's columns
    at a time (rel_slice)."""
    default = choose_config(1, HQ, HKV, 1, kv, 132)
    out = [default]
    for rel_dot in (False, True):
        for block_n in (64, 128):
            for stages in (2, 3):
                for rel_slice in (0,) if rel_dot else (0, 4, 8):
                    c = dataclasses.replace(
                        default, rel_dot=rel_dot, block_n=block_n, num_stages=stages, rel_slice=rel_slice
                    )
                    if c not in out:
                        out.append(c)
    return out


def short(config: AttentionConfig) -> str:
    """block_q x block_n, warps, stages, and the fields that differ from AttentionConfig's defaults."""
    base = AttentionConfig(heads=config.heads, block_q=config.block_q, block_n=config.block_n, num_splits=1)
    extra = [
        f"{f.name}={getattr(config, f.name)!r}"
        for f in dataclasses.fields(config)
        if f.name not in ("heads", "block_q", "block_n", "num_warps", "num_stages")
        and getattr(config, f.name) != getattr(base, f.name)
    ]
    return " ".join(
        [f"{config.block_q}x{config.block_n}", f"{config.num_warps}w", f"{config.num_stages}s", *extra]
    )


def variants(seq: int) -> list[AttentionConfig]:
    """The launcher's choice for a prefill of `seq` tokens, then PREFILL_VARIANTS."""
    default = choose_config(1, HQ, HKV, seq, seq, 132)
    return [default] + [c for c in PREFILL_VARIANTS if c != default]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=8192, help="prefill length the launches are shaped for")
    ap.add_argument("--only", default="", help="compile the variants whose repr contains this")
    ap.add_argument("--decode", type=int, default=0, help="a batch-1 decode over this many keys instead")
    ap.add_argument(
        "--head_dim", type=int, default=D, help="the Gluon launches' head dimension (with --only gluon)"
    )
    args = ap.parse_args(argv)
    if not isinstance(kernels.bank_attention_kernel, triton.runtime.jit.JITFunction):
        # TRITON_INTERPRET=1 (the tests) made this process's kernels, triton.language's too, interpreted
        # ones, which cannot be compiled: compile in a process without it.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "bench.sm90", *argv], env=env, check=False).returncode
    os.makedirs(args.out, exist_ok=True)
    rows = []
    kv = args.decode or None
    for config in decode_variants(kv) if kv else variants(args.seq):
        if args.only in repr(config):
            rows.append(report(config, args.seq, kv, args.head_dim))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "sm90.json"), "w") as f:
        json.dump({"seq": args.seq, "decode_kv": kv, "head_dim": args.head_dim, "rows": rows}, f, indent=1)
    what = (
        f"a batch-1 decode over {kv} keys (`--decode {kv}`)" if kv else f"prefill tiles (`--seq {args.seq}`)"
    )
    lines = [
        f"# The attention kernel compiled for sm_90 (`python -m bench.sm90`), {what}",
        "",
        "| variant | registers | spill bytes | shared bytes | programs an SM (registers / shared) | cp.async "
        "| wgmma | mma.sync | bar.sync | shfl |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        serial = " (wgmma serialized)" if r["wgmma_serialized"] else ""
        lines.append(
            f"| {r['variant']} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} "
            f"| {r['programs_by_registers']} / {r['programs_by_shared']} | {r['cp.async']} "
            f"| {r['wgmma']}{serial} | {r['mma.sync']} | {r['bar.sync']} | {r['shfl']} |"
        )
    with open(os.path.join(args.out, "sm90.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launcher of the MoE's Triton kernels (`inkling::sigmoid_sink_moe`): checks, buffers, grids and tile configs.

Nothing here reads a device value on the host: every grid comes from shapes (T, E, top_k) and the
config, so a call can be captured in a CUDA graph. The tile config is an argument; `tune()` picks
one per token bucket at build time (the builder stores its JSON-able table in the engine), and
`select_config()` reads that table at run time.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.testing

from ..triton_utils import interpreting
from . import decode_kernels, kernels

# The routed GEMMs' kernels: "mma" the tensor-core grouped GEMM; "gemv" decode rows on CUDA cores;
# "bd" decode rows on tensor cores through a block-diagonal activation operand (decode_kernels.moe_bd_kernel).
KERNELS = ("mma", "gemv", "bd")

# moe_bd_kernel's tile, and its GEMMs' keys as tune() picks them at decode sizes (_candidates has the
# measurements): GEMM 1's gate and up rows stacked in one dot a step, GEMM 2's activation row K-contiguous.
BD_TILE = {"block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3}
BD_GEMMS = {"gemm1": {**BD_TILE, "stack_gu": True, "one_dot": True}, "gemm2": {**BD_TILE, "k_major_a": True}}
# At batch 1 (T = 1): GEMM 1 on 32-row tiles in 2 splits with its activations loaded a step ahead, GEMM 2 capped
# at 96 registers (the fastest pair measured, _batch1_candidates' notes: 171.8 against 183.6 us on an H100).
BD_GEMMS_T1 = {
    "gemm1": {**BD_GEMMS["gemm1"], "block_n": 32, "split_k": 2, "prefetch_a": True},
    "gemm2": {**BD_GEMMS["gemm2"], "maxnreg": 96},
}

# moe_bd_kernel's scale_w form for batches (blocks of 16 rows of one expert as the dot's columns, the codes
# times their block scales before the dot): an expert's weights are read once for all its rows of the call.
# perm_a: both GEMMs' activations stored in the kernel's K order, so a K step's rows load contiguously.
SW_GEMMS = {
    "gemm1": {**BD_TILE, "stack_gu": True, "one_dot": True, "scale_w": True, "perm_a": True},
    "gemm2": {**BD_TILE, "one_dot": True, "scale_w": True, "perm_a": True},
}
# Its tiles (bench/moe.py --batch-tiles, H100, 2026-12-07, bench/results/gpu-2026-12-07/h100-batch-tiles/;
# each routed GEMM timed alone at T = 4 / 8 / 16 / 32 / 64, us):
#   GEMM 1 on 64 rows of W (128 stacked), block_k 256: 158 / 209 / 262 / 368 / 504 with perm_a, 170 / 233 /
#     310 / 476 / 708 without; on 32 rows: 169 / 229 / 271 / 401 / 561; 64 x 128: 204 / 259 / 326 / 435 / 534;
#   GEMM 2 on 64 rows, block_k 128: 99 / 125 / 154 / 217 / 300 with perm_a; block_k 256: 106 / 140 / 175 /
#     256 / 359.
# Before it, T = 8 read an expert's weights once a row (1-row bd blocks, 21 experts for 48 rows: GEMM 1 360
# us) and T = 64 ran the tensor-core tiles (GEMM 1 689 us). Also measured and dropped: 32-row blocks (GEMM 2
# 1.5-2.6x slower), GEMM 1 on 8 warps (15-75% slower), the shared experts serial (5-14% slower op). The pair
# SW_GEMMS' tiles make (GEMM 1 64 x 256, GEMM 2 64 x 128) was timed one GEMM at a time, not as a whole op.
# The last two are not yet timed: GEMM 1 on 2 stages, uncapped (943 SASS a K step, 254 registers, 2 programs
# an SM) and capped at 128 registers (1,021 with 12 spill loads a step, 4 programs an SM), against the default's
# 971 and 2 (bench.sm90_moe's compile; Nsight Compute saw the batch-1 kernel latency-bound on few warps).
SW_TILES = [
    ({"block_n": 64, "block_k": 256}, {"block_n": 64, "block_k": 128, "num_stages": 4}),
    ({"block_n": 64, "block_k": 256}, {"block_n": 64, "block_k": 256}),
    ({"block_n": 32, "block_k": 256}, {"block_n": 64, "block_k": 128, "num_stages": 4}),
    ({"block_n": 64, "block_k": 256, "num_stages": 2}, {"block_n": 64, "block_k": 128, "num_stages": 4}),
    (
        {"block_n": 64, "block_k": 256, "num_stages": 2, "maxnreg": 128},
        {"block_n": 64, "block_k": 128, "num_stages": 4},
    ),
]


def sw_config(g1: dict, g2: dict, block_m: int = 16, **top) -> dict:
    """A scale_w config: SW_GEMMS with GEMM 1's and GEMM 2's tile keys replaced by g1's and g2's."""
    return {"block_m": block_m, "kernel": "bd", "shared": "triton", "overlap": True, **top,
            "gemm1": {**SW_GEMMS["gemm1"], **g1}, "gemm2": {**SW_GEMMS["gemm2"], **g2}}  # fmt: skip


SW_DEFAULT = sw_config(*SW_TILES[0])


# The tensor-core GEMM's tiles for 16-row blocks: a scale_w config's where "bd" cannot run, and BF16 routed
# experts' below the GEMM's larger blocks (decode sizes).
MMA_16 = {"block_m": 16, "gemm1": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4},
          "gemm2": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}}  # fmt: skip


def without_bd(cfg: dict) -> dict:
    """A "bd" config where "bd" cannot run (a float32 network, toy widths): blocks of a few rows on the
    GEMV, with their tiles; scale_w's blocks of 16 or more rows on the tensor-core GEMM (exact in float32)."""
    if cfg["block_m"] >= 16:
        return {**cfg, "kernel": "mma", **MMA_16}
    return {**cfg, "kernel": "gemv"}


# One config per bucket of T (tokens per call). block_m is shared by both GEMMs (it sets the row
# alignment); each GEMM has its own N/K tiles, warps and pipeline stages. "kernel": "gemv" (decode
# only: a few rows per block on CUDA cores) instead of the tensor-core "mma" default.
DEFAULT_TABLE: dict = {
    "version": 1,
    "buckets": [
        {"max_tokens": 1, "block_m": 1, "kernel": "bd", "overlap": True, **BD_GEMMS_T1},
        {"max_tokens": 16, **SW_DEFAULT},
        {"max_tokens": 128, **SW_DEFAULT},
        {"max_tokens": 1024, "block_m": 32,
         "gemm1": {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
         "gemm2": {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4}},
        {"max_tokens": 1 << 30, "block_m": 64,
         "gemm1": {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
         "gemm2": {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}},
    ],
}  # fmt: skip


def select_config(table: dict | None, num_tokens: int) -> dict:
    for bucket in (table or DEFAULT_TABLE)["buckets"]:
        if num_tokens <= bucket["max_tokens"]:
            return bucket
    return (table or DEFAULT_TABLE)["buckets"][-1]


@functools.lru_cache(maxsize=64)
def parse_table(tile_configs: str) -> dict | None:
    """The op's `tile_configs` string: "" for the defaults, else the JSON of a tune() table."""
    return json.loads(tile_configs) if tile_configs else None


def _fit_k(block_k: int, K: int) -> int:
    while block_k > 32 and K % block_k:
        block_k //= 2
    if K % block_k:
        raise ValueError(f"sigmoid_sink_moe: reduction size {K} is not a multiple of 32")
    return block_k


def _block_k(cfg: dict, K: int) -> int:
    """A GEMM's K step for a reduction of K: the config's block_k, fitted to K."""
    return _fit_k(min(cfg["block_k"], K), K)


# moe_bd_kernel's constexpr flags and the config keys that set them
BD_FLAGS = {"stack_gu": "STACK_GU", "k_major_a": "K_MAJOR_A", "one_dot": "ONE_DOT", "prefetch_a": "PREFETCH_A",
            "scale_w": "SCALE_W", "perm_a": "PERM_A"}  # fmt: skip


def bd_flags(cfg: dict) -> dict:
    """A GEMM config's moe_bd_kernel flags (off where the config leaves them out)."""
    return {flag: bool(cfg.get(key, False)) for key, flag in BD_FLAGS.items()}


def _fit_split(split: int, k_steps: int) -> int:
    """The bd kernel's split of the reduction: the config's, less where the K steps do not divide evenly."""
    split = max(1, min(split, k_steps))
    while k_steps % split:
        split -= 1
    return split


SMEM_BYTES = 227 * 1024  # an H100's or H200's shared memory per block


def _fit_stages(
    stages: int, block_m: int, block_n: int, block_k: int, a_bytes: int, nvfp4: bool, gated: bool
) -> int:
    """The tensor-core GEMM's pipeline stages, fewer (down to 2) where a stage's operands would not fit the
    shared memory: the tiles are chosen for bf16 activations, and float32 ones (a float32 engine) double
    the A tile. On an H200 the bf16 shared experts' GEMM at T = 1 on the GEMV's tiles (16 x 32 x 512,
    3 stages) asked for 288 KB with float32 activations."""
    w_bytes = block_n * block_k * (2 if gated else 1) * (1 if nvfp4 else 2)  # NVFP4: codes and scales, <= 1 B
    per_stage = block_m * block_k * a_bytes + w_bytes
    while stages > 2 and stages * per_stage > SMEM_BYTES:
        stages -= 1
    return stages


def _gemm(
    a,
    w,
    ws,
    wg,
    out,
    route,
    num_tokens,
    N,
    K,
    top_k,
    KS,
    block_m,
    cfg,
    *,
    routed,
    nvfp4,
    gated,
    grid_m,
    kernel,
    perm_out=0,
):
    """One GEMM launch (two for a split "bd" reduction). "bd" with perm_a reads `a` with each K step in
    ONE_DOT's K order; perm_out ("bd"): out's columns stored in the ONE_DOT order of K steps of perm_out,
    for a GEMM 2 that reads them with perm_a."""
    sorted_rows, expert_ids, block_rows, route_w = route
    block_k = _block_k(cfg, K)
    dummy = w  # unused pointer arguments of a variant
    grid = (grid_m, triton.cdiv(N, cfg["block_n"]))
    args = (
        a, a.stride(0), w, w.stride(0), w.stride(1),
        ws if nvfp4 else dummy, ws.stride(0) if nvfp4 else 0, ws.stride(1) if nvfp4 else 0,
        wg if nvfp4 else dummy, out, out.stride(0),
        sorted_rows, expert_ids, block_rows, route_w, num_tokens, N, K,
    )  # fmt: skip
    stages = cfg["num_stages"]
    if kernel == "mma":
        stages = _fit_stages(stages, block_m, cfg["block_n"], block_k, a.element_size(), nvfp4, gated)
    tiles = dict(TOP_K=top_k, KS=KS, ROUTED=routed, NVFP4=nvfp4, GATED=gated,
                 BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
                 num_warps=cfg["num_warps"], num_stages=stages)  # fmt: skip
    if cfg.get("maxnreg"):  # a register cap per thread, for more programs per SM (see _candidates)
        tiles["maxnreg"] = cfg["maxnreg"]
    # The grid's N tiles first (kernels._program_ids): by default for the routed "mma" GEMMs, as a config's
    # "n_first" for "bd"; never for the shared experts or the GEMV, nor where the blocks would not fit the
    # grid's second dimension.
    n_first = routed and kernel != "gemv" and bool(cfg.get("n_first", kernel == "mma")) and grid_m <= 65535
    if n_first:
        grid = (grid[1], grid[0])
    if kernel == "gemv":
        decode_kernels.moe_gemv_kernel[grid](*args, **tiles)
    elif kernel == "bd":
        split = _fit_split(int(cfg.get("split_k", 1)), K // block_k)
        part = dummy  # the splits' float32 partial sums, which splitk_epilogue_kernel adds
        if split > 1:
            shape = (split, out.shape[0], (2 if gated else 1) * N)
            part = torch.empty(shape, dtype=torch.float32, device=a.device)
        decode_kernels.moe_bd_kernel[(*grid, split)](
            *args[:-1],  # (args ends with K, which the kernel takes after the partial sums' buffer)
            part,
            part.stride(0) if split > 1 else 0,
            K,
            SPLIT_K=split,
            PERM_OUT=perm_out,
            **bd_flags(cfg),
            N_FIRST=n_first,
            **tiles,
        )
        if split > 1:
            block_n = 256
            decode_kernels.splitk_epilogue_kernel[(grid_m, triton.cdiv(N, block_n))](
                part, part.stride(0), out, out.stride(0), *route, num_tokens, N,
                TOP_K=top_k, KS=KS, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, PERM_OUT=perm_out,
                num_warps=4,
            )  # fmt: skip
    else:
        # NVFP4 codes decoded by byte lookups (kernels._weight_tile_prmt): bf16 on CUDA, unless a config says
        # "prmt": False (the float32 decode, for comparison); inline PTX has no interpreter form
        prmt = nvfp4 and a.dtype == torch.bfloat16 and not interpreting() and bool(cfg.get("prmt", True))
        kernels.moe_gemm_kernel[grid](
            *args, IEEE=a.dtype == torch.float32, N_FIRST=n_first, PRMT=prmt, **tiles
        )


# The parts that may run on a side stream beside the routed ones (config "overlap": True): the shared
# experts, which read only x and, in GEMM 2, the route's weights.
SIDE_PARTS = ("gemm1 shared", "gemm2 shared", "shared (cuBLAS)")


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


@dataclass(frozen=True)
class SigmoidRouter:
    """The real Inkling's router (INKLING_SPEC §3.6): float32 logits, the selection bias [E], the learned
    global scale [1] (both float32 tensors, read on the device) and route_scale."""

    bias: torch.Tensor
    scale: torch.Tensor
    route_scale: float


def sigmoid_launches(
    x, gate, gate_bias, gate_scale, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13,
    shared_w2, route_scale: float, top_k: int, config: dict | None = None, expert_offset: int = 0,
    load: torch.Tensor | None = None, row_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[tuple[str, Callable[[], None]]], dict]:  # fmt: skip
    """The op's launches for its arguments (as `inkling::sigmoid_sink_moe`'s, less tile_configs and impl):
    (y, [(part name, launch)], the config they run). NVFP4 routed experts (the published layout, one global
    scale per expert for gate and up) or BF16 ones (empty scale tensors), which take the tensor-core GEMM at
    every size. Under expert parallelism the stacks hold experts expert_offset .. expert_offset +
    w13.shape[0] - 1 of the router's E, and y is this rank's part of the sum."""
    E = gate_bias.shape[0]
    nvfp4 = w13_scale.numel() > 0
    if nvfp4:
        n = w13.shape[0]
        w13_scale_2 = w13_scale_2.reshape(n, 1).expand(n, 2).contiguous()  # the kernels' (gate, up) pair
    cfg = config or select_config(None, x.shape[0])
    if not nvfp4 and (cfg.get("kernel", "mma") != "mma" or cfg["block_m"] < 16):
        cfg = MMA_16
    elif cfg.get("kernel") == "bd" and min(x.shape[1], shared_w2.shape[2]) < BD_MIN_K:
        cfg = without_bd(cfg)  # toy widths
    router = SigmoidRouter(gate_bias, gate_scale, route_scale)
    y, parts = launches(
        x, gate, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, shared_w13, shared_w2, E, top_k,
        router, config=cfg, expert_offset=expert_offset, load=load, row_valid=row_valid,
    )  # fmt: skip
    return y, parts, cfg


def sigmoid_sink_moe(*args, config: dict | None = None, **kwargs) -> torch.Tensor:
    """`inkling::sigmoid_sink_moe` on the GPU (arguments as `sigmoid_launches`)."""
    y, parts, cfg = sigmoid_launches(*args, config=config, **kwargs)
    return _run(y, parts, cfg, args[0])


BD_MIN_K = 128  # the "bd" kernel's smallest reduction: its dots take block_k / 8 >= 16 columns


def launches(
    x: torch.Tensor,  # [T, H]
    router_weight: torch.Tensor,  # [E+S, H]
    w13: torch.Tensor,  # uint8 [E, 2I, H/2], or bf16 [E, 2I, H] (a SigmoidRouter's BF16 experts)
    w13_scale: torch.Tensor,  # fp8 [E, 2I, H/16] (empty for BF16 experts)
    w13_scale_2: torch.Tensor,  # f32 [E, 2]
    w2: torch.Tensor,  # uint8 [E, H, I/2], or bf16 [E, H, I]
    w2_scale: torch.Tensor,  # fp8 [E, H, I/16]
    w2_scale_2: torch.Tensor,  # f32 [E]
    shared_w13: torch.Tensor,  # [S, 2I, H]
    shared_w2: torch.Tensor,  # [S, H, I]
    num_routed: int,
    top_k: int,
    router: SigmoidRouter,
    config: dict | None = None,
    expert_offset: int = 0,
    load: torch.Tensor | None = None,
    row_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[tuple[str, Callable[[], None]]]]:
    """The op as its kernel launches, in order: (the output y, [(part name, launch)]). Running every
    launch fills y; bench/moe.py times them one by one (each reads only buffers the earlier ones wrote,
    so a part can be replayed alone once all have run). router: the sigmoid router's other tensors.
    load, row_valid: the route counts each valid row's choices into load (int32 [E]; runtime/expert_load.py).
    expert_offset: expert parallelism, the stacks holding experts
    expert_offset .. expert_offset + w13.shape[0] - 1 of the router's num_routed."""
    T, H = x.shape
    E = num_routed
    EL = w13.shape[0]  # the experts held here (E without expert parallelism)
    S = shared_w13.shape[0]
    nvfp4 = w13_scale.numel() > 0
    pack = 2 if nvfp4 else 1  # weights per stored element
    # The routed experts' width, and the shared experts' (a 1/ep slice of it under expert parallelism)
    I, IS = w2.shape[-1] * pack, shared_w13.shape[1] // 2
    KS = top_k + S
    if not 0 <= expert_offset <= E - EL:
        raise ValueError(
            f"sigmoid_sink_moe: experts {expert_offset}..{expert_offset + EL - 1} are not among {E}"
        )
    if w13.shape != (EL, 2 * I, H // pack) or w2.shape != (EL, H, I // pack):
        raise ValueError(
            f"sigmoid_sink_moe: packed w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match E={EL}, H={H}, I={I}"
        )
    if router_weight.shape != (E + S, H) or shared_w2.shape != (S, H, IS):
        raise ValueError("sigmoid_sink_moe: router or shared weights do not match E, S, H and their width")
    if x.stride(1) != 1 or not (
        w13.is_contiguous()
        and w2.is_contiguous()
        and w13_scale.is_contiguous()
        and w2_scale.is_contiguous()
        and shared_w13.stride(2) == 1
        and shared_w2.stride(2) == 1
    ):
        raise ValueError("sigmoid_sink_moe: weights and x need unit stride on their last dimension")  # fmt: skip
    cfg = config or select_config(None, T)
    block_m = cfg["block_m"]
    dev = x.device
    y = torch.empty((T, H), dtype=x.dtype, device=dev)
    if T == 0:
        return y, []

    route_w = torch.empty(T * KS, dtype=torch.float32, device=dev)
    num_entries = T * top_k
    direct = block_m == 1  # route_kernel writes the blocks itself (its DIRECT), no align_kernel
    num_blocks = num_entries if direct else triton.cdiv(num_entries, block_m) + min(EL, num_entries)  # static
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    block_rows = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    if direct:  # the align path's scratch is never touched: pass a block array in its place
        counts = topk_ids = rank = block_rows
    else:
        counts = torch.empty(EL, dtype=torch.int32, device=dev)  # zeroed by route()
        topk_ids = torch.empty(T * top_k, dtype=torch.int32, device=dev)
        rank = torch.empty_like(topk_ids)
    chunk = 64
    entry_programs = triton.cdiv(num_entries, chunk)

    count = {}
    if load is not None and load.numel():
        if load.shape != (E,) or load.dtype != torch.int32 or row_valid is None or row_valid.shape != (T,):
            raise ValueError(f"sigmoid_sink_moe: expert load must be int32 [{E}] with row_valid [{T}]")
        count = dict(load_ptr=load, row_valid_ptr=row_valid, COUNT=True)

    def route():
        if router_weight.dtype == x.dtype == torch.bfloat16 and x.is_cuda:
            # BF16 products summed in float32: transformers' float32 router, in cuBLAS's order of the sums
            logits = torch.mm(x, router_weight.t(), out_dtype=torch.float32)
        else:  # float32, as transformers computes the real router
            logits = torch.nn.functional.linear(x.float(), router_weight.float())
        if not direct:
            counts.zero_()
        kernels.route_kernel[(T,)](
            logits, logits.stride(0), router.bias, router.scale, router.route_scale, topk_ids, rank, counts, route_w, sorted_rows, expert_ids, block_rows, E,
            expert_offset, EL, TOP_K=top_k, NUM_SHARED=S, BLOCK_E=triton.next_power_of_2(E + S), TOP_K_P2=triton.next_power_of_2(top_k),
            DIRECT=direct, num_warps=1 if E + S <= 512 else 4, **count,
        )  # fmt: skip
        if direct:
            return
        kernels.align_kernel[(entry_programs + triton.cdiv(num_blocks, chunk),)](
            topk_ids, rank, counts, sorted_rows, expert_ids, block_rows,
            num_entries, num_blocks, entry_programs, EL,
            TOP_K=top_k, KS=KS, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(EL), CHUNK=chunk, num_warps=4,
        )  # fmt: skip

    buffers = (sorted_rows, expert_ids, block_rows, route_w)
    h = torch.empty((T * KS, max(I, IS)), dtype=x.dtype, device=dev)
    out = torch.empty((T * KS, H), dtype=x.dtype, device=dev)
    g1, g2 = cfg["gemm1"], cfg["gemm2"]
    common = dict(num_tokens=T, top_k=top_k, KS=KS)
    kernel = cfg.get("kernel", "mma")  # the routed GEMMs' kernel
    if kernel not in KERNELS:
        raise ValueError(f"sigmoid_sink_moe: unknown kernel {kernel!r} in the tile config (have {KERNELS})")
    if not nvfp4 and (kernel != "mma" or block_m < 16):
        raise ValueError(
            "sigmoid_sink_moe: BF16 routed experts take the tensor-core GEMM, blocks of 16 rows or more"
        )
    routed = dict(
        route=buffers, routed=True, nvfp4=nvfp4, grid_m=num_blocks, block_m=block_m, kernel=kernel, **common
    )
    # The bf16 shared experts always take the tensor-core kernel (it reaches ~80% of the bandwidth at
    # decode sizes), in blocks of at least 16 tokens (its dot's smallest side).
    shared_block_m = max(block_m, 16)
    shared_m = S * triton.cdiv(T, shared_block_m)
    dense = dict(
        route=buffers,
        routed=False,
        nvfp4=False,
        grid_m=shared_m,
        block_m=shared_block_m,
        kernel="mma",
        **common,
    )

    # "bd" with perm_a: a GEMM's activations with each K step in ONE_DOT's K order, contiguous loads (x
    # permuted here, h stored so by GEMM 1)
    perm1, perm2 = (kernel == "bd" and bool(g.get("perm_a", False)) for g in (g1, g2))
    perm_h = _block_k(g2, I) if perm2 else 0  # GEMM 2's K step, the order GEMM 1 stores h in

    def gemm1_routed():
        a = x
        if perm1:
            bk = _block_k(g1, H)
            a = torch.empty_like(x)
            decode_kernels.one_dot_order_kernel[(T, H // bk)](
                x, x.stride(0), a, a.stride(0), BK=bk, num_warps=4
            )
        _gemm(a, w13, w13_scale, w13_scale_2, h, N=I, K=H, cfg=g1, gated=True, perm_out=perm_h, **routed)

    def gemm1_shared():
        _gemm(x, shared_w13, None, None, h, N=IS, K=H, cfg=g1, gated=True, **dense)

    def gemm2_routed():
        _gemm(h, w2, w2_scale, w2_scale_2, out, N=H, K=I, cfg=g2, gated=False, **routed)

    def gemm2_shared():
        _gemm(h, shared_w2, None, None, out, N=H, K=IS, cfg=g2, gated=False, **dense)

    parts = [("route", route), ("gemm1 routed", gemm1_routed)]
    if cfg.get("shared", "triton") == "triton":
        parts += [
            ("gemm1 shared", gemm1_shared),
            ("gemm2 routed", gemm2_routed),
            ("gemm2 shared", gemm2_shared),
        ]
    else:  # both shared GEMMs through cuBLAS
        parts += [
            ("gemm2 routed", gemm2_routed),
            ("shared (cuBLAS)", lambda: _shared_torch(x, shared_w13, shared_w2, route_w, out, top_k)),
        ]

    def combine():  # one launch of a few dozen programs at decode (torch's reduction took 5 us there)
        # 256 columns a program at decode; at prefill 1024, i.e. one 16-byte load per thread and slot (the
        # 8K prefill's combine took 2.1 ms a layer with 256 and a reduction across threads, ~8.5x its bytes)
        block_h = 256 if T < 64 else 1024
        kernels.combine_kernel[(T, triton.cdiv(H, block_h))](
            out, y, route_w, H, KS=KS, BLOCK_H=block_h, MASKED=EL < E, num_warps=4
        )

    parts.append(("combine", combine))
    return y, parts


def _run(y: torch.Tensor, parts: list, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """Run the op's launches (`launches`) and return y.

    With `"overlap": True` in the config (CUDA only), the shared experts run on a side stream while the
    routing and the routed GEMMs run on the current one: at decode sizes every one of these kernels
    leaves bandwidth unused (the routed GEMMs and the routing kernels wait on latency with a few hundred
    programs), so two at a time fill more of it. Fork and join are stream waits, so the op captures into
    a CUDA graph as two branches. The shared GEMM 1 starts at once; GEMM 2 waits for the route (its
    weights). Every buffer is allocated on the current stream before the fork and both streams join
    before the op returns, so nothing is freed while the side stream may use it.
    """
    if not (cfg.get("overlap") and x.is_cuda and parts):
        for _, run in parts:
            run()
        return y
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device.index if x.device.index is not None else torch.cuda.current_device())
    side.wait_stream(main)
    routed_ready = torch.cuda.Event()
    for name, run in parts:
        if name == "route":
            run()
            routed_ready.record(main)
        elif name in SIDE_PARTS:
            with torch.cuda.stream(side):
                if name != "gemm1 shared":  # GEMM 2, or the cuBLAS pair, scales by the route's weights
                    side.wait_event(routed_ready)
                run()
        else:
            if name == "combine":
                main.wait_stream(side)
            run()
    return y


def _shared_torch(x, shared_w13, shared_w2, route_w, out, top_k) -> None:
    """The bf16 shared experts through cuBLAS (a tunable alternative to the Triton grouped GEMM)."""
    T, H = x.shape
    S, I2, _ = shared_w13.shape
    I = I2 // 2
    KS = top_k + S
    hs = (x @ shared_w13.reshape(S * I2, H).T).view(T, S, I2)
    hs = (hs[..., :I].float() * torch.sigmoid(hs[..., :I].float()) * hs[..., I:].float()).to(x.dtype)
    ys = torch.bmm(hs.transpose(0, 1), shared_w2.transpose(1, 2))  # [S, T, H]
    p = route_w.view(T, KS)[:, top_k:]  # [T, S]
    out.view(T, KS, H)[:, top_k:] = (ys.transpose(0, 1).float() * p[..., None]).to(out.dtype)


def _batch1_candidates(best: dict) -> list[dict]:
    """The decode kernel's candidates for one token (T = 1) beside `best` (tune()'s usual decode pick): split
    reductions, 32-row GEMM 1 tiles, activations a step ahead. At T = 4 and 8 every one of them was slower
    (their grids are large already), so only batch 1's bucket times them."""
    out = []
    # The reduction split over programs (decode_kernels.moe_bd_kernel's SPLIT_K). At T = 1 GEMM 1 has 288
    # programs of 253 registers (2 an SM: 264 at once on 132 SMs) and GEMM 2 576 of 107 (4 an SM, 528
    # at once): a full round and a sliver of a second each. H100, 2026-12-07 (bench/moe.py --decode-tiles,
    # bench/results/gpu-2026-12-07/h100-moe-decode/): GEMM 1 82.5 us unsplit, 73.3 / 71.4 / 71.3 / 77.5 at
    # 2 / 3 / 4 / 6 splits; GEMM 2 42.4, 40.9 / 42.0 / 44.3 at 2 / 3 / 4; the op 186.4 -> 179.2 us. At
    # T = 4 every split was slower (the grid is large already). GEMM 1 on 32-row tiles (151 registers,
    # 3 programs an SM) 70.6 us unsplit.
    for s1, s2 in [(2, 1), (3, 1), (4, 1), (1, 2), (2, 2), (3, 2), (4, 2)]:
        out.append(
            {**best, "gemm1": {**best["gemm1"], "split_k": s1}, "gemm2": {**best["gemm2"], "split_k": s2}}
        )
    for s1, s2 in [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)]:
        g1 = {**best["gemm1"], "block_n": 32, "split_k": s1}
        out.append({**best, "gemm1": g1, "gemm2": {**best["gemm2"], "split_k": s2}})
    # one_dot's activations loaded a step ahead (decode_kernels.moe_bd_kernel's PREFETCH_A): Nsight Compute
    # found a third of GEMM 1's stall cycles waiting on them (H100, T = 1, gpu-2026-12-07/h100-moe-decode-2/).
    # Same H100, one call (h100-moe-decode-3/): GEMM 1 82.1 us; prefetched alone 86.1, with 2 splits 72.0,
    # on 32-row tiles with 2 splits 63.9 (66.1 without the prefetch); with GEMM 2 capped at 96 registers
    # (42.2 -> 35.2 us) the op took 171.8 us against 183.6 for the default.
    pf1 = {**best["gemm1"], "prefetch_a": True}
    pf2 = {**BD_TILE, "one_dot": True, "prefetch_a": True}
    n32 = {"block_n": 32, "split_k": 2}
    for g1, g2 in [
        (pf1, best["gemm2"]),
        ({**pf1, "split_k": 2}, {**best["gemm2"], "split_k": 2}),
        ({**pf1, **n32}, {**best["gemm2"], "split_k": 2}),
        ({**pf1, **n32}, pf2),
        (pf1, pf2),
        (BD_GEMMS_T1["gemm1"], BD_GEMMS_T1["gemm2"]),  # batch 1's default
        (BD_GEMMS_T1["gemm1"], {**best["gemm2"], "maxnreg": 80}),
    ]:
        out.append({**best, "gemm1": g1, "gemm2": g2})
    # Not candidates: the default with its activations in the kernel's K order (perm_a), which gained nothing
    # here (H100, 2026-12-07, h100-batch-tiles/: the op 176.8 us, 175.7 with GEMM 1's, 177.6 with both);
    # blocks of 2 and 4 rows, which read an expert's weights once for its rows. The dot's
    # columns are (scale block, row), so its tensor-core work grows with the rows while the weights stay:
    # at T = 1 GEMM 1 took 258 / 541 us against 82.5, at T = 4 585 / 1034 against 200 (same run).
    return out


def _candidates(T: int) -> list[dict]:
    """Configs worth timing for T tokens (a handful: tune() runs at build time, on the GPU)."""
    if T <= 16:
        tiles = [
            (16, 16, 128, 4, 4),
            (16, 32, 128, 4, 4),
            (16, 16, 256, 4, 3),
            (16, 32, 128, 4, 6),
            (16, 32, 256, 4, 3),
        ]
    elif T <= 128:
        tiles = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3), (32, 64, 128, 4, 4)]
    elif T <= 1024:
        tiles = [(32, 128, 64, 4, 4), (64, 128, 64, 8, 4), (64, 128, 128, 8, 3)]
    else:
        tiles = [
            (128, 128, 64, 8, 3),
            (128, 128, 128, 8, 3),
            (128, 256, 64, 8, 3),
            (64, 256, 64, 8, 3),
            (128, 128, 64, 4, 4),
        ]
    out = []
    for m, n, k, warps, stages in tiles:
        for shared in ("triton", "torch"):
            g = {"block_n": n, "block_k": k, "num_warps": warps, "num_stages": stages}
            out.append({"block_m": m, "shared": shared, "gemm1": g, "gemm2": dict(g)})
    if T > 1024:
        # GEMM 1 and GEMM 2 on tiles of their own: their best differ (H200, each launch timed alone, two
        # machines, bench/results/gpu-2026-12-01/s16/ s16-moe-prefill and s16d: at T = 4096 the routed
        # GEMM 1 was fastest at 128x64 with 4 warps, 7.9-8.6 ms, GEMM 2 at 128x128 with 4 warps, 3.9-4.5 ms;
        # one tile for both cost 6-10% more routed time).
        g1 = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4}
        g2 = {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4}
        for shared in ("triton", "torch"):
            out.append({"block_m": 128, "shared": shared, "gemm1": g1, "gemm2": dict(g2)})
        # Not candidates (H200, routed GEMMs alone at T = 4096, bench/results/gpu-2026-12-01/s18/): 8 warps
        # capped at 128 registers (two programs an SM; "maxnreg", still a config key) on (128, 64, 64): GEMM 1
        # 8.8 ms against 7.3 at this g1, GEMM 2 4.7-4.8 against 3.2 at this g2.
    if T <= 16:
        # the CUDA-core GEMV of the routed experts: rows per block (1 at batch 1; a few when an expert's
        # decode rows share one weight read), rows of W per program, columns per step; the shared
        # experts on tensor cores (tiles as the GEMV's, 16 tokens a block) or through cuBLAS
        for m, n, k, warps, stages in [(1, 32, 512, 4, 2), (1, 16, 512, 4, 3), (1, 64, 256, 4, 2),
                                       (1, 32, 1024, 8, 2), (2, 32, 512, 4, 2), (4, 32, 256, 4, 2)]:  # fmt: skip
            g = {"block_n": n, "block_k": k, "num_warps": warps, "num_stages": stages}
            for shared in ("triton", "torch"):
                out.append({"block_m": m, "kernel": "gemv", "shared": shared, "gemm1": g, "gemm2": dict(g)})
        # the block-diagonal decode kernel on tensor cores (block_k // 16 * block_m >= 16 fills its dot);
        # `stack_gu`: GEMM 1's gate and up rows in one dot per step; `k_major_a`: the 1-row activation
        # operand built K-contiguous; `one_dot`: the step's four nibble pieces in one dot (one operand
        # build, barrier and wgmma wait per step). H200, inkling-bench, routed GEMMs alone (2026-11-30,
        # bench/moe.py --decode-kernels): T = 1 GEMM 1 plain 71.8 us, stack_gu + k_major_a 63.3,
        # stack_gu + one_dot 54.3; GEMM 2 plain 43.7, k_major_a 38.1, one_dot 41.6. Also measured and
        # dropped: 8 warps, 2 stages, block_n 32, 2-row blocks (all slower at T = 1 and 8). An earlier run
        # (bench/results/gpu-2026-11-30/s11/moe-e2e/): the activation row's range read in one load before
        # the main loop 54.5 -> 53.9 us (noise), two warpgroups on the 128 stacked rows 73.3 us, GEMM 2
        # with block_k 128 and 4 stages 45.5 us, 4 stages on GEMM 1 over the shared memory: all dropped.
        plain, kmaj, one = {}, {"k_major_a": True}, {"one_dot": True}
        stack = {"stack_gu": True}
        for g1, g2 in [
            (plain, plain),
            ({**stack, **kmaj}, kmaj),
            ({**stack, **one}, kmaj),
            ({**stack, **one}, one),
        ]:
            for shared in ("triton", "torch"):
                out.append({"block_m": 1, "kernel": "bd", "shared": shared,
                            "gemm1": {**BD_TILE, **g1}, "gemm2": {**BD_TILE, **g2}})  # fmt: skip
        # `n_first` (the grid's N tiles first, a config key) gave nothing here: 53.96 against 53.99 us for
        # GEMM 1 and 38.4 against 38.6 for GEMM 2 at T = 1 (s18-decode), so it is not a candidate.
        # tune()'s usual choice with GEMM 2's registers capped: 5-6 programs an SM instead of 4. H200, session
        # 19 (bench/moe.py --decode-tiles, bench/results/gpu-2026-12-01/s19-bd/), GEMM 2 alone at T = 1 / 4 /
        # 8: 37.9 / 119.2 / 223.3 us uncapped, 35.8 / 112.7 / 210.1 at 80 registers, 38.6 / 111.5 / 208.3 at
        # 96; the op 1-2% faster. Measured there and not candidates: GEMM 2 with block_k 128 (5-9% slower),
        # GEMM 1 with block_k 128 or block_n 32 (8-33% slower), and the routed branch on a stream of higher
        # priority (CUDA graphs keep a node's priority; within 0.3% of the default at every T).
        best = {"block_m": 1, "kernel": "bd", "shared": "triton", "overlap": True, **BD_GEMMS}
        out += [{**best, "gemm2": {**best["gemm2"], "maxnreg": cap}} for cap in (80, 96)]
        if T == 1:
            out += _batch1_candidates(best)
    elif T <= 128:
        # The block-diagonal decode kernel for batches of decode and verify rows (batch 32 steps, MTP
        # verifies): a touched expert holds 1-2 of their rows, and the tensor-core tiles above decode its
        # weights for a 16-row block. H200, 2026-12-02 (bench/moe.py --decode-kernels 32,64,
        # bench/results/gpu-2026-12-02/s21-moe-batch/): the op at T = 32 took 2.43 ms with one row a block
        # against 2.66 on the best tensor-core tiles, at T = 64 4.75 against 3.73. Two and four rows a block
        # took 2.5 and 5 times as long as one (6.1 and 12.2 ms at T = 32), so they are not candidates (loading
        # each row's activations once a step since then cut 1,312 instructions a step to 1,053 at 2 rows, and
        # 2 rows still took 3 times as long as one at T = 1 and 4: _batch1_candidates says why).
        out.append({"block_m": 1, "kernel": "bd", "shared": "triton", **BD_GEMMS})
    if 1 < T <= 128:
        # scale_w: one expert's rows as the dot's columns, its weights read once for all of them (the bd
        # form above reads them once a row: at T = 8 on the H100, 21 experts for 48 rows, GEMM 1 took
        # 385 us against a 103 us bound, and the tensor-core tiles at T = 64 reached 29% of the bandwidth)
        out += [sw_config(g1, g2) for g1, g2 in SW_TILES]
    if T <= 128:
        # the shared experts on a side stream beside the routing and the routed GEMMs (_run's docstring), for the decode kernels and the small tensor-core tiles
        out += [
            {**c, "overlap": True}
            for c in out
            if (T > 16 or c.get("kernel") == "bd") and not c.get("overlap")
        ]
    return out


def tune(
    make_inputs,
    token_buckets=(1, 16, 32, 128, 1024, 1 << 30),
    sample_tokens=(1, 8, 32, 64, 512, 4096),
    max_tokens: int = 1 << 30,
    log=print,
    op=None,
) -> dict:
    """Time the candidate configs on the GPU and return a table for select_config (JSON-able).

    make_inputs(T) -> the positional arguments of `op` (without config) for T tokens; op: sigmoid_sink_moe
    (the default) or another function of the same form.
    Each bucket is tuned at its sample T; batch-1 decode has a bucket of its own, since at T = 8 another
    candidate may win, and so has T = 17-32 (batch 32 decode, batch 8 verifying 3 drafts), where the
    decode kernel beat the tensor-core tiles that win at T = 64. Candidates fix both GEMMs' tiles. A
    bucket sampled above `max_tokens` keeps the default tiles, untimed.
    """
    op = op or sigmoid_sink_moe
    table = {"version": 1, "buckets": []}
    for bucket_max, T in zip(token_buckets, sample_tokens):
        if T > max_tokens:
            log(f"tune T={T}: not tuned (tune_max_tokens {max_tokens}), default tiles")
            table["buckets"].append({**select_config(None, T), "max_tokens": bucket_max})
            continue
        args = make_inputs(T)
        want = op(*args, config=select_config(None, T)).float()
        best, best_ms = None, float("inf")
        for cfg in _candidates(T):
            try:
                got = op(*args, config=cfg).float()
                ms = _time(op, args, cfg)
            except Exception as exc:  # a config that does not compile (shared memory) is skipped
                log(f"tune T={T} {cfg}: failed ({type(exc).__name__})")
                continue
            err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
            if not err < 2e-2:  # the tiles sum in other orders, in bf16: a wrong kernel is far off
                log(f"tune T={T} {cfg}: wrong output (max error {err:.1e} of the output's range), skipped")
                continue
            log(f"tune T={T} {json.dumps(cfg)}: {ms * 1e3:.1f} us")
            if ms < best_ms:
                best, best_ms = cfg, ms
        table["buckets"].append({"max_tokens": bucket_max, **best})
    return table


def _time(op, args: tuple, cfg: dict) -> float:
    """Median ms of CUDA-graph replays, as the engine runs the op: timed eagerly, a decode-sized call
    measures its ~20 launches' host cost (~0.8 ms at T = 1 on the H200 host, the same for every config)
    rather than the kernels."""
    fn = lambda: op(*args, config=cfg)  # noqa: E731
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except RuntimeError:  # a stream that cannot capture: time it eagerly
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")

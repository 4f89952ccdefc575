"""The Lamport one-shot reduce-scatter / all-gather kernel (Triton code only; lamport.py launches it).

Every rank owns one buffer of 3 rotating slots, in the payload's bits (int16 for bf16/fp16, int32 for
fp32), every element pre-set to the bits of -0.0 (the sentinel). In round k all ranks use slot k % 3.
Rank s writes its contribution for rank p straight into p's slot, region s (`[N, T*W]`, W = C/N columns
per rank), with -0.0 replaced by +0.0 so that a payload value is never the sentinel; rank p then polls
its own slot, region by region in rank order, until no element of its tile is the sentinel (the data is
its own flag: no separate signal, no barrier), and reduces or copies. Meanwhile it resets the slot of
the previous round to -0.0: every peer's write into that slot has landed (this rank read them all), and
no peer writes into it again before round k + 2, which needs this rank's round-(k+1) writes, issued only
after this kernel has finished (stream order). Peers are at most one round ahead (slot k+1 % 3), so three
slots are enough and two are not.

The slot index and the size to reset live on the device (`state`: slot, programs arrived, numel to
reset), so the kernel has no host-side round counter and can be captured in a CUDA graph: each program
reads them, counts itself in with an atomic, and the last program to arrive advances them for the next
round (all others have read them by then).

Rank s's own contribution is read from x, not sent to itself. A reduce-scatter sums in float32 in rank
order starting from +0.0 (communicator.py): bitwise what the gloo and NCCL communicators compute. The
all-gather copies every region, its own included, with -0.0 made +0.0, so all ranks hold the same bits.

WRITE/READ split the kernel into its two halves; on a GPU both are 1. The Triton interpreter (CPU tests)
runs programs one after another, so there every rank's WRITE half runs before any READ half.
"""

from __future__ import annotations

import triton
import triton.language as tl

# FLOAT (the payload's float type): 0 float32, 1 bfloat16, 2 float16 (lamport.FLOAT_CODES)


@triton.jit
def _canonical(bits, SENTINEL: tl.constexpr):
    return tl.where(bits == SENTINEL, 0, bits).to(bits.dtype)


@triton.jit
def _to_f32(bits, FLOAT: tl.constexpr):
    if FLOAT == 0:
        return bits.to(tl.float32, bitcast=True)
    elif FLOAT == 1:
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _from_f32(acc, FLOAT: tl.constexpr):
    """float32 -> the payload's bits, rounding to nearest even (bf16 done in integers: the interpreter's
    bf16 cast truncates; this is torch's rounding, NaN -> 0x7FC0)."""
    if FLOAT == 0:
        return acc.to(tl.int32, bitcast=True)
    elif FLOAT == 1:
        is_nan = acc != acc
        u = tl.where(is_nan, 0, acc.to(tl.int32, bitcast=True))
        u = u + (0x7FFF + ((u >> 16) & 1))
        return tl.where(is_nan, 0x7FC0, u >> 16).to(tl.int16)
    else:
        return acc.to(tl.float16).to(tl.int16, bitcast=True)


@triton.jit
def _poll(ptrs, mask, SENTINEL: tl.constexpr):
    """Load until no element is the sentinel; volatile loads are not served from L1, and re-issued."""
    bits = tl.load(ptrs, mask=mask, other=0, volatile=True)
    while tl.max(tl.where(bits == SENTINEL, 1, 0)) > 0:
        bits = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return bits


@triton.jit
def lamport_kernel(
    x_ptr,  # this rank's input bits: [T, N*W] (reduce-scatter) or [T, W] (all-gather), contiguous
    out_ptr,  # output bits: [T, W] (reduce-scatter) or [T, N*W] (all-gather)
    buf_ptr,  # this rank's buffer: 3 slots of slot_numel elements
    peer_offsets_ptr,  # int64 [N]: rank r's buffer (as mapped here) is at buf_ptr + peer_offsets[r]
    state_ptr,  # int32 [3] on this rank: slot in use, programs arrived, numel to reset in the last slot
    num_tokens,
    width,  # W = C / N
    slot_numel,  # elements per slot
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    GATHER: tl.constexpr,  # 0: reduce-scatter, 1: all-gather
    FLOAT: tl.constexpr,
    SENTINEL: tl.constexpr,  # the bits of -0.0 as a signed integer
    BLOCK: tl.constexpr,
    WRITE: tl.constexpr,
    READ: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    num_col_blocks = tl.num_programs(1)
    num_programs = tl.num_programs(0) * num_col_blocks
    slot = tl.load(state_ptr, volatile=True)
    region = num_tokens * width  # elements each rank sends to each peer this round
    cur = slot.to(tl.int64) * slot_numel
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    elem = pid_t.to(tl.int64) * width + cols  # index inside a region: [T, W] row-major
    row_full = pid_t.to(tl.int64) * (WORLD * width)  # row start in a [T, N*W] tensor

    if WRITE:
        if GATHER:
            bits = _canonical(tl.load(x_ptr + elem, mask=mask), SENTINEL)
        for i in tl.static_range(1, WORLD):
            peer = (RANK + i) % WORLD  # start at the next rank so that ranks spread their traffic
            # an offset from a pointer argument, not a loaded address: Triton then knows the alignment
            # (torch allocations are 512-byte aligned) and vectorises the stores
            dst = buf_ptr + tl.multiple_of(tl.load(peer_offsets_ptr + peer), 16)
            if not GATHER:
                bits = _canonical(tl.load(x_ptr + row_full + peer * width + cols, mask=mask), SENTINEL)
            tl.store(dst + cur + RANK * region + elem, bits, mask=mask)

    if READ:
        clear_numel = tl.multiple_of(tl.load(state_ptr + 2, volatile=True), 16)
        # every thread's loads of the state come before this program's arrival (as __syncthreads() before
        # a thread-0 atomicAdd); the acq_rel atomic orders them before the last program's update
        tl.debug_barrier()
        arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel")
        if arrived == num_programs - 1:  # the last program in: every program has read slot and clear_numel
            tl.store(state_ptr, (slot + 1) % 3)
            # what to reset next round: this round's regions, rounded up to 16 elements (aligned,
            # vectorised stores; the extra elements were never written), within the slot
            tl.store(state_ptr + 2, tl.minimum((WORLD * region + 15) // 16 * 16, slot_numel))
            tl.store(state_ptr + 1, 0)
        own = buf_ptr

        # reset the previous round's slot, spread over all programs
        prev = own + ((slot + 2) % 3).to(tl.int64) * slot_numel
        pid = pid_t * num_col_blocks + pid_c
        sentinel = tl.full([BLOCK], SENTINEL, buf_ptr.dtype.element_ty)
        start = pid * BLOCK
        while start < clear_numel:  # a while loop: the interpreter cannot range() over loaded scalars
            offs = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
            tl.store(prev + offs, sentinel, mask=offs < clear_numel)
            start += num_programs * BLOCK

        if GATHER:
            for r in tl.static_range(WORLD):
                if r == RANK:
                    bits = _canonical(tl.load(x_ptr + elem, mask=mask), SENTINEL)
                else:
                    bits = _poll(own + cur + r * region + elem, mask, SENTINEL)
                tl.store(out_ptr + row_full + r * width + cols, bits, mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                if r == RANK:
                    bits = tl.load(x_ptr + row_full + RANK * width + cols, mask=mask, other=0)
                else:
                    bits = _poll(own + cur + r * region + elem, mask, SENTINEL)
                acc += _to_f32(bits, FLOAT)
            tl.store(out_ptr + elem, _from_f32(acc, FLOAT), mask=mask)

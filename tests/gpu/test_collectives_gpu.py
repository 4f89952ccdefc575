"""plugins.collectives on CUDA: the Lamport kernel between two processes over many rounds, exact; NCCL.

    python3 -m pytest tests/gpu/test_collectives_gpu.py -q -s -p no:cacheprovider

Two ranks, each on its own GPU when there are two, else both on one GPU through CUDA IPC (time-sliced:
correctness, not speed); four ranks where there are four GPUs. The handles go over a gloo process group (NCCL refuses two ranks on one GPU).
Every result is compared bitwise with plugins.collectives.reference on the same inputs, which include
exact -0.0 and +0.0: rounds checked one by one, rounds run back to back without a host synchronisation,
a CUDA graph of a reduce-scatter and an all-gather replayed on new inputs, the fallback above max_numel,
and the custom ops. -s prints each rank's log (the run to report).
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORLD_SIZE = 2
CHANNELS = 7168
TOKENS = (1, 8, 64)
DTYPES = (torch.bfloat16, torch.float32)
CHECKED_ROUNDS = 200
BACK_TO_BACK_ROUNDS = 120
GRAPH_REPLAYS = 20
TIMEOUT_S = 400


def rank_inputs(seed: int, world_size: int, shape: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input (CPU), made identically in every process; about 5% exact -0.0 and 5% +0.0."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(world_size):
        x = torch.randn(shape, generator=g)
        u = torch.rand(shape, generator=g)
        xs.append(torch.where(u < 0.05, -0.0, torch.where(u > 0.95, 0.0, x)).to(dtype))
    return xs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def round_plan(i: int) -> tuple[int, torch.dtype]:
    return TOKENS[i % len(TOKENS)], DTYPES[(i // len(TOKENS)) % len(DTYPES)]


def expected(xs: list[torch.Tensor], rank: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(reduce-scatter of xs, every rank's all-gather input, all-gather as Lamport delivers it)."""
    from plugins.collectives import reference

    n = len(xs)
    width = xs[0].shape[1] // n
    parts = [x[:, r * width : (r + 1) * width].contiguous() for r, x in enumerate(xs)]
    gathered = reference.without_negative_zero(reference.all_gather(parts))
    return reference.reduce_scatter(xs, rank), parts, gathered


def device_of(rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count())


def _lamport_checks(rank: int, world_size: int, log) -> None:
    import plugins  # noqa: F401
    from plugins import collectives
    from plugins.collectives import reference

    device = device_of(rank)
    comm = collectives.init_communicator("lamport", rank=rank, world_size=world_size, device=device)
    log(f"{comm} on {device} ({torch.cuda.get_device_name(device)}), fallback {comm.fallback.backend}")

    start = time.perf_counter()
    for i in range(CHECKED_ROUNDS):  # one round at a time, checked
        num_tokens, dtype = round_plan(i)
        xs = rank_inputs(i, world_size, (num_tokens, CHANNELS), dtype)
        want_rs, parts, want_ag = expected(xs, rank)
        got_rs = comm.reduce_scatter(xs[rank].to(device))
        got_ag = comm.all_gather(parts[rank].to(device))
        assert same_bits(got_rs, want_rs), f"reduce_scatter round {i} T={num_tokens} {dtype}"
        assert same_bits(got_ag, want_ag), f"all_gather round {i} T={num_tokens} {dtype}"
    log(
        f"checked rounds: {CHECKED_ROUNDS} x (reduce_scatter + all_gather) exact, {time.perf_counter() - start:.1f} s"
    )

    start = time.perf_counter()
    cases = []
    for i in range(BACK_TO_BACK_ROUNDS):  # inputs first, then every round without a host sync
        num_tokens, dtype = round_plan(i)
        xs = rank_inputs(10_000 + i, world_size, (num_tokens, CHANNELS), dtype)
        want_rs, parts, want_ag = expected(xs, rank)
        cases.append((xs[rank].to(device), parts[rank].to(device), want_rs, want_ag))
    torch.cuda.synchronize(device)
    outs = [(comm.reduce_scatter(x), comm.all_gather(p)) for x, p, _, _ in cases]
    torch.cuda.synchronize(device)
    for i, ((rs, ag), (_, _, want_rs, want_ag)) in enumerate(zip(outs, cases)):
        assert same_bits(rs, want_rs) and same_bits(ag, want_ag), f"back-to-back round {i}"
    log(f"back-to-back rounds: {BACK_TO_BACK_ROUNDS} exact, {time.perf_counter() - start:.1f} s")

    # a CUDA graph of reduce-scatter -> all-gather (a TP layer's close), replayed on new inputs
    static_x = torch.zeros(8, CHANNELS, dtype=torch.bfloat16, device=device)
    comm.all_gather(comm.reduce_scatter(static_x))  # compile before capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = comm.all_gather(comm.reduce_scatter(static_x))
    for i in range(GRAPH_REPLAYS):
        xs = rank_inputs(20_000 + i, world_size, (8, CHANNELS), torch.bfloat16)
        static_x.copy_(xs[rank])
        graph.replay()
        want = torch.cat([reference.reduce_scatter(xs, r) for r in range(world_size)], dim=1)
        assert same_bits(static_out, reference.without_negative_zero(want)), f"graph replay {i}"
        if i % 5 == 0:  # eager calls between replays keep the slot rotation in step
            num_tokens, dtype = round_plan(i)
            xs = rank_inputs(30_000 + i, world_size, (num_tokens, CHANNELS), dtype)
            want_rs, _, _ = expected(xs, rank)
            assert same_bits(comm.reduce_scatter(xs[rank].to(device)), want_rs), f"eager after replay {i}"
    log(f"CUDA graph: {GRAPH_REPLAYS} replays of reduce_scatter -> all_gather exact")

    big = rank_inputs(40_000, world_size, (comm.max_numel // CHANNELS + 1, CHANNELS), torch.bfloat16)
    want_rs, parts, want_ag = expected(big, rank)
    assert not comm.uses_kernel(big[rank].to(device), big[rank].numel())
    assert same_bits(comm.reduce_scatter(big[rank].to(device)), want_rs), "fallback reduce_scatter"
    assert torch.equal(comm.all_gather(parts[rank].to(device)).cpu(), want_ag), "fallback all_gather"
    log(f"fallback above max_numel={comm.max_numel} ({big[rank].shape[0]} tokens): exact")

    collectives.set_communicator(comm)
    xs = rank_inputs(50_000, world_size, (8, CHANNELS), torch.bfloat16)
    want_rs, parts, want_ag = expected(xs, rank)
    for impl in ("triton", "reference"):
        got = torch.ops.inkling.reduce_scatter(xs[rank].to(device), world_size, impl)
        assert same_bits(got, want_rs), f"op reduce_scatter impl={impl}"
        got = torch.ops.inkling.all_gather(parts[rank].to(device), world_size, impl)
        assert torch.equal(got.cpu(), want_ag), f"op all_gather impl={impl}"
    log("custom ops (impl triton and reference): exact")
    collectives.set_communicator(None)
    dist.barrier()
    comm.close()


def _nccl_checks(rank: int, world_size: int, log) -> None:
    import plugins  # noqa: F401
    from plugins import collectives

    device = device_of(rank)
    comm = collectives.init_communicator("nccl", rank=rank, world_size=world_size, device=device)
    for i in range(30):
        num_tokens, dtype = round_plan(i)
        xs = rank_inputs(i, world_size, (num_tokens, CHANNELS), dtype)
        want_rs, parts, _ = expected(xs, rank)
        assert same_bits(comm.reduce_scatter(xs[rank].to(device)), want_rs), f"nccl reduce_scatter round {i}"
        assert same_bits(comm.all_gather(parts[rank].to(device)), torch.cat(parts, dim=1)), (
            f"nccl all_gather {i}"
        )
    log("nccl: 30 rounds of reduce_scatter + all_gather exact")


def _worker(check: str, rank: int, world_size: int, init_file: str, queue) -> None:
    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(f"rank {rank}: {msg}")

    result = dict(rank=rank, ok=False, log=lines)
    try:
        torch.cuda.set_device(device_of(rank))
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        (_lamport_checks if check == "lamport" else _nccl_checks)(rank, world_size, log)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001  (reported to the parent)
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        queue.put(result)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(check: str, world_size: int, tmp_path, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Start one process per rank, wait for every report, return them. A rank whose peer failed may spin
    in a kernel for ever: after a failure the others get 30 s, then are killed."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(check, rank, world_size, str(tmp_path / f"pg_{check}"), queue), daemon=True
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout_s
    try:
        for _ in procs:
            results.append(queue.get(timeout=max(1.0, deadline - time.monotonic())))
            if not results[-1]["ok"]:
                deadline = min(deadline, time.monotonic() + 30)
    except Exception:  # noqa: BLE001  (queue.Empty: a rank hangs)
        results.append(dict(rank=-1, ok=False, error="no report from a rank in time (it hangs)", log=[]))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for r in sorted(results, key=lambda r: r["rank"]):
        print("\n".join(r["log"]))
        if not r["ok"]:
            print(f"rank {r['rank']} failed: {r.get('traceback') or r['error']}")
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_lamport_processes_exact(world_size, tmp_path):
    """2 ranks always (sharing GPU 0 on a one-GPU host); 4 ranks where there are 4 GPUs."""
    if world_size > 2 and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs")
    shared = torch.cuda.device_count() < world_size
    print(f"\nlamport: {world_size} processes on {'one shared GPU' if shared else 'one GPU each'}")
    results = run_ranks("lamport", world_size, tmp_path)
    failed = [r for r in results if not r["ok"]]
    assert not failed, "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)


def test_nccl_two_processes_exact(tmp_path):
    shared = torch.cuda.device_count() < WORLD_SIZE
    print(f"\nnccl: {WORLD_SIZE} processes on {'one shared GPU' if shared else 'one GPU each'}")
    results = run_ranks("nccl", WORLD_SIZE, tmp_path, timeout_s=120)
    failed = [r for r in results if not r["ok"]]
    if failed and shared:
        pytest.skip(f"NCCL with two ranks on one GPU: {failed[0]['error'][:300]}")
    assert not failed, "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)

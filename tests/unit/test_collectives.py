"""plugins.collectives on the CPU: the gloo backend in 2 and 4 processes against the reference, the custom
ops (export, fake impls, world size 1), input checks, and the Lamport kernel's logic (indexing, sentinel,
slot rotation and reset) in the Triton interpreter with simulated ranks in one process. The Lamport kernel
between real processes on a GPU: tests/gpu/test_collectives_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import plugins  # noqa: F401  (registers the ops)
from plugins import collectives
from plugins.collectives import reference
from plugins.triton_utils import HAS_TRITON, interpreting

SHAPES = [(1, 8), (5, 24), (16, 64)]  # [T, C]; C divisible by 2 and 4
DTYPES = [torch.float32, torch.bfloat16]


def rank_inputs(seed: int, world_size: int, shape: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input, made identically in every process; some exact -0.0 and +0.0 entries."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(world_size):
        x = torch.randn(shape, generator=g)
        zeros = torch.rand(shape, generator=g)
        x = torch.where(zeros < 0.05, -0.0, torch.where(zeros > 0.95, 0.0, x))
        xs.append(x.to(dtype))
    return xs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def _check_communicator(comm, rank: int, world_size: int) -> None:
    assert (comm.rank, comm.world_size, comm.backend) == (rank, world_size, "gloo")
    collectives.set_communicator(comm)
    for seed, (shape, dtype) in enumerate([(s, d) for s in SHAPES for d in DTYPES]):
        xs = rank_inputs(seed, world_size, shape, dtype)
        want_rs = reference.reduce_scatter(xs, rank)
        got_rs = comm.reduce_scatter(xs[rank])
        assert same_bits(got_rs, want_rs), (shape, dtype, (got_rs.float() - want_rs.float()).abs().max())
        width = shape[1] // world_size
        parts = [x[:, r * width : (r + 1) * width].contiguous() for r, x in enumerate(xs)]
        want_ag = reference.all_gather(parts)
        assert same_bits(comm.all_gather(parts[rank]), want_ag), (shape, dtype)
        for impl in ("reference", "triton"):
            assert same_bits(torch.ops.inkling.reduce_scatter(xs[rank], world_size, impl), want_rs)
            assert same_bits(torch.ops.inkling.all_gather(parts[rank], world_size, impl), want_ag)
        assert same_bits(comm.reduce_scatter(xs[rank]), got_rs)  # deterministic: the same bits again
        # and torch.distributed's own collectives agree (its all_reduce may add in another order)
        summed = xs[rank].float().clone()  # all_reduce works in place
        dist.all_reduce(summed, group=comm.group)
        torch.testing.assert_close(
            got_rs.float(), summed[:, rank * width : (rank + 1) * width].to(dtype).float()
        )
        gathered = [torch.empty_like(parts[rank]) for _ in range(world_size)]
        dist.all_gather(gathered, parts[rank], group=comm.group)
        assert same_bits(torch.cat(gathered, dim=1), want_ag)
    # a non-contiguous input (a column slice) works too
    x = rank_inputs(99, world_size, (3, 2 * 8 * world_size), torch.float32)
    sliced = [t[:, ::2] for t in x]
    assert same_bits(comm.reduce_scatter(sliced[rank]), reference.reduce_scatter(sliced, rank))
    with pytest.raises(ValueError, match="not divisible"):
        comm.reduce_scatter(torch.zeros(2, 4 * world_size + 1))
    with pytest.raises(RuntimeError, match="world_size=3"):
        torch.ops.inkling.reduce_scatter(torch.zeros(2, 6), 3, "reference")
    collectives.set_communicator(None)
    comm.close()


def _worker(rank: int, world_size: int, init_file: str) -> None:
    """All 4 ranks as one world, then as two worlds of 2 (process subgroups {0, 1} and {2, 3})."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        _check_communicator(
            collectives.init_communicator("gloo", rank=rank, world_size=world_size), rank, world_size
        )
        with pytest.raises(ValueError, match="disagrees"):  # a rank that disagrees with the process group
            collectives.init_communicator("gloo", rank=rank, world_size=world_size + 1)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        pair = pairs[rank // 2]
        comm = collectives.init_communicator("gloo", rank=rank % 2, world_size=2, group=pair)
        _check_communicator(comm, rank % 2, 2)
    finally:
        collectives.set_communicator(None)
        dist.destroy_process_group()


def test_gloo_matches_reference(tmp_path):
    """gloo with 4 processes, and 2 (one spawn for both: starting processes is most of the time)."""
    mp.spawn(_worker, args=(4, str(tmp_path / "pg")), nprocs=4, join=True)


def test_world_size_one_is_identity():
    comm = collectives.init_communicator("gloo", rank=0, world_size=1)  # no process group needed
    x = torch.randn(4, 6)
    assert torch.equal(comm.reduce_scatter(x), x) and torch.equal(comm.all_gather(x), x)
    for impl in ("reference", "triton"):
        y = torch.ops.inkling.reduce_scatter(x, 1, impl)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
        assert torch.equal(torch.ops.inkling.all_gather(x, 1, impl), x)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="not divisible"):
        torch.ops.inkling.reduce_scatter(torch.zeros(2, 7), 2, "reference")
    with pytest.raises(ValueError, match=r"must be \[T, C\]"):
        torch.ops.inkling.reduce_scatter(torch.zeros(2, 4, 2), 2, "reference")
    with pytest.raises(ValueError, match=r"must be \[T, C // world_size\]"):
        torch.ops.inkling.all_gather(torch.zeros(8), 2, "reference")
    with pytest.raises(ValueError, match="unknown impl"):
        torch.ops.inkling.all_gather(torch.zeros(2, 4), 2, "nccl")
    with pytest.raises(ValueError, match="world_size must be"):
        torch.ops.inkling.all_gather(torch.zeros(2, 4), 0, "reference")
    with pytest.raises(ValueError, match="unknown collectives backend"):
        collectives.init_communicator("mpi", rank=0, world_size=2)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        collectives.init_communicator("lamport", rank=0, world_size=2, device="cpu")
    collectives.set_communicator(None)
    with pytest.raises(RuntimeError, match="no communicator set"):
        torch.ops.inkling.all_gather(torch.zeros(2, 4), 2, "reference")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            collectives.init_communicator("gloo", rank=0, world_size=2)


def test_fake_impls_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 24, dtype=torch.bfloat16)
        assert torch.ops.inkling.reduce_scatter(x, 4, "triton").shape == (5, 6)
        assert torch.ops.inkling.all_gather(x, 4, "reference").shape == (5, 96)
        with pytest.raises(ValueError, match="not divisible"):
            torch.ops.inkling.reduce_scatter(x, 5, "reference")


class _TPBlock(torch.nn.Module):
    """A reduce-scatter, a per-channel op on the own slice, an all-gather: the shape of a TP layer's close."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.inkling.reduce_scatter(x, self.world_size, "triton")
        return torch.ops.inkling.all_gather(y * 2, self.world_size, "triton")


def test_export_with_collectives():
    x = torch.randn(3, 16)
    tokens = torch.export.Dim("num_tokens", min=1, max=64)
    for world_size in (1, 4):  # world_size 4 only traces (fake impls); it is not run here
        ep = torch.export.export(_TPBlock(world_size), (x,), dynamic_shapes=({0: tokens},))
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert {"inkling.reduce_scatter.default", "inkling.all_gather.default"} <= targets
        if world_size == 1:
            assert torch.equal(ep.module()(torch.ones(7, 16)), torch.full((7, 16), 2.0))


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter (CPU CI)")
@pytest.mark.parametrize("world_size", [2, 4])
def test_lamport_kernel_in_interpreter(world_size):
    """Rounds of mixed reduce-scatters and all-gathers, sizes and dtypes among simulated ranks: exact results,
    and after every round every buffer is the sentinel everywhere but the slot just used."""
    from plugins.collectives import lamport

    slot_numel = 4 * 40 * world_size
    buffers = {es: [lamport.new_buffer(es, slot_numel, "cpu") for _ in range(world_size)] for es in (2, 4)}
    states = {es: [lamport.new_state("cpu") for _ in range(world_size)] for es in (2, 4)}
    offsets = {es: [lamport.peer_offsets(bufs, r) for r in range(world_size)] for es, bufs in buffers.items()}
    rounds = {2: 0, 4: 0}

    def args(es, rank):
        return buffers[es][rank], offsets[es][rank], states[es][rank]

    plan = [(g, t, d) for t in (1, 3, 4) for d in (torch.float32, torch.bfloat16) for g in (False, True)]
    plan += [(True, 2, torch.float16), (False, 1, torch.float16), (False, 4, torch.bfloat16)]
    for seed, (gather, num_tokens, dtype) in enumerate(plan):
        width = 20 if num_tokens != 3 else 33  # not a multiple of the block: masked columns
        xs = rank_inputs(seed, world_size, (num_tokens, width * (1 if gather else world_size)), dtype)
        outs = [xs[0].new_empty((num_tokens, width * world_size if gather else width)) for _ in xs]
        es = xs[0].element_size()
        slot = rounds[es] % 3
        for rank in range(world_size):
            kw = dict(rank=rank, world_size=world_size, gather=gather)
            lamport.launch(xs[rank], outs[rank], *args(es, rank), **kw, read=False)
        region = num_tokens * width
        for rank, buf in enumerate(
            buffers[es]
        ):  # every peer's region has arrived (else the reads would spin)
            used = buf[slot * slot_numel :][: world_size * region].view(world_size, region)
            for peer in range(world_size):
                sentinels = int((used[peer] == lamport.SENTINEL[es]).sum())
                assert sentinels == (region if peer == rank else 0), (rank, peer, sentinels)
        for rank in range(world_size):
            kw = dict(rank=rank, world_size=world_size, gather=gather)
            lamport.launch(xs[rank], outs[rank], *args(es, rank), **kw, write=False)
        rounds[es] += 1
        for rank in range(world_size):
            if gather:
                want = reference.without_negative_zero(reference.all_gather(xs))
            else:
                want = reference.reduce_scatter(xs, rank)
            assert same_bits(outs[rank], want), (seed, gather, num_tokens, dtype, rank)
            assert states[es][rank].tolist() == [rounds[es] % 3, 0, (world_size * region + 15) // 16 * 16]
            rest = buffers[es][rank].view(3, slot_numel)[[s for s in range(3) if s != slot]]
            assert bool((rest == lamport.SENTINEL[es]).all()), (seed, rank)


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter (CPU CI)")
def test_lamport_communicator_glue_in_interpreter():
    """LamportCommunicator's launch and fallback rule, its buffers set up by hand (no CUDA IPC here): rank 1
    runs its halves through lamport.launch around rank 0's whole collective."""
    from types import SimpleNamespace

    from plugins.collectives import lamport

    world_size, slot_numel = 2, 256
    buffers = {es: [lamport.new_buffer(es, slot_numel, "cpu") for _ in range(world_size)] for es in (2, 4)}
    shared = {
        es: [
            SimpleNamespace(
                local=bufs[r], offsets=lamport.peer_offsets(bufs, r), state=lamport.new_state("cpu")
            )
            for r in range(world_size)
        ]
        for es, bufs in buffers.items()
    }
    fallback_calls = []

    class Fallback(collectives.Communicator):
        def reduce_scatter(self, x):
            fallback_calls.append(("reduce_scatter", tuple(x.shape), x.dtype))
            return x[:, : x.shape[1] // 2].clone()

    comm = lamport.LamportCommunicator.__new__(lamport.LamportCommunicator)
    comm.rank, comm.world_size, comm.device, comm.max_numel = 0, world_size, torch.device("cpu"), slot_numel
    comm.fallback = Fallback()
    comm._buffers = {es: sets[0] for es, sets in shared.items()}
    assert comm.reference() is comm.fallback

    for seed, (gather, dtype) in enumerate(
        [(False, torch.bfloat16), (True, torch.float32), (False, torch.float32)]
    ):
        xs = rank_inputs(seed, world_size, (3, 8 if gather else 16), dtype)
        es = xs[0].element_size()
        peer = shared[es][1]
        out1 = xs[1].new_empty((3, 16 if gather else 8))
        kw = dict(rank=1, world_size=world_size, gather=gather)
        lamport.launch(xs[1], out1, peer.local, peer.offsets, peer.state, **kw, read=False)
        out0 = comm.all_gather(xs[0]) if gather else comm.reduce_scatter(xs[0])
        lamport.launch(xs[1], out1, peer.local, peer.offsets, peer.state, **kw, write=False)
        for rank, out in ((0, out0), (1, out1)):
            if gather:
                want = reference.without_negative_zero(reference.all_gather(xs))
            else:
                want = reference.reduce_scatter(xs, rank)
            assert same_bits(out, want), (seed, rank)
    assert fallback_calls == []
    comm.reduce_scatter(torch.zeros(20, 16, dtype=torch.bfloat16))  # 320 elements > max_numel
    comm.reduce_scatter(torch.zeros(2, 16, dtype=torch.float64))  # no Lamport payload type
    assert fallback_calls == [
        ("reduce_scatter", (20, 16), torch.bfloat16),
        ("reduce_scatter", (2, 16), torch.float64),
    ]

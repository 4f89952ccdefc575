"""`inkling::reduce_scatter` and `inkling::all_gather`: tensor-parallel collectives on the channel dimension.

    reduce_scatter(x [T, C], world_size, impl) -> [T, C // N]   rank r: Σ over ranks of x[:, r*C/N:(r+1)*C/N]
    all_gather(x [T, C // N], world_size, impl) -> [T, C]        rank r's x at columns r*C/N .. (r+1)*C/N - 1

Summation is float32 in rank order, rounded once to x.dtype (communicator.py): every backend gives the
same bits. Backends, one `Communicator` per process (`init_communicator`, then `set_communicator`):

- "gloo": CPU (CUDA tensors are staged through the host); the CPU engines and CI.
- "nccl": CUDA, one GPU per rank.
- "lamport": CUDA, ranks on one host: a one-shot Triton kernel for small messages (lamport.py); messages
  of more than `max_numel` elements (T*C) go to the process group's NCCL (or gloo) instead.

The ops call the process's communicator (`get_communicator()`): an exported program cannot hold one.
`impl` (the builder's choice, recorded in the program): "reference" runs only torch.distributed
collectives (for a lamport communicator, its process-group fallback); "triton" runs the communicator's
own path, which is the Lamport kernel for a lamport communicator and the same as "reference" otherwise.
With world_size 1 both ops are copies and need no communicator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..registry import PluginSpec, check_impl, register
from .communicator import (
    Communicator,
    SoloCommunicator,
    check_all_gather,
    check_reduce_scatter,
    get_communicator,
    set_communicator,
)
from .process_group import ProcessGroupCommunicator

__all__ = [
    "BACKENDS",
    "Communicator",
    "ProcessGroupCommunicator",
    "all_gather",
    "get_communicator",
    "init_communicator",
    "reduce_scatter",
    "set_communicator",
]

BACKENDS = ("gloo", "nccl", "lamport")

REDUCE_SCATTER = register(
    PluginSpec(
        name="reduce_scatter",
        version=1,
        doc="tensor-parallel reduce-scatter on channels, float32 sum in rank order (gloo, NCCL, Lamport)",
    )
)
ALL_GATHER = register(
    PluginSpec(
        name="all_gather", version=1, doc="tensor-parallel all-gather on channels (gloo, NCCL, Lamport)"
    )
)


def init_communicator(
    backend: str,
    *,
    rank: int,
    world_size: int,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    **kw,
) -> Communicator:
    """This rank's communicator. Every rank calls it at the same point (it may create a process group and
    the lamport backend exchanges buffer handles).

    world_size > 1 needs torch.distributed initialised by the caller first
    (`torch.distributed.init_process_group(...)`, any backend; the communicator uses `group`, default the
    world). gloo and nccl use that group when it has their backend, else make one with
    `dist.new_group(backend=...)` over the same ranks. lamport (CUDA, one host, each rank's device set with
    `torch.cuda.set_device` and every GPU visible to every rank) exchanges CUDA IPC handles over the group
    and falls back to it (NCCL if the group has it, else gloo) for large messages; its keywords are
    LamportCommunicator's (`max_numel`). world_size 1 needs no process group.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown collectives backend {backend!r}; expected one of {BACKENDS}")
    device = torch.device(device)
    if backend in ("nccl", "lamport") and device.type != "cuda":
        raise ValueError(f"collectives backend {backend!r} needs a CUDA device, got {device}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if world_size == 1:
        return SoloCommunicator(backend)
    group = _checked_group(rank, world_size, group)
    if backend == "lamport":
        from .lamport import LamportCommunicator

        return LamportCommunicator(rank=rank, world_size=world_size, device=device, group=group, **kw)
    if kw:
        raise TypeError(f"collectives backend {backend!r} takes no options, got {sorted(kw)}")
    if backend not in dist.get_backend(group):
        ranks = None if group is None else dist.get_process_group_ranks(group)
        group = dist.new_group(ranks=ranks, backend=backend)
    return ProcessGroupCommunicator(backend, rank=rank, world_size=world_size, group=group)


def _checked_group(rank: int, world_size: int, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"init_communicator(world_size={world_size}) needs torch.distributed.init_process_group(...) "
            "to have been called in every rank first"
        )
    if dist.get_rank(group) != rank or dist.get_world_size(group) != world_size:
        raise ValueError(
            f"init_communicator(rank={rank}, world_size={world_size}) disagrees with the process group "
            f"(rank {dist.get_rank(group)} of {dist.get_world_size(group)})"
        )
    return group


def _communicator(world_size: int, impl: str) -> Communicator:
    comm = get_communicator()
    if comm.world_size != world_size:
        raise RuntimeError(f"op built for world_size={world_size} but the communicator has {comm.world_size}")
    return comm if impl == "triton" else comm.reference()


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


@torch.library.custom_op("inkling::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, world_size: int, impl: str) -> torch.Tensor:
    check_impl(REDUCE_SCATTER.name, impl)
    _check_world_size(world_size)
    check_reduce_scatter(x, world_size)
    if world_size == 1:
        return x.clone()
    return _communicator(world_size, impl).reduce_scatter(x)


@reduce_scatter.register_fake
def _reduce_scatter_fake(x, world_size, impl):
    check_impl(REDUCE_SCATTER.name, impl)
    _check_world_size(world_size)
    check_reduce_scatter(x, world_size)
    return x.new_empty((x.shape[0], x.shape[1] // world_size))


@torch.library.custom_op("inkling::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world_size: int, impl: str) -> torch.Tensor:
    check_impl(ALL_GATHER.name, impl)
    _check_world_size(world_size)
    check_all_gather(x)
    if world_size == 1:
        return x.clone()
    return _communicator(world_size, impl).all_gather(x)


@all_gather.register_fake
def _all_gather_fake(x, world_size, impl):
    check_impl(ALL_GATHER.name, impl)
    _check_world_size(world_size)
    check_all_gather(x)
    return x.new_empty((x.shape[0], x.shape[1] * world_size))

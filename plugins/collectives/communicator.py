"""The `Communicator` interface, the world-size-1 communicator, and the process's current communicator.

A communicator is one rank's end of the tensor-parallel group: `reduce_scatter` and `all_gather` on the
channel dimension (DESIGN.md "Tensor parallelism"). Every backend computes the same numbers:

    reduce_scatter: out = ((0.0 + x_0[:, s]) + x_1[:, s]) + ... + x_{N-1}[:, s]   in float32, then x.dtype
                    (s = this rank's column slice; ranks added in rank order; one rounding at the end)
    all_gather:     out[:, r*C/N:(r+1)*C/N] = x_r

so results are deterministic and bitwise equal across backends and calls (a sum of -0.0s comes out +0.0;
the Lamport backend also delivers a gathered -0.0 as +0.0, see lamport.py).
"""

from __future__ import annotations

import torch


class Communicator:
    """One rank's collectives. Subclasses: ProcessGroupCommunicator (gloo, nccl), LamportCommunicator."""

    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "lamport"

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, C], the same shape on every rank, C % world_size == 0 -> [T, C // world_size]."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, C // world_size] -> [T, C]: rank r's x at columns r*C/N .. (r+1)*C/N - 1."""
        raise NotImplementedError

    def reference(self) -> Communicator:
        """The torch.distributed-only path of this communicator (what impl="reference" runs): itself for
        gloo and nccl, the process-group fallback for lamport."""
        return self

    def close(self) -> None:
        """Release buffers; the process group stays (its owner destroys it)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, world_size={self.world_size})"
        )


class SoloCommunicator(Communicator):
    """world_size 1: both collectives are copies; needs no process group."""

    def __init__(self, backend: str) -> None:
        self.rank, self.world_size, self.backend = 0, 1, backend

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        check_reduce_scatter(x, 1)
        return x.clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        check_all_gather(x)
        return x.clone()


def check_reduce_scatter(x: torch.Tensor, world_size: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"reduce_scatter: x must be [T, C], got shape {tuple(x.shape)}")
    if x.shape[1] % world_size != 0:
        raise ValueError(f"reduce_scatter: channels C={x.shape[1]} not divisible by world_size={world_size}")
    if not x.is_floating_point():
        raise ValueError(f"reduce_scatter: x must be floating point, got {x.dtype}")


def check_all_gather(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"all_gather: x must be [T, C // world_size], got shape {tuple(x.shape)}")


def sum_in_rank_order(chunks: torch.Tensor) -> torch.Tensor:
    """chunks [N, ...] -> float32 ((0 + chunks[0]) + chunks[1]) + ...: the contract's summation order."""
    acc = torch.zeros(chunks.shape[1:], dtype=torch.float32, device=chunks.device)
    for chunk in chunks:
        acc.add_(chunk)
    return acc


# The process's communicator, read by the custom ops: an exported step program cannot carry a Python
# object, so (as TensorRT-LLM's NCCL plugins find their communicator per process) it is process state,
# set once when a rank starts and cleared when it stops.
_CURRENT: Communicator | None = None


def set_communicator(comm: Communicator | None) -> None:
    global _CURRENT
    _CURRENT = comm


def get_communicator() -> Communicator:
    if _CURRENT is None:
        raise RuntimeError(
            "no communicator set: call plugins.collectives.set_communicator(init_communicator(...)) "
            "in every rank before running a tensor-parallel program"
        )
    return _CURRENT

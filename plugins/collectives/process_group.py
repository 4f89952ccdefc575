"""gloo and NCCL communicators: the collectives through torch.distributed.

reduce_scatter is an all-to-all of column slices followed by a local float32 sum in rank order, not the
library's reduce-scatter: the bytes each rank sends are the same ((N-1)/N of x), and the result is the
contract's exact sum (communicator.py) whatever order gloo or NCCL would add in, on every backend. (gloo
also lacks reduce_scatter in older torch releases.) A gloo communicator takes CUDA tensors too, staging
them through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .communicator import Communicator, check_all_gather, check_reduce_scatter, sum_in_rank_order

# torch 2.13 renamed all_gather_into_tensor (2.11 has only the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ProcessGroupCommunicator(Communicator):
    def __init__(
        self, backend: str, *, rank: int, world_size: int, group: dist.ProcessGroup | None = None
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"ProcessGroupCommunicator: backend must be gloo or nccl, got {backend!r}")
        self.backend, self.rank, self.world_size, self.group = backend, rank, world_size, group

    def _to_wire(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "gloo":
            return x.cpu()
        if not x.is_cuda:
            raise ValueError(f"nccl communicator: x must be a CUDA tensor, got {x.device}")
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        check_reduce_scatter(x, self.world_size)
        num_tokens, channels = x.shape
        n = self.world_size
        # [N, T, C/N]: chunk p goes to rank p; after the exchange chunk r came from rank r
        send = self._to_wire(x).view(num_tokens, n, channels // n).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return sum_in_rank_order(recv).to(device=x.device, dtype=x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        check_all_gather(x)
        num_tokens, width = x.shape
        send = self._to_wire(x).contiguous()
        recv = send.new_empty((self.world_size * num_tokens, width))  # [N*T, C/N]: rank r's x at rows r*T..
        _all_gather_single(recv, send, group=self.group)
        recv = recv.view(self.world_size, num_tokens, width).transpose(0, 1)
        return recv.reshape(num_tokens, self.world_size * width).to(x.device)

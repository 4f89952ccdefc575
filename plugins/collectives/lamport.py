"""The Lamport communicator: one-shot reduce-scatter and all-gather for small messages, ranks on one host.

Each rank allocates, per payload width (16-bit for bf16/fp16, 32-bit for fp32), one buffer of three
rotating slots of `max_numel` elements filled with -0.0, shares it with the others as a CUDA IPC handle
over the process group, and maps theirs. A collective is then one kernel (kernels.py): each rank writes
its data straight into the peers' buffers and polls its own until the sentinel is gone. No NCCL call, no
host synchronisation, no host-side state per call: it can sit in a CUDA graph.

Fallback rule: a message of more than `max_numel` elements (T*C: the reduce-scatter's input, the
all-gather's output), a dtype other than float32/bfloat16/float16, or a tensor on another device goes to
the process group instead (NCCL if the group has it, else gloo); these checks depend only on shapes and
dtypes, which every rank shares, so all ranks take the same path. The default `max_numel`, 2**20 (64
tokens of 16384 channels), covers decode and verify steps; prefill chunks are bandwidth-bound and belong
to NCCL.

Rules for the caller: all ranks issue the same collectives in the same order (as for any collective
library), on one CUDA stream per rank (the slot rotation relies on stream order between calls), and each
rank's `torch.cuda.set_device(...)` is its device before `init_communicator`, every GPU visible to every
rank (for CUDA IPC). Two ranks may share one GPU (tests do); they then run time-sliced, slowly.

A -0.0 in an all-gather's payload arrives as +0.0 on every rank (the sentinel cannot be sent); a
reduce-scatter's result is the contract's bitwise (its +0.0 start already turns -0.0 into +0.0).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import triton
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from .communicator import Communicator, check_all_gather, check_reduce_scatter
from .kernels import lamport_kernel
from .process_group import ProcessGroupCommunicator

DEFAULT_MAX_NUMEL = 1 << 20
FLOAT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BITS = {2: torch.int16, 4: torch.int32}  # element size -> the integer type the kernel moves
SENTINEL = {2: -(1 << 15), 4: -(1 << 31)}  # the bits of -0.0, as that signed integer
NUM_SLOTS = 3
_STORAGE_DEVICE_ARG = list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


def new_buffer(element_size: int, slot_numel: int, device: torch.device) -> torch.Tensor:
    """One rank's buffer: NUM_SLOTS slots of slot_numel elements, every element the sentinel."""
    if slot_numel % 16:
        raise ValueError(f"lamport: slot_numel must be a multiple of 16, got {slot_numel}")
    return torch.full(
        (NUM_SLOTS * slot_numel,), SENTINEL[element_size], dtype=BITS[element_size], device=device
    )


def new_state(device: torch.device) -> torch.Tensor:
    """[slot in use, programs arrived, numel to reset in the previous slot]."""
    return torch.zeros(3, dtype=torch.int32, device=device)


def block_size(num_tokens: int, width: int) -> int:
    """Columns per program: about 256 programs per collective (more programs, more bytes in flight),
    between 128 and 2048 elements each, never much wider than a row."""
    block = max(128, triton.next_power_of_2(max(1, num_tokens * width // 256)))
    return max(16, min(block, 2048, triton.next_power_of_2(width)))


def peer_offsets(buffers: list[torch.Tensor], rank: int) -> torch.Tensor:
    """int64 [N]: where each rank's buffer (as mapped here) is, in elements from this rank's."""
    base, size = buffers[rank].data_ptr(), buffers[rank].element_size()
    offsets = [b.data_ptr() - base for b in buffers]
    assert all(o % (16 * size) == 0 for o in offsets), "buffers must be 16-element aligned"
    return torch.tensor([o // size for o in offsets], dtype=torch.int64, device=buffers[rank].device)


def launch(
    x: torch.Tensor,
    out: torch.Tensor,
    buffer: torch.Tensor,
    offsets: torch.Tensor,
    state: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    gather: bool,
    write: bool = True,
    read: bool = True,
) -> None:
    """One Lamport round of rank `rank`: x [T, C] -> out [T, C/N] (reduce-scatter) or x [T, C/N] -> out
    [T, C] (all-gather). x and out contiguous, float32/bfloat16/float16; buffer is this rank's new_buffer()
    of x's element size, offsets its peer_offsets(), state its new_state().
    write/read run half the kernel (the Triton interpreter needs every rank's writes before any read)."""
    slot_numel = buffer.numel() // NUM_SLOTS
    num_tokens = x.shape[0]
    width = out.shape[1] if not gather else x.shape[1]
    if num_tokens * width * world_size > slot_numel:
        raise ValueError(f"lamport: {num_tokens}x{width * world_size} elements exceed a slot of {slot_numel}")
    es = x.element_size()
    block = block_size(num_tokens, width)
    grid = (num_tokens, triton.cdiv(width, block))
    lamport_kernel[grid](
        x.view(BITS[es]),
        out.view(BITS[es]),
        buffer,
        offsets,
        state,
        num_tokens,
        width,
        slot_numel,
        RANK=rank,
        WORLD=world_size,
        GATHER=int(gather),
        FLOAT=FLOAT_CODES[x.dtype],
        SENTINEL=SENTINEL[es],
        BLOCK=block,
        WRITE=int(write),
        READ=int(read),
        num_warps=max(1, min(8, block // 256)),
    )


class _SharedBuffer:
    """This rank's buffer for one element size, every rank's buffer mapped here, and this rank's state."""

    def __init__(
        self, element_size: int, slot_numel: int, rank: int, world_size: int, device: torch.device, group
    ) -> None:
        self.local = new_buffer(element_size, slot_numel, device)
        self.state = new_state(device)
        torch.cuda.synchronize(device)  # filled before any peer can map it
        self.mapped = _exchange(self.local, rank, world_size, device, group)
        self.offsets = peer_offsets(self.mapped, rank)


def _exchange(local: torch.Tensor, rank: int, world_size: int, device: torch.device, group) -> list:
    """Every rank's buffer as a tensor in this process (its own is `local`), through CUDA IPC handles.

    torch's own IPC pickling (torch.multiprocessing.reductions) makes the handle; a peer's handle is opened
    with this rank's device current (the rebuild's device argument), so the mapping belongs to this rank's
    CUDA context with peer access enabled, and no context is created on the peer's GPU. (That tensor says
    it is on this rank's device even when its memory is on the peer's; only its address is used.)
    """
    _, args = reduce_tensor(local)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, args, group=group)
    mapped = []
    for r, peer_args in enumerate(gathered):
        if r == rank:
            mapped.append(local)
            continue
        peer_args = list(peer_args)
        peer_args[_STORAGE_DEVICE_ARG] = device.index
        mapped.append(rebuild_cuda_tensor(*peer_args))
    return mapped


class LamportCommunicator(Communicator):
    backend = "lamport"

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        max_numel: int = DEFAULT_MAX_NUMEL,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"lamport communicator needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.current_device() != device.index:
            raise RuntimeError(
                f"lamport communicator on {device}: call torch.cuda.set_device({device.index}) first "
                f"(the current device is cuda:{torch.cuda.current_device()})"
            )
        if max_numel < 1 or max_numel % 16:
            raise ValueError(f"lamport: max_numel must be a positive multiple of 16, got {max_numel}")
        self.rank, self.world_size, self.device, self.max_numel = rank, world_size, device, max_numel
        fallback = "nccl" if "nccl" in dist.get_backend(group) else "gloo"
        self.fallback = ProcessGroupCommunicator(fallback, rank=rank, world_size=world_size, group=group)
        self._buffers = {
            es: _SharedBuffer(es, max_numel, rank, world_size, device, group) for es in sorted(BITS)
        }

    def reference(self) -> Communicator:
        return self.fallback

    def uses_kernel(self, x: torch.Tensor, numel: int) -> bool:
        """Whether a collective on x moving `numel` elements (T*C) runs the Lamport kernel (else the fallback)."""
        return x.device == self.device and x.dtype in FLOAT_CODES and 0 < numel <= self.max_numel

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        check_reduce_scatter(x, self.world_size)
        if not self.uses_kernel(x, x.numel()):
            return self.fallback.reduce_scatter(x)
        out = x.new_empty((x.shape[0], x.shape[1] // self.world_size))
        self._launch(x.contiguous(), out, gather=False)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        check_all_gather(x)
        if not self.uses_kernel(x, x.numel() * self.world_size):
            return self.fallback.all_gather(x)
        out = x.new_empty((x.shape[0], x.shape[1] * self.world_size))
        self._launch(x.contiguous(), out, gather=True)
        return out

    def _launch(self, x: torch.Tensor, out: torch.Tensor, *, gather: bool) -> None:
        buf = self._buffers[x.element_size()]
        launch(
            x,
            out,
            buf.local,
            buf.offsets,
            buf.state,
            rank=self.rank,
            world_size=self.world_size,
            gather=gather,
        )

    def close(self) -> None:
        """Drop the mappings and buffers. Safe once this rank's collectives are done: every peer write
        into this rank's buffer has landed (it was read), and torch keeps an IPC-shared allocation alive
        while peers still map it."""
        if self._buffers:
            torch.cuda.synchronize(self.device)
            self._buffers = {}

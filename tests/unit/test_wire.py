"""runtime.distributed's control-group codec: a step's inputs cross to the workers as WireTensors (numpy
buffers) and come back as equal host tensors, whatever their dtype and shape, inside the containers and
dataclasses the runner sends."""

import pickle
from dataclasses import dataclass

import torch

from runtime.distributed import WireTensor, from_wire, to_wire


@dataclass
class Inputs:
    ids: torch.Tensor
    rows: torch.Tensor
    extra: dict


def test_wire_round_trip_keeps_values_dtypes_and_shapes():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-5, 5, (3, 4), generator=g, dtype=torch.int32),
        torch.randn(2, 7, generator=g).to(torch.bfloat16),
        torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        torch.tensor(3, dtype=torch.int64),  # 0-d
        torch.empty(0, 16, dtype=torch.float16),
        torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
        torch.tensor([True, False]),
    ]
    message = ("execute", (Inputs(tensors[0], tensors[1], {"more": tensors[2:]}), True), False)
    got = from_wire(pickle.loads(pickle.dumps(to_wire(message))))
    assert got[0] == "execute" and got[2] is False and got[1][1] is True
    sent = got[1][0]
    assert isinstance(sent, Inputs) and isinstance(to_wire(message)[1][0].ids, WireTensor)
    for want, have in zip(tensors, [sent.ids, sent.rows, *sent.extra["more"]]):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(_bytes(have), _bytes(want))  # bit for bit


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _two_ranks(rank: int, port: int, calls: list) -> None:
    import torch.distributed as dist

    from runtime.distributed import RankGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = RankGroup(rank, 2, dist.group.WORLD)
        for method, args, reply in calls:
            if rank == 0:
                group.send_call(method, args, reply)
            else:
                got = group.receive_call()
                assert got[0] == method and got[2] == reply and len(got[1]) == len(args)
                for want, have in zip(args, got[1]):
                    assert torch.equal(_bytes(have), _bytes(want)) and have.dtype == want.dtype
    finally:
        dist.destroy_process_group()


def test_control_calls_cross_between_ranks():
    """RankGroup.send_call / receive_call over gloo: a small call (one fixed-size broadcast) and one larger
    than the buffer (a second broadcast), in order."""
    import socket

    import torch.multiprocessing as mp

    from runtime.distributed import CONTROL_BYTES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls = [
        ("execute", (torch.arange(5), torch.randn(3, 7).to(torch.bfloat16)), False),
        ("gather", (torch.randn(CONTROL_BYTES // 4 + 100),), True),  # larger than the buffer
        ("reset_slot", (torch.tensor(2),), False),
    ]
    mp.spawn(_two_ranks, args=(port, calls), nprocs=2)

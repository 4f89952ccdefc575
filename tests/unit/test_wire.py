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

"""runtime.programs.retarget: an exported program's device moved where it runs (tensor-parallel ranks run
a program exported on cuda:0 on their own GPU). On the CPU the move goes to the meta device: every node
that names a device must name the new one, and the dynamic batch must stay dynamic."""

import torch
from torch.export import Dim

from runtime.programs import retarget


class Program(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x, lens):
        positions = torch.arange(x.shape[0], device=x.device)  # a factory naming the export's device
        y = (x * self.scale).to(torch.device("cpu"), torch.float32)
        return y + positions[:, None], lens + 1


def test_retarget_moves_devices_and_keeps_shapes_dynamic():
    B = Dim("batch", min=1, max=2)
    ep = torch.export.export(
        Program(), (torch.ones(2, 4), torch.ones(2, dtype=torch.int32)), dynamic_shapes=({0: B}, {0: B})
    )
    named = [n for n in ep.graph.nodes if str(n.kwargs.get("device", "")) == "cpu"]
    assert named, "the program should name its device somewhere"
    retarget(ep, "cpu", "meta")
    assert not [n for n in ep.graph.nodes if str(n.kwargs.get("device", "")) == "cpu"]
    assert all(str(v.device) == "meta" for v in ep.state_dict.values())
    for batch in (1, 2):  # the example's batch was 2: batch 1 must still pass the program's guards
        y, lens = ep.module()(
            torch.ones(batch, 4, device="meta"), torch.ones(batch, dtype=torch.int32, device="meta")
        )
        assert y.shape == (batch, 4) and y.device.type == "meta" and lens.shape == (batch,)

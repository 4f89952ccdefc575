"""The engine's exported programs on the runtime's device: moved where they run (a tensor-parallel rank
runs the program exported on cuda:0 on its own GPU), compiled where the engine says, the encoders
wrapped in their CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from builder.build import head_program_name
from builder.engine import Engine

from .encoder_graphs import GraphedEncoder


@dataclass
class Programs:
    """The callables the runner steps: the step program, the MTP depths' programs by name, and the
    encoders (None on a tensor-parallel worker: rank 0 encodes media)."""

    step: Any
    head: dict[str, Any]  # the MTP depths' programs by name ({} without depths)
    vision: GraphedEncoder | None
    audio: GraphedEncoder | None
    compiled: bool

    @classmethod
    def load(
        cls, engine: Engine, device: torch.device, dtype: torch.dtype, heads: bool, compile: bool | None
    ):
        """compile: torch.compile the step and head programs (default: when the engine was built with
        compile), seeded with the compiler cache artifacts the build saved."""
        compiled = engine.build_config.compile if compile is None else compile
        step = program_on_device(engine.programs["step"], device).module()
        # The MTP depths' programs, one per attention kind (builder/build.py), by name
        head = {
            name: program_on_device(p, device).module()
            for name, p in engine.programs.items()
            if heads and name.startswith("mtp_head")
        }
        if compiled:
            if engine.compile_cache is not None:
                torch.compiler.load_cache_artifacts(engine.compile_cache)
            step = torch.compile(step, dynamic=True)
            # as the step: Inductor fuses the head's small ops
            head = {name: torch.compile(h, dynamic=True) for name, h in head.items()}
        vision, audio = (
            GraphedEncoder(
                program_on_device(engine.programs[k], device).module(),
                k,
                device,
                dtype,
                engine_config=engine.config,
            )
            if k in engine.programs
            else None
            for k in ("vision", "audio")
        )
        return cls(step, head, vision, audio, compiled)


def program_on_device(
    program: torch.export.ExportedProgram, device: torch.device
) -> torch.export.ExportedProgram:
    """`program` with the devices its nodes name (tensor factories, the dtype/device asserts of `.to`)
    moved to `device`, in place: a build exports on cuda:0, and each rank of a tensor-parallel engine
    runs on its own GPU."""
    if device.type != "cuda":
        return program
    index = torch.cuda.current_device() if device.index is None else device.index
    if index == 0:
        return program
    return retarget(program, "cuda:0", f"cuda:{index}")


def retarget(program: torch.export.ExportedProgram, old: str, new: str) -> torch.export.ExportedProgram:
    """torch.export.passes.move_to_device_pass(program, {old: new}) without its rewrite of every node's
    meta["val"]: on the H200 (torch 2.11) rank 1 of a tp 2 engine built for one sequence, moved by
    that pass, failed its first step on `Guard failed: seq_lens.size()[0] == 2` (2: the export
    example's batch), while rank 0, not moved, ran the same program. What runs is the graph: the device
    kwargs of its nodes, the device argument of `aten.to.device`, and the program's own tensors."""
    for table in (program._state_dict, program._constants):
        for k, v in table.items():
            if isinstance(v, torch.Tensor) and str(v.device) == old:
                moved = v.to(new)
                table[k] = (
                    torch.nn.Parameter(moved, v.requires_grad) if isinstance(v, torch.nn.Parameter) else moved
                )
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if str(node.kwargs.get("device")) == old:
                node.kwargs = {**node.kwargs, "device": torch.device(new)}
            if (
                node.op == "call_function"
                and node.target is torch.ops.aten.to.device
                and str(node.args[1]) == old
            ):
                node.args = (node.args[0], torch.device(new), *node.args[2:])
        module.recompile()
    return program


class DepthPrograms:
    """The real Inkling's head programs called as one (what the drafter and the head graphs call): the
    first argument, a depth's weights dict, picks the program of that depth's attention kind."""

    def __init__(self, programs: dict[str, Any], weights: list[dict], layer_types: list[str]):
        self.programs = programs
        self.by_weights = {id(w): programs[head_program_name(k)] for w, k in zip(weights, layer_types)}

    def __call__(self, weights: dict, *args):
        return self.by_weights[id(weights)](weights, *args)


def encode_media(
    vision: GraphedEncoder | None,
    audio: GraphedEncoder | None,
    pixel_values: list[torch.Tensor],
    levels: list[torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
) -> torch.Tensor:
    """The real Inkling's media embeddings, images' then audio clips', in prompt order: [M, H]."""
    if (pixel_values and vision is None) or (levels and audio is None):
        raise ValueError("this engine has no vision tower or audio embedding: send text")
    rows = [vision(p.to(device, dtype)) for p in pixel_values]
    rows += [audio(a.to(device)) for a in levels]
    empty = torch.zeros(0, hidden_size, dtype=dtype, device=device)
    return torch.cat(rows).to(dtype) if rows else empty

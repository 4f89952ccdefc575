"""The programs' argument contracts: each program's arguments defined once, by name and in order.

A program of the engine (the step, the MTP head pass, the head pass with its draft pick) is called with
positional arguments, as torch.export wants. Its contract below names each argument and says what it is
for the code around the program:
- a per-call input (a field of StepInputs / HeadInputs / PickInputs, what the runtime builds each call),
  with its role in a ragged batch ("tokens": sized by the batch's tokens, "seqs": by its sequences,
  "logits": by the rows whose logits are wanted; "cu", "seq_lens", "q_bound", "mm_embeds",
  "mm_positions"), the padding value a CUDA-graph bucket fills it with, and its dynamic dimensions;
- or a fixed argument (weights, caches, states: the same tensors every call).

From the contract come the forward signature (checked: `implements`), the export's dynamic shapes
(`dynamic_shapes`), the CUDA-graph staging's view of the ragged batch (`ragged`, runtime/step_graphs.py)
and the positional call (`arguments`). Nothing else indexes a program's arguments by position.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import Dim

ROLES = ("tokens", "seqs", "logits", "cu", "seq_lens", "q_bound", "mm_embeds", "mm_positions")


def ragged(role: str, dim: int = 0, pad: float = 0, dynamic: dict[int, str] | None = None) -> Any:
    """A per-call input's field: its role in the ragged batch, the dimension that role sizes, the padding
    value, and its dynamic dimensions (dim -> a name of `dims`)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    return field(metadata={"role": role, "dim": dim, "pad": pad, "dynamic": dynamic or {dim: _DEFAULT[role]}})


_DEFAULT = {
    "tokens": "num_tokens", "seqs": "batch", "logits": "num_logits", "cu": "batch+1", "seq_lens": "batch",
    "q_bound": "max_q", "mm_embeds": "num_mm", "mm_positions": "num_mm",
}  # fmt: skip


class Inputs:
    """Per-call inputs of a program (a dataclass with `ragged` fields)."""

    def to(self, device: torch.device) -> list[torch.Tensor]:
        return [getattr(self, f.name).to(device) for f in dataclasses.fields(self)]


@dataclass
class StepInputs(Inputs):
    """The step program's per-call inputs (builder/network.py StepProgram; docs/interfaces.md)."""

    input_ids: torch.Tensor = ragged("tokens")  # [T]
    mm_embeds: torch.Tensor = ragged("mm_embeds")  # [M + 1, H]: media rows, then a dummy aimed at row T
    mm_positions: torch.Tensor = ragged("mm_positions")  # [M + 1]
    cu_seqlens_q: torch.Tensor = ragged("cu")  # int32 [B + 1]
    seq_lens: torch.Tensor = ragged("seq_lens")  # int32 [B]: each sequence's length after this step
    block_tables: torch.Tensor = ragged("seqs", dim=1)  # int32 [G, B, MB]
    slot_mappings: torch.Tensor = ragged("tokens", dim=1, pad=-1)  # int64 [G, T]; -1: write nothing
    state_indices: torch.Tensor = ragged("seqs", pad=-1)  # int32 [B]; -1: no sconv state
    logits_indices: torch.Tensor = ragged("logits")  # [N]: the rows whose logits are wanted
    q_bound: torch.Tensor = ragged("q_bound")  # int8 [Q]: its length bounds each sequence's new tokens


@dataclass
class HeadInputs(Inputs):
    """An MTP head pass's per-call inputs (builder/network.py HeadProgram): row t is the head at position t."""

    h_prev: torch.Tensor = ragged("tokens")  # [T, H]: the previous level's hidden states
    input_ids: torch.Tensor = ragged("tokens")  # [T]: the token m places ahead (or a draft's placeholder)
    mm_embeds: torch.Tensor = ragged("mm_embeds")
    mm_positions: torch.Tensor = ragged("mm_positions")
    cu_seqlens_q: torch.Tensor = ragged("cu")
    seq_lens: torch.Tensor = ragged("seq_lens")
    block_table: torch.Tensor = ragged("seqs")  # int32 [B, MB]: group 0's (docs/interfaces.md "MTP heads")
    slot_mapping: torch.Tensor = ragged("tokens", pad=-1)  # int64 [T]
    state_indices: torch.Tensor = ragged("seqs", pad=-1)
    q_bound: torch.Tensor = ragged("q_bound")


@dataclass
class PickInputs(Inputs):
    """What a drafting head pass adds for its draft pick (runtime/drafter.py Drafter.head_and_pick)."""

    pick_rows: torch.Tensor = ragged("seqs")  # [B]: the row each sequence drafts from
    pick_dst: torch.Tensor = ragged("seqs", pad=-1)  # [B]: where its draft goes in `drafted`; -1: a sink
    hole_src: torch.Tensor = ragged("tokens", pad=-1)  # [T]: the draft to read in place of the id; -1: none


@dataclass(frozen=True)
class Fixed:
    """An argument that is the same object every call (weights, caches, states). dynamic: its dynamic
    dimensions (a tensor); each: those of every element (a list of tensors); None: static."""

    name: str
    dynamic: dict[int, str] | None = None
    each: dict[int, str] | None = None


@dataclass(frozen=True)
class RaggedArgs:
    """Where a program's ragged batch sits among its positional arguments: index -> (dim, padding value)
    of the inputs sized by tokens and by sequences; the logits rows (N <= T), cu_seqlens_q, seq_lens,
    q_bound and the media splice; what each output is sized by ("T" or "N")."""

    tokens: dict[int, tuple[int, float]]
    seqs: dict[int, tuple[int, float]]
    cu: int
    seq_lens: int
    q_bound: int
    mm_embeds: int
    mm_positions: int
    outputs: tuple[str, ...]
    logits: int | None = None


class ProgramContract:
    """A program's arguments in order: Fixed arguments and the fields of Inputs dataclasses."""

    def __init__(self, name: str, parts: tuple[Fixed | type[Inputs], ...], outputs: tuple[str, ...]):
        self.name, self.parts, self.outputs = name, parts, outputs
        self.fields: list[tuple[str, dict | None, Fixed | None]] = []  # (name, ragged metadata, fixed)
        for part in parts:
            if isinstance(part, Fixed):
                self.fields.append((part.name, None, part))
            else:
                self.fields += [(f.name, dict(f.metadata), None) for f in dataclasses.fields(part)]
        self.names = tuple(n for n, _, _ in self.fields)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"{name}: an argument named twice in {self.names}")
        self.ragged = self._ragged()

    def index(self, name: str) -> int:
        return self.names.index(name)

    def arguments(self, *inputs: Inputs, **fixed: Any) -> list:
        """The positional call: each Inputs part from `inputs` (in the contract's order), each Fixed
        argument by its name."""
        given = iter(inputs)
        out = []
        for part in self.parts:
            if isinstance(part, Fixed):
                if part.name not in fixed:
                    raise TypeError(f"{self.name}: missing argument {part.name!r}")
                out.append(fixed.pop(part.name))
                continue
            x = next(given)
            if not isinstance(x, part):
                raise TypeError(f"{self.name}: expected {part.__name__}, got {type(x).__name__}")
            out += [getattr(x, f.name) for f in dataclasses.fields(part)]
        if fixed or next(given, None) is not None:
            raise TypeError(f"{self.name}: unexpected arguments {sorted(fixed)}")
        return out

    def by_name(self, args: list) -> dict[str, Any]:
        return dict(zip(self.names, args, strict=True))

    def dynamic_shapes(self, dims: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
        """torch.export's dynamic_shapes by argument name: `dims` maps the contract's dimension names to
        torch.export Dims; `example` gives the weights' keys and the lists' lengths."""
        out: dict[str, Any] = {}
        for name, meta, fixed in self.fields:
            if meta is not None:
                out[name] = {d: dims[n] for d, n in meta["dynamic"].items()}
            elif isinstance(example[name], dict):
                out[name] = {k: None for k in example[name]}
            elif isinstance(example[name], (list, tuple)):
                # Each element's dimensions are its own (the real Inkling's full and sliding caches hold
                # different numbers of blocks), bounded as the contract's name says.
                out[name] = [
                    {d: _own_dim(dims[n], f"{n}_{j}") for d, n in fixed.each.items()} if fixed.each else None
                    for j in range(len(example[name]))
                ]
            else:
                out[name] = {d: dims[n] for d, n in (fixed.dynamic or {}).items()} or None
        return out

    def implements(self, forward: Callable) -> Callable:
        """Decorator of a program's forward: its parameters must be the contract's names, in order."""
        params = [p for p in inspect.signature(forward).parameters if p != "self"]
        if tuple(params) != self.names:
            raise TypeError(
                f"{forward.__qualname__} takes {params}, the {self.name} contract says {self.names}"
            )
        return forward

    def _ragged(self) -> RaggedArgs:
        tokens, seqs, single = {}, {}, {}
        for i, (_, meta, _) in enumerate(self.fields):
            if meta is None:
                continue
            role = meta["role"]
            if role == "tokens":
                tokens[i] = (meta["dim"], meta["pad"])
            elif role == "seqs":
                seqs[i] = (meta["dim"], meta["pad"])
            else:
                if role in single:
                    raise ValueError(f"{self.name}: two arguments of role {role}")
                single[role] = i
        return RaggedArgs(
            tokens=tokens, seqs=seqs, cu=single["cu"], seq_lens=single["seq_lens"], q_bound=single["q_bound"],
            mm_embeds=single["mm_embeds"], mm_positions=single["mm_positions"], outputs=self.outputs,
            logits=single.get("logits"),
        )  # fmt: skip


def _own_dim(dim: Any, name: str) -> Any:
    """A torch.export Dim named `name` with `dim`'s bounds."""
    return Dim(name, min=dim.min, max=dim.max)


NUM_BLOCKS = {0: "num_blocks"}
STEP = ProgramContract(
    "step",
    (Fixed("weights"), StepInputs, Fixed("key_caches", each=NUM_BLOCKS), Fixed("value_caches", each=NUM_BLOCKS),
     Fixed("conv_states"), Fixed("expert_load")),
    outputs=("N", "T"),  # logits float32 [N, V], hidden [T, H]
)  # fmt: skip
HEAD = ProgramContract(
    "mtp_head",
    (Fixed("weights"), HeadInputs, Fixed("key_cache", dynamic=NUM_BLOCKS), Fixed("value_cache", dynamic=NUM_BLOCKS),
     Fixed("conv_states")),
    outputs=("T",),  # h^m [T, H]
)  # fmt: skip
# A drafting head pass with its draft pick in the same graph: the head's arguments, the pick's inputs, and
# `drafted` (the drafter's buffer of a round's drafts, read and written in place).
HEAD_PICK = ProgramContract("mtp_head_pick", (*HEAD.parts, PickInputs, Fixed("drafted")), outputs=("T",))

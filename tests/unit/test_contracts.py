"""The programs' argument contracts (builder/contracts.py): one definition each, from which the forward
signatures, the export's dynamic shapes, the graphs' ragged view and the positional calls come."""

from __future__ import annotations

import inspect

import pytest
import torch

from builder.contracts import (
    HEAD,
    HEAD_PICK,
    STEP,
    Fixed,
    HeadInputs,
    PickInputs,
    ProgramContract,
    StepInputs,
)
from builder.network import HeadProgram, StepProgram


def test_the_programs_forward_signatures_are_their_contracts():
    for program, contract in ((StepProgram, STEP), (HeadProgram, HEAD)):
        params = [p for p in inspect.signature(program.forward).parameters if p != "self"]
        assert tuple(params) == contract.names


def test_a_forward_that_differs_from_its_contract_is_refused():
    with pytest.raises(TypeError, match="contract says"):

        @STEP.implements
        def forward(self, weights, input_ids, mm_positions, mm_embeds):  # two swapped, the rest missing
            pass


def test_arguments_are_placed_by_name():
    t = {f: torch.tensor([i]) for i, f in enumerate(StepInputs.__dataclass_fields__)}
    fixed = dict(weights="w", key_caches="k", value_caches="v", conv_states="c", expert_load="e")
    args = STEP.arguments(StepInputs(**t), **fixed)
    assert args[0] == "w" and args[-4:] == ["k", "v", "c", "e"]
    assert STEP.by_name(args)["q_bound"] is t["q_bound"] and args[STEP.index("seq_lens")] is t["seq_lens"]
    with pytest.raises(TypeError):
        STEP.arguments(StepInputs(**t), weights="w", key_caches="k", value_caches="v", conv_states="c")
    h = {f: torch.tensor([0]) for f in HeadInputs.__dataclass_fields__}
    p = PickInputs(*(torch.tensor([0]) for _ in range(3)))
    args = HEAD_PICK.arguments(
        HeadInputs(**h), p, weights=1, key_cache=2, value_cache=3, conv_states=4, drafted=5
    )
    assert len(args) == len(HEAD_PICK.names) and args[-1] == 5 and args[: len(HEAD.names)][-1] == 4


def test_the_ragged_view_follows_the_fields():
    r = STEP.ragged
    assert r.tokens == {STEP.index("input_ids"): (0, 0), STEP.index("slot_mappings"): (1, -1)}
    assert r.seqs == {STEP.index("block_tables"): (1, 0), STEP.index("state_indices"): (0, -1)}
    assert (r.cu, r.seq_lens, r.logits) == (
        STEP.index("cu_seqlens_q"),
        STEP.index("seq_lens"),
        STEP.index("logits_indices"),
    )
    assert HEAD_PICK.ragged.tokens.keys() >= {HEAD_PICK.index("hole_src")}


def test_dynamic_shapes_by_name():
    dims = {n: n for n in ("num_tokens", "batch", "batch+1", "num_logits", "num_mm", "num_blocks", "max_q")}
    example = {
        "weights": {"a": 0, "b": 0},
        "key_caches": [0, 0],
        "value_caches": [0, 0],
        "conv_states": [0] * 3,
        "expert_load": [0] * 2,
    }
    from torch.export import Dim

    dims["num_blocks"] = Dim("num_blocks", min=2, max=1 << 20)
    d = STEP.dynamic_shapes(dims, example)
    assert list(d) == list(STEP.names)
    # each cache its own dimension (full and sliding caches hold different blocks), with num_blocks' bounds
    names = [c[0].__name__ for c in d["key_caches"]]
    assert d["weights"] == {"a": None, "b": None} and names == ["num_blocks_0", "num_blocks_1"]
    assert all((c[0].min, c[0].max) == (2, 1 << 20) for c in d["key_caches"])
    assert (
        d["conv_states"] == [None] * 3
        and d["expert_load"] == [None] * 2
        and d["block_tables"] == {1: "batch"}
        and d["cu_seqlens_q"] == {0: "batch+1"}
    )


def test_a_contract_names_each_argument_once():
    with pytest.raises(ValueError, match="named twice"):
        ProgramContract("bad", (Fixed("input_ids"), StepInputs), outputs=("T",))

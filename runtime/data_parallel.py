"""Data-parallel attention replicas meeting in the expert-parallel MoE: a replica's side (docs/interfaces.md
"Data-parallel attention"; the front that starts and routes to them: runtime/data_parallel_front.py).

An engine built with `--dp_size N --ep_size N` runs as N replicas, one process each (runtime/engine_child.py),
every one a whole engine of its own: its requests, scheduler, KV cache, sconv states, prefix cache, MTP depths
and sampler. They share only the routed experts: replica r holds experts r*E/N.. and a 1/N slice of the shared
experts' width, and every MoE layer of the step program gathers all replicas' rows, computes this rank's part
for all of them and reduce-scatters the sums back (builder/network.py `dp_moe`). So the replicas' step
programs run in lockstep:

- a replica steps while any replica has work, running a step of padding alone when it has none
  (`ModelRunner.idle_step`); each `LLMEngine.step` runs the step program exactly once;
- before each step the replicas agree on its token count, the largest of theirs, and each pads its own
  batch to it: a step-graph bucket's padding, or one padding sequence (`pad_step`: no KV slot, no sconv
  state, no expert load), eager;
- the serving loop agrees every iteration on whether anyone has work or is stopping (`DataParallelGroup.agree`),
  so that the replicas stop together.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from builder.contracts import StepInputs

from .distributed import STEP_TIMEOUT, RankGroup

IDLE_POLL_S = 0.005  # a replica with nothing to do (and nobody else busy) checks for requests this often


class DataParallelGroup:
    """A replica's place among the data-parallel replicas: what keeps their step programs in lockstep."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.rank, self.size = group.rank, group.world_size

    def agree(self, *values: int) -> list[int]:
        """Each value's maximum over the replicas (every replica calls this at the same point)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group.control)
        return t.tolist()

    def leave(self) -> None:
        self.group.leave()


def join_replicas(store_addr: str, rank: int, world_size: int, config: dict) -> DataParallelGroup:
    """Replica `rank` joins the others (every replica calls this at start): process groups through the
    front's store, and the communicator the step's collectives use."""
    host, port = store_addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=STEP_TIMEOUT)
    collectives = config["plugin_config"]["impls"].get("collectives", "reference")
    return DataParallelGroup(RankGroup.join(store, rank, world_size, config["device"], collectives))


def pad_step(inputs: StepInputs, num_tokens: int) -> StepInputs:
    """A step's inputs padded to `num_tokens` rows by one more sequence that touches nothing: its rows have
    no KV slot (and so count no expert load), it has no sconv state, its block-table row is block 0 (read
    only, and its length num_tokens - T <= max_num_tokens <= max_seq_len stays inside the row). The media
    splice's dummy row moves to the new last row + 1; the logits rows stay the real ones."""
    T = inputs.input_ids.shape[0]
    pad = num_tokens - T
    if pad < 0:
        raise ValueError(f"cannot pad a step of {T} tokens to {num_tokens}")
    if pad == 0:
        return inputs

    def cat(x: torch.Tensor, value: int, shape: tuple[int, ...], dim: int = 0) -> torch.Tensor:
        return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim)

    G, _, MB = inputs.block_tables.shape
    positions = inputs.mm_positions.clone()
    positions[-1] = num_tokens
    return dataclasses.replace(
        inputs,
        input_ids=cat(inputs.input_ids, 0, (pad,)),
        mm_positions=positions,
        cu_seqlens_q=cat(inputs.cu_seqlens_q, num_tokens, (1,)),
        seq_lens=cat(inputs.seq_lens, pad, (1,)),
        block_tables=cat(inputs.block_tables, 0, (G, 1, MB), 1),
        slot_mappings=cat(inputs.slot_mappings, -1, (G, pad), 1),
        state_indices=cat(inputs.state_indices, -1, (1,)),
        q_bound=torch.zeros(max(inputs.q_bound.shape[0], pad), dtype=inputs.q_bound.dtype),
    )

"""ModelRunner: the engine's programs over the caches: builds a step's inputs from the scheduled
sequences, runs the step program, saves and restores sconv states, rolls sequences back.

It owns every device tensor: the KV pool (one tensor per pool slot, docs/interfaces.md), the sconv
states (one slot per running sequence) and the sconv snapshots of prefix-cache restore points. Its
Drafter (runtime/drafter.py) runs the MTP heads' rounds over the heads' caches and states.
Under tensor parallelism each rank has a ModelRunner over its own slices; rank 0's broadcasts each call
that changes them to the others (`workers`, runtime/distributed.py), which make the same call.
"""

from __future__ import annotations

import dataclasses
import gc
import logging

import numpy as np
import torch
import torch.distributed as dist

import plugins  # noqa: F401  (the programs call torch.ops.inkling.*)
from builder.contracts import STEP, StepInputs
from builder.engine import Engine
from builder.network import depth_weights
from builder.tensor_parallel import DRAFT_UNEMBED

from .block_manager import FREED, fit_pools, kind_pools, pool_peaks
from .data_parallel import DataParallelGroup, pad_step
from .device_state import MAX_SNAPSHOTS, DeviceState, layout_k1, layout_rows
from .device_tables import DeviceTables
from .distributed import Workers
from .drafter import Drafter, Heads, HeadWork
from .program_inputs import add_media, cu_seqlens, media_splice, slot_mapping
from .programs import DepthPrograms, Programs, encode_media
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .step_graphs import (
    HEAD_ARGS,
    HEAD_PICK_ARGS,
    STEP_ARGS,
    StepGraphs,
    batch_buckets,
    catchup_token_buckets,
    program_max_batch,
    q_buckets,
    to_device,
    token_buckets,
)

log = logging.getLogger("runtime.model_runner")


UNEMBED = "model.llm.unembed.weight"


def fed_tokens(seq: Sequence, drafts: list[int], start: int, n: int) -> list[int]:
    """(seq.tokens + drafts)[start : start + n], copying only those tokens."""
    K = len(seq)
    if start + n <= K:
        return seq.token_range(start, start + n)
    return seq.token_range(min(start, K), K) + drafts[max(0, start - K) : start + n - K]


# The ops a graph may hold once they run their Triton kernels (no host sync): impl "triton", or bank_attention's
# "gluon" (the same launcher, some launches in Gluon)
GRAPH_OPS = ("bank_attention", "sconv", "sigmoid_sink_moe")
GRAPH_IMPLS = ("triton", "gluon")


def check_device_impls(impls: dict, device: torch.device) -> None:
    """An engine whose attention was built for Hopper's Gluon launches runs on a Hopper GPU: elsewhere they
    cannot launch, so loading it says to rebuild rather than failing at the first prefill."""
    if impls.get("bank_attention") != "gluon":
        return
    from plugins.attention.launcher import gluon_device_misfit

    why = gluon_device_misfit(device)
    if why is not None:
        raise ValueError(
            f"this engine's attention runs Gluon's Hopper launches (built on an sm_90 GPU), which {why}: rebuild "
            "the engine here (or with --attention_plugin triton)"
        )


def default_cuda_graphs(device: torch.device, impls: dict, tp_size: int) -> bool:
    """Whether decode/verify steps replay CUDA graphs when the caller does not say: on for a one-rank
    CUDA engine with the Triton plugins (H200: 1.2 ms against 16 ms per step eager, tiny engine, batch 1;
    outputs equal to eager, tests/gpu/test_engine_gpu.py). Tensor-parallel ranks opt in (LLM(cuda_graphs=True))
    until that path has run on GPUs."""
    ops = [op for op in GRAPH_OPS if op in impls]
    return (
        device.type == "cuda" and tp_size == 1 and bool(ops) and all(impls[op] in GRAPH_IMPLS for op in ops)
    )


# Of a GPU's memory, what the KV-cache sizing leaves to a step's activations (a prefill chunk of
# max_num_tokens through the dense MLP, the MoE's routed rows, the MTP depths' passes, the logits) and to
# the CUDA graphs' pools: inkling-bench with 3 depths at 2,048-token chunks ran out with 1.7 GB on an H100.
ACTIVATION_RESERVE = 0.08


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """The distinct slots as runs [a, b) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs


class ModelRunner:
    """The engine's programs, weights and device state (runtime/device_state.py) on one device, stepped
    from the scheduler's batches."""

    def __init__(
        self,
        engine: Engine,
        num_blocks: int | None = None,
        device: str | None = None,
        workers: Workers | None = None,
        cuda_graphs: bool | None = None,
        pad_eager: bool = False,
        compile: bool | None = None,
        dp: DataParallelGroup | None = None,
    ):
        """workers: on rank 0 of a tensor-parallel engine, the other ranks (they mirror its calls).
        dp: a replica of a data-parallel engine (runtime/data_parallel.py): its steps are padded to the
        replicas' common token count (`_dp_execute`).
        cuda_graphs: replay decode/verify steps and MTP head passes from CUDA graphs per (batch, tokens)
        bucket (runtime/step_graphs.py); None: default_cuda_graphs decides. pad_eager (tests): pad them to
        the buckets but run eager. compile: torch.compile the programs (None: as the engine was built)."""
        if engine.world_size > 1 and engine.rank == 0 and workers is None and dp is None:
            raise ValueError(
                f"this engine runs on {engine.world_size} ranks: run it with LLM(engine_dir), "
                "which starts its ranks"
            )
        self.engine = engine
        self.config = c = engine.model_config
        self.build = bc = engine.build_config
        self.layout = engine.config["cache_layout"]
        self.device = torch.device(device or engine.device)
        self.dtype = getattr(torch, engine.config["dtype"])
        check_device_impls(engine.config["plugin_config"]["impls"], self.device)
        self.workers = workers
        self.dp, self.dp_steps = dp, 0  # dp_steps: step programs run in lockstep with the other replicas
        self.block_size = bc.tokens_per_block
        self.K1 = c.sconv_kernel_size - 1
        self.state_rows = self.K1 + bc.max_draft_len
        self.num_groups = len(self.layout["group_windows"])
        # By default, room for max_batch_size sequences at max_seq_len at once: a full group's whole table, a
        # sliding group only its window, the drafts' margin and one prefill chunk (BlockManager.peak_blocks),
        # not a whole table per group (at 1M tokens and 2,048-token chunks: 162 blocks, not 65,536).
        chunk = max(self.block_size, bc.max_num_tokens // self.block_size * self.block_size)  # Scheduler's
        windows = self.layout["group_windows"]
        # The groups draw from a pool per attention kind (runtime/block_manager.py "Pools"), and each
        # kind's caches, the MTP depths' with group 0's, hold their pool's blocks alone. A num_blocks given
        # by the caller is one pool that the kinds share, as sized.
        pooled = not num_blocks
        self.group_pools = kind_pools(windows) if pooled else [0] * len(windows)
        per_pool = pool_peaks(
            windows, self.group_pools, self.block_size, bc.max_draft_len, bc.max_seq_len, chunk
        )
        self.pool_sizes = (
            [bc.max_batch_size * n for n in per_pool]
            if pooled
            else [num_blocks or bc.max_batch_size * per_pool[0]]
        )
        self.num_blocks = sum(self.pool_sizes)
        # Sorted: torch.compile's graph takes the weights in the dict's order, and its compiler cache keys
        # on that order, so the build (weights in memory) and a load (safetensors' order) must agree.
        weights = {k: engine.weights[k].to(self.device) for k in sorted(engine.weights)}
        self.weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        # Drafts never exceed max_draft_len (LLMEngine), so heads past it would hold KV nobody reads: at
        # inkling-bench's batch 64 each head's KV is 13.5 GiB, and all 8 did not fit beside the weights.
        has_heads = any(name.startswith("mtp_head") for name in engine.programs)
        self.num_heads = min(c.num_mtp_heads, bc.max_draft_len) if has_heads else 0
        # Drafts a step may verify on every rank, the ranks without depths too: the step graphs' buckets
        # must be the same on every rank, or their collectives would not meet
        self.step_drafts = bc.max_draft_len if (self.num_heads or self.layout.get("mtp_kv_heads")) else 0
        # A rank without the depths (a worker of a multi-rank real Inkling) holds no state for them
        depth_keys = ("mtp_kv_heads", "mtp_head_dims", "mtp_conv_channels")
        self.layout = {k: v[: self.num_heads] if k in depth_keys else v for k, v in self.layout.items()}
        self.head_weights = [depth_weights(weights, d) for d in range(self.num_heads)]
        # The draft pick's unembedding: the whole one (a tensor-parallel rank 0 keeps it beside its
        # vocabulary slice: builder/tensor_parallel.py).
        self.lm_head = weights.get(DRAFT_UNEMBED, self.weights[UNEMBED])
        programs = Programs.load(engine, self.device, self.dtype, bool(self.num_heads), compile)
        self.step, self.head, self.vision, self.audio = (
            programs.step,
            programs.head,
            programs.vision,
            programs.audio,
        )
        self.compiled = programs.compiled
        # one program per attention kind, picked by the depth's weights
        self.head = (
            DepthPrograms(self.head, self.head_weights, list(c.mtp.layer_types[: self.num_heads]))
            if self.num_heads
            else None
        )
        if pooled and self.device.type == "cuda":
            self._fit_pools_to_memory(per_pool)
        self.state = DeviceState.allocate(
            self.layout, bc, self.num_blocks, self.device, self.dtype,
            cache_blocks=self._cache_blocks(), head_blocks=self.pool_sizes[0],
        )  # fmt: skip
        st = self.state
        self.key_caches, self.value_caches, self.conv_states = st.key_caches, st.value_caches, st.conv_states
        self.head_key_caches, self.head_value_caches = st.head_key_caches, st.head_value_caches
        self.head_conv_states, self.snapshots = st.head_conv_states, st.snapshots
        self.expert_load = st.expert_load
        self.num_snapshots = st.num_snapshots
        self.num_real_tokens = engine_vocab(engine)
        self._shift_cache: dict[tuple[int, int, int, int], tuple[list, list]] = {}  # see _shift_views
        # Rollbacks not yet applied (rollback(defer=True)): the slots to shift by (head, n), and the
        # (head, slot) pairs among them. Every method that reads or writes sconv states applies them first.
        self._pending: dict[tuple[int, int], list[int]] = {}
        self._pending_keys: set[tuple[int, int]] = set()
        # The media splice's dummy row of every step and head pass (no program writes it).
        self.splice_row = torch.zeros(1, c.hidden_size, dtype=self.dtype, device=self.device)
        heads = Heads(
            self.head, self.head_weights, self.lm_head, st, self.num_real_tokens, self.splice_row,
            mup=c.text.logits_mup_width_multiplier,
        )  # fmt: skip
        # A one-rank engine keeps its block tables on the device (runtime/device_tables.py); the ranks of a
        # tensor-parallel one take rank 0's host tables with each step.
        self.tables = (
            DeviceTables(self.num_groups, bc.max_batch_size, bc.max_blocks_per_seq, self.device)
            if engine.world_size == 1 or dp is not None
            else None
        )
        self.drafter = Drafter(heads, c, bc, engine.config, self.tables)
        self._init_graphs(cuda_graphs, pad_eager)

    # The heads' graphs are the drafter's (it replays them); here for the runner's readers.
    head_graphs = property(lambda self: self.drafter.head_graphs)
    draft_graphs = property(lambda self: self.drafter.draft_graphs)
    catchup_graphs = property(lambda self: self.drafter.catchup_graphs)

    @head_graphs.setter
    def head_graphs(self, graphs: StepGraphs | None) -> None:
        self.drafter.head_graphs = graphs

    @draft_graphs.setter
    def draft_graphs(self, graphs: StepGraphs | None) -> None:
        self.drafter.draft_graphs = graphs

    @catchup_graphs.setter
    def catchup_graphs(self, graphs: StepGraphs | None) -> None:
        self.drafter.catchup_graphs = graphs

    def _init_graphs(self, cuda_graphs: bool | None, pad_eager: bool) -> None:
        """The step and head passes' CUDA graphs (or, pad_eager, their buckets run eager), every bucket a
        call can reach captured now: a request that opens a bucket never waits for a capture."""
        self.step_graphs = self.head_graphs = self.draft_graphs = self.catchup_graphs = None
        impls = self.engine.config["plugin_config"]["impls"]
        if cuda_graphs is None:
            cuda_graphs = not pad_eager and default_cuda_graphs(self.device, impls, self.engine.world_size)
        if not (cuda_graphs or pad_eager):
            return
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError(f"cuda_graphs needs a CUDA engine, this one runs on {self.device}")
            # the references sync (.tolist())
            if any(impls[op] not in GRAPH_IMPLS for op in GRAPH_OPS if op in impls):
                raise ValueError(f"cuda_graphs needs the Triton plugins, the engine has {impls}")
        bc = self.build
        q = 1 + self.step_drafts  # tokens a sequence feeds: 1 + its drafts
        # T_g <= max_seq_len: the padding sequence's reads (positions < T_g - T) stay in its block-table row.
        tokens = token_buckets(bc.max_batch_size, q, min(bc.max_num_tokens, bc.max_seq_len))
        qs = q_buckets(q)
        kw = dict(use_graphs=cuda_graphs, pad_eager=pad_eager)
        pool = torch.cuda.graph_pool_handle() if cuda_graphs else None  # one pool: one graph runs at a time

        def graphs(name: str, program, spec, tokens=tokens, qs=qs) -> StepGraphs:
            batch = batch_buckets(bc.max_batch_size, program_max_batch(self.engine.programs[name]))
            return StepGraphs(program, spec, self.device, batch, tokens, qs, pool=pool, **kw)

        self.step_graphs = graphs("step", self.step, STEP_ARGS)
        made = self.step_graphs.capture(
            lambda _: self._step_args(self._idle_inputs()), max_num_seqs=bc.max_batch_size
        )
        if self.head is not None:
            name = next(n for n in self.engine.programs if n.startswith("mtp_head"))
            self.head_graphs = graphs(name, self.head, HEAD_ARGS)
            self.draft_graphs = graphs(name, self.drafter.head_and_pick, HEAD_PICK_ARGS)
            heads = tuple(range(1, self.num_heads + 1))
            made += self.head_graphs.capture(self.drafter.template_args, heads, bc.max_batch_size)
            made += self.draft_graphs.capture(
                lambda m: self.drafter.template_args(m, drafting=True), heads, bc.max_batch_size
            )
            # the catch-up passes of heads left behind (Drafter._passes): up to catchup_q positions a sequence
            d = self.drafter
            catchup = catchup_token_buckets(d.catchup_q, d.catchup_tokens)
            self.catchup_graphs = graphs(name, self.head, HEAD_ARGS, catchup, (d.catchup_q,))
            made += self.catchup_graphs.capture(d.template_args, heads, bc.max_batch_size)
        seconds = sum(g.stats.capture_seconds for g in self._all_graphs() if g)
        log.info("%s %d buckets in %.1f s", "captured" if cuda_graphs else "made", made, seconds)

    def _idle_inputs(self) -> StepInputs:
        """A step's inputs of one sequence of one token that touches nothing (no KV write, no state): the
        dtypes and devices a real step's have, for the graphs' capture."""
        G, mb = self.num_groups, self.build.max_blocks_per_seq
        return StepInputs(
            input_ids=torch.zeros(1, dtype=torch.long),
            mm_embeds=self.splice_row,
            mm_positions=torch.tensor([1]),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.ones(1, dtype=torch.int32),
            block_tables=torch.zeros(G, 1, mb, dtype=torch.int32),
            slot_mappings=torch.full((G, 1), -1, dtype=torch.long),
            state_indices=torch.full((1,), -1, dtype=torch.int32),
            logits_indices=torch.zeros(1, dtype=torch.long),
            q_bound=torch.zeros(1, dtype=torch.int8),
        )

    def drop_graphs(self) -> None:
        """Destroy the captured graphs, before this rank leaves its process groups: on 2xH200 both ranks of
        tp 2 then waited forever in destroy_process_group while graphs that had captured NCCL collectives
        were alive."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_graphs = self.head_graphs = self.draft_graphs = self.catchup_graphs = None
        gc.collect()

    def read_expert_load(self) -> np.ndarray:
        """The step's expert load counters since the last read, int64 [MoE layers, E] (runtime/expert_load.py),
        and zeroed: one copy to the host, which waits for the steps in flight."""
        if not self.expert_load:
            return np.zeros((0, 0), dtype=np.int64)
        counts = torch.stack(self.expert_load).cpu().numpy().astype(np.int64)
        torch._foreach_zero_(self.expert_load)
        return counts

    def _all_graphs(self) -> tuple[StepGraphs | None, ...]:
        return self.step_graphs, self.head_graphs, self.draft_graphs, self.catchup_graphs

    def graph_stats(self) -> dict[str, int]:
        """Calls of the step and head programs that ran from a bucket (graphed) or eager, and captures (at
        start-up, and those a call waited for: a bucket start-up did not make)."""
        out: dict[str, int] = {}
        for name, g in zip(("step", "head", "head", "head"), self._all_graphs()):
            if g is not None:  # the head passes (with a draft pick, without, catching up) count together
                for kind, n in (
                    ("graphed", g.stats.graphed),
                    ("eager", g.stats.eager),
                    ("captures", g.stats.captures),
                    ("captures_while_serving", g.stats.captures_while_serving),
                ):
                    out[f"{name}_{kind}"] = out.get(f"{name}_{kind}", 0) + n
        return out

    # Media.
    @torch.no_grad()
    def encode_media(self, pixel_values: list[torch.Tensor], levels: list[torch.Tensor]) -> torch.Tensor:
        """The real Inkling's media embeddings, images' then audio clips', in prompt order: [M, H]."""
        return encode_media(
            self.vision, self.audio, pixel_values, levels, self.device, self.dtype, self.config.hidden_size
        )

    def _mirror(self, method: str, *args) -> None:
        """Rank 0 of a tensor-parallel engine: have every other rank make the same call first."""
        if self.workers is not None:
            self.workers.call(method, *args)

    # A step.
    @torch.no_grad()
    def run(
        self, batch: list[ScheduledSeq], input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Feed each scheduled sequence's new tokens (MTP drafts included), or `input_ids` (on the
        device: the picks of a step still running, see LLMEngine.step). Returns float32 logits of
        each sequence's last 1 + num_drafts rows (sequence b's are rows[b]..rows[b+1]-1), the row
        offsets, and the last hidden states h^0 of every token fed [T, H]."""
        inputs = self.step_inputs(batch, input_ids)
        # Decode/verify steps (each sequence feeds one token and its drafts) replay a graph, on every rank
        # alike: the bucket depends on shapes only, so the ranks' collectives meet with the same shapes.
        graphed = all(s.num_tokens == 1 + s.num_drafts for s in batch)
        if self.workers is not None:
            self._mirror_step(inputs, graphed, broadcast_ids=input_ids is not None)
        if self.dp is not None:
            logits, hidden = self._dp_execute(inputs, graphed)
        else:
            logits, hidden = self.execute(inputs, graphed)
        rows = [0]
        for s in batch:
            rows.append(rows[-1] + 1 + s.num_drafts)
        return logits, rows, hidden

    def _dp_execute(self, inputs: StepInputs, graphed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A data-parallel replica's step: the replicas agree on its token count (the largest of the counts
        each would run: its bucket's where it has one, its own otherwise; every replica calls this once a
        step, `run` or `idle_step`), then it replays a bucket of exactly that many tokens where one was
        captured and holds its batch, or pads its batch to it (`pad_step`) and runs eager. Never a capture
        here: a capture's warm-up runs would meet no other replica's."""
        g = self.step_graphs if graphed else None
        args = self._step_args(inputs) if g is not None else None
        own = g.bucket(args) if g is not None else None
        (num_tokens,) = self.dp.agree(own[1] if own else inputs.input_ids.shape[0])
        self.dp_steps += 1
        if g is not None:
            bucket = g.bucket(args, num_tokens)
            if bucket is not None and (None, *bucket) in g.buckets:
                self._apply_shifts()
                return g(args, padded_tokens=num_tokens)
        return self.execute(pad_step(inputs, num_tokens))

    @torch.no_grad()
    def idle_step(self) -> None:
        """A data-parallel replica without work this step: a step of padding alone (one inert token, padded
        to the replicas' count), so that the others' MoE collectives meet it."""
        self._dp_execute(self._idle_inputs(), graphed=True)

    def _mirror_step(self, inputs: StepInputs, graphed: bool, broadcast_ids: bool) -> None:
        """Rank 0 of a tensor-parallel engine: have every other rank run this step. Nothing here waits
        for the device: a step without media sends a host zero row for the media splice, and an
        overlapped step's input ids (picks still on the device) follow by a broadcast that the devices
        order (`execute_broadcast`)."""
        remote = inputs
        if inputs.mm_positions.numel() == 1:  # only the splice's dummy row
            dummy = torch.zeros(1, inputs.mm_embeds.shape[1], dtype=inputs.mm_embeds.dtype)
            remote = dataclasses.replace(remote, mm_embeds=dummy)
        if broadcast_ids:
            remote = dataclasses.replace(
                remote, input_ids=torch.zeros(inputs.input_ids.shape, dtype=torch.long)
            )
            self.workers.call("execute_broadcast", remote, graphed)
            dist.broadcast(inputs.input_ids, src=0)
        else:
            self.workers.call("execute", remote, graphed)

    @torch.no_grad()
    def execute_broadcast(self, inputs: StepInputs, graphed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A worker's side of an overlapped step: its input ids come from rank 0 by broadcast (`inputs`
        holds a placeholder of their shape)."""
        ids = torch.empty(inputs.input_ids.shape, dtype=torch.long, device=self.device)
        dist.broadcast(ids, src=0)
        return self.execute(dataclasses.replace(inputs, input_ids=ids), graphed)

    @torch.no_grad()
    def execute(self, inputs: StepInputs, graphed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The step program over this rank's weights, caches and states; with graphed, from the step
        graphs where they are on (ragged inputs stay on the host until copied into a bucket)."""
        self._apply_shifts()  # deferred rollbacks, before the step reads the states
        if graphed and self.step_graphs is not None:
            args = self._step_args(inputs)
            if self.step_graphs.bucket(args) is not None:
                return self.step_graphs(args)
        if self.step_graphs is not None:
            self.step_graphs.stats.eager += 1
        on_device = StepInputs(*inputs.to(self.device))
        return self.step(*self._step_args(on_device))

    def _step_args(self, inputs: StepInputs) -> list:
        return STEP.arguments(
            inputs, weights=self.weights, key_caches=self.key_caches, value_caches=self.value_caches,
            conv_states=self.conv_states, expert_load=self.expert_load,
        )  # fmt: skip

    def _fit_pools_to_memory(self, one_seq: list[int]) -> None:
        """Shrink the pools to kv_cache_free_gpu_memory_fraction of the memory free once the weights and
        programs are in place and ACTIVATION_RESERVE of the GPU is set aside for the steps' activations and
        the CUDA graphs, less the sconv states (block_manager.fit_pools)."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        left = free - int(ACTIVATION_RESERVE * total)
        budget = int(left * self.build.kv_cache_free_gpu_memory_fraction) - self._state_bytes()
        self.pool_sizes = fit_pools(self.pool_sizes, one_seq, self._pool_block_bytes(), budget)
        self.num_blocks = sum(self.pool_sizes)

    def _pool_block_bytes(self) -> list[int]:
        """What one block of each pool costs: K and V in every cache of its kind (`_cache_blocks`), and
        pool 0's in every built MTP depth too (they index group 0's blocks)."""
        lay, item = self.layout, self.dtype.itemsize

        def per_token(heads: list[int], dims: list[int]) -> int:
            return sum(2 * h * d * item for h, d in zip(heads, dims))

        g = len(lay["cache_kv_heads"]) // 2
        kinds = {
            False: per_token(lay["cache_kv_heads"][:g], lay["cache_head_dims"][:g]),
            True: per_token(lay["cache_kv_heads"][g:], lay["cache_head_dims"][g:]),
        }
        out = [0] * len(self.pool_sizes)
        for sliding, p in {bool(w): p for w, p in zip(lay["group_windows"], self.group_pools)}.items():
            out[p] += kinds[sliding]
        out[0] += per_token(lay["mtp_kv_heads"], lay["mtp_head_dims"])
        return [self.block_size * n for n in out]

    def _state_bytes(self) -> int:
        """The float32 sconv states, the MTP depths' and the prefix cache's snapshots (allocate_published)."""
        lay, bc = self.layout, self.build
        rows = bc.max_batch_size * layout_rows(lay, bc) * 4
        channels = sum(lay["conv_channels"])
        heads = sum(sum(sites) for sites in lay["mtp_conv_channels"])
        return rows * (channels + heads) + MAX_SNAPSHOTS * layout_k1(lay) * channels * 4

    def _cache_blocks(self) -> list[int]:
        """The real Inkling's caches' blocks: each kind's pool (`key_caches` lists pool_size full caches,
        then pool_size sliding ones); a kind without layers keeps the two blocks the programs' shapes
        need."""
        windows = self.layout["group_windows"]
        of_kind = {bool(w): self.pool_sizes[p] for w, p in zip(windows, self.group_pools)}
        g = len(self.layout["cache_kv_heads"]) // 2
        return [max(2, of_kind.get(False, 0))] * g + [max(2, of_kind.get(True, 0))] * g

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device, copied from pinned memory (step_graphs.to_device)."""
        return to_device(x, self.device)

    def step_inputs(self, batch: list[ScheduledSeq], input_ids: torch.Tensor | None = None) -> StepInputs:
        """The batch's tokens (or `input_ids`), media, block tables, slot mappings and state slots (host
        tensors built with NumPy, but media embeddings, input_ids and device-resident block tables stay
        where they are)."""
        bs, G, B = self.block_size, self.num_groups, len(batch)
        q_lens = np.array([s.num_tokens for s in batch], dtype=np.int64)
        cu = cu_seqlens(q_lens)
        T = int(cu[-1])
        if self.tables is not None:
            block_tables = self.tables.gather([(s.seq.slot, s.seq.blocks) for s in batch])
        else:
            tables = np.full((G, B, self.build.max_blocks_per_seq), FREED, dtype=np.int32)
            block_tables = torch.from_numpy(tables)
        slots = np.full((G, T), -1, dtype=np.int64)
        ids = np.empty(T if input_ids is None else 0, dtype=np.int64)
        mm_rows, mm_pos = [], []
        for b, s in enumerate(batch):
            seq, lo, hi = s.seq, int(cu[b]), int(cu[b + 1])
            pos = np.arange(s.start, s.start + s.num_tokens)
            for g in range(G):
                table = seq.blocks.row(g)
                if self.tables is None:
                    tables[g, b, : len(table)] = table
                slots[g, lo:hi] = slot_mapping(table, pos, bs)
            if input_ids is None:
                ids[lo:hi] = fed_tokens(seq, seq.drafts[: s.num_drafts], s.start, s.num_tokens)
            add_media(seq, s.start, s.start + s.num_tokens, lo, mm_rows, mm_pos)
        mm_embeds, mm_positions = media_splice(mm_rows, mm_pos, self.splice_row, T)
        # Each sequence's last 1 + num_drafts rows.
        logits_idx = np.concatenate(
            [np.arange(int(c) - 1 - s.num_drafts, int(c)) for c, s in zip(cu[1:], batch)]
        )
        return StepInputs(
            input_ids=torch.from_numpy(ids) if input_ids is None else input_ids,
            mm_embeds=mm_embeds,
            mm_positions=mm_positions,
            cu_seqlens_q=torch.from_numpy(cu),
            seq_lens=torch.tensor([s.start + s.num_tokens for s in batch], dtype=torch.int32),
            block_tables=block_tables,
            slot_mappings=torch.from_numpy(slots),
            state_indices=torch.tensor([s.seq.slot for s in batch], dtype=torch.int32),
            logits_indices=torch.from_numpy(logits_idx),
            q_bound=torch.zeros(int(q_lens.max()), dtype=torch.int8),
        )

    # Sconv states.
    def reset_slot(self, slot: int) -> None:
        self._mirror("reset_slot", slot)
        self._apply_shifts()
        self.state.reset_slot(slot)

    def save_snapshot(self, slot: int, snapshot: int, back: int) -> None:
        """Keep the sconv inputs before position (computed - back) of the sequence in `slot`."""
        end = self.state_rows - back
        if end < self.K1:
            raise ValueError(f"sconv history holds {self.state_rows} rows, cannot go {back} back")
        self._mirror("save_snapshot", slot, snapshot, back)
        self._apply_shifts()
        for state, snap in zip(self.conv_states, self.snapshots):
            snap[snapshot] = state[slot, end - self.K1 : end]

    def restore_snapshot(self, slot: int, snapshot: int) -> None:
        self._mirror("restore_snapshot", slot, snapshot)
        self._apply_shifts()
        for state, snap in zip(self.conv_states, self.snapshots):
            state[slot].zero_()
            state[slot, self.state_rows - self.K1 :] = snap[snapshot]

    def rollback(self, slot: int, n: int, defer: bool = False) -> None:
        """Forget the last n sconv inputs of a sequence's main model (docs/interfaces.md "Sconv state").
        defer: apply it with the other deferred rollbacks (`flush_rollbacks`, or before the states are next
        used), so that a step's rollbacks cost two multi-tensor launches in all, not two a sequence."""
        if not 0 <= n <= self.build.max_draft_len:
            raise ValueError(f"can roll back 0..{self.build.max_draft_len} tokens, not {n}")
        if n:
            self._mirror("rollback", slot, n, defer)
            self._shift(slot, [(0, n)], defer)

    def rollback_heads(self, slot: int, counts: list[int], defer: bool = False) -> None:
        """Forget the last counts[m-1] sconv inputs of MTP head m of a sequence, every head in one go."""
        if any(not 0 <= n <= self.build.max_draft_len for n in counts):
            raise ValueError(f"can roll back 0..{self.build.max_draft_len} tokens, not {counts}")
        if not self.num_heads:  # rank 0 alone holds the depths (none on the workers of a multi-rank engine)
            return
        self._shift(slot, [(m, n) for m, n in enumerate(counts, 1) if n], defer)

    def _shift(self, slot: int, counts: list[tuple[int, int]], defer: bool) -> None:
        """Shift the sequence's sconv rows of each (head, n) in `counts` (head 0: the main model) by n."""
        keys = [(head, slot) for head, _ in counts]
        if self._pending_keys.intersection(keys):  # rows already shifting: the second shift reads the first's
            self._apply_shifts()
        for head, n in counts:
            self._pending.setdefault((head, n), []).append(slot)
        self._pending_keys.update(keys)
        if not defer:
            self._apply_shifts()

    def flush_rollbacks(self) -> None:
        """Apply the deferred rollbacks (on every rank)."""
        if self._pending_keys:
            self._mirror("flush_rollbacks")
            self._apply_shifts()

    def _apply_shifts(self) -> None:
        """dst = src for every pending shift: the slots of one (head, n) taken as runs of consecutive slots,
        each run one pair of views a state, all of them in two multi-tensor (foreach) operations. A batch
        whose sequences all roll back then moves each state's rows once, not once a sequence (at batch 32
        on inkling-bench, 36 views, not 1,152)."""
        if not self._pending_keys:
            return
        srcs, dsts = [], []
        for (head, n), slots in self._pending.items():
            for a, b in slot_runs(slots):
                src, dst = self._shift_views(head, a, b, n)
                srcs += src
                dsts += dst
        torch._foreach_copy_(dsts, torch._foreach_add(srcs, 0))  # through copies: the rows overlap
        self._pending, self._pending_keys = {}, set()

    def _shift_views(
        self, head: int, a: int, b: int, n: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The rows state[a:b, :-n] and state[a:b, n:] of every sconv state of the main model (head 0) or of
        MTP head `head` (one slot: state[a, :-n], a contiguous view, which keeps the foreach operations on
        their fused path), made once per (head, a, b, n) while the cache stays small."""
        key = (head, a, b, n)
        if key not in self._shift_cache:
            if len(self._shift_cache) >= 4096:
                self._shift_cache.clear()
            states = self.conv_states if head == 0 else self.head_conv_states[head - 1]
            rows = a if b == a + 1 else slice(a, b)
            self._shift_cache[key] = ([s[rows, :-n] for s in states], [s[rows, n:] for s in states])
        return self._shift_cache[key]

    def memory_reports(self) -> list[dict]:
        """`memory_report()` of every rank, rank 0 first."""
        own = self.memory_report()
        return [own] if self.workers is None else self.workers.gather("memory_report", own=own)

    def memory_report(self) -> dict:
        """What this rank holds: weights, KV cache and sconv states (their channels per site, in the step's
        order), and the MTP heads'."""

        def nbytes(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        heads = [
            *self.head_key_caches,
            *self.head_value_caches,
            *(t for s in self.head_conv_states for t in s),
        ]
        return {
            "rank": self.engine.rank,
            "weight_bytes": nbytes(self.weights.values())
            + nbytes(t for w in self.head_weights for t in w.values())
            + (0 if self.lm_head is self.weights[UNEMBED] else nbytes([self.lm_head])),
            "kv_cache_shape": list(self.key_caches[0].shape),
            "kv_cache_bytes": nbytes(self.key_caches) + nbytes(self.value_caches),
            "conv_state_channels": [t.shape[-1] for t in self.conv_states],
            "conv_state_bytes": nbytes(self.conv_states),
            "num_mtp_heads": self.num_heads,
            "head_state_bytes": nbytes(heads),
        }

    # MTP heads.
    def run_heads(self, work: list[HeadWork]) -> list[list[int]]:
        """A round of the MTP heads over `work` (runtime/drafter.py): each work item's drafts. Under tensor
        or expert parallelism rank 0 holds the (dense) depths whole and drafts alone."""
        self._apply_shifts()
        return self.drafter.run(work)


def engine_vocab(engine: Engine) -> int:
    """Tokens the engine can emit: the unpadded vocabulary, whose columns alone the logits have."""
    return engine.model_config.text.num_real_tokens

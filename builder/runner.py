"""A minimal engine runner: prefill and greedy decode for a batch of prompts.

Enough to test engines against the reference model until the runtime (cache manager, scheduler,
sampling) lands: each sequence gets enough blocks for its whole length in every layer group, and a
sequence's state slot is its index in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import plugins  # noqa: F401  (the programs call torch.ops.inkling.*)
from inkling.processing import image_patches

from .encoder_graphs import GraphedEncoder
from .engine import Engine
from .sharding import DRAFT_LM_HEAD, TensorParallel


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [T] int64
    images: list[torch.Tensor] = field(default_factory=list)  # pixels [Hpx, Wpx, 3]
    audios: list[torch.Tensor] = field(default_factory=list)  # dMel levels [num_mels, F]


def on_device(program: torch.export.ExportedProgram, device: torch.device) -> torch.export.ExportedProgram:
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


class EngineRunner:
    """The engine's programs, weights and caches on a device; the runtime's ModelRunner extends it."""

    def __init__(
        self,
        engine: Engine,
        num_blocks: int | None = None,
        device: str | None = None,
        compile: bool | None = None,
    ):
        """compile: torch.compile the step program (default: when the engine was built with compile),
        seeded with the compiler cache artifacts the build saved."""
        self.engine = engine
        self.config = c = engine.model_config
        self.build = engine.build_config
        self.layout = engine.config["cache_layout"]
        self.device = torch.device(device or engine.device)
        self.dtype = getattr(torch, engine.config["dtype"])
        # Sorted: torch.compile's graph takes the weights in the dict's order, and its compiler cache keys
        # on that order, so the build (weights in memory) and a load (safetensors' order) must agree.
        weights = {k: engine.weights[k].to(self.device) for k in sorted(engine.weights)}
        self.weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        self.step = on_device(engine.programs["step"], self.device).module()
        self.compiled = engine.build_config.compile if compile is None else compile
        if self.compiled:
            if engine.compile_cache is not None:
                torch.compiler.load_cache_artifacts(engine.compile_cache)
            self.step = torch.compile(self.step, dynamic=True)
        self.vision, self.audio = (
            GraphedEncoder(
                on_device(engine.programs[k], self.device).module(),
                k,
                self.device,
                self.dtype,
                engine_config=engine.config,
            )
            if k in engine.programs
            else None  # a tensor-parallel worker: rank 0 encodes media
            for k in ("vision", "audio")
        )
        self.tp = TensorParallel(c, engine.tp_size)
        self.num_groups = len(self.layout["group_windows"])
        self.num_blocks = (
            num_blocks or self.num_groups * self.build.max_batch_size * self.build.max_blocks_per_seq
        )
        kv_shape = (self.num_blocks, self.build.tokens_per_block, self.tp.num_kv_heads, c.head_dim)
        pool = self.layout["pool_size"]
        self.key_caches = [torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in range(pool)]
        self.value_caches = [torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in range(pool)]
        self.state_rows = c.sconv_kernel_size - 1 + self.build.max_draft_len
        self.conv_states = [
            torch.zeros(self.build.max_batch_size, self.state_rows, C, dtype=self.dtype, device=self.device)
            for C in self.conv_channels()
        ]
        self._init_heads(weights)

    def _init_heads(self, weights: dict[str, torch.Tensor]) -> None:
        """The MTP head program, each head's weights, and its own KV (sharing the block table of the
        full-attention group 0) and sconv states (sites k, v, o); docs/interfaces.md "MTP heads". Under
        tensor parallelism every rank holds its share of each head (builder/sharding.py)."""
        from .build import head_conv_channels, head_weights

        c = self.config
        kv_shape = (self.num_blocks, self.build.tokens_per_block, self.tp.num_kv_heads, c.head_dim)
        # Drafts never exceed max_draft_len (LLMEngine), so heads past it would hold KV nobody reads: at
        # inkling-bench's batch 64 each head's KV is 13.5 GiB, and all 8 did not fit beside the weights.
        has_heads = "mtp_head" in self.engine.programs
        self.num_heads = min(c.num_mtp_heads, self.build.max_draft_len) if has_heads else 0
        self.head = (
            on_device(self.engine.programs["mtp_head"], self.device).module() if self.num_heads else None
        )
        if self.head is not None and self.compiled:  # as the step: Inductor fuses the head's small ops
            self.head = torch.compile(self.head, dynamic=True)
        self.head_weights = [head_weights(weights, m) for m in range(1, self.num_heads + 1)]
        # The draft pick's lm_head: the whole one (tensor-parallel ranks keep it beside their vocabulary
        # slice, builder/sharding.py).
        self.lm_head = weights.get(DRAFT_LM_HEAD, self.weights["lm_head.weight"])
        self.head_key_caches = [
            torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in self.head_weights
        ]
        self.head_value_caches = [torch.zeros_like(t) for t in self.head_key_caches]
        self.head_conv_states = [
            [
                torch.zeros(
                    self.build.max_batch_size, self.state_rows, C, dtype=self.dtype, device=self.device
                )
                for C in head_conv_channels(c, self.tp)
            ]
            for _ in self.head_weights
        ]

    def conv_channels(self) -> list[int]:
        """Channels of each sconv state, layer by layer, sites k, v, o, m (the step program's order): the
        rank's slices under tensor parallelism."""
        return self.tp.conv_channels()

    # Media.
    def media_embeddings(self, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [M, H], positions [M]) of the prompt's image and audio pad tokens."""
        c, ids = self.config, prompt.input_ids
        rows, positions = [], []
        for kind, items, program in (
            ("image", prompt.images, self.vision),
            ("audio", prompt.audios, self.audio),
        ):
            if not items:
                continue
            pos = (ids == c.token_id(f"{kind}_pad")).nonzero().flatten()
            if kind == "image":
                items = [image_patches(x) for x in items]
            emb = torch.cat(
                [program(x.to(self.device, self.dtype if x.is_floating_point() else x.dtype)) for x in items]
            )
            if emb.shape[0] != len(pos):
                raise ValueError(f"{kind}s give {emb.shape[0]} embeddings for {len(pos)} pad tokens")
            rows.append(emb.to(self.dtype))
            positions.append(pos)
        if not rows:
            return torch.zeros(0, c.hidden_size, dtype=self.dtype, device=self.device), ids.new_zeros(0)
        return torch.cat(rows), torch.cat(positions).to(self.device)

    # Steps.
    def _blocks(self, b: int, group: int) -> int:
        """First block of sequence b in a group: every (group, sequence) owns a contiguous range."""
        return (group * self.build.max_batch_size + b) * self.build.max_blocks_per_seq

    def run_step(
        self,
        chunks: list[torch.Tensor],
        starts: list[int],
        media: list[tuple[torch.Tensor, torch.Tensor]],
        all_logits: bool = False,
        seq_ids: list[int] | None = None,
    ):
        """One step over new tokens `chunks[i]` that start at positions `starts[i]` of sequence
        `seq_ids[i]` (default i), which owns state slot seq_ids[i] and its own blocks."""
        dev, bs = self.device, self.build.tokens_per_block
        B = len(chunks)
        seq_ids = list(range(B)) if seq_ids is None else seq_ids
        q_lens = [len(x) for x in chunks]
        cu = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([s + n for s, n in zip(starts, q_lens)], dtype=torch.int32, device=dev)
        mb = self.build.max_blocks_per_seq
        block_tables = torch.stack(
            [
                torch.stack([torch.arange(mb, dtype=torch.int32) + self._blocks(s, g) for s in seq_ids])
                for g in range(self.num_groups)
            ]
        ).to(dev)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
        seq_of_token = torch.cat([torch.full((n,), b) for b, n in enumerate(q_lens)])
        slots = torch.stack(
            [
                block_tables[g].cpu()[seq_of_token, positions // bs].long() * bs + positions % bs
                for g in range(self.num_groups)
            ]
        ).to(dev)
        T = int(cu[-1])
        mm_rows, mm_pos = [], []
        offset = 0
        for b, (emb, pos) in enumerate(media):
            keep = (pos >= starts[b]) & (pos < starts[b] + q_lens[b])
            mm_rows.append(emb[keep].to(dev))
            mm_pos.append((pos[keep] - starts[b] + offset).cpu())
            offset += q_lens[b]
        mm_rows.append(torch.zeros(1, self.config.hidden_size, dtype=self.dtype, device=dev))
        mm_pos.append(torch.tensor([T]))
        logits_idx = torch.arange(T, device=dev) if all_logits else (cu[1:] - 1).long()
        return self.step(
            self.weights, torch.cat(chunks).to(dev), torch.cat(mm_rows), torch.cat(mm_pos).to(dev),
            cu, seq_lens, block_tables, slots, torch.tensor(seq_ids, dtype=torch.int32, device=dev), logits_idx,
            torch.zeros(max(q_lens), dtype=torch.int8, device=dev), self.key_caches, self.value_caches, self.conv_states,
        )  # fmt: skip

    def reset(self) -> None:
        for t in self.conv_states:
            t.zero_()
        for states in self.head_conv_states:
            for t in states:
                t.zero_()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        max_new_tokens: int,
        prefill_chunk: int | None = None,
        return_logits: bool = False,
    ):
        """Greedy decoding. Prefill in chunks of `prefill_chunk` tokens per sequence (all at once by default).
        Returns new tokens per prompt, and with return_logits the logits of every prompt position and step."""
        if len(prompts) > self.build.max_batch_size:
            raise ValueError(
                f"{len(prompts)} prompts exceed the engine's max_batch_size {self.build.max_batch_size}"
            )
        self.reset()
        real = self.engine_vocab()
        media = [self.media_embeddings(p) for p in prompts]
        lens = [len(p.input_ids) for p in prompts]
        chunk = prefill_chunk or max(lens)
        logits_seen: list[list[torch.Tensor]] = [[] for _ in prompts]
        last = [None] * len(prompts)
        for start in range(0, max(lens), chunk):
            active = [b for b in range(len(prompts)) if start < lens[b]]
            pieces = [prompts[b].input_ids[start : start + chunk] for b in active]
            logits, _ = self.run_step(
                pieces, [start] * len(active), [media[b] for b in active], all_logits=True, seq_ids=active
            )
            offset = 0
            for b, piece in zip(active, pieces):
                logits_seen[b].append(logits[offset : offset + len(piece)])
                last[b] = logits[offset + len(piece) - 1]
                offset += len(piece)
        out = [[int(last[b][:real].argmax())] for b in range(len(prompts))]
        empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        for step in range(1, max_new_tokens):
            logits, _ = self.run_step(
                [torch.tensor([o[-1]]) for o in out], [lens[b] + step - 1 for b in range(len(prompts))],
                [(torch.zeros(0, self.config.hidden_size, dtype=self.dtype), empty[1])] * len(prompts),
            )  # fmt: skip
            for b in range(len(prompts)):
                logits_seen[b].append(logits[b : b + 1])
                out[b].append(int(logits[b, :real].argmax()))
        if return_logits:
            return out, [torch.cat(x) for x in logits_seen]
        return out

    def engine_vocab(self) -> int:
        if self.engine.tokenizer_json is None:
            return self.config.vocab_size
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.engine.tokenizer_json).get_vocab_size(with_added_tokens=True)

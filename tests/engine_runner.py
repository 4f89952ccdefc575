"""A direct greedy runner over an engine's step program, for tests that compare the engine with the
reference model logit by logit: prefill (optionally in chunks) and decode of a batch of prompts, every
position's logits returned. It stands on the runtime's ModelRunner (programs, weights, device state);
each sequence gets its own contiguous blocks in every layer group and state slot = its index."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from builder.engine import Engine
from runtime.model_runner import ModelRunner, StepInputs


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [T] int64
    images: list[torch.Tensor] = field(default_factory=list)  # pixels [Hpx, Wpx, 3]
    audios: list[torch.Tensor] = field(default_factory=list)  # dMel levels [num_mels, F]


class EngineRunner:
    def __init__(self, engine: Engine, compile: bool | None = None, device: str | None = None):
        # Every (group, sequence) owns a whole table's blocks (`_first_block`): a pool of that size.
        bc = engine.build_config
        num_blocks = (
            len(engine.config["cache_layout"]["group_windows"]) * bc.max_batch_size * bc.max_blocks_per_seq
        )
        self.runner = ModelRunner(engine, num_blocks, device=device, cuda_graphs=False, compile=compile)
        self.engine, self.config, self.build = engine, engine.model_config, engine.build_config
        self.device, self.dtype = self.runner.device, self.runner.dtype

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.runner.weights

    def media_embeddings(self, prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [M, H], positions [M]) of a processed prompt's image and audio pad tokens
        (inkling.published.processing.Prompt)."""
        ids, c = prompt.input_ids, self.config
        rows = self.runner.encode_media(prompt.pixel_values, prompt.audio_levels)
        positions = torch.cat([(ids == t).nonzero().flatten() for t in (c.image_token_id, c.audio_token_id)])
        return rows, positions.to(self.device)

    def _first_block(self, b: int, group: int) -> int:
        """Every (group, sequence) owns a contiguous range of blocks."""
        return (group * self.build.max_batch_size + b) * self.build.max_blocks_per_seq

    def run_step(self, chunks, starts, media, all_logits=False, seq_ids=None):
        """One step over new tokens `chunks[i]` that start at positions `starts[i]` of sequence
        `seq_ids[i]` (default i), which owns state slot seq_ids[i] and its own blocks."""
        bs, G = self.build.tokens_per_block, self.runner.num_groups
        seq_ids = list(range(len(chunks))) if seq_ids is None else seq_ids
        q_lens = [len(x) for x in chunks]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        mb = self.build.max_blocks_per_seq
        tables = torch.stack(
            [
                torch.stack([torch.arange(mb, dtype=torch.int32) + self._first_block(s, g) for s in seq_ids])
                for g in range(G)
            ]
        )
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
        seq_of_token = torch.cat([torch.full((n,), b) for b, n in enumerate(q_lens)])
        slots = torch.stack(
            [tables[g][seq_of_token, positions // bs].long() * bs + positions % bs for g in range(G)]
        )
        T = int(cu[-1])
        mm_rows, mm_pos, offset = [], [], 0
        for b, (emb, pos) in enumerate(media):
            keep = (pos >= starts[b]) & (pos < starts[b] + q_lens[b])
            mm_rows.append(emb[keep].to(self.device))
            mm_pos.append((pos[keep] - starts[b] + offset).cpu())
            offset += q_lens[b]
        mm_rows.append(self.runner.splice_row)
        mm_pos.append(torch.tensor([T]))
        inputs = StepInputs(
            input_ids=torch.cat(chunks),
            mm_embeds=torch.cat(mm_rows),
            mm_positions=torch.cat(mm_pos),
            cu_seqlens_q=cu,
            seq_lens=torch.tensor([s + n for s, n in zip(starts, q_lens)], dtype=torch.int32),
            block_tables=tables,
            slot_mappings=slots,
            state_indices=torch.tensor(seq_ids, dtype=torch.int32),
            logits_indices=torch.arange(T) if all_logits else (cu[1:] - 1).long(),
            q_bound=torch.zeros(max(q_lens), dtype=torch.int8),
        )
        return self.runner.execute(inputs)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        max_new_tokens: int,
        prefill_chunk: int | None = None,
        return_logits=False,
    ):
        """Greedy decoding. Prefill in chunks of `prefill_chunk` tokens per sequence (all at once by default).
        Returns new tokens per prompt, and with return_logits the logits of every prompt position and step."""
        if len(prompts) > self.build.max_batch_size:
            raise ValueError(
                f"{len(prompts)} prompts exceed the engine's max_batch_size {self.build.max_batch_size}"
            )
        for b in range(len(prompts)):
            self.runner.reset_slot(b)
        real = self.runner.num_real_tokens
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
        no_media = (self.runner.splice_row[:0], torch.zeros(0, dtype=torch.long))
        for step in range(1, max_new_tokens):
            logits, _ = self.run_step(
                [torch.tensor([o[-1]]) for o in out], [lens[b] + step - 1 for b in range(len(prompts))],
                [no_media] * len(prompts),
            )  # fmt: skip
            for b in range(len(prompts)):
                logits_seen[b].append(logits[b : b + 1])
                out[b].append(int(logits[b, :real].argmax()))
        if return_logits:
            return out, [torch.cat(x) for x in logits_seen]
        return out

"""Admission: what a request is (its processed prompt), whether this engine can serve it, and the state
a request admitted starts with (its sequence, sampling generators and detokenizer)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from builder.config import BuildConfig
from inkling.published.config import InklingConfig

from .block_manager import BlockManager
from .outputs import OutputProcessor, RequestState
from .params import SamplingParams
from .sampler import make_generator
from .scheduler import Scheduler
from .sequence import Sequence

DRAFT_SEED_SALT = 0x5DEECE66D  # a request's MTP rejection-sampling generator: its seed XOR this


@dataclass
class PromptInput:
    """A processed prompt: token ids, and the embeddings of its image/audio pad tokens (in order)."""

    input_ids: torch.Tensor  # [T] int64
    mm_embeds: torch.Tensor | None = None  # [M, H]
    mm_positions: torch.Tensor | None = None  # [M] positions in input_ids


class Admission:
    def __init__(
        self,
        config: InklingConfig,
        build: BuildConfig,
        blocks: BlockManager,
        scheduler: Scheduler,
        num_heads: int,
        device: torch.device,
        outputs: OutputProcessor,
        seed: int = 0,
    ):
        self.config, self.build, self.blocks, self.scheduler = config, build, blocks, scheduler
        self.num_heads, self.device, self.outputs, self.seed = num_heads, device, outputs, seed
        self.num_requests = 0

    def validate(self, ids: list[int], params: SamplingParams, prompt: PromptInput) -> None:
        """Raise ValueError with a clear message for a request this engine cannot serve."""
        bc, c = self.build, self.config
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > bc.max_input_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, the engine's max_input_len is {bc.max_input_len}"
            )
        if len(ids) + params.max_tokens > bc.max_seq_len:
            raise ValueError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the engine's max_seq_len {bc.max_seq_len}"
            )
        if min(ids) < 0 or max(ids) >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        # The scheduler's chunk size is read now: it may change after the engine starts.
        need = self.blocks.pool_peaks(len(ids) + params.max_tokens, min(self.scheduler.chunk_size, len(ids)))
        if any(n > size for n, size in zip(need, self.blocks.pool_sizes)):
            raise ValueError(
                f"request needs {sum(need)} cache blocks ({'+'.join(map(str, need))} by pool), the pool has "
                f"{self.blocks.num_blocks} ({'+'.join(map(str, self.blocks.pool_sizes))})"
            )
        m = 0 if prompt.mm_positions is None else len(prompt.mm_positions)
        if m != (0 if prompt.mm_embeds is None else prompt.mm_embeds.shape[0]):
            raise ValueError("mm_embeds and mm_positions disagree in length")
        if params.num_draft_tokens > self.num_heads:
            raise ValueError(
                f"num_draft_tokens {params.num_draft_tokens} exceeds this engine's {self.num_heads} MTP heads "
                f"(the model's {c.num_mtp_heads}, at most max_draft_len {bc.max_draft_len}; none if built "
                "without heads)"
            )

    def admit(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> RequestState:
        """A validated request's starting state: its sequence (the media rows' digests key the prefix
        cache), a sampling generator on the device seeded by the request's seed (else by the engine's seed
        and the request's number), and for sampled MTP its rejection sampler's own generator."""
        ids = prompt.input_ids.tolist()
        self.validate(ids, params, prompt)
        positions = prompt.mm_positions.tolist() if prompt.mm_positions is not None else []
        digests = {}
        if positions:
            rows = prompt.mm_embeds.detach().to("cpu", torch.float32).contiguous()
            digests = {p: hashlib.sha256(rows[i].numpy().tobytes()).digest() for i, p in enumerate(positions)}
        seq = Sequence(request_id, ids, params, positions, prompt.mm_embeds, digests)
        seq.head_computed = [0] * min(params.num_draft_tokens, self.num_heads)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + self.num_requests) % 2**63
        self.num_requests += 1
        generator = None if params.greedy else make_generator(seed, self.device)
        draft_generator = None  # a stream of its own: the same seed would correlate it with `generator`
        if not params.greedy and params.num_draft_tokens:
            draft_generator = make_generator(seed ^ DRAFT_SEED_SALT)
        return RequestState(seq, self.outputs.new_detokenizer(), generator, draft_generator)

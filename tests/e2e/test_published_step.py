"""The real Inkling's step program equals transformers 5.23.0, float32, on inkling-tiny checkpoints.

The program runs over paged caches the way the runtime drives it: ragged batches, prompts prefilled in
chunks that cross page boundaries, then greedy decoding, on prompts longer than the sliding window (16)
and the full layers' relative extent (24) and past the log-scaling floor (20). Its logits must equal
transformers' full recomputation at every position to float32 rounding, and its greedy tokens equal
transformers' token for token. Sliding layers' blocks behind the window point at a block of NaN: a read
there would poison the output.
"""

from __future__ import annotations

import pytest
import torch

from builder.network import (
    CacheLayout,
    StepProgram,
    conv_channels,
    engine_tensors,
)
from inkling.published.checkpoint import PublishedCheckpoint
from inkling.published.config import FULL, SLIDING, preset
from inkling.published.synth import write_checkpoint

transformers = pytest.importorskip("transformers")

BLOCK = 4
IMPLS = {
    "sconv": "reference",
    "kv_cache_write": "reference",
    "bank_attention": "reference",
    "sigmoid_sink_moe": "reference",
}


class PagedRunner:
    """Drives the step program: each sequence owns its own contiguous blocks in each layer group (groups
    share the caches' pool slots, so their blocks must differ; block 0 is the NaN poison block) and
    state slot = its index."""

    def __init__(self, config, weights, max_seqs: int, max_len: int, impls: dict[str, str] = IMPLS):
        self.c, self.w = config, weights
        self.program = StepProgram(config, impls)
        self.layout = CacheLayout.of(config)
        t = config.text
        self.blocks_per_seq, self.max_seqs = -(-max_len // BLOCK), max_seqs
        n_blocks = 1 + len(self.layout.group_kinds) * max_seqs * self.blocks_per_seq
        self.key_caches, self.value_caches = [], []
        for kind in self.layout.cache_kinds():
            a = t.attention_of(kind)
            shape = (n_blocks, BLOCK, a.num_kv_heads, a.head_dim)
            self.key_caches.append(torch.full(shape, float("nan")))
            self.value_caches.append(torch.full(shape, float("nan")))
        self.conv_states = [torch.zeros(max_seqs, t.conv_kernel_size - 1, C) for C in conv_channels(config)]
        moe_layers = [i for i in range(t.num_hidden_layers) if not t.is_dense(i)]
        self.expert_load = [torch.zeros(t.n_routed_experts, dtype=torch.int32) for _ in moe_layers]

    def table(self, b: int, seq_len: int, g: int) -> list[int]:
        """Sequence b's blocks in group g; in a sliding group those wholly behind its window point at
        block 0 (NaN)."""
        first = 1 + (g * self.max_seqs + b) * self.blocks_per_seq
        blocks = list(range(first, first + self.blocks_per_seq))
        if self.layout.group_kinds[g] == SLIDING:
            W = self.c.text.sliding_window_size
            first_needed = max(0, seq_len - W - 8)  # the next step's queries see seq_len - W + 1 onwards
            blocks = [0 if (n + 1) * BLOCK <= first_needed else blk for n, blk in enumerate(blocks)]
        return blocks

    def step(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """chunks: (sequence index, new token ids, tokens already cached) -> logits of every new token."""
        ids, cu, lens, slots, tables = [], [0], [], [], []
        for b, new, start in chunks:
            ids += new
            cu.append(len(ids))
            lens.append(start + len(new))
            slots.append(b)
        G = len(self.layout.group_kinds)
        slot_map = torch.empty(G, len(ids), dtype=torch.int64)
        for g in range(G):
            rows = []
            for n, (b, new, start) in enumerate(chunks):
                table = self.table(b, start, g)
                rows.append(table)
                for k in range(len(new)):
                    pos = start + k
                    slot_map[g, cu[n] + k] = table[pos // BLOCK] * BLOCK + pos % BLOCK
            tables.append(rows)
        T = len(ids)
        H = self.c.text.hidden_size
        logits, _ = self.program(
            self.w, torch.tensor(ids), torch.zeros(1, H), torch.tensor([T]), torch.tensor(cu, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32), slot_map,
            torch.tensor(slots, dtype=torch.int32), torch.arange(T), torch.empty(max(len(c[1]) for c in chunks)),
            self.key_caches, self.value_caches, self.conv_states, self.expert_load,
        )  # fmt: skip
        return logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    c = preset("inkling-tiny")
    d = write_checkpoint(tmp_path_factory.mktemp("step") / "tiny", c, seed=3)
    with PublishedCheckpoint(d) as ckpt:
        weights = dict(engine_tensors(ckpt.config, ((n, ckpt.get(n)) for n in ckpt.keys()), torch.float32))
    hf = transformers.InklingForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    return c, weights, hf


def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


PROMPTS = [
    [5],  # a one-token prompt
    [int(x) for x in torch.randint(0, 960, (53,), generator=torch.Generator().manual_seed(1))],
    [int(x) for x in torch.randint(0, 960, (30,), generator=torch.Generator().manual_seed(2))],
]


def test_layout_groups_layers_by_kind(tiny):
    c, _, _ = tiny
    lay = CacheLayout.of(c)
    assert lay.pool_size == 2 and lay.group_kinds == (FULL, SLIDING, SLIDING, SLIDING)
    assert [lay.group_of_layer[i] for i in (3, 7)] == [0, 0] and lay.cache_kinds() == (FULL,) * 2 + (
        SLIDING,
    ) * 2


def test_chunked_ragged_prefill_then_decode_equals_transformers(tiny):
    c, weights, hf = tiny
    runner = PagedRunner(c, weights, max_seqs=len(PROMPTS), max_len=80)
    # Prefill in chunks of 7 (page boundaries inside chunks), every sequence in every step while it has
    # prompt left: the batches are ragged, and the one-token prompt finishes first.
    got: dict[int, list[torch.Tensor]] = {b: [] for b in range(len(PROMPTS))}
    done = [0] * len(PROMPTS)
    while any(done[b] < len(p) for b, p in enumerate(PROMPTS)):
        chunks = [(b, p[done[b] : done[b] + 7], done[b]) for b, p in enumerate(PROMPTS) if done[b] < len(p)]
        logits = runner.step(chunks)
        row = 0
        for b, new, _ in chunks:
            got[b].append(logits[row : row + len(new)])
            row += len(new)
            done[b] += len(new)
    for b, p in enumerate(PROMPTS):
        ours, ref = torch.cat(got[b]), reference_logits(hf, p)
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # Greedy decoding, all sequences in one batch a step, against transformers token for token.
    seqs = [list(p) for p in PROMPTS]
    last = [got[b][-1][-1] for b in range(len(PROMPTS))]
    for _ in range(12):
        chunks = []
        for b in range(len(seqs)):
            token = int(last[b].argmax())
            chunks.append((b, [token], len(seqs[b])))
            seqs[b].append(token)
        logits = runner.step(chunks)
        last = list(logits)
    for b, p in enumerate(PROMPTS):
        ref_ids = list(p)
        for _ in range(12):
            ref_ids.append(int(reference_logits(hf, ref_ids)[-1].argmax()))
        assert seqs[b] == ref_ids, f"sequence {b}: {seqs[b][len(p) :]} vs {ref_ids[len(p) :]}"
        torch.testing.assert_close(last[b], reference_logits(hf, seqs[b])[-1], rtol=1e-4, atol=1e-4)


def prefill_logits(runner: PagedRunner, prompts, chunk: int) -> list[torch.Tensor]:
    out: dict[int, list[torch.Tensor]] = {b: [] for b in range(len(prompts))}
    done = [0] * len(prompts)
    while any(done[b] < len(p) for b, p in enumerate(prompts)):
        chunks = [
            (b, p[done[b] : done[b] + chunk], done[b]) for b, p in enumerate(prompts) if done[b] < len(p)
        ]
        logits, row = runner.step(chunks), 0
        for b, new, _ in chunks:
            out[b].append(logits[row : row + len(new)])
            row += len(new)
            done[b] += len(new)
    return [torch.cat(out[b]) for b in range(len(prompts))]


def test_bf16_program_follows_transformers_in_bf16(tiny):
    """bf16 weights and activations (sconvs, norms' statistics, router, softmax and τ in float32 as in
    transformers): against transformers in bf16 on the same positions, relative logit error under 3% and
    top-1 agreement over 90%."""
    c, weights, hf = tiny
    bf16 = {
        n: t if t.dtype != torch.float32 or "sconv" in n or ".gate." in n else t.bfloat16()
        for n, t in weights.items()
    }
    runner = PagedRunner(c, bf16, max_seqs=len(PROMPTS), max_len=80)
    for kind in ("key_caches", "value_caches"):
        setattr(runner, kind, [t.bfloat16() for t in getattr(runner, kind)])
    hf16 = hf.to(torch.bfloat16)
    try:
        for p, ours in zip(PROMPTS, prefill_logits(runner, PROMPTS, 9)):
            ref = reference_logits(hf16, p)
            rel = float((ours - ref).norm() / ref.norm())
            agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
            print(f"bf16: {len(p)} tokens, relative logit error {rel:.4f}, top-1 agreement {agree:.3f}")
            assert rel < 0.03 and agree > 0.9, (len(p), rel, agree)
    finally:
        hf.to(torch.float32)


@pytest.fixture(scope="module")
def tiny_fp4(tiny, tmp_path_factory):
    """The converter's NVFP4 checkpoint of the same model (layer 2's experts BF16, layers 3.. NVFP4): its
    config, engine weights, and transformers on the dequantized experts and on the BF16 source."""
    from convert.published import convert
    from inkling.published.reference import reference_model

    c, _, _ = tiny
    tmp = tmp_path_factory.mktemp("fp4")
    write_checkpoint(tmp / "bf16", c, seed=3)
    out = convert(str(tmp / "bf16"), str(tmp / "fp4"), calibration_prompts_n=0)
    assert [i for i in range(c.text.num_hidden_layers) if out.experts_quantized(i)] == [3, 4, 5, 6, 7]
    with PublishedCheckpoint(tmp / "fp4") as ckpt:
        weights = dict(engine_tensors(ckpt.config, ((n, ckpt.get(n)) for n in ckpt.keys()), torch.float32))
    return out, weights, reference_model(tmp / "fp4"), reference_model(tmp / "bf16")


def test_nvfp4_program_equals_transformers_on_the_dequantized_experts(tiny_fp4):
    """The NVFP4 checkpoint through the program, float32, equals transformers holding the same routed
    experts dequantized (inkling/published/reference.py)."""
    c, weights, ref_model, bf16_model = tiny_fp4
    runner = PagedRunner(c, weights, max_seqs=len(PROMPTS), max_len=80)
    for p, ours in zip(PROMPTS, prefill_logits(runner, PROMPTS, 11)):
        want = reference_logits(ref_model, p)
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
        if len(p) > 1:  # the quantization itself changed the model: the dequantized reference is not BF16's
            assert not torch.allclose(want, reference_logits(bf16_model, p), atol=1e-3)


def test_triton_kernels_equal_transformers(tiny_fp4):
    """The CUDA engine's kernels (bank attention, the sigmoid MoE on BF16 and NVFP4 experts, sconv, the KV
    write) in the Triton interpreter: a ragged chunked prefill of a one-token prompt and one past the window,
    the extent and the log floor (30 tokens), then a greedy decode step, equal to transformers (tests/gpu
    runs them compiled on the H200; each kernel's forms are tests/kernels')."""
    c, weights, ref_model, _ = tiny_fp4
    prompts = [PROMPTS[0], PROMPTS[2]]
    runner = PagedRunner(c, weights, max_seqs=len(prompts), max_len=80, impls={n: "triton" for n in IMPLS})
    seqs = [list(p) for p in prompts]
    last = [logits[-1] for logits in prefill_logits(runner, prompts, 17)]
    for _ in range(1):
        chunks = []
        for b, seq in enumerate(seqs):
            chunks.append((b, [int(last[b].argmax())], len(seq)))
            seq.append(chunks[-1][1][0])
        last = list(runner.step(chunks))
    for seq, ours in zip(seqs, last):
        torch.testing.assert_close(ours, reference_logits(ref_model, seq)[-1], rtol=1e-4, atol=1e-4)

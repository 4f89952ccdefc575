"""The decode/verify step and the MTP head passes as CUDA graphs, one per (batch, tokens) bucket
(DESIGN.md "Runtime", docs/interfaces.md "CUDA graphs").

A decode step of a large model is hundreds of small kernels; launched one by one from Python the host
is the bottleneck. So a ragged batch of B sequences and T tokens whose longest sequence feeds Q tokens
(no media) is padded to a bucket (B_g >= B, T_g >= T, Q_g >= Q), its inputs are copied into the
bucket's static buffers, and the graph captured for that bucket replays. Q_g is the program's q_bound
(the attention's tiles are chosen for it: one query per sequence in a decode step, not T). Padding never
touches real state (docs/interfaces.md):
- padding tokens fill padding sequences of at most Q_g tokens each (seq_len = q_len); the remaining
  padding sequences have q_len 0, so every row belongs to some sequence and every output row is defined
  (the split-KV reduction reads every row's partials);
- padding rows have slot_mapping -1: `kv_cache_write` skips them;
- padding sequences have state index -1 ("no state": x[t<0] = 0, nothing saved), which every sconv op
  honours; the exported programs fix the state tensors at max_batch_size slots, so there is no room for
  a scratch slot and none is needed;
- their block-table rows are all block 0 (a valid block, read only) and seq_len = q_len <= T_g, which
  the runner keeps <= max_seq_len, so attention reads stay inside the row.
The real sequences come first, so the real output rows are a prefix of the bucket's.

The copy into the buffers is one transfer: a bucket's ragged buffers are views of one flat device buffer,
and the host pads its inputs with NumPy into a pinned copy of that layout (`stage_ragged`), sent with one
asynchronous copy (inputs already on the device, such as an overlapped step's input ids, are copied
device to device). The media splice's dummy row and the q bound are the same for every call of a bucket
and are set once.

What the graph holds: the whole exported program (embedding, every layer's ops, final norm, lm_head
rows). Every op is sync-free with shapes taken from the bucket: attention picks tiles and split-KV
splits from (B_g, T_g, block-table width) on the host and each split walks its share of the device-side
seq_len; the MoE sizes its routing buffers from a static bound. What stays outside: building the
inputs on the host, the copy into the static buffers, sampling and rollback. A drafting MTP head pass's
graph (HEAD_PICK_ARGS) also holds its draft pick (the unembedding's argmax), which reads and writes the
drafter's device buffer of drafts.

`pad_eager` (tests): no graphs, but the same buckets, padding and static buffers, run eagerly, so the
padding is testable on the CPU.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from builder.contracts import HEAD, HEAD_PICK, STEP, RaggedArgs

FLAT_ALIGN = 64  # bytes: each ragged buffer's offset in its bucket's flat buffer (kernels assume 16)
WARMUP_RUNS = 3  # eager runs on a side stream before a capture (Triton compiles, cuBLAS handles)


def q_buckets(max_tokens_per_seq: int) -> tuple[int, ...]:
    """Bounds of the tokens one sequence feeds: 1 (decode), powers of two, and 1 + max drafts."""
    out, q = [], 1
    while q < max_tokens_per_seq:
        out.append(q)
        q *= 2
    return (*out, max_tokens_per_seq)


def batch_buckets(max_batch_size: int, max_program_batch: int | None = None) -> tuple[int, ...]:
    """1, 2, 4, ... below max_batch_size, max_batch_size itself, and max_program_batch where the programs
    take a larger batch (max_batch_size + 1: room for a padding sequence beside a full batch)."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    extra = () if max_program_batch is None or max_program_batch <= max_batch_size else (max_program_batch,)
    return (*out, max_batch_size, *extra)


def program_max_batch(program: torch.export.ExportedProgram) -> int | None:
    """The largest batch an exported step or head program takes (its `seq_lens` Dim's upper bound)."""
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name == "seq_lens":
            size = node.meta["val"].shape[0]
            if isinstance(size, torch.SymInt) and size.node.expr in program.range_constraints:
                return int(program.range_constraints[size.node.expr].upper)
            return int(size)
    return None


def token_buckets(max_batch_size: int, max_tokens_per_seq: int, max_num_tokens: int) -> tuple[int, ...]:
    """Powers of two up to the largest decode/verify step, plus max_batch_size * q for q = 1..
    max_tokens_per_seq: where the programs take no batch beyond max_batch_size, a full batch has no
    padding sequence to hold padding tokens, so its steps fit only where every sequence feeds q tokens
    (the same draft count everywhere)."""
    limit = min(max_num_tokens, max_batch_size * max_tokens_per_seq)
    pows, t = set(), 1
    while t <= limit:
        pows.add(t)
        t *= 2
    full = {max_batch_size * q for q in range(1, max_tokens_per_seq + 1)}
    return tuple(sorted({t for t in pows | full if t <= limit} | {limit}))


def catchup_token_buckets(q: int, max_tokens: int) -> tuple[int, ...]:
    """The token buckets of the MTP heads' catch-up passes (runtime/drafter.py `_passes`), whose pieces are
    up to q positions a sequence: q, 2q, 4q, ... below max_tokens, and max_tokens."""
    out, t = [], q
    while t < max_tokens:
        out.append(t)
        t *= 2
    return (*out, max_tokens)


def reachable_buckets(
    max_num_seqs: int, batch: tuple[int, ...], tokens: tuple[int, ...], qs: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """Every (B_g, T_g, Q_g) that `choose_bucket` picks for some batch of up to max_num_seqs sequences, each
    feeding at most qs[-1] tokens: what a start-up capture must cover so that no step captures while
    serving."""
    out = set()
    for n in range(1, max_num_seqs + 1):
        # The longest sequence feeds q tokens and the others 1..q: T runs over [q + n - 1, n * q], and over
        # the q of one q bound Q (all that choose_bucket sees of q) those ranges join into one.
        for low, Q in zip((0, *qs), qs):
            for T in range(low + n, min(n * Q, tokens[-1]) + 1):
                bucket = choose_bucket(n, T, Q, batch, tokens, qs)
                if bucket is not None:
                    out.add(bucket)
    return sorted(out, key=lambda b: (b[1], b[0], b[2]))


def choose_bucket(
    num_seqs: int,
    num_tokens: int,
    max_q: int,
    batch: tuple[int, ...],
    tokens: tuple[int, ...],
    qs: tuple[int, ...],
    padded_tokens: int | None = None,
) -> tuple[int, int, int] | None:
    """(B_g, T_g, Q_g): the smallest q bound and token bucket, then the smallest batch bucket with room for
    the padding sequences that hold the padding tokens (Q_g each at most); None (run eager) when none fits.
    padded_tokens: T_g must be exactly this (data-parallel replicas agree on their steps' token count)."""
    Q = next((q for q in qs if q >= max_q), None)
    if padded_tokens is None:
        T = next((t for t in tokens if t >= num_tokens), None)
    else:
        T = padded_tokens if padded_tokens in tokens and padded_tokens >= num_tokens else None
    if Q is None or T is None:
        return None
    need = num_seqs + -(-(T - num_tokens) // Q)
    B = next((b for b in batch if b >= need), None)
    return None if B is None else (B, T, Q)


# The programs' ragged batches, from their contracts (builder/contracts.py).
STEP_ARGS, HEAD_ARGS, HEAD_PICK_ARGS = STEP.ragged, HEAD.ragged, HEAD_PICK.ragged


def _pad(x: torch.Tensor, dim: int, size: int, value: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim)


def pad_ragged(args: list, spec: RaggedArgs, B: int, T: int, Q: int) -> dict[int, torch.Tensor]:
    """The ragged inputs of `args` padded to B sequences, T tokens and q bound Q (on each input's own
    device, no sync: the real sizes come from shapes): arg index -> padded tensor."""
    cu, seq_lens = args[spec.cu], args[spec.seq_lens]
    q_lens = torch.tensor(padding_q_lens(args, spec, B, T, Q), dtype=torch.int32, device=cu.device)
    out = {i: _pad(args[i], d, T, v) for i, (d, v) in spec.tokens.items()}
    out.update({i: _pad(args[i], d, B, v) for i, (d, v) in spec.seqs.items()})
    out[spec.q_bound] = args[spec.q_bound].new_zeros(Q)
    out[spec.cu] = torch.cat([cu, cu[-1:] + q_lens.cumsum(0, dtype=torch.int32)])
    out[spec.seq_lens] = torch.cat([seq_lens, q_lens.to(seq_lens.device)])
    # The media splice's dummy row aims at position T (no media in a graphed step).
    out[spec.mm_positions] = torch.full((1,), T, dtype=args[spec.mm_positions].dtype)
    out[spec.mm_embeds] = args[spec.mm_embeds]
    if spec.logits is not None:
        out[spec.logits] = _pad(args[spec.logits], 0, T, 0)
    return out


def padding_q_lens(args: list, spec: RaggedArgs, B: int, T: int, Q: int) -> list[int]:
    """The tokens of each of the B - num_seqs padding sequences that hold the T - num_tokens padding tokens:
    Q each, then one with the rest, then empty ones. ValueError where the batch does not fit the bucket."""
    num_seqs, max_q = args[spec.seq_lens].shape[0], args[spec.q_bound].shape[0]
    first = next(iter(spec.tokens))
    num_tokens = args[first].shape[spec.tokens[first][0]]
    pad_seqs, pad_tokens = B - num_seqs, T - num_tokens
    if pad_seqs < 0 or pad_tokens < 0 or max_q > Q or pad_tokens > pad_seqs * Q:
        raise ValueError(
            f"cannot pad {num_seqs} sequences / {num_tokens} tokens / q {max_q} to a ({B}, {T}, {Q}) bucket"
        )
    full, rest = divmod(pad_tokens, Q)
    q_list = [Q] * full + ([rest] if rest else [])
    return q_list + [0] * (pad_seqs - len(q_list))


def empty_batch(args: list, spec: RaggedArgs) -> list:
    """`args` with zero sequences and tokens (their padding is a batch that writes nothing)."""
    out = list(args)
    for i, (d, _) in spec.tokens.items():
        out[i] = args[i].narrow(d, 0, 0)
    for i, (d, _) in spec.seqs.items():
        out[i] = args[i].narrow(d, 0, 0)
    out[spec.cu] = args[spec.cu][:1] * 0
    out[spec.seq_lens] = args[spec.seq_lens][:0]
    out[spec.q_bound] = args[spec.q_bound][:0]
    if spec.logits is not None:
        out[spec.logits] = args[spec.logits][:0]
    return out


def ragged_indices(spec: RaggedArgs) -> list[int]:
    """The arguments a call's batch changes: those sized by tokens or sequences, cu_seqlens_q, seq_lens and
    the logits rows (the q bound's contents and the media splice's dummy row never change)."""
    return [i for i, _, _ in sized_args(spec)] + [spec.cu, spec.seq_lens]


def sized_args(spec: RaggedArgs) -> list[tuple[int, int, float]]:
    """(arg index, dim, padding value) of the arguments sized by tokens or sequences, logits rows included."""
    out = [(i, d, v) for i, (d, v) in (*spec.tokens.items(), *spec.seqs.items())]
    return out if spec.logits is None else [*out, (spec.logits, 0, 0)]


def stage_ragged(args: list, spec: RaggedArgs, B: int, T: int, Q: int, dst: dict[int, np.ndarray]) -> None:
    """Write what `pad_ragged` returns into the NumPy arrays `dst` (arg index -> an array of the padded
    shape holding the argument's bits, as `tensor_bits` gives, e.g. a view of a pinned staging buffer):
    host operations only, no torch call. Only the host arguments are written; those on another device
    are the caller's to copy. cu_seqlens_q and seq_lens must be host tensors (the host knows a batch's
    shape)."""
    cu, seq_lens = args[spec.cu], args[spec.seq_lens]
    if not (on_host(cu) and on_host(seq_lens)):
        raise ValueError("cu_seqlens_q and seq_lens of a graphed call must be host tensors")
    q_lens = np.array(padding_q_lens(args, spec, B, T, Q), dtype=np.int64)
    for i, d, v in sized_args(spec):
        if on_host(args[i]):
            _put_padded(dst[i], host_bits(args[i]), d, _pad_bits(v, torch_dtype(args[i])))
    num_seqs = seq_lens.shape[0]
    cu_out, lens_out = dst[spec.cu], dst[spec.seq_lens]
    cu_out[: num_seqs + 1] = host_bits(cu)
    cu_out[num_seqs + 1 :] = cu_out[num_seqs] + np.cumsum(q_lens)
    lens_out[:num_seqs] = host_bits(seq_lens)
    lens_out[num_seqs:] = q_lens


_BITS = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.int16),
    4: (torch.int32, np.int32),
    8: (torch.int64, np.int64),
}


@functools.cache
def _bits_of(dtype: torch.dtype) -> tuple[torch.dtype, np.dtype]:
    """The integer dtype (torch, NumPy) whose values hold a `dtype` tensor's bits: the dtype itself where
    it is an integer one, a same-sized integer for float ones (NumPy has no bfloat16)."""
    example = torch.empty((), dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        t, n = _BITS[example.element_size()]
        return t, np.dtype(n)
    return dtype, example.numpy().dtype


def tensor_bits(x: torch.Tensor) -> np.ndarray:
    """A host tensor as a NumPy array of its bits (`_bits_of`)."""
    bits = _bits_of(x.dtype)[0]
    return (x if bits == x.dtype else x.view(bits)).numpy()


def on_host(x: torch.Tensor | np.ndarray) -> bool:
    """Whether a ragged argument is on the host: a NumPy array (what the MTP drafter passes, saving a
    torch operator each way) or a host tensor."""
    return isinstance(x, np.ndarray) or x.device.type == "cpu"


def host_bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host argument's bits as NumPy (`tensor_bits`); a NumPy array of an integer dtype as it is."""
    if isinstance(x, np.ndarray):
        return x if x.dtype.kind in "iub" else tensor_bits(torch.from_numpy(x))
    return tensor_bits(x)


@functools.cache
def _torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def torch_dtype(x: torch.Tensor | np.ndarray) -> torch.dtype:
    return _torch_dtype_of(x.dtype) if isinstance(x, np.ndarray) else x.dtype


def as_tensor(x: Any) -> Any:
    """A NumPy argument as a host tensor (sharing its memory); anything else as it is."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def bits_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype `tensor_bits` gives for a tensor of `dtype`."""
    return _bits_of(dtype)[1]


@functools.cache
def _pad_bits(value: float, dtype: torch.dtype) -> int:
    return int(tensor_bits(torch.tensor([value], dtype=dtype))[0])


def copy_padded(out: torch.Tensor, x: torch.Tensor, dim: int, value: float) -> None:
    """out[..., :n, ...] = x along `dim`, the rest = value, by torch ops on out's device (for inputs that
    are already on the device: no host round trip)."""
    n = x.shape[dim]
    out.narrow(dim, 0, n).copy_(x)
    if out.shape[dim] > n:
        out.narrow(dim, n, out.shape[dim] - n).fill_(value)


def _put_padded(out: np.ndarray, x: np.ndarray, dim: int, value: int) -> None:
    """out[..., :n, ...] = x along `dim` (n = x's size there), the rest of `dim` = value."""
    n = x.shape[dim]
    head = (slice(None),) * dim
    out[(*head, slice(0, n))] = x
    out[(*head, slice(n, None))] = value


@dataclass
class _Bucket:
    """One bucket's static inputs (the program's arguments, ragged ones replaced by views of `flat`), its
    graph (None in pad_eager mode) and outputs. layout: arg index -> (byte offset, dtype, shape) in flat."""

    args: list
    flat: torch.Tensor
    layout: dict[int, tuple[int, torch.dtype, tuple[int, ...]]]
    graph: Any = None
    outputs: tuple[torch.Tensor, ...] = ()
    host_views: dict[int, np.ndarray] | None = None  # bit views of flat itself, where it is on the host

    def views(self, buffer: torch.Tensor) -> dict[int, torch.Tensor]:
        """The ragged arguments as views of `buffer` (flat)."""
        return {
            i: buffer[off : off + _nbytes(dtype, shape)].view(dtype).view(shape)
            for i, (off, dtype, shape) in self.layout.items()
        }

    def bit_views(self, buffer: np.ndarray) -> dict[int, np.ndarray]:
        """The ragged arguments' bits (`tensor_bits`) as views of a host buffer of flat's layout."""
        out = {}
        for i, (off, dtype, shape) in self.layout.items():
            bits = bits_dtype(dtype)
            out[i] = buffer[off : off + math.prod(shape) * bits.itemsize].view(bits).reshape(shape)
        return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class GraphStats:
    graphed: int = 0  # calls replayed (or run padded in pad_eager mode)
    eager: int = 0  # calls that fit no bucket or carried media
    captures: int = 0
    captures_while_serving: int = 0  # captures a call had to wait for (its bucket was not made yet)
    capture_seconds: float = 0.0  # spent in `capture`
    buckets: set = field(default_factory=set)  # the buckets calls used


class StepGraphs:
    """`program(*args)` of a ragged-batch program (the step or the MTP head program) replayed from CUDA
    graphs per (variant, B_g, T_g, Q_g) bucket; other calls run eager.

    variant: what tells apart calls whose fixed arguments (weights, caches) differ, e.g. the MTP head.
    pool: a graph memory pool to share (torch.cuda.graph_pool_handle()); its own otherwise. One caller at
    a time: the static buffers are shared; outputs are copies of the real rows.

    `capture` makes every bucket a call can reach, at start-up. The graphs write their outputs into one
    buffer per output, shared by all buckets (sized for the largest): each graph's own output is then a
    temporary of the shared pool, so the captures cost about the largest graph's memory, not the sum of
    all (the step's float32 logits [T_g, V] alone would be about 12 GB over inkling-bench's 105 buckets).
    """

    def __init__(
        self,
        program: Callable,
        spec: RaggedArgs,
        device: torch.device,
        batch: tuple[int, ...],
        tokens: tuple[int, ...],
        qs: tuple[int, ...],
        *,
        use_graphs: bool,
        pad_eager: bool = False,
        pool: Any = None,
    ):
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine runs on {device}")
        self.program, self.spec, self.device = program, spec, device
        self.batch, self.tokens, self.qs = batch, tokens, qs
        self.use_graphs, self.pad_eager = use_graphs, pad_eager
        self.pool = pool
        self.buckets: dict[Hashable, _Bucket] = {}
        self.stats = GraphStats()
        self.shared_outputs: list[torch.Tensor] | None = None  # see `capture`

    def capture(
        self, template: Callable[[Hashable], list], variants: tuple = (None,), max_num_seqs: int | None = None
    ) -> int:
        """Make every reachable bucket of each variant now: template(variant) gives the program's arguments
        of any batch (its fixed arguments the objects later calls pass, its ragged ones of the right
        dtypes). max_num_seqs: the most sequences a call has (default the largest batch bucket). Returns
        the number of buckets made."""
        start = time.perf_counter()
        buckets = reachable_buckets(max_num_seqs or self.batch[-1], self.batch, self.tokens, self.qs)
        made = 0
        for variant in variants:
            args = template(variant)
            for B, T, Q in buckets:
                if (variant, B, T, Q) not in self.buckets:
                    self._make((variant, B, T, Q), args, B, T, Q)
                    made += 1
        self.stats.capture_seconds += time.perf_counter() - start
        return made

    def bucket(self, args: list, padded_tokens: int | None = None) -> tuple[int, int, int] | None:
        """The bucket of a call (choose_bucket); None where it runs eager."""
        if not (self.use_graphs or self.pad_eager) or args[self.spec.mm_embeds].shape[0] != 1:
            return None
        num_seqs, max_q = args[self.spec.seq_lens].shape[0], args[self.spec.q_bound].shape[0]
        return choose_bucket(
            num_seqs, self._num_tokens(args), max_q, self.batch, self.tokens, self.qs, padded_tokens
        )

    def __call__(
        self, args: list, variant: Hashable = None, copy: bool = True, padded_tokens: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The program's outputs (a tuple) for `args`; ragged inputs may be host tensors or NumPy arrays.
        The outputs are copies of the real rows; with `copy` False, views of the bucket's own outputs,
        which the next call of the same bucket overwrites (for a caller done with them by then: the MTP
        drafter, whose head m replays once a round and whose rows are copied or consumed within it).
        padded_tokens: the bucket's token count, as choose_bucket takes it."""
        bucket = self.bucket(args, padded_tokens)
        if bucket is None:
            self.stats.eager += 1
            return _as_tuple(self.program(*[on_device(a, self.device) for a in args]))
        B, T, Q = bucket
        key = (variant, B, T, Q)
        entry = self.buckets.get(key)
        if entry is None:
            self.stats.captures_while_serving += self.use_graphs
            entry = self._make(key, args, B, T, Q)
        self.stats.buckets.add(key)
        for i, a in enumerate(args):
            if not isinstance(a, (torch.Tensor, np.ndarray)) and a is not entry.args[i]:
                raise RuntimeError(f"argument {i} is not the object bucket {key} was made with")
        self._stage(entry, args, B, T, Q)
        if entry.graph is not None:
            entry.graph.replay()
            outputs = entry.outputs
        else:
            outputs = _as_tuple(self.program(*entry.args))
        self.stats.graphed += 1
        real = {"T": self._num_tokens(args)}
        if self.spec.logits is not None:
            real["N"] = args[self.spec.logits].shape[0]
        # Copies: the next replay of this graph overwrites its outputs.
        return tuple(
            o[: real[kind]].clone() if copy else o[: real[kind]]
            for o, kind in zip(outputs, self.spec.outputs)
        )

    def _stage(self, entry: _Bucket, args: list, B: int, T: int, Q: int) -> None:
        """Copy the call's ragged inputs, padded, into the bucket's buffers: the host ones by one copy of
        a pinned staging buffer (from torch's caching host allocator, which reuses a block only after the
        copies out of it have run) up to the last host one's end, then the device ones device to device."""
        if entry.flat.device.type == "cpu":
            stage_ragged(args, self.spec, B, T, Q, entry.host_views)
        else:
            stage = torch.empty(entry.flat.shape, dtype=torch.uint8, pin_memory=True)
            stage_ragged(args, self.spec, B, T, Q, entry.bit_views(stage.numpy()))
            end = max(
                off + _nbytes(dtype, shape)
                for i, (off, dtype, shape) in entry.layout.items()
                if on_host(args[i])
            )
            entry.flat[:end].copy_(stage[:end], non_blocking=True)
        for i, d, v in sized_args(self.spec):
            if not on_host(args[i]):
                copy_padded(entry.args[i], args[i], d, v)

    def _num_tokens(self, args: list) -> int:
        i = next(iter(self.spec.tokens))
        return args[i].shape[self.spec.tokens[i][0]]

    def _shared_outputs(self, outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The buffers every bucket's graph writes its outputs into, made at the first capture (outside any
        graph) with the rows of the largest token bucket (outputs are sized by T_g or N_g <= T_g)."""
        if self.shared_outputs is None:
            self.shared_outputs = [o.new_empty((self.tokens[-1], *o.shape[1:])) for o in outputs]
        return self.shared_outputs

    @torch.no_grad()
    def _make(self, key: Hashable, args: list, B: int, T: int, Q: int) -> _Bucket:
        """The bucket's static buffers, holding a batch of padding only (it writes no cache or state,
        so the warm-up runs are harmless), and in graph mode the captured graph."""
        args = [as_tensor(a) for a in args]
        static = [on_device(a, self.device) for a in empty_batch(args, self.spec)]
        padded = pad_ragged(empty_batch(args, self.spec), self.spec, B, T, Q)
        for i, x in padded.items():
            static[i] = x.to(self.device).clone()
        layout, size = {}, 0
        # Smallest first: the staging copies the flat buffer only up to its last host argument's end, and
        # the largest, the block tables, come from the device where they live there (device_tables.py).
        for i in sorted(
            ragged_indices(self.spec), key=lambda i: padded[i].numel() * padded[i].element_size()
        ):
            x = padded[i]
            layout[i] = (size, x.dtype, tuple(x.shape))
            size += -(-_nbytes(x.dtype, tuple(x.shape)) // FLAT_ALIGN) * FLAT_ALIGN
        entry = _Bucket(static, torch.zeros(size, dtype=torch.uint8, device=self.device), layout)
        for i, view in entry.views(entry.flat).items():
            view.copy_(padded[i])
            static[i] = view
        if entry.flat.device.type == "cpu":
            entry.host_views = entry.bit_views(entry.flat.numpy())
        if self.use_graphs:
            with torch.cuda.device(self.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        warm = _as_tuple(self.program(*static))
                torch.cuda.current_stream().wait_stream(side)
                shared = self._shared_outputs(warm)
                del warm
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                entry.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(entry.graph, pool=self.pool):
                    outputs = _as_tuple(self.program(*static))
                    entry.outputs = tuple(buf[: o.shape[0]].copy_(o) for buf, o in zip(shared, outputs))
                del outputs  # temporaries of the pool now, which later captures reuse
                # One replay now, of the padding batch (it writes nothing): a graph's first launch uploads it
                # to the device, which a request would otherwise wait for. (The adaptive MTP run of
                # 2026-12-07 on an H100 had its first rounds at 60 and 13 ms against 7 ms later, the first
                # replays of their buckets; that the upload is what took the time is not measured yet.)
                entry.graph.replay()
            self.stats.captures += 1
        self.buckets[key] = entry
        return entry


def on_device(x: Any, device: torch.device) -> Any:
    """x on `device` where it is a tensor; anything else as it is (`to_device` is the pinned, asynchronous
    copy of a host tensor)."""
    x = as_tensor(x)
    return x.to(device) if isinstance(x, torch.Tensor) else x


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, on a GPU copied from pinned memory without waiting: a copy from pageable
    memory waits for the work queued before it (an overlapped step's, a round's head passes)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)

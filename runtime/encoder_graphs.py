"""The image and audio encoders as CUDA graphs, one per shape bucket (DESIGN.md "Runtime").

At batch 1 an encoder is a handful of small kernels whose launches cost more than their work, so on
CUDA the exported program is captured once per bucket of rows (image patches, or audio frames) and
replayed: the input is copied into the bucket's static buffer, the rest of which holds zeros or older
rows, and the real rows are sliced off the static output. That is exact because every output row depends
on its own input row only (inkling/published/towers.py: the vision tower works on each patch alone, the
audio embedding on each frame); only the kernels a GEMM picks for another row count may round the last
bit differently.
Inputs beyond the largest bucket, or not of the captured shape, dtype or device, run eager, and so
does everything on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DEFAULT_BUCKETS = tuple(2**i for i in range(4, 13))  # 16 .. 4096 rows
WARMUP_RUNS = 3  # eager runs on a side stream before a capture (cuBLAS handles, lazy inits)


class GraphedEncoder:
    """`program(x)` for an encoder program (`engine.programs[kind].module()`), replayed from CUDA graphs.

    kind: "vision" (pixel values [N, 2, 40, 40, 3] in `dtype` -> [N, H]) or "audio" (int64 dMel levels
    [N, mel_bins] -> [N, H]). engine_config: the engine's config.json (`Engine.config`), whose `encoders`
    give the input layout and the program's largest N. buckets: row counts to capture, clipped to that
    largest N. use_graphs: default on CUDA only. pad_eager: without graphs, still pad to the bucket and
    slice (to test the padding on the CPU). One caller at a time: the static buffers are shared.
    """

    def __init__(
        self,
        program: Callable[[torch.Tensor], torch.Tensor],
        kind: str,
        device: str | torch.device,
        dtype: torch.dtype,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        *,
        engine_config: dict[str, Any],
        use_graphs: bool | None = None,
        pad_eager: bool = False,
    ):
        self.program, self.kind = program, kind
        self.device = torch.device(device)
        layout = engine_config["encoders"].get(kind)  # builder/build.py encoder_layout
        if layout is None:
            raise ValueError(
                f"the engine has no {kind!r} encoder; it has {sorted(engine_config['encoders'])}"
            )
        self.shape, self.dim = list(layout["shape"]), layout["dim"]
        self.in_dtype = dtype if layout["input"] == "float" else torch.long
        max_rows = layout["max_rows"]
        self.buckets = tuple(sorted({min(int(b), max_rows) for b in buckets if b > 0}))
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.pad_eager = pad_eager
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None  # one memory pool for every bucket's graph

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.bucket(x) if (self.use_graphs or self.pad_eager) else None
        if bucket is None:
            return self.program(x)
        rows = x.shape[self.dim]
        if not self.use_graphs:
            padded = x.new_zeros(self.input_shape(bucket))
            padded.narrow(self.dim, 0, x.shape[self.dim]).copy_(x)
            return self.program(padded)[:rows]
        graph, static_in, static_out = self.graphs.get(bucket) or self.capture(bucket)
        static_in.narrow(self.dim, 0, x.shape[self.dim]).copy_(x)
        graph.replay()
        # A copy: the next replay of this graph, or another graph's intermediates in the shared pool,
        # overwrite the static output.
        return static_out[:rows].clone()

    def bucket(self, x: torch.Tensor) -> int | None:
        """The smallest bucket that holds x; None when x runs eager (the program judges it)."""
        if x.dtype != self.in_dtype or x.device.type != self.device.type or x.dim() != len(self.shape):
            return None
        if any(s != e for d, (s, e) in enumerate(zip(x.shape, self.shape)) if d != self.dim):
            return None
        size = x.shape[self.dim]
        if size == 0:
            return None
        return next((b for b in self.buckets if b >= size), None)

    def input_shape(self, bucket: int) -> list[int]:
        shape = list(self.shape)
        shape[self.dim] = bucket
        return shape

    def warmup(self) -> None:
        """Capture every bucket now, largest first (the smaller ones then fit in the pool it grew)."""
        if self.use_graphs:
            for bucket in reversed(self.buckets):
                if bucket not in self.graphs:
                    self.capture(bucket)

    @torch.no_grad()
    def capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        static_in = torch.zeros(self.input_shape(bucket), dtype=self.in_dtype, device=self.device)
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.program(static_in)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                static_out = self.program(static_in)
        self.graphs[bucket] = (graph, static_in, static_out)
        return self.graphs[bucket]

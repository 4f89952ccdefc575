"""GraphedEncoder (runtime/encoder_graphs.py): bucketed runs give the encoder programs' outputs.

On the CPU, `pad_eager` runs the padding and slicing without graphs; the `gpu` test replays graphs.
Padding is exact in math (each output row depends on its own patch or frames); a GEMM over more
rows may round the last bit differently, hence assert_close at the dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from builder.build import encoder_layout, export_towers
from builder.config import BuildConfig
from inkling.published.config import preset
from inkling.published.synth import iter_tensors
from runtime.encoder_graphs import GraphedEncoder

HAS_CUDA = torch.cuda.is_available()
BUILD = BuildConfig(max_batch_size=4, max_seq_len=256, max_input_len=256, max_num_tokens=512)
VISION_BUCKETS, AUDIO_BUCKETS = (2, 4, 8), (16, 32)


def tiny_encoders(device: str, dtype: torch.dtype) -> tuple[dict, dict]:
    """inkling-tiny's exported towers and the engine config that describes them."""
    config = preset("inkling-tiny")
    tensors = {
        name: t.to(device, dtype)
        for name, t in iter_tensors(config)
        if name.startswith(("model.visual.", "model.audio."))
    }
    programs = export_towers(config, BUILD, tensors, torch.device(device), dtype)
    engine_config = {"encoders": encoder_layout(config, BUILD)}
    return {k: p.module() for k, p in programs.items()}, engine_config


@pytest.fixture(scope="module")
def encoders() -> tuple[dict, dict]:
    return tiny_encoders("cpu", torch.float32)


def make_input(kind: str, rows: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """Pixel values [rows, 2, 40, 40, 3], or dMel levels [rows, 80] (inkling-tiny: 16 levels)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "vision":
        return torch.randn(rows, 2, 40, 40, 3, generator=g, device=device).to(dtype)
    return torch.randint(0, 16, (rows, 80), generator=g, device=device)


class Spy:
    """The program, recording the size of each input's dynamic dimension."""

    def __init__(self, program, dim: int):
        self.program, self.dim, self.sizes = program, dim, []

    def __call__(self, x):
        self.sizes.append(x.shape[self.dim])
        return self.program(x)


def test_buckets_are_clipped_to_the_programs_largest_input(encoders):
    programs, engine_config = encoders
    vision = GraphedEncoder(programs["vision"], "vision", "cpu", torch.float32, engine_config=engine_config)
    audio = GraphedEncoder(programs["audio"], "audio", "cpu", torch.float32, engine_config=engine_config)
    assert vision.buckets == audio.buckets == (16, 32, 64, 128, 256)  # max_input_len
    custom = GraphedEncoder(
        programs["vision"], "vision", "cpu", torch.float32, (8, 2, 100), engine_config=engine_config
    )
    assert custom.buckets == (2, 8, 100) and not custom.use_graphs


@pytest.mark.parametrize(
    "kind, rows, bucket",
    [("vision", n, b) for n, b in ((1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, None), (16, None))]
    + [("audio", n, b) for n, b in ((2, 16), (15, 16), (16, 16), (17, 32), (32, 32), (33, None), (90, None))],
)
def test_padded_runs_give_the_programs_outputs(encoders, kind, rows, bucket):
    programs, engine_config = encoders
    buckets = VISION_BUCKETS if kind == "vision" else AUDIO_BUCKETS
    spy = Spy(programs[kind], 0)
    enc = GraphedEncoder(
        spy, kind, "cpu", torch.float32, buckets, engine_config=engine_config, pad_eager=True
    )
    x = make_input(kind, rows, torch.float32, seed=rows)
    assert enc.bucket(x) == bucket
    out = enc(x)
    assert spy.sizes == [bucket or rows]  # padded to the bucket; above the largest, eager
    torch.testing.assert_close(out, programs[kind](x))


def test_on_the_cpu_the_program_runs_as_is(encoders):
    programs, engine_config = encoders
    spy = Spy(programs["vision"], 0)
    enc = GraphedEncoder(spy, "vision", "cpu", torch.float32, VISION_BUCKETS, engine_config=engine_config)
    x = make_input("vision", 3, torch.float32)
    assert torch.equal(enc(x), programs["vision"](x)) and spy.sizes == [3]


def test_inputs_outside_the_captured_layout_run_eager(encoders):
    """Another dtype, another patch shape, other mels, other level dtypes: the program judges them (and
    raises), as without buckets."""
    programs, engine_config = encoders
    vision = GraphedEncoder(programs["vision"], "vision", "cpu", torch.float32, engine_config=engine_config)
    audio = GraphedEncoder(programs["audio"], "audio", "cpu", torch.float32, engine_config=engine_config)
    for enc, x in (
        (vision, make_input("vision", 3, torch.float64)),
        (vision, torch.zeros(3, 2, 40, 40, 4)),
        (audio, torch.zeros(8, 40, dtype=torch.long)),
        (audio, torch.zeros(8, 80, dtype=torch.int32)),
    ):
        assert enc.bucket(x) is None
        with pytest.raises(Exception):  # noqa: B017  (the program's own error, whichever it is)
            enc(x)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_on_cuda(dtype):
    programs, engine_config = tiny_encoders("cuda", dtype)
    for kind, buckets, sizes in (
        ("vision", (2, 4, 8, 16), (3, 1, 16, 8, 5, 2)),
        ("audio", (16, 32, 64), (17, 2, 64, 16, 33, 100)),
    ):
        enc = GraphedEncoder(programs[kind], kind, "cuda", dtype, buckets, engine_config=engine_config)
        if kind == "audio":
            enc.warmup()
            assert sorted(enc.graphs) == list(buckets)
        outs = []
        for i, rows in enumerate(sizes):  # mixed order: stale rows in the static inputs, shared pool
            x = make_input(kind, rows, dtype, "cuda", seed=i)
            out = enc(x)
            outs.append((out, out.clone()))
            bucket = enc.bucket(x)
            if bucket is not None:
                padded = x.new_zeros(enc.input_shape(bucket))
                padded.narrow(0, 0, rows).copy_(x)
                assert torch.equal(out, programs[kind](padded)[:rows]), (kind, rows)
            torch.testing.assert_close(out, programs[kind](x))
        assert all(torch.equal(out, saved) for out, saved in outs)  # later replays leave earlier outputs be
        assert len(enc.graphs) == len(buckets)

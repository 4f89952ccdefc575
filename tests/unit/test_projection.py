"""bench/projection.py: the 1T's projection from bytes per GPU agrees with the bounds it stands on."""

from bench.bound import BANDWIDTH, decode_step_bytes
from bench.projection import busiest_share, main, step_seconds, total_weight_bytes
from inkling.published.config import preset


def test_one_gpu_step_is_the_byte_bound():
    """On one GPU without collectives a step is bench.bound's: inkling-bench's 1.52 ms at 8K (BENCHMARKS.md)."""
    c = preset("inkling-bench", nvfp4=True)
    nbytes, seconds = step_seconds(c, 8192, 1, 1, 0.0)
    assert abs(nbytes - decode_step_bytes(c, 8192).total) < 1
    assert abs(seconds - 1.517e-3) < 5e-6 and abs(seconds - nbytes / BANDWIDTH) < 1e-12


def test_the_busiest_gpu_holds_more_than_an_even_share():
    assert busiest_share(8, 256, 1) == 8
    eight = busiest_share(8, 256, 8)
    assert 1 < eight < 8 and busiest_share(8, 256, 4) > eight  # fewer GPUs, more experts each


def test_the_1t_needs_more_than_four_h200s_and_the_table_says_so(tmp_path):
    c = preset("inkling-1t", nvfp4=True)
    assert 4 * 141e9 < total_weight_bytes(c) < 8 * 141e9
    assert main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / "projection.md").read_text()
    assert "a projection from bytes per GPU, not a measurement" in text
    assert "| 4 | 148 GB (does not fit: over 141 GB) |" in text and "| 8 | 74 GB |" in text


def test_parallel_layouts_read_and_send_what_they_hold(tmp_path):
    """bench.parallel_projection: tensor parallelism reads 1/N of every part; attention-TP/EP reads whole
    experts on its busiest GPU; DP/EP reads the whole attention but sends only its own tokens, k times, on
    MoE layers; the table is labelled a projection."""
    from bench.parallel_projection import layout_step, main, parts_of, weights_per_gpu

    c = preset("inkling-1t", nvfp4=True)
    p = parts_of(c, 8192)
    tp = layout_step(c, p, "tp", 8, 1)
    want = (p.attention + p.dense + p.shared + p.unembed + 6 * p.expert + p.kv_per_user) / 8 + p.router
    assert abs(tp["read_bytes"] - want) < 1 and tp["distinct_experts"] == 6
    assert (
        tp["sent_bytes"] == 2 * p.layers * 2 * 7 / 8 * p.hidden * 2
    )  # two ring all-reduces of [1, H] a layer
    ep = layout_step(c, p, "attn-tp/ep", 8, 1)
    assert ep["read_bytes"] - tp["read_bytes"] > p.expert  # 6 experts on 8 GPUs: the busiest holds 2 or more
    dp = layout_step(c, p, "dp/ep", 8, 64)
    assert dp["read_bytes"] > p.attention + p.shared + p.unembed
    assert (
        dp["sent_bytes"] == 2 * p.moe_layers * 8 * 6 * 7 / 8 * p.hidden * 2
    )  # 8 local tokens, 6 experts each
    assert dp["sent_bytes"] < layout_step(c, p, "tp", 8, 64)["sent_bytes"]
    assert weights_per_gpu(c, p, "dp/ep", 8) > weights_per_gpu(c, p, "tp", 8)
    assert main(["--out", str(tmp_path), "--batches", "1,64"]) == 0
    assert "a projection, not a measurement" in (tmp_path / "parallel_projection.md").read_text()

"""The hardware bound against GPU.md's worked figures for inkling-bench."""

import pytest

from bench.bound import decode_batch_seconds, decode_step_bytes, expected_distinct_experts, prefill_flops
from inkling.config import preset


def test_decode_step_bytes_match_gpu_md():
    """GPU.md: about 7.32 GB per step at 8K context, 1.68 ms at 4.35 TB/s, about 594 tokens/s."""
    b = decode_step_bytes(preset("inkling-bench"), 8192)
    assert b.total == pytest.approx(7.32e9, rel=0.01)
    assert b.seconds == pytest.approx(1.68e-3, rel=0.01)
    assert 1 / b.seconds == pytest.approx(594, rel=0.01)
    assert b.lm_head == pytest.approx(2.87e9, rel=0.01)


def test_more_experts_cost_more_bytes_and_prefill_grows_with_context():
    c = preset("inkling-bench")
    extra = 6 * 43 * 3 * 2560 * 7168 * 0.5625  # 43 more NVFP4 experts in each of 6 layers
    more = decode_step_bytes(c, 8192, distinct_experts=49).total
    assert more == pytest.approx(decode_step_bytes(c, 8192).total + extra)
    assert prefill_flops(c, 2048) < prefill_flops(c, 4096) / 1.9


def test_bytes_per_gpu_under_tensor_parallelism():
    """tp 2 and 4: everything a rank slices halves/quarters, lm_head's vocabulary rows included; the router
    is read whole by every rank. inkling-bench has 8 KV heads, so its KV splits too; with 1 KV head it is
    replicated."""
    c = preset("inkling-bench")
    whole = decode_step_bytes(c, 8192)
    router = c.num_hidden_layers * c.num_router_outputs * c.hidden_size * 2
    for n in (2, 4):
        per_gpu = decode_step_bytes(c, 8192, tp_size=n)
        assert per_gpu.lm_head == whole.lm_head / n  # 200192 rows split evenly
        assert per_gpu.kv == pytest.approx(whole.kv / n)
        assert per_gpu.weights == pytest.approx((whole.weights - router) / n + router)
    one_kv_head = c.replace(num_key_value_heads=1)
    assert decode_step_bytes(one_kv_head, 8192, tp_size=4).kv == decode_step_bytes(one_kv_head, 8192).kv


def test_batch_bound_counts_the_experts_a_batch_touches():
    """Batch 1 is the one-token bound; at 32 distinct tokens inkling-bench's layers touch ~136 of 256 experts
    (uniform routing), and the step's bound is 8.9 ms (bench/results/history.md, end-to-end run 15)."""
    c = preset("inkling-bench")
    assert decode_batch_seconds(c, 8256, 1) == pytest.approx(decode_step_bytes(c, 8256).seconds)
    assert expected_distinct_experts(c, 1) == pytest.approx(6)
    assert expected_distinct_experts(c, 32) == pytest.approx(136.1, abs=0.1)
    assert decode_batch_seconds(c, 8256, 32) == pytest.approx(8.91e-3, rel=0.01)
    steps = [decode_batch_seconds(c, 8256, b) for b in (1, 8, 32, 64)]
    assert steps == sorted(steps) and steps[-1] < 64 * steps[0]


def test_real_bytes_per_gpu_under_tensor_parallelism():
    """inkling-1t at tp 8 (builder/tensor_parallel.py): every kind's KV heads split (8 and 16 of them), so
    the KV and the unembedding are 1/8 a GPU, the weights 1/8 but for the router, which every rank reads
    whole; the relative banks too."""
    from bench.bound import real_decode_step_bytes
    from inkling.published.config import preset as real_preset

    c = real_preset("inkling-1t", nvfp4=True)
    t = c.text
    one, eight = real_decode_step_bytes(c, 8192), real_decode_step_bytes(c, 8192, tp_size=8)
    router = sum(
        (t.n_routed_experts + t.n_shared_experts) * t.hidden_size * 2
        for i in range(t.num_hidden_layers)
        if not t.is_dense(i)
    )
    assert eight.kv == pytest.approx(one.kv / 8) and eight.rel_embed == one.rel_embed
    assert eight.lm_head == pytest.approx(one.lm_head / 8, rel=1e-4)
    assert eight.weights == pytest.approx((one.weights - router) / 8 + router)

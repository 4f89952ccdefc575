"""The hardware bound of a decode step and a prefill (bench/bound.py) on the real Inkling's shapes."""

import numpy as np
import pytest

from bench.bound import (
    decode_batch_seconds,
    decode_step_bytes,
    expected_distinct_experts,
    prefill_flops,
    routed_distinct_experts,
)
from inkling.published.config import preset


def test_bench_step_bytes_and_batches():
    """inkling-bench at 8K reads 6.60 GB a step at batch 1 (BENCHMARKS.md: 1.52 ms); a batch touches more
    experts, up to all 256, and its bound grows with it but far less than the batch."""
    c = preset("inkling-bench", nvfp4=True)
    one = decode_step_bytes(c, 8192)
    assert one.total == pytest.approx(6.60e9, rel=0.005)
    assert decode_batch_seconds(c, 8192, 1) == pytest.approx(one.seconds)
    assert expected_distinct_experts(c, 1) == pytest.approx(6)
    assert 6 < expected_distinct_experts(c, 32) < expected_distinct_experts(c, 64) < 256
    steps = [decode_batch_seconds(c, 8192, b) for b in (1, 8, 32, 64)]
    assert steps == sorted(steps) and steps[-1] < 8 * steps[0]
    assert decode_step_bytes(c, 8192, distinct_experts=256).weights > one.weights


def test_the_bound_of_a_measured_routing():
    """Even loads touch uniform routing's experts; loads on a quarter of the experts touch at most that
    quarter, and a batch's bound with them is below uniform routing's. Layers without loads are left out."""
    c = preset("inkling-bench", nvfp4=True)
    k = c.text.num_experts_per_tok
    even = np.full((6, 256), 100)
    assert routed_distinct_experts(even, k, 32) == pytest.approx(expected_distinct_experts(c, 32))
    skewed = np.zeros((6, 256))
    skewed[:, :64] = 100
    skewed[5] = 0  # a layer that saw no tokens
    distinct = routed_distinct_experts(skewed, k, 32)
    assert 60 < distinct <= 64
    assert decode_batch_seconds(c, 8192, 32, distinct) < decode_batch_seconds(c, 8192, 32)
    assert routed_distinct_experts(np.zeros((6, 256)), k, 32) is None


def test_prefill_grows_faster_than_the_prompt():
    c = preset("inkling-bench", nvfp4=True)
    assert prefill_flops(c, 16384) > 2 * prefill_flops(c, 8192)


def test_bytes_per_gpu_under_tensor_parallelism():
    """inkling-1t at tp 8 (builder/tensor_parallel.py): every kind's KV heads split (8 and 16 of them), so
    the KV and the unembedding are 1/8 a GPU, the weights 1/8 but for the router, which every rank reads
    whole; the relative banks too."""
    c = preset("inkling-1t", nvfp4=True)
    t = c.text
    one, eight = decode_step_bytes(c, 8192), decode_step_bytes(c, 8192, tp_size=8)
    router = sum(
        (t.n_routed_experts + t.n_shared_experts) * t.hidden_size * 2
        for i in range(t.num_hidden_layers)
        if not t.is_dense(i)
    )
    assert eight.kv == pytest.approx(one.kv / 8) and eight.rel_embed == one.rel_embed
    assert eight.lm_head == pytest.approx(one.lm_head / 8, rel=1e-4)
    assert eight.weights == pytest.approx((one.weights - router) / 8 + router)

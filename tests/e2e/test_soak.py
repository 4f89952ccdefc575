"""A CI-sized soak (bench/soak.py is the 20,000-request one): short requests of every kind through LLM
leave nothing behind, and the Python memory the engine holds stops growing once its bounded structures
(the prefix cache over the pool, the histograms) are full: no per-token or per-request list."""

from __future__ import annotations

import gc
import sys

from bench.soak import leftovers, soak
from runtime import LLM


def test_short_requests_leave_nothing_behind(engine_f32):
    llm = LLM(engine_f32[0])
    blocks = []

    def record(line: str) -> None:
        gc.collect()
        blocks.append(sys.getallocatedblocks())

    result = soak(llm, requests=384, batch=32, every=64, log=record)
    assert not result["leaked"] and not result["failed_requests"], result
    assert leftovers(llm) == {"held_blocks": 0, "busy_slots": 0, "requests": 0, "running": 0, "waiting": 0}
    # After 128 requests of warm-up, Python's allocated blocks stay within noise: a list growing by a float
    # a token would add about 1,000 blocks over the last 256 requests.
    growth = blocks[-1] - blocks[1]
    assert growth < 500, blocks

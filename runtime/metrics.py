"""Engine metrics over its whole life in bounded memory: counters and fixed-bucket histograms, never a
list that grows with every token (a server runs for weeks)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .speculative import AcceptanceStats

# Seconds; the bounds vLLM's histograms use for time to first token and inter-token latency, so a
# dashboard built for them reads ours alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class Histogram:
    """Observations counted per bucket (`bounds` are upper bounds; the last bucket is +inf), with their
    sum and count: the Prometheus histogram's content."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        """Record `value` n times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n
        self.count += n

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, +inf last: Prometheus' `_bucket` series."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


@dataclass
class EngineStats:
    """What an engine has done since it started: token and step counters, and latency histograms."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    generated_tokens: int = 0
    overlapped_steps: int = 0  # steps launched before the previous step's tokens were on the host
    step_seconds: float = 0.0  # the host's wall time inside step()
    first_tokens: int = 0  # requests that got a first token
    ttft_seconds: float = 0.0  # their times to first token, summed
    failed_requests: int = 0  # ended by an error while serving (the engine went on)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def summary(
        self, usage: dict[str, int], preemptions: int, acceptance: AcceptanceStats
    ) -> dict[str, float]:
        """LLMEngine.metrics: latency means, cache usage (the BlockManager's `usage()`), preemptions,
        failures, and MTP acceptance over the engine's life, per draft position too."""
        acc = acceptance
        out = {
            "mean_ttft_s": self.ttft.mean,
            "mean_itl_s": self.itl.mean,
            "cache_usage": usage["used_blocks"] / usage["total_blocks"],
            "generated_tokens": self.generated_tokens,
            "preemptions": preemptions,
            "failed_requests": self.failed_requests,
            "mean_acceptance_length": acc.mean_acceptance_length if acc.steps else 1.0,
            "acceptance_rate": acc.acceptance_rate,
        }
        for i, rate in enumerate(acc.acceptance_rates):
            out[f"acceptance_rate_{i + 1}"] = rate
        return out

    def counters(self) -> dict[str, float]:
        """The counters (no histograms), as cache_stats reports them."""
        return {k: v for k, v in vars(self).items() if not isinstance(v, Histogram)}

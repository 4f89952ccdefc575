"""BuildConfig and PluginConfig: what `trtllm-build`'s users know, for Inkling engines.

Both are frozen dataclasses validated on construction and written into the engine's config.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("bfloat16", "float32")
DEVICES = ("cpu", "cuda")
# The plugin families an engine's ops come from: "attention" (bank_attention, kv_cache_write), "sconv" and
# "moe" (sigmoid_sink_moe); the tensor-parallel collectives have their own setting below.
PLUGINS = ("attention", "sconv", "moe")


class BuildError(ValueError):
    """A build that cannot be made as asked."""


def require_divides(split: str, n: int, sizes: list[tuple[str, int]]) -> None:
    """A split over n ranks (split: "tp_size", "ep_size") must divide each (what, size) it cuts."""
    for what, size in sizes:
        if size % n:
            raise BuildError(f"{split} {n} does not divide {what} ({size})")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise BuildError(msg)


@dataclass(frozen=True)
class PluginConfig:
    """Which implementation each plugin op uses: "auto" picks triton on CUDA and reference elsewhere (and,
    for the attention, gluon where the build runs on a Hopper GPU: builder.build.resolve_impls)."""

    # "gluon": bank_attention's one-head prefill launches on Hopper's wgmma (plugins/attention/
    # gluon_attention.py), the `tl` kernel for the rest (decode, verify, shapes Gluon does not take); a
    # CUDA engine built on sm_90. "triton" keeps every launch on the portable `tl` kernel.
    attention: str = "auto"
    sconv: str = "auto"
    moe: str = "auto"
    # inkling::reduce_scatter / all_gather of tensor-parallel engines: "reference" runs torch.distributed
    # (gloo on CPU, NCCL on CUDA), "triton" the Lamport kernel for small messages (CUDA, one host).
    collectives: str = "auto"
    tune: bool = True  # time the Triton kernels' tile choices at build time (CUDA engines)
    # tune only the token buckets sampled at no more than this many tokens (the others keep the default
    # tiles): a decode-only benchmark spends seconds instead of minutes in the prefill buckets
    tune_max_tokens: int = 1 << 30

    def __post_init__(self) -> None:
        for name in PLUGINS:
            value = getattr(self, name)
            known = ("auto", "reference", "triton") + (("gluon",) if name == "attention" else ())
            _require(value in known, f"plugin_config.{name}: unknown impl {value!r}; expected one of {known}")
        _require(self.tune_max_tokens >= 1, "plugin_config.tune_max_tokens must be at least 1")
        _require(
            self.collectives in ("auto", "reference", "triton"),
            f"plugin_config.collectives: unknown impl {self.collectives!r}",
        )

    def resolve(self, device: str) -> dict[str, str]:
        """The concrete impl of each op for a device, with the reason (for the build log)."""
        out = {}
        for name in PLUGINS:
            value = getattr(self, name)
            if value == "auto":
                value = "triton" if device == "cuda" else "reference"
            _require(
                value == "reference" or device == "cuda",
                f"plugin_config.{name}={value} needs a CUDA engine (device is {device})",
            )
            out[name] = value
        return out

    def resolve_collectives(self, device: str) -> str:
        """The collectives' impl, for tensor-parallel engines only: "auto" is reference (torch.distributed)
        everywhere, since the Lamport kernel pays only for small messages on one host."""
        value = "reference" if self.collectives == "auto" else self.collectives
        _require(
            value == "reference" or device == "cuda",
            f"plugin_config.collectives={value} needs a CUDA engine (device is {device})",
        )
        return value

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BuildConfig:
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 2048
    max_draft_len: int = 8
    tokens_per_block: int = 16
    kv_cache_free_gpu_memory_fraction: float = 0.9
    dtype: str = "bfloat16"
    device: str = "cpu"
    tp_size: int = 1
    # Expert parallelism (the real Inkling): ep_size ranks, each owning num_experts / ep_size whole routed
    # experts; alone, a 1/ep_size slice of the shared experts' width each and attention and the rest
    # replicated; with tp_size (= ep_size), on the same ranks: attention and the dense parts split by
    # tensor parallelism, the routed experts whole by expert parallelism (builder/expert_parallel.py).
    ep_size: int = 1
    # Data-parallel attention (the real Inkling): dp_size replicas of everything but the routed experts, each
    # with its own requests, KV cache and scheduler, meeting in the expert-parallel MoE on the same ranks
    # (dp_size = ep_size, tp_size 1): each MoE layer gathers the replicas' tokens, every rank computes its
    # experts' share for all of them, and a reduce-scatter hands each replica its own tokens' sums.
    dp_size: int = 1
    # torch.compile the step program at build and save the compiler's cache artifacts in the engine, so
    # that a load compiles from them; the runtime then compiles the MTP head program too. Off by default:
    # it adds the compile to every build (CPU builds and the GPU tests' many small ones included), and tp > 1
    # and ep > 1 builds do not support it yet. Its engine equals transformers token for token (float32,
    # H100, tests/gpu/test_compiled_gpu.py). A GPU engine that serves should use it: Inductor's fusion takes
    # the real Inkling's inkling-bench decode step from 3.44 to 2.99 ms at batch 1 and 6.27 to 5.70 ms at
    # batch 8 on one H100 (bench/results/gpu-2026-12-07/h100-compiled-batches/; the earlier model's, 2.82
    # to 2.60 on the H200).
    compile: bool = False
    plugin_config: PluginConfig = field(default_factory=PluginConfig)

    def __post_init__(self) -> None:
        if isinstance(self.plugin_config, dict):
            object.__setattr__(self, "plugin_config", PluginConfig(**self.plugin_config))
        for name in (
            "max_batch_size",
            "max_input_len",
            "max_seq_len",
            "max_num_tokens",
            "tokens_per_block",
            "tp_size",
            "ep_size",
            "dp_size",
        ):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(
            0 <= self.max_draft_len <= 8,
            f"max_draft_len must be in 0..8 (8 MTP heads), got {self.max_draft_len}",
        )
        _require(
            self.tp_size == 1 or self.ep_size in (1, self.tp_size),
            f"tp_size {self.tp_size} with ep_size {self.ep_size}: attention's tensor parallelism and the MoE's "
            "expert parallelism share their ranks, so ep_size must be 1 or equal tp_size",
        )
        _require(
            self.dp_size == 1 or (self.ep_size == self.dp_size and self.tp_size == 1),
            f"dp_size {self.dp_size} with ep_size {self.ep_size} and tp_size {self.tp_size}: data-parallel "
            "attention replicas meet in the expert-parallel MoE on the same ranks, so dp_size needs ep_size "
            "equal to it and tp_size 1 (attention tensor parallelism inside a replica is not built)",
        )
        _require(
            self.dp_size == 1 or self.max_num_tokens <= self.max_seq_len,
            f"dp_size {self.dp_size}: a replica pads its step to the replicas' largest with one padding "
            f"sequence, which must fit max_seq_len ({self.max_seq_len}); max_num_tokens is {self.max_num_tokens}",
        )
        _require(self.max_input_len <= self.max_seq_len, "max_input_len must not exceed max_seq_len")
        _require(self.max_num_tokens >= self.max_batch_size, "max_num_tokens must be at least max_batch_size")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(
            0 < self.kv_cache_free_gpu_memory_fraction <= 1,
            f"kv_cache_free_gpu_memory_fraction must be in (0, 1], got {self.kv_cache_free_gpu_memory_fraction}",
        )

    @property
    def world_size(self) -> int:
        """The ranks the engine runs on: tp_size, ep_size or dp_size; on the same ranks where several are set."""
        return max(self.tp_size, self.ep_size, self.dp_size)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["plugin_config"] = self.plugin_config.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        _require(not unknown, f"unknown build_config fields {unknown}")
        return cls(**d)

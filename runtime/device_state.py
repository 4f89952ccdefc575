"""The runtime's device state besides the weights: the KV pool, the sconv states of the running
sequences, the MTP heads' KV and sconv states, and the sconv snapshots of prefix-cache restore points
(docs/interfaces.md "KV cache", "Sconv state", "MTP heads"). Sized by the engine's build config and the
pool's block count; under tensor parallelism, the rank's slices."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from builder.config import BuildConfig

MAX_SNAPSHOTS = 1024  # sconv snapshot slots of prefix-cache restore points


def layout_k1(layout: dict) -> int:
    """K - 1: the sconv history rows a restore point keeps (the engine's cache layout records K)."""
    return layout["sconv_kernel_size"] - 1


def layout_rows(layout: dict, build: BuildConfig) -> int:
    """Rows of sconv history a slot holds: K - 1 plus a rollback's margin (max_draft_len)."""
    return layout_k1(layout) + build.max_draft_len


@dataclass
class DeviceState:
    key_caches: list[torch.Tensor]  # per pool slot: [num_blocks, block_size, Hkv, D]
    value_caches: list[torch.Tensor]
    conv_states: list[torch.Tensor]  # per layer and site (k, v, o, m): [max_batch_size, S, C]
    head_key_caches: list[torch.Tensor]  # per MTP head: the pool's shape
    head_value_caches: list[torch.Tensor]
    head_conv_states: list[list[torch.Tensor]]  # per MTP head, sites k, v, o: [max_batch_size, S, C]
    snapshots: list[torch.Tensor]  # per conv state: [num_snapshots, K - 1, C]
    expert_load: list[torch.Tensor]  # per MoE layer: int32 [num_experts] (runtime/expert_load.py)

    @classmethod
    def allocate(
        cls,
        layout: dict,
        build: BuildConfig,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        cache_blocks: list[int] | None = None,
        head_blocks: int | None = None,
    ) -> DeviceState:
        """Zeroed state (builder/build.py `cache_layout`): each cache with its kind's
        KV heads (full and sliding layers differ) and cache_blocks[i] blocks (default num_blocks: its
        kind's pool, runtime/block_manager.py), sconv states and snapshots in float32 as transformers
        keeps them; each built MTP depth's KV cache (its kind's KV heads, indexed by the block ids of
        group 0: head_blocks of them, default num_blocks) and its four sconv states."""
        rows, slots, K1 = layout_rows(layout, build), build.max_batch_size, layout_k1(layout)
        f32 = dict(dtype=torch.float32, device=device)
        sizes = cache_blocks or [num_blocks] * len(layout["cache_kv_heads"])

        def kv() -> list[torch.Tensor]:
            shapes = zip(sizes, layout["cache_kv_heads"], layout["cache_head_dims"])
            return [
                torch.zeros(n, build.tokens_per_block, h, d, dtype=dtype, device=device) for n, h, d in shapes
            ]

        def head_kv() -> list[torch.Tensor]:
            shapes = zip(layout.get("mtp_kv_heads", []), layout.get("mtp_head_dims", []))
            return [
                torch.zeros(
                    head_blocks or num_blocks, build.tokens_per_block, h, d, dtype=dtype, device=device
                )
                for h, d in shapes
            ]

        channels = layout["conv_channels"]
        return cls(
            key_caches=kv(),
            value_caches=kv(),
            conv_states=[torch.zeros(slots, rows, C, **f32) for C in channels],
            head_key_caches=head_kv(),
            head_value_caches=head_kv(),
            head_conv_states=[
                [torch.zeros(slots, rows, C, **f32) for C in sites]
                for sites in layout.get("mtp_conv_channels", [])
            ],
            snapshots=[torch.zeros(min(num_blocks, MAX_SNAPSHOTS), K1, C, **f32) for C in channels],
            expert_load=[
                torch.zeros(layout.get("num_experts", 0), dtype=torch.int32, device=device)
                for _ in layout.get("moe_layers", [])
            ],
        )

    @property
    def num_snapshots(self) -> int:
        return self.snapshots[0].shape[0] if self.snapshots else 0

    def reset_slot(self, slot: int) -> None:
        """Zero a sequence's sconv states, the main model's and its heads' (x[t<0] = 0)."""
        for t in self.conv_states:
            t[slot].zero_()
        for states in self.head_conv_states:
            for t in states:
                t[slot].zero_()

    def nbytes(self) -> dict[str, int]:
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        return {
            "kv_cache_bytes": size(self.key_caches) + size(self.value_caches),
            "conv_state_bytes": size(self.conv_states),
            "head_state_bytes": size(self.head_key_caches)
            + size(self.head_value_caches)
            + size(t for s in self.head_conv_states for t in s),
            "snapshot_bytes": size(self.snapshots),
        }

"""The attention plugin: `bank_attention`, the real Inkling's causal GQA attention with its relative bank
and log scaling (INKLING_SPEC §3.4) over the paged KV cache, and `kv_cache_write`, which fills that cache
(docs/interfaces.md).

Ops (namespace `inkling`; last argument `impl`: "reference" | "triton", and for bank_attention "gluon": the
`tl` kernel with its one-head prefill launches on Hopper's wgmma, gluon_attention.py, where they fit):
- kv_cache_write(k [T, Hkv, D], v, key_cache [NB, BS, Hkv, D] (mutated), value_cache (mutated),
  slot_mapping int64 [T] (-1 = skip), impl) -> ()
- bank_attention(q [T, Hq, D], r [T, Hq, d_rel], bank [d_rel, X], key_cache, value_cache,
  block_table int32 [B, MB], cu_seqlens_q int32 [B+1], seq_lens int32 [B], max_seqlen_q, window (0: full),
  scale, log_floor (0: none), log_alpha, impl) -> out [T, Hq, D]

The "triton" impl never synchronises with the host (CUDA-graph safe): tiles and the number of KV
splits come from shapes, max_seqlen_q and the block table's capacity. Rows of `out` past
cu_seqlens_q[B] (padding of a graph bucket) are left undefined.
"""

from __future__ import annotations

import torch

from ..registry import PluginSpec, check_impl, register
from ..triton_utils import can_run_triton
from . import reference

KV_WRITE_SPEC = register(
    PluginSpec(name="kv_cache_write", version=1, doc="scatter new K/V rows into the paged cache")
)


def _require_triton(name: str, t: torch.Tensor) -> None:
    if not can_run_triton(t):
        raise RuntimeError(
            f"inkling::{name} impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got {t.device}"
        )


@torch.library.custom_op("inkling::kv_cache_write", mutates_args=("key_cache", "value_cache"))
def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: str,
) -> None:
    check_impl(KV_WRITE_SPEC.name, impl)
    if impl == "triton":
        _require_triton(KV_WRITE_SPEC.name, k)
        from . import launcher

        launcher.kv_cache_write(k, v, key_cache, value_cache, slot_mapping)
    else:
        reference.kv_cache_write(k, v, key_cache, value_cache, slot_mapping)


@kv_cache_write.register_fake
def _(k, v, key_cache, value_cache, slot_mapping, impl) -> None:
    return None


BANK_SPEC = register(
    PluginSpec(
        name="bank_attention",
        version=2,  # 2: the Triton kernel
        impls=("reference", "triton", "gluon"),
        doc="the real Inkling's paged GQA attention: q/k normed, 1/D, the layer's shared relative bank "
        "(zero beyond its extent), log scaling; prefill, verify, split-KV decode",
    )
)


@torch.library.custom_op("inkling::bank_attention", mutates_args=())
def bank_attention(
    q: torch.Tensor,
    r: torch.Tensor,
    bank: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    window: int,
    scale: float,
    log_floor: int,
    log_alpha: float,
    impl: str,
) -> torch.Tensor:
    """bank_attention(q [T, Hq, D], r [T, Hq, d_rel], bank [d_rel, X], key_cache, value_cache, block_table,
    cu_seqlens_q, seq_lens, max_seqlen_q, window (0: full), scale, log_floor (0: none), log_alpha, impl)."""
    check_impl(BANK_SPEC.name, impl)
    if impl in ("triton", "gluon"):
        _require_triton(BANK_SPEC.name, q)
        from . import launcher

        return launcher.bank_attention(
            q, r, bank, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, window,
            scale, log_floor, log_alpha, gluon=impl == "gluon",
        )  # fmt: skip
    return reference.bank_attention(
        q, r, bank, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, window, scale,
        log_floor, log_alpha,
    )  # fmt: skip


@bank_attention.register_fake
def _(q, r, bank, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, window, scale,
      log_floor, log_alpha, impl):  # fmt: skip
    return torch.empty_like(q)


__all__ = ["KV_WRITE_SPEC", "BANK_SPEC", "kv_cache_write", "bank_attention"]

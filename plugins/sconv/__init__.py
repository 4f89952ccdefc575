"""`inkling::sconv` and `inkling::sconv_kv_write`: the causal depthwise convolution of §3.2 with its
per-sequence state (docs/interfaces.md "Sconv state"), plus `sconv_rollback` for rejected drafts.

`sconv_kv_write` convolves K and V, writes them into the paged KV cache and returns them: one
launch instead of two sconvs and a cache write.
"""

from __future__ import annotations

import torch

from ..registry import PluginSpec, check_impl, register
from ..triton_utils import can_run_triton
from . import reference
from .reference import sconv_rollback  # noqa: F401

SPEC = register(PluginSpec(name="sconv", version=1, doc="causal depthwise conv with state (§3.2)"))
KV_SPEC = register(
    PluginSpec(name="sconv_kv_write", version=1, doc="sconv of K and V fused with the paged KV-cache write")
)


def _triton_ok(name: str, t: torch.Tensor) -> None:
    if not can_run_triton(t):
        raise RuntimeError(f"inkling::{name} impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")


@torch.library.custom_op("inkling::sconv", mutates_args=("state",))
def sconv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    check_impl(SPEC.name, impl)
    if impl == "reference":
        return reference.sconv(x, weight, state, state_indices, cu_seqlens_q)
    _triton_ok(SPEC.name, x)
    from . import launcher

    return launcher.sconv(x, weight, state, state_indices, cu_seqlens_q)


@sconv.register_fake
def _sconv_fake(x, weight, state, state_indices, cu_seqlens_q, impl):
    return torch.empty_like(x)


@torch.library.custom_op(
    "inkling::sconv_kv_write", mutates_args=("state_k", "state_v", "key_cache", "value_cache")
)
def sconv_kv_write(
    k_raw: torch.Tensor,
    v_raw: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    state_k: torch.Tensor,
    state_v: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_impl(KV_SPEC.name, impl)
    args = (
        k_raw,
        v_raw,
        wk,
        wv,
        state_k,
        state_v,
        state_indices,
        cu_seqlens_q,
        key_cache,
        value_cache,
        slot_mapping,
    )
    if impl == "reference":
        return reference.sconv_kv_write(*args)
    _triton_ok(KV_SPEC.name, k_raw)
    from . import launcher

    return launcher.sconv_kv_write(*args)


@sconv_kv_write.register_fake
def _sconv_kv_write_fake(
    k_raw,
    v_raw,
    wk,
    wv,
    state_k,
    state_v,
    state_indices,
    cu_seqlens_q,
    key_cache,
    value_cache,
    slot_mapping,
    impl,
):
    T = k_raw.shape[0]
    Hkv, D = key_cache.shape[2], key_cache.shape[3]
    return k_raw.new_empty((T, Hkv, D)), v_raw.new_empty((T, Hkv, D))

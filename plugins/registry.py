"""The plugin registry: every `inkling::*` custom op registers its spec here when its module is imported.

Conventions (docs/interfaces.md):
- an op is a `torch.library.custom_op` in the namespace `inkling`;
- its last argument is `impl: str`, the implementation the builder chose ("reference" or "triton"),
  a plugin attribute recorded in the exported program the way TensorRT serialises plugin fields;
- "reference" is plain PyTorch on any device; "triton" needs CUDA (or TRITON_INTERPRET=1 on CPU tensors);
- each op has a fake (meta) implementation so that torch.export can trace it;
- an op that reads weights in a layout of its own records a weight-layout version.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "inkling"
IMPLS = ("reference", "triton")


@dataclass(frozen=True)
class PluginSpec:
    name: str
    version: int
    impls: tuple[str, ...] = IMPLS
    weight_layout_version: int | None = None
    doc: str = ""

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


_REGISTRY: dict[str, PluginSpec] = {}


def register(spec: PluginSpec) -> PluginSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] != spec:
        raise ValueError(f"plugin {spec.name} registered twice with different specs")
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> PluginSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown plugin {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def all_plugins() -> dict[str, PluginSpec]:
    return dict(_REGISTRY)


def check_impl(name: str, impl: str) -> None:
    spec = get(name)
    if impl not in spec.impls:
        raise ValueError(f"plugin {name}: unknown impl {impl!r}; expected one of {spec.impls}")

"""Inkling's plugins: `torch.library` custom ops in the namespace `inkling`.

Importing this package registers every op (as TensorRT-LLM loads its plugin library); see
docs/interfaces.md for the contract and `plugins.registry` for versions.
"""

import importlib

from .registry import PluginSpec, all_plugins, get  # noqa: F401

_OP_MODULES = ("attention", "sconv", "moe", "collectives")

for _name in _OP_MODULES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _e:  # an op module not written yet
        if _e.name != f"{__name__}.{_name}":
            raise

"""checkpoint -> engine: BuildConfig, PluginConfig, build(), Engine.save / Engine.from_dir, a minimal runner."""

from .build import build
from .config import BuildConfig, BuildError, PluginConfig
from .engine import ENGINE_FORMAT_VERSION, Engine, EngineError
from .runner import EngineRunner, Prompt

__all__ = [
    "ENGINE_FORMAT_VERSION",
    "BuildConfig",
    "BuildError",
    "Engine",
    "EngineError",
    "EngineRunner",
    "PluginConfig",
    "Prompt",
    "build",
]

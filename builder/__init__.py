"""checkpoint -> engine: BuildConfig, PluginConfig, build(), Engine.save / Engine.from_dir."""

from .build import build
from .config import BuildConfig, BuildError, PluginConfig
from .engine import ENGINE_FORMAT_VERSION, Engine, EngineError

__all__ = [
    "ENGINE_FORMAT_VERSION",
    "BuildConfig",
    "BuildError",
    "Engine",
    "EngineError",
    "PluginConfig",
    "build",
]

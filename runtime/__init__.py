"""engine -> tokens: paged caches, continuous batching, sampling, streaming (DESIGN.md "Runtime").

`LLM` is the Python API, `EngineLoop` the background engine thread a server uses, `LLMEngine` the
step-at-a-time core.
"""

from .engine import LLMEngine, PromptInput, StreamDelta
from .llm import LLM, EngineLoop, RequestOutput
from .params import SamplingParams

__all__ = ["LLM", "EngineLoop", "LLMEngine", "PromptInput", "RequestOutput", "SamplingParams", "StreamDelta"]

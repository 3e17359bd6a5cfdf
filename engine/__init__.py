"""Flashgate's DeepSeek-V4 inference engine. Importable without the console; only `engine.server` needs a web stack.

from engine import LLM, SamplingParams
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

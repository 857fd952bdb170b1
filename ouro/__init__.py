"""ouro: a serving stack for GLM-5.3-Flash-class hybrid models."""

from .engine.llm import LLM
from .engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]

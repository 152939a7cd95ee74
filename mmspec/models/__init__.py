"""Network definitions no library provides."""

from .tiny_lm import TinyCausalLM, TinyLMConfig

__all__ = ["TinyCausalLM", "TinyLMConfig"]

"""Network definitions no library provides.

The diffusers-based models (``LlamaGenModel``, ``TinyVQModel``) import lazily: the core and its tests
should not pay for importing diffusers.
"""

from .tiny_lm import TinyCausalLM, TinyLMConfig

_LAZY = {"LlamaGenModel": ".llamagen", "TinyVQModel": ".vq"}

__all__ = ["TinyCausalLM", "TinyLMConfig", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

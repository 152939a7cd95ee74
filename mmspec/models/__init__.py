"""Network definitions no library provides.

The diffusers-based models (``LlamaGenModel``, ``TinyVQModel``, ``ShapesClassifier``) and
``load_llamagen_gpt`` (LlamaGen's released c2i GPT checkpoints as a ``LlamaGenModel``),
``LlamaGenVQModel`` and ``load_llamagen_vq`` (its VQ tokenizers in their own layout) import lazily:
the core and its tests should not pay for importing diffusers.
"""

from .tiny_lm import TinyCausalLM, TinyLMConfig

_LAZY = {"LlamaGenModel": ".llamagen", "ShapesClassifier": ".classifier", "TinyVQModel": ".vq",
         "load_llamagen_gpt": ".llamagen_convert", "LlamaGenVQModel": ".llamagen_vq", "load_llamagen_vq": ".llamagen_vq"}

__all__ = ["TinyCausalLM", "TinyLMConfig", "load_checkpoint", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_checkpoint(cls, path, dtype=None):
    """``cls.from_pretrained(path)`` from a local folder, safetensors only, computed in ``dtype``
    (default float32: checkpoints ship as fp16, the CPU computes in fp32)."""
    import torch

    return cls.from_pretrained(path, use_safetensors=True, dtype=dtype or torch.float32).eval()

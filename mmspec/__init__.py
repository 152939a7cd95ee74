"""mmspec: speculative acceleration for multimodal generation."""

__version__ = "0.1.0"

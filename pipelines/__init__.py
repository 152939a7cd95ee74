"""Diffusers-style pipelines (installed as ``mmspec.pipelines``); one file per pipeline."""

_LAZY = {"SpeculativePipeline": ".base",
         "SpeculativeARImagePipeline": ".ar_image", "ARImagePipelineOutput": ".ar_image",
         "SpeculativeGlmImagePipeline": ".glm_image", "GlmImageSpeculativeOutput": ".glm_image",
         "SpeculativeContinuousARPipeline": ".continuous", "ContinuousARPipelineOutput": ".continuous",
         "SpeculativeVLMPipeline": ".vlm", "VLMPipelineOutput": ".vlm",
         "StreamingVideoPipeline": ".video", "StreamingVideoPipelineOutput": ".video", "VideoChunk": ".video",
         "CacheLimitError": ".video", "save_video": ".video", "save_frame_strip": ".video"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

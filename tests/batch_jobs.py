"""A parsed ``mmspec batch`` job for the grouping tests (``make_batches``, ``make_streams``)."""

from mmspec import batch


def job(i: int, kind: str = "vlm", temperature: float = 0.0, method: str = "vispec") -> batch.Job:
    """Job ``i`` of ``kind`` (a VLM question or an AR class prompt) with its seed ``i``."""
    params = {"image": "x", "question": f"q{i}", "max_new_tokens": 8, "temperature": temperature}
    if kind == "ar-image":
        params = {"prompt": "a red circle", "guidance_scale": 2.0, "temperature": 1.0, "top_k": None, "top_p": None}
    return batch.Job(i, f"j{i}", kind, method, i, params)

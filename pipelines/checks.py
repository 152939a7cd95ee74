"""Argument checks every pipeline's ``check_inputs`` runs before any model does.

Each function raises ``ValueError("<name> must be <allowed>, got <value>")`` (``core.errors``) and
returns nothing or the value in its normal form. Concise errors over silent correction: a seed is
not turned into a generator, a grey or RGBA image is not converted, 0-255 floats are not clipped.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np
import PIL.Image
import torch

from ..core.errors import check, check_choice, check_int, is_int  # noqa: F401 (the int check lives in core)


def is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def check_number(value, name: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                 optional: bool = False) -> None:
    """A finite real number (not a bool) in the range: ``[low, high]``, or ``(low, high]`` with
    ``low_open``."""
    if optional and value is None:
        return
    if low is not None and high is not None:
        allowed = f"a number in {'(' if low_open else '['}{low}, {high}]"
    elif low is not None:
        allowed = f"a number {'>' if low_open else '>='} {low}"
    else:
        allowed = "a finite number"
    ok = is_number(value) and (low is None or value > low or (not low_open and value == low)) \
        and (high is None or value <= high)
    check(ok, name, f"None or {allowed}" if optional else allowed, value)


def check_flag(value, name: str) -> None:
    check(isinstance(value, bool), name, "True or False", value)


def check_callback(value, name: str) -> None:
    check(value is None or callable(value), name, "None or a callable", value)


def check_output_type(value, allowed) -> None:
    check_choice("output_type", value, allowed)


def check_prompts(prompts, name: str = "prompt") -> list[str]:
    """A non-empty string or a non-empty list (or tuple) of them; returns the list."""
    allowed = "a non-empty string or a non-empty list of non-empty strings"
    if isinstance(prompts, str):
        check(prompts.strip() != "", name, allowed, prompts)
        return [prompts]
    check(isinstance(prompts, (list, tuple)) and len(prompts) > 0, name, allowed, prompts)
    for i, p in enumerate(prompts):
        check(isinstance(p, str) and p.strip() != "", f"{name}[{i}]", "a non-empty string", p)
    return list(prompts)


def check_generator(generator, batch_size: int | None = None) -> None:
    """``None``, a ``torch.Generator``, or (when the pipeline draws per image: ``batch_size``
    given) a list of ``batch_size`` of them. A seed is refused, not seeded for the caller: which
    device and stream it should seed is the caller's choice."""
    how = "for a seed, pass torch.Generator().manual_seed(seed)"
    if isinstance(generator, (list, tuple)) and batch_size is not None:
        check(len(generator) == batch_size and all(isinstance(g, torch.Generator) for g in generator),
              "generator", f"a torch.Generator, None, or a list of {batch_size} torch.Generators (one per image)",
              generator)
        return
    allowed = "a torch.Generator or None" + ("" if batch_size is None else f" (or a list of {batch_size})")
    check(generator is None or isinstance(generator, torch.Generator), "generator", f"{allowed}; {how}", generator)


def check_method(modality: str, method, method_knobs):
    """``method`` and its ``method_knobs`` through the method registry (``mmspec.methods.resolve``):
    unknown names list the allowed ones, knobs of the wrong type or range are named. Returns the
    resolved recipe."""
    from .. import methods

    return methods.resolve(modality, method, method_knobs)


def check_class_labels(class_labels, num_classes: int) -> list[int]:
    """A class id or a non-empty list of them, each an int in ``[0, num_classes)``; returns the list."""
    allowed = f"an int in [0, {num_classes}) or a non-empty list of them"
    labels = class_labels if isinstance(class_labels, (list, tuple)) else [class_labels]
    check(len(labels) > 0, "class_labels", allowed, class_labels)
    for c in labels:
        check(is_int(c) and 0 <= c < num_classes, "class_labels", allowed, class_labels)
    return [int(c) for c in labels]


IMAGE_FORMS = ("an RGB PIL image, an (H, W, 3) numpy array (uint8, or floats in [0, 1]) or a (3, H, W) "
               "float tensor in [0, 1]")


def check_image(image, name: str = "image") -> None:
    """One image in one of ``IMAGE_FORMS``. Other PIL modes, channel-first arrays, channel-last
    tensors, integer arrays other than uint8 and floats outside [0, 1] are refused (a 0-255 float
    array would otherwise be clipped to a white image)."""
    if isinstance(image, PIL.Image.Image):
        check(image.mode == "RGB", f"{name}.mode", "'RGB' (convert with image.convert('RGB'))", image.mode)
        check(min(image.size) > 0, f"{name}.size", "non-empty (width, height)", image.size)
        return
    if isinstance(image, np.ndarray):
        shape, layout = image.shape, "(H, W, 3)"
        if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3:
            layout += " (channels last: transpose a (3, H, W) array with .transpose(1, 2, 0))"
        check(image.ndim == 3 and shape[-1] == 3 and min(shape) > 0, f"{name}.shape", layout, shape)
        if image.dtype == np.uint8:
            return
        check(np.issubdtype(image.dtype, np.floating), f"{name}.dtype", "uint8 or a float dtype", str(image.dtype))
        _check_unit_range(torch.from_numpy(np.ascontiguousarray(image)), name, "divide 0-255 values by 255")
        return
    if isinstance(image, torch.Tensor):
        layout = "(3, H, W)"
        if image.dim() == 3 and image.shape[-1] == 3 and image.shape[0] != 3:
            layout += " (channels first: permute an (H, W, 3) tensor with .permute(2, 0, 1))"
        check(image.dim() == 3 and image.shape[0] == 3 and min(image.shape) > 0, f"{name}.shape", layout,
              tuple(image.shape))
        check(image.is_floating_point(), f"{name}.dtype", "a float dtype (values in [0, 1])", image.dtype)
        _check_unit_range(image, name, "divide 0-255 values by 255")
        return
    check(False, name, IMAGE_FORMS, type(image).__name__)


def _check_unit_range(values: torch.Tensor, name: str, hint: str) -> None:
    lo, hi = values.min().item(), values.max().item()
    if not (math.isfinite(lo) and math.isfinite(hi) and lo >= 0 and hi <= 1):
        raise ValueError(f"{name} values must be floats in [0, 1] ({hint}), got values in [{lo:g}, {hi:g}]")


def check_images(images, count: int, name: str = "images") -> list:
    """One image per prompt (``count``): a single image when ``count`` is 1, else a list, where a
    prompt's image may also be a non-empty list of images (its images, in order)."""
    what = "one image (or a list of images) per prompt"
    check(images is not None, name, f"{what} ({count})", None)
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    check(len(images) == count, name, f"{what} ({count})", f"{len(images)} images")
    for i, image in enumerate(images):
        if isinstance(image, (list, tuple)):
            check(len(image) > 0, f"{name}[{i}]", "an image or a non-empty list of images", image)
            for j, one in enumerate(image):
                check_image(one, f"{name}[{i}][{j}]")
        else:
            check_image(image, f"{name}[{i}]")
    return images


def check_sampling(temperature, top_k=None, top_p=None, guidance_scale=None) -> None:
    """The sampling arguments as ``LogitsProcessor`` takes them (temperature 0 is greedy)."""
    check_number(temperature, "temperature", 0)
    check_int(top_k, "top_k", 1, optional=True)
    check_number(top_p, "top_p", 0, 1, low_open=True, optional=True)
    check_number(guidance_scale, "guidance_scale", 0, optional=True)

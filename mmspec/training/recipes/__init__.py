"""Training recipes that rebuild the tiny checkpoints from a seed: ``train_vq`` (the VQ tokenizer
on shapes) and ``train_ar_image`` (the class-conditional AR model on that tokenizer's ids)."""

from .ar_image import train_ar_image
from .vq import train_vq

__all__ = ["train_ar_image", "train_vq"]

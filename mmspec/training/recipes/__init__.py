"""Training recipes that rebuild the tiny checkpoints from a seed: ``train_vq`` (the VQ tokenizer
on shapes), ``train_ar_image`` (the class-conditional AR model on that tokenizer's ids), ``train_ar_draft``
(its drafts: EAGLE's feature head or a small chain model) and
``train_classifier`` (the shapes classifier whose features the AR image bench measures with),
``train_video_ae`` and ``train_video`` (the streaming video model's frame autoencoder and its
chunk-causal video transformer)."""

from .ar_draft import train_ar_draft
from .ar_image import train_ar_image
from .classifier import train_classifier
from .continuous import TOKENIZER_KINDS, train_continuous_ar, train_continuous_draft, train_continuous_tokenizer
from .vlm import train_vlm
from .vlm_draft import train_vlm_draft
from .video import train_video, train_video_ae
from .video_judge import train_video_judge
from .vq import train_vq

__all__ = ["train_ar_draft", "train_ar_image", "train_classifier", "train_video", "train_video_ae", "train_video_judge", "train_vlm", "train_vlm_draft",
           "train_vq"]

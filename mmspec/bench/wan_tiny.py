"""A tiny random Wan stream for ``mmspec bench video``'s Wan rows and the tests: diffusers'
``WanTransformer3DModel``, ``AutoencoderKLWan``, transformers' ``UMT5EncoderModel`` and a word-level
tokenizer, built from constructors under a seed (nothing downloaded), in
``StreamingVideoPipeline.from_wan``. Random weights draw noise, not videos: the rows measure the
cache's cost and flatness, not quality."""

from __future__ import annotations

import torch

TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=8, ffn_dim=32, num_layers=2, cross_attn_norm=True)
"""About 20k parameters; ``attention_head_dim`` 12 splits into Wan's t/h/w rotary parts 4/4/4."""
VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
           latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
WORDS = ["<pad>", "</s>", "<unk>", "a", "the", "red", "blue", "cat", "dog", "ball", "walks", "runs", "jumps", "on",
         "grass", "left", "right"]


def text_parts(seed: int = 0, d_model: int = 16):
    """(UMT5EncoderModel, PreTrainedTokenizerFast): a one-layer UMT5 over a word-level vocabulary
    (``WORDS``; other words are ``<unk>``), sequences ended by ``</s>`` as T5's tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(WORDS), d_model=d_model, d_kv=4, d_ff=32, num_layers=1,
                                          num_heads=2, relative_attention_num_buckets=8)).eval()
    return encoder, tokenizer


def tiny_wan_pipeline(seed: int = 0, num_layers: int = 2, **stream_config):
    """A ``StreamingVideoPipeline.from_wan`` over random tiny Wan parts: chunks of 3 latent frames,
    32 x 32 pixels (latent frames of 4 x 4, 2 x 2 tokens), 8 text tokens; ``stream_config``
    overrides (e.g. ``sink_frames``, ``window_frames``, ``position_policy``)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from ..pipelines import StreamingVideoPipeline

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**dict(TRANSFORMER, num_layers=num_layers)).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(**VAE).eval()
    encoder, tokenizer = text_parts(seed + 2)
    config = dict(height=32, width=32, max_text_length=8, sink_frames=3, window_frames=6)
    config.update(stream_config)
    pipe = StreamingVideoPipeline.from_wan(transformer, vae, encoder, tokenizer, chunk_frames=3, **config)
    pipe.set_progress_bar_config(disable=True)
    return pipe

"""Load LlamaGen's released class-conditional GPT checkpoints (FoundationVision/LlamaGen,
``autoregressive/models/gpt.py``) into our ``LlamaGenModel``.

LlamaGen's ``Transformer`` is already our block layout (fused ``wqkv``, ``wo``, SwiGLU
``w1``/``w3``/``w2``, pre-norm RMSNorm, the class token at position 0 with a null-class row, 2-D
RoPE), so conversion is a key rename plus a config read from the weight shapes. Two things cannot
be read from shapes: the number of heads (``gpt_model="GPT-B"`` or ``n_head=12``) and, unless the
state dict carries a ``freqs_cis`` buffer, the token grid side (``grid_size=16`` for the 256 px
models, 24 for the 384 px ones).

RoPE: LlamaGen's ``precompute_freqs_cis_2d`` + ``apply_rotary_emb`` is our ``GridRope2D``
exactly (complex pairs (2j, 2j+1), the first D/4 pairs by token row and the last D/4 by column,
frequencies ``base ** (-4j / D)``, base 10000), and its q/k/v split of ``wqkv`` is ours, so no
weight is permuted. One difference: its class-token row of the table is cos = sin = 0, which
zeroes the class token's query and key (so every query scores 0 on it); the converted model sets
``cls_rope="zero"`` to reproduce that.

Example (the download and the ``.pt`` -> safetensors step run outside mmspec, once; a ``.pt`` is a
pickle: ``weights_only=True`` where the file holds only tensors, ``False`` only for a file you
trust, e.g. a training checkpoint that pickles its argparse ``args``)::

    import torch
    from huggingface_hub import hf_hub_download
    from safetensors.torch import save_file

    for name in ("c2i_B_256.pt", "vq_ds16_c2i.pt"):
        pt = hf_hub_download("FoundationVision/LlamaGen", name)
        sd = torch.load(pt, map_location="cpu", weights_only=True)["model"]
        save_file({k: v.contiguous() for k, v in sd.items()}, name.replace(".pt", ".safetensors"))

    from mmspec.models.llamagen_convert import load_llamagen_gpt
    from mmspec.models.llamagen_vq import load_llamagen_vq
    from mmspec.pipelines import SpeculativeARImagePipeline

    transformer = load_llamagen_gpt("c2i_B_256.safetensors", gpt_model="GPT-B", grid_size=16)
    vq = load_llamagen_vq("vq_ds16_c2i.safetensors", config="VQ-16", sample_size=256)
    pipe = SpeculativeARImagePipeline(transformer=transformer, vqvae=vq)
    pipe.save_pretrained("llamagen-c2i-b")  # optional: our folder layout (cls_rope="zero" saved)
    out = pipe(class_labels=[207, 360], method="zipar+sjd", guidance_scale=4.0)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from ..core.errors import check, check_choice, is_int
from .llamagen import LlamaGenModel

# LlamaGen's ``GPT_models``: name -> (n_layer, n_head, dim)
GPT_CONFIGS = {
    "GPT-B": (12, 12, 768), "GPT-L": (24, 16, 1024), "GPT-XL": (36, 20, 1280), "GPT-XXL": (48, 24, 1536),
    "GPT-XXXL": (48, 40, 2560), "GPT-1B": (22, 32, 2048), "GPT-3B": (24, 32, 3200), "GPT-7B": (32, 32, 4096),
}
_WRAPPERS = ("model", "module", "state_dict")  # the keys LlamaGen's sample scripts unwrap
_BUFFERS = ("freqs_cis",)  # may be present, carries no weights
_LAYER = re.compile(r"layers\.(\d+)\.")


def unwrap_state_dict(checkpoint) -> tuple[Mapping, str | None]:
    """The bare state dict (of a GPT or a VQ checkpoint) and the ``gpt_type`` of the training args
    when a wrapper (``"model"``, ``"module"``, ``"state_dict"``) carries them."""
    check(isinstance(checkpoint, Mapping), "checkpoint", "a path to a .safetensors file or a state dict",
          type(checkpoint).__name__)
    if "tok_embeddings.weight" not in checkpoint:
        for key in _WRAPPERS:
            if isinstance(checkpoint.get(key), Mapping):
                return checkpoint[key], getattr(checkpoint.get("args"), "gpt_type", None)
    return checkpoint, None


def read_checkpoint(checkpoint) -> Mapping:
    """A LlamaGen checkpoint as a mapping: a ``.safetensors`` path is read (safetensors only: the
    released ``.pt`` pickles are converted once outside mmspec), a mapping is returned as it is
    (bare or wrapped; ``unwrap_state_dict`` takes the state dict out)."""
    if isinstance(checkpoint, (str, os.PathLike)):
        check(str(checkpoint).endswith(".safetensors") and os.path.isfile(checkpoint), "checkpoint",
              "a path to an existing .safetensors file (convert LlamaGen's .pt first: see the docstring) "
              "or a state dict", str(checkpoint))
        from safetensors.torch import load_file

        return load_file(str(checkpoint))
    check(isinstance(checkpoint, Mapping), "checkpoint", "a path to a .safetensors file or a state dict",
          type(checkpoint).__name__)
    return checkpoint


def _refuse_t2i(state_dict: Mapping, gpt_type: str | None) -> None:
    t2i = [k for k in state_dict if k.startswith(("cls_embedding.cap_proj.", "cls_embedding.uncond_embedding"))]
    if t2i or gpt_type == "t2i":
        why = f"it has {t2i[0]!r}" if t2i else "its args say gpt_type='t2i'"
        raise ValueError(f"state_dict is a text-to-image (t2i) checkpoint ({why}): this loader takes "
                         "class-conditional (c2i) GPT checkpoints")


def _shape(state_dict: Mapping, key: str) -> tuple[int, ...]:
    if key not in state_dict:
        raise ValueError(f"state_dict is missing {key!r}")
    return tuple(state_dict[key].shape)


def _expected_shapes(n_layers: int, dim: int, mlp_hidden: int, vocab_size: int, rows: int) -> dict:
    """Every key of a LlamaGen c2i GPT state dict (original names) and its shape."""
    shapes = {"tok_embeddings.weight": (vocab_size, dim), "cls_embedding.embedding_table.weight": (rows, dim)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wqkv.weight": (3 * dim, dim), p + "attention.wo.weight": (dim, dim),
                       p + "feed_forward.w1.weight": (mlp_hidden, dim), p + "feed_forward.w3.weight": (mlp_hidden, dim),
                       p + "feed_forward.w2.weight": (dim, mlp_hidden), p + "attention_norm.weight": (dim,),
                       p + "ffn_norm.weight": (dim,)})
    shapes.update({"norm.weight": (dim,), "output.weight": (vocab_size, dim)})
    return shapes


def llamagen_config_from_state_dict(state_dict: Mapping, *, gpt_model: str | None = None, n_head: int | None = None,
                                    grid_size: int | None = None, num_classes: int | None = None) -> dict:
    """``LlamaGenModel`` keyword arguments for a LlamaGen c2i GPT state dict (original key names).

    Args:
        state_dict: the weights, bare or wrapped under ``"model"`` (LlamaGen's training checkpoints).
        gpt_model: LlamaGen's config name (``"GPT-B"``, ``"GPT-L"``, ``"GPT-XL"``, ...): gives the
            heads and checks the depth and width.
        n_head: the number of attention heads, where ``gpt_model`` is not given.
        grid_size: tokens per image side (``image_size // 16``: 16 at 256 px, 24 at 384 px);
            read from a ``freqs_cis`` buffer when the state dict has one.
        num_classes: checked against the class table, which has ``num_classes + 1`` rows (the
            last is the null class of classifier-free guidance).

    Vocabulary, width, depth and the SwiGLU width (LlamaGen's
    ``find_multiple(int(ffn_dim_multiplier * int(8 * dim / 3)), multiple_of)``) come from the shapes.
    Raises a one-line ``ValueError`` naming the key for a missing key, a wrong shape, an extra key
    or a text-to-image checkpoint.
    """
    state_dict, gpt_type = unwrap_state_dict(state_dict)
    _refuse_t2i(state_dict, gpt_type)
    vocab_size, dim = _shape(state_dict, "tok_embeddings.weight")
    rows = _shape(state_dict, "cls_embedding.embedding_table.weight")[0]
    mlp_hidden = _shape(state_dict, "layers.0.feed_forward.w1.weight")[0]
    n_layers = 1 + max(int(m.group(1)) for m in map(_LAYER.match, state_dict) if m)

    if gpt_model is not None:
        check_choice("gpt_model", gpt_model, GPT_CONFIGS)
        layers, heads, width = GPT_CONFIGS[gpt_model]
        check((layers, width) == (n_layers, dim), "gpt_model",
              f"the checkpoint's config (it has {n_layers} layers of width {dim})",
              f"{gpt_model} ({layers} layers of width {width})")
        check(n_head is None or n_head == heads, "n_head", f"None or {heads} (gpt_model={gpt_model!r})", n_head)
        n_head = heads
    check(is_int(n_head) and n_head >= 1, "n_head",
          f"an int >= 1, or give gpt_model (one of {', '.join(GPT_CONFIGS)}): the number of heads "
          "cannot be read from the weight shapes", n_head)

    if "freqs_cis" in state_dict:  # (cls_token_num + grid_size**2, head_dim / 2, 2), cls_token_num = 1
        side = round((state_dict["freqs_cis"].shape[0] - 1) ** 0.5)
        check(side * side + 1 == state_dict["freqs_cis"].shape[0], "state_dict['freqs_cis']",
              "a table of 1 + grid_size**2 rows (one class token, a square grid)", tuple(state_dict["freqs_cis"].shape))
        check(grid_size is None or grid_size == side, "grid_size", f"None or {side} (the checkpoint's freqs_cis)",
              grid_size)
        grid_size = side
    check(is_int(grid_size) and grid_size >= 1, "grid_size",
          "an int >= 1 (image_size // 16: 16 for LlamaGen's 256 px models, 24 for its 384 px ones)", grid_size)

    check(rows >= 2, "state_dict['cls_embedding.embedding_table.weight']", "a table of num_classes + 1 rows", rows)
    check(num_classes is None or num_classes == rows - 1, "num_classes",
          f"None or {rows - 1}: the class table has num_classes + 1 rows, the last the null class "
          "(checkpoints trained without class dropout have no null class and are not supported)", num_classes)

    expected = _expected_shapes(n_layers, dim, mlp_hidden, vocab_size, rows)
    for key, shape in expected.items():
        got = _shape(state_dict, key)
        check(got == shape, f"state_dict[{key!r}]", f"of shape {shape}", got)
    for key in state_dict:
        if key not in expected and key not in _BUFFERS:
            raise ValueError(f"state_dict has an unexpected key {key!r}: not part of a LlamaGen c2i GPT")
    return dict(vocab_size=vocab_size, grid_size=grid_size, num_classes=rows - 1, dim=dim, n_layers=n_layers,
                n_heads=n_head, mlp_hidden=mlp_hidden, class_dropout_prob=0.1, rope_base=10000.0, norm_eps=1e-5,
                cls_rope="zero")


def _our_key(key: str) -> str:
    """LlamaGen's parameter name -> ours (our blocks hold attention and SwiGLU weights directly)."""
    if key == "cls_embedding.embedding_table.weight":
        return "cls_embedding.weight"
    return key.replace(".attention.wqkv.", ".wqkv.").replace(".attention.wo.", ".wo.").replace(".feed_forward.", ".")


def load_llamagen_gpt(checkpoint, *, gpt_model: str | None = None, n_head: int | None = None,
                      grid_size: int | None = None, num_classes: int | None = None, id2label: dict | None = None,
                      dtype: torch.dtype = torch.float32) -> LlamaGenModel:
    """A LlamaGen class-conditional (c2i) GPT checkpoint as an eval-mode ``LlamaGenModel``.

    Args:
        checkpoint: a path to a ``.safetensors`` file, or an in-memory state dict (bare or wrapped
            under ``"model"``). LlamaGen releases ``.pt`` pickles; we load weights with safetensors
            only, so convert once outside mmspec::

                python -c "import torch, safetensors.torch as st; st.save_file({k: v.contiguous() for k, v in torch.load('c2i_B_256.pt', map_location='cpu', weights_only=True)['model'].items()}, 'c2i_B_256.safetensors')"

        gpt_model, n_head, grid_size, num_classes: as in ``llamagen_config_from_state_dict``.
        id2label: class names for the pipeline's prompts (``LlamaGenModel``'s argument), e.g.
            ImageNet's; without it the pipeline takes ``class_labels`` only.
        dtype: the returned model's parameter dtype.

    The model's logits equal LlamaGen's ``Transformer`` (eval mode) at every position: the logit
    at sequence position p predicts image token p. See the module docstring for a full example.
    """
    from_file = isinstance(checkpoint, (str, os.PathLike))
    checkpoint = read_checkpoint(checkpoint)
    config = llamagen_config_from_state_dict(checkpoint, gpt_model=gpt_model, n_head=n_head, grid_size=grid_size,
                                             num_classes=num_classes)
    state_dict, _ = unwrap_state_dict(checkpoint)
    model = LlamaGenModel(**config, id2label=id2label)
    # assign: the parameters take the checkpoint's tensors in ``dtype`` (copies of a caller's dict)
    weights = {_our_key(k): v.to(dtype, copy=not from_file) for k, v in state_dict.items() if k not in _BUFFERS}
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()

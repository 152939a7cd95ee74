"""The ``train`` functions of the bundled drafters' registered recipes (``mmspec.methods``'s
``TrainingRecipe`` names them as ``"mmspec.training.recipes.registered:<name>"``, imported only when
``mmspec train`` runs one, so the method registry imports no training code).

Each takes ``(out_dir, **options)``: the recipe's CLI options by name (``--vq`` is ``vq``) and the
common ``steps``, ``batch_size``, ``lr``, ``seed``, ``dataset_size``, ``log_every``, ``log``, and
returns the training record (None on the other processes of an ``accelerate launch``). The
recipes are looked up on ``mmspec.training.recipes`` when called (where tests replace them).
"""

from __future__ import annotations


def _ar_draft(kind: str, out_dir, *, vq, target=None, heads=None, data=None, **run) -> dict:
    from . import train_ar_draft

    return train_ar_draft(out_dir, kind=kind, vq_dir=vq, target_dir=target, data_dir=data,
                          **({} if heads is None else {"medusa_heads": heads}), **run)


def ar_sd(out_dir, **options) -> dict:
    """``mmspec train ar-sd`` (``ar-draft --kind chain``): ``train_ar_draft(kind="chain")``."""
    return _ar_draft("chain", out_dir, **options)


def ar_eagle(out_dir, **options) -> dict:
    """``mmspec train ar-eagle`` (``ar-draft --kind eagle``): ``train_ar_draft(kind="eagle")``."""
    return _ar_draft("eagle", out_dir, **options)


def ar_medusa(out_dir, **options) -> dict:
    """``mmspec train ar-medusa`` (``ar-draft --kind medusa``): ``train_ar_draft(kind="medusa")``,
    ``--heads`` its ``medusa_heads``."""
    return _ar_draft("medusa", out_dir, **options)


def continuous_sd(out_dir, *, tokenizer, target, distill, input_noise, **run) -> dict:
    """``mmspec train continuous-sd`` (``continuous-draft``): ``train_continuous_draft``."""
    from . import train_continuous_draft

    return train_continuous_draft(out_dir, tokenizer_dir=tokenizer, target_dir=target, distill=distill,
                                  input_noise=input_noise, **run)


def vlm_sd(out_dir, **run) -> dict:
    """``mmspec train vlm-sd``: the small draft VLM, ``train_vlm(size="draft")``."""
    from . import train_vlm

    return train_vlm(out_dir, size="draft", **run)


def _vlm_head(method: str, out_dir, *, target, rollout_steps=None, heads=None, data=None, image_folder=None,
              regenerate=None, tau_tokens=None, init=None, **run) -> dict | None:
    from . import train_vlm_draft

    extra = {} if tau_tokens is None else {"tau_tokens": tau_tokens}
    extra.update({} if init is None else {"init": init})
    return train_vlm_draft(out_dir, method=method, target_dir=target, rollout_steps=rollout_steps, data=data,
                           image_folder=image_folder, regenerate=regenerate,
                           **({} if heads is None else {"medusa_heads": heads}), **extra, **run)


def vlm_eagle(out_dir, **options) -> dict | None:
    """``mmspec train vlm-eagle`` (``vlm-draft --method eagle``): ``train_vlm_draft(method="eagle")``."""
    return _vlm_head("eagle", out_dir, **options)


def vlm_specvlm(out_dir, **options) -> dict | None:
    """``mmspec train vlm-specvlm`` (``vlm-draft --method specvlm``)."""
    return _vlm_head("specvlm", out_dir, **options)


def vlm_vispec(out_dir, **options) -> dict | None:
    """``mmspec train vlm-vispec`` (``vlm-draft --method vispec``)."""
    return _vlm_head("vispec", out_dir, **options)


def vlm_medusa(out_dir, **options) -> dict | None:
    """``mmspec train vlm-medusa`` (``vlm-draft --method medusa``): ``--heads`` its ``medusa_heads``."""
    return _vlm_head("medusa", out_dir, **options)

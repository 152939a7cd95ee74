"""The learned continuous tokenizer (``ConvTokenizer``) and its recipe: raster token layout, round
trip, pipeline save/load, recipe records, bad arguments refused."""

import json

import pytest
import torch

from mmspec.models import load_checkpoint
from mmspec.models.continuous_tokenizer import ConvTokenizer, PatchPCATokenizer
from mmspec.training.recipes import train_continuous_tokenizer
from mmspec.training.recipes.continuous import _load_tokenizer, encode_dataset

TINY = dict(latent_channels=3, channels=[8, 8], stem_channels=8, sample_size=16, norm_groups=4)


def test_tokens_are_the_latent_grid_in_raster_order():
    torch.manual_seed(0)
    tok = ConvTokenizer(**TINY).eval()
    with torch.no_grad():
        tok.latent_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        tok.latent_std.copy_(torch.tensor([2.0, 0.5, 1.0]))
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    z = tok.encode(x)
    assert (tok.grid_size, tok.num_tokens, tok.token_dim) == (4, 16, 3) and z.shape == (2, 16, 3)
    grid = (tok.encoder(x) - tok.latent_mean[:, None, None]) / tok.latent_std[:, None, None]  # (2, 3, 4, 4)
    # token r * 4 + c is grid cell (r, c): raster order, channels last
    torch.testing.assert_close(z[:, 1 * 4 + 2], grid[:, :, 1, 2])
    torch.testing.assert_close(tok.decode(z), tok.decoder(tok.encoder(x)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tok(x), tok.decode(z))
    with pytest.raises(ValueError, match=r"images must be a \(batch, 3, 16, 16\) tensor"):
        tok.encode(torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"latents must be a \(batch, 16, 3\) tensor"):
        tok.decode(torch.zeros(1, 16, 4))


def test_conv_recipe_trains_saves_and_loads(tmp_path):
    out = tmp_path / "tok"
    logs = []
    record = train_continuous_tokenizer(out, dataset_size=32, heldout_size=8, steps=3, batch_size=4, latent_dim=4,
                                        log_every=1, log=logs.append)
    assert record["kind"] == "conv" and record["train"]["steps"] == 3
    assert json.loads((out / "train_log.json").read_text())["kind"] == "conv"
    assert record["recon_accuracy"] is None and record["noisy_recon_accuracy"] is None
    assert any("continuous-tokenizer (conv) held-out reconstruction MSE" in line for line in logs)
    path, tok = _load_tokenizer(out)  # the recipe's loader picks the class from config.json
    assert isinstance(tok, ConvTokenizer) and tok.token_dim == 4 and tok.grid_size == 8
    # the latent statistics were measured on the training images: encoded data is unit scale
    labels, latents = encode_dataset(tok, 32, 0)
    assert latents.shape == (32, 64, 4)
    torch.testing.assert_close(latents.mean((0, 1)), torch.zeros(4), atol=0.05, rtol=0)
    torch.testing.assert_close(latents.std((0, 1)), torch.ones(4), atol=0.05, rtol=0)
    # a PCA folder still loads through the same loader
    pca = tmp_path / "pca"
    train_continuous_tokenizer(pca, kind="pca", dataset_size=16, heldout_size=4, log=lambda s: None)
    assert isinstance(_load_tokenizer(pca)[1], PatchPCATokenizer)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="vq"), "kind must be one of"),
    (dict(patch_size=6), "patch_size must be a power of two >= 2 with kind='conv'"),
    (dict(latent_dim=0), "latent_dim must be None or an int >= 1"),
    (dict(latent_noise=-1.0), "latent_noise must be a number >= 0"),
    (dict(steps=0), "steps must be an int >= 1"),
])
def test_conv_recipe_refuses_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_continuous_tokenizer(tmp_path / "x", dataset_size=8, log=lambda s: None, **kwargs)


def test_loader_refuses_another_model(tmp_path):
    from mmspec.models.video_ae import FrameAutoencoder

    other = tmp_path / "other"
    FrameAutoencoder(**TINY).save_pretrained(other)  # a valid checkpoint of another class
    with pytest.raises(ValueError, match="tokenizer_dir must be a folder holding a ConvTokenizer or a "
                                         "PatchPCATokenizer"):
        _load_tokenizer(other)


def test_noisy_recon_accuracy_is_the_classifier_on_noised_latents(tmp_path):
    """The record's ``noisy_recon_accuracy`` is what its docstring says: the classifier's accuracy on
    decodes of the held-out latents plus N(0, 0.3^2) noise (generator seeded with the held-out
    seed); and the noise bites on PCA (less than the clean reconstructions' accuracy)."""
    from pathlib import Path

    from mmspec.eval.quality import class_accuracy
    from mmspec.models.classifier import ShapesClassifier
    from mmspec.training.data import ShapesDataset
    from mmspec.training.recipes.ar_image import AR_DATA_STYLE
    from mmspec.training.recipes.common import stack

    classifier_dir = Path(__file__).resolve().parents[1] / "assets" / "classifier"
    rec = train_continuous_tokenizer(tmp_path / "pca", kind="pca", dataset_size=64, heldout_size=64,
                                     classifier_dir=classifier_dir, log=lambda s: None)
    tok = _load_tokenizer(tmp_path / "pca")[1]
    held, labels = stack(ShapesDataset(64, rec["heldout"]["seed"], 64, style=AR_DATA_STYLE))
    with torch.no_grad():
        z = tok.encode(held)
        noisy = tok.decode(z + 0.3 * torch.randn(z.shape, generator=torch.Generator().manual_seed(rec["heldout"]["seed"])))
    acc = class_accuracy(load_checkpoint(ShapesClassifier, classifier_dir), noisy.clamp(-1, 1), labels)
    assert rec["noisy_recon_accuracy"] == acc
    assert rec["noisy_recon_accuracy"] < rec["recon_accuracy"]

"""The AR image bench's quality metrics (Frechet distance, class accuracy) against closed forms
and known logits, and a smoke run of the classifier recipe that feeds them."""

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from mmspec import cli
from mmspec.bench.quality import (FrechetToReference, ReferenceStats, bootstrap_indices, centred_interval,
                                  class_accuracy, extract_features, fd_replicates, frechet_distance, image_quality,
                                  mean_ci, percentile_interval, reference_stats)
from mmspec.models import load_checkpoint
from mmspec.models.classifier import ShapesClassifier
from mmspec.models.vq import TinyVQModel
from mmspec.training.data import NUM_CLASSES, ShapesDataset
from mmspec.training.recipes import train_classifier

WEIGHTS = "diffusion_pytorch_model.safetensors"
KEYS = {"recipe", "seed", "steps", "config", "train", "final_loss", "heldout_accuracy", "heldout", "vq_dir",
        "vq_recon_accuracy", "wall_time_s"}
TINY_RUN = dict(steps=3, batch_size=4, lr=1e-3, dataset_size=16, heldout_size=8, log_every=2)


def gaussian(n, dim, seed, mean=0.0, std=1.0):
    return mean + std * np.random.default_rng(seed).standard_normal((n, dim))


def tiny_classifier(seed=0):
    torch.manual_seed(seed)
    return ShapesClassifier(sample_size=16, block_out_channels=(8, 16), feature_dim=12).eval()


def shapes(n, seed, resolution=16):
    data = ShapesDataset(n, seed, resolution)
    images, labels = zip(*(data[i] for i in range(n)))
    return torch.stack(images), torch.tensor(labels)


def run(out, log=None, **kw):
    return train_classifier(out, log=log or (lambda msg: None), **{**TINY_RUN, **kw})


# --- Frechet distance ---------------------------------------------------------------------------

def test_fd_of_a_set_with_itself_is_zero():
    feats = gaussian(512, 16, seed=0)
    assert abs(frechet_distance(feats, feats)) < 1e-8
    assert abs(frechet_distance(torch.from_numpy(feats).float(), ReferenceStats.from_features(feats))) < 1e-4


@pytest.mark.parametrize("shift", [0.5, 1.0, 2.0])
def test_fd_of_a_mean_shift_is_its_squared_norm(shift):
    # N(0, I) vs N(mu, I) in 8 dims, mu = shift * (1, ..., 1): FD = |mu|^2 = 8 shift^2; with 20000
    # samples a set the sampling error of each term is well under 0.1 (measured ~0.01)
    dim, n = 8, 20_000
    a = gaussian(n, dim, seed=1)
    b = gaussian(n, dim, seed=2, mean=shift)
    assert frechet_distance(a, b) == pytest.approx(dim * shift**2, abs=0.1)


def test_fd_of_a_scale_change_matches_the_closed_form():
    # N(0, I) vs N(0, 4 I): tr(I + 4 I - 2 (4 I)^(1/2)) = dim
    dim, n = 8, 20_000
    assert frechet_distance(gaussian(n, dim, seed=3), gaussian(n, dim, seed=4, std=2.0)) == pytest.approx(dim, abs=0.15)


def test_fd_grows_with_the_shift_and_is_symmetric():
    a = gaussian(2000, 8, seed=5)
    fds = [frechet_distance(a, gaussian(2000, 8, seed=6, mean=m)) for m in (0.0, 0.25, 0.5, 1.0)]
    assert fds == sorted(fds) and fds[0] < 0.1
    b = gaussian(2000, 8, seed=6, mean=0.5)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-9)


def test_fd_with_fewer_samples_than_features_is_finite():
    # singular covariances (as the bench's 64 images in 128 features): no warning, a finite value
    a, b = gaussian(8, 32, seed=7), gaussian(8, 32, seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fd = frechet_distance(a, b)
    assert np.isfinite(fd) and fd > 0


def test_fd_rejects_bad_features():
    with pytest.raises(ValueError, match="feats_a must be an \\(N, F\\) array with N >= 2"):
        frechet_distance(gaussian(1, 4, seed=0), gaussian(5, 4, seed=0))
    with pytest.raises(ValueError, match="feats_b must be features of the same width as feats_a \\(4\\)"):
        frechet_distance(gaussian(5, 4, seed=0), gaussian(5, 3, seed=0))


# --- class accuracy and the convenience -----------------------------------------------------------

def test_class_accuracy_on_known_logits():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 1.0], [5.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    labels = torch.tensor([0, 1, 2, 1, 2])  # the last two are wrong
    identity = nn.Identity().eval()  # the "images" are the logits
    assert class_accuracy(identity, logits, labels) == 0.6
    assert class_accuracy(identity, logits, labels, batch_size=2) == 0.6
    assert class_accuracy(identity, logits, labels.tolist()) == 0.6


def test_class_accuracy_rejects_bad_input():
    logits, labels = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="labels must be a \\(N,\\) tensor with N = len\\(images\\) = 4"):
        class_accuracy(nn.Identity().eval(), logits, labels[:3])
    with pytest.raises(ValueError, match="classifier must be in eval mode"):
        class_accuracy(nn.Identity().train(), logits, labels)


def test_image_quality_agrees_with_the_separate_metrics():
    classifier = tiny_classifier()
    reference = reference_stats(classifier, 64, seed=11)
    images, labels = shapes(32, seed=12)
    feats = extract_features(classifier, images)
    assert feats.shape == (32, 12)
    assert torch.allclose(extract_features(classifier, images, batch_size=5), feats, atol=1e-6)
    quality = image_quality(classifier, images, labels, reference)
    assert quality == {"fd": pytest.approx(frechet_distance(feats, reference)),
                       "class_acc": class_accuracy(classifier, images, labels)}
    assert image_quality(classifier, images, labels, reference) == quality  # deterministic
    real = reference_stats(classifier, 64, seed=11)
    assert np.array_equal(real.mu, reference.mu) and real.n == 64


def test_classifier_checks_its_input():
    classifier = tiny_classifier()
    assert classifier(torch.zeros(2, 3, 16, 16)).shape == (2, 16)
    with pytest.raises(ValueError, match="images must be a \\(B, 3, 16, 16\\) tensor"):
        classifier(torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match="sample_size must be a positive multiple of the downsampling factor 4"):
        ShapesClassifier(sample_size=18, block_out_channels=(8, 16))


# --- the recipe ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vq_dir(tmp_path_factory):
    # an untrained VQ is enough to exercise the reconstruction branch
    out = tmp_path_factory.mktemp("vq") / "vq"
    torch.manual_seed(0)
    TinyVQModel().save_pretrained(out, safe_serialization=True)
    return out


def test_recipe_saves_a_loadable_folder(tmp_path, vq_dir):
    lines = []
    record = run(tmp_path / "a", log=lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp folder left behind
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(["config.json", WEIGHTS, "train_log.json"])
    assert json.loads((tmp_path / "a" / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert KEYS <= record.keys() and record["recipe"] == "classifier" and record["steps"] == 3
    assert 0 <= record["heldout_accuracy"] <= 1 and record["heldout"]["seed"] != record["seed"]
    assert record["vq_dir"] is None and record["vq_recon_accuracy"] is None
    assert [line.split()[2] for line in lines if " step " in line] == ["2/3", "3/3"]
    model = load_checkpoint(ShapesClassifier, tmp_path / "a")
    assert model.config.num_classes == NUM_CLASSES and not model.training
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, NUM_CLASSES)
    assert model.features(torch.zeros(1, 3, 64, 64)).shape == (1, model.config.feature_dim)

    # same seed: the same weights; the VQ is used only after training, to measure
    with_vq = run(tmp_path / "b", vq_dir=vq_dir)
    assert 0 <= with_vq["vq_recon_accuracy"] <= 1 and with_vq["vq_dir"] == str(vq_dir.resolve())
    assert (tmp_path / "a" / WEIGHTS).read_bytes() == (tmp_path / "b" / WEIGHTS).read_bytes()
    run(tmp_path / "c", seed=1)
    assert (tmp_path / "a" / WEIGHTS).read_bytes() != (tmp_path / "c" / WEIGHTS).read_bytes()


@pytest.mark.parametrize("kw, message", [
    ({"steps": 0}, "steps must be an int >= 1, got 0"),
    ({"dataset_size": 2}, "dataset_size must be an int >= batch_size"),
    ({"warmup": 0}, "warmup must be an int >= 1, got 0"),
    ({"weight_decay": -1.0}, "weight_decay must be a number >= 0"),
    ({"vq_dir": "/no/such/vq"}, "vq_dir must be None or a folder saved by TinyVQModel.save_pretrained"),
])
def test_recipe_bad_arguments_name_the_argument(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        run(tmp_path / "x", **kw)
    assert not (tmp_path / "x").exists()


def test_cli_train_classifier(tmp_path, vq_dir):
    parser = cli.build_parser()
    args = parser.parse_args(["train", "classifier", "--out", "x"])
    assert (args.recipe, args.vq, args.steps) == ("classifier", None, cli.TRAIN_DEFAULTS["classifier"]["steps"])
    args = parser.parse_args(["train", "classifier", "--out", "x", "--vq", str(vq_dir)])
    assert args.vq == str(vq_dir)


# -- bootstrap intervals ---------------------------------------------------------------------------
def test_fast_fd_equals_frechet_distance():
    ref = ReferenceStats.from_features(gaussian(1024, 32, 1) @ gaussian(32, 32, 2) * 0.2)
    fast = FrechetToReference(ref)
    for n, seed in ((128, 3), (16, 4)):  # also fewer samples than features (singular covariance)
        x = gaussian(n, 32, seed, mean=0.3, std=1.5)
        assert fast(x) == pytest.approx(frechet_distance(x, ref), rel=1e-7)
    idx = bootstrap_indices(128, 5, 0)
    x = gaussian(128, 32, 3)
    assert np.allclose(fd_replicates(x, fast, idx), [frechet_distance(x[i], ref) for i in idx], rtol=1e-7)


def test_mean_interval_covers_a_known_mean():
    """200 draws of n = 128 Bernoulli(0.7) outcomes (seeds 0..199), 500 resamples each (seed 0):
    the 95% interval holds 0.7 in 90%..99% of draws (binomial sd of the rate about 1.5%)."""
    idx = bootstrap_indices(128, 500, 0)
    hits = [lo <= 0.7 <= hi for lo, hi in
            (mean_ci((np.random.default_rng(s).random(128) < 0.7).astype(float), idx) for s in range(200))]
    assert 0.90 <= np.mean(hits) <= 0.99


def test_fd_interval_covers_the_expected_fd_at_that_size():
    """FD of n = 128 Gaussian features (F = 8) to a fixed reference: the truth is the mean FD of
    2,000 fresh sets of 128 (seeds 10,000..); over 200 sets (seeds 0..199, 500 resamples, seed 0)
    the centred interval holds it in 90%..99% of sets, while the plain percentile interval, shifted
    up by the duplicates a resample holds, covers less (measured 0.84 at 1,000 resamples)."""
    F, n = 8, 128
    fd = FrechetToReference(ReferenceStats.from_features(gaussian(4096, F, 99)))
    draw = lambda s: gaussian(n, F, s, mean=0.3, std=1.2)  # noqa: E731
    truth = np.mean([fd(draw(10_000 + s)) for s in range(2000)])
    idx = bootstrap_indices(n, 500, 0)
    centred, plain = [], []
    for s in range(200):
        x = draw(s)
        reps = fd_replicates(x, fd, idx)
        lo, hi = centred_interval(reps, fd(x))
        centred.append(lo <= truth <= hi)
        lo, hi = percentile_interval(reps)
        plain.append(lo <= truth <= hi)
    assert 0.90 <= np.mean(centred) <= 0.99
    assert np.mean(plain) < np.mean(centred) - 0.05


def test_degenerate_intervals():
    idx = bootstrap_indices(16, 200, 0)
    assert mean_ci(np.ones(16), idx) == (1.0, 1.0)  # every image right: no spread
    assert mean_ci(np.zeros(16), idx) == (0.0, 0.0)
    assert mean_ci(np.ones(1)) == (1.0, 1.0)  # a single image
    # a method paired with itself: the ratio is 1 in every resample
    fd = FrechetToReference(ReferenceStats.from_features(gaussian(256, 4, 0)))
    reps = fd_replicates(gaussian(16, 4, 1), fd, idx)
    assert centred_interval(reps / reps, 1.0, log=True) == pytest.approx((1.0, 1.0))
    # an interval shifted below 0 is clipped where asked (FD >= 0)
    assert centred_interval([0.0, 1.0, 2.0, 3.0, 4.0], 0.5, lower=0.0)[0] == 0.0
    # one index matrix per seed: the pairing across methods is reproducible
    assert np.array_equal(bootstrap_indices(16, 200, 0), idx)


def test_interval_bad_input():
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        bootstrap_indices(0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_indices(8, 0)
    with pytest.raises(ValueError, match="level"):
        percentile_interval([1.0, 2.0], level=1.5)
    with pytest.raises(ValueError, match="replicates"):
        centred_interval([1.0, -1.0], 1.0, log=True)

"""The procedural shapes dataset: deterministic per (seed, index), labelled truthfully, varied
within a class, and cheap to render."""

import time

import pytest
import torch

from mmspec.training.data import CLASS_NAMES, CLASS_PROMPTS, NUM_CLASSES, ShapesDataset, render
from mmspec.training.data.shapes import PALETTE, SHAPES, item_seed


def test_class_names():
    assert NUM_CLASSES == 16 == len(CLASS_NAMES) == len(set(CLASS_NAMES)) == len(CLASS_PROMPTS)
    assert CLASS_NAMES[0] == "red circle" and CLASS_NAMES[-1] == "yellow star"
    assert all(name in prompt for name, prompt in zip(CLASS_NAMES, CLASS_PROMPTS))


def test_deterministic_in_any_order():
    ds = ShapesDataset(40, seed=3)
    forward = [ds[i] for i in range(40)]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = {i: ShapesDataset(40, seed=3)[i] for i in reversed(order)}
    for i, (image, label) in enumerate(forward):
        assert torch.equal(image, shuffled[i][0]) and label == shuffled[i][1]
    # another seed gives other images of the same labels
    other = ShapesDataset(40, seed=4)
    assert all(not torch.equal(forward[i][0], other[i][0]) and forward[i][1] == other[i][1] for i in range(40))


@pytest.mark.parametrize("resolution", [64, 32])
def test_range_shape_and_labels(resolution):
    ds = ShapesDataset(48, seed=0, resolution=resolution)
    images, labels = zip(*(ds[i] for i in range(len(ds))))
    images = torch.stack(images)
    assert images.shape == (48, 3, resolution, resolution) and images.dtype == torch.float32
    assert images.min() >= -1.0 and images.max() <= 1.0
    assert images.min() < -0.9 and images.max() > 0.9  # the range is used, not squeezed
    assert list(labels) == [i % 16 for i in range(48)]  # balanced classes
    with pytest.raises(IndexError):
        ds[48]


@pytest.mark.parametrize("label", range(16))
def test_every_class_shows_its_colour(label):
    """The mean colour inside the main object's mask is nearest its palette colour, in 20 scenes."""
    for seed in range(20):
        image, mask = render(label, torch.Generator().manual_seed(seed), return_mask=True)
        assert image.shape == (3, 64, 64) and mask.shape == (64, 64)
        inside = mask > 0.99
        assert inside.sum() > 50  # at least about a 7x7 patch
        mean = ((image + 1) / 2)[:, inside].mean(dim=1)  # (3,) in [0, 1]
        assert (PALETTE - mean).norm(dim=1).argmin().item() == label // len(SHAPES)


def test_label_sets_shape_and_colour():
    """Under one generator seed the random draws are the same for every label: labels of one shape
    give the same mask, labels of different shapes different masks."""
    masks = [render(label, torch.Generator().manual_seed(7), return_mask=True)[1] for label in range(16)]
    for a in range(16):
        for b in range(a + 1, 16):
            same_shape = a % len(SHAPES) == b % len(SHAPES)
            assert torch.equal(masks[a], masks[b]) == same_shape, (CLASS_NAMES[a], CLASS_NAMES[b])


def test_images_of_one_class_differ():
    """Any two of 8 images of a class differ by more than 0.1 mean absolute pixel difference
    (measured: min 0.16, mean 0.46, in [-1, 1] units); the AR model cannot memorise a class."""
    ds = ShapesDataset(16 * 8, seed=0)
    images = torch.stack([ds[i][0] for i in range(len(ds))]).view(8, 16, 3, 64, 64)  # (n, class, C, H, W)
    diff = (images[:, None] - images[None]).abs().mean(dim=(3, 4, 5))  # (n, n, class)
    pairs = diff[~torch.eye(8, dtype=torch.bool)]  # (n * (n - 1), class)
    assert pairs.min() > 0.1 and pairs.mean() > 0.3


def test_thousand_images_render_fast():
    ds = ShapesDataset(1000, seed=0)
    start = time.process_time()  # CPU time: other processes' load on the machine does not count
    for i in range(1000):
        ds[i]
    assert time.process_time() - start < 5.0  # about 0.6 s on the 2-core CI machine


def test_bold_style_draws_large_objects_over_few_distractors():
    """The AR target's "bold" scenes: main object radius in [0.45, 0.62] (the "scene" style's
    [0.28, 0.58]), at most one distractor (up to 3), so its mask covers more of the image; the
    "scene" default is unchanged by the option (the VLM and classifier data stay as they were)."""
    bold = [render(i % 16, torch.Generator().manual_seed(i), return_mask=True, return_meta=True, style="bold")
            for i in range(200)]
    scene = [render(i % 16, torch.Generator().manual_seed(i), return_mask=True, return_meta=True) for i in range(200)]
    assert all(0.45 <= m["r"] <= 0.62 and len(m["distractors"]) <= 1 for _, _, m in bold)
    assert all(0.28 <= m["r"] <= 0.58 and len(m["distractors"]) <= 3 for _, _, m in scene)
    assert max(len(m["distractors"]) for _, _, m in scene) == 3 and max(len(m["distractors"]) for _, _, m in bold) == 1
    # mean coverage of the image by the main object: measured 0.178 (bold) vs 0.121 (scene)
    assert torch.stack([k.mean() for _, k, _ in bold]).mean() > 1.3 * torch.stack([k.mean() for _, k, _ in scene]).mean()
    default = ShapesDataset(4, seed=2)[3][0]
    assert torch.equal(default, render(3, torch.Generator().manual_seed(item_seed(2, 3))))
    assert torch.equal(ShapesDataset(4, seed=2, style="bold")[3][0],
                       render(3, torch.Generator().manual_seed(item_seed(2, 3)), style="bold"))


def test_upright_style_draws_upright_shapes_on_smooth_backgrounds():
    """The AR target's "upright" scenes: bold's sizes, angle 0, no distractor, a smooth texture and no
    sensor noise (pixel-to-pixel steps on the background are far smaller than on "bold" scenes)."""
    from mmspec.training.data.shapes import SMOOTH_TEXTURES

    up = [render(i % 16, torch.Generator().manual_seed(i), return_mask=True, return_meta=True, style="upright")
          for i in range(200)]
    bold = [render(i % 16, torch.Generator().manual_seed(i), return_mask=True, return_meta=True, style="bold")
            for i in range(200)]
    assert all(0.45 <= m["r"] <= 0.62 and m["angle"] == 0.0 and m["distractors"] == [] for _, _, m in up)
    assert {m["texture"] for _, _, m in up} == set(SMOOTH_TEXTURES)

    def background_step(items):  # mean |horizontal step| where neither pixel touches the object
        steps = []
        for image, mask, _ in items:
            bg = (mask[:, 1:] == 0) & (mask[:, :-1] == 0)
            steps.append((image[:, :, 1:] - image[:, :, :-1]).abs().mean(0)[bg].mean())
        return torch.stack(steps)

    smooth = [x for x in bold if x[2]["texture"] in SMOOTH_TEXTURES and not x[2]["distractors"]]
    # measured: 0.010 (upright) vs 0.063 (bold with the same textures and no distractor: its noise)
    assert background_step(up).mean() < 0.5 * background_step(smooth).mean()
    assert torch.equal(ShapesDataset(4, seed=2, style="upright")[3][0],
                       render(3, torch.Generator().manual_seed(item_seed(2, 3)), style="upright"))


@pytest.mark.parametrize("make,match", [
    (lambda: ShapesDataset(10, seed=0, style="plain"), r"style must be one of scene, bold, upright, got 'plain'"),
    (lambda: render(0, torch.Generator(), style="Bold"), r"style must be one of scene, bold, upright, got 'Bold'"),
    (lambda: ShapesDataset(0, seed=0), r"size must be an int >= 1, got 0"),
    (lambda: ShapesDataset(10, seed=-1), r"seed must be an int >= 0, got -1"),
    (lambda: ShapesDataset(10, seed=0, resolution=8), r"resolution must be an int >= 16, got 8"),
    (lambda: render(16, torch.Generator()), r"label must be an int in \[0, 16\), got 16"),
])
def test_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()

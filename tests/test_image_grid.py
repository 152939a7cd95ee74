"""``mmspec.utils.images.save_image_grid``: the one PNG grid writer of the benches and scripts."""

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec.utils.images import save_image_grid


def _read(path) -> np.ndarray:
    with PIL.Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_tensor_grid_places_images_in_rows_of_nrow(tmp_path):
    images = torch.rand(6, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    out = save_image_grid(images, tmp_path / "grid.png", nrow=3)
    pixels = _read(out)
    assert pixels.shape == (2 * 4, 3 * 5, 3)
    for i, image in enumerate(images):
        r, c = divmod(i, 3)
        expected = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        assert np.array_equal(pixels[r * 4:(r + 1) * 4, c * 5:(c + 1) * 5], expected)
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"]  # no temporary left behind


def test_pil_grid_matches_the_images(tmp_path):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, (3, 2, 3), dtype=np.uint8) for _ in range(4)]
    pixels = _read(save_image_grid([PIL.Image.fromarray(a) for a in arrays], tmp_path / "g.png", nrow=2))
    assert np.array_equal(pixels, np.concatenate([np.concatenate(arrays[:2], 1), np.concatenate(arrays[2:], 1)], 0))


@pytest.mark.parametrize("images, nrow, match", [
    (torch.rand(2, 3, 4, 4), 0, "nrow must be an int >= 1"),
    (torch.rand(2, 1, 4, 4), 2, r"images must be a non-empty \(N, 3, H, W\) float tensor"),
    ([PIL.Image.new("RGB", (2, 2))] * 3, 2, "multiple of nrow=2"),
])
def test_bad_input_is_refused_and_nothing_is_written(tmp_path, images, nrow, match):
    with pytest.raises(ValueError, match=match):
        save_image_grid(images, tmp_path / "grid.png", nrow=nrow)
    assert list(tmp_path.iterdir()) == []

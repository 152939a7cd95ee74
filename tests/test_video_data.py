"""The procedural video dataset: deterministic per (seed, index), motion and colour as prompted
(measured from pixels, not only from the renderer's own bookkeeping), switches exactly where the
schedule puts them, prompts parsed from text."""

import pytest
import torch

from mmspec.training.data.video import (COLOURS, DIRECTIONS, NUM_PROMPTS, SHAPES, VideoClipDataset, VideoPrompt,
                                        frame_colour, motion_direction, pixel_centroid, render_clip)


def test_deterministic_from_the_seed_in_any_order():
    ds = VideoClipDataset(12, seed=5, num_frames=9, switch_prob=0.5)
    forward = [ds[i] for i in range(12)]
    again = {i: VideoClipDataset(12, seed=5, num_frames=9, switch_prob=0.5)[i] for i in reversed(range(12))}
    for i, item in enumerate(forward):
        assert torch.equal(item["frames"], again[i]["frames"]) and item["schedule"] == again[i]["schedule"]
        assert torch.equal(item["truth"].centroid, again[i]["truth"].centroid)
    other = VideoClipDataset(12, seed=6, num_frames=9, switch_prob=0.5)
    assert all(not torch.equal(forward[i]["frames"], other[i]["frames"]) for i in range(12))


def test_range_shapes_and_balanced_prompts():
    ds = VideoClipDataset(NUM_PROMPTS + 1, seed=0, num_frames=4, resolution=32)
    item = ds[3]
    assert item["frames"].shape == (4, 3, 32, 32) and item["prompt_ids"].shape == (4, 3)
    assert item["frames"].min() >= -1 and item["frames"].max() <= 1
    assert [ds.schedule(i, torch.Generator())[0][1].index for i in range(NUM_PROMPTS + 1)] == \
        list(range(NUM_PROMPTS)) + [0]
    with pytest.raises(IndexError):
        ds[NUM_PROMPTS + 1]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_motion_direction_matches_the_prompt(direction):
    """Over 16 clips of 12 frames (seeds 0-15, every colour and shape), the direction measured from
    the object's pixel centroid matches the prompt at >= 97% of the steps (occluders may shift a
    centroid), and the renderer's own centroids at every step."""
    hits = steps = 0
    for seed in range(16):
        prompt = VideoPrompt(seed % 4, seed // 4, DIRECTIONS.index(direction))
        frames, truth = render_clip([(0, prompt)], 12, torch.Generator().manual_seed(seed))
        assert (motion_direction(truth.centroid) == prompt.direction).all()
        measured = motion_direction(pixel_centroid(frames, prompt.colour))
        hits += int((measured == prompt.direction).sum())
        steps += len(measured)
    assert hits / steps >= 0.97, hits / steps


def test_colour_and_centroid_measured_from_pixels():
    """Every frame's dominant palette colour is the prompt's, and the pixel centroid lies within
    0.1 (1.6 px) of the true centre on the torus, in 32 clips of 8 frames (seed 0)."""
    ds = VideoClipDataset(32, seed=0, num_frames=8)
    for i in range(32):
        item = ds[i]
        truth = item["truth"]
        assert torch.equal(frame_colour(item["frames"]), truth.colour)
        err = torch.remainder(pixel_centroid(item["frames"]) - truth.centroid + 1, 2) - 1
        assert err.abs().max() < 0.1


def test_switches_happen_where_stated():
    """A colour switch at frame 6: frames 0-5 measure the old colour, 6 on the new one; a direction
    switch at frame 9: steps into frames 1-8 move the old way, into 9 on the new way."""
    red_right = VideoPrompt(0, 1, 0)
    frames, truth = render_clip([(0, red_right), (6, VideoPrompt(2, 1, 0))], 12, torch.Generator().manual_seed(1))
    assert frame_colour(frames).tolist() == [0] * 6 + [2] * 6 == truth.colour.tolist()
    assert truth.switch_frames == [6]
    frames, truth = render_clip([(0, red_right), (9, VideoPrompt(0, 1, 2))], 16, torch.Generator().manual_seed(2))
    assert motion_direction(truth.centroid).tolist() == [0] * 8 + [2] * 7
    assert motion_direction(pixel_centroid(frames, 0)).tolist() == [0] * 8 + [2] * 7
    # the object does not jump at the switch: its step there is an ordinary step
    steps = (torch.remainder(truth.centroid[1:] - truth.centroid[:-1] + 1, 2) - 1).norm(dim=1)
    assert steps.max() < 0.12


def test_dataset_switches_on_chunk_multiples():
    """With switch_prob 0.5 about half the clips switch (60 clips: 20 to 40), each once, at a
    multiple of 3 inside the clip, changing the colour or the direction only."""
    ds = VideoClipDataset(60, seed=0, num_frames=24, switch_prob=0.5, switch_multiple=3)
    switched = [ds[i] for i in range(60) if ds[i]["switch_frame"] >= 0]
    assert 20 <= len(switched) <= 40
    kinds = set()
    for item in switched:
        k = item["switch_frame"]
        assert k % 3 == 0 and 3 <= k <= 21
        (_, a), (start, b) = item["schedule"]
        assert start == k and a.shape == b.shape and (a.colour != b.colour) != (a.direction != b.direction)
        kinds.add("colour" if a.colour != b.colour else "direction")
        ids = item["prompt_ids"]
        assert (ids[:k] == torch.tensor(a.ids)).all() and (ids[k:] == torch.tensor(b.ids)).all()
    assert kinds == {"colour", "direction"}
    plain = VideoClipDataset(10, seed=0, num_frames=24)  # switch_prob 0 by default
    assert all(plain[i]["switch_frame"] == -1 and len(plain[i]["schedule"]) == 1 for i in range(10))


def test_prompts_parse_from_text():
    p = VideoPrompt.parse("A Blue star, moving LEFT")
    assert (COLOURS[p.colour], SHAPES[p.shape], DIRECTIONS[p.direction]) == ("blue", "star", "left")
    assert VideoPrompt.parse(p.text) == p and VideoPrompt.from_index(p.index) == p
    for bad in ["", "a red circle", "a red blue circle moving up", "a red circle moving sideways"]:
        with pytest.raises(ValueError, match="prompt must be"):
            VideoPrompt.parse(bad)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="schedule must be start frames strictly increasing"):
        render_clip([(0, VideoPrompt(0, 0, 0)), (0, VideoPrompt(1, 0, 0))], 8, torch.Generator())
    with pytest.raises(ValueError, match="schedule must be start frames"):
        render_clip([(3, VideoPrompt(0, 0, 0))], 8, torch.Generator())
    with pytest.raises(ValueError, match="num_frames must be an int >= 1"):
        render_clip([(0, VideoPrompt(0, 0, 0))], 0, torch.Generator())
    with pytest.raises(ValueError, match="switch_prob must be"):
        VideoClipDataset(4, 0, switch_prob=2)
    with pytest.raises(ValueError, match="direction must be an int in"):
        VideoPrompt(0, 0, 4)


def _style_figures(style: str) -> dict:
    """Measured over 64 clips of 12 frames (seed 3): the object's step along its direction (from the
    renderer's centroids), how well squares fill their pixel bounding box (frames where the square
    is whole and off the border), the mean horizontal pixel step of the first frame's background
    (pixels of no palette colour), and how many clips have an occluded object."""
    from mmspec.training.data.video import DIRECTION_VECTORS, palette_mask

    ds = VideoClipDataset(64, seed=3, num_frames=12, style=style)
    steps, fills, background, occluded, distractors = [], [], [], 0, []
    for i in range(64):
        item = ds[i]
        truth, frames = item["truth"], item["frames"]
        step = torch.remainder(truth.centroid[1:] - truth.centroid[:-1] + 1, 2) - 1
        steps.append((step * DIRECTION_VECTORS[truth.direction[1:]]).sum(-1))
        occluded += int((truth.visible < 0.99).any())
        distractors.append(truth.distractors)
        masks = palette_mask(frames)[torch.arange(12), truth.colour]  # (F, H, W)
        for mask in masks if SHAPES[int(truth.shape[0])] == "square" else []:
            if mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any() or mask.sum() < 9:
                continue
            rows, cols = mask.any(1).nonzero(), mask.any(0).nonzero()
            fills.append(float(mask.sum() / ((rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1))))
        coloured = palette_mask(frames[0]).any(0)
        dx = (frames[0][:, :, 1:] - frames[0][:, :, :-1]).abs().mean(0)
        background.append(float(dx[~(coloured[:, 1:] | coloured[:, :-1])].mean()))
    steps = torch.cat(steps)
    return dict(speed=(float(steps.min()), float(steps.max())), fill_min=min(fills), fills=len(fills),
                background=sum(background) / len(background), occluded=occluded, distractors=distractors)


def test_simple_style_is_what_it_says():
    """The "simple" clips the video recipes train on, against "scene" on the same seeds: faster
    (0.07-0.12 per frame, 1.1-1.9 px, against 0.04-0.10), upright squares that fill their pixel box
    (>= 0.85 in every whole frame; scene's rotated squares go below 0.5), smoother backgrounds (mean
    pixel step 0.011 against 0.021, asserted below 0.7x), at most one distractor, in 10 to 22 of
    the 64 clips (a quarter is 16; scene: up to two, in most clips), and occlusion still present."""
    simple, scene = _style_figures("simple"), _style_figures("scene")
    assert 0.07 <= simple["speed"][0] and simple["speed"][1] <= 0.12, simple
    assert scene["speed"][0] < 0.07, scene
    assert simple["fills"] >= 20 and simple["fill_min"] >= 0.85, simple
    assert scene["fill_min"] < 0.5, scene
    assert simple["background"] < 0.7 * scene["background"], (simple, scene)
    assert set(simple["distractors"]) <= {0, 1} and 10 <= sum(simple["distractors"]) <= 22, simple
    assert max(scene["distractors"]) == 2 and sum(d > 0 for d in scene["distractors"]) > 32, scene
    assert simple["occluded"] >= 1, simple
    with pytest.raises(ValueError, match="style must be one of scene, simple"):
        VideoClipDataset(4, 0, style="busy")

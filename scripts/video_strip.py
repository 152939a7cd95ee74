"""Rebuild the README's frame strip of the bundled video model (``assets/video_strip.png``).

Four 96-frame streams, seeds 0-3, one frame every 6; the last two switch colour and direction at
frame 48 (LongLive's re-cache), at the model's default steps and guidance. Run from the repository
root: ``.venv/bin/python scripts/video_strip.py [PIPELINE_DIR] [OUT_PNG]``.
"""

import sys

import torch

from mmspec.pipelines import StreamingVideoPipeline
from mmspec.pipelines.video import save_frame_strip

PROMPTS = ["a red circle moving right", "a green square moving left", "a blue triangle moving up",
           "a yellow star moving down"]
SWITCHED = ["a red circle moving right", "a green square moving left", "a red triangle moving left",
            "a blue star moving right"]


def main(pipeline_dir: str = "assets/video", out: str = "assets/video_strip.png") -> None:
    pipe = StreamingVideoPipeline.from_pretrained(pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    out_frames = pipe(prompts=[(0, PROMPTS), (48, SWITCHED)], num_frames=96, output_type="np",
                      generator=[torch.Generator().manual_seed(i) for i in range(4)]).frames
    print(save_frame_strip(list(out_frames), out, every=6, per_row=16, scale=2))


if __name__ == "__main__":
    main(*sys.argv[1:])

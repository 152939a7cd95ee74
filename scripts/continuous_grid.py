"""Rebuild the README's sample grid of the bundled continuous-token target
(``assets/continuous_samples.png``).

Two images of each of the 16 classes (class ``i % 16``, generator seed ``5000 + i``, held out from
the bench's seeds), target alone (``none``, the mixture head) at the bench's constant CFG 3.0,
temperature 1; row r holds classes 0-7 or 8-15 in order (colours red, green, blue, yellow; shapes
circle, square, triangle, star). Prints the bundled classifier's accuracy on them. Run from the
repository root: ``.venv/bin/python scripts/continuous_grid.py [PIPELINE_DIR] [OUT_PNG]``.
"""

import sys

import torch

from mmspec.eval.quality import class_accuracy
from mmspec.models import load_checkpoint
from mmspec.models.classifier import ShapesClassifier
from mmspec.pipelines import SpeculativeContinuousARPipeline
from mmspec.utils.images import save_image_grid


def main(pipeline_dir: str = "assets/continuous", out: str = "assets/continuous_samples.png") -> None:
    pipe = SpeculativeContinuousARPipeline.from_pretrained(pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    labels = [i % 16 for i in range(32)]
    result = pipe(class_labels=labels, method="none", guidance_scale=3.0, guidance_schedule="constant",
                  generator=[torch.Generator().manual_seed(5000 + i) for i in range(32)], output_type="pt")
    classifier = load_checkpoint(ShapesClassifier, "assets/classifier")
    acc = class_accuracy(classifier, result.images * 2 - 1, torch.tensor(labels))
    pil = pipe.postprocess_images(result.images * 2 - 1, "pil")
    save_image_grid([p.resize((128, 128)) for p in pil], out, nrow=8)
    print(f"{out}: 32 images, classifier accuracy {acc:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])

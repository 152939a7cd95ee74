"""Where continuous ``sjd`` loses its drafts: acceptance per window slot, after a rejection and
after a fully accepted pass (or the first pass).

Runs ``sjd`` on the bundled continuous-token target (class ``i % 16``, generator seed ``5000 + i``,
the bench's constant CFG 3), reads each pass's committed tokens from ``callback_on_step_end``
(``n`` accepted drafts plus the correction or bonus) and prints, for the passes that follow a
rejection and for the others, the fraction of passes reaching each slot that accept it
(``P(slot j accepted | slots < j accepted)``), and how many drafts the passes accepted. Run from
the repository root: ``.venv/bin/python scripts/sjd_slot_acceptance.py [IMAGES] [WINDOW] [PIPELINE_DIR]``.
"""

import collections
import sys

import torch

from mmspec.pipelines import SpeculativeContinuousARPipeline


def passes(pipe, label: int, seed: int, window: int) -> list[int]:
    """Accepted drafts of every pass of one image (the last pass may be cut by the image's end)."""
    seen, out = [1], []  # the prefill emits the first token

    def on_step(p, step, done, kwargs):
        out.append(done - seen[0] - 1)
        seen[0] = done
        return {}

    pipe(class_labels=label, method="sjd", method_knobs={"sjd_window": window}, guidance_scale=3.0,
         guidance_schedule="constant", generator=torch.Generator().manual_seed(seed), output_type="latent",
         callback_on_step_end=on_step)
    return out[:-1]  # the last pass may stop at the image's end, not at a rejection


def main(images: int = 32, window: int = 8, pipeline_dir: str = "assets/continuous") -> None:
    pipe = SpeculativeContinuousARPipeline.from_pretrained(pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    G = window - 1
    tried = {k: [0] * G for k in ("after a rejection", "after a full pass or first")}
    ok = {k: [0] * G for k in tried}
    counts = collections.Counter()
    for i in range(images):
        prev = None
        for n in passes(pipe, i % 16, 5000 + i, window):
            kind = "after a rejection" if prev is not None and prev < G else "after a full pass or first"
            for j in range(min(n + 1, G)):
                tried[kind][j] += 1
                ok[kind][j] += j < n
            counts[n] += 1
            prev = n
    print(f"sjd window {window}, {images} images, {sum(counts.values())} passes")
    for kind in tried:
        rates = " ".join(f"{ok[kind][j] / tried[kind][j]:.2f}" if tried[kind][j] else "-" for j in range(G))
        print(f"  {kind:28s} passes {tried[kind][0]:5d}  slot acceptance {rates}")
    print("  accepted drafts per pass:", dict(sorted(counts.items())))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 32, int(args[1]) if len(args) > 1 else 8, *(args[2:3] or ["assets/continuous"]))

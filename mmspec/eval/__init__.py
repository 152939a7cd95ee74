"""Metrics and judges: how good generated outputs are, apart from how fast they came.

- ``quality``: image quality on a trained ``ShapesClassifier``'s features: KID and a paired MMD
  permutation test against the baseline, the Frechet distance, class accuracy, ``reconstruct``.
- ``stats``: bootstrap intervals (iid and moving-block) and least-squares slopes.
- ``video``: what a stream shows, frame by frame (the judge's and the pixels' reading), its
  accuracies, and the measures of a prompt switch.

The benches (``mmspec.bench``) and the training recipes import these; this package imports
neither of them, and of the training package only the data definitions it judges against
(``mmspec.training.data``: the palette and prompt vocabulary of the rendered videos), inside the
functions that need them (tests/test_pipeline_base.py holds these rules).
"""

__all__ = ["quality", "stats", "video"]

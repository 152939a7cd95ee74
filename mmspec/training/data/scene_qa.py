"""Procedural image / question / answer data for the tiny VLM: the shapes scenes of
``mmspec.training.data.shapes`` with questions about them and answers written from the scene's
own description (``render(..., return_meta=True)``), so every answer is true of its image.

Most questions ask for a detailed description (answers of 40-120 words: the main object, where it
is and how large, the background's texture and colours, the small shapes behind it, a closing
remark), which is where speculation pays; the rest ask short questions (colour, shape, place,
count). Phrasings are drawn from small template sets, so a trained model stays uncertain at a few
points of an answer and confident elsewhere, much like a real captioner.

With ``images=K > 1`` an item holds 1 to K images (its own draw of how many), one image part each,
and its question is about the **last** one, the image nearest the question (as a stream's newest
frame): the others are scenes of other items, context the model must learn to look past.

Text is lower case with punctuation split off by spaces: one word = one token of the word-level
tokenizer ``build_tokenizer`` makes from ``vocabulary()``, the closed set of words the templates
can produce.
"""

from __future__ import annotations

import math
import random

import torch

from ...core.errors import check, check_int
from .shapes import COLOURS, NUM_CLASSES, SHAPES, item_seed, render

# the image placeholder the processor expands to one token per image feature
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", IMAGE_TOKEN)
# the chat frame around a question: "<s> user : <image> QUESTION assistant :" -> answer "</s>"
USER, ASSISTANT = "user :", "assistant :"

# names for arbitrary RGB colours (background, distractors): the nearest of these
_NAMED = {
    "red": (0.85, 0.15, 0.15), "green": (0.2, 0.7, 0.25), "blue": (0.2, 0.3, 0.9),
    "yellow": (0.92, 0.85, 0.15), "orange": (0.95, 0.55, 0.1), "purple": (0.55, 0.25, 0.7),
    "pink": (0.95, 0.6, 0.75), "brown": (0.5, 0.32, 0.15), "grey": (0.5, 0.5, 0.5),
    "white": (0.92, 0.92, 0.92), "black": (0.08, 0.08, 0.08), "teal": (0.15, 0.6, 0.6),
}
_TEXTURE_WORDS = {"stripes": "striped", "checker": "checkered", "noise": "blotchy", "gradient": "smooth gradient"}
_NUMBERS = ("no", "one", "two", "three")
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars"}

_DESCRIBE = ("describe the image in detail .", "what do you see in this picture ?",
             "give a detailed description of the scene .", "please describe everything in this image .")
_OPENERS = ("the image shows a {size} {colour} {shape} {where} .",
            "this picture contains a {size} {colour} {shape} , placed {where} .",
            "in this image there is a {size} {colour} {shape} {where} .")
_BACKGROUNDS = ("the background has a {texture} pattern that goes from {bg1} to {bg2} .",
                "behind it is a {texture} background in {bg1} and {bg2} .")
_NO_DISTRACTORS = ("there are no other objects in the scene .", "nothing else is in the picture .")
_DISTRACTORS = ("there {be} {n} small {things} behind the {shape} : {items} .",
                "{n_cap} small {things} {be} partly hidden behind it : {items} .")
_COVERAGE = ("it covers {fraction} of the image .", "the {shape} takes up {fraction} of the frame .")
_CLOSERS = ("overall the scene is simple and the {colour} {shape} stands out clearly .",
            "the {shape} is the main subject of the picture .",
            "the {colour} {shape} is easy to see against the {texture} background .")
_SHORT = (
    ("what colour is the main shape ?", "the main shape is {colour} ."),
    ("what shape is in the image ?", "it is a {shape} ."),
    ("where is the shape ?", "the {shape} is {where} ."),
    ("how many small shapes are behind the main one ?", "there {be} {n} small {things} behind it ."),
    ("what is the main object ?", "a {size} {colour} {shape} ."),
)


def colour_name(rgb) -> str:
    """The nearest name in ``_NAMED`` to an RGB triple in [0, 1]."""
    return min(_NAMED, key=lambda name: sum((a - b) ** 2 for a, b in zip(_NAMED[name], rgb)))


def _where(cx: float, cy: float) -> str:
    col = "left" if cx < -0.25 else "right" if cx > 0.25 else ""
    row = "top" if cy < -0.25 else "bottom" if cy > 0.25 else ""
    if row and col:
        return f"in the {row} {col} corner"
    if row or col:
        return f"near the {row or col} edge"
    return "in the centre"


def _size(r: float) -> str:
    return "small" if r < 0.38 else "large" if r > 0.48 else "medium sized"


def _fraction(r: float) -> str:
    area = math.pi * r * r / 4  # of the [-1, 1]^2 frame
    return ("a small part" if area < 0.09 else "about a tenth" if area < 0.13 else
            "about a sixth" if area < 0.2 else "about a quarter")


def _fields(meta: dict) -> dict:
    colour_id, shape_id = divmod(meta["label"], len(SHAPES))
    shape = SHAPES[shape_id]
    n = len(meta["distractors"])
    items = [f"a {colour_name(rgb)} {s}" for s, rgb, *_ in meta["distractors"]]
    items = items[0] if n == 1 else " , ".join(items[:-1]) + " and " + items[-1] if n else ""
    bg1, bg2 = (colour_name(c) for c in meta["background"])
    return dict(colour=COLOURS[colour_id], shape=shape, size=_size(meta["r"]), where=_where(meta["cx"], meta["cy"]),
                texture=_TEXTURE_WORDS[meta["texture"]], bg1=bg1, bg2=bg2 if bg2 != bg1 else f"a lighter {bg1}",
                n=_NUMBERS[n], n_cap=_NUMBERS[n], be="is" if n == 1 else "are",
                things="shape" if n == 1 else "shapes", items=items, fraction=_fraction(meta["r"]))


def describe(meta: dict, rng: random.Random) -> str:
    """A detailed description of the scene in ``meta`` (40-120 words), phrasing drawn with ``rng``."""
    f = _fields(meta)
    parts = [rng.choice(_OPENERS), rng.choice(_BACKGROUNDS),
             rng.choice(_DISTRACTORS if meta["distractors"] else _NO_DISTRACTORS),
             rng.choice(_COVERAGE), rng.choice(_CLOSERS)]
    return " ".join(p.format(**f) for p in parts)


def question_answer(meta: dict, rng: random.Random, describe_prob: float = 0.7) -> tuple[str, str]:
    """A (question, answer) pair about the scene: a description with ``describe_prob``, else a
    short question."""
    if rng.random() < describe_prob:
        return rng.choice(_DESCRIBE), describe(meta, rng)
    question, answer = rng.choice(_SHORT)
    return question, answer.format(**_fields(meta))


def prompt_text(question: str, images: int = 1) -> str:
    """The chat frame before the answer, with ``images`` image parts before the question (as the
    processor's chat template writes them); each ``IMAGE_TOKEN`` is expanded by the processor."""
    return f"<s> {USER} {' '.join([IMAGE_TOKEN] * images)} {question} {ASSISTANT}"


def vocabulary() -> list[str]:
    """Every word the templates can write, special tokens first (ids 0-4), then sorted."""
    words = set()
    texts = [*_DESCRIBE, *_OPENERS, *_BACKGROUNDS, *_NO_DISTRACTORS, *_DISTRACTORS, *_COVERAGE, *_CLOSERS,
             *(q + " " + a for q, a in _SHORT), USER, ASSISTANT, "a lighter and", "in the top bottom left right"
             " corner near the edge in the centre small large medium sized a small part about a tenth sixth quarter"]
    for text in texts:
        for word in text.split():
            if not word.startswith("{"):
                words.add(word)
    words |= set(SHAPES) | set(_PLURAL.values()) | set(COLOURS) | set(_NAMED) | set(_NUMBERS)
    words |= {w for t in _TEXTURE_WORDS.values() for w in t.split()} | {"is", "are", "shape", "shapes"}
    words -= set(SPECIAL_TOKENS)
    return list(SPECIAL_TOKENS) + sorted(words)


class SceneQADataset(torch.utils.data.Dataset):
    """``size`` (image (3, H, W) in [-1, 1], question, answer) triples; item ``i`` is drawn from
    its own seed ``(seed, i)`` (image and phrasing alike), label ``i % 16``, like ``ShapesDataset``.

    ``images=K > 1``: item ``i`` holds ``(images (k, 3, H, W), question, answer)`` with ``k`` drawn
    in ``1 .. K`` from its seed; the question and answer are about the last image, item ``i``'s
    own scene (the same scene, question and answer as with ``images=1``), and the ``k - 1`` before
    it are scenes drawn from seeds of their own."""

    def __init__(self, size: int, seed: int, resolution: int = 64, describe_prob: float = 0.7, images: int = 1):
        check_int(size, "size", 1)
        check_int(seed, "seed", 0)
        check(0.0 <= describe_prob <= 1.0, "describe_prob", "a number in [0, 1]", describe_prob)
        check_int(images, "images", 1)
        self.size, self.seed, self.resolution, self.describe_prob = size, seed, resolution, describe_prob
        self.images = images

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str, str]:
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of range for a dataset of size {self.size}")
        s = item_seed(self.seed, i)
        image, meta = render(i % NUM_CLASSES, torch.Generator().manual_seed(s), self.resolution, return_meta=True)
        question, answer = question_answer(meta, random.Random(s), self.describe_prob)
        if self.images == 1:
            return image, question, answer
        rng = random.Random(item_seed(s, -1))  # how many images, and the earlier scenes' labels and seeds
        earlier = [render(rng.randrange(NUM_CLASSES), torch.Generator().manual_seed(rng.getrandbits(63)),
                          self.resolution) for _ in range(rng.randrange(self.images))]
        return torch.stack([*earlier, image]), question, answer

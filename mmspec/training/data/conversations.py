"""Conversations with images in the LLaVA / ShareGPT layout, read for training a VLM's drafter.

The layout (LLaVA's ``llava_v1_5_mix665k.json``, ShareGPT4V, most VLM instruction sets)::

    [{"id": "0001", "image": "coco/000000033471.jpg",
      "conversations": [{"from": "human", "value": "<image>\\nWhat is on the table?"},
                        {"from": "gpt", "value": "A laptop and a mug."},
                        {"from": "human", "value": "What colour is the mug?"},
                        {"from": "gpt", "value": "Red."}]},
     ...]

as one JSON list (``.json``) or one record per line (``.jsonl``), or a folder of such files (read
in name order). ``image`` is a path relative to ``image_folder`` (default: the file's folder);
a record without ``image`` is text only. Roles ``human`` / ``user`` and ``gpt`` / ``assistant``
alternate, the user first; the ``<image>`` tag (LLaVA's) marks where the image goes in the first
user turn and is removed from the text (no tag: the image comes first, as LLaVA puts it).

What cannot be read at all is refused before any training, naming the file (a missing path, a
``.json`` that is not valid JSON, no usable record in the whole set). A malformed record in the
middle (a line that is not JSON, missing or misordered turns, an empty message, several images,
an image file that is missing or unreadable) is skipped and counted: ``Conversations.skipped``
holds ``(where, why)`` per skipped record, ``where`` the file and line or index.

``render`` turns a conversation into the target's token ids with the target's own processor and
chat template, marking the assistant tokens (each answer and its end-of-turn tokens) as those a
drafter learns to predict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...core.errors import check
from ...models.vlm_distill import VISION_KEYS, Rendered

USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant")
IMAGE_TAG = "<image>"
SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class Conversation:
    """One record: the image's path (None: text only) and its (question, answer) turns."""

    image: Path | None
    turns: tuple[tuple[str, str], ...]
    where: str  # "file:line" or "file[index]", for messages


@dataclass
class Conversations:
    """The usable records of a data path, and the skipped ones as ``(where, why)``."""

    records: list[Conversation] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        first = f" (first: {self.skipped[0][0]}: {self.skipped[0][1]})" if self.skipped else ""
        return f"{len(self.records)} conversations, {len(self.skipped)} skipped{first}"


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
        check(files, "data", "a folder holding .json or .jsonl files of conversations", f"{path} (none in it)")
        return files
    check(path.is_file(), "data", "a .json or .jsonl file of conversations (LLaVA layout), or a folder of them",
          f"{path} (no such file or folder)")
    check(path.suffix in SUFFIXES, "data", "a file ending in .json or .jsonl", str(path))
    return [path]


def _records(file: Path):
    """``(where, record)`` of a file; a ``.json`` that does not parse is refused (ValueError)."""
    text = file.read_text(encoding="utf-8", errors="replace")
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"data: {file} is not valid JSON ({err}); a file with a bad record in the middle "
                             "can be written one record per line (.jsonl), whose bad lines are skipped") from None
        check(isinstance(data, list), "data", f"{file} holding a JSON list of records", type(data).__name__)
        yield from ((f"{file}[{i}]", r) for i, r in enumerate(data))
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{file}:{n}", json.loads(line)
        except json.JSONDecodeError as err:
            yield f"{file}:{n}", ValueError(f"not JSON ({err.msg})")


def _parse(record, where: str, image_folder: Path) -> Conversation:
    """One record, or ValueError saying why it is skipped."""
    if isinstance(record, ValueError):
        raise record
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, got {type(record).__name__}")
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        raise ValueError("'conversations' must be a list of at least one human and one gpt turn")
    if turns and isinstance(turns[0], dict) and turns[0].get("from") == "system":
        raise ValueError("system turns are not supported")
    if len(turns) % 2:
        raise ValueError(f"turns must alternate human, gpt and end with gpt, got {len(turns)} turns")
    for i, turn in enumerate(turns):
        roles = ASSISTANT_ROLES if i % 2 else USER_ROLES
        if not isinstance(turn, dict) or turn.get("from") not in roles:
            got = turn.get("from") if isinstance(turn, dict) else type(turn).__name__
            raise ValueError(f"turn {i} must be from {' or '.join(roles)}, got {got!r}")
        if not isinstance(turn.get("value"), str) or not turn["value"].strip():
            raise ValueError(f"turn {i} has no text ('value')")
    pairs = [(turns[i]["value"], turns[i + 1]["value"]) for i in range(0, len(turns), 2)]
    image = record.get("image")
    tags = sum(q.count(IMAGE_TAG) for q, _ in pairs)
    if isinstance(image, list):
        if len(image) != 1:
            raise ValueError(f"one image per record is supported, got {len(image)}")
        image = image[0]
    if image is None:
        if tags:
            raise ValueError(f"{IMAGE_TAG} in the text but no 'image'")
        return Conversation(None, tuple(pairs), where)
    if not isinstance(image, str) or not image:
        raise ValueError(f"'image' must be a path, got {image!r}")
    if tags > 1 or any(IMAGE_TAG in q for q, _ in pairs[1:]):
        raise ValueError(f"one {IMAGE_TAG} tag, in the first human turn")
    path = image_folder / image
    if not path.is_file():
        raise ValueError(f"image {path} not found")
    first = pairs[0][0].replace(IMAGE_TAG, "").strip()
    if not first:
        raise ValueError("the first human turn has no text besides the image")
    pairs[0] = (first, pairs[0][1])
    return Conversation(path, tuple((q.strip(), a.strip()) for q, a in pairs), where)


def read_conversations(data, image_folder=None) -> Conversations:
    """The conversations in ``data`` (a ``.json`` / ``.jsonl`` file or a folder of them; see the
    module docstring), images found under ``image_folder`` (default: the data file's folder, or
    the folder itself). Refuses (ValueError naming the path) what cannot be read at all or holds no
    usable record; skips and counts malformed records."""
    check(isinstance(data, (str, Path)), "data", "a path", type(data).__name__)
    path = Path(data)
    files = _files(path)
    if image_folder is not None:
        check(Path(image_folder).is_dir(), "image_folder", "an existing folder", str(image_folder))
    out = Conversations()
    for file in files:
        root = Path(image_folder) if image_folder is not None else file.parent
        for where, record in _records(file):
            try:
                out.records.append(_parse(record, where, root))
            except ValueError as err:
                out.skipped.append((where, str(err)))
    if not out.records:
        first = f"; first: {out.skipped[0][0]}: {out.skipped[0][1]}" if out.skipped else ""
        raise ValueError(f"data: no usable conversation in {path} ({len(out.skipped)} records skipped{first})")
    return out


def load_image(path: Path):
    """The RGB PIL image at ``path``; ValueError when it cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as err:
        raise ValueError(f"image {path} cannot be read ({err})") from None


def messages(conversation: Conversation, turns: int, answered: bool) -> list[dict]:
    """The chat-template messages of the first ``turns`` turns (the last one's answer only when
    ``answered``): the image in the first user message, before its text."""
    out = []
    for i, (question, answer) in enumerate(conversation.turns[:turns]):
        content = ([{"type": "image"}] if i == 0 and conversation.image is not None else [])
        out.append({"role": "user", "content": content + [{"type": "text", "text": question}]})
        if i < turns - 1 or answered:
            out.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return out




def _encode(processor, text: str, image) -> dict:
    bos = processor.tokenizer.bos_token
    kwargs = dict(text=[text], return_tensors="pt", add_special_tokens=not (bos is not None and text.startswith(bos)))
    if image is not None:
        kwargs["images"] = [image]
    return processor(**kwargs)


def render(processor, conversation: Conversation, image=None) -> Rendered:
    """``conversation`` through ``processor``'s chat template (its ``image`` already loaded, as a
    PIL image). Turn k's answer tokens are the ids the template adds from the prompt with turn k's
    generation prompt to the conversation through turn k's answer; ValueError when the template
    does not render turns as prefixes of each other (then the record is skipped). Each text is
    encoded once; the last turn's is the whole conversation."""
    answer, prompt_len, done, last = [], None, [], None
    for k in range(1, len(conversation.turns) + 1):
        prompt = processor.apply_chat_template(messages(conversation, k, False), add_generation_prompt=True,
                                               tokenize=False)
        last = _encode(processor, processor.apply_chat_template(messages(conversation, k, True), tokenize=False),
                       image)
        a = _encode(processor, prompt, image)["input_ids"][0].tolist()
        b = last["input_ids"][0].tolist()
        if a[: len(done)] != done or b[: len(a)] != a or len(b) == len(a):
            raise ValueError(f"the chat template does not render turn {k} as a prefix of the conversation")
        prompt_len = len(a) if prompt_len is None else prompt_len
        answer += [False] * (len(a) - len(done)) + [True] * (len(b) - len(a))
        done = b
    vision = {k: last[k] for k in VISION_KEYS if k in last}
    return Rendered(done, answer, vision, prompt_len)

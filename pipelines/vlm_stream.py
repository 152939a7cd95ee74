"""``SpeculativeVLMPipeline.stream()``: questions about a live frame stream, each answer decoded
speculatively on one bounded cache (``mmspec.adapters.vlm_stream``: StreamingVLM's sink, vision
window, text window and position re-indexing).

The chat frame comes from the processor's own template, split around the image and the question:
the text before the image is the sink (fed once); a round is the chunk's frames (image
placeholders), then the text between the image and the question, the question and the text after
it (the generation prompt), then the answer and the end-of-turn mark (the EOS id).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..adapters.vlm_stream import ContextTarget, StreamPolicy, VLMStream
from ..core import LogitsProcessor
from ..core.errors import check
from . import checks
from .vlm_inputs import sampling_from_generation_config, user_message

_MARK = "mmspecquestionmark"  # lower case: templates may lower-case the question


@dataclass
class StreamAnswer:
    """One answer: its text and tokens, the decode's stats (``SpeculativeDecoder.generate``'s,
    plus ``context_tokens`` before the question, ``cache_bytes`` and ``seconds``, the answer's
    wall time including its question's feed)."""

    text: str
    tokens: list[int]
    stats: dict


class VLMStreamSession:
    """Built by ``SpeculativeVLMPipeline.stream``; ``add_frames`` then ``ask``, round after round."""

    def __init__(self, pipe, policy: StreamPolicy, capacity: int | None, chunk_frames: int = 1):
        self.pipe = pipe
        target, _ = pipe.views()
        tok = pipe.processor.tokenizer
        image_token = getattr(pipe.processor, "image_token", None) or tok.image_token
        text = pipe.processor.apply_chat_template(user_message(_MARK), add_generation_prompt=True, tokenize=False)
        check(text.count(image_token) == 1 and text.count(_MARK) == 1, "processor.chat_template",
              "a template writing one image placeholder and the question", text)
        before, after = text.split(image_token)
        between, closer = after.split(_MARK)
        add_bos = not (tok.bos_token is not None and text.startswith(tok.bos_token))
        # a frame's block: its placeholders and the special tokens the template wraps them in
        # (Qwen's vision start / end), which leave the sink and the question's frame words
        row = pipe.prepare_inputs([torch.zeros(3, 8, 8)], ["x"])[0][0]
        image_id = target.image_token_id
        first, last = row.index(image_id), len(row) - 1 - row[::-1].index(image_id)
        special = set(tok.all_special_ids) - {tok.bos_token_id}
        lead = 1 if first > 0 and row[first - 1] in special else 0
        trail = 1 if last + 1 < len(row) and row[last + 1] in special else 0
        self._wrap = (row[first - lead : first], row[last + 1 : last + 1 + trail])
        self.frame_tokens = last + 1 - first  # placeholders per frame (at this size)
        sink = tok(before, add_special_tokens=add_bos)["input_ids"]
        self.sink_ids = sink[: len(sink) - lead]
        self._between, self._closer, self._trail = between, closer, trail
        eos = sampling_from_generation_config(pipe.target.generation_config)["eos_token_id"]
        self.eos = eos
        self.end_of_turn = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)[:1]
        if capacity is None:  # the windows' frames and text, the previous text, a round's room
            capacity = (len(self.sink_ids) + policy.text_sink + policy.text_sliding_window
                        + (policy.vision_window + 1) * chunk_frames * (self.frame_tokens + lead + trail)
                        + (policy.text_window + 1) * 256 + 256)
        self.stream = VLMStream(target, self.sink_ids, policy, capacity)

    def fork(self) -> "VLMStreamSession":
        """An independent copy of the session (``VLMStream.fork``): the same context, asked
        separately."""
        new = object.__new__(VLMStreamSession)
        new.__dict__.update(self.__dict__)
        new.stream = self.stream.fork()
        return new

    def add_frames(self, frames) -> None:
        """Start a round with ``frames`` (a list of images, ``IMAGE_FORMS``: a chunk of the stream),
        pruning the cache by the policy first."""
        check(isinstance(frames, (list, tuple)) and len(frames) > 0, "frames", "a non-empty list of images", frames)
        ids, vision = self.pipe.prepare_inputs(list(frames), ["x"] * len(frames))
        image_id = self.stream.target.image_token_id
        block = []
        for row in ids:
            block += self._wrap[0] + [i for i in row if i == image_id] + self._wrap[1]
        self.stream.new_round(block, **self.stream.target.vision_inputs(**vision))

    @torch.no_grad()
    def ask(self, question: str, *, method: str = "none", max_new_tokens: int = 64, method_knobs: dict | None = None,
            temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
            generator: torch.Generator | None = None, remember: bool = True) -> StreamAnswer:
        """Answer ``question`` about the stream so far (after ``add_frames``); ``method`` as the
        pipeline's (``sd`` refused: its draft VLM would need a stream of its own).

        ``remember``: the question and answer join the context (StreamingVLM's rounds: one
        question a round). With False they are forgotten once answered: the context stays as it
        was, and the round may be asked again."""
        check(isinstance(remember, bool), "remember", "True or False", remember)
        check(isinstance(question, str) and question.strip() != "", "question", "a non-empty string", question)
        checks.check_int(max_new_tokens, "max_new_tokens", 1)
        rounds = self.stream.rounds
        check(bool(rounds) and not rounds[-1].question, "the session", "one question per round, asked after "
              "add_frames", "a second question" if rounds else "no frames yet")
        recipe = self.pipe.check_method(method, method_knobs)
        check("draft" not in recipe.requires, "method", "a method without a draft model (its cache would need the "
              "stream too): none, lookup, eagle, specvlm, vispec, medusa", method)
        start = time.perf_counter()
        tok = self.pipe.processor.tokenizer
        q_ids = tok(self._between + question + self._closer, add_special_tokens=False)["input_ids"][self._trail:]
        context = self.stream.context_tokens()
        sampling = sampling_from_generation_config(self.pipe.target.generation_config, temperature, top_k, top_p)
        sampling.pop("eos_token_id")
        decoder = self.pipe.build_decoder(recipe, LogitsProcessor(**sampling), target=ContextTarget(self.stream))
        out = decoder.generate([q_ids], max_new_tokens, eos_token_id=self.eos, generator=generator)
        answer = out.sequences[0, : out.lengths[0]].tolist()
        ends = bool(self.end_of_turn) and answer[-1:] == self.end_of_turn
        if remember:
            self.stream.close_answer(q_ids, answer[:-1] if ends else answer, self.end_of_turn)
        else:
            self.stream.discard_answer()
        stats = out.stats.as_dict()
        stats.update(context_tokens=context, cache_bytes=self.stream.cache.nbytes(),
                     seconds=time.perf_counter() - start)
        return StreamAnswer(tok.decode(answer, skip_special_tokens=True), answer, stats)

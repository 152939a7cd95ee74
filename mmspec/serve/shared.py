"""A queue that several callers share: VLM requests from different threads (the demo's users)
decoded together by continuous batching (``run_vlm_continuous``), each caller handed its own
answer.

    shared = SharedQueue(models, slots=4)
    future = shared.submit(image, "what shape is it ?", method="eagle")   # from any thread
    result = future.result()                                              # a serve.Result

One worker thread takes the oldest waiting request, waits ``window_s`` for others to arrive, and
decodes every waiting request with the same method, knobs and token limit as one group: ``slots``
rows at a time, a finished answer's row refilled by the next request's prefill
(``SpeculativeDecoder.serve``). Requests that arrive while a group decodes wait for the next group
(the group's cache is sized before it starts). Answers are greedy, so each equals the request run
alone (``run_vlm``); ``Result.stats`` adds ``group`` (requests decoded together) and
``queued_seconds`` (submit to the group's start). A request is checked when it is submitted
(``ValueError`` naming the argument, in the caller's thread); an error while decoding is raised by
every ``future.result()`` of its group.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import check, check_int
from .base import Models, check_seed
from .slots import run_vlm_continuous
from .vlm import check_requests


@dataclass
class _Request:
    image: np.ndarray
    question: str
    seed: int
    method: str
    knobs: dict
    max_new_tokens: int
    key: str  # requests with equal keys decode in one group
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)


class SharedQueue:
    """Greedy VLM requests from many threads, decoded in shared continuous batches.

    Args:
        models: the loaded pipelines (``Models``; the ``"vlm"`` one is used).
        slots: rows decoded at once (an int >= 1).
        window_s: seconds the worker waits after the first waiting request for others to join its
            group (a number >= 0).
    """

    def __init__(self, models: Models, slots: int = 4, window_s: float = 0.05):
        check_int(slots, "slots", 1)
        check(isinstance(window_s, (int, float)) and not isinstance(window_s, bool) and window_s >= 0, "window_s",
              "a number of seconds >= 0", window_s)
        self.models, self.slots, self.window_s = models, slots, float(window_s)
        self.groups: list[int] = []  # size of every group decoded so far, in order
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None

    def submit(self, image, question: str, seed: int = 0, method: str = "none", knobs: dict | None = None,
               max_new_tokens: int = 64) -> Future:
        """Queue one request (checked now, as ``run_vlm`` checks it) -> a ``Future`` of its ``Result``."""
        knobs = dict(knobs or {})
        image = check_requests([image], [question], [check_seed(seed)], method, knobs, max_new_tokens)[0]
        key = repr((method, sorted(knobs.items()), max_new_tokens))
        request = _Request(image, question, seed, method, knobs, max_new_tokens, key)
        with self._cond:
            self._pending.append(request)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="mmspec-shared-queue", daemon=True)
                self._worker.start()
            self._cond.notify()
        return request.future

    def _next_group(self) -> list[_Request]:
        with self._cond:
            while not self._pending:
                self._cond.wait()
        time.sleep(self.window_s)  # let the requests sent at about the same time join
        with self._cond:
            key = self._pending[0].key
            group = [r for r in self._pending if r.key == key]
            self._pending = [r for r in self._pending if r.key != key]
        return group

    def _work(self) -> None:
        while True:
            group = self._next_group()
            self.groups.append(len(group))
            first = group[0]
            start = time.perf_counter()
            try:
                for index, result in run_vlm_continuous(
                        self.models, [r.image for r in group], [r.question for r in group], [r.seed for r in group],
                        first.method, first.knobs, first.max_new_tokens, slots=min(self.slots, len(group))):
                    request = group[index]
                    result.stats.update(group=len(group), queued_seconds=round(start - request.submitted, 4))
                    request.future.set_result(result)
            except BaseException as err:  # every caller of the group sees it; the worker goes on
                for request in group:
                    if not request.future.done():
                        request.future.set_exception(err)


__all__ = ["SharedQueue"]

"""What generation returns (``GenerationResult``, ``StreamEvent``) and the text side of a sequence:
incremental detokenisation for streaming and stop-string matching (``TextTracker``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: finish reasons: a stop token id or stop string ended it; the token budget (max_new_tokens, or the
#: model's context / the KV cache when they cap it) ran out; the caller aborted it
FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass
class GenerationResult:
    """One finished request."""

    #: the request's request_id (or None)
    request_id: str | None
    #: the prompt's token ids as the model saw them
    prompt_ids: list[int]
    #: generated token ids only (a stop token id that ended the sequence is the last one)
    token_ids: list[int]
    #: log-probability of each generated token (see ``lockstep.generate.sampling.token_logprobs``)
    logprobs: list[float]
    #: generated text ("" without a tokenizer): without a final stop token, cut before a stop string
    text: str
    #: "stop", "length" or "abort"
    finish_reason: str


@dataclasses.dataclass
class StreamEvent:
    """One generated token of one request, as soon as it is sampled."""

    #: position of the request in the ``stream``/``generate`` call (the engine's sequence id for ``step``)
    index: int
    #: the engine's id of the sequence (what ``add_request`` returned)
    seq_id: int
    request_id: str | None
    token_id: int
    logprob: float
    #: new text since the previous event of this request (may be "" while a character is incomplete
    #: or could still be the start of a stop string)
    text: str
    finished: bool = False
    finish_reason: str | None = None
    #: the whole result, on the finishing event
    result: GenerationResult | None = None


class TextTracker:
    """Text of a growing list of generated ids; finds stop strings; hands out streamable deltas.

    The concatenation of all deltas equals the final text. A delta holds back a trailing
    incomplete UTF-8 character (decoded as U+FFFD) and, when stop strings are set, the last
    ``len(longest stop) - 1`` characters, which could still begin a stop string.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._search_from = 0

    def push(self, token_id: int | None) -> bool:
        """Add a token (None: nothing to add); True when a stop string now appears (text is cut before it)."""
        if self.tokenizer is None or token_id is None:
            return False
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids)
        if not self.stop:
            return False
        hits = [i for i in (self.text.find(s, self._search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        self._search_from = max(0, len(self.text) - self._hold)
        return False

    def delta(self, final: bool) -> str:
        """Text not handed out yet (all of it when ``final``)."""
        end = len(self.text)
        if not final:
            end -= self._hold
            while end > 0 and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:end], end
        return out


def follow(step: Callable[[], list[StreamEvent]], seq_ids: list[int],
           abort: Callable[[int], None]) -> Iterator[StreamEvent]:
    """The events of the sequences ``seq_ids`` as ``step()`` produces them, ``event.index`` set to the
    position in ``seq_ids``; leaving early aborts the sequences still running. Every engine's ``stream``."""
    index = {seq_id: i for i, seq_id in enumerate(seq_ids)}
    pending = set(index)
    try:
        while pending:
            for event in step():
                if event.seq_id in index:
                    event.index = index[event.seq_id]
                    if event.finished:
                        pending.discard(event.seq_id)
                    yield event
    finally:
        for seq_id in pending:
            abort(seq_id)


def final_results(events: Iterable[StreamEvent], n: int) -> list[GenerationResult]:
    """The result of each of ``n`` requests, in order, from a stream of their events (every engine's
    ``generate``)."""
    results: list[GenerationResult | None] = [None] * n
    for event in events:
        if event.finished:
            results[event.index] = event.result
    return results  # type: ignore[return-value]

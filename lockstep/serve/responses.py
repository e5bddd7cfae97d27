"""OpenAI response JSON from engine events: completions and chat, whole and as stream chunks.

Log-probabilities are the engine's: ``log_softmax(logits / T)`` at each token with ``T`` the
request's temperature (1 when greedy) -- the same numbers as ``GenerationResult.logprobs``; top-N
alternatives come from the same distribution (:mod:`lockstep.serve.loop`). A token's text is
``tokenizer.decode([id])`` (a byte-level piece of a multi-byte character decodes to U+FFFD; ``bytes``
in chat logprobs is that text's UTF-8).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from lockstep.generate.output import GenerationResult
from lockstep.serve.loop import TokenEvent


@dataclasses.dataclass
class Prepared:
    """A checked request, ready for the engine."""

    #: "completion" or "chat"
    kind: str
    model: str
    prompt_ids: list[int]
    #: top log-probabilities per token (0: none) and whether any log-probabilities are returned
    top_logprobs: int
    want_logprobs: bool
    return_token_ids: bool
    include_usage: bool
    #: stop ids of this request (for stop_reason): its own, the model's end-of-turn ids, eos
    stop_ids: frozenset[int]
    stop: list[str]
    #: answer with server-sent events
    stream: bool = False
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return f"{'cmpl' if self.kind == 'completion' else 'chatcmpl'}-{self.id}"


class Formatter:
    """Builds the JSON of one request's response from its :class:`TokenEvent` s."""

    def __init__(self, prep: Prepared, tokenizer: Any) -> None:
        self.prep, self.tokenizer = prep, tokenizer
        self._offset = 0  # completions' text_offset: characters of text handed out so far

    # ------------------------------------------------------------------ pieces

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, events: list[TokenEvent]) -> dict[str, Any]:
        tokens = [self.token_text(e.event.token_id) for e in events]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        tops = None
        if self.prep.top_logprobs:
            tops = []
            for e in events:
                top: dict[str, float] = {}
                for t, lp in e.top or []:  # two ids with one text (byte pieces): keep the likelier
                    top.setdefault(self.token_text(t), lp)
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.event.logprob for e in events], "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_logprobs(self, events: list[TokenEvent]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for e in events:
            item = entry(e.event.token_id, e.event.logprob)
            item["top_logprobs"] = [entry(t, lp) for t, lp in (e.top or [])]
            content.append(item)
        return {"content": content}

    def logprobs(self, events: list[TokenEvent]) -> dict[str, Any] | None:
        if not self.prep.want_logprobs:
            return None
        return self._completion_logprobs(events) if self.prep.kind == "completion" else self._chat_logprobs(events)

    def stop_reason(self, result: GenerationResult) -> int | str | None:
        """What ended a "stop" finish: the stop token id, or the stop string (vLLM's ``stop_reason``)."""
        if result.finish_reason != "stop" or not result.token_ids:
            return None
        last = result.token_ids[-1]
        if last in self.prep.stop_ids:
            return last
        rest = self.tokenizer.decode(result.token_ids)[len(result.text):]
        return next((s for s in sorted(self.prep.stop, key=len, reverse=True) if rest.startswith(s)), None)

    def usage(self, result: GenerationResult) -> dict[str, int]:
        prompt, completion = len(result.prompt_ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.prep.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.prep.response_id, "object": obj, "created": self.prep.created, "model": self.prep.model}

    # ------------------------------------------------------------------ whole responses

    def response(self, events: list[TokenEvent]) -> dict[str, Any]:
        result = events[-1].event.result
        assert result is not None
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(events),
                                  "finish_reason": _finish(result.finish_reason),
                                  "stop_reason": self.stop_reason(result)}
        if self.prep.kind == "completion":
            choice["text"] = result.text
        else:
            choice["message"] = {"role": "assistant", "content": result.text}
        if self.prep.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        body = {**self._head(chunk=False), "choices": [choice], "usage": self.usage(result)}
        if self.prep.return_token_ids:
            body["prompt_token_ids"] = list(result.prompt_ids)
        return body

    # ------------------------------------------------------------------ stream chunks

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (empty content), as OpenAI's do."""
        if self.prep.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        return {**self._head(chunk=True), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None}]}

    def chunk(self, events: list[TokenEvent]) -> dict[str, Any] | None:
        """One chunk for ``events`` (one or more tokens); None when there is nothing to send."""
        text = "".join(e.event.text for e in events)
        last = events[-1].event
        if not text and not last.finished and not self.prep.want_logprobs and not self.prep.return_token_ids:
            return None  # (a token without text still carries its id when the client asked for ids)
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(events),
                                  "finish_reason": _finish(last.finish_reason) if last.finished else None}
        if self.prep.kind == "completion":
            choice["text"] = text
        else:
            choice["delta"] = {"content": text} if text or not last.finished else {}
        if self.prep.return_token_ids:
            choice["token_ids"] = [e.event.token_id for e in events]
        if last.finished:
            assert last.result is not None
            choice["stop_reason"] = self.stop_reason(last.result)
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage(result)}


def _finish(reason: str | None) -> str | None:
    """OpenAI's finish reasons: the engine's "stop" and "length" as they are; "abort" is not one."""
    return None if reason is None else ("stop" if reason == "abort" else reason)

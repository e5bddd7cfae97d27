"""The OpenAI request bodies the server accepts, checked field by field, and their sampling.

``CompletionBody`` (``/v1/completions``) and ``ChatBody`` (``/v1/chat/completions``) are strict
pydantic models: a wrong type is an :class:`ApiError` (HTTP 400, OpenAI's error JSON) whose message
and ``param`` name the field. Fields OpenAI defines that this server does not implement
(``n`` > 1, ``best_of``, ``echo``, ``suffix``, penalties, ``logit_bias``, tools) are refused with a
400 when set to anything but their neutral value; unknown fields are ignored, as OpenAI does.

Extensions (as vLLM spells them): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``return_token_ids`` (each choice gets the generated ``token_ids``, the response ``prompt_token_ids``),
and for chat ``add_generation_prompt`` / ``continue_final_message`` (the model continues the last
assistant message instead of opening a new turn: how :mod:`lockstep.serve.agent` runs multi-turn
tool environments).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from lockstep.generate.config import SamplingParams

#: OpenAI's cap on stop sequences
MAX_STOP = 4
#: most top log-probabilities per token (OpenAI: 20 for chat, 5 for completions; one cap here)
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    return_token_ids: bool = False

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_common(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n: only n=1 is supported, got {self.n} (send n separate requests, with "
                                f"different seeds)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ApiError(400, f"{name}: not supported by this server (must be 0)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias: not supported by this server", "logit_bias")
        stops = self.stop_list()
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ApiError(400, f"stop: at most {MAX_STOP} non-empty strings, got {stops!r}", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise ApiError(400, f"stop_token_ids: must be non-negative, got {self.stop_token_ids}", "stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (``temperature=0`` is greedy; ``top_k`` -1 or 0 = off)."""
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature,
                              top_k=max(self.top_k, 0), top_p=self.top_p, seed=self.seed, stop=self.stop_list(),
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)


class CompletionBody(_Common):
    """``/v1/completions``: a text prompt or token ids (one prompt: a one-element list is accepted)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    #: top log-probabilities per token (0: the chosen token's only)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise ApiError(400, "echo: not supported by this server", "echo")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of: only 1 is supported, got {self.best_of}", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix: not supported by this server", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request is supported, got a batch of {len(prompt)}",
                               "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        return prompt  # type: ignore[return-value]


class ImageUrl(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    url: str
    #: OpenAI's resolution hint; the model's processor decides the resolution here
    detail: Literal["auto", "low", "high"] = "auto"


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @property
    def image_count(self) -> int:
        return 0 if not isinstance(self.content, list) else sum(p.type == "image_url" for p in self.content)

    def text(self) -> str:
        """The text parts joined (image parts left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")

    def template_content(self, where: str) -> str | list[dict[str, Any]]:
        """What the chat template gets: a string (text parts joined, as before images), or with image
        parts the list of parts (the template writes each image's placeholder)."""
        if not isinstance(self.content, list):
            return self.text()
        for i, part in enumerate(self.content):
            field = f"{where}.content[{i}]"
            if part.type == "text" and part.text is None:
                raise ApiError(400, f"{field}.text: a text part needs its text", f"{field}.text")
            if part.type == "image_url":
                if part.image_url is None:
                    raise ApiError(400, f"{field}.image_url: an image_url part needs image_url.url",
                                   f"{field}.image_url")
                if self.role != "user":
                    raise ApiError(400, f"{field}: image parts are taken in user messages only (this one is "
                                        f"{self.role!r})", field)
            elif part.type != "text":
                raise ApiError(400, f"{field}: only text and image_url parts are supported, got type {part.type!r}",
                               field)
        if not self.image_count:
            return self.text()
        return [{"type": "text", "text": p.text} if p.type == "text" else
                {"type": "image_url", "image_url": {"url": p.image_url.url}}  # type: ignore[union-attr]
                for p in self.content]


class ChatBody(_Common):
    """``/v1/chat/completions``."""

    messages: list[Message]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise ApiError(400, "messages: must hold at least one message", "messages")
        if self.tools:
            raise ApiError(400, "tools: tool calling is not supported by this server", "tools")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ApiError(400, "continue_final_message: needs add_generation_prompt: false",
                               "continue_final_message")
            if self.messages[-1].role != "assistant":
                raise ApiError(400, "continue_final_message: the last message must be the assistant's",
                               "continue_final_message")

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (``developer`` as ``system``); content parts
        checked, kept as a list only where images are (:meth:`Message.template_content`)."""
        return [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.template_content(f"messages[{i}]")} for i, m in enumerate(self.messages)]

    @property
    def image_count(self) -> int:
        return sum(m.image_count for m in self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(cls: type[BaseModel], body: Any) -> Any:
    """``cls`` from a decoded JSON body; a validation error becomes a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: must be a JSON object, got {type(body).__name__}")
    try:
        parsed = cls.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        # a union's alternatives add their type name to loc ("prompt", "str"); keep the field path
        loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
        field = _dotted(loc) or "request body"
        got = "" if first["type"] == "missing" else f" (got {first.get('input')!r:.80})"
        raise ApiError(400, f"{field}: {first['msg']}{got}", field) from None
    parsed.check()
    return parsed


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain"}


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out

"""The FastAPI application: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

``create_app(engine, ...)`` wraps any engine with the lockstep Engine's request API
(:class:`~lockstep.serve.loop.ServableEngine`) in an :class:`~lockstep.serve.loop.EngineLoop`
(started and stopped with the app). A handler checks the body (:mod:`lockstep.serve.protocol`),
tokenises the prompt (the chat template of the model's tokenizer for chat), checks it against the
context (``prompt + max_tokens`` <= ``min(model.max_seq_len, KV-cache tokens)``), submits it and
answers the whole response or a server-sent-event stream (``data: {chunk}`` lines, then
``data: [DONE]``). Chat image parts are checked and decoded by :mod:`lockstep.serve.images` (off the
event loop) and handed to the engine as ``Request.images`` beside the rendered prompt. Errors use
OpenAI's JSON shape: 400 bad request (naming the field), 429 queue full, 503 shutting down / engine
failed. ``GET /stats`` returns the loop's counters, ``GET /health`` 200 while the engine loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lockstep.generate.config import Request
from lockstep.serve.images import ImageLimits, image_refusal, load_images
from lockstep.serve.loop import EngineLoop, Failure, Handle, QueueFull, ServableEngine, TokenEvent, Unavailable
from lockstep.serve.protocol import ApiError, ChatBody, CompletionBody, parse_body
from lockstep.serve.responses import Formatter, Prepared

#: completions' max_tokens when the request gives none (OpenAI's default)
DEFAULT_COMPLETION_TOKENS = 16
#: chat's max_tokens when the request gives none (capped by the rest of the context). OpenAI's is
#: unlimited, but the engine reserves KV-cache blocks for each request's worst case when it admits
#: it, so "the rest of a long context" would let only a few chats run at once
DEFAULT_CHAT_TOKENS = 1024
#: seconds between checks that a waiting client is still connected
DISCONNECT_POLL_S = 0.5


def context_limit(engine: Any) -> int:
    """Most tokens (prompt + generated) one request may hold: the model's context, and the KV cache's."""
    limit = int(engine.max_seq_len)
    cache = getattr(engine, "cache", None)
    capacity = getattr(cache, "capacity_tokens", None)
    return min(limit, int(capacity)) if capacity is not None else limit


class Server:
    """The state behind the routes: engine loop, tokenizer, chat template, served model name."""

    def __init__(self, engine: ServableEngine, *, model_name: str, chat_template: Any = None,
                 stop_token_ids: list[int] | None = None, max_batch_size: int = 32, max_queue: int = 64,
                 default_chat_tokens: int = DEFAULT_CHAT_TOKENS, image_limits: ImageLimits | None = None) -> None:
        if engine.tokenizer is None:
            raise ValueError("serve: the engine needs a tokenizer (text in, text out)")
        self.engine, self.tokenizer, self.chat_template = engine, engine.tokenizer, chat_template
        self.model_name, self.default_chat_tokens = model_name, default_chat_tokens
        self.stop_token_ids = list(stop_token_ids or [])
        self.loop = EngineLoop(engine, max_batch_size=max_batch_size, max_queue=max_queue)
        self.limit = context_limit(engine)
        self.vocab_size = getattr(engine, "vocab_size", None)
        self.eos_id = getattr(engine, "eos_id", None)
        self.created = int(time.time())
        self.image_limits = image_limits or ImageLimits()
        #: None when the engine takes images (chat image parts), else why not
        self.image_refusal = image_refusal(engine)

    # ------------------------------------------------------------------ request preparation

    def _check_model(self, model: str | None) -> str:
        if model is not None and model != self.model_name:
            raise ApiError(400, f"model: unknown model {model!r}; this server serves {self.model_name!r}", "model",
                           code="model_not_found")
        return self.model_name

    def _check_prompt_ids(self, ids: list[int], field: str) -> None:
        if not ids:
            raise ApiError(400, f"{field}: the prompt encodes to no tokens", field)
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                               field)
        if len(ids) >= self.limit:
            raise ApiError(400, f"{field}: the prompt has {len(ids)} tokens; the context holds {self.limit} "
                                f"(prompt + max_tokens), so nothing is left to generate", field)

    def _max_tokens(self, requested: int | None, n_prompt: int, default: int) -> int:
        room = self.limit - n_prompt
        if requested is None:
            return min(default, room)
        if requested > room:
            raise ApiError(400, f"max_tokens: {requested} new tokens and the prompt's {n_prompt} exceed the context "
                                f"of {self.limit} tokens; at most {room} fit", "max_tokens")
        return requested

    def _stop_ids(self, body: Any) -> frozenset[int]:
        ids = set(body.stop_token_ids) | set(self.stop_token_ids)
        if self.eos_id is not None and not body.ignore_eos:
            ids.add(self.eos_id)
        return frozenset(ids)

    def prepare_completion(self, body: CompletionBody) -> tuple[Prepared, Request]:
        model = self._check_model(body.model)
        prompt = body.single_prompt()
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        self._check_prompt_ids(ids, "prompt")
        max_new = self._max_tokens(body.max_tokens, len(ids), DEFAULT_COMPLETION_TOKENS)
        top = body.logprobs or 0
        prep = Prepared("completion", model, ids, top, body.logprobs is not None, body.return_token_ids,
                        bool(body.stream_options and body.stream_options.include_usage), self._stop_ids(body),
                        body.stop_list(), stream=body.stream)
        return prep, self._request(prep, body, max_new)

    def prepare_chat(self, body: ChatBody) -> tuple[Prepared, Request]:
        model = self._check_model(body.model)
        if self.chat_template is None:
            raise ApiError(400, "messages: this model's tokenizer has no chat template; use /v1/completions, or "
                                "start the server with --chat-template FILE", "messages")
        messages = body.template_messages()
        images = self._images(messages) if body.image_count else None
        try:
            text = self.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
        except ValueError as err:  # ConfigError from the template (raise_exception, bad roles)
            raise ApiError(400, f"messages: {err}", "messages") from None
        if body.continue_final_message:  # cut what the template wrote after the last assistant text
            final = messages[-1]["content"]
            end = text.rfind(final) if final else -1
            if end >= 0:
                text = text[:end + len(final)]
        ids = list(self.tokenizer.encode(text))
        self._check_prompt_ids(ids, "messages")
        max_new = self._max_tokens(body.requested_max_tokens, len(ids), self.default_chat_tokens)
        top = body.top_logprobs or 0
        prep = Prepared("chat", model, ids, top, body.logprobs, body.return_token_ids,
                        bool(body.stream_options and body.stream_options.include_usage), self._stop_ids(body),
                        body.stop_list(), stream=body.stream)
        return prep, self._request(prep, body, max_new, images)

    def _images(self, messages: list[dict[str, Any]]) -> list[Any]:
        """The decoded images of the image parts (:mod:`lockstep.serve.images`), or a 400 when the engine
        takes none. With images, the prompt's length after the engine expands each image's placeholder
        is checked by the engine (a 400 too), and ``max_tokens`` is capped at the context's room."""
        if self.image_refusal is not None:
            i, j = next((i, j) for i, m in enumerate(messages) if not isinstance(m["content"], str)
                        for j, p in enumerate(m["content"]) if p["type"] == "image_url")
            raise ApiError(400, f"messages[{i}].content[{j}]: {self.image_refusal}", f"messages[{i}].content[{j}]")
        return load_images(messages, self.image_limits)

    def _request(self, prep: Prepared, body: Any, max_new: int, images: list[Any] | None = None) -> Request:
        if prep.top_logprobs and not self.loop.supports_top_logprobs:
            field = "logprobs" if prep.kind == "completion" else "top_logprobs"
            raise ApiError(400, f"{field}: this engine returns only the chosen token's log-probability (use 0)",
                           field)
        sampling = body.sampling(max_new)
        sampling.stop_token_ids = sorted(set(sampling.stop_token_ids) | set(self.stop_token_ids))
        try:
            sampling.validate("sampling")
        except ValueError as err:
            raise ApiError(400, str(err).removeprefix("sampling."), None) from None
        return Request(prompt_ids=prep.prompt_ids, sampling=sampling, request_id=prep.response_id, images=images)

    # ------------------------------------------------------------------ running

    def submit(self, prep: Prepared, request: Request) -> Handle:
        try:
            return self.loop.submit(request, prep.top_logprobs)
        except QueueFull as err:
            raise ApiError(429, str(err), None, kind="rate_limit_error", code="queue_full") from None
        except Unavailable as err:
            raise ApiError(503, str(err), None, kind="server_error", code="unavailable") from None


async def _next(handle: Handle) -> TokenEvent:
    item = await handle.get()
    if isinstance(item, Failure):
        if item.kind == "invalid":
            raise ApiError(400, item.message, None)
        raise ApiError(503, item.message, None, kind="server_error", code="unavailable")
    return item


class ClientGone(Exception):
    """The client disconnected before its (non-streaming, or not yet started) response."""


class _Watched:
    """A handle's events for a client that may leave: every ``DISCONNECT_POLL_S`` (between events,
    or while waiting for one) it checks the connection and raises :class:`ClientGone` once it is
    closed -- a request waiting in the queue or generating for nobody would hold its slot to the
    end. (A stream notices a disconnect itself: its generator is cancelled.)"""

    def __init__(self, handle: Handle, http: HttpRequest) -> None:
        self.handle, self.http, self.checked = handle, http, time.monotonic()

    async def next(self) -> TokenEvent:
        while True:
            if time.monotonic() - self.checked >= DISCONNECT_POLL_S:
                self.checked = time.monotonic()
                if await self.http.is_disconnected():
                    raise ClientGone()
            try:  # a Queue.get cancelled by the timeout loses nothing
                return await asyncio.wait_for(_next(self.handle), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(server: Server, handle: Handle, fmt: Formatter, first: TokenEvent) -> AsyncIterator[str]:
    """The SSE body: the first event was already received (so errors before any token are a status)."""
    finished = False
    try:
        opening = fmt.first_chunk()
        if opening is not None:
            yield _sse(opening)
        event = first
        while True:
            pending = [event]
            while not event.event.finished and not handle.queue.empty():  # tokens that arrived meanwhile
                item = handle.queue.get_nowait()
                if isinstance(item, Failure):
                    raise ApiError(503, item.message, kind="server_error", code="unavailable")
                event = item
                pending.append(event)
            for group in ([pending] if not fmt.prep.want_logprobs else [[e] for e in pending]):
                chunk = fmt.chunk(group)
                if chunk is not None:
                    yield _sse(chunk)
            if event.event.finished:
                finished = True
                if fmt.prep.include_usage:
                    yield _sse(fmt.usage_chunk(event.event.result))
                yield "data: [DONE]\n\n"
                return
            event = await _next(handle)
    except ApiError as err:  # the engine failed mid-stream: an error event, then the end
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away (or the stream failed): free the engine's slot
            server.loop.abort(handle)


def create_app(engine: ServableEngine, *, model_name: str = "lockstep", chat_template: Any = None,
               stop_token_ids: list[int] | None = None, max_batch_size: int = 32, max_queue: int = 64,
               default_chat_tokens: int = DEFAULT_CHAT_TOKENS, image_limits: ImageLimits | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (see the module docstring). ``app.state.server`` is
    the :class:`Server` (its ``loop.stats`` holds the batching counters). ``image_limits``: what chat
    image parts may hold (:mod:`lockstep.serve.images`; default: no ``file://`` URLs)."""
    server = Server(engine, model_name=model_name, chat_template=chat_template, stop_token_ids=stop_token_ids,
                    max_batch_size=max_batch_size, max_queue=max_queue, default_chat_tokens=default_chat_tokens,
                    image_limits=image_limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()
            close = getattr(engine, "close", None)  # the vLLM engine: its engine core (and processes)
            if callable(close):
                close()

    app = FastAPI(title="lockstep serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    async def body_of(http: HttpRequest) -> Any:
        try:
            return await http.json()
        except ValueError:
            raise ApiError(400, "request body: not valid JSON") from None

    async def run(prep: Prepared, request: Request, http: HttpRequest) -> Any:
        handle = server.submit(prep, request)
        fmt = Formatter(prep, server.tokenizer)
        watched = _Watched(handle, http)
        try:
            events = [await watched.next()]
            if prep.stream:
                return StreamingResponse(_stream(server, handle, fmt, events[0]), media_type="text/event-stream")
            while not events[-1].event.finished:
                events.append(await watched.next())
        except BaseException as err:  # an error, or the client left: free the engine's slot
            server.loop.abort(handle)
            if isinstance(err, ClientGone):
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
            raise
        return JSONResponse(fmt.response(events))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Any:
        body = parse_body(CompletionBody, await body_of(http))
        prep, request = server.prepare_completion(body)
        return await run(prep, request, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Any:
        body = parse_body(ChatBody, await body_of(http))
        if body.image_count:  # decoding images takes a while: not on the event loop
            prep, request = await asyncio.to_thread(server.prepare_chat, body)
        else:
            prep, request = server.prepare_chat(body)
        return await run(prep, request, http)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "lockstep", "max_model_len": server.limit}]}

    @app.get("/health")
    async def health() -> Any:
        if server.loop.error is not None:
            raise ApiError(503, f"the engine failed: {server.loop.error}", kind="server_error")
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> Any:
        return {**vars(server.loop.stats), "in_flight": server.loop.in_flight, "capacity": server.loop.capacity}

    return app

"""The engine loop: one thread owns the engine and steps it with every active request.

HTTP handlers (asyncio) never touch the engine. They :meth:`EngineLoop.submit` a
:class:`~lockstep.generate.Request` and read its :class:`~lockstep.generate.StreamEvent` s from an
``asyncio.Queue`` (:class:`Handle`); the loop thread hands new requests and aborts to the engine
*between* steps (``add_request`` / ``abort``), calls ``engine.step()`` while anything is unfinished,
and posts each event to its handle's queue with ``call_soon_threadsafe``. So requests join and leave
the running batch between steps: continuous batching across concurrent HTTP requests.

**Engine-neutral.** The engine is any object with the lockstep Engine's request API
(:class:`ServableEngine`): ``add_request(Request) -> id``, ``step() -> [StreamEvent]``, ``abort(id)``,
``has_unfinished``, ``tokenizer``, ``max_seq_len``. ``on_logits`` (the lockstep Engine's hook,
``on_logits(seq_ids, logits [B, V] fp32)``) is optional: without it, top-N log-probabilities are
refused (:attr:`EngineLoop.supports_top_logprobs`); so is ``vision`` (the lockstep Engine's, not None
for a vision-language model): without it, chat image parts are refused (:mod:`lockstep.serve.images`).

**Overload.** At most ``max_batch_size + max_queue`` requests are in flight (running or waiting);
one more is refused with :class:`QueueFull` (HTTP 429). After :meth:`stop`, or once a step raised,
every submit is refused with :class:`Unavailable` (HTTP 503), and the requests in flight end with
an error event.

**Counters** (``stats``): engine steps and the seconds spent in them, the most requests that
produced a token in one step, and the number of steps where more than one did (proof that
batching happened).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Any, Protocol, runtime_checkable

import torch

from lockstep.generate.config import Request
from lockstep.generate.output import GenerationResult, StreamEvent


@runtime_checkable
class ServableEngine(Protocol):
    """What the server needs of an engine: the lockstep Engine's request API."""

    tokenizer: Any
    max_seq_len: int

    def add_request(self, request: Request) -> int: ...

    def step(self) -> list[StreamEvent]: ...

    def abort(self, seq_id: int) -> GenerationResult | None: ...

    @property
    def has_unfinished(self) -> bool: ...


class QueueFull(RuntimeError):
    """Too many requests in flight (HTTP 429)."""


class Unavailable(RuntimeError):
    """The loop is shutting down or the engine failed (HTTP 503)."""


@dataclasses.dataclass
class Failure:
    """What a handle's queue gets instead of events when its request could not run."""

    #: "invalid" (the engine refused the request: HTTP 400) or "unavailable" (HTTP 503)
    kind: str
    message: str


@dataclasses.dataclass
class TokenEvent:
    """One engine event and, when the request asked for them, the top log-probabilities at that step."""

    event: StreamEvent
    #: [(token_id, logprob)] most likely first; None when not asked for
    top: list[tuple[int, float]] | None = None


class Handle:
    """One submitted request as its HTTP handler sees it: ``await handle.get()`` yields
    :class:`TokenEvent` s until one is ``finished``, or a :class:`Failure`."""

    def __init__(self, request: Request, top_logprobs: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request, self.top_logprobs, self._loop = request, top_logprobs, loop
        self.queue: asyncio.Queue[TokenEvent | Failure] = asyncio.Queue()
        self.seq_id: int | None = None
        self.done = False

    def post(self, item: TokenEvent | Failure) -> None:
        """From the loop thread."""
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    async def get(self) -> TokenEvent | Failure:
        return await self.queue.get()


@dataclasses.dataclass
class LoopStats:
    #: engine.step() calls
    steps: int = 0
    #: the most distinct requests that got a token in one step
    max_active: int = 0
    #: steps in which more than one request got a token
    batched_steps: int = 0
    #: requests that ran to a result
    finished: int = 0
    #: requests refused because the queue was full
    rejected: int = 0
    #: seconds spent inside engine.step() (the rest of the loop's time: waiting, handing out events)
    step_seconds: float = 0.0


class EngineLoop:
    """See the module docstring."""

    def __init__(self, engine: ServableEngine, *, max_batch_size: int, max_queue: int) -> None:
        if not isinstance(engine, ServableEngine):
            raise TypeError(f"serve: the engine must have the lockstep Engine's request API (add_request, step, "
                            f"abort, has_unfinished, tokenizer, max_seq_len); got {type(engine).__name__}")
        self.engine = engine
        self.capacity = max_batch_size + max_queue
        self.stats = LoopStats()
        self.supports_top_logprobs = hasattr(engine, "on_logits")
        self._lock = threading.Condition()
        self._incoming: collections.deque[Handle] = collections.deque()
        self._aborts: collections.deque[Handle] = collections.deque()
        self._active: dict[int, Handle] = {}  # engine seq id -> handle (loop thread only)
        self._in_flight = 0  # submitted, not yet finished (under _lock)
        self._top: dict[int, collections.deque] = {}  # seq id -> top log-probs of its pending tokens
        self._stopping = False
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="lockstep-serve-engine", daemon=True)
        if self.supports_top_logprobs:
            engine.on_logits = self._on_logits  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ handler side (event loop thread)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, end those in flight with a 503 failure, join the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, request: Request, top_logprobs: int = 0) -> Handle:
        """Queue ``request`` for the engine; raises :class:`Unavailable` or :class:`QueueFull`."""
        handle = Handle(request, top_logprobs, asyncio.get_running_loop())
        with self._lock:
            if self._stopping or self.error is not None:
                raise Unavailable(self._unavailable_reason())
            if self._in_flight >= self.capacity:
                self.stats.rejected += 1
                raise QueueFull(f"the server is at capacity ({self.capacity} requests in flight: max batch size + "
                                f"max queue); retry later")
            self._in_flight += 1
            self._incoming.append(handle)
            self._lock.notify_all()
        return handle

    def abort(self, handle: Handle) -> None:
        """Stop a request whose client went away (its blocks return to the cache)."""
        with self._lock:
            if not handle.done:
                self._aborts.append(handle)
                self._lock.notify_all()

    def _unavailable_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {self.error}"
        return "the server is shutting down"

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._incoming or self._aborts or self.engine.has_unfinished):
                        self._lock.wait()
                    if self._stopping:
                        break
                    incoming, self._incoming = list(self._incoming), collections.deque()
                    aborts, self._aborts = list(self._aborts), collections.deque()
                for handle in incoming:
                    self._add(handle)
                for handle in aborts:
                    self._abort(handle)
                if self.engine.has_unfinished:
                    self._step()
        except BaseException as err:  # the engine is in an unknown state: fail everything, refuse new work
            self.error = f"{type(err).__name__}: {err}"
        self._fail_all(Failure("unavailable", self._unavailable_reason()))

    def _add(self, handle: Handle) -> None:
        try:
            handle.seq_id = self.engine.add_request(handle.request)
        except (ValueError, TypeError) as err:  # ConfigError is a ValueError: the request is bad
            self._finish(handle, Failure("invalid", str(err)))
            return
        self._active[handle.seq_id] = handle
        if handle.top_logprobs:
            self._top[handle.seq_id] = collections.deque()

    def _abort(self, handle: Handle) -> None:
        if handle.seq_id is not None and self._active.pop(handle.seq_id, None) is not None:
            self.engine.abort(handle.seq_id)
            self._top.pop(handle.seq_id, None)
            self._finish(handle, None)

    def _step(self) -> None:
        start = time.perf_counter()
        events = self.engine.step()
        self.stats.step_seconds += time.perf_counter() - start
        self.stats.steps += 1
        active = len({e.seq_id for e in events})
        self.stats.max_active = max(self.stats.max_active, active)
        self.stats.batched_steps += active > 1
        for event in events:
            handle = self._active.get(event.seq_id)
            if handle is None:
                continue
            tops = self._top.get(event.seq_id)
            handle.post(TokenEvent(event, tops.popleft() if tops else None))
            if event.finished:
                del self._active[event.seq_id]
                self._top.pop(event.seq_id, None)
                self.stats.finished += 1
                self._finish(handle, None)

    def _on_logits(self, seq_ids: list[int], logits: torch.Tensor) -> None:
        """The engine's hook before sampling: the top-N log-probabilities of the rows that asked,
        at the request's logprob temperature (``T``, 1 when greedy), as the engine's own logprobs."""
        for row, seq_id in enumerate(seq_ids):
            tops = self._top.get(seq_id)
            if tops is None:
                continue
            handle = self._active[seq_id]
            t = handle.request.sampling.temperature
            scaled = logits[row].float() / (t if t > 0 else 1.0)
            values, ids = torch.log_softmax(scaled, dim=-1).topk(handle.top_logprobs)
            tops.append(list(zip(ids.tolist(), values.tolist())))

    def _finish(self, handle: Handle, failure: Failure | None) -> None:
        handle.done = True
        with self._lock:
            self._in_flight -= 1
        if failure is not None:
            handle.post(failure)

    def _fail_all(self, failure: Failure) -> None:
        with self._lock:
            pending = list(self._incoming) + list(self._active.values())
            self._incoming.clear()
        self._active.clear()
        for handle in pending:
            if not handle.done:
                self._finish(handle, failure)

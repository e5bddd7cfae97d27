"""``VllmEngine``: lockstep's generation API (``Request`` / ``SamplingParams`` in, ``StreamEvent`` /
``GenerationResult`` out) over a vLLM engine running the lockstep model (:mod:`lockstep.vllm.model`).

It takes what lockstep's :class:`~lockstep.generate.Engine` takes (a lockstep ``Transformer``, a
tokenizer, an :class:`~lockstep.generate.EngineConfig`) and answers the same calls: ``add_request``,
``step``, ``abort``, ``has_unfinished``, ``stream``, ``generate``. vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) and never sees a tokenizer: prompts go
in as token ids, text and stop strings are lockstep's (:class:`~lockstep.generate.output.TextTracker`).

Weights: vLLM starts on placeholder weights and :meth:`VllmEngine.load_weights` copies the model's
tensors into vLLM's copy in place (no restart); RL generators call it for every new version.

What maps and what does not (docs/generation.md, "vLLM"): ``max_batch_size`` -> vLLM's
``max_num_seqs``, ``max_prefill_tokens`` -> ``max_num_batched_tokens``, ``cache_memory_mb`` -> its
KV cache bytes, ``weights_dtype`` -> its dtype, ``batch_invariant`` -> lockstep's batch-invariant
kernels in the lockstep modules (not in vLLM's attention), ``pack_weights`` / ``linear_kernel`` ->
the lockstep modules' linears run on prepacked weights on CPU as in lockstep's engine
(:func:`lockstep.generate.packed.pack_linears`; each pack follows its weight's version counter, so
:meth:`VllmEngine.load_weights`' in-place copies repack it at the next step); compiled decode and
paged_attention have no vLLM counterpart and are ignored (vLLM runs eager). Log-probabilities
are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` as lockstep's, except that vLLM
renormalises over what top-k/top-p keep where lockstep does not. Seeded sampling is reproducible
within vLLM but draws other tokens than lockstep's engine for the same seed; greedy is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.generate.config import EngineConfig, Request, SamplingParams
from lockstep.generate.engine import tokenizer_eos_id
from lockstep.generate.packed import linear_kernel, pack_linears, packable
from lockstep.generate.output import GenerationResult, StreamEvent, TextTracker, final_results, follow
from lockstep.models.hf.io import resolve_dtype
from lockstep.vllm import DIE_WITH_PARENT, configure_environment, register
from lockstep.vllm.model import check_supported, padded_head_size
from lockstep.vllm.model_dir import write_model_dir

_instances = itertools.count()
#: VllmEngines running in this process, and the engine cores of those closed while others ran (close)
_in_process_live = 0
_closed_in_process: list[Any] = []


@dataclasses.dataclass
class _Sequence:
    """The lockstep side of one vLLM request."""

    seq_id: int
    request: Request
    prompt: list[int]
    text: TextTracker
    #: token ids that end the sequence (the request's, and eos unless ignore_eos): kept, but not in the text
    stop_ids: frozenset[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def result(self) -> GenerationResult:
        return GenerationResult(self.request.request_id, self.prompt, list(self.token_ids), list(self.logprobs),
                                self.text.text, self.finish_reason or "abort")


class VllmEngine:
    """lockstep's Engine API over vLLM running the lockstep model (module docstring)."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, config: EngineConfig | None = None, *,
                 separate_process: bool | None = None) -> None:
        """``separate_process``: run vLLM's engine core in a process of its own (spawned) instead of this
        one; None: only when this process is already in a torch.distributed job (an RL generator),
        whose process group vLLM would otherwise take for its own world."""
        global _in_process_live
        self.config = config = config or EngineConfig()
        config.validate()
        if not hasattr(model, "trunk") or not hasattr(model, "layers"):
            raise TypeError(f"VllmEngine needs a lockstep Transformer (with trunk() and layers), "
                            f"got {type(model).__name__}")
        check_supported(model)  # before starting vLLM: a clear error naming the family
        self.model, self.tokenizer = model, tokenizer
        weights_dtype = resolve_dtype(None if config.weights_dtype == "model" else config.weights_dtype)
        self.dtype = weights_dtype or model.tok_embeddings.weight.dtype
        self.vocab_size, self.max_seq_len = model.config.vocab_size, model.config.max_seq_len
        #: the longest sequence vLLM takes: the model's context, or what the KV cache holds if less (vLLM
        #: refuses to start when one sequence of max_model_len does not fit)
        self.context = min(self.max_seq_len, _cache_tokens(model, self.dtype, config.cache_memory_mb))
        if self.context < 1:
            raise ConfigError(f"engine.cache_memory_mb: {config.cache_memory_mb} MiB holds no token of this model's "
                              f"KV cache")
        self.eos_id = tokenizer_eos_id(tokenizer) if tokenizer is not None else None
        self._dir = tempfile.TemporaryDirectory(prefix="lockstep-vllm-")
        write_model_dir(model.config, self.dtype, self._dir.name)
        # a torch.distributed world that is not the one in-process vLLM engines set up for themselves
        in_job = torch.distributed.is_available() and torch.distributed.is_initialized() and not _in_process_live
        if separate_process is None:
            separate_process = in_job
        if in_job and not separate_process:
            raise ValueError("VllmEngine: this process is in a torch.distributed job; vLLM would take its process "
                             "group for its own world: use separate_process=True")
        self.separate_process = separate_process
        started = time.perf_counter()
        self.llm = _start_llm(self._dir.name, self.dtype, config, self.context, separate_process)
        self.engine = self.llm.llm_engine
        if not separate_process:
            _in_process_live += 1
        #: seconds vLLM took to start (before the first weights were loaded)
        self.start_s = time.perf_counter() - started
        #: what callers read of lockstep's KV cache (``cache.capacity_tokens``: the Rollout's and chat's context
        #: limit), capped at ``context``, the longest sequence vLLM takes
        self.cache = _CacheInfo(min(self.context, _capacity_tokens(self.llm, model, self.dtype, config)))
        self._instance = next(_instances)
        self._next_id = 0
        self._live: dict[str, _Sequence] = {}
        #: per load_weights call: {"seconds", "bytes"} of the last one
        self.last_sync: dict[str, float] = {}
        #: lockstep's batch-invariant kernels for the lockstep modules inside vLLM (EngineConfig.batch_invariant,
        #: None: the process-wide switch now); vLLM's attention kernel is not one of them (docs/numerics.md)
        mode = config.batch_invariant
        self.batch_invariant = numerics.is_batch_invariant() if mode is None else mode
        kernel = linear_kernel(config.linear_kernel, self.dtype) if config.pack_weights else None
        packed = self.llm.apply_model(functools.partial(_prepare_model, self.batch_invariant, separate_process,
                                                        kernel, config.max_batch_size))
        #: the kernel the lockstep linears inside vLLM run on prepacked weights (None: unpacked, e.g. on GPUs)
        self.linear_kernel = kernel if any(packed) else None
        self.load_weights()

    def close(self) -> None:
        """Stop vLLM: its engine core (and processes). vLLM's shutdown also destroys the torch.distributed
        world and model-parallel groups it set up in this process, which every in-process engine
        shares: so an in-process engine closed while others run is shut down with the last of them."""
        global _in_process_live
        if self.llm is None:
            return
        if self.separate_process:
            self.engine.engine_core.shutdown()
        else:
            _in_process_live -= 1
            _closed_in_process.append(self.engine.engine_core)
            if _in_process_live == 0:
                while _closed_in_process:
                    _closed_in_process.pop().shutdown()
        self.llm = self.engine = None
        self._dir.cleanup()

    # ----------------------------------------------------------------- weights

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Copy ``state`` (default: the model's ``state_dict()``) into vLLM's model in place; returns and
        keeps in ``last_sync`` the seconds and bytes it took. Requests already running continue on
        the new weights from their next step."""
        state = self.model.state_dict() if state is None else state
        started = time.perf_counter()
        items = [(name, t.detach()) for name, t in state.items()]
        self.llm.apply_model(functools.partial(_load_into, items))
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        self.last_sync = {"seconds": time.perf_counter() - started, "bytes": float(nbytes)}
        return self.last_sync

    def sync_weights(self) -> None:
        """lockstep Engine's name for "re-read the model's weights": :meth:`load_weights`."""
        self.load_weights()

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> int:
        """Queue a request (validated now); returns its sequence id."""
        from vllm.inputs import TokensPrompt

        seq, params = self._make_sequence(request, self._next_id)
        self._next_id += 1
        self.engine.add_request(self._key(seq.seq_id), TokensPrompt(prompt_token_ids=seq.prompt), params)
        self._live[self._key(seq.seq_id)] = seq
        return seq.seq_id

    def abort(self, seq_id: int) -> GenerationResult | None:
        """Stop a queued or running sequence now; its partial result (or None)."""
        seq = self._live.pop(self._key(seq_id), None)
        if seq is None:
            return None
        self.engine.abort_request([self._key(seq_id)])
        seq.finish_reason = seq.finish_reason or "abort"
        return seq.result()

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    def _key(self, seq_id: int) -> str:
        return f"lockstep-{self._instance}-{seq_id}"

    def _make_sequence(self, request: Request, seq_id: int) -> tuple[_Sequence, Any]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not isinstance(request, Request):
            raise TypeError(f"expected a lockstep.generate.Request, got {type(request).__name__}")
        sp = request.sampling
        if not isinstance(sp, SamplingParams):
            raise ConfigError(f"Request.sampling: must be a SamplingParams, got {type(sp).__name__}")
        sp.validate("sampling")
        prompt = self._prompt_ids(request)
        n = len(prompt)
        if n >= self.context:
            raise ConfigError(f"Request.prompt_ids: the prompt has {n} tokens; vLLM needs it shorter than the "
                              f"model's context (model.max_seq_len={self.max_seq_len}) and the KV cache "
                              f"({self.context} tokens in engine.cache_memory_mb={self.config.cache_memory_mb})")
        if sp.stop and self.tokenizer is None:
            raise ConfigError("sampling.stop: stop strings need an engine with a tokenizer")
        bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ConfigError(f"sampling.stop_token_ids: {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        stop_ids = set(sp.stop_token_ids)
        if self.eos_id is not None and not sp.ignore_eos:
            stop_ids.add(self.eos_id)
        params = VllmSamplingParams(
            temperature=sp.temperature, top_k=sp.top_k if sp.top_k > 0 else 0, top_p=sp.top_p, seed=sp.seed,
            max_tokens=min(sp.max_new_tokens, self.context - n), stop_token_ids=sorted(stop_ids),
            ignore_eos=True, logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)
        return _Sequence(seq_id, request, prompt, TextTracker(self.tokenizer, sp.stop), frozenset(stop_ids)), params

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.images:  # vLLM takes images, but this wrapper does not hand them over
            raise ConfigError("Request.images: the vLLM engine here takes text only; use the lockstep engine "
                              "for requests with images")
        return request.token_ids(self.tokenizer, self.vocab_size)

    # ----------------------------------------------------------------- driving

    def step(self) -> list[StreamEvent]:
        """One vLLM engine step (its scheduler admits, prefills and decodes); an event per new token."""
        events: list[StreamEvent] = []
        if self.separate_process:  # the switch was set in vLLM's process (_prepare_model)
            outputs = self.engine.step()
        else:
            with numerics.batch_invariant(self.batch_invariant):
                outputs = self.engine.step()
        for output in outputs:
            seq = self._live.get(output.request_id)
            if seq is None:
                continue  # aborted meanwhile
            completion = output.outputs[0]
            new_ids = list(completion.token_ids)
            for i, token in enumerate(new_ids):
                logprob = completion.logprobs[i][token].logprob if completion.logprobs else float("nan")
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                stop_string = seq.text.push(None if token in seq.stop_ids else token)
                last = i == len(new_ids) - 1
                finished = stop_string or (last and output.finished)
                if finished:
                    seq.finish_reason = "stop" if stop_string else _finish_reason(completion.finish_reason)
                event = StreamEvent(seq.seq_id, seq.seq_id, seq.request.request_id, token, logprob,
                                    seq.text.delta(final=finished), finished, seq.finish_reason)
                if finished:
                    event.result = seq.result()
                    del self._live[output.request_id]
                    if stop_string and not output.finished:
                        self.engine.abort_request([output.request_id])
                events.append(event)
                if finished:
                    break
        return events

    def stream(self, requests: Iterable[Request]) -> Iterator[StreamEvent]:
        """Tokens of ``requests`` as they are generated (``event.index`` = position in ``requests``);
        leaving early aborts the requests still running."""
        requests = list(requests)
        for r in requests:  # validate all before queueing any, as lockstep's Engine does
            self._make_sequence(r, -1)
        yield from follow(self.step, [self.add_request(r) for r in requests], self.abort)

    def generate(self, requests: Iterable[Request]) -> list[GenerationResult]:
        """Run ``requests`` to completion; one result per request, in order."""
        requests = list(requests)
        return final_results(self.stream(requests), len(requests))


@dataclasses.dataclass(frozen=True)
class _CacheInfo:
    #: tokens vLLM's KV cache holds (every sequence together)
    capacity_tokens: int


def _cache_tokens(model: nn.Module, dtype: torch.dtype, cache_memory_mb: float) -> int:
    """Tokens ``cache_memory_mb`` holds in vLLM's cache for ``model`` (keys and values at the padded head
    size, :mod:`lockstep.vllm.model`), rounded down to whole 256-token blocks of any vLLM CPU block size."""
    per_token = sum(2 * lay.heads * padded_head_size(max(lay.key_dim, lay.value_dim))
                    for lay in check_supported(model).values()) * dtype.itemsize
    return int(cache_memory_mb * 2**20 // per_token) // 256 * 256


def _capacity_tokens(llm: Any, model: nn.Module, dtype: torch.dtype, config: EngineConfig) -> int:
    """vLLM's KV-cache blocks x block size; where vLLM does not tell (it sized the cache in another
    process), the estimate of :func:`_cache_tokens`."""
    cache = llm.llm_engine.vllm_config.cache_config
    if cache.num_gpu_blocks:
        return int(cache.num_gpu_blocks * cache.block_size)
    return _cache_tokens(model, dtype, config.cache_memory_mb)


def _prepare_model(batch_invariant: bool, separate_process: bool, kernel: str | None, batch_hint: int,
                   vllm_model: nn.Module) -> int:
    """In vLLM's worker: the lockstep linears follow the batch-invariant switch and, on CPU, run on
    prepacked weights of ``kernel`` (packed at their first call, repacked when a weight is written);
    in a process of vLLM's own, the switch is set there for good (in this process, ``step`` sets it
    around each step). Returns the number of packed linears."""
    model = vllm_model.model
    numerics.prepare_model(model)
    if separate_process:
        numerics.set_batch_invariant(batch_invariant)
    on_cpu = next(model.parameters()).device.type == "cpu"
    if kernel is None or not on_cpu or not packable(model):
        return 0
    return len(pack_linears(model, batch_hint, kernel))


def _load_into(items: list[tuple[str, torch.Tensor]], vllm_model: nn.Module) -> int:
    """Run in vLLM's worker (a module-level function: a separate process receives it by pickle)."""
    return len(vllm_model.load_weights(items))


def _finish_reason(vllm_reason: str | None) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(vllm_reason or "", "length")


def _start_llm(path: str, dtype: torch.dtype, config: EngineConfig, max_model_len: int, separate_process: bool
               ) -> Any:
    """vLLM's ``LLM`` on the model directory. In this process, vLLM pins torch's intra-op threads to one
    and replaces ``torch.set_num_threads`` while it starts: both are put back. In a separate process
    (spawned: a fork would inherit this one's torch.distributed state), the weights travel by
    pickle (``VLLM_ALLOW_INSECURE_SERIALIZATION``: the function load_weights sends) and the child keeps
    this process's thread count (``OMP_NUM_THREADS``)."""
    configure_environment()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate_process else "0"
    if separate_process:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ[DIE_WITH_PARENT] = "1"
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    register()
    from vllm import LLM

    try:
        with _modules_vllm_cannot_scan():
            return LLM(model=path, dtype=str(dtype).removeprefix("torch."), distributed_executor_backend="uni",
                       load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                       enable_prefix_caching=False, max_num_seqs=config.max_batch_size,
                       max_num_batched_tokens=max(config.max_prefill_tokens, config.max_batch_size),
                       max_model_len=max_model_len, kv_cache_memory_bytes=int(config.cache_memory_mb * 2**20),
                       logprobs_mode="processed_logprobs", seed=0)
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _modules_vllm_cannot_scan() -> Iterator[None]:
    """Hide, while vLLM starts, the imported modules whose globals include werkzeug ``LocalProxy`` objects
    (flask's ``current_app``, ``g``, ``request``; flask comes in with moto, the S3 test server). vLLM's CPU
    start-up scans every module in ``sys.modules`` with ``hasattr(value, "__dict__")``
    (``triton_utils.dispatcher._rebind_kernels``), and such a proxy raises RuntimeError ("Working outside of
    application context") instead of returning False. The modules are put back unchanged afterwards."""
    hidden = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        # type(), not isinstance(): a proxy forwards __class__ to the object it stands for
        if any(type(value).__name__ == "LocalProxy" for value in list(namespace.values())):
            hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)

"""The generation engine: the training model's own modules, a paged KV cache, continuous batching.

``Engine(model, tokenizer, config)`` takes any lockstep ``Transformer`` (every family: dense GQA,
MoE, MLA) and drives it through ``model.trunk(tokens, positions, cache=...)`` and ``model.output``;
there is no second model class. Each :meth:`Engine.step`:

1. admits waiting requests that fit (:mod:`lockstep.generate.scheduler`);
2. prefills the admitted prompts in one padded batch (``[B, longest prompt]``; padding tokens
   write to the cache's null block and are never attended; in chunks with ``prefill_chunk``,
   :mod:`lockstep.generate.prefill`) and samples each one's first token;
3. runs one batched decode step (``[B, 1]``) for every running sequence (with ``speculative="mtp"``
   a verify forward of MTP drafts instead, :mod:`lockstep.generate.speculative`);
4. releases finished sequences (their blocks return to the pool).

Only the last position of each sequence goes through the output head. ``compile_decode`` wraps the
decode forward in ``torch.compile`` as one graph, the cache's writes and attention included; the
batch is then padded to a power of two (at most ``max_batch_size``) and each context to a power of
two blocks (null-block padding, masked), so each (batch, context) bucket compiles once. With the
Inductor modes the one-shot prefill is compiled too, per (rows, columns) bucket
(``EngineConfig.compile_prefill``, :mod:`lockstep.generate.prefill`).
``EngineConfig.weights_dtype`` runs a cast copy of the weights (:mod:`lockstep.generate.weights`);
``EngineConfig.pack_weights`` runs linears on prepacked weights (:mod:`lockstep.generate.packed`).

**Devices.** The engine runs where the model is (``model.to("cuda")`` first): the KV-cache pools,
each step's tokens, positions, slots and block tables, and the sampling tensors live on that device
(step metadata is built on the CPU and copied once per step). The CPU C kernels (packed linears,
in-place paged decode attention) are used only for a CPU model; elsewhere linears are ``F.linear``
and attention gathers each context and runs the backend's cached variant (SDPA). Batch-invariant
mode is CPU-only (:func:`check_batch_invariant_device`). Sampling draws from per-request CPU
generators on every device (:mod:`lockstep.generate.sampling`), so a seed gives the same draws.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.generate.cache import PagedKVCache, StepMetadata, layer_layouts, window_tables
from lockstep.generate.compressed_cache import CompressedStateCache
from lockstep.generate.config import EngineConfig, Request, SamplingParams
from lockstep.generate.packed import linear_kernel, pack_linears, packable, sibling_grouping_pass
from lockstep.generate.output import GenerationResult, StreamEvent, TextTracker, final_results, follow
from lockstep.generate.prefill import check_prefill_chunk, prefill
from lockstep.generate.recurrent import RecurrentStateCache, recurrent_layers
from lockstep.generate.sampling import request_generator, sample_next
from lockstep.generate.scheduler import Scheduler, Sequence
from lockstep.generate.speculative import MTPSpeculator, check_speculative, mtp_layouts
from lockstep.generate.vision import ImageInputs, refuse_images
from lockstep.generate.weights import ShadowWeights, parse_dtype


def tokenizer_eos_id(tokenizer: Any) -> int | None:
    """End-of-sequence id of a lockstep Tokenizer (``eos_id``) or a transformers one (``eos_token_id``)."""
    for attr in ("eos_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return None


def check_batch_invariant_device(device: torch.device, field: str = "engine.batch_invariant") -> None:
    """Refuse batch-invariant mode off the CPU, naming ``field``. Its bitwise promise rests on the
    CPU C kernels and on CPU kernel choices measured for the fixed-tile torch ops; on an accelerator
    the library kernels (cuBLAS GEMMs, reductions such as RMSNorm's) choose how to split a row's sums
    by the call's shape, so a row's bits would depend on its batch, and no kernel here fixes that."""
    if device.type != "cpu":
        raise ConfigError(
            f"{field}: batch-invariant mode is CPU-only (its kernels fix a row's arithmetic order on the CPU; "
            f"on {device.type} the library GEMMs and reductions split sums by the batch shape); run this engine on "
            f"the CPU, or turn batch-invariant mode off (numerics.batch_invariant=false)")


def _check_compilable(model: nn.Module) -> None:
    """Refuse what ``torch.compile`` cannot trace in the decode step, naming the module."""
    from lockstep.models.common.moe import GroupedExperts, resolve_impl

    for name, module in model.named_modules():
        if (isinstance(module, GroupedExperts) and module.w1.dtype != torch.bfloat16
                and resolve_impl(module.impl, module.w1.device) == "grouped_mm"):
            raise ConfigError(
                f"engine.compile_decode: {name} computes its experts with torch._grouped_mm in {module.w1.dtype}, "
                f"which torch.compile cannot trace (its compile-time kernel takes bf16 only); use a bf16 model or "
                f"compile_decode='none'")


class Engine:
    """Batched, cached generation with the model's own modules; see the module docstring."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        if not hasattr(model, "trunk") or not hasattr(model, "layers"):
            raise TypeError(f"Engine needs a lockstep Transformer (with trunk() and layers), "
                            f"got {type(model).__name__}")
        self.model, self.tokenizer = model, tokenizer
        weights_dtype = parse_dtype(config.weights_dtype)
        #: a cast copy of the model's weights, synced before each step (EngineConfig.weights_dtype)
        self._shadow = (ShadowWeights(model, weights_dtype)
                        if weights_dtype not in (None, model.tok_embeddings.weight.dtype) else None)
        #: the module tree the forwards run: the model itself, or its shadow
        self.runner = runner = self._shadow.model if self._shadow is not None else model
        weight = runner.tok_embeddings.weight
        self.device, self.dtype = weight.device, weight.dtype
        if config.batch_invariant:
            check_batch_invariant_device(self.device)
            refusal = getattr(model.config, "batch_invariant_refusal", None)  # a family without invariant kernels
            if callable(refusal):
                raise ConfigError(f"engine.batch_invariant: {refusal()}")
        on_cpu = self.device.type == "cpu"
        #: linears on prepacked weights (EngineConfig.pack_weights; bf16, and fp32 with AVX-512, on CPU)
        kernel = linear_kernel(config.linear_kernel, self.dtype) if config.pack_weights and on_cpu else None
        self._packed = pack_linears(runner, config.max_batch_size, kernel) if kernel and packable(runner) else []
        self.vocab_size, self.max_seq_len = model.config.vocab_size, model.config.max_seq_len
        self.eos_id = tokenizer_eos_id(tokenizer) if tokenizer is not None else None
        self._modules = list(runner.modules())
        self._prepared = False  # numerics.prepare_model has run on the runner
        layouts = layer_layouts(runner)
        check_speculative(runner, config.speculative, bool(recurrent_layers(runner)))
        if config.speculative == "mtp":  # the MTP depths' own cache layers
            layouts.update(mtp_layouts(runner))
        per_block, window_blocks, window_bytes = PagedKVCache.sizes(layouts, config.block_size, self.dtype,
                                                                    config.max_batch_size)
        num_blocks = config.num_blocks or int((config.cache_memory_mb * 2**20 - window_bytes) // per_block)
        if num_blocks < 1:
            raise ConfigError(f"engine.cache_memory_mb: {config.cache_memory_mb} MiB holds no cache block "
                              f"({per_block} bytes each at block_size={config.block_size})")
        self.cache = PagedKVCache(layouts, num_blocks, config.block_size, self.dtype, self.device,
                                  in_place_decode=config.paged_attention, window_blocks=window_blocks)
        self.scheduler = Scheduler(self.cache.allocator, config.block_size, config.max_batch_size,
                                   config.max_prefill_tokens, self.cache.window_allocator, self.cache.window_span)
        #: per-sequence state beside the paged cache: linear-attention layers (hybrid models) or
        #: DeepSeek-V4's compressed attention (lockstep.generate.compressed_cache); None without either
        self.recurrent = (RecurrentStateCache.for_model(runner, config.max_batch_size, self.dtype, self.device)
                          or CompressedStateCache.for_model(runner, config.max_batch_size, self.dtype, self.device))
        #: what the model's trunk is handed: the paged KV cache, beside the recurrent state if any
        self._model_cache = self.recurrent.wrap(self.cache) if self.recurrent is not None else self.cache
        check_prefill_chunk(config.prefill_chunk, self.cache.window)
        #: drafts and verification of MTP speculative decoding (EngineConfig.speculative), None when off
        self.speculator = MTPSpeculator(self, config.draft_tokens) if config.speculative == "mtp" else None
        #: images of requests to a vision-language model (lockstep.generate.vision), None for text-only models
        self.vision = ImageInputs.for_model(runner, config.image_min_pixels, config.image_max_pixels)
        #: optional hook, called as ``on_logits(seq_ids, logits [B, V] fp32)`` for every sampled row (tests, debugging)
        self.on_logits: Callable[[list[int], torch.Tensor], None] | None = None
        self._next_id = 0
        self._decode_forward = self._forward_last
        self._tables_key, self._tables = None, None  # the last block table built (_block_tables)
        self._compiled = config.compile_decode != "none"
        #: the compiled prefill forward (EngineConfig.compile_prefill; lockstep.generate.prefill), or None
        self._prefill_forward: Callable[..., torch.Tensor] | None = None
        #: (rows, context blocks) buckets whose compiled step ran with every guard checked
        self._guarded: set[tuple] = set()
        #: buckets where dynamo still asked to recompile with guards skipped: always checked in full
        self._unskippable: set[tuple] = set()
        if self._compiled:
            _check_compilable(runner)
            backend = "aot_eager" if config.compile_decode == "aot_eager" else "inductor"
            options = {"freezing": True} if config.compile_decode == "inductor-frozen" else {}
            if self._packed and backend == "inductor":
                options["post_grad_custom_post_pass"] = sibling_grouping_pass()
            self._decode_forward = torch.compile(self._forward_last, backend=backend, dynamic=False,
                                                 options=options)
            prefill_on = config.compile_prefill
            if backend == "inductor" if prefill_on is None else prefill_on:  # None: Inductor modes only
                self._prefill_forward = torch.compile(self._forward_at, backend=backend, dynamic=False,
                                                      options=options)

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> int:
        """Queue a request (validated now); returns its sequence id. It joins the running batch at
        the next :meth:`step` with room for it."""
        seq = self._make_sequence(request)
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> GenerationResult | None:
        """Stop a queued or running sequence now and free its blocks; its partial result (or None)."""
        seq = self.scheduler.abort(seq_id)
        self._free_recurrent()
        return None if seq is None else seq.result()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def _make_sequence(self, request: Request) -> Sequence:
        if not isinstance(request, Request):
            raise TypeError(f"expected a lockstep.generate.Request, got {type(request).__name__}")
        sp = request.sampling
        if not isinstance(sp, SamplingParams):
            raise ConfigError(f"Request.sampling: must be a SamplingParams, got {type(sp).__name__}")
        sp.validate("sampling")
        if self.speculator is not None:
            self.speculator.check_request(sp.greedy)
        prompt, visual = self._prompt_ids(request), None
        if self.vision is None:
            refuse_images(request, self.model)
        else:
            if request.images and self.speculator is not None:
                raise ConfigError("Request.images: speculative decoding does not take images")
            prompt, visual = self.vision.admit(request, prompt)
        n = len(prompt)
        if n > self.max_seq_len:
            raise ConfigError(f"Request.prompt_ids: the prompt has {n} tokens, longer than the model's context "
                              f"(model.max_seq_len={self.max_seq_len})")
        capacity = self.cache.capacity_tokens
        if n > capacity:
            raise ConfigError(
                f"Request.prompt_ids: the prompt has {n} tokens, longer than the KV cache budget of {capacity} "
                f"tokens ({self.cache.num_blocks} blocks x {self.config.block_size}); raise engine.cache_memory_mb")
        if sp.stop and self.tokenizer is None:
            raise ConfigError("sampling.stop: stop strings need an Engine with a tokenizer")
        bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ConfigError(f"sampling.stop_token_ids: {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        # every token but the last generated one is fed back (and cached): positions < max_seq_len
        max_new = min(sp.max_new_tokens, self.max_seq_len - n + 1, capacity - n + 1)
        stop_ids = set(sp.stop_token_ids)
        if self.eos_id is not None and not sp.ignore_eos:
            stop_ids.add(self.eos_id)
        seq = Sequence(self._next_id, request, prompt, max_new, frozenset(stop_ids),
                       None if sp.greedy else request_generator(sp.seed), TextTracker(self.tokenizer, sp.stop),
                       visual=visual)
        self._next_id += 1
        return seq

    def _prompt_ids(self, request: Request) -> list[int]:
        return request.token_ids(self.tokenizer, self.vocab_size)

    # ----------------------------------------------------------------- driving

    def step(self) -> list[StreamEvent]:
        """Admit, prefill the newcomers, decode every running sequence once; events of every sequence."""
        mode = self.config.batch_invariant
        with numerics.batch_invariant(mode) if mode is not None else contextlib.nullcontext():
            return self._step()

    def sync_weights(self) -> None:
        """Re-read every weight of the model into the engine's cast copy (``weights_dtype``) and repack
        packed weights (``pack_weights``). Steps already pick up in-place writes; this is only needed
        after parameters were replaced, or written by something that moves no version counter."""
        if self._shadow is not None:
            self._shadow.resync()
        for layer in self._packed:
            layer.drop_packed()
        self._guarded.clear()
        self._unskippable.clear()

    def _prepare(self) -> None:
        """Before a step: sync cast weights; on the first step make the linears follow the
        batch-invariant switch (``numerics.prepare_model``; attention layers read it themselves)."""
        if self._shadow is not None:
            self._shadow.sync()
        if numerics.is_batch_invariant():
            check_batch_invariant_device(self.device, "numerics.batch_invariant")
        if not self._prepared:
            numerics.prepare_model(self.runner)
            self._prepared = True

    def _step(self) -> list[StreamEvent]:
        self._prepare()
        training = [m for m in self._modules if m.training]  # the modes found, restored after the step
        for m in training:
            m.training = False
        try:
            with torch.inference_mode():
                events: list[StreamEvent] = []
                admitted = self.scheduler.admit()
                if admitted:
                    events += prefill(self, admitted)
                active = [s for s in self.scheduler.running if s.finish_reason is None]
                if active:
                    events += self.speculator.decode(active) if self.speculator else self._decode(active)
                self.scheduler.release_finished()
                self._free_recurrent()
        finally:
            for m in training:
                m.training = True
        return events

    def stream(self, requests: Iterable[Request]) -> Iterator[StreamEvent]:
        """Tokens of ``requests`` as they are generated (``event.index`` = position in ``requests``).

        All requests are validated before any is queued. Leaving the iterator early aborts the
        requests it still had running. Drive other requests with ``add_request``/``step`` instead,
        not beside a live stream (the stream delivers only its own events).
        """
        seqs = [self._make_sequence(r) for r in requests]
        for seq in seqs:
            self.scheduler.add(seq)
        yield from follow(self.step, [s.seq_id for s in seqs], self.scheduler.abort)

    def generate(self, requests: Iterable[Request]) -> list[GenerationResult]:
        """Run ``requests`` to completion; one result per request, in order."""
        requests = list(requests)
        return final_results(self.stream(requests), len(requests))

    # ----------------------------------------------------------------- forwards

    def _forward_last(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] of the last column of ``tokens`` (decode: the only one); the cast is
        here so that a compiled step fuses it (sampling reads fp32 logits either way)."""
        h = self.runner.trunk(tokens, positions, cache=self._model_cache)[2]
        return self.runner.output(h[:, -1]).float()

    def _forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] of column ``columns[b]`` of each row (a padded prefill: each prompt's last)."""
        h = self.runner.trunk(tokens, positions, cache=self._model_cache)[2]
        return self.runner.output(h[torch.arange(h.shape[0], device=h.device), columns]).float()

    def _free_recurrent(self) -> None:
        """Return the recurrent-state slots (hybrid models) and drafts of sequences no longer running."""
        if self.recurrent is not None:
            self.recurrent.keep_only(s.seq_id for s in self.scheduler.running)
        if self.speculator is not None:
            self.speculator.forget(s.seq_id for s in self.scheduler.running)

    def _decode(self, seqs: list[Sequence]) -> list[StreamEvent]:
        b = len(seqs)
        # batch-invariant mode decodes uncompiled: its C kernels split a traced step into pieces
        # (they are opaque to dynamo), and the compiled pieces gave other numbers than eager
        compiled = self._compiled and not numerics.is_batch_invariant()
        rows = self._bucket(b) if compiled else b
        pad = [0] * (rows - b)  # padding rows: token 0 at position 0 (the null block's slot 0)
        lengths = [s.length for s in seqs]
        tokens = torch.tensor([s.last_token for s in seqs] + pad).view(rows, 1)
        positions = torch.tensor([n - 1 for n in lengths] + pad).view(rows, 1)
        n_blocks = -(-max(lengths) // self.config.block_size)
        if compiled:  # one graph per (batch, context) bucket: context padded to a power of two blocks
            n_blocks = 1 << max(0, math.ceil(math.log2(n_blocks)))
        tables = self._block_tables(seqs, n_blocks, rows)
        valid = torch.arange(rows)[:, None] < b
        positions = self._set_step(tables, positions, valid, seqs)
        if self.vision is not None:  # rotary positions continue from each image prompt's mRoPE offset
            positions = self.vision.decode_positions(seqs, positions)
        if self.recurrent is not None:
            self.recurrent.set_step([s.seq_id for s in seqs], rows=rows)
        tokens = tokens.to(self.device)
        if compiled:
            logits = self._compiled_call(self._decode_forward, (rows, n_blocks), tokens, positions)
        else:
            logits = self._forward_last(tokens, positions)
        return self._sample(seqs, logits[:b])

    def _compiled_call(self, forward: Callable[..., torch.Tensor], bucket: tuple, *args: torch.Tensor) -> torch.Tensor:
        """A compiled forward: the decode step's (``bucket`` = (rows, context blocks)) or the prefill's
        (``("prefill", rows, columns)``, :mod:`lockstep.generate.prefill`). A bucket that already
        ran with every guard checked runs with only the guards that tell cached graphs apart
        (``EngineConfig.skip_guard_checks``); should dynamo still want to recompile, the step reruns
        with full guards (it only rewrites the same cache slots with the same values) and the bucket
        is never skipped again.

        One graph per bucket is up to log2(max batch) x log2(max blocks) graphs, above dynamo's default
        recompile limit of 8: the limit is raised to 64 around the fully guarded call only (the one
        that may compile; dynamo reads the limit when it does), not for the rest of the process. The
        guard-skipping call never compiles (it raises instead), so it pays nothing for the patch."""
        if self.config.skip_guard_checks and bucket in self._guarded and bucket not in self._unskippable:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return forward(*args)
            except RuntimeError as err:
                if "skip_guard_eval_unsafe" not in str(err):
                    raise
                self._unskippable.add(bucket)
        with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64)):
            logits = forward(*args)
        self._guarded.add(bucket)  # ran with every guard checked: this bucket's graph is known
        return logits

    def _bucket(self, b: int) -> int:
        return min(1 << max(0, math.ceil(math.log2(b))), max(b, self.config.max_batch_size))

    def _block_tables(self, seqs: list[Sequence], n_blocks: int, rows: int | None = None) -> torch.Tensor:
        """``[rows, n_blocks]`` block ids of ``seqs`` (0, the null block, past their blocks). A sequence's
        blocks are reserved whole at admission, so the table of the same sequences and shape is the
        last one again: it is kept (only read downstream) until the batch or its shape changes."""
        key = (tuple(s.seq_id for s in seqs), n_blocks, rows)
        if key == self._tables_key:
            return self._tables
        tables = torch.zeros(rows or len(seqs), n_blocks, dtype=torch.long)
        for i, seq in enumerate(seqs):
            blocks = seq.blocks[:n_blocks]
            tables[i, : blocks.numel()] = blocks
        self._tables_key, self._tables = key, tables
        return tables

    def _set_step(self, tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, seqs: list[Sequence],
                  fresh: bool = False) -> torch.Tensor:
        """Hand the cache this step's metadata (built on the CPU, moved to the engine's device);
        returns the positions on the device. ``fresh``: a prefill (every sequence from position 0)."""
        bs = self.config.block_size
        slots = tables.gather(1, positions // bs) * bs + positions % bs
        slots = slots * valid  # padding -> slot 0 of the null block
        window = {}
        if self.cache.window:  # sliding-window layers: each sequence's ring (lockstep.generate.cache)
            rings = torch.zeros(tables.shape[0], self.cache.window_span, dtype=torch.long)
            for i, seq in enumerate(seqs):
                rings[i] = seq.window_blocks
            w_tables = window_tables(rings, (positions * valid).amax(1), tables.shape[1], bs, self.cache.window)
            w_slots = (w_tables.gather(1, positions // bs) * bs + positions % bs) * valid
            window = {"window_slot_mapping": w_slots.reshape(-1).to(self.device),
                      "window_block_tables": w_tables.to(self.device)}
        positions = positions.to(self.device)
        self.cache.set_step(StepMetadata(slots.reshape(-1).to(self.device), tables.to(self.device), positions,
                                         fresh=fresh, **window))
        return positions

    # ----------------------------------------------------------------- sampling

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-probability (a generation group's engine takes group
        rank 0's: :class:`lockstep.generate.parallel.GroupEngine`)."""
        return sample_next(logits, [s.request.sampling for s in seqs], [s.generator for s in seqs])

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StreamEvent]:
        if self.on_logits is not None:
            self.on_logits([s.seq_id for s in seqs], logits)
        tokens, logprobs = self._draw(seqs, logits)
        events = []
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.generated.append(token)
            seq.logprobs.append(logprob)
            stop_token = token in seq.stop_ids
            stop_string = seq.text.push(None if stop_token else token)
            if stop_token or stop_string:
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.max_new:
                seq.finish_reason = "length"
            finished = seq.finish_reason is not None
            events.append(StreamEvent(seq.seq_id, seq.seq_id, seq.request.request_id, token, logprob,
                                      seq.text.delta(final=finished), finished, seq.finish_reason,
                                      seq.result() if finished else None))
        return events

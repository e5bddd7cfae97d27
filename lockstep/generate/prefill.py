"""Prefill: the admitted prompts in one padded batch, in chunks of ``EngineConfig.prefill_chunk`` columns.

The batch is ``[B, longest prompt]`` (padding tokens write to the cache's null block and are never
attended). With ``prefill_chunk = C > 0`` it runs as forwards over columns ``[0, C)``, ``[C, 2C)``,
...: each chunk's tokens store their keys/values (or MLA latents) in the paged cache and attend over
the cache's context up to themselves, exactly the attention of a one-shot prefill, so the outputs
are the same up to float summation order (the attention of a chunk reduces over the gathered
context instead of the prompt). Activations (hidden states, MLP/expert intermediates, attention
scores ``[chunk, context]``) scale with the chunk, not the prompt; the cache is what grows. A row
whose prompt ends inside a chunk is sampled from that chunk's forward; in later chunks it is padding.

Chunked prefill is refused for sliding-window layers (their ring of cache blocks holds the window of
the *last* position of a step, which a chunk longer than one block overruns). Linear-attention
(recurrent) layers carry their state from chunk to chunk (``fresh`` only on the first).

With MTP speculative decoding (:mod:`lockstep.generate.speculative`) each chunk's hidden states also
run through MTP depth 1 under the same cache metadata, and the rows whose prompt ended draft.

Requests with images (:mod:`lockstep.generate.vision`): the vision tower runs once per request before
the first chunk; each chunk takes its columns' mRoPE positions and image embeddings.

With ``EngineConfig.compile_prefill`` (on by default with ``compile_decode="inductor"``) a one-shot
prefill runs compiled (:meth:`Engine._compiled_call`, the decode step's guard handling): the batch is
padded to the decode step's power-of-two row bucket and the columns to a power of two, so at most
log2(max batch) x log2(max context) graphs compile, each once. Eager SwiGLU/RMSNorm/rope pieces then
fuse (SmolLM2 bf16 16x32 tokens: docs/benchmarks.md, issue #22). Padding changes the GEMM and
attention shapes, so the logits match the eager prefill within float rounding, not bitwise. Left
eager: batch-invariant mode, chunked prefills of more than one chunk (their context grows chunk by
chunk), images, recurrent state, sliding windows and MTP drafts (they read more than the logits).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.generate.output import StreamEvent
from lockstep.generate.scheduler import Sequence

if TYPE_CHECKING:
    from lockstep.generate.engine import Engine


def check_prefill_chunk(chunk: int, window: int, field: str = "engine.prefill_chunk") -> None:
    """Refuse chunked prefill for a model with sliding-window layers (module docstring)."""
    if chunk and window:
        raise ConfigError(f"{field}: chunked prefill does not support sliding-window attention layers (window "
                          f"{window}); set prefill_chunk=0 for this model")


def _compiles(engine: "Engine", seqs: list[Sequence], t: int) -> bool:
    """Whether this prefill runs the compiled forward (module docstring: the cases it leaves eager)."""
    chunk = engine.config.prefill_chunk
    return (engine._prefill_forward is not None and not numerics.is_batch_invariant()
            and (not chunk or t <= chunk) and engine.vision is None and engine.recurrent is None
            and engine.speculator is None and not engine.cache.window)


def _compiled_prefill(engine: "Engine", seqs: list[Sequence], lengths: torch.Tensor) -> list[StreamEvent]:
    """The one-shot prefill as one compiled graph per (rows, columns) bucket: rows padded as a
    compiled decode step pads them, columns to a power of two (at most the model's context, at least
    the longest prompt). Padding tokens go to the null block at position 0; a row's logits are those
    of its last prompt column."""
    b, t = len(seqs), int(lengths.max())
    rows = engine._bucket(b)
    cols = max(t, min(1 << max(0, math.ceil(math.log2(t))), engine.max_seq_len))
    tokens = torch.zeros(rows, cols, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids)
    columns = torch.arange(cols)
    valid = torch.zeros(rows, cols, dtype=torch.bool)
    valid[:b] = columns[None] < lengths[:, None]
    tables = engine._block_tables(seqs, -(-cols // engine.config.block_size), rows)
    positions = engine._set_step(tables, columns.expand(rows, -1) * valid, valid, seqs, fresh=True)
    last = torch.zeros(rows, dtype=torch.long)
    last[:b] = lengths - 1
    logits = engine._compiled_call(engine._prefill_forward, ("prefill", rows, cols), tokens.to(engine.device),
                                   positions, last.to(engine.device))
    return engine._sample(seqs, logits[:b])


def prefill(engine: "Engine", seqs: list[Sequence]) -> list[StreamEvent]:
    """Prefill ``seqs`` (just admitted) and sample each one's first token; their events."""
    lengths = torch.tensor([len(s.prompt_ids) for s in seqs])
    b, t = len(seqs), int(lengths.max())
    if _compiles(engine, seqs, t):
        return _compiled_prefill(engine, seqs, lengths)
    tokens = torch.zeros(b, t + 1, dtype=torch.long)  # one spare column: the MTP depth's next tokens
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids)
    chunk = engine.config.prefill_chunk or t
    block_size = engine.config.block_size
    runner, speculator = engine.runner, engine.speculator
    # requests with images: encoded once here; mRoPE positions and embeddings sliced per chunk
    images = engine.vision.prefill_batch(runner, seqs, t) if engine.vision is not None else None
    events: list[StreamEvent] = []
    for start in range(0, t, chunk):
        end = min(t, start + chunk)
        columns = torch.arange(start, end)
        valid = columns[None] < lengths[:, None]
        tables = engine._block_tables(seqs, -(-end // block_size))
        positions = engine._set_step(tables, columns.expand(b, -1) * valid, valid, seqs, fresh=start == 0)
        if engine.recurrent is not None:  # fresh states on the first chunk; padding leaves them untouched
            engine.recurrent.set_step([s.seq_id for s in seqs], (lengths - start).clamp(0, end - start),
                                      fresh=start == 0)
        rope, visual = images.chunk(start, end, positions) if images is not None else (positions, None)
        extra = {"visual": visual} if visual is not None else {}  # text-only batches call trunk as before
        h = runner.trunk(tokens[:, start:end].to(engine.device), rope, cache=engine._model_cache, **extra)[2]
        ending = [i for i in range(b) if start < int(lengths[i]) <= end]  # prompts whose last token is here
        last = [-1] * b
        if ending:
            cols = [int(lengths[i]) - 1 - start for i in ending]
            rows = torch.tensor(ending, device=engine.device)
            picked = h[rows, torch.tensor(cols, device=engine.device)]
            events += engine._sample([seqs[i] for i in ending], runner.output(picked).float())
            for i, col in zip(ending, cols):
                last[i] = col
        if speculator is not None:  # depth 1 reads each position's next token: the prompt's, then the sample
            nxt = tokens[:, start + 1:end + 1].clone()
            for i in ending:
                nxt[i, last[i]] = seqs[i].generated[0]
            speculator.catch_up(seqs, nxt, h, positions, last)
    return events

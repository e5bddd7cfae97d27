"""Continuous batching: a FIFO waiting queue and the running set, under the KV-cache block budget.

A request is admitted (between decode steps) when a batch slot is free and the allocator has the
blocks for its *worst case* (prompt + max new tokens - 1 cached tokens): blocks are reserved up
front, so a running sequence never runs out and nothing is ever preempted. Admission is strictly
FIFO (a request that does not fit yet blocks the ones behind it). Finished sequences leave the
running set and return their blocks at the end of the step that finished them. A model with
sliding-window layers also needs a free ring of ``window_span`` blocks of those layers' own pools
(:mod:`lockstep.generate.cache`), reserved the same way.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from lockstep.generate.cache import BlockAllocator
from lockstep.generate.config import Request
from lockstep.generate.output import GenerationResult, TextTracker


@dataclasses.dataclass
class Sequence:
    """One request in flight."""

    seq_id: int
    request: Request
    prompt_ids: list[int]
    #: new-token budget: the request's max_new_tokens, capped by the model's context and the cache
    max_new: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    text: TextTracker
    #: cache blocks (reserved for the worst case at admission); a LongTensor for fast table building
    blocks: torch.Tensor | None = None
    #: ring of sliding-window-layer blocks (models with such layers), reserved at admission
    window_blocks: torch.Tensor | None = None
    #: the request's images (lockstep.generate.vision.SequenceImages), None without images
    visual: Any = None
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        """Tokens so far (prompt + generated)."""
        return len(self.prompt_ids) + len(self.generated)

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt_ids[-1]

    @property
    def worst_case_tokens(self) -> int:
        """Cached tokens at most: every token but the last generated one is fed back."""
        return len(self.prompt_ids) + self.max_new - 1

    def result(self) -> GenerationResult:
        return GenerationResult(self.request.request_id, list(self.prompt_ids), list(self.generated),
                                list(self.logprobs), self.text.text, self.finish_reason or "abort")


class Scheduler:
    """Waiting queue -> running set; see the module docstring."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int,
                 max_prefill_tokens: int, window_allocator: BlockAllocator | None = None,
                 window_span: int = 0) -> None:
        self.allocator, self.block_size = allocator, block_size
        self.window_allocator, self.window_span = window_allocator, window_span
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def blocks_needed(self, seq: Sequence) -> int:
        return -(-max(seq.worst_case_tokens, len(seq.prompt_ids)) // self.block_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences that fit into the running set (with their blocks); return them."""
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            need = self.blocks_needed(seq)
            if need > self.allocator.num_free:
                break
            if self.window_allocator is not None and self.window_span > self.window_allocator.num_free:
                break
            longest_if = max(longest, len(seq.prompt_ids))
            if admitted and (len(admitted) + 1) * longest_if > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.blocks = torch.tensor(self.allocator.allocate(need), dtype=torch.long)
            if self.window_allocator is not None:
                seq.window_blocks = torch.tensor(self.window_allocator.allocate(self.window_span), dtype=torch.long)
            admitted.append(seq)
            longest = longest_if
        self.running.extend(admitted)
        return admitted

    def release_finished(self) -> list[Sequence]:
        """Drop finished sequences from the running set and free their blocks."""
        done = [s for s in self.running if s.finish_reason is not None]
        if done:
            self.running = [s for s in self.running if s.finish_reason is None]
            for seq in done:
                self._free(seq)
        return done

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove a sequence wherever it is (its blocks are freed); None if unknown or finished."""
        for seq in list(self.waiting):
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.seq_id == seq_id and seq.finish_reason is None:
                seq.finish_reason = "abort"
                self.running.remove(seq)
                self._free(seq)
                return seq
        return None

    def _free(self, seq: Sequence) -> None:
        if seq.blocks is not None:
            self.allocator.free(seq.blocks.tolist())
            seq.blocks = None
        if seq.window_blocks is not None:
            self.window_allocator.free(seq.window_blocks.tolist())
            seq.window_blocks = None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

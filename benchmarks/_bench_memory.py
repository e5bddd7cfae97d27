"""Memory measures for benchmarks/compile_and_remat.py: what one training micro-step holds.

Three measures, each named in the benchmark's table so they are never mixed up:

- ``step_peak_bytes``: the CPU allocator's peak during one micro-batch's forward + backward
  (``runtime.loss_and_backward``), above what was allocated when it started. Read from the
  profiler's allocation events (``profile_memory=True``: every allocation and free with the running
  total), so it works alike for eager, checkpointed and captured-graph steps. It includes the
  gradients the backward allocates (the same bytes in every variant of one model: ``.grad`` is
  None at the start) and the transient buffers of the largest op.
- ``held_after_forward_bytes``: net bytes the allocator still holds after an eager forward (the
  activations autograd keeps for backward, plus the loss): ``activation_bytes_after_forward``.
  Eager modes only: a captured graph has no point between forward and backward.
- ``graph_saved_bytes``: what the graph trainer's memory pass says the captured forward saves for
  backward, before and after the passes (their own records, computed from node shapes; not a
  measurement), and the recompute pass's static peak of live intermediates.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def _allocation_events(prof) -> list[tuple[int, int]]:
    """(time ns, bytes allocated (+) or freed (-)) of every allocation event, in time order."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, int(event.extra_fields.alloc_size)))
        stack.extend(event.children)
    events.sort()
    return events


def allocator_peak_bytes(fn) -> int:
    """Peak of the CPU allocator's running total during ``fn()``, above its value at the start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    running = peak = 0
    for _, size in _allocation_events(prof):
        running += size
        peak = max(peak, running)
    return peak


def step_peak_bytes(trainer) -> int:
    """``step_peak_bytes`` (module docstring) of one micro-batch of ``trainer``'s next batch."""
    batch = next(trainer.bench_batches)
    trainer.optimizer.zero_grad(set_to_none=True)
    peak = allocator_peak_bytes(lambda: trainer.runtime.loss_and_backward(batch, 1))
    trainer.optimizer.zero_grad(set_to_none=True)  # measured, never applied
    return peak


def held_after_forward_bytes(trainer) -> int:
    """``held_after_forward_bytes`` (module docstring) of an eager trainer's forward."""
    from lockstep.parallel.checkpointing import activation_bytes_after_forward
    from lockstep.run.objective import LMObjective

    inputs, targets = trainer.runtime.to_device(*next(trainer.bench_batches))
    kept: list[torch.Tensor] = []

    def forward() -> None:
        with trainer.runtime.autocast():
            loss, _ = LMObjective()(trainer.model, (inputs, targets))
        kept.append(loss)  # alive until measured: the autograd graph holds the saved activations

    held = activation_bytes_after_forward(forward)
    kept.clear()
    return held


def graph_saved_bytes(trainer) -> dict[str, int] | None:
    """The last capture's memory records (``runtime.graph.records``), or None when there are none:
    ``captured`` (bytes the captured graph saves for backward, memory pass), ``after`` (after the
    passes: the recompute pass's count on the rewritten graph, else the memory pass's plan), and
    ``static_peak`` (the recompute pass's static peak of live intermediates after rewriting), if recorded."""
    records = getattr(getattr(trainer.runtime, "graph", None), "records", None) or {}
    memory, recompute = records.get("memory") or {}, records.get("recompute") or {}
    if "saved_bytes_before" not in memory:
        return None
    out = {"captured": int(memory["saved_bytes_before"]),
           "after": int(recompute.get("saved_bytes_after", memory.get("saved_bytes_after", 0)))}
    if "peak_bytes_after" in recompute:
        out["static_peak"] = int(recompute["peak_bytes_after"])
    return out

"""Dist-MoE: the routed experts under expert parallelism as one overlapped operation.

With ``parallel.ep_chunks = N >= 1`` (:func:`lockstep.parallel.expert.apply_expert_parallel`) every
MoE layer becomes a :class:`DistMoE`: the router, selection bias and metrics stay the model's
(:class:`~lockstep.models.common.moe.MoE`), and :meth:`DistMoE.routed_and_shared` runs

1. **plan** -- one small blocking ``all_gather`` of each rank's assignment counts per (chunk,
   expert) (:mod:`lockstep.parallel.dist_moe_plan`): every rank then knows the exact split sizes of
   every exchange of the call; the batch's local tokens are split into N chunks of
   ``ceil(tokens / N)`` consecutive tokens;
2. **dispatch** -- per chunk, one uneven ``all_to_all_single`` of exactly the kept rows, sorted by
   destination expert (no padding on the wire);
3. **experts** -- the owner regroups what it received by local expert, pads an expert's group of
   fewer than 16 rows to 16 (zero rows that feed no token: a GEMM row's bits on this CPU do not
   depend on its neighbours from 16 rows on; bf16 groups to 16-row multiples) and runs its experts
   as one grouped GEMM (``torch._grouped_mm``; SwiGLU or the family's activation);
4. **combine** -- the results back with the reverse uneven exchange, then each token's kept
   assignments weighted and summed (the MoE module's own order: by expert).

Overlap: the dispatch of chunk k+1 is issued (``async_op=True``; gloo progresses it on its own
thread) before chunk k's experts run and chunk k's combine right after them, so both travel while
the next chunk computes; the shared experts run while chunk 0's dispatch is in flight. Backward
runs the same pipeline in reverse chunk order (gradients of the outputs to the owners, expert
backward, input gradients back) and computes the expert weight gradients once, while the last
input gradients travel. ``ep_chunks = 1`` is the same operation without overlap.

Capacity (``parallel.ep_capacity_factor``):

* ``0`` (default) **no-drop**: every assignment travels and is computed; the rows sent and
  computed are the real ones (plus at most 15 padding rows per expert and chunk at the owner);
* ``f > 0`` **drop**: capacity ``ceil(f * chunk_tokens * k / E)`` per (source rank, expert, chunk);
  within a (chunk, expert) the earliest tokens keep their slots and the rest are dropped (their
  weight is lost, the token keeps its other experts, the shared experts and the residual). The
  dropped set is a deterministic function of the routing; it depends on ``ep_chunks`` (capacity is
  per chunk). Every drop is counted (``dropped_tokens``). The buffers are not fixed-shape: a
  capacity bounds them (and the work of the busiest expert) without making them constant.

Bits: ``ep_chunks`` 1, 2, 4 and every capacity that drops nothing give bitwise-equal losses and
gradients (:mod:`lockstep.parallel.dist_moe_ops` says why). Against the synchronous uneven exchange of
:class:`~lockstep.parallel.expert.ExpertParallelExperts` equality is measured, not built in (other
matmul calls): the tests find equal bits on the debug flavors at ep 2 and 4 in fp32.

Metrics (``pop_auxiliary``; per layer under the layer's path, totals over layers under ``moe/``):
``dispatch_wait_s`` / ``combine_wait_s`` (exposed communication: time blocked waiting on the data
exchanges, forward and backward), ``sync_wait_s`` (the plan's blocking counts gather: every rank waits
there for the slowest one, so it measures load skew between ranks more than transfer; kept apart so
skew does not count as exposed communication), ``hidden_frac`` (1 - waited / total time of the data
exchanges from issue to completion), ``imbalance`` (max / mean tokens per expert over the ep group,
last forward), ``dropped_tokens`` (assignments dropped over the ep group, last forward). A step's
backward waits are reported with the next forward's metrics (the objective pops them right after
the forward). Benchmarks and tests can put an emulated link under the exchanges
(``LOCKSTEP_EP_LINK_EMULATION``, :func:`~lockstep.parallel.dist_moe_ops.emulated_link`): the same
metrics then measure it. Built and tested on CPU with gloo. Not supported (ConfigError): expert biases, expert
tensor parallelism, graph capture; pipeline and context parallelism are refused until tested
(:class:`~lockstep.parallel.dims.ParallelConfig`). Activation checkpointing works (the recompute
runs the exchanges again; the backward uses the forward's own state).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.config.base import ConfigError
from lockstep.graph.state import is_capturing
from lockstep.models.common.moe import MoE
from lockstep.parallel.dist_moe_ops import CallState, Dispatch, ExpertsCombine, Recorder
from lockstep.parallel.dist_moe_plan import make_plan

TIMES = ("dispatch_wait_s", "combine_wait_s", "sync_wait_s", "dispatch_s", "combine_s")


def drop_policy(capacity_factor: float) -> str:
    return "no-drop" if capacity_factor == 0 else f"drop past ceil({capacity_factor} * chunk_tokens * k / E)"


def describe_dispatch(config) -> dict:
    """The manifest entry (``parallel.expert_dispatch``) for a ParallelConfig with ep > 1."""
    if config.ep_chunks == 0:
        return {"operation": "synchronous uneven all_to_all (ExpertParallelExperts)", "ep_chunks": 0,
                "drop_policy": "no-drop"}
    return {"operation": "dist_moe: exact-split all_to_all dispatch -> grouped experts -> combine, one autograd "
                         "function per direction", "ep_chunks": config.ep_chunks, "overlap": config.ep_chunks > 1,
            "capacity_factor": config.ep_capacity_factor, "drop_policy": drop_policy(config.ep_capacity_factor),
            "metrics": "moe/dispatch_wait_s, moe/combine_wait_s, moe/sync_wait_s, moe/hidden_frac, moe/imbalance, "
                       "moe/dropped_tokens (and per layer)"}


class DistMoETotals(nn.Module):
    """No parameters: its ``pop_auxiliary`` reports the layers' metrics summed (``moe/...``); the
    layers add theirs when they are popped (they come first in module order)."""

    def __init__(self) -> None:
        super().__init__()
        self._sums: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if k == "imbalance":
                self._sums[k] = max(self._sums.get(k, 0.0), v)
            else:
                self._sums[k] = self._sums.get(k, 0.0) + v

    def pop_auxiliary(self) -> tuple[dict, dict[str, float]]:
        sums, self._sums = self._sums, {}
        if not sums:
            return {}, {}
        out = {k: sums[k] for k in ("dispatch_wait_s", "combine_wait_s", "sync_wait_s", "dropped_tokens", "imbalance")
               if k in sums}
        comm = sums.get("dispatch_s", 0.0) + sums.get("combine_s", 0.0)
        waited = sums.get("dispatch_wait_s", 0.0) + sums.get("combine_wait_s", 0.0)
        out["hidden_frac"] = _hidden(waited, comm)
        return {}, out


def _hidden(waited: float, comm: float) -> float:
    return max(0.0, 1.0 - waited / comm) if comm > 0 else 0.0


class DistMoE(MoE):
    """A MoE whose routed experts run as the Dist-MoE operation (module docstring). Made by
    :func:`make_dist_moe` from a MoE whose ``experts`` are already an ExpertParallelExperts."""

    ep_chunks: int
    capacity_factor: float
    recorder: Recorder
    totals: DistMoETotals | None

    def routed_and_shared(self, flat: torch.Tensor, expert_in: torch.Tensor, weights: torch.Tensor,
                          indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if is_capturing():
            raise ConfigError("parallel.ep_chunks: the Dist-MoE operation cannot be graph-captured; "
                              "use parallel.ep_chunks=0 with training.mode=graph")
        experts = self.experts
        if isinstance(experts.w1, DTensor):
            raise ConfigError("parallel.ep_chunks: expert tensor parallelism (parallel.tp > 1) is not supported "
                              "by the Dist-MoE operation; use parallel.ep_chunks=0")
        w1, w2, w3 = experts.local_weights()
        dtype = flat.dtype
        if torch.is_autocast_enabled(flat.device.type):
            dtype = torch.get_autocast_dtype(flat.device.type)
        plan = make_plan(indices.detach(), self.ep_chunks, experts.n_experts, experts.group,
                         self.capacity_factor, self.recorder, dtype)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (expert_in, weights, w1, w2, w3))
        state = CallState(plan, experts.group, self.recorder, experts._act, dtype, needs_grad)
        marker = Dispatch.apply(expert_in, state)
        shared = self.shared_output(flat)  # while chunk 0's dispatch is in flight
        out = ExpertsCombine.apply(marker, weights, w1, w2, w3, state)
        if torch._C._current_graph_task_id() == -1:  # not an activation checkpoint's recompute (see moe.py)
            per_expert = plan.counts.sum((0, 1)).to(torch.float64)
            self._ep_stats = {"imbalance": float(per_expert.max() / per_expert.mean().clamp(min=1e-9)),
                              "dropped_tokens": float(plan.dropped)}
        return out if shared is None else out + shared

    def pop_auxiliary(self):
        losses, metrics = super().pop_auxiliary()
        stats = getattr(self, "_ep_stats", None)
        if not metrics or stats is None:
            return losses, metrics
        self._ep_stats = None
        times = self.recorder.pop()
        mine = {**times, **stats}
        if self.totals is not None:
            self.totals.add(mine)
        metrics["dispatch_wait_s"] = times["dispatch_wait_s"]
        metrics["combine_wait_s"] = times["combine_wait_s"]
        metrics["sync_wait_s"] = times["sync_wait_s"]
        metrics["hidden_frac"] = _hidden(times["dispatch_wait_s"] + times["combine_wait_s"],
                                         times["dispatch_s"] + times["combine_s"])
        metrics["imbalance"] = stats["imbalance"]
        metrics["dropped_tokens"] = stats["dropped_tokens"]
        return losses, metrics


def make_dist_moe(moe: MoE, layer: int, ep_chunks: int, capacity_factor: float,
                  totals: DistMoETotals | None) -> DistMoE:
    """Turn ``moe`` (its experts already expert-parallel) into a :class:`DistMoE` in place."""
    if ep_chunks < 1:
        raise ConfigError(f"parallel.ep_chunks: must be >= 1 for the Dist-MoE operation, got {ep_chunks}")
    if capacity_factor < 0:
        raise ConfigError(f"parallel.ep_capacity_factor: must be >= 0, got {capacity_factor}")
    if any(getattr(moe.experts, b, None) is not None for b in ("b1", "b2", "b3")):
        raise ConfigError("parallel.ep_chunks: experts with biases (model.feed_forward.expert_bias) are not "
                          "supported by the Dist-MoE operation; use parallel.ep_chunks=0")
    moe.__class__ = DistMoE
    moe.ep_chunks, moe.capacity_factor = ep_chunks, capacity_factor
    moe.recorder, moe._ep_stats = Recorder(layer), None
    object.__setattr__(moe, "totals", totals)  # a reference, not a submodule (the model holds it)
    return moe

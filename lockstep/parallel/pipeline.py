"""Pipeline parallelism on ``torch.distributed.pipelining``: stage modules, schedules, one runner.

The model is cut into ``pp x stages_per_rank`` stages (by layer count, by a cost model, or by an
explicit list: ``split``), each a ``PipelineStageModule`` (:mod:`lockstep.parallel.pipeline_stage`:
any block kind, MTP heads and tied embeddings on the last stage, auxiliary losses of every stage
joined to the backward). The schedules (and their engine) are PyTorch's:

================  ==============  ===========================  =======================================
schedule          stages / rank   placement of stage s         n_microbatches (pp = pipeline ranks)
================  ==============  ===========================  =======================================
GPipe             1               rank s                       >= 1
1F1B              1               rank s                       >= pp
Interleaved1F1B   2               rank s % pp (loop)           a multiple of max(1, n_mb // pp)
                                                               (torch's rounds rule: at pp=2 any of
                                                               1-4, 6, 8 but not 5, 7)
ZBVZeroBubble     2               V: ranks 0..pp-1..0          >= 1
DualPipeV         2               V: ranks 0..pp-1..0          >= 2 * pp
================  ==============  ===========================  =======================================

The loss on the last stage is ``sum CE / (tokens of the whole batch)`` per micro-batch with
``scale_grads=False``: the micro-batch losses add up to the full-batch mean and the gradients are
the single-process gradients of it (before data-parallel averaging, which FSDP does as usual).
Auxiliary losses (MoE balance, MTP) join with ``loss_scale / n_microbatches`` per micro-batch (see
``pipeline_stage``); the embedding shared by the first and last stage (tied head, MTP) has its
copies' gradients summed by ``reduce_shared_grads`` before clipping (which counts it once).

Compose with FSDP by passing ``parallelize_fn`` (applied to each stage module before it becomes a
``PipelineStage``), e.g. ``apply_fsdp(part, list(part.layers.values()), dp_mesh, ...)``; under the
V schedules the runner turns ``reshard_after_forward`` off on every FSDP unit (see
``_keep_unsharded_after_forward``) and refuses selective activation checkpointing (full is fine).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.parallel.pipeline_stage import (  # noqa: F401  (re-exported)
    AuxiliaryState,
    PipelineStageModule,
    StageReport,
    _too_few_layers,
    check_splittable,
    layer_ranges,
    shared_parameter_names,
    split_into_stages,
    split_sizes,
)

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "GPipe")
#: stages each pipeline rank holds under a schedule
STAGES_PER_RANK = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}
#: schedules that place stages in a V (rank r holds stages r and n_stages - 1 - r)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
IGNORE_INDEX = -100  # F.cross_entropy's default, as in the trainer's lm_loss


def canonical_schedule(schedule: str) -> str:
    """The schedule's canonical spelling (case-insensitive match); ValueError naming the choices."""
    for name in SCHEDULES:
        if name.lower() == str(schedule).lower():
            return name
    raise ValueError(f"pp_schedule: unknown schedule {schedule!r}; choose from {list(SCHEDULES)}")


def stages_per_rank(schedule: str) -> int:
    return STAGES_PER_RANK[canonical_schedule(schedule)]


def stage_ids_for_rank(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """Stage indices pipeline rank ``pp_rank`` holds, in increasing order."""
    schedule = canonical_schedule(schedule)
    n = STAGES_PER_RANK[schedule]
    if n == 1:
        return [pp_rank]
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(n)]


def last_stage_pp_rank(schedule: str, pp: int) -> int:
    """The pipeline rank that holds the last stage (and so computes the loss)."""
    return 0 if canonical_schedule(schedule) in V_SCHEDULES else pp - 1


def validate_pipeline(schedule: str, pp: int, n_microbatches: int, n_layers: int | None = None,
                      batch_size: int | None = None) -> str:
    """Check a pipeline layout up front (no processes needed); returns the canonical schedule name.

    Raises ValueError naming ``pp``, ``n_microbatches`` or ``pp_schedule`` -- never lets a bad
    combination reach the schedule engine, where it would fail late or hang.
    """
    schedule = canonical_schedule(schedule)
    if pp < 1:
        raise ValueError(f"pp: must be >= 1, got {pp}")
    n_stages = pp * STAGES_PER_RANK[schedule]
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches: must be a positive integer, got {n_microbatches!r}")
    rule = None
    if schedule == "1F1B" and n_microbatches < pp:
        rule = f"1F1B needs n_microbatches >= pp = {pp}"
    elif schedule == "Interleaved1F1B":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            ok = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]
            rule = (f"Interleaved1F1B runs max(1, n_microbatches // pp) = {rounds} rounds and needs "
                    f"n_microbatches to be a multiple of that; valid values up to {4 * pp}: {ok}")
    elif schedule == "DualPipeV" and n_microbatches < n_stages:
        rule = f"DualPipeV needs n_microbatches >= its {n_stages} stages (2 * pp)"
    if rule:
        raise ValueError(f"n_microbatches: {n_microbatches} does not fit {schedule} at pp={pp}: {rule}")
    if n_layers is not None and n_layers < n_stages:
        raise ValueError(_too_few_layers(n_layers, n_stages, f"pp={pp} x {STAGES_PER_RANK[schedule]} "
                                                             f"stage(s) per rank ({schedule})"))
    if batch_size is not None and batch_size % n_microbatches:
        raise ValueError(f"n_microbatches: {n_microbatches} does not divide the per-rank batch size "
                         f"{batch_size} (micro-batches must have equal shapes)")
    return schedule


def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """``PipelineStage`` whose same-rank gradient hand-off is a no-op in a forward-only run.

        torch 2.13's runtime still walks the backward actions of V schedules (ZBVZeroBubble,
        DualPipeV) under ``schedule.eval`` and asserts in ``get_local_bwd_output`` while passing the
        (absent) gradient to the adjacent stage on the same rank.
        """

        def _forward_metadata_inference(self, *args, **kwargs):
            # torch runs the stage once on placeholder inputs to learn its output shapes: that pass
            # must leave no trace (no auxiliary losses reported, no routing counts for the bias step)
            from lockstep.models.common.moe import MoE

            moes = [m for m in self.submod.modules() if isinstance(m, MoE)]
            saved = [m.pending_counts for m in moes]
            self.submod.inferring_shapes = True
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                self.submod.inferring_shapes = False
                for m, counts in zip(moes, saved):
                    m.pending_counts = counts

        def get_local_bwd_output(self, mb_index):
            if not self.has_backward:
                return ()
            return super().get_local_bwd_output(mb_index)

        def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
            if not self.has_backward:
                return
            return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return _Stage


def check_split_backward(parts: Sequence[nn.Module], schedule: str) -> None:
    """Refuse selective activation checkpointing under the V schedules, before any rank starts.

    Their backward runs twice over each region (input gradients, later weight gradients), and
    torch's selective checkpointing raises "Trying to backward an extra time" on the second pass
    -- on one rank, mid-schedule, leaving the others waiting. Full checkpointing works. torch_remat
    save regions (mode "regions") fail there too (measured, torch 2.13 + torch-remat 0.2.2: the weight
    pass hits "Can't detach views in-place"), though a plain second backward over them is exact.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from lockstep.parallel.remat_regions import is_region_checkpointed

    for part in parts:
        for name, module in part.named_modules():
            if is_region_checkpointed(module):
                raise ValueError(
                    f"pp: activation checkpointing mode 'regions' ({name}) cannot run under {schedule}, whose "
                    "split backward (input grads, then weight grads) fails in torch_remat's replay; use "
                    "training.activation_checkpoint.mode 'full' or 'none', or a schedule without the split "
                    "(1F1B, Interleaved1F1B, GPipe)")
            keywords = getattr(getattr(module, "checkpoint_fn", None), "keywords", None) or {}
            if isinstance(module, CheckpointWrapper) and keywords.get("context_fn") is not None:
                raise ValueError(
                    f"pp: selective activation checkpointing ({name.replace('._checkpoint_wrapped_module', '')}) "
                    f"cannot run under {schedule}, whose split backward (input grads, then weight grads) "
                    "backpropagates each checkpointed region twice; use activation_checkpoint 'full' or "
                    "'none', or a schedule without the split (1F1B, Interleaved1F1B, GPipe)")


def _keep_unsharded_after_forward(parts: Sequence[nn.Module]) -> None:
    """FSDP units of a V schedule must not reshard after forward.

    ZBVZeroBubble and DualPipeV split backward into input- and weight-gradient passes; with
    ``reshard_after_forward=True`` (torch 2.13) the weight pass of some FSDP units silently produces
    wrong or missing gradients (measured at pp=2 x dp_shard=2: ``layers.*`` grads off by as much as
    the gradients themselves, some ``None``). The schedule's own UNSHARD/RESHARD actions still bound
    the memory per stage; TorchTitan's default policy does not reshard after forward under pp either.
    """
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False, recurse=False)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


@dataclasses.dataclass
class _LossState:
    #: ``scale / (target tokens of the whole batch)`` as a float32 0-d tensor on the batch's device:
    #: computed on the device (float64, then rounded), so preparing a step reads nothing back to the host
    factor: torch.Tensor | None = None
    #: an objective's loss ``(logits, target) -> loss`` replacing the cross-entropy for one call (its
    #: factor is then just the scale: the objective normalises its own loss)
    custom: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class PipelineRunner:
    """This rank's stages of ``model`` and the schedule that trains them.

    ``pp_group``: the pipeline dim -- a 1-D ``DeviceMesh`` (``mesh["pp"]``) or a ``ProcessGroup``.
    ``parallelize_fn(part) -> part | None`` runs on each stage module first (EP, TP, FSDP,
    activation checkpointing). Every rank of the pipeline calls ``step`` with the same batch.
    ``split``: "even" (by layer count), "cost" (:func:`pipeline_stage.cost_split` at ``seq_len``)
    or layers per stage. ``tp_mesh``: the tensor-parallel mesh when the stages are TP-sharded (the
    last stage's logits leave sharded on the vocabulary; the loss is loss-parallel -- run ``step``
    under ``loss_parallel()``). ``ep_group``: the expert-parallel group (gradient norms of the
    rank-local experts are summed over it). ``context``: a ContextParallel (cp > 1): ``step`` takes
    this rank's sequence shards (``context.shard_batch``), the loss divides by the tokens of the whole
    sequences (counted over cp) and the reported loss is summed over cp, as ``context.cross_entropy``.
    """

    def __init__(self, model: nn.Module, pp_group, *, schedule: str = "1F1B", n_microbatches: int | None = None,
                 parallelize_fn: Callable[[nn.Module], nn.Module | None] | None = None,
                 device: torch.device | str | None = None, split: str | Sequence[int] = "even",
                 seq_len: int | None = None, tp_mesh=None, ep_group=None, context=None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        if isinstance(pp_group, DeviceMesh):
            if pp_group.ndim != 1:
                raise ValueError(f"pp: expected the 1-D pipeline sub-mesh, got a {pp_group.ndim}-D mesh")
            pp_group = pp_group.get_group()
        self.group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.schedule_name = canonical_schedule(schedule)
        self.n_stages = self.pp * STAGES_PER_RANK[self.schedule_name]
        if n_microbatches is None:
            n_microbatches = self.n_stages
        validate_pipeline(self.schedule_name, self.pp, n_microbatches, model.config.n_layers)
        self.n_microbatches = n_microbatches
        self.stage_ids = stage_ids_for_rank(self.schedule_name, self.pp_rank, self.pp)
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)

        sizes = split_sizes(model, self.n_stages, split, seq_len)
        #: layers per stage (all stages, in order)
        self.stage_layers = [len(r) for r in layer_ranges(model.config.n_layers, self.n_stages, sizes)]
        parts = split_into_stages(model, self.n_stages, self.stage_ids, sizes)
        self.aux_state = AuxiliaryState(n_microbatches=n_microbatches)
        shared_names = [shared_parameter_names(model.config, p) for p in parts]
        for part in parts:
            part.aux_state = self.aux_state
        self.tp_mesh, self.ep_group = tp_mesh, ep_group
        self.context = context if context is not None and context.size > 1 else None
        if parallelize_fn is not None:
            parts = [(parallelize_fn(p) or p) for p in parts]
        if self.schedule_name in V_SCHEDULES:
            check_split_backward(parts, self.schedule_name)
            _keep_unsharded_after_forward(parts)
        #: this rank's stage modules (for the optimizer, clipping, state dicts), in stage order
        self.model_parts: list[nn.Module] = parts
        stage_cls = _stage_class()
        self.stages = [stage_cls(part, s, self.n_stages, self.device, group=pp_group)
                       for s, part in zip(self.stage_ids, parts)]
        self.has_first_stage = 0 in self.stage_ids
        self.has_last_stage = self.n_stages - 1 in self.stage_ids
        self.last_stage_rank = dist.get_global_rank(pp_group, last_stage_pp_rank(self.schedule_name, self.pp))
        self._setup_shared(parts, shared_names)

        self._loss_state = _LossState()
        self._schedule_cls = get_schedule_class(self.schedule_name)
        self._single = issubclass(self._schedule_cls, PipelineScheduleSingle)
        self._shapes: tuple | None = None  # the (inputs, targets) shapes the schedule's stages were set up for
        self.schedule = self._new_schedule()

    def _new_schedule(self):
        stages = self.stages[0] if self._single else self.stages
        return self._schedule_cls(stages, n_microbatches=self.n_microbatches, loss_fn=self._loss_fn,
                                  scale_grads=False)

    def _fit_shapes(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """torch sets a schedule's stages up (receive buffers, shape metadata) for the first batch's shapes;
        a batch of other shapes (RL: each step's longest sequence) gets a fresh schedule over the same
        stages, which sets them up again (every pipeline rank sees the same shapes: the same batch)."""
        shapes = (tuple(inputs.shape), tuple(targets.shape))
        if self._shapes is not None and shapes != self._shapes:
            self.schedule = self._new_schedule()
        self._shapes = shapes

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self._loss_state.custom is not None:  # the objective's last-stage half (e.g. RL's policy loss)
            return self._loss_state.custom(logits, targets) * self._loss_state.factor
        if self.tp_mesh is not None:  # this rank's vocabulary shard: loss-parallel cross-entropy
            from torch.distributed.tensor import Shard

            logits = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)], run_check=False)
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                                ignore_index=IGNORE_INDEX)
        return total * self._loss_state.factor

    def _prepare(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        if inputs.shape[0] % self.n_microbatches:
            raise ValueError(f"n_microbatches: {self.n_microbatches} does not divide the batch of "
                             f"{inputs.shape[0]} sequences (micro-batches must have equal shapes)")
        self._fit_shapes(inputs, targets)
        self._loss_state.custom = loss_fn
        if loss_fn is not None:  # the objective's own loss: scaled only; auxiliary losses are not part of it
            self._loss_state.factor = torch.full((), scale, dtype=torch.float32, device=targets.device)
            self.aux_state.factor = None
            self.aux_state.report = StageReport()
            return
        # the same float64 arithmetic as Python's ``scale / n_tokens`` (not ``scale * (1 / n)``), kept
        # on the device: no host synchronisation per micro-batch
        n_tokens = (targets != IGNORE_INDEX).sum()
        if self.context is not None:  # the targets are this rank's shards: count the whole sequences
            dist.all_reduce(n_tokens, group=self.context.group)
        n_tokens = n_tokens.clamp(min=1)
        scale64 = torch.full((), scale, dtype=torch.float64, device=targets.device)
        self._loss_state.factor = scale64.div(n_tokens).float()
        aux = torch.full((), scale / self.n_microbatches, dtype=torch.float64, device=targets.device)
        self.aux_state.factor = aux.float()
        self.aux_state.report = StageReport()

    def _run(self, run, inputs, targets) -> torch.Tensor | None:
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        target = targets if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        # every stage gets the micro-batch's token ids: the last stage's MTP heads embed them, and
        # under TP a stage's input is its sequence shard while rope covers the whole sequence
        run(*args, target=target, losses=losses, tokens=inputs)
        if not self.has_last_stage:
            return None
        loss = torch.stack([_local(l.detach()).float() for l in losses]).sum().to(torch.float64)
        if self.context is not None:  # each cp rank's part of the mean: their sum (same ranks' stage)
            dist.all_reduce(loss, group=self.context.group)
        return loss

    def report(self) -> StageReport:
        """This rank's stages' auxiliary losses and metrics of the last ``step``/``eval_loss``
        (each summed over micro-batches / n_microbatches: the batch's value for batch means)."""
        return self.aux_state.report

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *,
             loss_scale: float = 1.0, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
             ) -> torch.Tensor | None:
        """Forward + backward of one batch through the pipeline; gradients accumulate into
        ``.grad`` of ``model_parts`` (``loss_scale`` multiplies them, e.g. ``1 / grad_accum``).
        ``loss_fn(logits, target)``: another objective's loss per micro-batch on the last stage instead of
        the cross-entropy (``targets``: any tensor split on dim 0 with the inputs, e.g. RL's packed
        per-token values); its micro-batch losses must add up to the batch's loss, and no auxiliary loss
        joins the gradients.

        Returns the batch's mean cross-entropy (unscaled) as a detached float64 0-d tensor on the
        rank(s) holding the last stage, None elsewhere (see ``broadcast_loss``). Nothing is read back
        to the host: the caller decides when to synchronise (``StepScalars.reduce``, once a step).
        """
        self._prepare(inputs, targets, loss_scale, loss_fn)
        try:
            loss = self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), inputs, targets)
        finally:
            self._loss_state.custom = None
        return None if loss is None else loss / loss_scale

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor, *,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward-only mean cross-entropy of a batch (a float64 0-d tensor on the last-stage rank;
        None elsewhere); ``loss_fn``: another objective's loss (as in :meth:`step`; also a way to read the
        last stage's logits of a forward-only pass, e.g. a frozen reference's scores)."""
        self._prepare(inputs, targets, 1.0, loss_fn)
        self.aux_state.factor = None
        try:
            return self._run(lambda *a, **k: self.schedule.eval(*a, return_outputs=False, **k), inputs, targets)
        finally:
            self._loss_state.custom = None

    def broadcast_loss(self, loss: torch.Tensor | float | None) -> float:
        """The last stage's loss on every pipeline rank as a float (collective over the pipeline
        group, on the CPU; a host synchronisation: for tests and tools, not the training step)."""
        value = float("nan") if loss is None else loss
        t = torch.as_tensor(value, dtype=torch.float64).reshape(1).cpu()
        if self.pp > 1:
            dist.broadcast(t, src=self.last_stage_rank, group=self.group)
        return float(t)

    def _setup_shared(self, parts: Sequence[nn.Module], names: Sequence[list[str]]) -> None:
        """The copies of the embedding shared by the first and last stage (tied head, MTP): on this
        rank, and the group that sums their gradients (the pipeline group itself at pp=2, a 2-rank
        group of the first and last stage's ranks beyond; none when one rank holds both)."""
        self._shared: list[tuple[int, str]] = [(i, n) for i, ns in enumerate(names) for n in ns]
        #: parameters whose gradient norm another stage already counts (the last stage's copies)
        self._norm_skip: set[int] = set()
        self._shared_group = None
        if not self._shared:
            return
        for i, name in self._shared:
            if parts[i].is_last:
                self._norm_skip.add(id(parts[i].get_parameter(name)))
        first, last = 0, last_stage_pp_rank(self.schedule_name, self.pp)
        if first == last:
            return
        if self.pp == 2:
            self._shared_group = self.group
        else:
            pair = [dist.get_global_rank(self.group, first), dist.get_global_rank(self.group, last)]
            self._shared_group = dist.new_group(pair, use_local_synchronization=True)

    @torch.no_grad()
    def reduce_shared_grads(self) -> None:
        """Sum the gradients of the embedding copies held by the first and last stage (after
        backward, before clipping): every copy then has one process's gradient of the shared weight."""
        if not self._shared:
            return
        params = [self.model_parts[i].get_parameter(n) for i, n in self._shared]
        params = list({id(p): p for p in params}.values())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # a TP embedding's gradient comes back replicated: take this rank's shard (no communication)
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad for p in params]
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if self._shared_group is not None:
            total = total.clone() if len(grads) == 1 else total
            dist.all_reduce(total, group=self._shared_group)
        for g in grads:
            g.copy_(total)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """``lockstep.parallel.grad.clip_grad_norm`` over the whole pipeline: each rank's squared
        norm (already reduced over its FSDP / TP mesh; rank-local experts summed over ep) is summed
        over the pipeline group, so every rank scales by the global norm; the shared embedding counts
        once. Returns the norm before clipping (same on every rank)."""
        from lockstep.parallel.expert import expert_parameters

        experts = {id(p) for part in self.model_parts for p in expert_parameters(part)} if self.ep_group else set()
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        expert_squares = torch.zeros((), dtype=torch.float32, device=self.device)
        grads = []
        for p in self.parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if id(p) in self._norm_skip:
                continue
            norm = torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            if id(p) in experts:
                expert_squares = expert_squares + norm * norm
            else:
                squares = squares + norm * norm
        if self.ep_group is not None:
            dist.all_reduce(expert_squares, group=self.ep_group)
            squares = squares + expert_squares
        if self.pp > 1:
            dist.all_reduce(squares, group=self.group)
        total = squares.sqrt()
        if math.isfinite(max_norm):
            scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            for g in grads:
                g.mul_(scale)
        return total

    def train(self, mode: bool = True) -> "PipelineRunner":
        for part in self.model_parts:
            part.train(mode)
        return self

    def eval(self) -> "PipelineRunner":
        return self.train(False)

    def parameters(self):
        for part in self.model_parts:
            yield from part.parameters()

    def full_state_dict(self, group=None) -> dict[str, torch.Tensor]:
        """The unsplit model's full state dict (FQNs as in ``Transformer``) on ``group``'s first rank
        (default: the whole world's rank 0), ``{}`` elsewhere. Collective over ``group``: every rank of it
        must call it (an RL job passes its trainer ranks' group: the generators are not in it). One rank per stage
        sends (coordinate 0 on every data-parallel and tensor-parallel dim); expert-parallel
        experts are gathered over ep first."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local: dict[str, torch.Tensor] = {}
        owner = True
        for part in self.model_parts:
            params = list(part.parameters())
            if any(isinstance(p, DTensor) for p in params):
                state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
                for p in params:
                    if isinstance(p, DTensor) and any(c != 0 for c in p.device_mesh.get_coordinate() or ()):
                        owner = False  # data- or tensor-parallel copies of the same stage: one rank sends
            else:
                state = part.state_dict()
            if self.ep_group is not None:
                from lockstep.parallel.expert import gather_full_experts

                state.update(gather_full_experts(part, self.ep_group))
                if dist.get_rank(self.ep_group) != 0:
                    owner = False
            local.update({k.replace("._checkpoint_wrapped_module", ""): _local(v).detach().cpu()
                          for k, v in state.items()})
        if not owner:
            local = {}
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return local
        first = dist.get_global_rank(group, 0) if group is not None else 0
        gathered = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
        dist.gather_object(local, gathered, dst=first, group=group)
        if dist.get_rank() != first:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part_state in gathered:
            merged.update(part_state)
        return merged

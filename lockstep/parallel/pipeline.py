"""Pipeline parallelism on ``torch.distributed.pipelining``: stage modules, schedules, one runner.

The model is cut by layer count into ``pp x stages_per_rank`` stages. Each stage is a
``PipelineStageModule`` holding deep copies of the model's own submodules under the model's own
names (``tok_embeddings`` on the first stage, its ``layers`` keys, ``norm`` + ``output`` on the
last; absent pieces are ``None``), so parameter FQNs -- and state dicts merged over stages -- are
the unsplit model's. The schedules (and their engine) are PyTorch's:

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

Compose with FSDP by passing ``parallelize_fn`` (applied to each stage module before it becomes a
``PipelineStage``), e.g. ``apply_fsdp(part, list(part.layers.values()), dp_mesh, ...)``; under the
V schedules the runner turns ``reshard_after_forward`` off on every FSDP unit (see
``_keep_unsharded_after_forward``) and refuses selective activation checkpointing (full is fine).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

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


def _too_few_layers(n_layers: int, n_stages: int, what: str) -> str:
    return (f"pp: {n_layers} layers cannot be split into {n_stages} pipeline stages ({what}); every stage "
            "needs at least one layer: lower pp, use a single-stage schedule (1F1B, GPipe), or add layers")


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer indices per stage, split evenly by count (earlier stages take the remainder:
    the last stage also carries the head and the loss)."""
    if n_stages < 1:
        raise ValueError(f"pp: need at least one stage, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(_too_few_layers(n_layers, n_stages, f"{n_stages} stages requested"))
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class PipelineStageModule(nn.Module):
    """One pipeline stage of a ``Transformer``, built from (copies of) the model's own submodules.

    ``forward(x)``: token ids [B, T] on the first stage (embedded here), hidden states [B, T, dim]
    elsewhere; runs this stage's blocks with rope for positions ``0..T-1`` (as the full model does
    by default), then the final norm and head on the last stage (logits [B, T, vocab]).
    """

    def __init__(self, config, *, tok_embeddings: nn.Module | None, rope: nn.Module, layers: nn.ModuleDict,
                 norm: nn.Module | None, output: nn.Module | None, stage_index: int, n_stages: int) -> None:
        super().__init__()
        self.config = config
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.tok_embeddings = tok_embeddings
        self.rope = rope
        self.layers = layers
        self.norm = norm
        self.output = output

    @property
    def is_last(self) -> bool:
        return self.output is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = self.rope.prefix(h.shape[1])  # positions 0..T-1, as the full model's default
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}/{self.n_stages}, layers={list(self.layers.keys())}"


def _check_splittable(model: nn.Module) -> None:
    from lockstep.models.common.transformer import Transformer

    if not isinstance(model, Transformer) or type(model).forward is not Transformer.forward:
        raise ValueError(f"pp: pipeline stages are cut from a plain Transformer; got {type(model).__name__} "
                         "(extra heads such as MTP are not supported)")
    if model.config.tie_embeddings:
        raise ValueError("pp: tied embeddings (model.tie_embeddings) put one weight on the first and the last "
                         "stage; untie them to pipeline this model")
    for name, module in model.named_modules():
        if module is not model and hasattr(module, "pop_auxiliary"):
            raise ValueError(f"pp: {name} ({type(module).__name__}) records auxiliary losses/updates in its "
                             "forward, which pipeline stages cannot carry to the loss; use a dense model")
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("pp: split the plain model, then shard each stage (parallelize_fn)")


def split_into_stages(model: nn.Module, n_stages: int, stage_ids: Sequence[int] | None = None
                      ) -> list[PipelineStageModule]:
    """Stage modules for ``stage_ids`` (default: all ``n_stages``), each a deep copy of the pieces it keeps.

    TorchTitan's cut: stage ``s`` keeps the ``layers`` keys of its contiguous share (the keys stay the
    model's, "0".."n-1"), the first stage keeps ``tok_embeddings``, the last keeps ``norm`` and
    ``output``; the others hold ``None`` there. ``model`` itself is left untouched.
    """
    _check_splittable(model)
    ranges = layer_ranges(model.config.n_layers, n_stages)
    ids = list(range(n_stages)) if stage_ids is None else list(stage_ids)
    stages = []
    for s in ids:
        if not 0 <= s < n_stages:
            raise ValueError(f"pp: stage index {s} is outside 0..{n_stages - 1}")
        memo: dict = {}  # one memo per stage: anything shared inside a stage stays shared

        def keep(module):
            return copy.deepcopy(module, memo) if module is not None else None

        first, last = s == 0, s == n_stages - 1
        stages.append(PipelineStageModule(
            model.config,
            tok_embeddings=keep(model.tok_embeddings) if first else None,
            rope=keep(model.rope),
            layers=nn.ModuleDict({str(i): keep(model.layers[str(i)]) for i in ranges[s]}),
            norm=keep(model.norm) if last else None,
            output=keep(model.output) if last else None,
            stage_index=s, n_stages=n_stages,
        ))
    return stages


def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """``PipelineStage`` whose same-rank gradient hand-off is a no-op in a forward-only run.

        torch 2.13's runtime still walks the backward actions of V schedules (ZBVZeroBubble,
        DualPipeV) under ``schedule.eval`` and asserts in ``get_local_bwd_output`` while passing the
        (absent) gradient to the adjacent stage on the same rank.
        """

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
    -- on one rank, mid-schedule, leaving the others waiting. Full checkpointing works.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for part in parts:
        for name, module in part.named_modules():
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


@dataclasses.dataclass
class _LossState:
    #: ``scale / (target tokens of the whole batch)`` as a float32 0-d tensor on the batch's device:
    #: computed on the device (float64, then rounded), so preparing a step reads nothing back to the host
    factor: torch.Tensor | None = None


class PipelineRunner:
    """This rank's stages of ``model`` and the schedule that trains them.

    ``pp_group``: the pipeline dim -- a 1-D ``DeviceMesh`` (``mesh["pp"]``) or a ``ProcessGroup``.
    ``parallelize_fn(part) -> part | None`` runs on each stage module first (FSDP, activation
    checkpointing). Every rank of the pipeline calls ``step`` with the same batch.
    """

    def __init__(self, model: nn.Module, pp_group, *, schedule: str = "1F1B", n_microbatches: int | None = None,
                 parallelize_fn: Callable[[nn.Module], nn.Module | None] | None = None,
                 device: torch.device | str | None = None) -> None:
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

        parts = split_into_stages(model, self.n_stages, self.stage_ids)
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

        self._loss_state = _LossState()
        cls = get_schedule_class(self.schedule_name)
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        self.schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=self._loss_fn, scale_grads=False)

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                                ignore_index=IGNORE_INDEX)
        return total * self._loss_state.factor

    def _prepare(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> None:
        if inputs.shape[0] % self.n_microbatches:
            raise ValueError(f"n_microbatches: {self.n_microbatches} does not divide the batch of "
                             f"{inputs.shape[0]} sequences (micro-batches must have equal shapes)")
        # the same float64 arithmetic as Python's ``scale / n_tokens`` (not ``scale * (1 / n)``), kept
        # on the device: no host synchronisation per micro-batch
        n_tokens = (targets != IGNORE_INDEX).sum().clamp(min=1)
        scale64 = torch.full((), scale, dtype=torch.float64, device=targets.device)
        self._loss_state.factor = scale64.div(n_tokens).float()

    def _run(self, run, inputs, targets) -> torch.Tensor | None:
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        target = targets if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        run(*args, target=target, losses=losses)
        if not self.has_last_stage:
            return None
        return torch.stack([l.detach().float() for l in losses]).sum().to(torch.float64)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *,
             loss_scale: float = 1.0) -> torch.Tensor | None:
        """Forward + backward of one batch through the pipeline; gradients accumulate into
        ``.grad`` of ``model_parts`` (``loss_scale`` multiplies them, e.g. ``1 / grad_accum``).

        Returns the batch's mean cross-entropy (unscaled) as a detached float64 0-d tensor on the
        rank(s) holding the last stage, None elsewhere (see ``broadcast_loss``). Nothing is read back
        to the host: the caller decides when to synchronise (``StepScalars.reduce``, once a step).
        """
        self._prepare(inputs, targets, loss_scale)
        loss = self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), inputs, targets)
        return None if loss is None else loss / loss_scale

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward-only mean cross-entropy of a batch (a float64 0-d tensor on the last-stage rank;
        None elsewhere)."""
        self._prepare(inputs, targets, 1.0)
        return self._run(lambda *a, **k: self.schedule.eval(*a, return_outputs=False, **k), inputs, targets)

    def broadcast_loss(self, loss: torch.Tensor | float | None) -> float:
        """The last stage's loss on every pipeline rank as a float (collective over the pipeline
        group, on the CPU; a host synchronisation: for tests and tools, not the training step)."""
        value = float("nan") if loss is None else loss
        t = torch.as_tensor(value, dtype=torch.float64).reshape(1).cpu()
        if self.pp > 1:
            dist.broadcast(t, src=self.last_stage_rank, group=self.group)
        return float(t)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """``lockstep.parallel.grad.clip_grad_norm`` over the whole pipeline: each rank's squared
        norm (already reduced over its FSDP mesh) is summed over the pipeline group first, so every
        rank scales by the global norm. Returns the norm before clipping (same on every rank)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32)
        for g in grads:
            norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squares = squares + norm * norm
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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's full state dict (FQNs as in ``Transformer``) on global rank 0, ``{}``
        elsewhere. Collective over the whole world: every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        local: dict[str, torch.Tensor] = {}
        owner = True
        for part in self.model_parts:
            if isinstance(part, FSDPModule):
                state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
                dt = next((p for p in part.parameters() if isinstance(p, DTensor)), None)
                if dt is not None and any(c != 0 for c in dt.device_mesh.get_coordinate() or ()):
                    owner = False  # data-parallel copies of the same stage: one rank sends
            else:
                state = part.state_dict()
            local.update({k.replace("._checkpoint_wrapped_module", ""): v.detach().cpu() for k, v in state.items()})
        if not owner:
            local = {}
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part_state in gathered:
            merged.update(part_state)
        return merged

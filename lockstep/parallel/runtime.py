"""What a trainer needs to know about its place in a distributed job, in one object.

``ParallelRuntime.create(config)`` initialises the process group (when launched by torchrun) on the
run's device (NCCL on CUDA, gloo on the CPU), resolves the degrees and builds the mesh -- over the
whole world, or over a subset of it (``ranks=``: an RL job's trainer ranks, beside its generator
processes). It parallelizes a model with its family's plan (on ``device``), and is the step seam:

- ``loss_and_backward(batch, accumulate, objective=None)``: one micro-batch's forward + backward
  for the layout, returning a :class:`~lockstep.run.step.StepLoss` of detached tensors -- no host
  synchronisation. The forward is an :class:`~lockstep.run.objective.Objective` (what the workload
  computes: the LM cross-entropy by default, with context parallel's ``shard_batch`` + cp
  cross-entropy; RL's policy-gradient loss) wrapped with the layout's pieces (device, autocast,
  ``loss_parallel`` when tp > 1, timer stages, the backward); pipeline: ``PipelineRunner.step``
  (under cp on the cp-sharded batch: each stage's attention runs over the cp group), and another
  objective through its pipeline halves (``pipeline_batch`` / ``pipeline_loss`` on the last stage /
  ``pipeline_report``: RL's policy loss, :class:`~lockstep.rl.objective.PolicyObjective`);
- ``loss(batch)``: the same forward without gradients (evaluation);
- ``optimizer_step(optimizer, max_norm)``: gradient sync (cp, ep), clipping, the step, and the
  model's ``after_optimizer_step`` hook (``clip_gradients`` + ``apply_step``/``drop_step``: its halves);
- ``scalars()``: a :class:`~lockstep.run.step.StepScalars` reducing a step's scalars in one collective.

This is the piece a graph-captured step replaces: with ``mode = "graph"`` (``parallelize(...,
mode="graph")``) a training micro-batch runs as a captured graph (:mod:`lockstep.graph.step`).
A single process gets the same object with world 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lockstep.parallel.checkpointing import ActivationCheckpointConfig
from lockstep.parallel.dims import ParallelConfig, ParallelDims
from lockstep.parallel.launch import check_one_gpu_per_rank, init_distributed, resolve_device
from lockstep.run.objective import LMObjective, Objective, lm_loss  # noqa: F401  (lm_loss: re-exported)
from lockstep.run.step import StepLoss, StepScalars


def _sub_mesh(dims: ParallelDims, ranks: list[int], device_type: str):
    """A DeviceMesh over ``ranks`` only. Every process of the job calls this (making the mesh's groups
    is collective over the world); the others get a mesh they are not in."""
    from torch.distributed.device_mesh import DeviceMesh

    names = [n for n, _ in dims.mesh_dims]
    if not names:
        return None
    shape = tuple(d for _, d in dims.mesh_dims)
    mesh = DeviceMesh(device_type, torch.tensor(ranks).view(shape), mesh_dim_names=tuple(names))
    if dist.get_rank() in ranks:
        return dims.flatten_mesh(mesh)
    # an outsider cannot slice a mesh it is not in (torch needs the local rank for a proper slice), but
    # must take part in creating the flattened dims' groups: the same new_group calls, by their layouts
    from torch.distributed._mesh_layout import _MeshLayout

    for sliced, name in dims.flattened_dims:
        layout = _MeshLayout([mesh._get_slice_mesh_layout(sliced).collapse()])
        DeviceMesh._init_process_groups(layout, mesh._rank_map, (name,), ((None, None),))
    return mesh


@dataclasses.dataclass
class ParallelRuntime:
    #: this process's global rank
    rank: int
    #: processes of this runtime (the job's world, or the ``ranks`` subset)
    world_size: int
    #: where the model, batches and autocast live (``training.device`` resolved)
    device: torch.device
    dims: ParallelDims
    mesh: object | None
    dp_rank: int
    #: the process group of this runtime's ranks (None: the default group, the whole world)
    group: object | None = None
    #: the compute dtype (autocast when not float32)
    dtype: torch.dtype = torch.float32
    #: the global rank of this runtime's first rank (its main rank)
    first_rank: int = 0

    @classmethod
    def create(cls, config: ParallelConfig, *, ranks: Sequence[int] | None = None, device: str = "auto",
               dtype: torch.dtype = torch.float32) -> "ParallelRuntime | None":
        """The runtime of this process. ``ranks``: the runtime spans only these global ranks; every
        process of the job must call this (group creation is collective) and those outside get None."""
        rank, world, dev = init_distributed(device)
        members = list(range(world)) if ranks is None else list(ranks)
        check_one_gpu_per_rank(members, dev, "the trainer")  # its CUDA collectives (NCCL): one GPU per rank
        dims = config.resolve(len(members))
        group = None
        if len(members) == world:
            mesh = dims.build_mesh(dev.type)
        else:
            mesh = _sub_mesh(dims, members, dev.type)
            group = dist.new_group(ranks=members)
            if rank not in members:
                return None
        return cls(rank, len(members), dev, dims, mesh, dims.dp_rank(mesh), group=group, dtype=dtype,
                   first_rank=members[0])

    @classmethod
    def local(cls, device: str = "auto", dtype: torch.dtype = torch.float32) -> "ParallelRuntime":
        """A one-process runtime that touches no process group (a component used on its own)."""
        return cls(0, 1, resolve_device(device), ParallelConfig(dp_shard=1).resolve(1), None, 0, dtype=dtype)

    @property
    def is_main(self) -> bool:
        """The runtime's first rank (the one writing the run directory)."""
        return self.rank == self.first_rank

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device_type(self) -> str:
        return self.device.type

    pipeline: object | None = None
    context: object | None = None  # a ContextParallel when cp > 1
    #: the parallelized model (``parallelize`` sets it; pipeline: this rank's stages)
    model: nn.Module | None = None
    #: ``training.mode``: "eager" (autograd) or "graph" (captured steps; ``parallelize`` sets it)
    mode: str = "eager"
    #: graph mode: the captured steps (a ``lockstep.graph.step.GraphStep``)
    graph: object | None = None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def shard_frozen(self, model: nn.Module, config: ParallelConfig) -> nn.Module:
        """A frozen companion of the trained model (e.g. RL's KL reference) placed like it: on the
        device, under the same plan (FSDP-sharded over the same mesh), in eval mode without
        gradients; the runtime's own model, context and pipeline are left as they are. With pp > 1 the
        companion is split into the same stages, with a PipelineRunner of its own (forward-only: its
        ``eval_loss``), returned as a ModuleList of this rank's frozen stages whose ``pipeline`` attribute
        is that runner. Context parallel is refused: a companion would need its sequence shards."""
        from lockstep.parallel.parallelize import parallelize_dense

        if self.dims.cp > 1:
            raise ValueError("shard_frozen: a frozen companion model is not supported with cp > 1")
        if self.dims.pp > 1:
            from lockstep.parallel.pipeline_parallelize import stage_parallelizer

            runner = self._pipeline_runner(model, config, stage_parallelizer(self.dims, self.mesh, config, "none"))
            frozen = nn.ModuleList(runner.model_parts).eval().requires_grad_(False)
            frozen.pipeline = runner
            return frozen
        model = parallelize_dense(model.to(self.device), self.dims, self.mesh, config, "none")
        return model.eval().requires_grad_(False)

    def _pipeline_runner(self, model: nn.Module, config: ParallelConfig, parallelize_fn):
        """A PipelineRunner of ``model`` over this runtime's pipeline dim, by ``config``'s schedule and split."""
        from lockstep.parallel.pipeline import PipelineRunner

        return PipelineRunner(model.to(self.device), self.mesh["pp"], schedule=config.pp_schedule,
                              n_microbatches=config.pp_microbatches or None, parallelize_fn=parallelize_fn,
                              device=self.device, split=config.pp_split,
                              tp_mesh=self.mesh["tp"] if self.dims.tp > 1 else None,
                              ep_group=self.mesh["ep"].get_group() if self.dims.ep > 1 else None,
                              context=self.context)

    def parallelize(self, model: nn.Module, config: ParallelConfig,
                    activation_checkpoint: ActivationCheckpointConfig | str = "none", *,
                    mode: str = "eager", graph_config=None) -> nn.Module:
        """The model's plan applied for this layout (one process: activation checkpointing only).

        With pp > 1 the model is split into stages run by ``self.pipeline`` (a PipelineRunner);
        the returned module then holds this rank's stages (for the optimizer and mode switches).
        ``mode`` (``training.mode``): "graph" runs training steps as captured graphs (``graph_config``:
        the ``graph`` section), with data parallelism by traceable FSDP; dp_shard / dp_replicate only.
        """
        from lockstep.parallel.parallelize import parallelize_dense

        if mode == "graph":
            self._use_graph(graph_config, activation_checkpoint)
        model = model.to(self.device)
        if self.dims.pp == 1:
            model = parallelize_dense(model, self.dims, self.mesh, config, activation_checkpoint,
                                      traceable=mode == "graph")
            if self.dims.cp > 1:
                from lockstep.parallel.context import ContextParallel

                self.context = ContextParallel(self.mesh["cp"].get_group(), method=config.cp_method)
                self.context.install(model)
            self.model = model
            return model
        from lockstep.parallel.checkpointing import check_save_globs
        from lockstep.parallel.pipeline_parallelize import stage_parallelizer

        check_save_globs(model, activation_checkpoint)  # each stage holds only some of the blocks
        parallelize_fn = stage_parallelizer(self.dims, self.mesh, config, activation_checkpoint)
        if self.dims.cp > 1:
            parallelize_fn = self._context_stages(model, config, parallelize_fn)
        self.pipeline = self._pipeline_runner(model, config, parallelize_fn)
        self.model = nn.ModuleList(self.pipeline.model_parts)
        return self.model

    def _use_graph(self, graph_config, activation_checkpoint) -> None:
        """Graph mode's refusals (before any work), then its captured steps."""
        from lockstep import numerics
        from lockstep.graph.config import check_graph_layout
        from lockstep.graph.step import GraphStep

        d = self.dims
        check_graph_layout({"tp": d.tp, "cp": d.cp, "pp": d.pp, "ep": d.ep},
                           getattr(activation_checkpoint, "mode", activation_checkpoint), numerics.is_batch_invariant())
        self.mode, self.graph = "graph", GraphStep(graph_config, facts={"mesh": self.mesh, "dims": d})

    def _context_stages(self, model: nn.Module, config: ParallelConfig, parallelize_fn):
        """cp x pp: ``parallelize_fn`` followed by CP as the attention wrapper of each stage's layers
        (over the cp sub-mesh's group; the stage's rope then takes its shard's global positions).
        ``install`` also sets each stage's MoE layers' whole-sequence balance loss and count hooks and
        the last stage's ``mtp_context`` (MTP's shift by global position, its loss cp's parts); the
        parts are summed over cp in the report (``_pipeline_forward``)."""
        from lockstep.parallel.context import ContextParallel

        self.context = ContextParallel(self.mesh["cp"].get_group(), method=config.cp_method)

        def parallelize_stage(part: nn.Module) -> nn.Module:
            part = parallelize_fn(part) or part
            self.context.install(part)
            part.context = self.context
            return part

        return parallelize_stage

    # ------------------------------------------------------------------ the step seam

    def to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tensors on the runtime's device (the same tensors when already there: no copy on the CPU)."""
        return tuple(t.to(self.device) for t in tensors)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype on the device's type (none for float32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Cross-entropy over vocabulary-sharded logits when tensor parallel."""
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss_and_backward(self, batch, accumulate: int = 1, timer=None,
                          objective: Objective | None = None) -> StepLoss:
        """Forward + backward of one micro-batch (this data rank's share) for this layout; the
        gradient is that of ``objective``'s loss ``/ accumulate``. ``objective``: None, the LM
        objective, ``batch`` = ``(inputs, targets)`` full ``[B, T]`` (the loss + auxiliary losses).
        ``timer``: a StageTimer (stages ``forward``/``backward``; a pipeline's interleaved schedule
        is one ``forward_backward`` stage). Returns the objective's report."""
        return self._forward(batch, accumulate, timer, objective, train=True)

    @torch.no_grad()
    def loss(self, batch, objective: Objective | None = None) -> StepLoss:
        """The loss of one batch without gradients (evaluation; modules' metrics are dropped)."""
        out = self._forward(batch, 1, None, objective, train=False)
        return StepLoss(out.loss)

    def _forward(self, batch, accumulate: int, timer, objective: Objective | None, train: bool) -> StepLoss:
        stage = timer.stage if timer is not None else (lambda name: contextlib.nullcontext())
        # a tuple of tensors goes to the device here; another batch type by its own ``to(device)``
        batch = self.to_device(*batch) if isinstance(batch, (tuple, list)) else batch.to(self.device)
        if objective is not None and self.context is not None:
            raise ValueError(f"ParallelRuntime: objective {type(objective).__name__}: context parallel layouts "
                             f"run the LM objective only")
        if objective is not None and self.pipeline is not None:
            return self._objective_pipeline(objective, batch, accumulate, stage, train)
        if self.pipeline is not None:
            if self.context is not None:  # cp x pp: shard the sequences, then the schedule splits micro-batches
                batch = self.context.shard_batch(*batch)[:2]
            return self._pipeline_forward(*batch, accumulate, stage, train)
        if train and self.graph is not None:  # the captured forward + backward (lockstep.graph.step)
            objective = objective or self.graph.default_objective(LMObjective)
            with self.loss_context(), stage("forward_backward"):
                return self.graph.step(self.model, objective, batch, accumulate, self.autocast, self.dtype)
        if objective is None:
            objective = LMObjective(self.context)
        with self.loss_context():
            with stage("forward"), self.autocast():
                loss, report = objective(self.model, batch)
                loss = loss / accumulate
            if train:
                with stage("backward"):
                    loss.backward()
        return report

    def _pipeline_forward(self, inputs, targets, accumulate: int, stage, train: bool) -> StepLoss:
        """The schedule's step on this rank's stages. The loss exists on the last stage's rank only
        (None elsewhere; ``StepScalars`` averages over the ranks holding it); every rank reports its
        own stages' auxiliary losses (MoE balance, MTP: already in the gradients, see
        ``pipeline_stage``) and module metrics, averaged over the micro-batches."""
        with stage("forward_backward" if train else "forward"), self.autocast(), self.loss_context():
            if train:
                local = self.pipeline.step(inputs, targets, loss_scale=1.0 / accumulate)
            else:
                local = self.pipeline.eval_loss(inputs, targets)
        report = self.pipeline.report()
        aux = dict(report.aux_losses)
        if self.context is not None:  # this rank's parts of the whole-sequence values: summed over cp
            aux = self.context.report_auxiliary(aux)
        # a detached float64 tensor on the device (None off the last stage)
        return StepLoss(local, aux, dict(report.metrics))

    def _objective_pipeline(self, objective, batch, accumulate: int, stage, train: bool) -> StepLoss:
        """Another objective through the schedule: its ``pipeline_batch(pipeline, batch) -> (inputs,
        target)`` (the schedule splits both on dim 0), ``pipeline_loss(logits, target)`` on the last stage
        per schedule micro-batch (losses that add up to the batch's), and ``pipeline_report(pipeline,
        batch, loss)`` afterwards (the report; None loss off the last stage)."""
        if not callable(getattr(objective, "pipeline_batch", None)):
            raise ValueError(f"ParallelRuntime: objective {type(objective).__name__} has no pipeline half "
                             f"(pipeline_batch, pipeline_loss, pipeline_report): a pipeline runs the LM objective only")
        with self.autocast():  # a frozen companion may score first (forward-only, through its own pipeline)
            inputs, target = objective.pipeline_batch(self.pipeline, batch)
        with stage("forward_backward" if train else "forward"), self.autocast(), self.loss_context():
            if train:
                local = self.pipeline.step(inputs, target, loss_scale=1.0 / accumulate, loss_fn=objective.pipeline_loss)
            else:
                local = self.pipeline.eval_loss(inputs, target, loss_fn=objective.pipeline_loss)
        return objective.pipeline_report(self.pipeline, batch, local)

    def scalars(self) -> StepScalars:
        """An accumulator of a step's scalars, reduced over this runtime's ranks in one collective."""
        return StepScalars(self.device, group=self.group, distributed=self.distributed,
                           gather_names=self.pipeline is not None)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Gradient sync (cp sums, ep scaling), clipping to ``max_norm`` (inf: none), the optimizer
        step, ``zero_grad`` and the model's per-step hook; returns the norm before clipping (a tensor).
        :meth:`clip_gradients` then :meth:`apply_step` (or :meth:`drop_step`) are its two halves, for a
        loop that decides between them (a non-finite step)."""
        grad_norm = self.clip_gradients(max_norm)
        self.apply_step(optimizer)
        return grad_norm

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Gradient sync (cp sums, ep scaling) and clipping to ``max_norm`` (inf: none); returns the
        global norm before clipping (a tensor, the same on every rank; no host read here)."""
        model = self.model
        if self.pipeline is not None:
            self.pipeline.reduce_shared_grads()  # the embedding copies of the first and last stage
        self.sync_context_grads(model)
        self.after_backward(model)
        return self.clip_grad_norm(model, max_norm)

    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step on the clipped gradients, ``zero_grad`` and the model's per-step hook."""
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.after_optimizer_step(self.model)

    def drop_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Discard this step's gradients without updating the weights or the optimizer state (the
        model's per-step hook still runs, so its pending per-step state does not carry over)."""
        optimizer.zero_grad(set_to_none=True)
        self.after_optimizer_step(self.model)

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Once per optimizer step, outside any forward: the model's ``after_optimizer_step()`` (the
        MoE routers' pending selection-bias updates), or, for a module without it (a pipeline rank's
        stages), those updates directly. A collective under data parallelism (expert counts are
        summed over the data-parallel ranks)."""
        hook = getattr(model, "after_optimizer_step", None)
        if callable(hook):
            hook()
            return
        from lockstep.models.common.moe import apply_routing_updates

        apply_routing_updates(model)

    def after_backward(self, model: nn.Module) -> None:
        """Expert gradients sum every ep rank's tokens; scale them to the mean loss's gradient
        (FSDP already averages the rest)."""
        if self.dims.ep > 1:
            from lockstep.parallel.expert import expert_parameters

            for p in expert_parameters(model):
                if p.grad is not None:
                    p.grad.div_(self.dims.ep_data_ranks)

    def sync_context_grads(self, model: nn.Module) -> None:
        """cp ranks each backpropagate their share of one sequence's loss: sum their gradients."""
        if self.context is not None:
            params = list(model.parameters())
            if self.dims.ep_spans_cp:  # cp peers own other experts: expert gradients are not summed over cp
                from lockstep.parallel.expert import expert_parameters

                experts = {id(p) for p in expert_parameters(model)}
                params = [p for p in params if id(p) not in experts]
            self.context.all_reduce_grads(params)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(max_norm)
        if self.dims.ep > 1:
            from lockstep.parallel.expert import clip_grad_norm_expert_parallel

            return clip_grad_norm_expert_parallel(model, max_norm, self.mesh["ep"])
        from lockstep.parallel.grad import clip_grad_norm

        return clip_grad_norm(model.parameters(), max_norm)

    # ------------------------------------------------------------------ state and records

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Unsharded parameters on the CPU, on the runtime's first rank (collective over its ranks)."""
        if not self.distributed:
            return {k: v.cpu() for k, v in model.state_dict().items()}
        if self.pipeline is not None:
            return self.pipeline.full_state_dict(self.group)
        from lockstep.parallel.flex import flex_state

        if flex_state(model) is not None:
            from lockstep.parallel.flex.state import full_state_dict

            return full_state_dict(model, self.is_main)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dims.ep > 1:
            from lockstep.parallel.expert import gather_full_experts

            state.update({k: v.cpu() for k, v in gather_full_experts(model, self.mesh["ep"]).items()})
        return state

    def _experts_layout(self) -> str | None:
        from lockstep.parallel.fsdp import expert_mesh

        d = self.dims
        if d.ep == 1:
            return None
        if self.mesh is not None and expert_mesh(self.mesh, d) is not None:
            return (f"routed experts split over ep={d.ep}, FSDP-sharded over dp_shard_mod_ep={d.dp_shard // d.ep}"
                    + (f", replicated over dp_replicate={d.dp_replicate}" if d.dp_replicate > 1 else ""))
        return f"routed experts split over ep={d.ep}, outside FSDP"

    def _sharding(self) -> dict | str | None:
        """The data-parallel sharding: "fsdp2", or FlexShard's buckets (placement, #params, bytes per rank)."""
        from lockstep.parallel.flex import flex_state

        flex = flex_state(self.model) if self.model is not None else None
        if flex is not None:
            return flex.describe()
        return "fsdp2" if self.dims.dp > 1 else None

    def describe(self, family: str | None = None, config: ParallelConfig | None = None, images: bool = False) -> dict:
        from lockstep.parallel.dist_moe import describe_dispatch
        from lockstep.parallel.tested_layouts import matching_parity_test

        d = self.dims
        parity = None
        if family is not None and config is not None and self.distributed:
            parity = matching_parity_test({"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp,
                                           "ep": d.ep, "pp": d.pp, "cp": d.cp}, family,
                                          config.pp_schedule, config.cp_method, images)
        sharding = self._sharding()
        if parity is not None and isinstance(sharding, dict):  # FlexShard: proven equal to FSDP2 separately
            parity = (f"{parity} (FSDP2) + tests/parallel/test_flex_shard.py::test_flex_matches_fsdp2_world{d.dp}"
                      if d.dp in (2, 4) else None)
        return {
            "parity_test": parity or ("untested layout for this family" if self.distributed else None),
            "world_size": self.world_size,
            "device": self.device_type,
            "backend": dist.get_backend(self.group) if dist.is_initialized() else None,
            "degrees": {"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard, "tp": self.dims.tp,
                        "ep": self.dims.ep, "pp": self.dims.pp, "cp": self.dims.cp},
            "context_parallel": {"method": self.context.method, "load_balance": "chunks r and 2cp-1-r"}
            if self.context is not None else None,
            "pipeline": {"schedule": self.pipeline.schedule_name, "n_stages": self.pipeline.n_stages,
                         "layers_per_stage": list(self.pipeline.stage_layers),
                         "split": config.pp_split if config is not None else None,
                         "stages_on_this_rank": list(self.pipeline.stage_ids)} if self.pipeline is not None else None,
            "experts": self._experts_layout(),
            "expert_dispatch": describe_dispatch(config) if d.ep > 1 and config is not None else None,
            "mesh": [list(n) for n in self.dims.mesh_dims],
            "fsdp_units": "each transformer block + root" if self.dims.dp > 1 else None,
            "sharding": sharding,
            "tp_plan": "megatron col/row + sequence-parallel norms + loss-parallel head" if self.dims.tp > 1 else None,
        }

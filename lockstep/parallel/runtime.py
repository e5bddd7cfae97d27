"""What a trainer needs to know about its place in a distributed job, in one object.

``ParallelRuntime.create(config)`` initialises the process group (when launched by torchrun),
resolves the degrees and builds the mesh; then it parallelizes a model with its family's plan,
averages scalars over data-parallel ranks, and gathers full state dicts for rank 0 to write.
A single process gets the same object with world 1 and does nothing extra.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.parallel.dims import ParallelConfig, ParallelDims
from lockstep.parallel.launch import init_distributed


@dataclasses.dataclass
class ParallelRuntime:
    rank: int
    world_size: int
    device_type: str
    dims: ParallelDims
    mesh: object | None
    dp_rank: int

    @classmethod
    def create(cls, config: ParallelConfig) -> "ParallelRuntime":
        rank, world, device_type = init_distributed()
        dims = config.resolve(world)
        mesh = dims.build_mesh(device_type)
        return cls(rank, world, device_type, dims, mesh, dims.dp_rank(mesh))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    pipeline: object | None = None
    context: object | None = None  # a ContextParallel when cp > 1

    def parallelize(self, model: nn.Module, config: ParallelConfig, activation_checkpoint: str = "none") -> nn.Module:
        """The model's plan applied for this layout (one process: activation checkpointing only).

        With pp > 1 the model is split into stages run by ``self.pipeline`` (a PipelineRunner);
        the returned module then holds this rank's stages (for the optimizer and mode switches).
        """
        from lockstep.parallel.parallelize import parallelize_dense

        if self.dims.pp == 1:
            model = parallelize_dense(model, self.dims, self.mesh, config, activation_checkpoint)
            if self.dims.cp > 1:
                from lockstep.parallel.context import ContextParallel

                self.context = ContextParallel(self.mesh["cp"].get_group(), method=config.cp_method)
                self.context.install(model)
            return model
        from lockstep.parallel.checkpointing import apply_activation_checkpointing
        from lockstep.parallel.fsdp import apply_fsdp, dp_mesh
        from lockstep.parallel.pipeline import PipelineRunner

        def parallelize_stage(part: nn.Module) -> nn.Module:
            apply_activation_checkpointing(part, activation_checkpoint)
            if self.dims.dp > 1:
                apply_fsdp(part, list(part.layers.values()), dp_mesh(self.mesh, self.dims), config.fsdp_param_dtype,
                           config.reshard_after_forward)
            return part

        self.pipeline = PipelineRunner(model, self.mesh["pp"], schedule=config.pp_schedule,
                                       n_microbatches=config.pp_microbatches or None,
                                       parallelize_fn=parallelize_stage)
        return nn.ModuleList(self.pipeline.model_parts)

    def after_backward(self, model: nn.Module) -> None:
        """Expert gradients sum every ep rank's tokens; scale them to the mean loss's gradient
        (FSDP already averages the rest)."""
        if self.dims.ep > 1:
            from lockstep.parallel.expert import expert_parameters

            for p in expert_parameters(model):
                if p.grad is not None:
                    p.grad.div_(self.dims.ep)

    def sync_context_grads(self, model: nn.Module) -> None:
        """cp ranks each backpropagate their share of one sequence's loss: sum their gradients."""
        if self.context is not None:
            self.context.all_reduce_grads(model.parameters())

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(max_norm)
        if self.dims.ep > 1:
            from lockstep.parallel.expert import clip_grad_norm_expert_parallel

            return clip_grad_norm_expert_parallel(model, max_norm, self.mesh["ep"])
        from lockstep.parallel.grad import clip_grad_norm

        return clip_grad_norm(model.parameters(), max_norm)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Cross-entropy over vocabulary-sharded logits when tensor parallel."""
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def mean_over_dp(self, value: torch.Tensor | float) -> float:
        """Average a per-rank scalar over all ranks (TP ranks hold equal copies, so this is the dp mean)."""
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if not self.distributed:
            return float(value)
        t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
        dist.all_reduce(t)
        return float(t) / self.world_size

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Unsharded parameters on CPU (collective: every rank must call it)."""
        if not self.distributed:
            return model.state_dict()
        if self.pipeline is not None:
            return self.pipeline.full_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dims.ep > 1:
            from lockstep.parallel.expert import gather_full_experts

            state.update({k: v.cpu() for k, v in gather_full_experts(model, self.mesh["ep"]).items()})
        return state

    def describe(self, family: str | None = None, config: ParallelConfig | None = None) -> dict:
        from lockstep.parallel.tested_layouts import matching_parity_test

        d = self.dims
        parity = None
        if family is not None and config is not None and self.distributed:
            parity = matching_parity_test({"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp,
                                           "ep": d.ep, "pp": d.pp, "cp": d.cp}, family,
                                          config.pp_schedule, config.cp_method)
        return {
            "parity_test": parity or ("untested layout for this family" if self.distributed else None),
            "world_size": self.world_size,
            "device": self.device_type,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "degrees": {"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard, "tp": self.dims.tp,
                        "ep": self.dims.ep, "pp": self.dims.pp, "cp": self.dims.cp},
            "context_parallel": {"method": self.context.method, "load_balance": "chunks r and 2cp-1-r"}
            if self.context is not None else None,
            "pipeline": {"schedule": self.pipeline.schedule_name, "n_stages": self.pipeline.n_stages,
                         "stages_on_this_rank": list(self.pipeline.stage_ids)} if self.pipeline is not None else None,
            "experts": f"routed experts split over ep={self.dims.ep}, outside FSDP" if self.dims.ep > 1 else None,
            "mesh": [list(n) for n in self.dims.mesh_dims],
            "fsdp_units": "each transformer block + root" if self.dims.dp > 1 else None,
            "tp_plan": "megatron col/row + sequence-parallel norms + loss-parallel head" if self.dims.tp > 1 else None,
        }

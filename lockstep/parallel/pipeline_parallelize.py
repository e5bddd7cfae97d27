"""The families' parallelize plan applied to one pipeline stage: EP, TP, activation checkpointing, FSDP.

The same pieces, in the same order, as :func:`lockstep.parallel.parallelize.parallelize_dense`
applies to a whole model, on a :class:`~lockstep.parallel.pipeline_stage.PipelineStageModule`:

- routers' bias-update counts summed over the data-parallel ranks (each stage's own routers);
- expert parallel on the stage's MoE layers (a stage without any -- DeepSeek-V3's dense first
  layers -- has nothing to shard);
- the TP plan (GQA/MLA attention, SwiGLU/MoE, MTP); plan keys of pieces the stage does not hold
  (the head on the first stage, the embedding on a middle one) are skipped. A stage with MTP heads
  keeps its residual stream as DTensors (as the whole model does under TP), so its received hidden
  states are wrapped back into sequence-sharded DTensors (``residual_mesh``);
- activation checkpointing, then FSDP2 with the rank-local experts left out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from lockstep.parallel.checkpointing import ActivationCheckpointConfig, apply_activation_checkpointing
from lockstep.parallel.dims import ParallelConfig, ParallelDims
from lockstep.parallel.expert import apply_expert_parallel, expert_parameters, moe_layers
from lockstep.parallel.fsdp import apply_fsdp, dp_mesh, expert_mesh


def stage_parallelizer(dims: ParallelDims, mesh, config: ParallelConfig,
                       activation_checkpoint: ActivationCheckpointConfig | str = "none"
                       ) -> Callable[[nn.Module], nn.Module]:
    """``parallelize_fn`` for :class:`~lockstep.parallel.pipeline.PipelineRunner` under ``dims``.
    A stage holds only some blocks: save globs are checked against the whole model before the split
    (:func:`~lockstep.parallel.checkpointing.check_save_globs`), not per stage."""
    from lockstep.parallel.parallelize import _share_expert_counts, apply_dense_tp

    def parallelize_stage(part: nn.Module) -> nn.Module:
        cfg = part.config
        dims.check_model(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size)
        _share_expert_counts(part, dims, mesh)
        if dims.ep > 1 and moe_layers(part):
            apply_expert_parallel(part, mesh["ep"], config.ep_chunks, config.ep_capacity_factor)
        if dims.tp > 1:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Parallelize plan key")
                apply_dense_tp(part, mesh["tp"])
            if part.mtp is not None:
                part.residual_mesh = mesh["tp"]
        experts_mesh = expert_mesh(mesh, dims)  # experts FSDP over dp_shard_mod_ep (x dp_replicate), or local
        ignored = set(expert_parameters(part)) if dims.ep > 1 and experts_mesh is None else None
        apply_activation_checkpointing(part, activation_checkpoint, strict=False)
        if dims.dp > 1:
            apply_fsdp(part, list(part.layers.values()), dp_mesh(mesh, dims), config.fsdp_param_dtype,
                       config.reshard_after_forward, ignored_params=ignored or None, experts_mesh=experts_mesh)
        return part

    return parallelize_stage

"""The parallelize plan of the decoder families: TP/SP layout, expert parallelism and FSDP units.

Applied from outside the model (the model never sees a mesh). TP follows the Megatron
split (q/k/v and w1/w3 column-wise, wo and w2 row-wise) with sequence parallel norms between, the
embedding output sharded on the sequence, and the head's logits left sharded on the vocabulary for
loss-parallel cross-entropy. MLA attention, MoE feed-forwards (expert TP, with or without ep) and
DeepSeek's MTP layers take the plans of :mod:`lockstep.parallel.tp_blocks`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lockstep.config.base import ConfigError
from lockstep.models.common.attention import GroupedQueryAttention
from lockstep.models.common.gated_attention import GatedAttention
from lockstep.models.common.gated_deltanet import GatedDeltaNet
from lockstep.models.common.mla import MultiHeadLatentAttention
from lockstep.models.common.mlp import SwiGLU
from lockstep.models.common.moe import MoE
from lockstep.parallel.checkpointing import ActivationCheckpointConfig, apply_activation_checkpointing
from lockstep.parallel.dims import ParallelConfig, ParallelDims
from lockstep.parallel.expert import apply_expert_parallel, expert_parameters
from lockstep.parallel.fsdp import DTYPES, apply_fsdp, dp_mesh, expert_mesh
from lockstep.parallel.tp_blocks import (check_tp_divides, gated_deltanet_plan, install_mla_hooks, install_moe_tp,
                                        install_mtp_tp, mla_plan, moe_plan, replicate_auxiliary_losses, sinks_tp)
from lockstep.parallel.visual import apply_visual_sequence_parallel


def apply_dense_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> None:
    """The TP plan of every block kind: GQA or MLA attention, SwiGLU or MoE feed-forward (MLA, MoE
    and MTP pieces from :mod:`lockstep.parallel.tp_blocks`). Refuses other block kinds.

    ``sequence_parallel=False`` (generation, :mod:`lockstep.generate.parallel`): the residual stream
    is replicated (plain tensors) instead of sharded on the sequence, norms stay plain replicated
    modules, each row-parallel output is all-reduced, and the head's logits are gathered whole on
    every rank; the heads / hidden dims / experts are split exactly as in training. Gated DeltaNet
    layers have the sequence-parallel plan only."""
    _require_tp_blocks(model)
    check_tp_divides(model, tp_mesh.size())
    mtp = getattr(model, "mtp", None)
    # MTP slices the embeddings and final hidden states along the sequence: keep the residual stream
    # as DTensors so those are slices of the whole sequence, not of this rank's shard
    residual_dtensor = mtp is not None and sequence_parallel
    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=not residual_dtensor),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
    else:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        })
    for block in model.layers.values():
        _apply_block_tp(block, tp_mesh, residual_dtensor, sequence_parallel)
    for layer in (mtp.values() if mtp is not None else ()):
        _apply_block_tp(layer.block, tp_mesh, residual_dtensor, sequence_parallel)
        if sequence_parallel:  # without it the MTP layer's inputs are already whole (replicated)
            install_mtp_tp(layer, tp_mesh)
    if sequence_parallel:
        replicate_auxiliary_losses(model, tp_mesh)
    # Both the embedding (row-wise) and the head (column-wise) shard the vocabulary dim, so a tied
    # pair stays one parameter: re-tie, since each parallelize call made its own DTensor.
    if model.config.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # (a pipeline stage may hold only one of them)


def _apply_block_tp(block: nn.Module, tp_mesh, residual_dtensor: bool, sequence_parallel: bool = True) -> None:
    local = not residual_dtensor
    # the residual stream between blocks: sharded on the sequence (training) or replicated (generation)
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()} if sequence_parallel else {}
    if isinstance(block.attention, MultiHeadLatentAttention):
        plan.update(mla_plan(block, sequence_parallel=sequence_parallel))
        plan["attention.wo"] = RowwiseParallel(output_layouts=residual, use_local_output=local)
        install_mla_hooks(block.attention, tp_mesh)
    elif isinstance(block.attention, GatedDeltaNet):
        if not sequence_parallel:
            raise ConfigError("parallel.tp: Gated DeltaNet (linear attention) layers have a sequence-parallel "
                              "tensor-parallel plan only (training); not for generation")
        plan.update(gated_deltanet_plan(block, tp_mesh, local))
    else:  # GQA, output-gated (wq's rows [query | gate] per head) or with GPT-OSS biases and sinks
        sinks_tp(block.attention, tp_mesh)
        plan.update({
            "attention": PrepareModuleInput(input_layouts=(residual, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual, use_local_output=local),
        })
        if block.attention.q_norm is not None:
            # q/k norms act per head on [B, T, heads, D]: heads are sharded, the weight is shared,
            # so treat the head dim like a sequence dim (replicated weight, reduced gradient).
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if isinstance(block.feed_forward, MoE):
        plan.update(moe_plan(shared=block.feed_forward.shared_experts is not None, residual_dtensor=residual_dtensor,
                             sequence_parallel=sequence_parallel))
        install_moe_tp(block.feed_forward, tp_mesh)
    else:
        plan.update({
            "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual, use_local_output=local),
            "feed_forward.w3": ColwiseParallel(),
        })
    parallelize_module(block, tp_mesh, plan)


def _share_expert_counts(model: nn.Module, dims: ParallelDims, mesh) -> None:
    """Routers are replicated over data-parallel ranks that see different tokens: their
    aux-loss-free bias updates must use the counts summed over those ranks."""
    if not dims.data_dims:
        return
    import torch.distributed as dist

    group_mesh = mesh["dp"] if len(dims.data_dims) > 1 else mesh[dims.data_dims[0]]
    group = group_mesh.get_group()

    def reduce(counts):
        total = counts.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    for module in model.modules():
        if hasattr(module, "reduce_counts"):
            module.reduce_counts = reduce


def _require_tp_blocks(model: nn.Module) -> None:
    attention = (GroupedQueryAttention, GatedAttention, GatedDeltaNet, MultiHeadLatentAttention)
    blocks = dict(model.layers.items())
    blocks.update({f"mtp.{k}.block": layer.block for k, layer in (getattr(model, "mtp", None) or {}).items()})
    for name, block in blocks.items():
        # exact types: a subclass (e.g. gated attention) may project differently than the plan assumes
        if type(block.attention) not in attention or type(block.feed_forward) not in (SwiGLU, MoE):
            raise ConfigError(
                f"parallel.tp: the tensor-parallel plan covers GQA or MLA attention + SwiGLU or MoE blocks; "
                f"{name if name.startswith('mtp') else 'layers.' + name} has {type(block.attention).__name__} + "
                f"{type(block.feed_forward).__name__} ({model.config.family}); use dp_shard/dp_replicate for this family"
            )


def parallelize_dense(model: nn.Module, dims: ParallelDims, mesh, config: ParallelConfig,
                      activation_checkpoint: ActivationCheckpointConfig | str = "none", *,
                      traceable: bool = False) -> nn.Module:
    """Apply TP (if tp > 1), activation checkpointing, then FSDP2 (if dp > 1), in place.

    The order matters: TP plans name modules inside blocks (before AC wraps them), and FSDP units
    must be the (wrapped) blocks. ``traceable`` (the graph trainer): data parallelism by
    :mod:`lockstep.graph.simple_fsdp` instead of FSDP2 (the same sharded parameters, gathered by
    functional collectives a capture records); dp_shard / dp_replicate only.
    """
    cfg = model.config
    dims.check_model(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size)
    if traceable:
        return _parallelize_traceable(model, dims, mesh, config, activation_checkpoint)
    _share_expert_counts(model, dims, mesh)
    expert_params: set[nn.Parameter] | None = None
    if dims.ep > 1:
        # experts split over ep; FSDP over the ranks holding the same experts (dp_shard_mod_ep x
        # dp_replicate), or kept out of FSDP when there are none (ep == dp_shard: each owns its slice)
        apply_expert_parallel(model, mesh["ep"], config.ep_chunks, config.ep_capacity_factor)
    if dims.tp > 1:  # after ep: expert TP splits each ep rank's experts on their hidden dim
        apply_dense_tp(model, mesh["tp"])
        apply_visual_sequence_parallel(model, mesh["tp"])  # images: each rank's share of the sequence
    experts_mesh = expert_mesh(mesh, dims)
    if dims.ep > 1 and experts_mesh is None:
        expert_params = set(expert_parameters(model))
    apply_activation_checkpointing(model, activation_checkpoint)
    if dims.dp > 1 and config.sharding == "flex":
        from lockstep.parallel.flex import buckets_from_config, flex_shard

        if getattr(activation_checkpoint, "mode", activation_checkpoint) == "regions":
            # a torch_remat replay calls the block's forward without its module hooks: no gathered weights
            raise ConfigError("parallel.sharding: flex supports training.activation_checkpoint modes none, full "
                              "and selective, not regions")

        flex_shard(model, buckets_from_config(config, model), mesh, param_dtype=DTYPES[config.fsdp_param_dtype],
                   reshard_after_forward=config.reshard_after_forward)
    elif dims.dp > 1:
        apply_fsdp(model, list(model.layers.values()), dp_mesh(mesh, dims), config.fsdp_param_dtype,
                   config.reshard_after_forward, ignored_params=expert_params, experts_mesh=experts_mesh)
    return model


def _parallelize_traceable(model: nn.Module, dims: ParallelDims, mesh, config: ParallelConfig,
                           activation_checkpoint: ActivationCheckpointConfig | str) -> nn.Module:
    """Activation checkpointing, then traceable FSDP over the data-parallel mesh (if dp > 1)."""
    from lockstep.graph.simple_fsdp import simple_fsdp

    if config.sharding == "flex":
        raise ConfigError("parallel.sharding: flex is eager only; training.mode=graph shards by the traceable "
                          "FSDP (use sharding='fsdp2')")
    for name in ("tp", "ep", "cp", "pp"):
        if getattr(dims, name) > 1:
            raise ConfigError(f"parallel.{name}: training.mode=graph (traceable FSDP) supports dp_shard and "
                              f"dp_replicate only, got {name}={getattr(dims, name)}")
    _share_expert_counts(model, dims, mesh)
    apply_activation_checkpointing(model, activation_checkpoint)
    if dims.dp > 1:
        simple_fsdp(model, dp_mesh(mesh, dims), DTYPES[config.fsdp_param_dtype], reduce_dtype=torch.float32)
    return model

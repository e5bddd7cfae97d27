"""The parallelize plan of the dense decoder (llama3, qwen3): TP/SP layout and FSDP units.

Applied from outside the model (the model never sees a mesh). TP follows the Megatron
split (q/k/v and w1/w3 column-wise, wo and w2 row-wise) with sequence parallel norms between, the
embedding output sharded on the sequence, and the head's logits left sharded on the vocabulary for
loss-parallel cross-entropy.
"""

from __future__ import annotations

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
from lockstep.models.common.mlp import SwiGLU
from lockstep.parallel.checkpointing import apply_activation_checkpointing
from lockstep.parallel.dims import ParallelConfig, ParallelDims
from lockstep.parallel.expert import apply_expert_parallel, expert_parameters
from lockstep.parallel.fsdp import apply_fsdp, dp_mesh


def apply_dense_tp(model: nn.Module, tp_mesh) -> None:
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if block.attention.q_norm is not None:
            # q/k norms act per head on [B, T, heads, D]: heads are sharded, the weight is shared,
            # so treat the head dim like a sequence dim (replicated weight, reduced gradient).
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
    # Both the embedding (row-wise) and the head (column-wise) shard the vocabulary dim, so a tied
    # pair stays one parameter: re-tie, since each parallelize call made its own DTensor.
    if model.config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight


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


def _require_dense_blocks(model: nn.Module) -> None:
    for name, block in model.layers.items():
        if not isinstance(block.attention, GroupedQueryAttention) or not isinstance(block.feed_forward, SwiGLU):
            raise ConfigError(
                f"parallel.tp: the tensor-parallel plan covers GQA attention + SwiGLU blocks; layers.{name} "
                f"has {type(block.attention).__name__} + {type(block.feed_forward).__name__} "
                f"({model.config.family}); use dp_shard/dp_replicate for this family"
            )


def parallelize_dense(model: nn.Module, dims: ParallelDims, mesh, config: ParallelConfig,
                      activation_checkpoint: str = "none") -> nn.Module:
    """Apply TP (if tp > 1), activation checkpointing, then FSDP2 (if dp > 1), in place.

    The order matters: TP plans name modules inside blocks (before AC wraps them), and FSDP units
    must be the (wrapped) blocks.
    """
    cfg = model.config
    dims.check_model(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size)
    _share_expert_counts(model, dims, mesh)
    expert_params: set[nn.Parameter] | None = None
    if dims.ep > 1:
        # experts split over ep and kept out of FSDP (each ep rank owns its slice whole)
        apply_expert_parallel(model, mesh["ep"])
        expert_params = set(expert_parameters(model))
    if dims.tp > 1:
        _require_dense_blocks(model)
        apply_dense_tp(model, mesh["tp"])
    apply_activation_checkpointing(model, activation_checkpoint)
    if dims.dp > 1:
        apply_fsdp(model, list(model.layers.values()), dp_mesh(mesh, dims), config.fsdp_param_dtype,
                   config.reshard_after_forward, ignored_params=expert_params)
    return model

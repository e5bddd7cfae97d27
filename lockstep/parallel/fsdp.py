"""FSDP2 (``fully_shard``) over the data-parallel mesh dims: one unit per block plus the root.

Under expert parallel with ep < dp_shard or with replicas (EP that borrows part of the
data-parallel ranks), each rank's routed experts are data-parallel over the ranks holding the same
experts -- ``dp_shard_mod_ep`` (sharded) x ``dp_replicate`` (replicated): each MoE layer's experts
are their own FSDP unit on that mesh (:func:`expert_mesh`), inside their block's unit. FSDP then
averages their gradients over those ``dp / ep`` ranks; the remaining ``1 / ep`` (a local expert's
gradient already sums every ep rank's tokens) is the runtime's ``after_backward``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dp_mesh(mesh, dims):
    """The sub-mesh FSDP shards over: (dp_replicate, dp_shard) for HSDP, else the one dp dim
    (``dp_shard`` is the flattened (dp_shard_mod_ep, ep) under expert parallel)."""
    names = [n for n in ("dp_replicate", "dp_shard") if n in dims.data_dims or (n == "dp_shard" and dims.ep > 1)]
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def expert_mesh(mesh, dims):
    """The mesh the expert-parallel experts are FSDP-sharded over: (dp_replicate, dp_shard_mod_ep)
    (HSDP) or dp_shard_mod_ep; None when every data-parallel rank of an ep group holds different
    experts (ep == dp_shard, no replicas: the experts stay out of FSDP) or without ep over dp_shard."""
    names = dict(dims.mesh_dims)
    if dims.ep == 1 or "dp_shard_mod_ep" not in names:
        return None
    if dims.dp_replicate == 1 and names["dp_shard_mod_ep"] == 1:
        return None
    return mesh[("dp_replicate", "dp_shard_mod_ep")] if dims.dp_replicate > 1 else mesh["dp_shard_mod_ep"]


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh, param_dtype: str,
               reshard_after_forward: str, ignored_params: set[nn.Parameter] | None = None,
               experts_mesh=None) -> None:
    """Shard each block, then the root (embeddings, final norm, head); ``ignored_params`` stay local.
    ``experts_mesh`` (:func:`expert_mesh`): every expert-parallel experts module becomes its own unit
    on that mesh first (the blocks' units then leave its parameters to it)."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    if experts_mesh is not None:
        from lockstep.parallel.expert import expert_modules

        for _, experts in expert_modules(model):
            fully_shard(experts, mesh=experts_mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward != "never")
    for i, block in enumerate(blocks):
        if reshard_after_forward == "except_last":
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward == "always",
                ignored_params=ignored_params)

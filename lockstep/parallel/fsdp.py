"""FSDP2 (``fully_shard``) over the data-parallel mesh dims: one unit per block plus the root."""

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


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh, param_dtype: str,
               reshard_after_forward: str, ignored_params: set[nn.Parameter] | None = None) -> None:
    """Shard each block, then the root (embeddings, final norm, head); ``ignored_params`` stay local."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        if reshard_after_forward == "except_last":
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward == "always",
                ignored_params=ignored_params)

"""Traceable FSDP: parameters stored sharded, gathered by functional collectives that a capture records.

FSDP2 (``lockstep.parallel.fsdp``) gathers and reduces parameters from module hooks with async
collectives on side streams; ``make_fx`` cannot trace those. Here (the idea of TorchTitan's SimpleFSDP)
each parameter is stored as FSDP2 stores it -- a DTensor ``Shard(0)`` over the data-parallel mesh
(``(Replicate(), Shard(0))`` for HSDP), so the optimizer, gradient clipping, checkpoints and
``full_state_dict`` see what they see under FSDP2, under the same names -- and reading it as a module
attribute (``linear.weight``) returns the full tensor, computed from the local shard by
:class:`_GatherShard`:

- forward: cast to the FSDP ``param_dtype``, pad dim 0 to ``ceil(rows / shards)`` rows, one
  ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``, cut the padding;
- backward: cast the gradient to ``reduce_dtype`` (fp32), pad, ``reduce_scatter_tensor`` with "avg"
  (+ ``all_reduce`` "avg" over the replicas under HSDP), keep this rank's rows -- the ops and reduce
  ops FSDP2 uses for fp32/bf16 gradients, so the sharded gradient is FSDP2's mean over dp.

Under capture (``lockstep.graph.capture``: parameters substituted by their local shards) the same
attribute read records those collectives as graph nodes, which ``lockstep.graph.passes.bucketing``
buckets per block and reorders for overlap, and ``lockstep.graph.passes.reshard`` gathers again in the
backward (FSDP's reshard after forward). Eager forwards work too (the collectives run at once).

Gradients equal the per-rank autograd gradients averaged over dp (bitwise, measured). FSDP2 agrees
bitwise on llama3, qwen3_moe, qwen3_next and gpt_oss; on deepseek_v3 (whose embedding output also feeds
MTP) FSDP2's own embedding gradient is 4e-9 off that average at step 1 (summation order, not
located further), so losses there agree within 1e-6 after 3 steps, not bitwise.

Within one forward of the parallelized root module each parameter is gathered once (a tied embedding
and head share one gather, so their gradients are summed before the reduce-scatter, as under FSDP2);
a read outside a root forward (activation checkpointing's recompute, ``model.trunk`` called directly)
gathers again. Every read is a collective: code that reads a parameter attribute on some ranks only
must use :func:`sharded_parameters` (then attributes are the stored DTensors, as outside an FSDP2 unit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lockstep.config.base import ConfigError
from lockstep.parallel.param_properties import swap_in_properties


def _functional_ops():
    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None or not hasattr(ops, "all_gather_into_tensor") or not hasattr(ops, "wait_tensor"):
        raise RuntimeError(f"traceable FSDP needs torch.ops._c10d_functional (all_gather_into_tensor, "
                           f"reduce_scatter_tensor, wait_tensor), which torch {torch.__version__} lacks")
    return ops


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter is sharded and gathered (kept on its module: under capture the parameter
    slot holds a plain local tensor with no DTensor spec)."""

    #: dim 0 of the full parameter
    rows: int
    #: ranks the parameter is sharded over, and their process group's name (1 / "": not sharded)
    shards: int
    shard_group: str
    #: HSDP replicas (gradients averaged over them too) and their group's name ("": none)
    replicate_group: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype

    @property
    def padded_rows(self) -> int:
        """Rows of one padded shard (``torch.chunk``'s chunk size, what Shard(0) uses)."""
        return math.ceil(self.rows / self.shards)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


class _GatherShard(torch.autograd.Function):
    """local shard -> full parameter (all-gather); gradient: full -> local (reduce-scatter, mean)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        ops = _functional_ops()
        ctx.spec, ctx.local_rows, ctx.local_dtype = spec, local.shape[0], local.dtype
        x = local if spec.param_dtype is None else local.to(spec.param_dtype)
        if spec.shards == 1:
            return x.clone() if x is local else x
        x = _pad_rows(x, spec.padded_rows).contiguous()
        full = ops.wait_tensor(ops.all_gather_into_tensor(x, spec.shards, spec.shard_group))
        return full if full.shape[0] == spec.rows else full[:spec.rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ops = _functional_ops()
        spec: ShardSpec = ctx.spec
        g = grad.to(spec.reduce_dtype)
        if spec.shards > 1:
            g = _pad_rows(g, spec.padded_rows * spec.shards).contiguous()
            g = ops.wait_tensor(ops.reduce_scatter_tensor(g, "avg", spec.shards, spec.shard_group))
        if spec.replicate_group:
            g = ops.wait_tensor(ops.all_reduce(g.contiguous(), "avg", spec.replicate_group))
        if g.shape[0] != ctx.local_rows:
            g = g[:ctx.local_rows]
        return g.to(ctx.local_dtype), None


# ------------------------------------------------------------------ gathering on attribute reads

@dataclasses.dataclass
class _GatherState:
    #: gathered parameters of the current root forward: id(stored tensor) -> (stored, full)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    depth: int = 0
    enabled: bool = True


_STATE = _GatherState()


@contextlib.contextmanager
def sharded_parameters() -> Iterator[None]:
    """Parameter attributes read as the stored (sharded) tensors in the body: no collective."""
    previous, _STATE.enabled = _STATE.enabled, False
    try:
        yield
    finally:
        _STATE.enabled = previous


def gather_parameter(stored: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full parameter from what a parameter slot holds: the DTensor (eager) or, under capture,
    its local shard."""
    cache = _STATE.cache
    if cache is not None and id(stored) in cache:
        return cache[id(stored)][1]
    local = stored.to_local() if isinstance(stored, DTensor) else stored
    full = _GatherShard.apply(local, spec)
    if cache is not None:
        cache[id(stored)] = (stored, full)
    return full


def _root_pre_hook(module, args) -> None:
    _STATE.depth += 1
    if _STATE.depth == 1:
        _STATE.cache = {}


def _root_post_hook(module, args, output) -> None:
    _STATE.depth -= 1
    if _STATE.depth == 0:
        _STATE.cache = None


def _gathering_property(name: str) -> property:
    def get(self):
        stored = self._parameters[name]
        if stored is None or not _STATE.enabled:
            return stored
        return gather_parameter(stored, self._shard_specs[name])

    return property(get)


def is_simple_fsdp(model: nn.Module) -> bool:
    return any(hasattr(m, "_shard_specs") for m in model.modules())


def simple_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Shard every parameter of ``model`` over the data-parallel ``mesh`` (1-D: Shard(0); 2-D
    (dp_replicate, dp_shard): HSDP) and make its reads gather it; in place. ``param_dtype``: the
    dtype parameters are gathered (and computed) in, None = their own; gradients are reduced in
    ``reduce_dtype``. Parameters must be plain tensors (no TP/EP DTensors)."""
    _functional_ops()
    if mesh.ndim == 1:
        placements, shard_mesh, replicate_mesh = (Shard(0),), mesh, None
    elif mesh.ndim == 2:
        placements, shard_mesh, replicate_mesh = (Replicate(), Shard(0)), mesh[mesh.mesh_dim_names[1]], \
            mesh[mesh.mesh_dim_names[0]]
    else:
        raise ConfigError(f"parallel: traceable FSDP shards over a 1-D or 2-D (HSDP) mesh, got {mesh.ndim} dims")
    if param_dtype is not None and all(p.dtype == param_dtype for p in model.parameters()):
        param_dtype = None  # no cast to record
    shard_group = shard_mesh.get_group().group_name
    replicate_group = replicate_mesh.get_group().group_name if replicate_mesh is not None else ""
    sharded: dict[int, nn.Parameter] = {}  # tied parameters stay one parameter
    for module_name, module in list(model.named_modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        specs = {}
        for name in names:
            param = module._parameters[name]
            if isinstance(param, DTensor):
                raise ConfigError(f"parallel: traceable FSDP takes plain parameters; "
                                  f"{module_name}.{name} is already a DTensor (tp/ep are not supported with it)")
            if param.dim() == 0:
                raise ConfigError(f"parallel: traceable FSDP shards dim 0; {module_name}.{name} is a scalar")
            if id(param) not in sharded:
                dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
                sharded[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
            module._parameters[name] = sharded[id(param)]
            specs[name] = ShardSpec(rows=param.shape[0], shards=shard_mesh.size(), shard_group=shard_group,
                                    replicate_group=replicate_group, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype)
        module._shard_specs = specs
        swap_in_properties(module, names, _gathering_property, "SimpleFSDP")
    model.register_forward_pre_hook(_root_pre_hook)
    model.register_forward_hook(_root_post_hook, always_call=True)
    return model
